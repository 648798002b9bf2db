"""train-drafter end to end: answers -> sequences -> cached target taps -> training -> drafter dir."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

from blockpilot.devices import resolve_device
from blockpilot.errors import UserError
from blockpilot.models.checkpoint import load_drafter, load_target, save_drafter
from blockpilot.models.config import DecoderConfig, DrafterConfig, check_drafter_fits_target, default_target_layer_ids
from blockpilot.models.dflash import DFlashDrafter
from blockpilot.text import load_tokenizer
from blockpilot.training.data import read_answer_rows, regenerate_answers, row_key, tokenize_rows
from blockpilot.training.features import cached_taps, extract_features, feature_bytes, load_cached_taps
from blockpilot.training.objective import default_gamma
from blockpilot.training.trainer import MAX_STEPS_UNSET, TrainConfig, TrainData, Trainer


def drafter_config_for(target: DecoderConfig, *, block_size: int, layers: int, taps: int,
                       mask_token_id: int) -> DrafterConfig:
    """Qwen3-style drafter layers with the target's sizes (RoPE included), DFlash tap choice."""
    shape = dataclasses.replace(target, family="qwen3", qk_norm=True, num_hidden_layers=layers,
                                tie_word_embeddings=False, attention_bias=False)
    return DrafterConfig(layers=shape, block_size=block_size, mask_token_id=mask_token_id,
                         target_layer_ids=default_target_layer_ids(target.num_hidden_layers, taps),
                         num_target_layers=target.num_hidden_layers)


def _check_args(args) -> list:
    """Check the arguments; returns the training prompts to answer first (none without --regenerate),
    loaded here so that a bad file, an evaluation set or a leaked prompt fails before any work."""
    if not args.time_budget or args.time_budget <= 0:
        raise UserError(f"--time-budget must be a positive number of minutes (got {args.time_budget})")
    if not 0.0 <= args.distill <= 1.0:
        raise UserError(f"--distill must be between 0 and 1 (got {args.distill}); 0 trains on hard labels only")
    if args.distill and args.distill_top_k < 1:
        raise UserError(f"--distill-top-k must be >= 1 (got {args.distill_top_k})")
    if args.distill and args.distill_temperature <= 0:
        raise UserError(f"--distill-temperature must be > 0 (got {args.distill_temperature})")
    if args.block_size < 2:
        raise UserError(f"--block-size must be >= 2 for a drafter (got {args.block_size})")
    for flag, value in (("--lr", args.lr), ("--gamma", args.gamma)):
        if value is not None and value <= 0:  # --gamma None: its default for the block size
            raise UserError(f"{flag} must be > 0 (got {value})")
    for flag, value in (("--eval-every", args.eval_every), ("--checkpoint-every", args.checkpoint_every)):
        if value < 0:  # 0: at every step
            raise UserError(f"{flag} must be >= 0 minutes (got {value})")
    for flag, value, low in (("--sequences-per-step", args.sequences_per_step, 1), ("--anchors", args.anchors, 1),
                             ("--valid", args.valid, 0), ("--max-len", args.max_len, args.block_size + 1)):
        if value < low:
            raise UserError(f"{flag} must be >= {low} (got {value})")
    if args.max_steps is not None and args.max_steps < 1:
        raise UserError(f"--max-steps must be >= 1 (got {args.max_steps})")
    if not args.answers and not (args.prompts and args.regenerate > 0):
        raise UserError("no training data: pass --answers FILE and/or --prompts FILE|SET --regenerate N")
    for path in args.answers:
        if not Path(path).is_file():
            raise UserError(f"cannot read {path}: no such file; check the path")
    if not (args.prompts and args.regenerate > 0):
        return []
    from blockpilot.assets.prompts import load_train_prompts

    return load_train_prompts(args.prompts)[: args.regenerate]


def _resolve_target(args) -> tuple[Path, int | None]:
    if args.target is not None:
        return args.target, args.mask_token_id
    from blockpilot.assets.smollm2 import SMOLLM2_MASK_TOKEN_ID, smollm2_dir

    return smollm2_dir(), args.mask_token_id if args.mask_token_id is not None else SMOLLM2_MASK_TOKEN_ID


