"""Tiny fixture models built in the test process: random HF targets and matching drafters; the
repository's scripts/ loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from blockpilot.models.checkpoint import save_drafter
from blockpilot.models.config import DecoderConfig, DrafterConfig, default_target_layer_ids
from blockpilot.models.dflash import DFlashDrafter

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """Import `scripts/<name>.py` as module `name` (registered in sys.modules while it executes, as
    dataclasses need)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
"""Devices the device-generic tests run on: CUDA too where a GPU is present."""

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def hf_tiny_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kwargs = dict(TINY, **overrides)
    if family == "llama":
        kwargs.setdefault("tie_word_embeddings", False)
    return cls(**kwargs)


def make_hf_target(tmp: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random transformers model of `family` to `tmp/target-{family}` and return the dir."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_tiny_config(family, **overrides))
    with torch.no_grad():  # larger logits spread so greedy choices are not near-ties
        model.lm_head.weight.mul_(8.0)
    out = tmp / f"target-{family}-{seed}"
    model.save_pretrained(out)
    return out


def make_drafter(tmp: Path, target_dir: Path, block_size: int = 8, layers: int = 1, seed: int = 1,
                 mask_token_id: int = 3, name: str = "drafter") -> Path:
    """A random drafter whose shape fits the target saved at `target_dir`."""
    import json

    target = DecoderConfig.from_dict(json.loads((target_dir / "config.json").read_text()))
    config = DrafterConfig(
        layers=DecoderConfig(**{**target.__dict__, "family": "qwen3", "qk_norm": True,
                                "num_hidden_layers": layers, "tie_word_embeddings": False,
                                "attention_bias": False}),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=default_target_layer_ids(target.num_hidden_layers, 2),
        num_target_layers=target.num_hidden_layers,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    return save_drafter(drafter, tmp / name)


def target_continuation_backend():
    """A TorchBackend subclass whose drafts are the target's own greedy continuation (computed on a
    scratch copy of the cache), so at T = 0 every draft is accepted."""
    from blockpilot.models.decoder import KVCache
    from blockpilot.runtime.backend import TorchBackend

    class TargetContinuationBackend(TorchBackend):
        def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size):
            t = self.target
            scratch = KVCache([k.clone() for k in state.target_cache.k], [v.clone() for v in state.target_cache.v])
            tokens, token = [], last_tokens
            with torch.inference_mode():
                for i in range(block_size - 1):
                    out = t(t.embed_tokens(token[:, None]), torch.tensor([block_start + i]), scratch,
                            block_start + i + 1)
                    token = t.lm_head(out.hidden[:, -1]).argmax(-1)
                    tokens.append(token)
            return torch.stack(tokens, dim=1)  # (B, block_size - 1)

    return TargetContinuationBackend


WORDS = [f"w{i}" for i in range(90)]


def make_word_corpus(tmp: Path) -> tuple[Path, Path]:
    """A tiny target with a word-level tokenizer over WORDS, and a JSONL of 24 'answers' that repeat a
    learnable pattern (for training drafters that get some drafts accepted). Returns (target, answers)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target_dir = make_hf_target(tmp, "llama")
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(target_dir)
    rows = [{"prompt": " ".join(WORDS[i:i + 5]), "answer": " ".join(WORDS[(i + 3 * j) % 40] for j in range(40)),
             "finish": "stop"} for i in range(24)]
    answers = tmp / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target_dir, answers


class CountingBackend:
    """Records the number of rows of every draft and verify call of the backend it wraps."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, int, int]] = []  # (kind, rows, block size)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size, new_counts=None, **kwargs):
        self.calls.append(("draft", last_tokens.shape[0], block_size))
        return self.inner.draft(state, last_tokens, new_taps, ctx_start, block_start, block_size, new_counts, **kwargs)

    def count(self, kind: str) -> int:
        """Calls of `kind` ("draft" or "verify") recorded so far."""
        return sum(call[0] == kind for call in self.calls)

    def verify(self, state, block_ids, start):
        self.calls.append(("verify", block_ids.shape[0], block_ids.shape[1]))
        return self.inner.verify(state, block_ids, start)
