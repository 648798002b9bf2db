"""Exact labels by replay: no target verify passes, step times from a calibration.

At T = 0 speculative decoding commits exactly the target's greedy continuation `y` of the prompt,
whatever the block size, so the acceptance length of every step can be replayed with drafter
passes only (`blockpilot.training.evaluate.replay_block_sizes`) once `y` and the
target's taps over prompt + `y` are known.

At T > 0 the same replay over one *draw* `y` of the target's continuation (at the same temperature,
top-k and top-p) is speculative sampling itself, with its posterior draws coupled to `y`: a step
accepts draft i while the drafts before it were accepted and draft i equals the posterior drawn
after them, and given the committed prefix, the next token of `y` is distributed exactly as that
posterior draw. So accepting while `draft == y` gives every step's acceptance length with exactly
the distribution decoding gives it (the drafter is deterministic), and all candidates share the
draw (common random numbers: their comparison is less noisy than separate decodes). `blockpilot
answer --temperature T` draws `y`; past its end the replay draws the tokens it still needs. Per prompt:

    prefill (backend.prefill: the runtime's features)
    y     = the target's greedy continuation; an answer from a file is only a hint: one
            teacher-forced pass checks it, and from its first token that is not the target's
            argmax on, the rest is generated one token at a time (also past the end id, because
            the last step's drafts are compared beyond it); at T > 0 the answer is the draw,
            continued by drawing one token at a time
    taps  = the target's taps over prompt + y: from that teacher-forced pass, and from the
            one-token passes for generated tokens
    tau   = per candidate, replay stopped where the runtime stops (the end id or the token budget),
            with the same per-step acceptance lengths as `Runner.generate`: drafter blocks, and
            with `settings.lookup` lookup copies where the context repeats (`runtime.lookup`); all
            candidates step in lockstep and share one lm_head call per round

Step times are not measured per prompt: the throughput objective uses each candidate's mean step
time over the dataset, so `calibrate_step_times` times real `backend.draft` + `backend.verify`
calls at each candidate size once, and rows store `steps x` those medians (`drafter calls x` for
the draft part: a step that copied its draft makes none).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from blockpilot.errors import UserError
from blockpilot.models.decoder import KVCache
from blockpilot.runtime.sampling import SamplingParams, logits_to_probs, sample_tokens
from blockpilot.training.evaluate import ReplayRun, SampledReplay, replay_runs
from blockpilot.predictor.labels import PARTS, LabelSettings, consolidate, prefill_row, save_rows_atomic

CALIBRATION_NEW_TAPS = 3  # newly committed positions fed to each timed draft call (a typical step's tau)


# ---------------------------------------------------------------- answers (hints of the greedy continuation)


def load_answer_hints(path: Path, tokenizer, sampling: SamplingParams | None = None) -> list[list[int]]:
    """Answer token ids of each prompt row of an answers JSONL file, in `load_jsonl_prompts` order.

    A row gives `answer_ids` (a list of ints) or `answer` (text, tokenized without special tokens);
    `"finish": "stop"` means the answer ended with the end token, which is appended. Every row must
    have been made at `sampling` (default: greedy): its `temperature`, `top_k` and `top_p` (absent:
    greedy, as `blockpilot answer` writes greedy rows) equal those of the labels.

    Raises:
        UserError: the file is unreadable, a row has neither field, or a row was drawn at other
            sampling settings (the message names the line).
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read answers file {path}: {exc}") from None
    sampling = sampling or SamplingParams()
    hints = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            row = json.loads(line)
            _check_row_sampling(row, sampling, f"{path}:{number}")
            hints.append(_hint_from_row(row, tokenizer, f"{path}:{number}"))
    return hints


def _check_row_sampling(row: dict, sampling: SamplingParams, where: str) -> None:
    """Raise `UserError` unless the row's answer was made at `sampling` (absent fields: greedy)."""
    try:
        drawn = SamplingParams(float(row.get("temperature", 0.0)), int(row.get("top_k", 0)), float(row.get("top_p", 1.0)))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: {exc}; fix the row's temperature, top_k or top_p") from None
    if drawn != sampling:
        raise UserError(f"{where}: answer {_describe(drawn)}, labels at {_describe(sampling)}: replay is exact only "
                        "on answers made at the labels' sampling; pass the matching --temperature/--top-k/--top-p "
                        "or make answers with `blockpilot answer --temperature ...`")


