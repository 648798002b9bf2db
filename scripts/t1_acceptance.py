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
    python scripts/t1_acceptance.py --temperature 1 --answers draws-t1.jsonl --per-set 64 --candidates 4

`--candidates M` also reports each slot's acceptance when the verifier sees up to M candidates drawn from `q`
(at the request's temperature) instead of one, i.e. a draft *tree* with M children per slot, judged by
recursive rejection sampling: candidate i is accepted with probability `min(1, r_i(x) / q_i(x))`, and on
rejection `r_{i+1} = max(r_i - q_i, 0)` (normalised), `r_1 = p`. With replacement (`q_i = q`) the acceptance
after M candidates is exact, `1 - prod_i (1 - sum_x min(r_i(x), q(x)))`; without replacement (each candidate
drawn from `q` with the earlier ones removed; Jeon et al. 2024) it is a Monte Carlo estimate. Slot k's rate
is conditioned on the true prefix: on the target's own draws (`--answers`) that prefix is distributed as the
token any lossless tree commits, so the rates say what a tree would keep, before its extra verify rows.
The same flag reports the deterministic tree: the M most likely ids of `q` as candidates, kept when the
target's own draw is one of them (`--temperature 0.01` approximates greedy decoding's).

`--step-costs STEPS.json` (a `scripts/bench_steps.py --json` file) prices shorter verifies of drafts drawn from
`q` at the request's temperature: for each block size, verifying the whole block, verifying the rows
`runtime.policy.verify_rows` picks from each slot's largest `q` (what greedy requests use, with their
confidence replaced by `q`'s top probability), and from the measured acceptances themselves (an oracle of the
expected tokens, the best any rule that reads the drafter alone could do). A step of r rows is expected to commit
`1 + sum_{j<r} prod_{i<=j} a_i` tokens and costs `verify_ms(r)` plus the drafter call; modelled speed is
expected tokens over expected ms, against the table's one-row plain step.

    python scripts/t1_acceptance.py --temperature 1 --answers draws-t1.jsonl --per-set 120 --anchors 1000 \
        --draft-temperatures 1 --step-costs steps.json
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
from blockpilot.runtime.policy import top_probability, verify_rows
from blockpilot.text import load_tokenizer
from blockpilot.training.data import read_answer_rows, tokenize_rows
from blockpilot.training.features import extract_taps
from blockpilot.training.objective import Batch, DraftHead, block_forward

ROOT = Path(__file__).resolve().parents[1]
SETS = (("smollm2-sharegpt-answers-1259.jsonl.gz", 2), ("smollm2-champ-answers-270.jsonl.gz", 1),
        ("smollm2-stdlib-answers-3574.jsonl.gz", 1))
"""Answer files (their first rows: the predictor's label sets, which no drafter trained on) and their
share of `--per-set` (ShareGPT twice as many)."""
TREE_SLOTS = 3  # `--candidates` is measured on the first slots only (the blocks sampled requests run are short)


def with_replacement_acceptance(p: torch.Tensor, q: torch.Tensor, m: int) -> torch.Tensor:
    """Probability `(N, m)` that recursive rejection sampling keeps one of the first 1..m candidates drawn
    independently from `q` `(N, V)`, judged against the target's `p` `(N, V)` (exact)."""
    residual, rejected, kept = p.double().clone(), torch.ones(len(p), dtype=torch.float64), []
    q = q.double()
    for _ in range(m):
        rejected = rejected * (1 - torch.minimum(residual, q).sum(-1))
        kept.append(1 - rejected)
        residual = (residual - q).clamp(min=0)
        residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-300)
    return torch.stack(kept, -1)


def without_replacement_acceptance(p: torch.Tensor, q: torch.Tensor, m: int, draws: int,
                                   generator: torch.Generator) -> torch.Tensor:
    """Monte Carlo estimate `(N, m)` of the same with candidates drawn from `q` without replacement."""
    kept = torch.zeros(len(p), m, dtype=torch.float64)
    for _ in range(draws):
        residual, proposal = p.double().clone(), q.double().clone()
        done = torch.zeros(len(p), dtype=torch.bool)
        for i in range(m):
            alive = proposal.sum(-1) > 0  # rows whose q still has ids left to propose (a tree of fewer candidates)
            x = torch.multinomial(torch.where(alive[:, None], proposal, 1.0), 1, generator=generator)  # (N, 1)
            ratio = residual.gather(-1, x)[:, 0] / proposal.gather(-1, x)[:, 0].clamp(min=1e-300)
            done |= alive & (torch.rand(len(p), generator=generator, dtype=torch.float64) < ratio.clamp(max=1))
            kept[:, i] += done.double()
            residual = (residual - proposal).clamp(min=0)
            residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-300)
            proposal = proposal.scatter(-1, x, 0.0)
            proposal = proposal / proposal.sum(-1, keepdim=True).clamp(min=1e-300)
    return kept / draws


