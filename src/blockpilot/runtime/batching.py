"""Batched speculative decoding: requests that chose the same block size share every target call.

An engine runs one optimization profile (one block size) per call, so a step can only batch the
requests that draft and verify the same number of tokens. `BatchDecoder` keeps one *group* per
block size; each group owns one `DecodeState` whose rows are its requests. Per step and group:

    draft   one drafter call for the group's rows (each row at its own positions; rows that
            committed fewer tokens last step mask the extra context out)
    verify  one target call over `(rows, K)` blocks, each row at its own start position
    accept  per row: its own sampling parameters and random generator, its own acceptance

A request joins a group after its own prefill (batch 1; prompts differ in length) and its first
draft (so that a long prompt's context never widens the group's drafter call), and leaves it as
soon as it finishes or is cancelled: its rows are dropped from the group's state at once, and the
state's caches shrink to what the longest remaining request needs.
Requests in a batch are independent: each row of a call rounds as it would alone (the backends'
kernels give every row the same result whatever the row count, see `OnnxBackend.min_rows`), so
at T=0 every request's tokens equal its single-request output, and sampled requests draw from
their own generators exactly as they would alone.

`BatchDecoder` is not thread-safe: one thread adds, steps and cancels (a server's scheduler).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import torch

from blockpilot.errors import UserError
from blockpilot.runtime.backend import DecodeState
from blockpilot.runtime.lookup import PromptLookup
from blockpilot.runtime.sampling import (SamplingParams, accepted_draft_counts, committed_tokens, draft_distribution,
                                        block_verify_block, draw_categorical, logits_to_probs,
                                        rejection_sample_block, sample_tokens)


@dataclasses.dataclass
class GenerationRequest:
    """One request to `BatchDecoder.add`."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed
    block_size: int | str | None = None  # an int, "auto", or None (the runner's default)
    end_id: int | None = None  # None: the runner's end id


@dataclasses.dataclass
class StepEvent:
    """What one step did for one request."""

    request_id: int
    new_tokens: list[int]  # tokens committed by this step
    finished: bool  # True on the request's last event
    result: "RequestResult"  # the request's running result  # noqa: F821 (runner imports this module)


@dataclasses.dataclass
class _Active:
    """Decode state of one request between steps."""

    id: int
    result: "RequestResult"  # noqa: F821
    params: SamplingParams
    generator: torch.Generator
    max_new_tokens: int
    end_id: int | None
    k: int
    last: torch.Tensor  # (1,) the last committed token, not yet in the caches
    pending_taps: torch.Tensor  # (1, n, tH) taps committed since the last draft
    ctx_start: int  # first drafter-cache position of pending_taps
    pos: int  # position of `last`
    capacity: int  # cache positions the request needs (prompt, answer, room for its largest block)
    state: DecodeState | None  # own state until the request joins a group
    new_tokens: list[int] = dataclasses.field(default_factory=list)  # to report at the next step
    done: bool = False
    adaptive: bool = False  # the block size came from the predictor and may be revised downwards
    moving: bool = False  # leaving one group for another (its tokens are already reported)
    proposal: tuple[torch.Tensor, torch.Tensor] | None = None  # sampled draft: (columns (K-1,), q (K-1, N))
    rows: int = 0  # block rows this step's draft asks the verify for (`Runner.verify_length`)
    lookup: PromptLookup | None = None  # copied drafts (`runtime.lookup`), None: the drafter's only


@dataclasses.dataclass
class _Group:
    k: int
    state: DecodeState
    members: list[_Active]