def _describe(params: SamplingParams) -> str:
    return "greedy" if params.greedy else f"temperature {params.temperature:g}, top-k {params.top_k}, top-p {params.top_p:g}"


def _hint_from_row(row: dict, tokenizer, where: str) -> list[int]:
    ids = row.get("answer_ids")
    if ids is None and isinstance(row.get("answer"), str):
        ids = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise UserError(f"{where}: needs \"answer_ids\" (a list of token ids) or \"answer\" (text) to replay; "
                        "write answers with `blockpilot train-drafter --regenerate` or drop --replay-answers")
    eos = tokenizer.eos_token_id
    if row.get("finish") == "stop" and eos is not None and ids[-1:] != [eos]:
        ids = ids + [eos]
    return list(ids)


# ---------------------------------------------------------------- the greedy continuation


def tokens_needed(continuation: list[int], settings: LabelSettings, end_id: int | None) -> tuple[int, int]:
    """(s, n): the runtime commits `continuation[:s + 1]` (to the end id or the budget, whichever is
    first) and its last step compares drafts up to index `s + max(candidates) - 2`, so the replay
    needs the first `n = s + max(candidates) - 1` tokens; with too few tokens known, `s` is a bound."""
    budget_last = settings.max_new_tokens - 1
    eos_at = continuation.index(end_id) if end_id is not None and end_id in continuation else budget_last
    s = min(eos_at, budget_last)
    return s, s + max(settings.candidates) - 1


@torch.inference_mode()
def continuation(target, prompt_ids: list[int], hint: list[int], settings: LabelSettings,
                 end_id: int | None, tap_layers, generator: torch.Generator | None = None,
                 token_probs: list[float] | None = None) -> tuple[list[int], torch.Tensor, int]:
    """The target's continuation of `prompt_ids`, as long as the replay needs it, with its taps.

    At T = 0 (`settings.temperature`) the greedy continuation: one teacher-forced pass over prompt +
    `hint` checks the hint and gives the taps of every position up to its first wrong token; from
    there tokens are generated one at a time, each pass giving the taps of its position. At T > 0
    `hint` is a draw of the continuation at the settings' temperature, top-k and top-p (all of it is
    kept) and the tokens the replay needs past it are drawn one at a time with `generator`.

    Args:
        target: the target `Decoder`.
        prompt_ids: the prompt's token ids.
        hint: an answer believed to be greedy (T = 0), or drawn at the settings' sampling (T > 0).
        settings: candidates, sampling and token budget.
        end_id: the runtime's end id (None: stop only at the budget).
        tap_layers: the drafter's `target_layer_ids`.
        generator: the draws past the hint (T > 0).
        token_probs: at T > 0, filled with `p(y[i] | prompt + y[:i])` under the settings' sampling (what
            the replay of sampled drafts needs).

    Returns:
        The continuation `y` (index 0 is the token prefill commits), the taps `(1, P + len(y) - 1, tH)`
        of prompt + `y[:-1]` (the replay never reads the last one), and how many tokens of `y` were
        generated one at a time because the hint was wrong or too short.
    """
    p, longest = len(prompt_ids), settings.max_new_tokens + max(settings.candidates) - 1
    hint, tap_layers = hint[:longest], tuple(tap_layers)
    params = SamplingParams(settings.temperature, settings.top_k, settings.top_p)
    cache = KVCache.allocate(target.config, 1, p + longest, torch.float32)
    seq = torch.tensor([prompt_ids + hint])
    out = target(target.embed_tokens(seq), torch.arange(seq.shape[1]), cache, seq.shape[1], tap_layers)
    logits = target.lm_head(out.hidden[0, p - 1:])  # (len(hint) + 1, V): row i predicts the token after hint[:i]
    if params.greedy:
        greedy = logits.argmax(-1).tolist()
        agree = next((i for i, (h, g) in enumerate(zip(hint, greedy)) if h != g), len(hint))
    else:
        agree = len(hint)
    y = hint[:agree] + [int(sample_tokens(logits[agree], params, generator))]
    taps = [out.taps[:, :p + agree]]  # taps of prompt + y[:-1]
    rows = [logits[: agree + 1]]  # row i: the target's logits for y[i]
    while len(y) < tokens_needed(y, settings, end_id)[1]:
        position = p + len(y) - 1  # feed y[-1]; the cache is right for every position before it
        out = target(target.embed_tokens(torch.tensor([[y[-1]]])), torch.tensor([position]), cache, position + 1,
                     tap_layers)
        rows.append(target.lm_head(out.hidden[0, -1:]))
        y.append(int(sample_tokens(rows[-1][0], params, generator)))
        taps.append(out.taps)
    n = tokens_needed(y, settings, end_id)[1]
    if token_probs is not None and not params.greedy:  # p(y[i] | prompt + y[:i]) at the labels' sampling
        probs = logits_to_probs(torch.cat(rows)[:n], params)  # (n, V)
        token_probs[:] = probs.gather(1, torch.tensor(y[:n])[:, None])[:, 0].double().tolist()
    return y[:n], torch.cat(taps, dim=1)[:, :p + n - 1], len(y) - agree - 1


