"""The systems a profile compares, behind one small interface, and the registry that names them.

A system turns one `Request` into a `Measurement` (the tokens it produced and how long that took).
Ours run `Runner.generate` at a block size ("ar" is block size 1, the same code path); the peers
run transformers' `generate`: plain ("hf-ar"), DFlash assisted with the same drafter weights
("hf-dflash", through `hf_dflash.DFlashAssistant`) and prompt lookup ("hf-prompt-lookup").

Peers' TTFT is the time from the `generate` call to the streamer receiving the first generated
token. Their tau is measured, not taken from transformers: a forward hook counts the target's
forward passes, and tau = (output tokens - 1) / (forward passes - 1): every pass after the prefill
is one verify step (the prefill commits the first token), as for our runner's `accept_lengths`.

`SystemRegistry` maps a baseline name to a factory `(Models) -> System`; a factory raises
`UserError` when the system cannot run with the models given (e.g. hf-dflash without a drafter).
Tests add systems of their own to a registry.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from blockpilot.errors import UserError
from blockpilot.profiling.timing import RequestTimer
from blockpilot.profiling.workload import Request

PROMPT_LOOKUP_TOKENS = 10


@dataclasses.dataclass
class Measurement:
    """One request on one system. Times in seconds."""

    output_ids: list[int]
    ttft_s: float  # prefill + first token + block-size prediction
    total_s: float  # the whole request
    tau: float | None = None  # tokens committed per verify step (None: not measurable)
    verify_steps: int | None = None  # target passes after the prefill
    block_size: int | None = None
    block_size_prob: float | None = None
    predictor_s: float | None = None
    block_size_switches: list | None = None  # (verify steps done, new size): the policy's revisions (auto)


class System(Protocol):
    name: str
    kind: str  # "bp" (our runner, block size > 1 or auto), "ar", or the peer's baseline name
    block_size: int | str | None  # what the system was asked to use

    def prepare(self) -> None:
        """Load whatever the system needs, so no load time lands in a measurement."""

    def generate(self, request: Request, temperature: float, seed: int, max_new_tokens: int) -> Measurement:
        """Run one request at batch 1."""


@dataclasses.dataclass(frozen=True)
class ModelSources:
    """Where the models come from.

    Args:
        target_dir: Hugging Face target (transformers peers; our runner without an engine).
        drafter_dir: DFlash drafter (z-lab format).
        engine_dir: engine directory for our runner (`blockpilot build`); None: run from the dirs.
        backend: our runner's backend name (None: `Runner.from_dir`'s default).
        device: "cpu" or "cuda[:i]".
        dtype: weights' precision for every system.
        predictor: block-size predictor `.onnx` for our runner (overrides an engine dir's).
        predictor_threshold: overrides the predictor's fallback threshold.
        tokenizer_dir: where the tokenizer is (None: `target_dir`).
        predictor_any_backend: accept a predictor labelled for another backend's or dtype's step costs.
        verification: how our runner judges drafts drawn at T > 0 ("block" or "token", `Runner`).
    """

    target_dir: Path | None
    drafter_dir: Path | None
    engine_dir: Path | None = None
    backend: str | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    predictor: Path | None = None
    predictor_threshold: float | None = None
    tokenizer_dir: Path | None = None
    predictor_any_backend: bool = False
    verification: str = "block"


class Models:
    """Loads each model once, on first use, and shares it among the systems.

    Args:
        sources: where the models come from.
        clock: the profiling clock; our runner reads it at step boundaries.
        runner: an already built `Runner` to use instead of loading one from `sources` (its clock
            is replaced by `clock`).
    """

    def __init__(self, sources: ModelSources, clock: Callable[[], float], runner=None):
        self.sources = sources
        self.clock = clock
        self._assistants: dict[int, object] = {}
        self._runner = runner
        if runner is not None:
            runner.clock = clock

    @property
    def runner(self):
        """Our `Runner` (from the engine dir, else from target + drafter), reading `clock`."""
        from blockpilot.runtime.runner import Runner

        if self._runner is None:
            s = self.sources
            common = dict(backend=s.backend, device=s.device, predictor=s.predictor,
                          predictor_threshold=s.predictor_threshold, predictor_any_backend=s.predictor_any_backend)
            if s.engine_dir is not None:  # the engine's own drafter, dtype and (unless given) predictor
                self._runner = Runner.from_dir(s.engine_dir, **common)
            else:
                self._runner = Runner.from_dir(s.target_dir, drafter_dir=s.drafter_dir, dtype=s.dtype, **common)
            self._runner.clock = self.clock
            self._runner.verification = s.verification
        return self._runner

    @functools.cached_property
    def one_row_runner(self):
        """Plain decoding on the runner's models at one row per step (`one_row_plain`), reading `clock`."""
        from blockpilot.runtime.runner import Runner

        runner = self.runner
        if not hasattr(runner.backend, "one_row_plain"):
            raise UserError(f"baseline ar-1row needs the onnxruntime or torch backend, not {runner.backend.name}; "
                            "drop ar-1row")
        return Runner(runner.backend.one_row_plain(), end_id=runner.end_id, clock=self.clock)

    @functools.cached_property
    def hf_target(self):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.sources.target_dir, dtype=self.sources.dtype)
        return model.to(self.sources.device).eval()

    def assistant(self, block_size: int | None = None):
        """The drafter as a transformers DFlash assistant drafting `block_size`-token blocks."""
        from blockpilot.models.config import DecoderConfig, check_drafter_fits_target, read_config_json
        from blockpilot.profiling.hf_dflash import assistant_from_dir

        s = self.sources
        key = block_size or 0
        if key not in self._assistants:
            assistant = assistant_from_dir(s.drafter_dir, block_size=block_size, device=s.device, dtype=s.dtype)
            target = DecoderConfig.from_dict(read_config_json(s.target_dir))
            check_drafter_fits_target(target, assistant.drafter.config, where=f"drafter {s.drafter_dir}")
            self._assistants[key] = assistant
        return self._assistants[key]

    @property
    def end_id(self) -> int | None:
        """End-of-sequence id every system stops at (the runner's)."""
        return self.runner.end_id


