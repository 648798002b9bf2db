"""The one interface the decode loop talks to, and its torch implementation.

A backend runs the target and the drafter; the decode loop (`runner.py`) never branches on which
backend it has. Per-request state (the two KV caches) is created by `new_state` and passed to every
call. Rolling back rejected tokens needs no call at all: the loop passes smaller positions next
time, and stale cache entries beyond them are overwritten or never attended to.

Shapes: `B` batch, `P` prompt length, `K` block size, `V` vocabulary, `H` hidden size,
`tH` = number of tapped layers x H.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Protocol

import torch

from blockpilot.models.config import DecoderConfig, DrafterConfig
from blockpilot.models.decoder import Decoder, KVCache
from blockpilot.models.dflash import DFlashDrafter, draft_logits
from blockpilot.models.packed import PackedLinear, can_pack, pack_linears, rows_round_alike, split_long_products
from blockpilot.runtime.sampling import greedy_tokens


@dataclasses.dataclass
class DecodeState:
    """Caches of one request (or one batch), owned by the decode loop."""

    target_cache: Any
    drafter_cache: Any
    capacity: int


@dataclasses.dataclass
class PrefillOutput:
    last_logits: torch.Tensor  # (B, V) logits at the last prompt position
    taps: torch.Tensor  # (B, P, tH) tapped target hidden states, drafter context
    hidden: torch.Tensor  # (B, P, H) final-layer hidden states, predictor features


@dataclasses.dataclass
class VerifyOutput:
    logits: torch.Tensor  # (B, K, V)
    taps: torch.Tensor  # (B, K, tH)


@dataclasses.dataclass
class DraftOutput:
    ids: torch.Tensor  # (B, K - 1) greedy draft tokens (target ids)
    logits: torch.Tensor  # (B, K - 1, N) drafter logits over the backend's `draft_vocab_ids` (all V ids: None)


Starts = "int | torch.Tensor"
"""A start position for every row: one int for all rows, or a `(B,)` int64 tensor, one per row."""


class Backend(Protocol):
    name: str
    target_config: DecoderConfig
    drafter_config: DrafterConfig | None
    max_capacity: int  # largest cache a request may use (positions)
    max_batch: int  # most rows one draft / verify call may carry
    # optional `loop_threads: int`: torch threads for the decode loop's own ops while this backend
    # runs (a backend that computes outside torch sets 1; absent: torch's setting is left alone)
    # optional `draft_logits: bool` (absent: False): `draft(..., with_logits=True)` also returns the
    # drafter's logits (`DraftOutput`), over `draft_vocab_ids` `(N,)` (None: all V ids); the decode loop
    # then draws T > 0 drafts from them and accepts by rejection sampling (`runtime.sampling`)

    def supports_block_size(self, block_size: int) -> bool: ...

    def new_state(self, batch: int, capacity: int) -> DecodeState: ...

    def merge_states(self, states: list[DecodeState]) -> DecodeState:
        """One state whose rows are the rows of `states` in order (capacity: the largest)."""
        ...

    def select_rows(self, state: DecodeState, rows: list[int], capacity: int | None = None) -> DecodeState:
        """A state holding only `rows` of `state`, in that order. With `capacity` (at most the state's; every
        kept row must fit in it) its caches are cut to that many positions: merging pads every row to the
        largest capacity of the group, and a step reads the whole cache, so a group whose longest request
        has left would otherwise keep paying for that request's cache."""
        ...

    def prefill(self, state: DecodeState, input_ids: torch.Tensor) -> PrefillOutput: ...

    def draft(
        self, state: DecodeState, last_tokens: torch.Tensor, new_taps: torch.Tensor,
        ctx_start: Starts, block_start: Starts, block_size: int, new_counts: torch.Tensor | None = None,
        with_logits: bool = False,
    ) -> "torch.Tensor | DraftOutput":
        """Greedy draft tokens `(B, K - 1)` for block positions 1..K-1 (with `with_logits`, a
        `DraftOutput` that also holds the drafter's logits; only where `draft_logits` is True).

        `new_taps` `(B, n, tH)` are the target hidden states of positions `ctx_start..ctx_start+n-1`,
        committed since the last call; `last_tokens` `(B,)` sits at `block_start`. When rows
        committed different numbers of tokens, `new_counts` `(B,)` says how many of the `n` are
        real for each row (the rest are written past its context, masked out, overwritten later)."""
        ...

    def verify(self, state: DecodeState, block_ids: torch.Tensor, start: Starts) -> VerifyOutput:
        """Target logits and taps of the K tokens `block_ids` `(B, K)` at positions `start..start+K-1`.

        Lossless speculation needs each row's result to be independent of K: a plain decoding step
        (K = 1) must round exactly like row 0 of a K = 8 verify. Backends whose kernels do not give
        that for every K run extra padding rows (`padded_block`) and drop their outputs; the cache
        entries they write lie beyond the committed positions and are overwritten later."""
        ...


