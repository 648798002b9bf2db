"""The block-size policy: prefill features and the ONNX predictor that scores candidate block sizes.

BlockPilot chooses one block size per request right after prefill:

    prefill -> features (B, F) -> predictor -> probabilities (B, K) over `candidates`
            -> block size (the top candidate, or the drafter's B_train when the top
               probability is under `threshold`)

and, when asked to (`OnnxBlockSizePolicy.revise_min_steps`; off by default) and the predictor
carries the step-cost table its labels were scored with, revises it downwards while the request
decodes (`revise_block_size`): after some steps at block size k the accepted-draft counts `a_i` tell
what a smaller block k' would have accepted, `min(a_i, k' - 1)` (its drafts are the first k' - 1 of a
block; a block diffusion drafter proposes them nearly alike), so the expected tokens per second of
every candidate k' <= k is `(1 + mean min(a_i, k' - 1)) / step_ms(k')`; the request moves to the best
one when that beats staying by a margin. Only downwards: a larger block's extra drafts were never
proposed, so nothing measures them. Lossless either way: every step is verified, and the block size
depends only on tokens already committed. Off by default because it did not pay: on 60 unseen code
and chat prompts (SmolLM2, onnxruntime fp32, T = 0) revising after 4 steps lost 1-6% against not
revising, after 16 steps 1-2%: acceptance early in an answer says little about the rest of it, and
a move down cannot be undone.

The feature functions here are the only definition of the features: the labelling code
(`blockpilot.predictor.labels`) imports them, so features at label time and at inference time are
the same code. Two kinds exist:

    pooled   the target's final (post-norm) hidden states mean-pooled over the prompt, (B, H)
    logits   the target's logits at the last prompt token, (B, V) (the authors' released code)

A predictor is an ONNX file written by `blockpilot train-predictor`. Its graph maps `features`
`(B, F)` float32 (and `temperature` `(B, 1)` float32 when trained with it) to `probabilities`
`(B, K)`; its `metadata_props` say which candidates, feature kind, width and models it belongs to,
and, for throughput labels, which backend, dtype and machine class the step costs were measured on.
A candidate of 1 means plain decoding (no drafter call). A predictor whose step costs come from
another backend or dtype than the runner's is refused (`load_policy`) unless the caller overrides it:
its choices trade tau against costs that do not hold there. onnxruntime is imported only when a
predictor is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from blockpilot.errors import UserError
from blockpilot.files import remembered_digest

FEATURE_KINDS = ("pooled", "logits")
REVISE_MIN_STEPS = 16  # decode steps observed at a block size before `revise_block_size` may leave it
REVISE_MARGIN = 0.10  # a smaller block must promise this much more throughput than staying
PREDICTOR_FORMAT = "blockpilot-predictor"
PREDICTOR_VERSION = 1
FEATURES_INPUT = "features"
TEMPERATURE_INPUT = "temperature"
PROBABILITIES_OUTPUT = "probabilities"
TEMPERATURE_TOLERANCE = 0.05
"""A predictor without a temperature input chooses for requests this close to a temperature it was labelled at."""


# ---------------------------------------------------------------- features (pure tensor math)


def pooled_hidden_features(hidden: torch.Tensor) -> torch.Tensor:
    """Final-layer hidden states `(B, P, H)` mean-pooled over the prompt -> `(B, H)` float32."""
    return hidden.float().mean(dim=1)


def last_logits_features(last_logits: torch.Tensor) -> torch.Tensor:
    """Logits at the last prompt token `(B, V)` -> `(B, V)` float32 (used as they are)."""
    return last_logits.float()


def prefill_features(kind: str, hidden: torch.Tensor, last_logits: torch.Tensor) -> torch.Tensor:
    """Predictor input `(B, F)` float32 of feature kind `kind` from one prefill's outputs.

    Args:
        kind: "pooled" or "logits".
        hidden: `(B, P, H)` final-layer hidden states of the prompt (`PrefillOutput.hidden`).
        last_logits: `(B, V)` logits at the last prompt position (`PrefillOutput.last_logits`).

    Returns:
        `(B, H)` for "pooled", `(B, V)` for "logits", on the CPU.
    """
    if kind == "pooled":
        return pooled_hidden_features(hidden).cpu()
    if kind == "logits":
        return last_logits_features(last_logits).cpu()
    raise ValueError(f"unknown feature kind {kind!r}; expected one of {FEATURE_KINDS}")


def feature_width(kind: str, target_config) -> int:
    """Width F of feature kind `kind` for a target with `target_config` (a `DecoderConfig`)."""
    return target_config.hidden_size if kind == "pooled" else target_config.vocab_size


def revise_block_size(block_size: int, accept_lengths: list[int], steps_at_size: int, sizes, step_ms,
                      min_steps: int = REVISE_MIN_STEPS, margin: float = REVISE_MARGIN) -> int:
    """The candidate of `sizes` (all <= `block_size`) with the best expected tokens per second, given
    the accepted lengths so far; `block_size` unless it wins by `margin` after `min_steps` steps there.

    Expected tokens per step at size k from steps that accepted `a_i = accept_lengths[i] - 1`
    drafts: `1 + mean(min(a_i, k - 1))`; per second: that over `step_ms(k)`.
    """
    if block_size <= 1 or steps_at_size < min_steps or not accept_lengths:
        return block_size
    drafts = torch.tensor(accept_lengths, dtype=torch.float64) - 1

    def rate(k: int) -> float:
        return (1 + float(drafts.clamp(max=k - 1).mean())) / step_ms(k)

    current = rate(block_size)
    best = max((k for k in sizes if k < block_size), key=rate, default=block_size)
    return best if best != block_size and rate(best) > current * (1 + margin) else block_size


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """`softmax(logits).max(-1)` `(...)` from logits `(..., N)`: the drafter's confidence in its greedy draft."""
    logits = logits.float()
    return (logits.max(-1).values - logits.logsumexp(-1)).exp()