class RunnerSystem:
    """Our `Runner.generate` at one block size (int) or "auto" (the runner's predictor); with
    `one_row`, plain decoding without padding rows (`Models.one_row_runner`). `lookup`, `verify_length`: the
    runner's settings of those names while this system generates (None: the runner's own)."""

    def __init__(self, name: str, models: Models, block_size: int | str, one_row: bool = False,
                 lookup: str | None = None, verify_length: str | None = None):
        self.name, self.models, self.block_size, self.one_row = name, models, block_size, one_row
        self.settings = {"lookup": lookup, "verify_length": verify_length}
        self.kind = name if one_row else ("ar" if block_size == 1 else "bp")

    def _runner(self):
        return self.models.one_row_runner if self.one_row else self.models.runner

    def prepare(self) -> None:
        self._runner()

    def generate(self, request: Request, temperature: float, seed: int, max_new_tokens: int) -> Measurement:
        runner, n = self._runner(), len(request.input_ids)
        timer = RequestTimer(self.models.clock, self.models.sources.device)
        with runner.settings_set_to(**self.settings), timer:
            out = runner.generate([torch.tensor(request.input_ids)], max_new_tokens=max_new_tokens,
                                  temperature=temperature, random_seed=seed, block_size=self.block_size,
                                  return_dict=True)
        timings = out["timings"][0]
        length = int(out["sequence_lengths"][0, 0])
        return Measurement(
            output_ids=out["output_ids"][0, 0, n:length].tolist(),
            ttft_s=timings["prefill_s"] + timings["predictor_s"],
            total_s=timer.elapsed_s,
            tau=out["tau"][0],
            verify_steps=len(out["accept_lengths"][0]),
            block_size=out["block_sizes"][0],
            block_size_prob=out["block_size_probs"][0],
            block_size_switches=out["block_size_switches"][0],
            predictor_s=timings["predictor_s"] if self.block_size == "auto" else None,
        )


