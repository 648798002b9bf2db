"""What the commands share: one spelling and one parser per idea, and one way to open the models.

- Block-size lists (`--block-sizes`): ranges and commas mixed, `6-8,10` -> (6, 7, 8, 10).
- Dtypes (`--dtype`): `fp32`, `bf16`, `fp16`; the torch names `float32`, `bfloat16`, `float16` are
  accepted as aliases.
- `--device`: `auto` (CUDA when present, else the CPU), `cpu`, `cuda`, `cuda:N`; `auto` everywhere.
- The model options of generate, demo and profile (`add_model_args`) and their resolution into
  paths and a `Runner` (`resolve_models`, `open_runner`): the embedded SmolLM2 target with its
  shipped drafter and predictor unless told otherwise, a target + drafter directory pair, or an
  engine directory from `blockpilot build`.

Nothing here imports torch at module level, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from blockpilot.errors import UserError
from blockpilot.runtime.settings import DEFAULT_LOOKUP, DEFAULT_VERIFY_LENGTH, LOOKUPS, VERIFY_LENGTHS  # torch-free

DTYPES = ("fp32", "bf16", "fp16")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
BACKENDS = ("torch", "onnxruntime", "tensorrt")
DEVICE_HELP = "cpu, cuda, cuda:N or auto (CUDA when present, else the CPU)"
BLOCK_SIZES_EXAMPLE = "6-10 or 6-8,10"


# ---------------------------------------------------------------- parsers


def parse_dtype(text: str) -> str:
    """`"fp32"`, `"bf16"` or `"fp16"` from one of those or its torch name (`"bfloat16"`, ...).

    Raises:
        UserError: any other name.
    """
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise UserError(f"dtype {text!r} is not one of {', '.join(DTYPES)} "
                        f"(or {', '.join(DTYPE_ALIASES)})")
    return name


def torch_dtype(name: str):
    """The `torch.dtype` for a name `parse_dtype` accepts."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[parse_dtype(name)]


def parse_block_sizes(text: str, keywords: tuple[str, ...] = ()) -> tuple:
    """Block sizes from a comma list of sizes and inclusive ranges, e.g. `"6-8,10"` -> (6, 7, 8, 10).

    Sizes come back sorted and distinct; words in `keywords` (e.g. profile's `auto`) are kept as
    strings after them, in the order given.

    Raises:
        UserError: a part is neither a size >= 1, a range low-high with low <= high, nor a keyword;
            or the text names nothing.
    """
    sizes: set[int] = set()
    words: list[str] = []
    for part in (p.strip() for p in str(text).split(",")):
        if part in keywords:
            words += [part] if part not in words else []
            continue
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise UserError(_bad_block_sizes(text, part, keywords)) from None
        if first < 1 or last < first:
            raise UserError(_bad_block_sizes(text, part, keywords))
        sizes.update(range(first, last + 1))
    return (*sorted(sizes), *words)


def _bad_block_sizes(text: str, part: str, keywords: tuple[str, ...]) -> str:
    extra = f", or {', '.join(keywords)}" if keywords else ""
    what = repr(part) if part else "an empty entry"
    return (f"block sizes {text!r}: {what} is not a size >= 1 or a range like 6-10{extra}; "
            f"write e.g. {BLOCK_SIZES_EXAMPLE}")


def parse_block_size(text: str | None) -> int | str | None:
    """One block size: None (the runner's default), `"auto"` (the predictor) or an int; the
    runner checks the range."""
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--block-size {text!r} is not an integer or 'auto'; pass e.g. --block-size 8") from None


def finite_float(text: str) -> float:
    """A number option (argparse `type=`): `float`, less the NaN and infinities it also parses, which every
    such option here would carry into its arithmetic (a NaN temperature sampled NaN probabilities)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def argument_type(parse, *args):
    """`parse` as an argparse `type=`: its `UserError` becomes argparse's one-line usage error."""
    def convert(text: str):
        try:
            return parse(text, *args)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


