"""`blockpilot generate`: streams the runner's text, applies the chat template, passes sampling
parameters through, and reports tau and tokens/s per prompt."""

from __future__ import annotations

import json

import pytest
import torch

from blockpilot.cli import main
from blockpilot.commands.generate import TextStream
from blockpilot.text import chat_prompt_ids as encode_prompt
from blockpilot.runtime.runner import Runner

from cli_fixtures import IM_END, byte_tokenizer, make_chat_target
from fixtures import make_drafter

PROMPT = "Säg hej, 😀!"  # multi-byte characters: several byte tokens each


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    target = make_chat_target(tmp)
    return target, make_drafter(tmp, target, block_size=8)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def run_cli(argv, capsys) -> tuple[str, str]:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def runner_text(models, tokenizer, ids, **kwargs) -> str:
    """What the runner itself generates for `ids`, decoded."""
    runner = Runner.from_dir(models[0], drafter_dir=models[1])
    out = runner.generate([torch.tensor(ids)], end_id=IM_END, return_dict=True, **kwargs)
    length = int(out["sequence_lengths"][0, 0])
    return tokenizer.decode(out["output_ids"][0, 0, len(ids):length].tolist(), skip_special_tokens=True)


def test_text_stream_holds_back_a_character_until_its_last_byte_token(tokenizer):
    text = "héllo € 😀 ok"
    tokens = tokenizer(text)["input_ids"]
    assert len(tokens) > len(text)  # some characters span several tokens
    stream = TextStream(tokenizer)
    pieces = [stream.update(tokens[: i + 1]) for i in range(len(tokens))]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[tokens.index(0xC3)] == ""  # first byte of "é" alone writes nothing


def test_text_stream_writes_an_unfinished_character_only_at_the_end(tokenizer):
    tokens = tokenizer("a€")["input_ids"][:-1]  # "a" + 2 of the 3 bytes of "€"
    stream = TextStream(tokenizer)
    assert stream.update(tokens) == "a"
    assert stream.update(tokens, final=True) == "\ufffd"


def test_chat_template_is_applied_unless_disabled(tokenizer):
    chat = encode_prompt(tokenizer, "hi")
    assert chat == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                 tokenize=True)["input_ids"]
    assert encode_prompt(tokenizer, "hi", use_chat_template=False) == [ord("h"), ord("i")]


def test_cli_streams_the_runners_greedy_text_for_every_block_size(models, tokenizer, capsys):
    ids = encode_prompt(tokenizer, PROMPT)
    expected = runner_text(models, tokenizer, ids, max_new_tokens=40, block_size=1)
    assert expected.strip()
    base = ["generate", "--target", models[0], "--drafter", models[1], "--prompt", PROMPT, "--max-new-tokens", 40]
    for block_size in (1, 4, 8):
        out, err = run_cli([*base, "--block-size", block_size], capsys)
        assert out == expected + "\n", f"block size {block_size}"
        stats = err.strip().splitlines()
        assert len(stats) == 1 and stats[0].startswith("[1/1] ")
        assert f"block size {block_size}," in stats[0] and "tau " in stats[0] and "tok/s" in stats[0]
    out, err = run_cli(base, capsys)  # default block size: the drafter's training size
    assert out == expected + "\n" and "block size 8," in err


def test_no_chat_template_feeds_the_plain_prompt(models, tokenizer, capsys):
    expected = runner_text(models, tokenizer, encode_prompt(tokenizer, PROMPT, use_chat_template=False), max_new_tokens=20,
                           block_size=4)
    out, _ = run_cli(["generate", "--target", models[0], "--drafter", models[1], "--prompt", PROMPT,
                      "--max-new-tokens", 20, "--block-size", 4, "--no-chat-template"], capsys)
    assert out == expected + "\n"


def test_sampling_parameters_reach_the_runner(models, tokenizer, capsys):
    ids = encode_prompt(tokenizer, PROMPT)
    base = ["generate", "--target", models[0], "--drafter", models[1], "--prompt", PROMPT, "--max-new-tokens", 30,
            "--block-size", 4]
    sampled = runner_text(models, tokenizer, ids, max_new_tokens=30, block_size=4, temperature=1.0, top_p=0.9,
                          random_seed=7)
    assert run_cli([*base, "--temperature", 1, "--top-p", 0.9, "--seed", 7], capsys)[0] == sampled + "\n"
    greedy = runner_text(models, tokenizer, ids, max_new_tokens=30, block_size=4)
    assert sampled != greedy  # so the comparison above could tell sampling from greedy
    top1, _ = run_cli([*base, "--temperature", 1, "--top-k", 1, "--seed", 7], capsys)
    assert top1 == greedy + "\n"  # top-k 1 is greedy whatever the seed


def test_prompts_files_give_one_answer_and_one_stats_line_per_prompt(models, tokenizer, tmp_path, capsys):
    prompts = ["first prompt", "zweiter Prompt ü"]
    expected = "".join(runner_text(models, tokenizer, encode_prompt(tokenizer, p), max_new_tokens=12,
                                   block_size=4) + "\n" for p in prompts)
    txt = tmp_path / "prompts.txt"
    txt.write_text(f"{prompts[0]}\n\n{prompts[1]}\n")  # blank lines are skipped
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": str(i)}) + "\n" for i, p in enumerate(prompts)))
    for path in (txt, jsonl):
        out, err = run_cli(["generate", "--target", models[0], "--drafter", models[1], "--prompts-file", path,
                            "--max-new-tokens", 12, "--block-size", 4], capsys)
        assert out == expected
        assert [line[:5] for line in err.strip().splitlines()] == ["[1/2]", "[2/2]"]


def test_without_a_drafter_it_decodes_autoregressively_and_says_so(models, tokenizer, capsys):
    expected = runner_text(models, tokenizer, encode_prompt(tokenizer, PROMPT), max_new_tokens=16, block_size=1)
    out, err = run_cli(["generate", "--target", models[0], "--prompt", PROMPT, "--max-new-tokens", 16], capsys)
    assert out == expected + "\n"
    note, stats = err.strip().splitlines()
    assert note.startswith("note: ") and "autoregressively" in note
    assert "block size 1," in stats and "tau 1.00" in stats


@pytest.mark.slow
def test_default_target_is_the_embedded_smollm2_and_matches_transformers(capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockpilot.assets.smollm2 import smollm2_dir

    folder = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = encode_prompt(tok, "What is 2 + 3?")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id)
    expected = tok.decode(ref[0, len(ids):], skip_special_tokens=True)
    out, err = run_cli(["generate", "--prompt", "What is 2 + 3?", "--max-new-tokens", 8], capsys)
    assert out == expected + "\n"
    assert "tok/s" in err.strip().splitlines()[-1]
