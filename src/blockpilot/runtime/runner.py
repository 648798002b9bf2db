"""`Runner`: speculative generation with a TensorRT-LLM-shaped `generate`.

The decode loop (`runtime.batching`) is the same for every backend and every block size; block
size 1 is plain autoregressive decoding (no drafting, one-token verify steps). Per request:

    prefill -> first token -> [choose block size] -> repeat {draft K-1 tokens, verify K tokens,
    accept the longest matching prefix + 1 bonus token} until max_new_tokens or end_id.

The K-1 drafts come from the drafter, or, on a greedy request's steps whose context ends in a few
tokens that occurred before, are copied from what followed them (`runtime.lookup`).

The loop records counts and step boundaries through `clock` (wall time by default; profiling can
pass a clock that synchronizes the GPU first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from blockpilot.errors import UserError
from blockpilot.runtime.backend import Backend
from blockpilot.runtime.settings import DEFAULT_LOOKUP, DEFAULT_VERIFY_LENGTH, LOOKUPS, VERIFY_LENGTHS
from blockpilot.runtime.sampling import VERIFICATIONS, SamplingParams


def check_lookup(which: str) -> str:
    """`which` if it is one of `LOOKUPS`, else a `UserError` naming them."""
    if which not in LOOKUPS:
        raise UserError(f"unknown lookup {which!r}: choose one of {', '.join(LOOKUPS)}")
    return which


def lookup_applies(which: str, params: SamplingParams) -> bool:
    """Whether lookup setting `which` (one of `LOOKUPS`) lets a request with `params` copy drafts."""
    return which == "all" or (which == "greedy" and params.greedy)


@dataclasses.dataclass
class RequestResult:
    """One request's outcome. Times are seconds measured by the runner's clock."""

    input_ids: list[int]
    output_tokens: list[int] = dataclasses.field(default_factory=list)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens committed per verify step
    block_size: int = 1  # the size the request started with (chosen by the caller or the predictor)
    block_size_prob: float | None = None  # predictor's probability of the chosen size (auto only)
    # (verify steps done, new size) each time the policy moved the request to a smaller block (auto only)
    block_size_switches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    predictor_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    drafter_calls: int = 0  # steps that called the drafter (the others copied their drafts by lookup)
    finished: bool = False  # ended by end_id

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens committed per target verify step)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def final_block_size(self) -> int:
        """The block size the request decoded with last."""
        return self.block_size_switches[-1][1] if self.block_size_switches else self.block_size


@dataclasses.dataclass
class GenerationResult:
    requests: list[RequestResult]
    max_new_tokens: int
    pad_value: int

    def output_ids(self) -> torch.Tensor:
        """`(batch, 1, max_input_len + max_new_tokens)` int32: prompt + output, padded."""
        width = max(len(r.input_ids) for r in self.requests) + self.max_new_tokens
        out = torch.full((len(self.requests), 1, width), self.pad_value, dtype=torch.int32)
        for i, r in enumerate(self.requests):
            seq = r.input_ids + r.output_tokens
            out[i, 0, : len(seq)] = torch.tensor(seq, dtype=torch.int32)
        return out

    def to_dict(self) -> dict:
        return {
            "output_ids": self.output_ids(),
            "sequence_lengths": torch.tensor(
                [[len(r.input_ids) + len(r.output_tokens)] for r in self.requests], dtype=torch.int32
            ),
            "accept_lengths": [r.accept_lengths for r in self.requests],
            "tau": [r.tau for r in self.requests],
            "block_sizes": [r.block_size for r in self.requests],
            "block_size_probs": [r.block_size_prob for r in self.requests],
            "block_size_switches": [list(r.block_size_switches) for r in self.requests],
            "drafter_calls": [r.drafter_calls for r in self.requests],
            "timings": [
                {"prefill_s": r.prefill_s, "predictor_s": r.predictor_s, "draft_s": r.draft_s,
                 "verify_s": r.verify_s}
                for r in self.requests
            ],
        }


class Runner:
    """Generation over a backend. Build it with `Runner.from_dir`.

    Args:
        backend: runs the target and the drafter.
        policy: chooses a block size from prefill output (`block_size="auto"`); optional.
        default_block_size: block size when neither the caller nor a policy chooses one.
        clock: returns seconds; the loop reads it at step boundaries only.
        sampled_drafts: at T > 0, draw drafts from the drafter's distribution and accept them by
            rejection sampling where the backend returns the drafter's logits (`draft_logits`); False:
            greedy drafts and "sample, then match" at every temperature (`runtime.sampling`). Both are
            lossless; rejection sampling accepts more (a slot survives with probability
            `sum min(p, q)` instead of `p(argmax q)`).
        verification: how sampled drafts are judged: "block" (default; block verification, which keeps
            the most tokens per step any lossless verifier of the same drafts can) or "token" (slot-by-slot
            rejection sampling). Both are lossless; see `runtime.sampling`.
        lookup: which requests draft by lookup (`runtime.lookup`: a copy of what followed the last
            time the context ended the same way, used instead of the drafter's block where one exists):
            "all" (default), "greedy" (T = 0 requests only), or "off". Lossless in every case (at T > 0 a
            copied draft is deterministic and judged by "sample, then match").
        verify_length: "adaptive" (default): a greedy request's step verifies only the leading drafts that
            pay for their target rows, by the drafter's confidence and the step-cost table of the engine
            directory (else of the predictor; `policy.verify_rows`); "full": every row of the block. Lossless
            either way (the choice depends only on the drafter's output). Without a step-cost table, or for
            sampled requests and copied drafts, steps verify the whole block.
    """

    def __init__(self, backend: Backend, *, policy=None, default_block_size: int | None = None,
                 end_id: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 sampled_drafts: bool = True, verification: str = "block", lookup: str = DEFAULT_LOOKUP,
                 verify_length: str = DEFAULT_VERIFY_LENGTH):
        self.backend = backend
        self.sampled_drafts = sampled_drafts
        self.verification = verification
        self.lookup = lookup
        self.verify_length = verify_length
        self._step_costs = None
        self.policy = policy
        dc = backend.drafter_config
        self.default_block_size = default_block_size or (dc.block_size if dc is not None else 1)
        self.end_id = end_id
        self.clock = clock

    @property
    def verification(self) -> str:
        """How drafts drawn at T > 0 are judged: "block" or "token" (see the class docstring)."""
        return self._verification

    @verification.setter
    def verification(self, rule: str) -> None:
        if rule not in VERIFICATIONS:
            raise UserError(f"unknown verification {rule!r}: choose one of {', '.join(VERIFICATIONS)}")
        self._verification = rule

    @property
    def lookup(self) -> str:
        """Which requests draft by lookup: "greedy", "all" or "off" (see the class docstring)."""
        return self._lookup

    @lookup.setter
    def lookup(self, which: str) -> None:
        self._lookup = check_lookup(which)

    @contextlib.contextmanager
    def settings_set_to(self, **settings):
        """The runner's settings named in `settings` (e.g. `lookup`, `verify_length`) set to their values inside
        the block (None: left alone), and what they were afterwards."""
        saved = {name: getattr(self, name) for name, value in settings.items() if value is not None}
        try:
            for name in saved:
                setattr(self, name, settings[name])
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def uses_lookup(self, params: SamplingParams) -> bool:
        """Whether a request with `params` may copy drafts by lookup."""
        return self.backend.drafter_config is not None and lookup_applies(self._lookup, params)

    @property
    def verify_length(self) -> str:
        """How many rows of a drafted block a step verifies: "adaptive" or "full" (see the class docstring)."""
        return self._verify_length

    @verify_length.setter
    def verify_length(self, which: str) -> None:
        if which not in VERIFY_LENGTHS:
            raise UserError(f"unknown verify length {which!r}: choose one of {', '.join(VERIFY_LENGTHS)}")
        self._verify_length = which

    @property
    def step_costs(self):
        """The step-cost table adaptive verify lengths are priced with: one set here, else the engine
        directory's (measured by `blockpilot build` on these graphs), else the predictor's; None when none."""
        if self._step_costs is not None:
            return self._step_costs
        manifest = getattr(self.backend, "manifest", None)
        if manifest is not None and manifest.step_costs is not None:
            return manifest.step_costs
        return getattr(self.policy, "step_costs", None)

    @step_costs.setter
    def step_costs(self, costs) -> None:
        self._step_costs = costs

    def verifies_adaptively(self, params: SamplingParams) -> bool:
        """Whether a request with `params` verifies adaptive lengths of its drafter's blocks."""
        return self._verify_length == "adaptive" and params.greedy and self.step_costs is not None

    def rows_to_verify(self, draft_logits: torch.Tensor, block_size: int) -> int:
        """Rows (1..`block_size`) of a greedy block to verify, from the drafter's logits `(K - 1, N)` at its
        draft slots (`policy.verify_rows`)."""
        from blockpilot.runtime.policy import top_probability, verify_rows

        costs = self.step_costs
        return verify_rows(top_probability(draft_logits).tolist(), costs.target_ms_at, costs.drafter_ms_at(block_size))

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, drafter_dir: str | Path | None = None,
                 backend: str | None = None, device: str | None = None, dtype: torch.dtype = torch.float32,
                 max_block_size: int | None = None, predictor: str | Path | None = None,
                 predictor_threshold: float | None = None, predictor_any_backend: bool = False) -> "Runner":
        """Load a target (Hugging Face directory) and a DFlash drafter directory, or an engine
        directory (one with `manifest.json`: see `from_engine_dir`; `dtype` is then the build's).

        Without `drafter_dir` the runner can only decode autoregressively (block size 1). With
        `predictor` (an ONNX file from `blockpilot train-predictor`, checked against both models)
        block size "auto" is the default; `predictor_threshold` overrides its fallback threshold.
        A predictor labelled with the step costs of another backend or dtype is refused unless
        `predictor_any_backend`.
        """
        from blockpilot.models.checkpoint import load_drafter, load_target
        from blockpilot.models.config import check_drafter_fits_target
        from blockpilot.runtime.backend import TorchBackend

        if (Path(model_dir) / "manifest.json").is_file():
            if drafter_dir is not None:
                raise UserError(f"{model_dir} is an engine directory with its own drafter; do not pass drafter_dir")
            return cls.from_engine_dir(model_dir, backend=backend, device=device, predictor=predictor,
                                       predictor_threshold=predictor_threshold,
                                       predictor_any_backend=predictor_any_backend)
        device = device or "cpu"
        if dtype == torch.float16 and drafter_dir is not None and str(device).startswith("cpu"):
            raise UserError("fp16 on the CPU rounds each row differently with the number of rows a step carries, "
                            "so speculation would not be lossless; use bf16 or fp32 on the CPU (fp16 on CUDA)")
        if backend not in (None, "torch"):
            raise UserError(f"backend {backend!r} needs an engine directory (blockpilot build); use backend='torch'")
        if dtype == torch.bfloat16 and str(device).startswith("cpu"):
            from blockpilot.models.packed import native_bf16

            if not native_bf16():
                warnings.warn("this CPU has no native bf16 products (AVX512-BF16 or AMX): bf16 runs emulated, far "
                              "slower than fp32 (1.2 against ~100 GFLOP/s on a 2-core AVX2 EPYC); use fp32 here",
                              RuntimeWarning, stacklevel=2)
        target = load_target(model_dir, dtype=dtype).to(device)
        drafter = None
        if drafter_dir is not None:
            drafter = load_drafter(drafter_dir, dtype=dtype).to(device)
            check_drafter_fits_target(target.config, drafter.config, where=f"drafter {drafter_dir}")
        # Reduced precision runs one kernel shape for every step (see TorchBackend), so that
        # speculation is exactly lossless there too.
        torch_backend = TorchBackend(target, drafter, max_block_size, fixed_shape=dtype != torch.float32)
        policy = None
        if predictor is not None:
            from blockpilot.runtime.policy import load_policy

            policy = load_policy(predictor, torch_backend, target_dir=model_dir, drafter_dir=drafter_dir,
                                 threshold=predictor_threshold, any_backend=predictor_any_backend)
        return cls(torch_backend, policy=policy, end_id=_read_eos_id(Path(model_dir)))

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, *, backend: str | None = None, device: str | None = None,
                        predictor: str | Path | None = None, predictor_threshold: float | None = None,
                        predictor_any_backend: bool = False, threads: int | None = None,
                        use_predictor: bool = True) -> "Runner":
        """Load an engine directory written by `blockpilot build` (manifest and file hashes checked).

        `backend`: "torch", "onnxruntime", "tensorrt", or None for the fastest usable one. The
        directory's `predictor.onnx` (or `predictor`) makes block size "auto" the default.
        `threads`: onnxruntime intra-op threads (None: all cores). `use_predictor=False` loads no predictor
        (plain decoding, e.g. `blockpilot answer`, needs none).
        """
        from blockpilot.runtime.engine_dir import open_engine_dir

        opened = open_engine_dir(engine_dir, backend=backend, device=device, predictor=predictor,
                                 predictor_threshold=predictor_threshold, predictor_any_backend=predictor_any_backend,
                                 threads=threads, use_predictor=use_predictor)
        return cls(opened.backend, policy=opened.policy, default_block_size=opened.default_block_size,
                   end_id=_read_eos_id(opened.target_dir))

    # ---------------------------------------------------------------- public API

    def generate(self, batch_input_ids: list[torch.Tensor], *, max_new_tokens: int,
                 end_id: int | None = None, pad_id: int | None = None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, random_seed: int | None = None,
                 block_size: int | str | None = None, streaming: bool = False,
                 return_dict: bool = False, max_batch: int | None = None):
        """Generate for each prompt of `batch_input_ids` (1-D int tensors).

        Returns `output_ids` `(batch, 1, max_input_len + max_new_tokens)` int32 (prompt followed by
        generated tokens, padded with `end_id`, else `pad_id`, else 0), or with `return_dict=True`
        a dict adding `sequence_lengths`, `accept_lengths` (per request, per step), `tau`,
        `block_sizes`, `block_size_probs` and `timings`. With `streaming=True` returns an iterator
        that yields the same type after every step.

        The requests decode together (`runtime.batching`): those that use the same block size share
        every drafter and target call, up to `max_batch` at a time (default: all of them, within
        what the backend takes; 1 runs them one after another). Each request's output is what it
        would be alone: at T=0 token for token, sampled from its own generator (seeded with
        `random_seed + i` for request i).
        `block_size`: an int, "auto" (predictor), or None (auto when a predictor is loaded, else
        the drafter's training block size).
        """
        from blockpilot.runtime.batching import BatchDecoder, GenerationRequest

        SamplingParams.checked(temperature, top_k, top_p)
        end_id = self.end_id if end_id is None else end_id
        if isinstance(batch_input_ids, torch.Tensor):
            raise UserError(f"batch_input_ids is one tensor of shape {tuple(batch_input_ids.shape)}; pass a list "
                            "of 1-D token id tensors, one per prompt (e.g. [ids] or list(rows))")
        if not batch_input_ids:
            raise UserError("batch_input_ids is empty; pass at least one prompt")
        if random_seed is not None and (isinstance(random_seed, bool) or not isinstance(random_seed, int)):
            raise UserError(f"random_seed must be an integer (got {random_seed!r})")
        prompts = [self.check_prompt(ids, max_new_tokens, block_size, index=i) for i, ids in enumerate(batch_input_ids)]
        pad = end_id if end_id is not None else (pad_id if pad_id is not None else 0)
        base_seed = random_seed if random_seed is not None else torch.seed() & (2**62 - 1)
        requests = [GenerationRequest(ids, max_new_tokens, temperature, top_k, top_p, base_seed + i, block_size, end_id)
                    for i, ids in enumerate(prompts)]
        decoder = BatchDecoder(self, max_batch=max_batch or len(prompts))
        steps = self._run_batch(decoder, requests, max_new_tokens, pad)
        convert = (lambda g: g.to_dict()) if return_dict else (lambda g: g.output_ids())
        if streaming:
            return (convert(g) for g in steps)
        result = None
        for result in steps:
            pass
        return convert(result)

    # ---------------------------------------------------------------- checks

    def check_prompt(self, ids, max_new_tokens: int, block_size, index: int = 0) -> list[int]:
        """`ids` (a 1-D int tensor or list) as a list, checked against the vocabulary and the cache.

        Raises:
            UserError: empty prompt, ids outside the vocabulary, prompt + max_new_tokens + block
                beyond the cache, max_new_tokens < 1, unsupported block size.
        """
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        ids = torch.as_tensor(ids)
        if ids.numel() == 0:
            raise UserError(f"prompt {index} is empty; give at least one token")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise UserError(f"prompt {index} holds {ids.dtype} values; pass token ids as integers")
        if ids.dim() > 1 and (ids.dim() > 2 or ids.shape[0] != 1):
            raise UserError(f"prompt {index} has shape {tuple(ids.shape)}; pass each prompt as a 1-D tensor of "
                            "token ids (a (1, n) tensor is taken as one prompt)")
        prompt = ids.reshape(-1).tolist()
        vocab = self.backend.target_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise UserError(f"prompt {index} has token ids outside the vocabulary [0, {vocab})")
        largest = self.largest_block(block_size)
        if len(prompt) + max_new_tokens + largest > self.backend.max_capacity:
            raise UserError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) + block ({largest}) "
                f"exceeds the cache capacity ({self.backend.max_capacity} positions); shorten the "
                "prompt or lower max_new_tokens"
            )
        return prompt

    def largest_block(self, block_size) -> int:
        """The largest block a request with `block_size` (int, "auto" or None) may run."""
        if block_size is None or block_size == "auto":
            candidates = self.policy.candidates if self.policy is not None else ()
            return max((self.default_block_size, *candidates))
        if isinstance(block_size, str) or not isinstance(block_size, int):
            raise UserError(f"block size {block_size!r} is not an integer or 'auto'")
        if block_size > 1 and self.backend.drafter_config is None:
            raise UserError(f"block size {block_size} needs a drafter; pass one or use block size 1")
        if not self.backend.supports_block_size(block_size):
            raise UserError(
                f"block size {block_size} is not supported by this {self.backend.name} backend; "
                f"choose one it supports ({supported_sizes(self.backend)})"
            )
        return block_size

    # ---------------------------------------------------------------- the loop

    def _run_batch(self, decoder, requests, max_new_tokens, pad):
        result = GenerationResult([RequestResult(input_ids=r.input_ids) for r in requests], max_new_tokens, pad)
        waiting = list(zip(requests, result.requests))
        while waiting or len(decoder):
            while waiting and len(decoder) < decoder.max_batch:
                request, filled = waiting.pop(0)
                decoder.add(request, result=filled)
            decoder.step()
            yield result

    def choose_block_size(self, request: RequestResult, block_size, prefill, temperature: float) -> int:
        """The block size of a request: `block_size` if an int, else the predictor's choice (timed
        into `request.predictor_s`), else the default."""
        if isinstance(block_size, int):
            return block_size
        if self.policy is None:
            if block_size == "auto":
                raise UserError("block_size='auto' needs a predictor; load one or pass a block size")
            return self.default_block_size
        start = self.clock()
        choice = self.policy.select(prefill.hidden, prefill.last_logits, temperature=temperature)
        request.predictor_s = self.clock() - start
        request.block_size_prob = choice.probability
        return choice.block_size

    @staticmethod
    def commit(request: RequestResult, tokens: list[int], max_new_tokens: int, end_id) -> bool:
        """Append `tokens`, cut at `end_id` or the token budget; True when the request is done."""
        room = max_new_tokens - len(request.output_tokens)
        if end_id is not None and end_id in tokens[:room]:
            request.output_tokens += tokens[: tokens.index(end_id) + 1]
            request.finished = True
            return True
        request.output_tokens += tokens[:room]
        return len(request.output_tokens) >= max_new_tokens


def supported_sizes(backend, largest: int = 64) -> str:
    """The block sizes `backend` takes, as runs: "1-8", "1-4, 6, 8"."""
    sizes = [k for k in range(1, largest + 1) if backend.supports_block_size(k)]
    runs: list[list[int]] = []
    for k in sizes:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _read_eos_id(model_dir: Path) -> int | None:
    """The end-of-sequence id from `generation_config.json` or `config.json`, if any."""
    import json

    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"{path} is not valid JSON ({exc}); restore or delete the file") from None
            eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None