def row_positions(start: Starts, count: int, batch: int, device="cpu") -> torch.Tensor:
    """`(B, count)` int64 positions `start[b] .. start[b] + count - 1` of every row."""
    offsets = torch.arange(count, device=device)
    if isinstance(start, int):
        return (start + offsets).expand(batch, count)
    return start.to(device=device, dtype=torch.int64)[:, None] + offsets


def last_position(start: Starts) -> int:
    """The largest start over the rows."""
    return start if isinstance(start, int) else int(start.max())


def padded_block(block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """`block_ids` `(B, K)` extended to `(B, max(K, rows))` by repeating its last token."""
    k = block_ids.shape[1]
    return block_ids if k >= rows else torch.cat((block_ids, block_ids[:, -1:].expand(-1, rows - k)), dim=1)


def merge_tensor_caches(caches: list[list[torch.Tensor]], seq_axis: int = 2) -> list[torch.Tensor]:
    """Per-layer concatenation along the batch of caches `(B_i, nkv, cap_i, hd)`, each padded with
    zeros to the largest capacity."""
    capacity = max(c[0].shape[seq_axis] for c in caches)
    merged = []
    for layer in zip(*caches):
        padded = [torch.nn.functional.pad(t, (0, 0, 0, capacity - t.shape[seq_axis])) for t in layer]
        merged.append(torch.cat(padded, dim=0))
    return merged


PRODUCT_ROWS = 32
"""The most rows a torch bf16 target call carries when its products run the step's own rows: the check at load
covers every count of rows up to this (`rows_round_alike`), and no more, since oneDNN's kernels handle a call's
last rows by the row count; batches are capped at `PRODUCT_ROWS // max_block_size` requests (4 at blocks of up to
8, 2 at blocks of up to 16)."""


def default_max_block_size(drafter_config: DrafterConfig | None, fixed_shape: bool) -> int:
    """The largest block a `TorchBackend` takes unless told: twice the drafter's training block size, or
    with `fixed_shape` the training size itself, since every step's attention then runs that many query rows
    (a step costs more the larger it is: on a 2-core Intel Xeon, bf16, 6 HumanEval and 6 MT-Bench prompts,
    block 6 ran 1.563x the fastest plain decoding at 8 rows and 1.508x at 16, lossless plain decoding 0.932x
    and 0.873x). The shipped predictor chooses among sizes up to the training size; blocks longer than it
    rarely keep their last slots."""
    if drafter_config is None:
        return 1
    return drafter_config.block_size * (1 if fixed_shape else 2)


class TorchBackend:
    """Runs `models/` directly (CPU or CUDA): the reference backend.

    With `fixed_shape` every target forward after prefill runs `max_block_size` query rows over the
    whole cache (padding rows dropped): one kernel shape for plain decoding and every block size,
    so each row rounds the same whatever K is. Eager products (MKL in fp32, oneDNN in bf16) and
    attention over `start + K` keys round differently per shape otherwise (measured on SmolLM2:
    rows of a K = 8 verify differ from K = 1 steps by up to 5e-5 in fp32, more in bf16). Reduced
    precision uses it by default (`Runner.from_dir`), where products cost about the same for 1 and
    16 rows; fp32 without it is the fast reference, exact up to such rounding. Where this CPU's packed
    bf16 products give every row the same bits for any row count (`models.packed.rows_round_alike`,
    checked when the backend is made), only attention keeps the fixed shape (`Decoder.forward`'s
    `attention_rows`): the products run the step's own rows, so a plain decoding step costs what one
    row costs (on a 2-core Intel Xeon with AVX512-BF16 the products of 16 rows took 32.6 ms, of one
    14.6), and batches are capped so that a call carries at most `PRODUCT_ROWS` rows, the most the check
    covers. `pad_products=True` keeps the whole step at the fixed shape whatever the check would say.

    bf16 weights on a CPU with oneDNN's bf16 products are prepacked once (`pack_weights`, default:
    whenever possible; q/k/v and gate/up fused first; `models.packed`): same results, about 1.3x
    faster target forwards and 3x faster drafter calls on SmolLM2 than eager products, which
    reorder every weight on every call.
    """

    name = "torch"

    def __init__(self, target: Decoder, drafter: DFlashDrafter | None, max_block_size: int | None = None,
                 fixed_shape: bool = False, pack_weights: bool | None = None, pad_products: bool = False):
        self.target = target
        self.drafter = drafter
        self.target_config = target.config
        self.drafter_config = drafter.config if drafter is not None else None
        self.tap_layers = self.drafter_config.target_layer_ids if drafter is not None else ()
        self.max_block_size = max_block_size or default_max_block_size(self.drafter_config, fixed_shape)
        self.fixed_rows = self.max_block_size if fixed_shape else None
        self.device = target.embed_tokens.weight.device
        self.dtype = target.embed_tokens.weight.dtype
        self.draft_head = drafter.draft_head_weight(target.lm_head.weight) if drafter is not None else None  # (N, H)
        self.draft_logits = drafter is not None
        self.draft_vocab_ids = drafter.draft_vocab_ids if drafter is not None else None
        self.packed = can_pack(target.embed_tokens.weight) if pack_weights is None else pack_weights
        if self.packed:
            rows = self.fixed_rows or 16
            target.fuse_projections()
            pack_linears(target, rows)
            if drafter is not None:
                pack_linears(drafter, rows)
                self.draft_head = PackedLinear(self.draft_head, None, rows)
        # the query rows attention runs at over the whole cache (None: over the positions so far)
        self.attention_rows = self.fixed_rows
        if self.fixed_rows and self.packed and not pad_products:
            split = split_long_products(target)
            if rows_round_alike(target, list(range(1, max(PRODUCT_ROWS, self.fixed_rows) + 1))):
                self.fixed_rows = None  # products at the step's own rows, attention alone at the fixed shape
            else:
                for parent, name, layer in split:  # the whole step at the fixed shape, as the products were
                    setattr(parent, name, layer)
        self.pad_rows = (self.fixed_rows or 1) - 1  # cache positions padding rows may write past a block
        self.max_capacity = min(target.max_positions, drafter.rope.cos.shape[0] if drafter else 1 << 30) - self.pad_rows
        # rows of a batched verify beyond the `PRODUCT_ROWS` checked would not be known to round alike
        products_unpadded = self.attention_rows and not self.fixed_rows
        self.max_batch = max(1, PRODUCT_ROWS // self.attention_rows) if products_unpadded else 1 << 16

    def supports_block_size(self, block_size: int) -> bool:
        return 1 <= block_size <= self.max_block_size

    def one_row_plain(self) -> "TorchBackend":
        """A copy (same models) whose steps run only their own rows over the positions so far, not the
        fixed shape: the fastest plain decoding, which may round unlike the verify steps; a baseline only."""
        one = copy.copy(self)
        one.fixed_rows, one.pad_rows, one.attention_rows = None, 0, None
        one.max_capacity = self.max_capacity + self.pad_rows
        return one

    def new_state(self, batch: int, capacity: int) -> DecodeState:
        target_cache = KVCache.allocate(self.target_config, batch, capacity + self.pad_rows, self.dtype, self.device)
        drafter_cache = (
            KVCache.allocate(self.drafter_config.layers, batch, capacity, self.dtype, self.device)
            if self.drafter is not None else None
        )
        return DecodeState(target_cache, drafter_cache, capacity)

    def merge_states(self, states: list[DecodeState]) -> DecodeState:
        def merge(caches: list[KVCache]) -> KVCache:
            n = len(caches[0].k)
            layers = merge_tensor_caches([c.k + c.v for c in caches])
            return KVCache(k=layers[:n], v=layers[n:])

        drafter = merge([s.drafter_cache for s in states]) if self.drafter is not None else None
        return DecodeState(merge([s.target_cache for s in states]), drafter, max(s.capacity for s in states))

    def select_rows(self, state: DecodeState, rows: list[int], capacity: int | None = None) -> DecodeState:
        index = torch.tensor(rows, device=self.device)
        capacity = state.capacity if capacity is None else capacity

        def select(cache: KVCache | None, size: int) -> KVCache | None:
            return None if cache is None else KVCache(k=[t[index, :, :size] for t in cache.k],
                                                      v=[t[index, :, :size] for t in cache.v])

        return DecodeState(select(state.target_cache, capacity + self.pad_rows),
                           select(state.drafter_cache, capacity), capacity)

    @torch.inference_mode()
    def prefill(self, state: DecodeState, input_ids: torch.Tensor) -> PrefillOutput:
        t = self.target
        n = input_ids.shape[1]
        out = t(t.embed_tokens(input_ids), torch.arange(n, device=self.device), state.target_cache, n,
                self.tap_layers)
        taps = out.taps if out.taps is not None else out.hidden[:, :, :0]
        return PrefillOutput(last_logits=t.lm_head(out.hidden[:, -1]), taps=taps, hidden=out.hidden)

    @torch.inference_mode()
    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size, new_counts=None,
              with_logits=False):
        t, d = self.target, self.drafter
        b, n = new_taps.shape[:2]
        block = d.block_embeddings(
            t.embed_tokens(last_tokens[:, None]), t.embed_tokens.weight[d.config.mask_token_id], block_size
        )
        per_row = not isinstance(ctx_start, int) or new_counts is not None
        if per_row:
            block_pos = row_positions(block_start, block_size, b, self.device)
            ctx_pos = row_positions(ctx_start, n, b, self.device)
            counts = new_counts if new_counts is not None else torch.full((b,), n)
            lengths = row_positions(ctx_start, 1, b)[:, 0] + counts  # (B,)
            hidden = d(block, block_pos, new_taps, ctx_pos, state.drafter_cache, kv_len=last_position(ctx_start) + n,
                       context_lengths=lengths.to(self.device))
        else:
            hidden = d(
                block,
                torch.arange(block_start, block_start + block_size, device=self.device),
                new_taps,
                torch.arange(ctx_start, ctx_start + n, device=self.device),
                state.drafter_cache,
                kv_len=ctx_start + n,
            )
        logits = draft_logits(hidden[:, 1:], self.draft_head).float()  # (B, K - 1, N), exact in float32
        best = greedy_tokens(logits)  # numpy's argmax: torch's took 0.2 ms of a 4.5 ms bf16 drafter call
        ids = best if d.draft_vocab_ids is None else d.draft_vocab_ids[best]  # (B, K - 1) target ids
        return DraftOutput(ids, logits) if with_logits else ids

    @torch.inference_mode()
    def verify(self, state, block_ids, start):
        t = self.target
        b, k = block_ids.shape
        ids = padded_block(block_ids, self.fixed_rows or k)
        rows = ids.shape[1]
        kv_len = state.target_cache.capacity if self.attention_rows else last_position(start) + k
        if isinstance(start, int):
            positions = torch.arange(start, start + rows, device=self.device)
        else:
            positions = row_positions(start, rows, b, self.device)
        out = t(t.embed_tokens(ids), positions, state.target_cache, kv_len, self.tap_layers, self.attention_rows)
        hidden = out.hidden[:, :k]
        taps = out.taps[:, :k] if out.taps is not None else hidden[:, :, :0]
        return VerifyOutput(logits=t.lm_head(hidden), taps=taps)