def top_candidates_acceptance(p: torch.Tensor, q: torch.Tensor, m: int) -> torch.Tensor:
    """Probability `(N, m)` that the target's own draw from `p` is one of the 1..m most likely ids of `q`: the
    tree counterpart of "sample, then match" (deterministic candidates; at T = 0 the greedy tree's acceptance)."""
    top = q.topk(m, dim=-1).indices  # (N, m)
    return p.double().gather(-1, top).cumsum(-1)


def verify_length_speeds(acceptance: torch.Tensor, top_q: torch.Tensor, costs: dict, block_sizes) -> dict:
    """Modelled speed against the one-row plain step of three verify-length rules at each block size (see the
    module docstring). `acceptance` and `top_q` `(A, S)`: each anchor's slot acceptances and `q`'s top
    probabilities; `costs`: {"verify": {K: ms}, "draft": {K: ms}, "plain": ms}."""
    verify_ms = costs["verify"].__getitem__
    out = {}
    for b in block_sizes:
        if b - 1 > acceptance.shape[1]:
            continue
        a = acceptance[:, : b - 1].double()
        expected = torch.cat((torch.ones(len(a), 1, dtype=a.dtype), 1 + a.cumprod(1).cumsum(1)), 1)  # (A, b): r rows
        fixed = costs["draft"][b]
        rules = {"full": [b] * len(a),
                 "adaptive on top q": [verify_rows(c, verify_ms, fixed) for c in top_q[:, : b - 1].tolist()],
                 "oracle of expected tokens": [verify_rows(c, verify_ms, fixed) for c in a.tolist()]}
        out[b] = {}
        for name, rows in rules.items():
            tokens = sum(float(expected[i, r - 1]) for i, r in enumerate(rows))
            ms = sum(verify_ms(r) + fixed for r in rows)
            out[b][name] = {"speed_vs_plain": round(tokens / ms * costs["plain"], 4),
                            "mean_rows": round(sum(rows) / len(rows), 3)}
    return out


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
    ap.add_argument("--candidates", type=int, default=1,
                    help="also report slot acceptance with up to this many candidates per slot drawn from q at T "
                         "(a draft tree; see above)")
    ap.add_argument("--mc-draws", type=int, default=32, help="Monte Carlo draws for candidates without replacement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step-costs", type=Path, help="bench_steps.py --json output: model verify lengths (above)")
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
    top_q: list[torch.Tensor] = []  # q's top probability at each slot, at the request's temperature
    accept: dict[str, list[torch.Tensor]] = {"match (greedy draft)": [], **{f"reject, q at {t:g}": [] for t in temps},
                                             "max p (best deterministic draft)": []}
    trees: dict[str, list[torch.Tensor]] = {"with replacement": [], "without replacement": [],
                                            "top candidates of q, matched": []}
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
        top_q.append(top_probability(z / args.temperature))
        if args.candidates > 1:  # q over all V ids (zero off the draft vocabulary), at the request's temperature
            q_full = torch.softmax(z / args.temperature, -1)
            if head.vocab_ids is not None:
                q_full = torch.zeros_like(p).index_copy_(-1, head.vocab_ids, q_full)
            flat_p, flat_q = p[:, :TREE_SLOTS].flatten(0, 1), q_full[:, :TREE_SLOTS].flatten(0, 1)
            shape = (len(p), -1, args.candidates)
            trees["with replacement"].append(with_replacement_acceptance(flat_p, flat_q, args.candidates).reshape(shape))
            trees["without replacement"].append(
                without_replacement_acceptance(flat_p, flat_q, args.candidates, args.mc_draws, generator).reshape(shape))
            trees["top candidates of q, matched"].append(top_candidates_acceptance(flat_p, flat_q, args.candidates)
                                                         .reshape(shape))
    print(f"T = {args.temperature:g}, {len(sequences)} answers, block {bsz}")
    for name, parts in accept.items():
        a = torch.cat(parts)  # (blocks, B-1)
        tau = 1 + a.cumprod(1).sum(1).mean()
        print(json.dumps({"scheme": name, "slot_acceptance": [round(float(x), 3) for x in a.mean(0)[:3]],
                          "approx_tau": round(float(tau), 3)}))
    if args.step_costs and 1.0 in temps:
        from lookup_replay import read_step_costs

        speeds = verify_length_speeds(torch.cat(accept["reject, q at 1"]), torch.cat(top_q),
                                      read_step_costs(args.step_costs), range(2, bsz + 1))
        print(json.dumps({"verify_lengths (drafts drawn from q at T)": speeds}))
    for name, parts in trees.items():
        if parts:
            a = torch.cat(parts).mean(0)  # (TREE_SLOTS, M): slot k's acceptance with 1..M candidates
            kind = name if name.startswith("top") else f"candidates drawn from q at T, {name}"
            print(json.dumps({"tree": kind, "blocks": sum(len(x) for x in parts),
                              "slot_acceptance_by_candidates": {f"slot {k + 1}": [round(float(x), 3) for x in a[k]]
                                                                for k in range(len(a))}}))


if __name__ == "__main__":
    main()
