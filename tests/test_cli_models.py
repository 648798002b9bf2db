"""Where the commands' models come from: `generate` and `demo` on model dirs and on engine dirs
(with the engine's own drafter and predictor), and `build`'s defaults derived from the drafter."""

from __future__ import annotations

import pytest
import torch

from blockpilot.cli import build_parser, main
from blockpilot.commands.build import resolve_spec
from blockpilot.errors import UserError
from blockpilot.runtime.runner import Runner
from blockpilot.text import chat_prompt_ids, load_tokenizer

from builder_fixtures import TINY_BLOCK_SIZES, TINY_DRAFTER_BLOCK_SIZE, tiny_engine_dir, tiny_models
from cli_fixtures import make_chat_target
from fixtures import make_drafter

PROMPT = "hello there"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine_dir(tmp_path_factory)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def engine_text(engine, backend: str | None, max_new_tokens: int) -> tuple[str, int]:
    """The engine runner's own greedy text for PROMPT, and its default block size."""
    tokenizer = load_tokenizer(engine)
    runner = Runner.from_dir(engine, backend=backend)
    ids = chat_prompt_ids(tokenizer, PROMPT, False)
    out = runner.generate([torch.tensor(ids)], max_new_tokens=max_new_tokens, end_id=tokenizer.eos_token_id,
                          return_dict=True)
    length = int(out["sequence_lengths"][0, 0])
    return tokenizer.decode(out["output_ids"][0, 0, len(ids):length].tolist(), skip_special_tokens=True), \
        runner.default_block_size


@pytest.mark.parametrize("backend", [None, "torch"])
def test_generate_runs_an_engine_dir_with_its_own_drafter(engine, backend, capsys):
    expected, block = engine_text(engine, backend, 8)
    assert block in TINY_BLOCK_SIZES and block > 1
    argv = ["generate", "--engine-dir", engine, "--prompt", PROMPT, "--no-chat-template", "--max-new-tokens", 8,
            *(["--backend", backend] if backend else [])]
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and out == expected + "\n"
    assert "autoregressively" not in err and f"block size {block}," in err, err
    assert len(err.strip().splitlines()) == 1


def test_an_engine_dir_passed_as_target_counts_as_engine_dir(engine, capsys):
    expected, block = engine_text(engine, None, 8)
    code, out, err = run_cli(["generate", "--target", engine, "--prompt", PROMPT, "--no-chat-template",
                              "--max-new-tokens", 8], capsys)
    assert code == 0 and out == expected + "\n" and "autoregressively" not in err