def _gather_rows(args, prompts, target_dir: Path, work_dir: Path) -> list[dict]:
    rows = [row for path in args.answers for row in read_answer_rows(path)]
    if prompts:
        out = regenerate_answers(target_dir, [p.text for p in prompts], max_new_tokens=args.gen_max_new_tokens,
                                 batch_size=args.gen_batch_size, out_path=work_dir / "regenerated_answers.jsonl",
                                 sources=[p.category for p in prompts], device=args.device,
                                 histories=[p.history for p in prompts])
        rows += read_answer_rows(out)
    return rows


def _features(args, prompts, target, tokenizer, target_dir: Path, work_dir: Path, tap_layers):
    rows = _gather_rows(args, prompts, target_dir, work_dir)
    key = hashlib.sha256(json.dumps({
        "target": str(Path(target_dir).resolve()), "taps": list(tap_layers), "max_len": args.max_len,
        "rows": hashlib.sha256("".join(row_key(r) + r["answer"] for r in rows).encode()).hexdigest(),
    }, sort_keys=True).encode()).hexdigest()[:16]
    top_k = args.distill_top_k if args.distill else 0
    on_cpu = torch.device(args.device).type == "cpu"  # on a GPU recomputing takes seconds; writing tens of GB does not
    cached = load_cached_taps(work_dir / "features", key, top_k) if on_cpu else None
    if cached is not None:
        return cached
    sequences = tokenize_rows(rows, tokenizer, args.max_len)
    if not on_cpu:
        need = feature_bytes(sequences, len(tap_layers) * target.config.hidden_size, top_k)
        free = torch.cuda.mem_get_info(torch.device(args.device))[0] if torch.device(args.device).type == "cuda" else None
        where = features_device(need, free, host_available_bytes(), args.device)
        return (sequences, *extract_features(target, sequences, tuple(tap_layers), top_k=top_k, out_device=where))
    return (sequences, *cached_taps(work_dir / "features", target, sequences, tuple(tap_layers), key, top_k=top_k))


FEATURES_GPU_SHARE = 0.5
"""A GPU run keeps the target features on the GPU while they take at most this share of its free memory."""


def features_device(need: int, gpu_free: int | None, host_available: int | None, device: str) -> torch.device:
    """Where a run on an accelerator keeps its target features (`need` bytes): on `device` while they fit
    `FEATURES_GPU_SHARE` of its free memory (`gpu_free`, None: unknown, kept there), else in host memory,
    each step's batch moved to the device (the SmolLM2 drafter's 39k training sequences of data/ are 69 GB of
    taps: more than an H100 holds, or an H200 beside a second run).

    Raises:
        UserError: they fit neither (`host_available`, None: unknown, not checked).
    """
    gb = 1e9
    if gpu_free is None or need <= FEATURES_GPU_SHARE * gpu_free:
        return torch.device(device)
    if host_available is not None and need > 0.9 * host_available:
        raise UserError(f"the target features of these answers take {need / gb:.1f} GB: more than half of the "
                        f"{gpu_free / gb:.1f} GB free on {device} and than the {host_available / gb:.1f} GB of host "
                        f"memory available; train on fewer answers (or shorter ones: --max-len)")
    print(f"target features: {need / gb:.1f} GB, more than half of the {gpu_free / gb:.1f} GB free on {device}: "
          "kept in host memory, each step's batch moved to the device", flush=True)
    return torch.device("cpu")