class BatchDecoder:
    """Continuous batching over a `Runner`'s backend and policy.

    Args:
        runner: the loaded runner (backend, predictor, default block size, end id, clock).
        max_batch: most requests one group (one target call) carries; limited by the backend.
        disable_speculation_from: a request without a block size of its own (None or "auto") that
            arrives while at least this many are active decodes plainly (block size 1), as vLLM's
            `speculative_disable_by_batch_size`: with many rows a verify of K tokens per row is
            compute-bound and plain decoding's batch gives more tokens per second. None: never.
    """

    def __init__(self, runner, max_batch: int = 16, disable_speculation_from: int | None = None):
        if max_batch < 1:
            raise UserError(f"max_batch must be >= 1 (got {max_batch})")
        if disable_speculation_from is not None and disable_speculation_from < 1:
            raise UserError(f"disable_speculation_from must be >= 1 (got {disable_speculation_from})")
        self.disable_speculation_from = disable_speculation_from
        self.runner = runner
        self.backend = runner.backend
        self.max_batch = max(1, min(max_batch, getattr(self.backend, "max_batch", 1)))
        self.max_capacity = self.backend.max_capacity
        self._ids = itertools.count()
        self._joining: list[_Active] = []
        self._groups: list[_Group] = []

    def __len__(self) -> int:
        return len(self._joining) + sum(len(g.members) for g in self._groups)

    # ---------------------------------------------------------------- requests in and out

    def add(self, request: GenerationRequest, result=None) -> int:
        """Check, prefill and place one request; returns its id. Its first token (from prefill) is
        reported by the next `step`. `result`: a `RequestResult` to fill (a new one by default).

        Raises:
            UserError: empty prompt, ids outside the vocabulary, too long for the cache, bad block
                size or sampling parameters.
        """
        with self._loop_threads():
            return self._add(request, result)

    def _add(self, request: GenerationRequest, result=None) -> int:
        from blockpilot.runtime.runner import RequestResult

        runner, be, clock = self.runner, self.backend, self.runner.clock
        params = SamplingParams.checked(request.temperature, request.top_k, request.top_p)
        ids = runner.check_prompt(request.input_ids, request.max_new_tokens, request.block_size)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(request.seed if request.seed is not None else torch.seed() & (2**63 - 1))
        end_id = runner.end_id if request.end_id is None else request.end_id
        result = result if result is not None else RequestResult(input_ids=ids)

        t0 = clock()
        # A backend whose attention runs one fixed shape attends over the whole cache, so the cache is as large
        # for plain decoding as for its largest block: every block size of a request then rounds alike.
        room = max(runner.largest_block(request.block_size), getattr(be, "attention_rows", None) or 1)
        capacity = min(len(ids) + request.max_new_tokens + room, be.max_capacity)  # check_prompt: >= the need
        state = be.new_state(1, capacity)
        prefill = be.prefill(state, torch.tensor([ids], device=getattr(be, "device", "cpu")))
        last = sample_tokens(prefill.last_logits, params, generator)  # (1,)
        result.prefill_s = clock() - t0
        block_size = request.block_size
        if (block_size in (None, "auto") and self.disable_speculation_from is not None
                and len(self) >= self.disable_speculation_from):
            block_size = 1
        result.block_size = k = runner.choose_block_size(result, block_size, prefill, params.temperature)
        adaptive = block_size in (None, "auto") and hasattr(runner.policy, "revise") and k > 1
        lookup = PromptLookup(ids) if runner.uses_lookup(params) else None
        active = _Active(next(self._ids), result, params, generator, request.max_new_tokens, end_id, k, last,
                         prefill.taps, 0, len(ids), capacity, state, adaptive=adaptive, lookup=lookup)
        active.done = self._commit(active, [int(last)])
        self._joining.append(active)
        return active.id

    def cancel(self, request_id: int) -> None:
        """Drop a request now (its rows leave its group's state); no more events for it."""
        self._joining = [a for a in self._joining if a.id != request_id]
        for group in self._groups:
            rows = [i for i, a in enumerate(group.members) if a.id != request_id]
            if len(rows) < len(group.members):
                self._keep_rows(group, rows)
        self._groups = [g for g in self._groups if g.members]

    # ---------------------------------------------------------------- one step

    def step(self) -> list[StepEvent]:
        """One decode step for every active request; returns one event per request touched."""
        with self._loop_threads():
            return self._step()

    @contextlib.contextmanager
    def _loop_threads(self):
        """The loop's own torch ops (sampling, acceptance) on `backend.loop_threads` threads.

        A backend whose forwards run outside torch (onnxruntime's thread pool, TensorRT) asks for 1:
        on 2 cores, torch's OpenMP threads spinning after each small op took the cores from the
        onnxruntime pool (measured on SmolLM2, block 6: 57.9 -> 77.7 tok/s, plain decoding unchanged)."""
        threads = getattr(self.backend, "loop_threads", None)
        if threads is None:
            yield
            return
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(saved)

    def _step(self) -> list[StepEvent]:
        clock = self.runner.clock
        events: list[StepEvent] = []
        joining, self._joining = self._joining, []
        for active in joining:  # first tokens (from prefill) come out with this step
            if not active.moving:
                events.append(self._event(active))
            active.moving = False
        joining = [a for a in joining if not a.done]
        drafts: dict[int, torch.Tensor] = {}  # group index -> (B, k - 1)
        for index, group in enumerate(self._groups):  # the groups draft before anyone joins them
            t0 = clock()
            drafts[index] = self._draft_rows(group.state, group.members)
            for active in group.members:
                active.result.draft_s += clock() - t0
        for active in joining:  # a first draft alone: its context is as long as its prompt
            t0 = clock()
            first = self._draft_rows(active.state, [active], skip_drafter=False)
            active.result.draft_s += clock() - t0
            index = self._join(active)
            drafts[index] = torch.cat((drafts[index], first)) if index in drafts else first
        for index, group in enumerate(self._groups):
            rows = max(a.rows for a in group.members)  # a group verifies as many rows as its members ask for
            events += self._verify_group(group, drafts[index][:, : rows - 1])
        self._groups = [g for g in self._groups if g.members]
        return events

    def _join(self, active: _Active) -> int:
        """Put `active` into a group of its block size with room (a new one if none); its index."""
        for index, group in enumerate(self._groups):
            if group.k == active.k and len(group.members) < self.max_batch:
                group.state = self.backend.merge_states([group.state, active.state])
                group.members.append(active)
                break
        else:
            index = len(self._groups)
            self._groups.append(_Group(active.k, active.state, [active]))
        active.state = None
        return index

    def _verify_group(self, group: _Group, draft: torch.Tensor) -> list[StepEvent]:
        """One target call over the group's blocks `[last, draft]`, then each row's acceptance."""
        be, clock, members = self.backend, self.runner.clock, group.members
        last = torch.cat([a.last for a in members])  # (B,)
        starts = torch.tensor([a.pos for a in members], dtype=torch.int64)
        t0 = clock()
        verify = be.verify(group.state, torch.cat((last[:, None], draft), dim=1),
                           int(starts[0]) if len(members) == 1 else starts)
        elapsed = clock() - t0
        events, keep, moving = [], [], []
        for row, active in enumerate(members):
            if active.proposal is not None:  # drawn from the drafter's distribution: block or token verification
                columns, q = active.proposal
                active.proposal = None
                probs = logits_to_probs(verify.logits[row], active.params)  # (k, V)
                verify_fn = block_verify_block if self.runner.verification == "block" else rejection_sample_block
                tokens, a = verify_fn(columns, q, self.backend.draft_vocab_ids, probs, active.generator)
                last = torch.tensor([tokens[-1]])
            else:
                posterior = sample_tokens(verify.logits[row:row + 1], active.params, active.generator)  # (1, k)
                accepted = accepted_draft_counts(draft[row:row + 1], posterior)  # (1,)
                a = int(accepted[0])
                tokens = committed_tokens(draft[row:row + 1], posterior, accepted)[0, : a + 1].tolist()
                last = posterior[:, a]
            active.result.verify_s += elapsed
            active.result.accept_lengths.append(a + 1)
            active.done = self._commit(active, tokens)
            events.append(self._event(active))
            if active.done:
                continue
            # after a step that copied its draft the drafter has not seen the previous step's taps yet
            active.pending_taps = torch.cat((active.pending_taps, verify.taps[row:row + 1, : a + 1]), dim=1)
            active.pos += a + 1
            active.last = last
            if self._revise(active):
                moving.append(row)
            else:
                keep.append(row)
        for row in moving:  # each leaves with its own rows of the state, drafts alone next step, joins its size
            active = members[row]
            active.state = be.select_rows(group.state, [row], capacity=active.capacity)
            active.moving = True
            self._joining.append(active)
        if len(keep) < len(members):
            self._keep_rows(group, keep)
        return events

    def _revise(self, active: _Active) -> bool:
        """For a predictor-chosen size, ask the policy whether a smaller block pays better now (True:
        the request moves to that size)."""
        if not active.adaptive:
            return False
        result = active.result
        since = result.block_size_switches[-1][0] if result.block_size_switches else 0  # steps before this size
        k = self.runner.policy.revise(active.k, result.accept_lengths, len(result.accept_lengths) - since,
                                      self.backend.supports_block_size)
        if k == active.k:
            return False
        result.block_size_switches.append((len(result.accept_lengths), k))
        active.k, active.adaptive = k, k > 1
        return True

    def _draft_rows(self, state: DecodeState, members: list[_Active], skip_drafter: bool = True) -> torch.Tensor:
        """Drafts `(B, k - 1)` of `members` (the rows of `state`, in order): copied by lookup where the
        row's context allows it, else from one drafter call. With `skip_drafter` the call is skipped when
        every row copies (the taps then wait for the next call); a request's first draft makes it anyway,
        so that its prompt's context never widens the drafter calls of the group it joins."""
        for a in members:
            a.rows = a.k  # copied and sampled drafts are verified whole
        if members[0].k == 1:
            return torch.zeros((len(members), 0), dtype=torch.long)
        copies = {row: copy for row, a in enumerate(members)
                  if a.lookup is not None and (copy := a.lookup.propose(a.k - 1)) is not None}
        if skip_drafter and len(copies) == len(members):
            return torch.tensor([copies[row] for row in range(len(members))], dtype=torch.long)
        counts = [a.pending_taps.shape[1] for a in members]
        width = max(counts)
        taps = torch.zeros((len(members), width, members[0].pending_taps.shape[2]), dtype=members[0].pending_taps.dtype)
        for i, a in enumerate(members):
            taps[i, : counts[i]] = a.pending_taps[0]
        last = torch.cat([a.last for a in members])
        has_logits = getattr(self.backend, "draft_logits", False)
        sampled = self.runner.sampled_drafts and has_logits and any(not a.params.greedy for a in members)
        shorten = [has_logits and row not in copies and self.runner.verifies_adaptively(a.params)
                   for row, a in enumerate(members)]
        extra = {"with_logits": True} if sampled or any(shorten) else {}
        if len(members) == 1:
            a = members[0]
            draft = self.backend.draft(state, last, taps, a.ctx_start, a.pos, a.k, **extra)
        else:
            ctx = torch.tensor([a.ctx_start for a in members], dtype=torch.int64)
            pos = torch.tensor([a.pos for a in members], dtype=torch.int64)
            draft = self.backend.draft(state, last, taps, ctx, pos, members[0].k,
                                       new_counts=torch.tensor(counts, dtype=torch.int64), **extra)
        for a in members:
            a.result.drafter_calls += 1
        for row, a in enumerate(members):
            if shorten[row]:
                a.rows = self.runner.rows_to_verify(draft.logits[row], a.k)
        if sampled:
            draft = self._sample_drafts(members, draft)
        elif extra:
            draft = draft.ids
        if copies:
            draft = draft.clone()
            for row, copy in copies.items():
                draft[row] = torch.tensor(copy, dtype=draft.dtype)
                members[row].proposal = None  # a copied draft is judged by "sample, then match"
        for a, n in zip(members, counts):
            a.ctx_start += n
            a.pending_taps = a.pending_taps[:, :0]
        return draft

    def _sample_drafts(self, members: list[_Active], out) -> torch.Tensor:
        """Drafts `(B, K - 1)`: greedy for T = 0 rows, drawn from the drafter's distribution at the row's
        temperature for the others (kept in `proposal` for their rejection-sampling step)."""
        drafts = out.ids.clone()
        vocab_ids = self.backend.draft_vocab_ids
        for row, a in enumerate(members):
            if a.params.greedy:
                continue
            q = draft_distribution(out.logits[row], a.params.temperature)  # (K - 1, N) float64
            columns = draw_categorical(q, a.generator)  # (K - 1,)
            a.proposal = (columns, q)
            drafts[row] = (columns if vocab_ids is None else vocab_ids[columns]).to(drafts)
        return drafts

    def _keep_rows(self, group: _Group, rows: list[int]) -> None:
        """Keep `rows` of the group; its caches shrink to what the longest remaining request needs. A step
        reads the whole cache, and a group would otherwise keep the capacity of every long prompt it served:
        `blockpilot answer` on 160 package-code prompts, 16 at a time, onnxruntime fp32 on the 2-core AMD EPYC,
        took 286 s before and 265 s after (one run each, the same answers)."""
        group.members = [group.members[i] for i in rows]
        if rows:
            capacity = max(a.capacity for a in group.members)
            group.state = self.backend.select_rows(group.state, rows, capacity=capacity)

    # ---------------------------------------------------------------- helpers

    def _commit(self, active: _Active, tokens: list[int]) -> bool:
        """Append `tokens` to the request, cut at its end id or token budget; True when it is done."""
        result = active.result
        before = len(result.output_tokens)
        done = self.runner.commit(result, tokens, active.max_new_tokens, active.end_id)
        committed = result.output_tokens[before:]
        active.new_tokens += committed
        if active.lookup is not None:
            active.lookup.extend(committed)
        return done

    @staticmethod
    def _event(active: _Active) -> StepEvent:
        event = StepEvent(active.id, active.new_tokens, active.done, active.result)
        active.new_tokens = []
        return event