@pytest.mark.parametrize("extra, needle", [
    (["--drafter", "{drafter}"], "holds its own target and drafter; drop --target/--drafter"),
    (["--dtype", "bf16"], "was built in fp32"),
    (["--block-size", "4"], "block size 4"),  # built: 3 and 5 only
])
def test_generate_refuses_what_an_engine_dir_cannot_do_in_one_line(engine, tmp_path_factory, extra, needle, capsys):
    _, drafter = tiny_models(tmp_path_factory, "llama")
    extra = [str(drafter) if a == "{drafter}" else a for a in extra]
    code, out, err = run_cli(["generate", "--engine-dir", engine, "--prompt", PROMPT, "--no-chat-template",
                              "--max-new-tokens", 4, *extra], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("flag", ["--target", "--drafter", "--engine-dir", "--predictor"])
def test_a_missing_model_path_is_refused_naming_its_flag(flag, tmp_path, capsys):
    missing = tmp_path / "nope"
    code, out, err = run_cli(["generate", flag, missing, "--prompt", "hi"], capsys)
    assert code == 2 and out == ""
    assert err.strip() == f"blockpilot generate: error: {flag} {missing}: no such " + \
        ("file" if flag == "--predictor" else "model directory")


def test_model_dirs_refuse_a_backend_that_needs_an_engine_dir(tmp_path_factory, capsys):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    code, _, err = run_cli(["generate", "--target", target, "--drafter", drafter, "--prompt", "hi",
                            "--backend", "onnxruntime"], capsys)
    assert code == 2 and "--backend onnxruntime runs an engine directory" in err


def test_demo_takes_the_model_options_and_reports_speculative_rows(tmp_path, capsys):
    target = make_chat_target(tmp_path)
    drafter = make_drafter(tmp_path, target, block_size=4)
    code, out, err = run_cli(["demo", "--target", target, "--drafter", drafter, "--max-new-tokens", 6,
                              "--device", "cpu", "--dtype", "float32"], capsys)
    assert code == 0, err
    rows = out.strip().splitlines()[2:]
    assert len(rows) == 4 and all(row.split()[-1] == "4" for row in rows)  # block size: B_train


@pytest.mark.parametrize("extra, needle", [(["--max-new-tokens", 0], "max_new_tokens must be >= 1"),
                                           (["--max-new-tokens", 100000], "exceeds the cache capacity"),
                                           (["--block-size", 99], "block size 99")])
def test_demo_mistakes_are_one_line_before_any_table_row(tmp_path, extra, needle, capsys):
    target = make_chat_target(tmp_path)
    drafter = make_drafter(tmp_path, target, block_size=4)
    code, out, err = run_cli(["demo", "--target", target, "--drafter", drafter, "--device", "cpu", *extra], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and needle in lines[0], (out, err)


# ---------------------------------------------------------------- build


def build_args(*argv):
    return build_parser().parse_args(["build", *map(str, argv)])


def test_build_defaults_to_b_train_plus_minus_two_and_the_targets_positions(tmp_path_factory, tmp_path):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    spec = resolve_spec(build_args("--target", target, "--drafter", drafter, "--out", tmp_path / "e"))
    b = TINY_DRAFTER_BLOCK_SIZE
    assert spec.block_sizes == tuple(range(max(2, b - 2), b + 3)) and spec.dtype == "fp32"
    assert spec.max_seq_len == 256  # the tiny target's max_position_embeddings, below the default 1024
    spec = resolve_spec(build_args("--target", target, "--drafter", drafter, "--out", tmp_path / "e",
                                   "--block-sizes", "3,5-6", "--max-seq-len", 64, "--dtype", "float16"))
    assert (spec.block_sizes, spec.max_seq_len, spec.dtype) == ((3, 5, 6), 64, "fp16")


def test_build_with_a_target_of_ones_own_needs_its_drafter(tmp_path_factory, tmp_path):
    target, _ = tiny_models(tmp_path_factory, "llama")
    with pytest.raises(UserError, match="needs --drafter"):
        resolve_spec(build_args("--target", target, "--out", tmp_path / "e"))


@pytest.mark.slow
def test_build_without_models_builds_the_embedded_default_with_its_predictors_sizes(tmp_path):
    from blockpilot.assets import default_drafter_dir, default_predictor_path
    from blockpilot.assets.smollm2 import smollm2_dir
    from blockpilot.runtime.policy import OnnxBlockSizePolicy

    spec = resolve_spec(build_args("--out", tmp_path / "e"))
    assert (spec.target_dir, spec.drafter_dir, spec.predictor) == \
        (smollm2_dir(), default_drafter_dir(), default_predictor_path())
    candidates = OnnxBlockSizePolicy(default_predictor_path()).candidates
    assert spec.block_sizes == tuple(k for k in candidates if k > 1)  # 1 (plain decoding) needs no graph
    assert spec.max_seq_len == 1024


@pytest.mark.slow
def test_build_with_block_sizes_the_shipped_predictor_lacks_says_how_and_builds_without_it_when_asked(tmp_path):
    from blockpilot.assets.smollm2 import smollm2_dir

    with pytest.raises(UserError, match=r"--block-sizes 2,3,4 lacks 6,.*add --no-predictor"):
        resolve_spec(build_args("--out", tmp_path / "e", "--block-sizes", "2-4"))
    spec = resolve_spec(build_args("--out", tmp_path / "e", "--block-sizes", "2-4", "--no-predictor"))
    assert (spec.target_dir, spec.predictor, spec.block_sizes) == (smollm2_dir(), None, (2, 3, 4))
    with pytest.raises(UserError, match="contradict"):
        resolve_spec(build_args("--out", tmp_path / "e", "--predictor", __file__, "--no-predictor"))
