"""Every user mistake ends in `UserError`: through the Python API it raises, through the CLI it is
one line on stderr, exit status 2, no traceback, and nothing on stdout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from blockpilot.cli import main
from blockpilot.errors import UserError
from blockpilot.runtime.runner import Runner

from cli_fixtures import make_chat_target
from fixtures import make_drafter, make_hf_target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target with a tokenizer (4 layers, hidden 32, vocab 258, 256 positions) and a drafter
    for it (block size 8, so block sizes 1..16 are supported), plus a drafter of hidden size 48."""
    tmp = tmp_path_factory.mktemp("bad-input")
    target = make_chat_target(tmp)
    drafter = make_drafter(tmp, target, block_size=8)
    wide_target = make_hf_target(tmp, "llama", seed=3, vocab_size=258, hidden_size=48)
    wide_drafter = make_drafter(tmp, wide_target, name="wide-drafter")
    return {"target": target, "drafter": drafter, "wide_drafter": wide_drafter, "tmp": tmp}


def run_cli(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, err
    assert out == "", "nothing may be written before the error"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockpilot generate: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def copy_with(src: Path, dst: Path, edit=None) -> Path:
    """Copy the model dir `src` to `dst`, then apply `edit(dst)`."""
    shutil.copytree(src, dst)
    if edit is not None:
        edit(dst)
    return dst


def edit_config(**changes):
    def edit(folder: Path):
        config = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            if key in ("mask_token_id", "target_layer_ids"):
                config["dflash_config"][key] = value
            elif value is None:
                del config[key]
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def write_file(name: str, content: bytes | str):
    def edit(folder: Path):
        path = folder / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return edit


def truncate_weights(folder: Path):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete(name: str):
    return lambda folder: (folder / name).unlink()


# ------------------------------------------------------------------ prompts and generation limits

GENERATE_MISTAKES = {
    # id: (generate kwargs for the API or None for a text-level mistake, CLI args, words the message
    # must contain)
    "empty-prompt": (dict(ids=[]), ["--prompt", ""], "empty"),
    "whitespace-prompt": (None, ["--prompt", "  \n\t "], "empty"),
    "beyond-cache-capacity": (dict(max_new_tokens=1000), ["--max-new-tokens", 1000], "cache capacity"),
    "zero-max-new-tokens": (dict(max_new_tokens=0), ["--max-new-tokens", 0], "max_new_tokens"),
    "block-size-zero": (dict(block_size=0), ["--block-size", 0], "block size 0"),
    "block-size-negative": (dict(block_size=-3), ["--block-size", -3], "block size -3"),
    "block-size-beyond-drafter": (dict(block_size=17), ["--block-size", 17], "block size 17"),
    "block-size-not-a-number": (None, ["--block-size", "eight"], "'eight'"),
    "auto-without-predictor": (dict(block_size="auto"), ["--block-size", "auto"], "predictor"),
    "negative-temperature": (dict(temperature=-1.0), ["--temperature", -1], "temperature"),
    "nan-temperature": (dict(temperature=float("nan")), ["--temperature", "nan"], "finite"),
    "infinite-temperature": (dict(temperature=float("inf")), ["--temperature", "inf"], "finite"),
    "top-p-zero": (dict(top_p=0.0), ["--top-p", 0], "top_p"),
    "negative-top-k": (dict(top_k=-2), ["--top-k", -2], "top_k"),
}


@pytest.mark.parametrize("case", sorted(c for c, (api, _, _) in GENERATE_MISTAKES.items() if api is not None))
def test_generate_mistake_raises_user_error_through_the_api(models, case):
    api, _, needle = GENERATE_MISTAKES[case]
    runner = Runner.from_dir(models["target"], drafter_dir=models["drafter"])
    kwargs = dict(max_new_tokens=8, block_size=4)
    kwargs.update(api)
    ids = kwargs.pop("ids", [256, 104, 105])
    with pytest.raises(UserError) as caught:
        # a lazy failure (after prefill) must surface on the first step, before any output
        next(iter(runner.generate([torch.tensor(ids, dtype=torch.long)], streaming=True, **kwargs)))
    assert needle in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("batch, kwargs, needle", [
    ([torch.tensor([104.0, 105.0])], {}, "holds torch.float32 values; pass token ids as integers"),
    ([torch.tensor([True, False])], {}, "holds torch.bool values"),
    ([torch.tensor([[104, 105], [106, 107]])], {}, "has shape (2, 2); pass each prompt as a 1-D tensor"),
    (torch.tensor([[104, 105]]), {}, "batch_input_ids is one tensor of shape (1, 2); pass a list"),
    ([torch.tensor([104, 105])], dict(random_seed="7", temperature=1.0), "random_seed must be an integer"),
])
def test_prompts_and_seeds_of_the_wrong_kind_raise_user_error_through_the_api(models, batch, kwargs, needle):
    runner = Runner.from_dir(models["target"], drafter_dir=models["drafter"])
    with pytest.raises(UserError) as caught:
        runner.generate(batch, max_new_tokens=4, block_size=4, **kwargs)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_a_one_row_prompt_tensor_is_one_prompt(models):
    runner = Runner.from_dir(models["target"], drafter_dir=models["drafter"])
    flat = runner.generate([torch.tensor([104, 105, 106])], max_new_tokens=4, block_size=4)
    row = runner.generate([torch.tensor([[104, 105, 106]])], max_new_tokens=4, block_size=4)
    assert torch.equal(flat, row)


@pytest.mark.parametrize("case", sorted(GENERATE_MISTAKES))
def test_generate_mistake_is_one_line_and_exit_2_through_the_cli(models, case, capsys):
    _, cli, needle = GENERATE_MISTAKES[case]
    argv = ["generate", "--target", models["target"], "--drafter", models["drafter"], "--prompt", "hi",
            "--max-new-tokens", 8, *cli]
    assert_one_line_error(*run_cli(argv, capsys), needle)


def test_block_size_above_one_without_a_drafter_is_refused(models, capsys):
    runner = Runner.from_dir(models["target"])
    with pytest.raises(UserError, match="needs a drafter"):
        runner.generate([torch.tensor([1, 2, 3])], max_new_tokens=4, block_size=4)
    argv = ["generate", "--target", models["target"], "--prompt", "hi", "--block-size", 4]
    assert_one_line_error(*run_cli(argv, capsys), "needs a drafter")


# ------------------------------------------------------------------ drafter does not fit the target

MISFITS = {
    "num-target-layers": (edit_config(num_target_layers=6), "num_target_layers 6"),
    "vocab": (edit_config(vocab_size=259), "vocab size 259"),
    "tap-id-out-of-range": (edit_config(target_layer_ids=[1, 4]), "target_layer_ids [4]"),
    "negative-tap-id": (edit_config(target_layer_ids=[-1, 2]), "target_layer_ids [-1]"),
    "mask-token-out-of-range": (edit_config(mask_token_id=258), "mask_token_id 258"),
    "negative-mask-token": (edit_config(mask_token_id=-1), "mask_token_id -1"),
}


@pytest.fixture(scope="module")
def misfit_drafters(models):
    out = {name: copy_with(models["drafter"], models["tmp"] / f"misfit-{name}", edit)
           for name, (edit, _) in MISFITS.items()}
    out["hidden-size"] = models["wide_drafter"]
    return out


MISFIT_NEEDLES = {**{name: needle for name, (_, needle) in MISFITS.items()}, "hidden-size": "hidden size 48"}


@pytest.mark.parametrize("case", sorted(MISFIT_NEEDLES))
def test_drafter_that_does_not_fit_the_target_is_refused(models, misfit_drafters, case, capsys):
    needle = MISFIT_NEEDLES[case]
    with pytest.raises(UserError, match="does not fit the target") as caught:
        Runner.from_dir(models["target"], drafter_dir=misfit_drafters[case])
    assert needle in str(caught.value)
    argv = ["generate", "--target", models["target"], "--drafter", misfit_drafters[case], "--prompt", "hi"]
    assert_one_line_error(*run_cli(argv, capsys), "does not fit the target", needle)


# ------------------------------------------------------------------ missing or corrupt files

BROKEN_FILES = {
    # id: (which model, edit of a copy, words the message must contain)
    "target-dir-missing": ("target", None, "no such model directory"),
    "target-config-missing": ("target", delete("config.json"), "config.json is missing"),
    "target-config-invalid-json": ("target", write_file("config.json", '{"model_type": "llama",'), "not valid JSON"),
    "target-config-not-an-object": ("target", write_file("config.json", "[1, 2]"), "JSON object"),
    "target-config-missing-field": ("target", edit_config(hidden_size=None), "hidden_size"),
    "target-config-bad-field": ("target", edit_config(num_hidden_layers="four"), "malformed field"),
    "target-config-unsupported-family": ("target", edit_config(model_type="gpt2"), "gpt2"),
    "target-weights-missing": ("target", delete("model.safetensors"), "no *.safetensors"),
    "target-weights-garbage": ("target", write_file("model.safetensors", b"not a safetensors file" * 4),
                               "corrupt"),
    "target-weights-truncated": ("target", truncate_weights, "corrupt"),
    "target-weights-other-shape": ("target", edit_config(intermediate_size=48), "do not belong together"),
    "target-generation-config-invalid": ("target", write_file("generation_config.json", "{eos"),
                                         "generation_config.json"),
    "drafter-dir-missing": ("drafter", None, "no such model directory"),
    "drafter-config-missing": ("drafter", delete("config.json"), "config.json is missing"),
    "drafter-config-invalid-json": ("drafter", write_file("config.json", "{"), "not valid JSON"),
    "drafter-config-not-dflash": ("drafter", edit_config(dflash_config=None), "not a DFlash"),
    "drafter-config-bad-dflash-field": ("drafter", edit_config(target_layer_ids="1,2"), "malformed field"),
    "drafter-weights-garbage": ("drafter", write_file("model.safetensors", b"\x00" * 64), "corrupt"),
    "drafter-weights-truncated": ("drafter", truncate_weights, "corrupt"),
}


@pytest.fixture(scope="module")
def broken_dirs(models):
    out = {}
    for name, (which, edit, _) in BROKEN_FILES.items():
        dst = models["tmp"] / f"broken-{name}"
        out[name] = dst if edit is None else copy_with(models[which], dst, edit)
    return out


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_missing_or_corrupt_model_files_are_user_errors(models, broken_dirs, case, capsys):
    which, _, needle = BROKEN_FILES[case]
    target = broken_dirs[case] if which == "target" else models["target"]
    drafter = broken_dirs[case] if which == "drafter" else models["drafter"]
    with pytest.raises(UserError) as caught:
        Runner.from_dir(target, drafter_dir=drafter)
    assert needle in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    argv = ["generate", "--target", target, "--drafter", drafter, "--prompt", "hi"]
    assert_one_line_error(*run_cli(argv, capsys), needle)


@pytest.mark.parametrize("case,edit,needle", [
    ("no-tokenizer", lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
     "no tokenizer files"),
    ("corrupt-tokenizer", write_file("tokenizer.json", "{"), "cannot load the tokenizer"),
])
def test_target_without_a_usable_tokenizer_is_refused_by_the_cli(models, case, edit, needle, capsys):
    target = copy_with(models["target"], models["tmp"] / f"tokenizer-{case}", edit)
    argv = ["generate", "--target", target, "--drafter", models["drafter"], "--prompt", "hi"]
    assert_one_line_error(*run_cli(argv, capsys), needle)


# ------------------------------------------------------------------ prompt files

@pytest.mark.parametrize("case,content,needle", [
    ("missing", None, "cannot read prompts file"),
    ("empty-txt", "\n  \n", "has no prompts"),
    ("not-utf8-txt", b"\xff\xfe\xfa prompt\n", "cannot read prompts file"),
    ("empty-jsonl", "", "has no prompts"),
    ("invalid-jsonl-line", '{"prompt": "ok"}\n{"prompt": \n', ":2"),
    ("jsonl-without-prompt", '{"text": "hello"}\n', "prompt"),
    ("jsonl-whitespace-prompt", '{"prompt": "   "}\n', "empty"),
])
def test_unusable_prompts_file_is_refused(models, tmp_path, case, content, needle, capsys):
    path = tmp_path / f"prompts.{'jsonl' if 'jsonl' in case else 'txt'}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    argv = ["generate", "--target", models["target"], "--drafter", models["drafter"], "--prompts-file", path]
    assert_one_line_error(*run_cli(argv, capsys), needle)


def test_a_too_long_later_prompt_fails_before_any_text_is_written(models, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("a short prompt\n" + "x" * 300 + "\n")  # 300 byte tokens > 256 positions
    argv = ["generate", "--target", models["target"], "--drafter", models["drafter"], "--prompts-file", path,
            "--max-new-tokens", 8]
    assert_one_line_error(*run_cli(argv, capsys), "cache capacity")
