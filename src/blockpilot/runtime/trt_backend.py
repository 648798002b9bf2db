"""The TensorRT backend: the engine directory's engines, one execution context each (TensorRT 10 API).

Per call: `set_optimization_profile_async` to the profile of the block size (prefill has its own),
`set_input_shape` for every input, `set_tensor_address` for every input and output,
`execute_async_v3` on the current torch CUDA stream. Buffers are torch CUDA tensors. Caches are
allocated at the engines' capacity (`max_seq_len`, pinned by every profile). With opset-24 engines
(`TensorScatter` -> KV-cache update layer) the present cache is bound to the past cache's address
and updated in place; with opset-18 engines (`ScatterND`) the engine writes a second buffer and the
two swap after each call. tensorrt is imported only when this backend is opened.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from blockpilot.builder.manifest import GraphEntry, Manifest
from blockpilot.errors import UserError
from blockpilot.models.config import DecoderConfig, DrafterConfig
from blockpilot.models.checkpoint import read_draft_vocab_ids
from blockpilot.runtime.backend import DecodeState, DraftOutput, PrefillOutput, VerifyOutput, row_positions

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _capturing_logger():
    """A `trt.ILogger` that keeps error messages (to explain a failed deserialization)."""
    import tensorrt as trt

    class CapturingLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)

    return CapturingLogger()


def load_engine(path: Path):
    """Deserialize `path`; an engine from another GPU or TensorRT version -> `UserError`."""
    import tensorrt as trt

    logger = _capturing_logger()
    engine = trt.Runtime(logger).deserialize_cuda_engine(Path(path).read_bytes())
    if engine is None:
        reason = logger.errors[-1] if logger.errors else "deserialization failed"
        raise UserError(
            f"TensorRT {trt.__version__} cannot load {path} ({reason}); engines only run on the GPU model and "
            "TensorRT version that built them: rebuild with `blockpilot build --trt` on this machine"
        )
    return engine


@dataclasses.dataclass
class CacheBuffers:
    """Per-layer caches; `spare` is the second buffer of double-buffered (opset-18) engines."""

    current: list[torch.Tensor]
    spare: list[torch.Tensor] | None

    def outputs(self) -> list[torch.Tensor]:
        return self.current if self.spare is None else self.spare

    def after_run(self) -> None:
        if self.spare is not None:
            self.current, self.spare = self.spare, self.current


class TrtGraph:
    """One engine and its execution context."""

    def __init__(self, engine, entry: GraphEntry):
        import tensorrt as trt

        self.trt = trt
        self.engine = engine
        self.context = engine.create_execution_context()
        self.entry = entry
        self.past_names, self.present_names = entry.past_names, entry.present_names
        self.plain_outputs = [n for n in entry.outputs if not n.startswith("present_")]
        self.active_profile: int | None = None

    def _output_tensor(self, name: str, device) -> torch.Tensor:
        dtype = {self.trt.float32: torch.float32, self.trt.float16: torch.float16, self.trt.bfloat16: torch.bfloat16,
                 self.trt.int64: torch.int64, self.trt.int32: torch.int32}[self.engine.get_tensor_dtype(name)]
        return torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=dtype, device=device)

    def run(self, profile: int, inputs: dict[str, torch.Tensor], caches: CacheBuffers) -> dict[str, torch.Tensor]:
        """Execute at optimization profile `profile`; returns the non-cache outputs by name."""
        ctx, stream = self.context, torch.cuda.current_stream().cuda_stream
        if profile != self.active_profile:
            ctx.set_optimization_profile_async(profile, stream)
            self.active_profile = profile
        bound = {**inputs, **dict(zip(self.past_names, caches.current))}
        for name, tensor in bound.items():
            if not ctx.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"{name} shape {tuple(tensor.shape)} is outside profile {profile} of {self.entry.engine}")
            ctx.set_tensor_address(name, tensor.data_ptr())
        device = caches.current[0].device
        outputs = {name: self._output_tensor(name, device) for name in self.plain_outputs}
        for name, tensor in [*outputs.items(), *zip(self.present_names, caches.outputs())]:
            ctx.set_tensor_address(name, tensor.data_ptr())
        if not ctx.execute_async_v3(stream):
            raise RuntimeError(f"TensorRT execution of {self.entry.engine} failed at profile {profile}")
        caches.after_run()
        return outputs


class TrtBackend:
    """`Backend` over an engine directory's TensorRT engines (contract: `runtime/backend.py`).

    Args:
        manifest: the engine directory's checked manifest (profile indices, dtype, capacity).
        target, drafter: the two engines with their contexts.
        target_config, drafter_config: the models' configurations.
        device: the CUDA device the engines run on.
    """

    name = "tensorrt"

    def __init__(self, manifest: Manifest, target: TrtGraph, drafter: TrtGraph, target_config: DecoderConfig,
                 drafter_config: DrafterConfig, device: str = "cuda", draft_vocab_ids: torch.Tensor | None = None):
        self.manifest = manifest
        self.target, self.drafter = target, drafter
        self.draft_logits = "draft_logits" in drafter.entry.outputs  # engines of export version >= 5
        self.draft_vocab_ids = None if draft_vocab_ids is None else draft_vocab_ids.to(device)
        self.target_config, self.drafter_config = target_config, drafter_config
        self.max_capacity = manifest.max_seq_len
        self.max_batch = 1  # the engines' profiles pin batch 1
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[manifest.dtype]
        self.in_place = manifest.opset >= 24

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, manifest: Manifest, target_config: DecoderConfig,
                        drafter_config: DrafterConfig, device: str = "cuda") -> "TrtBackend":
        if not manifest.has_engines:
            raise UserError(f"{engine_dir} has no TensorRT engines; rebuild it with `blockpilot build --trt`")
        if not torch.cuda.is_available():
            raise UserError("the tensorrt backend needs a CUDA GPU; use backend 'onnxruntime' or 'torch'")
        if torch.device(device).index is not None:
            torch.cuda.set_device(torch.device(device))
        graphs = [TrtGraph(load_engine(Path(engine_dir) / e.engine), e) for e in (manifest.target, manifest.drafter)]
        return cls(manifest, *graphs, target_config, drafter_config, device,
                   read_draft_vocab_ids(Path(engine_dir) / manifest.drafter_dir))

    def supports_block_size(self, block_size: int) -> bool:
        return block_size == 1 or block_size in self.manifest.block_sizes

    def _caches(self, config: DecoderConfig, batch: int, count: int) -> CacheBuffers:
        shape = (batch, config.num_key_value_heads, self.max_capacity, config.head_dim)

        def zeros() -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(count)]

        return CacheBuffers(zeros(), None if self.in_place else zeros())

    def new_state(self, batch: int, capacity: int) -> DecodeState:
        """Caches at the engines' fixed capacity (`max_seq_len` >= `capacity`)."""
        if batch != 1 or capacity > self.max_capacity:
            raise ValueError(f"engines are built for batch 1 and capacity {self.max_capacity}")
        return DecodeState(self._caches(self.target_config, batch, len(self.target.past_names)),
                           self._caches(self.drafter_config.layers, batch, len(self.drafter.past_names)),
                           self.max_capacity)

    def _positions(self, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count, dtype=torch.int64, device=self.device)

    def _row(self, start, count: int) -> torch.Tensor:
        """`(1, count)` positions of the one row an engine call carries."""
        return row_positions(start, count, 1).to(self.device).contiguous()

    def merge_states(self, states: list[DecodeState]) -> DecodeState:
        if len(states) != 1:
            raise ValueError("TensorRT engines are built for batch 1 (max_batch = 1)")
        return states[0]

    def select_rows(self, state: DecodeState, rows: list[int], capacity: int | None = None) -> DecodeState:
        """The state itself: engines run one row at their fixed capacity (`capacity` is not used)."""
        if rows != [0]:
            raise ValueError("TensorRT engines are built for batch 1 (max_batch = 1)")
        return state

    def _run_target(self, state, ids: torch.Tensor, start, logits_index: torch.Tensor, block_size):
        profile = self.manifest.target.profile_index(block_size)
        inputs = {"input_ids": ids.to(self.device, torch.int64).contiguous(),
                  "positions": self._row(start, ids.shape[1]), "logits_index": logits_index}
        return self.target.run(profile, inputs, state.target_cache)

    def prefill(self, state: DecodeState, input_ids: torch.Tensor) -> PrefillOutput:
        n = input_ids.shape[1]
        out = self._run_target(state, input_ids, 0, self._positions(n - 1, 1), None)
        return PrefillOutput(last_logits=out["logits"][:, 0], taps=out["taps"], hidden=out["hidden"])

    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size, new_counts=None,
              with_logits=False):
        n = new_taps.shape[1]
        count = n if new_counts is None else int(new_counts[0])
        ctx_start = ctx_start if isinstance(ctx_start, int) else int(ctx_start[0])
        if n == 0:
            raise ValueError("the drafter engine needs at least one new context position per call")
        inputs = {
            "last_token": last_tokens.to(self.device, torch.int64).reshape(-1, 1).contiguous(),
            "block_positions": self._row(block_start, block_size),
            "context_taps": new_taps.to(self.device, self.dtype).contiguous(),
            "context_positions": self._row(ctx_start, n),
            "context_length": torch.tensor([[ctx_start + count]], dtype=torch.int64, device=self.device),
        }
        profile = self.manifest.drafter.profile_index(block_size)
        out = self.drafter.run(profile, inputs, state.drafter_cache)
        return DraftOutput(out["draft_ids"], out["draft_logits"].float()) if with_logits else out["draft_ids"]

    def verify(self, state, block_ids, start):
        k = block_ids.shape[1]
        out = self._run_target(state, block_ids, start, self._positions(0, k), k)
        return VerifyOutput(logits=out["logits"], taps=out["taps"])