class TransformersSystem:
    """transformers `generate` on the target, with extra `generate` keyword arguments.

    Args:
        name: baseline name.
        models: shared models.
        config_fields: extra `GenerationConfig` fields (e.g. `prompt_lookup_num_tokens`).
        extra_kwargs: returns extra `generate` arguments (called once the models are loaded).
        block_size: reported block size (drafted tokens + 1), if the method has one.
    """

    def __init__(self, name: str, models: Models, config_fields: dict | None = None,
                 extra_kwargs: Callable[[], dict] = dict, block_size: int | None = None):
        self.name, self.kind, self.models = name, name, models
        self.config_fields = config_fields or {}
        self.extra_kwargs, self.block_size = extra_kwargs, block_size

    def prepare(self) -> None:
        self.models.hf_target  # noqa: B018 (loads it)
        self.extra_kwargs()

    def generate(self, request: Request, temperature: float, seed: int, max_new_tokens: int) -> Measurement:
        model, models = self.models.hf_target, self.models
        input_ids = torch.tensor([request.input_ids], device=models.sources.device)
        config = _generation_config(temperature, max_new_tokens, models.end_id, **self.config_fields)
        streamer = _FirstTokenStreamer(models.clock)
        forwards = []
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        torch.manual_seed(seed)
        try:
            with RequestTimer(models.clock, models.sources.device) as timer:
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                     generation_config=config, streamer=streamer, **self.extra_kwargs())
        finally:
            hook.remove()
        output_ids = out[0, input_ids.shape[1]:].tolist()
        steps = len(forwards) - 1
        return Measurement(
            output_ids=output_ids,
            ttft_s=(streamer.first_token_s or models.clock()) - timer.start_s,
            total_s=timer.elapsed_s,
            tau=(len(output_ids) - 1) / steps if steps > 0 else None,
            verify_steps=steps,
            block_size=self.block_size,
        )


def _generation_config(temperature: float, max_new_tokens: int, end_id: int | None, **fields):
    """Plain sampling at `temperature` (no top-k, no top-p), or greedy at 0; stop at `end_id`."""
    from transformers import GenerationConfig

    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=end_id,
                            pad_token_id=end_id if end_id is not None else 0, **sampling, **fields)


class _FirstTokenStreamer:
    """A transformers streamer that notes the clock when the first generated tokens arrive.

    `generate` puts the prompt first, then each step's new tokens."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.puts = 0
        self.first_token_s: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_s = self.clock()

    def end(self) -> None:
        pass


SystemFactory = Callable[[Models], System]


class SystemRegistry:
    """Baseline names -> factories. `create` raises `UserError` for unknown names."""

    def __init__(self):
        self._factories: dict[str, SystemFactory] = {}

    def add(self, name: str, factory: SystemFactory) -> None:
        self._factories[name] = factory

    def names(self) -> list[str]:
        return list(self._factories)

    def create(self, name: str, models: Models) -> System:
        if name not in self._factories:
            raise UserError(f"unknown baseline {name!r}; choose from {', '.join(self._factories)}")
        return self._factories[name](models)


def _needs_hf_target(models: Models, name: str) -> None:
    if models.sources.target_dir is None:
        raise UserError(f"baseline {name} runs transformers on the Hugging Face target; pass --target DIR")


def _hf_ar(models: Models) -> System:
    _needs_hf_target(models, "hf-ar")
    return TransformersSystem("hf-ar", models)


def _hf_dflash(models: Models) -> System:
    _needs_hf_target(models, "hf-dflash")
    if models.sources.drafter_dir is None:
        raise UserError("baseline hf-dflash needs a DFlash drafter; pass --drafter DIR or drop hf-dflash")
    from blockpilot.models.config import DrafterConfig, read_config_json

    block = DrafterConfig.from_dict(read_config_json(models.sources.drafter_dir)).block_size
    return TransformersSystem("hf-dflash", models, {"speculation_type": "dflash"},
                              lambda: {"assistant_model": models.assistant()}, block_size=block)


def _hf_prompt_lookup(models: Models) -> System:
    _needs_hf_target(models, "hf-prompt-lookup")
    return TransformersSystem("hf-prompt-lookup", models, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS})


def default_registry() -> SystemRegistry:
    """The baselines `--baselines` accepts: ar, ar-1row, hf-ar, hf-dflash, hf-prompt-lookup.

    ar-1row is our plain decoding without the padding rows that make `ar` round like every verify step
    (onnxruntime: 1 row instead of 2; torch bf16: its own row, attention included, instead of the fixed shape): the fastest
    plain decoding of the backend, whose T = 0 output may differ from `ar`'s at a near-tie."""
    registry = SystemRegistry()
    registry.add("ar", lambda models: RunnerSystem("ar", models, 1))
    registry.add("ar-1row", lambda models: RunnerSystem("ar-1row", models, 1, one_row=True))
    registry.add("hf-ar", _hf_ar)
    registry.add("hf-dflash", _hf_dflash)
    registry.add("hf-prompt-lookup", _hf_prompt_lookup)
    return registry