def host_available_bytes() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as stream:
            line = next(line for line in stream if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def train_drafter_from_args(args: argparse.Namespace) -> Path:
    for name, default in (("init_from", None), ("distill", 0.0), ("distill_top_k", 32), ("distill_temperature", 1.0)):
        if not hasattr(args, name):  # namespaces built in code may predate the option
            setattr(args, name, default)
    prompts = _check_args(args)
    args.device = resolve_device(args.device)
    target_dir, mask_token_id = _resolve_target(args)
    if mask_token_id is None:
        raise UserError("--mask-token-id is required for this target: pick a special token it never uses")
    target = load_target(target_dir).to(args.device)
    drafter = _initial_drafter(args, target.config, mask_token_id)
    config = drafter.config
    work_dir = args.work_dir or args.out.with_name(args.out.name + ".work")
    _check_resume(work_dir, target.config, args.resume)  # before the target's features, which take minutes
    work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(target_dir)
    sequences, taps, soft = _features(args, prompts, target, tokenizer, target_dir, work_dir, config.target_layer_ids)
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(args.seed)).tolist()
    items = [(sequences[i], taps[i]) if soft is None else (sequences[i], taps[i], soft[i]) for i in order]
    data = TrainData(train=items[args.valid:], valid=items[: args.valid])
    drafter = drafter.to(args.device)
    train_config = TrainConfig(
        time_budget_s=args.time_budget * 60, max_steps=args.max_steps or MAX_STEPS_UNSET,
        sequences_per_step=args.sequences_per_step,
        anchors_per_sequence=args.anchors, lr=args.lr, gamma=args.gamma or default_gamma(args.block_size),
        distill=args.distill, distill_temperature=args.distill_temperature,
        eval_every_s=args.eval_every * 60, checkpoint_every_s=args.checkpoint_every * 60,
        autocast=not args.no_autocast, seed=args.seed, device=args.device)
    trainer = Trainer(drafter, target, data, train_config, work_dir)
    if args.resume and not trainer.load_checkpoint():  # `_check_resume` found it at the start
        raise UserError(f"--resume: the checkpoint in {work_dir} went away while the run started; run again")
    began = time.time()
    log = trainer.run()
    summary = {"steps": trainer.step, "train_seconds": round(trainer.elapsed, 1), "sequences": len(data.train),
               "init_from": str(args.init_from) if args.init_from else None,
               "answer_files": [str(path) for path in args.answers],
               "hardware": _hardware(args.device),
               "answer_tokens": sum(len(item[0].ids) - item[0].answer_start for item in data.train),
               "config": dataclasses.asdict(train_config), "log": log, "wall_seconds_this_run": round(time.time() - began)}
    save_drafter(drafter.half(), args.out, extra_files={"training_log.json": json.dumps(summary, indent=1)})
    print(f"drafter written to {args.out} (steps {trainer.step}, simulated tau {log[-1].get('sim_tau')})")
    return args.out


def _initial_drafter(args, target: DecoderConfig, mask_token_id: int) -> DFlashDrafter:
    """A fresh drafter of the requested shape (seeded), or `--init-from`'s weights (and draft vocabulary)
    to continue training from, checked against the target and the requested shape."""
    if args.init_from is None:
        config = drafter_config_for(target, block_size=args.block_size, layers=args.layers, taps=args.taps,
                                    mask_token_id=mask_token_id)
        check_drafter_fits_target(target, config, where="the requested drafter")
        torch.manual_seed(args.seed)
        return DFlashDrafter(config)
    if not (Path(args.init_from) / "config.json").is_file():
        raise UserError(f"--init-from {args.init_from}: no drafter there (no config.json); give a drafter directory")
    drafter = load_drafter(args.init_from)
    check_drafter_fits_target(target, drafter.config, where=f"--init-from {args.init_from}")
    c = drafter.config
    wanted = {"--block-size": (args.block_size, c.block_size), "--layers": (args.layers, c.layers.num_hidden_layers),
              "--taps": (args.taps, len(c.target_layer_ids)), "--mask-token-id": (mask_token_id, c.mask_token_id)}
    for flag, (asked, has) in wanted.items():
        if asked != has:
            raise UserError(f"--init-from {args.init_from} has {flag.removeprefix('--')} {has}, not {asked}; "
                            f"pass {flag} {has} or start from scratch without --init-from")
    return drafter


def _check_resume(work_dir: Path, target: DecoderConfig, resume: bool) -> None:
    """A resumed run needs a checkpoint, made for the same target."""
    if not resume:
        return
    ckpt = work_dir / "checkpoint" / "config.json"
    if ckpt.is_file():
        saved = DrafterConfig.from_dict(json.loads(ckpt.read_text()), str(ckpt))
        check_drafter_fits_target(target, saved, where=f"the checkpoint in {work_dir}")
    if not (work_dir / "checkpoint" / "train_state.pt").is_file():
        raise UserError(f"--resume: no checkpoint in {work_dir}; run without --resume first")


def _hardware(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    import os
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}"