# ---------------------------------------------------------------- argparse


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already states its default or
    there is none to state (None, False, or a `required` option)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or any(default is none for none in (None, False, argparse.SUPPRESS))
                or default == [] or action.required or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The parser of every command: `HelpFormatter`, and a usage error on one line (exit 2) like a
    `UserError`, naming `--help`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def add_device_arg(parser) -> None:
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def add_dtype_arg(parser, help_text: str, default: str | None = "fp32") -> None:
    parser.add_argument("--dtype", type=argument_type(parse_dtype), default=default,
                        metavar="{" + ",".join(DTYPES) + "}", help=help_text)


LOOKUP_HELP = ("which requests copy their draft from the context where its last tokens occurred before, instead "
               "of calling the drafter (prompt lookup; lossless): all (default), greedy (T = 0 requests only), off")


def comma_list(text: str) -> list[str]:
    """`"a, b,,c"` -> ["a", "b", "c"]."""
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_lookups(text: str) -> list[str]:
    """`greedy,off` -> ["greedy", "off"] (each value once, in order)."""
    return parse_choices(text, LOOKUPS, "lookup")


VERIFY_LENGTH_HELP = ("how many rows of a greedy request's drafted block a step verifies (lossless either way): "
                      "adaptive (default: the leading drafts the drafter is sure enough of to pay for their rows, "
                      "priced by the engine dir's or the predictor's step-cost table), full (every row)")


def parse_choices(text: str, choices: tuple[str, ...], what: str) -> list[str]:
    """`a,b` -> ["a", "b"]: each value once, in order, every one of `choices` (else a `UserError`)."""
    values = list(dict.fromkeys(comma_list(text)))
    unknown = [v for v in values if v not in choices]
    if unknown or not values:
        raise UserError(f"{what} values {text!r}: give one or more of {', '.join(choices)}, comma-separated")
    return values


def add_lookup_arg(parser, many: bool = False) -> None:
    """`--lookup` (`Runner.lookup`); with `many` (profile) a comma list, one system per value."""
    if many:
        parser.add_argument("--lookup", type=argument_type(parse_lookups), default=[DEFAULT_LOOKUP], metavar="LIST",
                            help=LOOKUP_HELP + "; a comma list (e.g. greedy,off) profiles each block size once per "
                            "value, the systems of later values named with a -lookup-VALUE suffix")
    else:
        parser.add_argument("--lookup", choices=LOOKUPS, default=DEFAULT_LOOKUP, help=LOOKUP_HELP)


def add_verify_length_arg(parser, many: bool = False) -> None:
    """`--verify-length` (`Runner.verify_length`); with `many` (profile) a comma list, one system per value."""
    if many:
        parser.add_argument("--verify-length", type=argument_type(
            lambda text: parse_choices(text, VERIFY_LENGTHS, "verify length")), default=[DEFAULT_VERIFY_LENGTH], metavar="LIST",
            help=VERIFY_LENGTH_HELP + "; a comma list (e.g. adaptive,full) profiles each block size once per value, "
            "the systems of later values named with a -verify-VALUE suffix")
    else:
        parser.add_argument("--verify-length", choices=VERIFY_LENGTHS, default=DEFAULT_VERIFY_LENGTH, help=VERIFY_LENGTH_HELP)


def add_model_args(parser, *, peers: bool = False) -> None:
    """The model options of generate, demo and profile, in one argument group.

    With `peers` (profile) `--target`/`--drafter` may accompany `--engine-dir`: they are then the
    transformers peers' models.
    """
    group = parser.add_argument_group("models (default: the embedded SmolLM2-135M-Instruct, its shipped "
                                      "drafter and predictor)")
    group.add_argument("--target", type=Path, help="Hugging Face target model dir")
    group.add_argument("--drafter", type=Path, help="DFlash drafter dir (z-lab format); without one, and "
                       "with a --target of your own, decoding is autoregressive")
    group.add_argument("--engine-dir", type=Path,
                       help="engine dir from `blockpilot build` (holds its own target, drafter and predictor)"
                       + ("; the transformers peers use its target and drafter unless --target/--drafter "
                          "are given" if peers else "; not with --target/--drafter"))
    group.add_argument("--predictor", type=Path, help="block-size predictor .onnx (blockpilot train-predictor) "
                       "for block size auto; overrides the shipped one or the engine dir's")
    group.add_argument("--predictor-any-backend", action="store_true",
                       help="use a predictor labelled with another backend's or dtype's step costs (refused "
                       "otherwise: its choices trade tau against costs that do not hold here)")
    group.add_argument("--backend", choices=BACKENDS,
                       help="runtime backend; model dirs run on torch, an engine dir by default on the "
                       "fastest usable one (tensorrt with engines and a GPU, else onnxruntime for fp32/fp16)")
    add_device_arg(group)
    add_dtype_arg(group, "weights' precision for model dirs (default: fp32); an engine dir runs at the "
                  "dtype it was built with", default=None)