# ---------------------------------------------------------------- the replay


# ---------------------------------------------------------------- rows


def replay_row(backend, input_ids: list[int], hint: list[int], settings: LabelSettings, end_id: int | None,
               step_times: dict[str, dict[str, float]],
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """One dataset row (as `labels.label_prompt` writes) from replay and calibrated step times.

    Args:
        backend: a `TorchBackend` with a drafter (its `target` and `drafter` modules are replayed).
        input_ids: the prompt's token ids.
        hint: answer ids believed greedy, or drawn at the settings' sampling (see `continuation`).
        settings: candidates, sampling and token budget.
        end_id: the runtime's end id.
        step_times: `{"draft_s": {size: s}, "verify_s": {size: s}}` per-call medians (`calibrate_step_times`).
        generator: draws past the end of a sampled hint (T > 0).

    Returns:
        Row tensors with a leading dimension of 1 (see `blockpilot.predictor.labels`).
    """
    target, drafter, p = backend.target, backend.drafter, len(input_ids)
    row = prefill_row(backend, input_ids)
    token_probs: list[float] = []
    y, taps, _ = continuation(target, input_ids, hint, settings, end_id, drafter.config.target_layer_ids, generator,
                              token_probs)
    s, _ = tokens_needed(y, settings, end_id)
    k = len(settings.candidates)
    sampled = None
    if settings.temperature > 0 and settings.sampled_drafts:
        uniform = torch.rand(len(y), generator=generator, dtype=torch.float64)  # one per token, shared by candidates
        sampled = SampledReplay(settings.temperature, torch.tensor([0.0] * p + token_probs, dtype=torch.float64),
                                torch.cat((torch.zeros(p, dtype=torch.float64), uniform)))
    runs = _replay_runs(target, drafter, input_ids + y, p, settings.candidates, taps, stop_at=p + s,
                        sampled=sampled, lookup=settings.lookup)
    steps = torch.tensor([[len(run.steps) for run in runs]], dtype=torch.int64)
    accepted = torch.tensor([[sum(run.steps) for run in runs]], dtype=torch.int64)
    drafter_calls = torch.tensor([[run.drafted for run in runs]], dtype=torch.int64)
    draft_one = torch.tensor([[step_times["draft_s"][str(c)] for c in settings.candidates]], dtype=torch.float64)
    verify_one = torch.tensor([[step_times["verify_s"][str(c)] for c in settings.candidates]], dtype=torch.float64)
    times = {"draft_s": drafter_calls * draft_one, "verify_s": steps * verify_one}
    per_step = steps.double().clamp_min(1)
    return {**row, "steps": steps, "accepted": accepted, "new_tokens": torch.full((1, k), s + 1),
            **times, "tau": accepted.double() / per_step, "step_s": (times["draft_s"] + times["verify_s"]) / per_step,
            "lookup_steps": steps - drafter_calls}


def _replay_runs(target, drafter, ids: list[int], p: int, candidates, taps, stop_at: int,
                 sampled: "SampledReplay | None" = None, lookup: bool = False) -> list[ReplayRun]:
    """`replay_runs` for every candidate; block size 1 (plain decoding) commits one token a step and
    makes no drafter call (its `drafted` counts every step: none copies)."""
    drafted = [c for c in candidates if c > 1]
    runs = iter(replay_runs(target, drafter, ids, p, drafted, taps, stop_at=stop_at, sampled=sampled, lookup=lookup)
                if drafted else [])
    plain = [1] * (min(stop_at, len(ids) - 1) - p)
    return [ReplayRun(1, p + len(plain), plain, len(plain)) if c == 1 else next(runs) for c in candidates]


def replay_label_prompts(backend, prompts: list[tuple[int, str, list[int]]], hints: list[list[int]],
                         settings: LabelSettings, end_id: int | None, step_times: dict, out: Path,
                         progress: bool = True) -> int:
    """Label `prompts` (file index, id, token ids) by replay into the prepared dataset directory `out`.

    `hints[index]` is the answer of the prompt at file index `index`. Rows are written one part
    file each, as `labels.label_prompts` does, and consolidated at the end. At T > 0 the draws past
    a hint's end come from a generator seeded with `settings.seed + index` (a resumed run draws alike).

    Returns:
        The number of rows in the dataset afterwards.
    """
    from tqdm import tqdm

    for index, prompt_id, ids in tqdm(prompts, desc="labelling (replay)", unit="prompt", disable=not progress):
        generator = torch.Generator().manual_seed(settings.seed + index)
        row = replay_row(backend, ids, hints[index], settings, end_id, step_times, generator)
        save_rows_atomic([prompt_id], row, out / PARTS / f"{index:07d}.safetensors")
    return consolidate(out)


# ---------------------------------------------------------------- step-time calibration


def calibrate_step_times(backend, prompts: list[list[int]], candidates: tuple[int, ...], reps: int,
                         clock) -> dict:
    """Seconds of one `draft` and one `verify` call at each candidate size, on this backend.

    Per prompt: prefill, one untimed draft that caches all but the last `CALIBRATION_NEW_TAPS`
    prompt positions as drafter context, one untimed warm-up round, then `reps` rounds over the
    candidates (order rotated each round), each timing a draft fed those last positions as newly
    committed and the verify of its block right after the prompt. Repeated calls rewrite the same
    cache positions with the same values, so every round sees the same state.

    Args:
        backend: the labelling backend (with a drafter).
        prompts: token ids of the calibration prompts.
        candidates: block sizes to time.
        reps: timed rounds per prompt.
        clock: seconds (`time.perf_counter` or `time.process_time`).

    Returns:
        {"draft_s": {size: median}, "verify_s": {size: median}, "raw": {"draft_s": {size: [...]},
        "verify_s": {...}}, "prompts": n, "reps": reps, "new_taps": CALIBRATION_NEW_TAPS}; sizes are
        strings (JSON keys).
    """
    raw = {"draft_s": {str(c): [] for c in candidates}, "verify_s": {str(c): [] for c in candidates}}
    for ids in prompts:
        _calibrate_prompt(backend, ids, candidates, reps, clock, raw)
    medians = {kind: {c: statistics.median(v) for c, v in values.items()} for kind, values in raw.items()}
    return {**medians, "raw": raw, "prompts": len(prompts), "reps": reps, "new_taps": CALIBRATION_NEW_TAPS}


def _calibrate_prompt(backend, ids: list[int], candidates, reps: int, clock, raw: dict) -> None:
    """Time `reps` rounds of draft + verify at every candidate on one prompt into `raw` (see above)."""
    n = len(ids)
    state = backend.new_state(1, n + max(candidates))
    prefill = backend.prefill(state, torch.tensor([ids], device=getattr(backend, "device", "cpu")))
    last = prefill.last_logits.argmax(-1)  # (1,) the greedy first token
    fresh = min(CALIBRATION_NEW_TAPS, n)
    drafted = [c for c in candidates if c > 1]
    if drafted:
        backend.draft(state, last, prefill.taps[:, :n - fresh], 0, n, drafted[0])
    for rep in range(reps + 1):  # round 0 warms up
        shift = rep % len(candidates)
        for size in candidates[shift:] + candidates[:shift]:
            t0 = clock()
            draft = (backend.draft(state, last, prefill.taps[:, n - fresh:], n - fresh, n, size) if size > 1
                     else last.new_zeros(1, 0))  # block size 1: plain decoding, no drafter call
            t1 = clock()
            backend.verify(state, torch.cat((last[:, None], draft), dim=1), n)
            t2 = clock()
            if rep:
                raw["draft_s"][str(size)].append(t1 - t0 if size > 1 else 0.0)
                raw["verify_s"][str(size)].append(t2 - t1)
