"""The onnxruntime backend: runs an engine directory's ONNX graphs (the ones TensorRT builds from).

One `InferenceSession` per graph. KV caches are `OrtValue`s owned by the `DecodeState`; they are
bound as inputs and outputs through `IOBinding`. With opset-24 graphs (`TensorScatter`) the present
cache is bound to the past cache's buffer, so each step writes only the new positions in place;
with opset-18 graphs (`ScatterND`) the graph writes a fresh present cache, which replaces the past
one in the state. The graphs accept any cache capacity up to `max_seq_len`, so a request's caches
are exactly as large as it needs. Graph contracts: `blockpilot.builder.export`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from blockpilot.builder.manifest import GraphEntry, Manifest
from blockpilot.errors import UserError
from blockpilot.models.config import DecoderConfig, DrafterConfig
from blockpilot.models.checkpoint import read_draft_vocab_ids
from blockpilot.runtime.backend import (DecodeState, DraftOutput, PrefillOutput, VerifyOutput, merge_tensor_caches,
                                        padded_block, row_positions)

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}


def numpy_float_type(dtype: str):
    """The numpy type of a build dtype; bf16 graphs cannot be fed from numpy (`UserError`)."""
    if dtype not in NUMPY_DTYPES:
        raise UserError(f"the onnxruntime backend cannot run {dtype} graphs; rebuild with "
                        "`blockpilot build --dtype fp32` or use the tensorrt backend")
    return NUMPY_DTYPES[dtype]


def make_session(path: Path, threads: int | None = None, source_digest: str | None = None):
    """An onnxruntime CPU session for `path` on the process-wide thread pool (`ort_session.open_session`:
    from a cached optimized copy when `source_digest`, a digest of the checked files it reads, is given)."""
    from blockpilot.runtime.ort_session import open_session

    try:
        return open_session(path, threads, source_digest)
    except Exception as exc:  # onnxruntime raises its own exception types for graphs it cannot run
        raise UserError(f"onnxruntime cannot load {path} ({str(exc).splitlines()[0][:200]}); rebuild the engine "
                        "directory with `blockpilot build --dtype fp32` for the onnxruntime backend") from None


class OnnxGraph:
    """One session plus the graph's I/O contract; runs with caches bound in place or replaced."""

    def __init__(self, session, entry: GraphEntry, in_place: bool, path: Path | None = None):
        self.session = session
        self.path = path  # the .onnx file the session runs
        self.entry = entry
        self.in_place = in_place
        self.past_names, self.present_names = entry.past_names, entry.present_names
        self.plain_outputs = [n for n in entry.outputs if not n.startswith("present_")]
        # in place, a state's caches stay bound from call to call: binding SmolLM2's 60 caches took
        # 0.2 ms a call (2-core AVX2 EPYC), paid by the target and the drafter call of every step
        self._binding, self._bound_caches = None, None

    def run(self, inputs: dict[str, np.ndarray], caches: list) -> dict[str, np.ndarray]:
        """Run with `inputs` and the cache `OrtValue`s `caches` (updated in the list).

        Returns:
            The non-cache outputs by name.
        """
        if self.in_place and caches is self._bound_caches:
            binding = self._binding  # the same list: the same OrtValues (in place, nothing replaces them)
        else:
            binding = self.session.io_binding()
            for name in self.plain_outputs:  # bound first: `get_outputs` lists outputs in binding order
                binding.bind_output(name)
            for name, cache in zip(self.past_names, caches):
                binding.bind_ortvalue_input(name, cache)
            for name, cache in zip(self.present_names, caches):
                if self.in_place:
                    binding.bind_ortvalue_output(name, cache)  # TensorScatter updates the buffer itself
                else:
                    binding.bind_output(name)
            if self.in_place:
                self._binding, self._bound_caches = binding, caches
        arrays = {name: np.ascontiguousarray(value) for name, value in inputs.items()}  # alive until run ends
        for name, array in arrays.items():
            binding.bind_cpu_input(name, array)
        for name in self.plain_outputs:
            binding.bind_output(name)  # rebinding keeps the position; a fresh buffer each call, as the caller keeps it
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        if not self.in_place:
            caches[:] = values[len(self.plain_outputs):]
        return {name: values[i].numpy() for i, name in enumerate(self.plain_outputs)}