# ---------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """Where the models come from, resolved from the command line.

    `target` and `drafter` are the Hugging Face / z-lab directories (for an engine dir: its copies,
    or the user's with `peers`); `tokenizer` is where the tokenizer files are; `device` is a torch
    device string; `runner_device` is what `Runner.from_dir` gets (None lets an engine dir's
    backend pick); `dtype` a name of `DTYPES`.
    """

    target: Path
    drafter: Path | None
    predictor: Path | None
    engine_dir: Path | None
    tokenizer: Path
    backend: str | None
    device: str
    runner_device: str | None
    dtype: str
    embedded_engine: bool = False  # the engine dir is the embedded default's cached one
    predictor_any_backend: bool = False  # accept a predictor labelled for another backend or dtype


def resolve_models(args: argparse.Namespace, *, peers: bool = False) -> ModelChoice:
    """Check the model options of `add_model_args` and fill in the defaults.

    A `--target` that is an engine directory counts as `--engine-dir`.

    Raises:
        UserError: a path that does not exist (naming its flag), an engine dir combined with
            model dirs (unless `peers`), a backend other than torch for model dirs, a dtype
            different from an engine dir's.
    """
    from blockpilot.devices import resolve_device

    target, drafter, predictor, engine = args.target, args.drafter, args.predictor, args.engine_dir
    for path, flag in ((engine, "--engine-dir"), (target, "--target"), (drafter, "--drafter")):
        if path is not None and not Path(path).is_dir():
            raise UserError(f"{flag} {path}: no such model directory")
    if predictor is not None and not Path(predictor).is_file():
        raise UserError(f"--predictor {predictor}: no such file")
    if engine is None and target is not None and (Path(target) / "manifest.json").is_file():
        if drafter is not None:
            raise UserError(f"--target {target} is an engine directory with its own drafter; drop --drafter")
        engine, target = Path(target), None
    device = resolve_device(args.device)
    if engine is not None:
        return _engine_choice(args, engine, target, drafter, predictor, device, peers)
    if args.backend not in (None, "torch"):
        raise UserError(f"--backend {args.backend} runs an engine directory; build one with `blockpilot build` "
                        "and pass --engine-dir, or use --backend torch")
    if target is None and drafter is None and _embedded_engine_applies(args, device):
        from blockpilot.builder.embedded import embedded_engine_dir

        return _engine_choice(args, embedded_engine_dir(), None, None, predictor, device, peers, embedded=True)
    if target is None:
        target, drafter, shipped = _embedded_default(drafter, predictor)
        predictor = predictor or _shipped_predictor_for(shipped, "torch", args.dtype or "fp32", args)
    return ModelChoice(target, drafter, predictor, None, target, "torch", device, device, args.dtype or "fp32",
                       predictor_any_backend=_any_backend(args))


def _any_backend(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "predictor_any_backend", False))


def _shipped_predictor_for(path: Path | None, backend: str, dtype: str, args: argparse.Namespace) -> Path | None:
    """The shipped predictor when its step costs are this backend's and dtype's (or the user overrides), else
    None: the embedded default then decodes at its default block size instead of refusing to start."""
    if path is None or _any_backend(args):
        return path
    from blockpilot.runtime.policy import OnnxBlockSizePolicy

    return path if OnnxBlockSizePolicy(path).info.fits_precision(backend, dtype) else None


def _embedded_engine_applies(args: argparse.Namespace, device: str) -> bool:
    """The embedded default runs from its cached fp32 engine directory on onnxruntime (the fastest
    lossless CPU path) unless the user asks for torch, another dtype, or a CUDA device."""
    from blockpilot.assets import default_drafter_dir

    if args.backend not in (None, "onnxruntime") or (args.dtype or "fp32") != "fp32" or device != "cpu":
        return False
    try:
        default_drafter_dir()
    except UserError:  # the package ships no drafter: nothing to build
        return False
    return True


def _engine_choice(args, engine: Path, target, drafter, predictor, device: str, peers: bool,
                   embedded: bool = False) -> ModelChoice:
    from blockpilot.builder.manifest import read_manifest

    if not peers and (target is not None or drafter is not None):
        raise UserError(f"--engine-dir {engine} holds its own target and drafter; drop --target/--drafter")
    manifest = read_manifest(engine, verify_files=False)
    if args.dtype is not None and args.dtype != manifest.dtype:
        raise UserError(f"--dtype {args.dtype}: the engine dir {engine} was built in {manifest.dtype}; drop "
                        f"--dtype or rebuild it with `blockpilot build --dtype {args.dtype}`")
    target = target or engine / manifest.target_dir
    drafter = drafter or engine / manifest.drafter_dir
    tokenizer = engine if manifest.tokenizer_files else target
    # "auto" lets the engine dir pick its backend (onnxruntime runs on the CPU only); an explicit
    # device, or the torch backend, gets the resolved device.
    runner_device = None if args.device == "auto" and args.backend != "torch" else device
    return ModelChoice(target, drafter, predictor, engine, tokenizer, args.backend, device, runner_device,
                       manifest.dtype, embedded, _any_backend(args))


def _embedded_default(drafter: Path | None, predictor: Path | None) -> tuple[Path, Path | None, Path | None]:
    """The embedded SmolLM2 target, its shipped drafter unless `drafter` is given (None when the
    package ships none), and the shipped predictor for the shipped drafter unless `predictor` is given."""
    from blockpilot.assets import default_drafter_dir, default_predictor_path
    from blockpilot.assets.smollm2 import smollm2_dir

    if drafter is None:
        try:
            drafter = default_drafter_dir()
        except UserError:
            return smollm2_dir(), None, predictor
        predictor = predictor or default_predictor_path()
    return smollm2_dir(), drafter, predictor


@dataclasses.dataclass(frozen=True)
class OpenedRunner:
    runner: object  # a `Runner`
    choice: ModelChoice
    note: str | None  # for stderr: why decoding will be autoregressive, if it will


def _open_engine_runner(choice: ModelChoice):
    from blockpilot.runtime.runner import Runner

    def open_it(engine_dir: Path):
        return Runner.from_dir(engine_dir, backend=choice.backend, device=choice.runner_device,
                               predictor=choice.predictor, predictor_any_backend=choice.predictor_any_backend)

    if not choice.embedded_engine:
        return open_it(choice.engine_dir)
    from blockpilot.builder.embedded import discard, embedded_engine_dir

    try:
        return open_it(choice.engine_dir)
    except UserError:  # a damaged cache (a file changed or went missing): build it again
        discard(choice.engine_dir)
        return open_it(embedded_engine_dir())


def open_runner(args: argparse.Namespace) -> OpenedRunner:
    """The `Runner` for the model options of `args` (see `add_model_args`), with where its models
    came from and a note when decoding will be autoregressive (no drafter)."""
    from blockpilot.runtime.runner import Runner

    choice = resolve_models(args)
    if choice.engine_dir is not None:
        runner = _open_engine_runner(choice)
    else:
        runner = Runner.from_dir(choice.target, drafter_dir=choice.drafter, backend=choice.backend,
                                 device=choice.runner_device, dtype=torch_dtype(choice.dtype),
                                 predictor=choice.predictor, predictor_any_backend=choice.predictor_any_backend)
    runner.lookup = getattr(args, "lookup", runner.lookup)
    runner.verify_length = getattr(args, "verify_length", runner.verify_length)
    note = None
    if runner.backend.drafter_config is None:
        note = "no drafter, decoding autoregressively (block size 1); pass --drafter DIR for speculation"
    return OpenedRunner(runner, choice, note)
