"""`scripts/check_trt.py`: its --dry-run does everything up to TensorRT on a CPU machine, and its checks fail
when outputs or tokens differ."""

import importlib.util
import json
import sys

import numpy as np
import pytest

from builder_fixtures import TINY_BLOCK_SIZES, TINY_MAX_SEQ_LEN, tiny_models
from fixtures import load_script


@pytest.fixture(scope="module")
def check_trt():
    yield load_script("check_trt")
    sys.modules.pop("check_trt", None)


def test_dry_run_builds_compares_every_profile_and_checks_greedy_equality(check_trt, tmp_path_factory, tmp_path):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    report_path = tmp_path / "report.json"
    code = check_trt.main(["--target", str(target), "--drafter", str(drafter), "--out", str(tmp_path / "engine"),
                           "--block-sizes", ",".join(map(str, TINY_BLOCK_SIZES)), "--max-seq-len",
                           str(TINY_MAX_SEQ_LEN), "--dtype", "fp32", "--max-new-tokens", "8", "--dry-run",
                           "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0 and report["ok"] and report["dry_run"], report["failures"]
    assert not (tmp_path / "engine" / "target.engine").exists()
    profiles = [(r["graph"], r["name"]) for r in report["profiles"]]
    sizes = [f"block_{k}" for k in TINY_BLOCK_SIZES]
    assert profiles == [("target", n) for n in ("prefill", "block_1", *sizes)] + [("drafter", n) for n in sizes]
    assert all(r["matches"] and r["trt_ms_opt"] is None for r in report["profiles"])
    assert report["profiles"][0]["shapes"]["max"]["input_ids"] == [1, TINY_MAX_SEQ_LEN]
    rows = [(r["backend"], r["block_size"], r["equals_plain"]) for r in report["generation"]]
    assert rows == [("onnxruntime", k, True) for k in (1, *TINY_BLOCK_SIZES)]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_without_tensorrt_the_full_check_is_a_one_line_user_error(check_trt, capsys):
    assert check_trt.main(["--out", "unused"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "use --dry-run" in err


def test_target_without_drafter_is_a_user_error(check_trt, capsys, tmp_path):
    assert check_trt.main(["--target", str(tmp_path), "--dry-run"]) == 2
    assert "pass both --target and --drafter" in capsys.readouterr().err


def test_output_comparison_flags_values_beyond_tolerance_and_differing_ids(check_trt):
    reference = {"logits": np.array([[1.0, 2.0]], np.float32), "draft_ids": np.array([[3, 4]], np.int64)}
    close = {"logits": np.array([[1.0005, 2.0]], np.float32), "draft_ids": np.array([[3, 4]], np.float32)}
    assert check_trt.compare_outputs(reference, close, 1e-3, exact_ids=True)[1] == []
    far = {"logits": np.array([[1.5, 2.0]], np.float32), "draft_ids": np.array([[3, 5]], np.float32)}
    diffs, problems = check_trt.compare_outputs(reference, far, 1e-3, exact_ids=True)
    assert diffs == {"logits": 0.5, "draft_ids": 1} and len(problems) == 2
    assert check_trt.compare_outputs(reference, far, 1.0, exact_ids=False)[1] == []


def test_first_difference_finds_the_first_differing_token(check_trt):
    assert check_trt.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert check_trt.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert check_trt.first_difference([1, 2], [1, 2, 3]) == 2
