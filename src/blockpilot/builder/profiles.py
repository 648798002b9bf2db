"""Optimization profiles of the exported graphs and valid example inputs at their exact shapes.

Every profile pins batch 1 and the cache capacity to `max_seq_len` (the onnxruntime graphs take any
batch up to the manifest's `max_batch`; the TensorRT engines run one request per call). Target: `prefill` (query
length 1..max_seq_len, one logit row) and one profile per block size `K` (block size 1 included,
for autoregressive decoding) with min = opt = max = K. Drafter: one profile per drafting block
size `K` with the block pinned to K and the new-context count ranging over 1..max_seq_len - K.
The TensorRT build, the onnxruntime tests and `scripts/check_trt.py` all read shapes from here.
"""

from __future__ import annotations

import numpy as np

from blockpilot.builder.export import GraphSpec
from blockpilot.builder.manifest import PREFILL, Profile
from blockpilot.models.config import DecoderConfig, DrafterConfig

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}  # bf16 has no numpy type
SHAPE_CHOICES = ("min", "opt", "max")


def _fixed(shape) -> tuple:
    shape = tuple(shape)
    return (shape, shape, shape)


def _caches(spec: GraphSpec, config: DecoderConfig, capacity: int) -> dict:
    shape = (1, config.num_key_value_heads, capacity, config.head_dim)
    return {name: _fixed(shape) for name in spec.past_names}


def target_profiles(spec: GraphSpec, config: DecoderConfig, block_sizes, max_seq_len: int,
                    prefill_opt: int = 128) -> tuple[Profile, ...]:
    """`prefill`, then block size 1, then each of `block_sizes` (ascending)."""
    s, opt = max_seq_len, min(prefill_opt, max_seq_len)
    caches = _caches(spec, config, s)
    prefill = Profile(PREFILL, None, {
        "input_ids": ((1, 1), (1, opt), (1, s)), "positions": ((1, 1), (1, opt), (1, s)),
        "logits_index": _fixed((1,)), **caches})
    blocks = tuple(
        Profile(f"block_{k}", k, {"input_ids": _fixed((1, k)), "positions": _fixed((1, k)),
                                  "logits_index": _fixed((k,)), **caches})
        for k in sorted({1, *block_sizes})
    )
    return (prefill, *blocks)


def drafter_profiles(spec: GraphSpec, drafter: DrafterConfig, block_sizes, max_seq_len: int) -> tuple[Profile, ...]:
    """One profile per drafting block size (ascending)."""
    config = drafter.layers
    taps = len(drafter.target_layer_ids) * config.hidden_size
    caches = _caches(spec, config, max_seq_len)
    return tuple(
        Profile(f"block_{k}", k, {
            "last_token": _fixed((1, 1)), "block_positions": _fixed((1, k)),
            "context_taps": ((1, 1, taps), (1, k, taps), (1, max_seq_len - k, taps)),
            "context_positions": ((1, 1), (1, k), (1, max_seq_len - k)),
            "context_length": _fixed((1, 1)), **caches})
        for k in sorted(block_sizes)
    )


def profile_shapes(profile: Profile, choice: str) -> dict[str, tuple[int, ...]]:
    """Input shapes of `profile` at `choice` ("min", "opt" or "max")."""
    index = SHAPE_CHOICES.index(choice)
    return {name: shapes[index] for name, shapes in profile.shapes.items()}


def target_feed(shapes: dict, past_names: list[str], vocab_size: int, dtype: str, rng: np.random.Generator,
                prefill: bool) -> dict[str, np.ndarray]:
    """Valid target inputs of exactly `shapes`: contiguous positions that fit the capacity, random
    tokens and cache contents (stale entries included); prefill starts at 0, a block anywhere."""
    b, t = shapes["positions"]
    capacity = shapes[past_names[0]][2]
    start = 0 if prefill else int(rng.integers(0, capacity - t + 1))
    float_type = NUMPY_DTYPES[dtype]
    feed = {
        "input_ids": rng.integers(0, vocab_size, shapes["input_ids"]).astype(np.int64),
        "positions": np.broadcast_to(np.arange(start, start + t, dtype=np.int64), (b, t)).copy(),
        "logits_index": (np.array([t - 1]) if prefill else np.arange(t)).astype(np.int64),
    }
    feed.update({n: rng.standard_normal(shapes[n]).astype(float_type) for n in past_names})
    return feed


def drafter_feed(shapes: dict, past_names: list[str], vocab_size: int, dtype: str,
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Valid drafter inputs of exactly `shapes`: context positions `[c0, c0 + n)` directly followed
    by the block, all inside the capacity; random tokens, taps and cache contents."""
    (b, k), n = shapes["block_positions"], shapes["context_positions"][1]
    capacity = shapes[past_names[0]][2]
    c0 = int(rng.integers(0, capacity - n - k + 1))
    float_type = NUMPY_DTYPES[dtype]
    feed = {
        "last_token": rng.integers(0, vocab_size, shapes["last_token"]).astype(np.int64),
        "block_positions": np.broadcast_to(np.arange(c0 + n, c0 + n + k, dtype=np.int64), (b, k)).copy(),
        "context_taps": rng.standard_normal(shapes["context_taps"]).astype(float_type),
        "context_positions": np.broadcast_to(np.arange(c0, c0 + n, dtype=np.int64), (b, n)).copy(),
        "context_length": np.full((b, 1), c0 + n, dtype=np.int64),
    }
    feed.update({name: rng.standard_normal(shapes[name]).astype(float_type) for name in past_names})
    return feed
