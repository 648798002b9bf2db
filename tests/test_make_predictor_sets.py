"""`SETS_ONLY=1 scripts/make_predictor.sh` writes the predictor's five prompt sets and stops: what
`scripts/finetune_data.py` (and so `scripts/cpu_stage.sh`) needs on a fresh machine, without the labelling run."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _subset(src: str, dst: Path, n: int) -> Path:
    with gzip.open(ROOT / src, "rt") as f:
        rows = [line for line, _ in zip(f, range(n))]
    with gzip.open(dst, "wt") as f:
        f.writelines(rows)
    return dst


def test_sets_only_writes_the_five_label_sets_and_labels_nothing(tmp_path):
    runs = tmp_path / "runs"
    # BP=false and a named step-cost table: a run that went on to label would fail at once
    env = dict(os.environ, SETS_ONLY="1", RUNS=str(runs), PY=sys.executable, BP="false", VALID="8",
               STEP_COSTS=str(tmp_path / "step-costs.json"),
               ANSWERS=str(_subset("data/smollm2-answers-9831.jsonl.gz", tmp_path / "answers.jsonl.gz", 40)),
               STDLIB=str(_subset("data/smollm2-stdlib-answers-3574.jsonl.gz", tmp_path / "std.jsonl.gz", 30)),
               SHAREGPT=str(_subset("data/smollm2-sharegpt-answers-1259.jsonl.gz", tmp_path / "sg.jsonl.gz", 4)),
               SHAREGPT_OPEN=str(_subset("data/smollm2-sharegpt-answers-open-818.jsonl.gz", tmp_path / "so.jsonl.gz", 5)),
               CHAMP=str(_subset("data/smollm2-champ-answers-270.jsonl.gz", tmp_path / "champ.jsonl.gz", 6)))
    done = subprocess.run(["bash", str(ROOT / "scripts/make_predictor.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    counts = {p.name: sum(1 for _ in p.open()) for p in runs.iterdir()}
    # every 12th stdlib task from the 6th on; the first rows of each ShareGPT file; every CHAMP row
    assert counts == {"heldout.jsonl": 8, "stdlib-300.jsonl": 3, "sharegpt-new-300.jsonl": 4,
                      "sharegpt-open-300.jsonl": 5, "champ.jsonl": 6}
    std = [json.loads(line)["prompt"] for line in (runs / "stdlib-300.jsonl").open()]
    with gzip.open(tmp_path / "std.jsonl.gz", "rt") as f:
        assert std == [json.loads(line)["prompt"] for line in f][5::12]