def verify_rows(confidence, verify_ms, fixed_ms: float) -> int:
    """How many rows of a greedy block to verify: the k in 1..len(confidence) + 1 with the most expected
    tokens per millisecond.

    A block is the last committed token and its drafts; verifying its first k rows can keep the first
    k - 1 drafts. Slot j's draft survives (given the slots before it did) about as often as the drafter's
    top probability there, `confidence[j - 1]` (measured on SmolLM2's drafter: drafts at confidence
    0.5-0.6 were accepted 47%, at 0.9-1.0 94%), so k rows are expected to commit
    `1 + sum_{j < k} prod_{i <= j} confidence[i - 1]` tokens and cost `verify_ms(k) + fixed_ms` (the
    drafter call and the loop, the same for every k). On a CPU a verify row costs ~1-4% of a step, so
    rows whose drafts will likely fail are worth dropping. Lossless: which rows are verified depends only
    on the drafter's output, never on the target's.

    Args:
        confidence: the drafter's top probability at each draft slot, in order.
        verify_ms: `verify_ms(k)`, milliseconds of a target forward over k rows.
        fixed_ms: the rest of a step, the same whatever k.
    """
    best_rows, best_rate, expected, survive = 1, 1.0 / (verify_ms(1) + fixed_ms), 1.0, 1.0
    for rows, c in enumerate(confidence, start=2):
        survive *= float(c)
        expected += survive
        rate = expected / (verify_ms(rows) + fixed_ms)
        if rate > best_rate:
            best_rows, best_rate = rows, rate
    return best_rows


