"""A tiny target with a real tokenizer, for tests that go through `blockpilot generate`.

The tokenizer is byte-level (one token per UTF-8 byte, ids 0..255) plus two ChatML specials,
`<|im_start|>` (256) and `<|im_end|>` (257, the end-of-sequence token), with a ChatML chat
template. A character such as "é" or "€" spans several tokens, which is what streaming decode
must handle.
"""

from __future__ import annotations

from pathlib import Path

from fixtures import make_hf_target

IM_START, IM_END = 256, 257
BYTE_VOCAB = 258
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(chat_template: str | None = CHATML_TEMPLATE):
    """A `PreTrainedTokenizerFast` mapping each UTF-8 byte to its own id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _gpt2_byte_chars().items()}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab.update({"<|im_start|>": IM_START, "<|im_end|>": IM_END})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenization emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def make_chat_target(tmp: Path, seed: int = 0, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """A tiny random Llama target (vocab 258) with the byte tokenizer saved beside it."""
    target = make_hf_target(tmp, "llama", seed=seed, vocab_size=BYTE_VOCAB, bos_token_id=IM_START,
                            eos_token_id=IM_END, pad_token_id=IM_END)
    byte_tokenizer(chat_template).save_pretrained(target)
    return target
