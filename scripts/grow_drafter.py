"""Deepen a trained DFlash drafter without changing what it drafts: new decoder layers appended after its last one,
each a copy of that layer with its two output projections (`self_attn.o_proj`, `mlp.down_proj`) set to zero, so
every new layer adds nothing to the residual stream until training moves those projections. The grown drafter
drafts exactly as its source at the start of a fine-tune (`blockpilot train-drafter --init-from OUT --layers N`),
the capacity test of the drafter's MODEL_CARD. Written in fp16, as `train-drafter` writes drafters; the output
directory is written whole or not at all, and never over an existing one.

    python scripts/grow_drafter.py --drafter <3-layer drafter> --layers 5 --out runs/drafter-5l
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from blockpilot.errors import UserError
from blockpilot.models.checkpoint import load_drafter, save_drafter
from blockpilot.models.dflash import DFlashDrafter

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow(drafter: DFlashDrafter, layers: int) -> DFlashDrafter:
    """A drafter with `layers` decoder layers whose forward equals `drafter`'s (new layers zero their outputs)."""
    config = drafter.config
    have = config.layers.num_hidden_layers
    if layers <= have:
        raise UserError(f"--layers {layers}: the drafter already has {have} layers; ask for more than {have}")
    grown_config = dataclasses.replace(config, layers=dataclasses.replace(config.layers, num_hidden_layers=layers))
    grown = DFlashDrafter(grown_config)
    source = drafter.state_dict()
    state = {}
    for name in grown.state_dict():
        if name in source:
            state[name] = source[name].clone()
        elif name.startswith("layers."):
            rest = name.split(".", 2)[2]
            last = source[f"layers.{have - 1}.{rest}"]
            state[name] = torch.zeros_like(last) if rest in ZEROED else last.clone()
        else:
            raise RuntimeError(f"grown drafter has a tensor its source lacks: {name}")
    grown.load_state_dict(state)
    grown.set_mask_embedding(drafter.mask_embedding)
    grown.set_draft_vocabulary(drafter.draft_vocab_ids, source="the source drafter")
    return grown.to(drafter.fc.weight.dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--drafter", type=Path, required=True, help="the drafter directory to deepen")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers of the grown drafter")
    ap.add_argument("--out", type=Path, required=True, help="where to write the grown drafter")
    args = ap.parse_args(argv)
    try:
        if not (args.drafter / "config.json").is_file():
            raise UserError(f"--drafter {args.drafter}: no drafter there (no config.json); give a drafter directory")
        if args.out.exists():
            raise UserError(f"--out {args.out} exists; remove it or name another directory")
        source = load_drafter(args.drafter)
        save_drafter(grow(source, args.layers).half(), args.out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {source.config.layers.num_hidden_layers} -> {args.layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