def select_block_size(probabilities: torch.Tensor, candidates: torch.Tensor, fallback: int,
                      threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block size per row: the most probable candidate, or `fallback` when it is not sure enough.

    Args:
        probabilities: `(B, K)` predictor output over `candidates`.
        candidates: `(K,)` int64 block sizes, the predictor's classes in order.
        fallback: block size used when a row's top probability is under `threshold`.
        threshold: minimum top probability to follow the predictor.

    Returns:
        `(B,)` int64 chosen block sizes and `(B,)` float32 probabilities the predictor gave them
        (0 for a fallback that is not one of its classes).
    """
    top_prob, top_index = probabilities.max(dim=-1)  # (B,), (B,)
    confident = top_prob >= threshold
    sizes = torch.where(confident, candidates[top_index], torch.full_like(top_index, fallback))
    is_fallback = (candidates == fallback).to(probabilities.dtype)  # (K,)
    fallback_prob = (probabilities * is_fallback).sum(dim=-1)  # (B,)
    return sizes, torch.where(confident, top_prob, fallback_prob).float()


# ---------------------------------------------------------------- model identity


def model_files_sha256(model_dir: str | Path) -> str:
    """SHA-256 over a model directory's weights (`*.safetensors`, sorted by name, name + bytes).

    Only weights are hashed, so a re-saved config.json (other transformers version) keeps the hash.
    Remembered across processes while the files' stat is unchanged (`files.remembered_digest`).

    Raises:
        UserError: the directory has no safetensors weights.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no *.safetensors weights to identify the model by; pass a model directory")
    return remembered_digest("model-weights-sha256", files, lambda: _hash_files(files))


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as stream:
            while chunk := stream.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- the ONNX policy


@dataclasses.dataclass(frozen=True)
class BlockSizeChoice:
    block_size: int
    probability: float  # the predictor's probability of `block_size`


@dataclasses.dataclass(frozen=True)
class PredictorInfo:
    """What a predictor's `metadata_props` say about it."""

    candidates: tuple[int, ...]
    feature_kind: str
    input_width: int
    objective: str
    b_train: int
    with_temperature: bool
    target_sha256: str
    drafter_sha256: str
    threshold: float
    cost_backend: str = ""  # where the step costs of throughput labels were measured ("" unknown / tau labels)
    cost_dtype: str = ""
    cost_machine: str = ""

    @classmethod
    def from_metadata(cls, props: dict[str, str], source: str) -> "PredictorInfo":
        if props.get("format") != PREDICTOR_FORMAT:
            raise UserError(f"{source} is not a BlockPilot predictor (no '{PREDICTOR_FORMAT}' metadata); "
                            "train one with `blockpilot train-predictor`")
        if int(props.get("version", 0)) != PREDICTOR_VERSION:
            raise UserError(f"{source} has predictor format version {props.get('version')}, this BlockPilot reads "
                            f"{PREDICTOR_VERSION}; retrain it with `blockpilot train-predictor`")
        return cls(
            candidates=tuple(json.loads(props["candidates"])),
            feature_kind=props["feature_kind"],
            input_width=int(props["input_width"]),
            objective=props["objective"],
            b_train=int(props["b_train"]),
            with_temperature=props["with_temperature"] == "true",
            target_sha256=props["target_sha256"],
            drafter_sha256=props["drafter_sha256"],
            threshold=float(props.get("threshold", "0")),
            cost_backend=props.get("cost_backend", ""),
            cost_dtype=props.get("cost_dtype", ""),
            cost_machine=props.get("cost_machine", ""),
        )

    def to_metadata(self) -> dict[str, str]:
        """The `metadata_props` that `from_metadata` reads back (format and version included)."""
        return {
            "format": PREDICTOR_FORMAT, "version": str(PREDICTOR_VERSION),
            "candidates": json.dumps(list(self.candidates)), "feature_kind": self.feature_kind,
            "input_width": str(self.input_width), "objective": self.objective, "b_train": str(self.b_train),
            "with_temperature": "true" if self.with_temperature else "false",
            "target_sha256": self.target_sha256, "drafter_sha256": self.drafter_sha256,
            "threshold": repr(self.threshold),
            **({"cost_backend": self.cost_backend, "cost_dtype": self.cost_dtype, "cost_machine": self.cost_machine}
               if self.cost_backend else {}),
        }

    def fits_precision(self, backend: str, dtype: str) -> bool:
        """True when the step costs behind the labels were measured on `backend` at `dtype` (or are unknown)."""
        return not self.cost_backend or (self.cost_backend, self.cost_dtype) == (backend, dtype)


class OnnxBlockSizePolicy:
    """Scores prefill features with an ONNX predictor (one onnxruntime session) and picks a block size.

    Args:
        path: predictor `.onnx` written by `blockpilot train-predictor`.
        threshold: follow the predictor only when its top probability is at least this; None uses
            the threshold stored in the predictor (0 unless chosen at training).
        fallback_block_size: block size when unsure, normally the drafter's B_train; None uses
            the B_train stored in the predictor.
    """

    def __init__(self, path: str | Path, *, threshold: float | None = None,
                 fallback_block_size: int | None = None):
        self.path = Path(path)
        self.session = _load_session(self.path)
        props = dict(self.session.get_modelmeta().custom_metadata_map)
        self.info = PredictorInfo.from_metadata(props, str(self.path))
        self.threshold = self.info.threshold if threshold is None else float(threshold)
        if not 0.0 <= self.threshold <= 1.0:
            raise UserError(f"predictor threshold {self.threshold} is not a probability; use a value in [0, 1]")
        self.fallback_block_size = fallback_block_size or self.info.b_train
        self.candidates = self.info.candidates
        self._candidates = torch.tensor(self.candidates, dtype=torch.int64)
        # temperatures the labels were made at (metadata "temperatures"; absent in older predictors: any)
        self.labelled_temperatures = tuple(json.loads(props["temperatures"])) if "temperatures" in props else None
        # the step-cost table the throughput labels were scored with (absent: no revision while decoding)
        self.revise_min_steps: int | None = None  # steps before a revision (None: never revise; see the module)
        self.revise_margin = REVISE_MARGIN
        self.step_costs = None
        if props.get("step_costs"):
            from blockpilot.builder.manifest import StepCosts

            self.step_costs = StepCosts.from_dict(json.loads(props["step_costs"]))

    def revise(self, block_size: int, accept_lengths: list[int], steps_at_size: int, supported) -> int:
        """The block size a request decoding at `block_size` should continue with (see the module
        docstring); `block_size` itself when revision is off (`revise_min_steps` None, the default),
        the predictor has no step-cost table, or the evidence is too thin.

        Args:
            block_size: the request's current block size.
            accept_lengths: tokens committed per verify step so far (all at sizes >= `block_size`).
            steps_at_size: how many of those steps ran at `block_size`.
            supported: `supported(k)` is True for block sizes the backend can run.
        """
        if self.step_costs is None or self.revise_min_steps is None:
            return block_size
        sizes = [k for k in self.candidates if k <= block_size and (k == 1 or supported(k))
                 and k in self.step_costs.target_ms and (k == 1 or k in self.step_costs.drafter_ms)]
        return revise_block_size(block_size, accept_lengths, steps_at_size, sizes, self.step_costs.step_ms,
                                 self.revise_min_steps, self.revise_margin)

    def probabilities(self, features: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
        """Predictor output `(B, K)` for features `(B, F)` (float32, CPU) at sampling `temperature`."""
        inputs = {FEATURES_INPUT: features.float().contiguous().numpy()}
        if self.info.with_temperature:
            inputs[TEMPERATURE_INPUT] = torch.full((features.shape[0], 1), float(temperature)).numpy()
        return torch.from_numpy(self.session.run([PROBABILITIES_OUTPUT], inputs)[0])

    def select(self, hidden: torch.Tensor, last_logits: torch.Tensor, temperature: float = 0.0) -> BlockSizeChoice:
        """Block size for one request from its prefill outputs.

        Args:
            hidden: `(1, P, H)` final-layer hidden states of the prompt.
            last_logits: `(1, V)` logits at the last prompt position.
            temperature: the request's sampling temperature (an input only for predictors trained with it).

        Returns:
            The chosen block size and the predictor's probability of it. A predictor without a
            temperature input whose labels were all made at other temperatures (more than
            `TEMPERATURE_TOLERANCE` away) does not choose: such requests decode plainly (block size
            1, probability 0). Measured with the T=0 predictor shipped for SmolLM2 on a 2-core CPU:
            at T=1 its choices ran at 0.84x plain decoding (40 HumanEval + 40 MT-Bench).
        """
        if not self.covers_temperature(temperature):
            return BlockSizeChoice(1, 0.0)
        features = prefill_features(self.info.feature_kind, hidden, last_logits)  # (1, F)
        sizes, probs = select_block_size(self.probabilities(features, temperature), self._candidates,
                                         self.fallback_block_size, self.threshold)
        return BlockSizeChoice(int(sizes[0]), float(probs[0]))

    def covers_temperature(self, temperature: float) -> bool:
        """True when the predictor can choose for a request at `temperature`: it takes temperature as an
        input, or its labels were made at a temperature within `TEMPERATURE_TOLERANCE` of it (or say nothing)."""
        if self.info.with_temperature or self.labelled_temperatures is None:
            return True
        return any(abs(float(temperature) - t) <= TEMPERATURE_TOLERANCE for t in self.labelled_temperatures)

    def check_fits(self, target_config, drafter_config, supports_block_size) -> None:
        """Raise `UserError` unless the predictor's input width and classes fit this runner.

        Args:
            target_config: the target's `DecoderConfig`.
            drafter_config: the drafter's `DrafterConfig`, or None without a drafter.
            supports_block_size: the backend's `supports_block_size(int) -> bool`.
        """
        kind, width = self.info.feature_kind, self.info.input_width
        expected = feature_width(kind, target_config)
        if width != expected:
            what = "hidden size" if kind == "pooled" else "vocabulary size"
            raise UserError(f"predictor {self.path} expects {width}-wide {kind} features but the target's {what} "
                            f"is {expected}; train a predictor for this target")
        if drafter_config is None:
            raise UserError(f"predictor {self.path} chooses block sizes {list(self.candidates)} but no drafter is "
                            "loaded; pass the drafter it was trained with")
        unsupported = [c for c in self.candidates if not supports_block_size(c)]
        if unsupported:
            raise UserError(f"predictor {self.path} may choose block size {unsupported[0]}, which this backend does "
                            f"not support; use a predictor whose candidates it supports, or rebuild for them")

    def check_precision(self, backend: str, dtype: str) -> None:
        """Raise `UserError` unless the predictor's step costs are those of `backend` at `dtype`."""
        if not self.info.fits_precision(backend, dtype):
            raise UserError(f"predictor {self.path} was labelled with {self.info.cost_backend} {self.info.cost_dtype} "
                            f"step costs, this runner is {backend} {dtype}; label and train one for it (blockpilot "
                            "label --step-costs ENGINE_DIR) or pass --predictor-any-backend to use it anyway")

    def check_models(self, target_dir: str | Path, drafter_dir: str | Path) -> None:
        """Raise `UserError` unless `target_dir` and `drafter_dir` hold the models the predictor was trained for."""
        for role, directory, expected in (("target", target_dir, self.info.target_sha256),
                                          ("drafter", drafter_dir, self.info.drafter_sha256)):
            actual = model_files_sha256(directory)
            if actual != expected:
                raise UserError(f"predictor {self.path} was trained for another {role} (weights sha256 "
                                f"{expected[:12]}, {directory} has {actual[:12]}); train a predictor for this {role}")


def load_policy(path: str | Path, backend, *, target_dir: str | Path, drafter_dir: str | Path | None,
                threshold: float | None = None, any_backend: bool = False) -> OnnxBlockSizePolicy:
    """An `OnnxBlockSizePolicy` checked against a runner's backend and model directories.

    Args:
        path: predictor `.onnx`.
        backend: the runner's backend (`target_config`, `drafter_config`, `supports_block_size`).
        target_dir, drafter_dir: the model directories the backend was loaded from.
        threshold: see `OnnxBlockSizePolicy`.
        any_backend: accept a predictor labelled with another backend's or dtype's step costs.

    Returns:
        The policy, falling back to the drafter's B_train.
    """
    from blockpilot.runtime.step_costs import backend_precision

    dc = backend.drafter_config
    policy = OnnxBlockSizePolicy(path, threshold=threshold, fallback_block_size=dc.block_size if dc else None)
    policy.check_fits(backend.target_config, dc, backend.supports_block_size)
    if not any_backend:
        policy.check_precision(*backend_precision(backend))
    policy.check_models(target_dir, drafter_dir)
    return policy


def _load_session(path: Path):
    """An onnxruntime CPU session on the package's shared thread pool (`runtime.ort_session`)."""
    if not path.is_file():
        raise UserError(f"predictor {path} not found; pass the .onnx written by `blockpilot train-predictor`")
    import onnxruntime as ort

    from blockpilot.runtime.ort_session import session_options

    try:
        return ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for unreadable models
        raise UserError(f"predictor {path} is not a readable ONNX model ({type(exc).__name__}); "
                        "retrain it with `blockpilot train-predictor`") from None