class OnnxBackend:
    """`Backend` over an engine directory's ONNX graphs (see `runtime/backend.py` for the contract).

    Args:
        manifest: the engine directory's checked manifest.
        target, drafter: the two graphs.
        target_config, drafter_config: the models' configurations (cache shapes, vocabulary).
    """

    name = "onnxruntime"
    device = "cpu"
    loop_threads = 1  # torch threads for the decode loop's own ops (see `BatchDecoder._loop_threads`)
    min_rows = 2
    """Every verify runs at least 2 query rows (a plain decoding step gets one padding row).

    onnxruntime's matrix products take a different kernel for a single row; from 2 rows on, each
    row's result is bit-identical whatever the row count and cache capacity (checked on SmolLM2 for
    2..16 rows, `tests/test_batch_invariance.py`), so this makes plain decoding round exactly like every
    block size, at the cost of a 2-row step: on the 2-core AMD EPYC 16.8 ms against 15.2 for one row at a
    256-token context (`scripts/bench_steps.py`), and `profile`'s padded plain decoding (`ar`) runs at
    0.91-0.94x the unpadded `ar-1row` (`one_row_plain`), the baseline every speedup is reported against."""

    def __init__(self, manifest: Manifest, target: OnnxGraph, drafter: OnnxGraph,
                 target_config: DecoderConfig, drafter_config: DrafterConfig, draft_vocab_ids: torch.Tensor | None = None):
        self.manifest = manifest
        self.target, self.drafter = target, drafter
        # graphs exported before the drafter graph had `draft_logits` (engine dirs of export version < 5) draft greedily
        self.draft_logits = "draft_logits" in drafter.entry.outputs
        self.draft_vocab_ids = draft_vocab_ids
        self.target_config, self.drafter_config = target_config, drafter_config
        self.max_capacity = manifest.max_seq_len - (self.min_rows - 1)
        self.max_batch = manifest.max_batch
        self.float_type = numpy_float_type(manifest.dtype)

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, manifest: Manifest, target_config: DecoderConfig,
                        drafter_config: DrafterConfig, threads: int | None = None) -> "OnnxBackend":
        """Open both graphs of a checked engine directory (`threads`: intra-op threads, None = all cores)."""
        numpy_float_type(manifest.dtype)
        in_place = manifest.opset >= 24
        drafter_file = manifest.ort_drafter or manifest.drafter.onnx  # same I/O, 4-bit weights when built
        # the engine dir's checked hashes, all of them: a graph's copy is reused only for the same files
        digest = hashlib.sha256(json.dumps(manifest.files, sort_keys=True).encode()).hexdigest()
        graphs = [OnnxGraph(make_session(Path(engine_dir) / name, threads, digest), entry, in_place,
                            Path(engine_dir) / name)
                  for name, entry in ((manifest.target.onnx, manifest.target), (drafter_file, manifest.drafter))]
        return cls(manifest, *graphs, target_config, drafter_config,
                   read_draft_vocab_ids(Path(engine_dir) / manifest.drafter_dir))

    def supports_block_size(self, block_size: int) -> bool:
        return block_size == 1 or block_size in self.manifest.block_sizes

    def one_row_plain(self) -> "OnnxBackend":
        """A copy (same sessions) whose plain decoding steps run one row, without the padding row: the
        fastest plain decoding, which rounds unlike every verify step (see `min_rows`); a baseline only."""
        one = copy.copy(self)
        one.min_rows = 1
        one.max_capacity = self.manifest.max_seq_len
        return one

    def _zeros(self, config: DecoderConfig, batch: int, capacity: int, count: int) -> list:
        import onnxruntime as ort

        shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
        return [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.float_type)) for _ in range(count)]

    def new_state(self, batch: int, capacity: int) -> DecodeState:
        if not 2 <= capacity <= self.max_capacity:
            raise ValueError(f"capacity {capacity} outside [2, {self.max_capacity}]")
        target_capacity = capacity + self.min_rows - 1  # room for a padding row after the last block
        return DecodeState(
            target_cache=self._zeros(self.target_config, batch, target_capacity, len(self.target.past_names)),
            drafter_cache=self._zeros(self.drafter_config.layers, batch, capacity, len(self.drafter.past_names)),
            capacity=capacity,
        )

    def merge_states(self, states: list[DecodeState]) -> DecodeState:
        def merge(caches: list[list]) -> list:
            tensors = [[torch.from_numpy(v.numpy()) for v in cache] for cache in caches]
            return [_ortvalue(t.numpy()) for t in merge_tensor_caches(tensors)]

        return DecodeState(merge([s.target_cache for s in states]), merge([s.drafter_cache for s in states]),
                           max(s.capacity for s in states))

    def select_rows(self, state: DecodeState, rows: list[int], capacity: int | None = None) -> DecodeState:
        capacity = state.capacity if capacity is None else capacity

        def select(cache: list, size: int) -> list:
            return [_ortvalue(np.ascontiguousarray(v.numpy()[rows, :, :size])) for v in cache]

        return DecodeState(select(state.target_cache, capacity + self.min_rows - 1),
                           select(state.drafter_cache, capacity), capacity)

    def _run_target(self, state: DecodeState, ids: np.ndarray, start, logits_index: np.ndarray) -> dict:
        positions = row_positions(start, ids.shape[1], ids.shape[0]).numpy()
        return self.target.run({"input_ids": ids.astype(np.int64), "positions": positions,
                                "logits_index": logits_index.astype(np.int64)}, state.target_cache)

    def prefill(self, state: DecodeState, input_ids: torch.Tensor) -> PrefillOutput:
        n = input_ids.shape[1]
        out = self._run_target(state, input_ids.cpu().numpy(), 0, np.array([n - 1]))
        return PrefillOutput(last_logits=torch.from_numpy(out["logits"][:, 0]), taps=torch.from_numpy(out["taps"]),
                             hidden=torch.from_numpy(out["hidden"]))

    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size, new_counts=None,
              with_logits=False):
        b, n = new_taps.shape[:2]
        if n == 0:
            raise ValueError("the drafter graph needs at least one new context position per call")
        counts = new_counts if new_counts is not None else torch.full((b,), n)
        lengths = row_positions(ctx_start, 1, b)[:, 0] + counts  # (B,)
        out = self.drafter.run({
            "last_token": last_tokens.cpu().numpy().astype(np.int64)[:, None],
            "block_positions": row_positions(block_start, block_size, b).numpy(),
            "context_taps": new_taps.cpu().numpy().astype(self.float_type),
            "context_positions": row_positions(ctx_start, n, b).numpy(),
            "context_length": lengths[:, None].numpy().astype(np.int64),
        }, state.drafter_cache)
        ids = torch.from_numpy(out["draft_ids"])
        return DraftOutput(ids, torch.from_numpy(out["draft_logits"]).float()) if with_logits else ids

    def verify(self, state, block_ids, start):
        k = block_ids.shape[1]
        ids = padded_block(block_ids, self.min_rows)
        out = self._run_target(state, ids.cpu().numpy(), start, np.arange(ids.shape[1]))
        return VerifyOutput(logits=torch.from_numpy(out["logits"][:, :k]), taps=torch.from_numpy(out["taps"][:, :k]))


def _ortvalue(array: np.ndarray):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(array)
