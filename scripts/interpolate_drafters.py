"""Mix the weights of a drafter and its fine-tune: `(1 - alpha) * A + alpha * B` (WiSE-FT).

A fine-tune on a narrow kind of data (the shipped drafter's stage 7: mostly code answers) gains there
and forgets a little elsewhere; when B is a fine-tune of A, the straight line between the two weight
sets often keeps most of B's gain and most of A's strength (Wortsman et al., "Robust fine-tuning of
zero-shot models", CVPR 2022). Both drafters must have the same config.json and the same tensor names,
shapes and dtypes, and equal integer tensors (the draft vocabulary); the floating tensors are mixed in
fp32 and stored in their own dtype. The output holds config.json, model.safetensors and
interpolation.json (the two sources and alpha), and is written whole or not at all.

    python scripts/interpolate_drafters.py --a <stage-6 drafter> --b <its code fine-tune> --alpha 0.5 --out soup
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from blockpilot.errors import UserError

WEIGHTS = "model.safetensors"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="the starting drafter (alpha = 0)")
    ap.add_argument("--b", type=Path, required=True, help="its fine-tune (alpha = 1)")
    ap.add_argument("--alpha", type=float, required=True, help="weight of B, in [0, 1]")
    ap.add_argument("--out", type=Path, required=True, help="a new directory")
    return ap.parse_args(argv)


def mixed_tensors(a_dir: Path, b_dir: Path, alpha: float) -> dict:
    """`(1 - alpha) * A + alpha * B` for every floating tensor; integer tensors must be equal."""
    from safetensors import safe_open

    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"--alpha {alpha} is outside [0, 1]; pass the weight of --b")
    for d in (a_dir, b_dir):
        if not (d / WEIGHTS).is_file() or not (d / "config.json").is_file():
            raise UserError(f"{d} is not a drafter directory (config.json + {WEIGHTS}); pass one")
    if json.loads((a_dir / "config.json").read_text()) != json.loads((b_dir / "config.json").read_text()):
        raise UserError(f"{a_dir} and {b_dir} have different config.json; only a drafter and its fine-tune mix")
    mixed = {}
    with safe_open(a_dir / WEIGHTS, "pt") as fa, safe_open(b_dir / WEIGHTS, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            raise UserError(f"{a_dir} and {b_dir} hold different tensors; only a drafter and its fine-tune mix")
        for name in fa.keys():
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                raise UserError(f"tensor {name} differs in shape or dtype between {a_dir} and {b_dir}")
            if not ta.is_floating_point():
                if not ta.equal(tb):
                    raise UserError(f"{name} differs between {a_dir} and {b_dir} (another draft vocabulary?); "
                                    "mix drafters with the same one")
                mixed[name] = ta
            else:
                mixed[name] = ((1 - alpha) * ta.float() + alpha * tb.float()).to(ta.dtype).contiguous()
    return mixed


def write_mix(a_dir: Path, b_dir: Path, alpha: float, out_dir: Path) -> Path:
    from safetensors.torch import save_file

    from blockpilot.files import staged_directory
    from blockpilot.models.checkpoint import load_drafter

    if out_dir.exists():
        raise UserError(f"{out_dir} exists; pass a new --out directory")
    tensors = mixed_tensors(a_dir, b_dir, alpha)
    with staged_directory(out_dir) as tmp:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        shutil.copyfile(a_dir / "config.json", tmp / "config.json")
        (tmp / "interpolation.json").write_text(json.dumps(
            {"a": str(a_dir), "b": str(b_dir), "alpha": alpha, "weights": "(1 - alpha) * a + alpha * b"},
            indent=1) + "\n")
        load_drafter(tmp)  # loads as a drafter (draft vocabulary checked)
    return out_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        write_mix(args.a, args.b, args.alpha, args.out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {1 - args.alpha:g} x {args.a} + {args.alpha:g} x {args.b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
