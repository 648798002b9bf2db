"""Expected per-slot acceptance at T > 0: BlockPilot's "sample, then match" against rejection sampling.

The runtime drafts greedily at every temperature and accepts a draft token while it equals the target's
own sample at that position (lossless for a deterministic drafter): slot k is accepted with probability
`p_k(draft_k)`, where `p_k` is the target's distribution at T. Speculative *rejection* sampling (Leviathan
et al.) would instead draw the draft from the drafter's distribution `q_k` (any temperature `t_d`) and
accept it with probability `min(1, p/q)`, resampling from `max(p - q, 0)` on rejection: also lossless,
accepted with probability `sum_x min(p_k(x), q_k(x))`. This script measures both on teacher-forced
positions of the target's own answers (prompts the drafter never trained on), slot by slot, with anchors
drawn in each answer, and an approximate tau `1 + sum_k prod_{j<=k} a_j` over the block (the draft of slot
k is conditioned on the true prefix, as in the anchored simulated tau). `max p` is the ceiling of any
deterministic draft.

    python scripts/t1_acceptance.py --temperature 1 [--drafter DIR] [--per-set 12]
    python scripts/t1_acceptance.py --temperature 1 --answers draws-t1.jsonl [--answers ...]   # sampled contexts
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from blockpilot.assets import default_drafter_dir
from blockpilot.assets.smollm2 import smollm2_dir
from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.models.decoder import KVCache
from blockpilot.text import load_tokenizer
from blockpilot.training.data import read_answer_rows, tokenize_rows
from blockpilot.training.features import extract_taps
from blockpilot.training.objective import Batch, DraftHead, block_forward

ROOT = Path(__file__).resolve().parents[1]
SETS = (("smollm2-sharegpt-answers-1259.jsonl.gz", 2), ("smollm2-champ-answers-270.jsonl.gz", 1),
        ("smollm2-stdlib-answers-3574.jsonl.gz", 1))
"""Answer files (their first rows: the predictor's label sets, which no drafter trained on) and their
share of `--per-set` (ShareGPT twice as many)."""


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, default=None, help="default: the shipped drafter")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--draft-temperatures", default="0.5,0.75,1,1.25,1.5,2")
    ap.add_argument("--per-set", type=int, default=12, help="prompts per answer file (ShareGPT: twice)")
    ap.add_argument("--anchors", type=int, default=24, help="anchors per answer")
    ap.add_argument("--answers", type=Path, action="append", default=[],
                    help="answers JSONL (e.g. the target's own draws at T, `blockpilot answer --temperature`) "
                         "instead of the greedy answers in data/; repeatable")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = smollm2_dir()
    target, drafter = load_target(target_dir), load_drafter(args.drafter or default_drafter_dir())
    rows = []
    for name, share in ([] if args.answers else SETS):
        with gzip.open(ROOT / "data" / name, "rt") as f:
            rows += [json.loads(line) for _, line in zip(range(args.per_set * share), f)]
    for path in args.answers:
        rows += read_answer_rows(path)[: args.per_set]
    sequences = tokenize_rows(rows, load_tokenizer(target_dir), 384)
    bsz, temps = drafter.config.block_size, [float(t) for t in args.draft_temperatures.split(",")]
    head = DraftHead.of(drafter, target.lm_head.weight)
    generator = torch.Generator().manual_seed(0)
    accept: dict[str, list[torch.Tensor]] = {"match (greedy draft)": [], **{f"reject, q at {t:g}": [] for t in temps},
                                             "max p (best deterministic draft)": []}
    taps = extract_taps(target, sequences, tuple(drafter.config.target_layer_ids), autocast=False)
    for seq, seq_taps in zip(sequences, taps):
        n = len(seq.ids)
        span = n - 1 - bsz - seq.answer_start
        if span <= 0:
            continue
        ids = torch.tensor([seq.ids])
        hidden = target(target.embed_tokens(ids), torch.arange(n), KVCache.allocate(target.config, 1, n, torch.float32), n).hidden
        logits = target.lm_head(hidden)[0]  # (n, V): position i predicts token i + 1
        anchors = (torch.randperm(span, generator=generator)[: args.anchors] + seq.answer_start).sort().values[None]
        batch = Batch(ids, seq_taps[None].float(), torch.tensor([n]), anchors, torch.ones_like(anchors, dtype=torch.bool))
        z = block_forward(drafter, target.embed_tokens.weight, batch)[:, 1:] @ head.weight.T  # (A, B-1, N_v)
        p = torch.softmax(logits[anchors[0][:, None] + torch.arange(bsz - 1)] / args.temperature, -1)  # (A, B-1, V)
        p_draft = p if head.vocab_ids is None else p[..., head.vocab_ids]
        accept["match (greedy draft)"].append(p_draft.gather(-1, z.argmax(-1, keepdim=True))[..., 0])
        accept["max p (best deterministic draft)"].append(p.max(-1).values)
        for t in temps:
            accept[f"reject, q at {t:g}"].append(torch.minimum(p_draft, torch.softmax(z / t, -1)).sum(-1))
    print(f"T = {args.temperature:g}, {len(sequences)} answers, block {bsz}")
    for name, parts in accept.items():
        a = torch.cat(parts)  # (blocks, B-1)
        tau = 1 + a.cumprod(1).sum(1).mean()
        print(json.dumps({"scheme": name, "slot_acceptance": [round(float(x), 3) for x in a.mean(0)[:3]],
                          "approx_tau": round(float(tau), 3)}))


if __name__ == "__main__":
    main()
