"""`blockpilot answer`: the target's own answers to training prompts (drafter training data; sampled
answers are what `label --replay-answers` replays sampled decoding on)."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockpilot.commands.common import BACKENDS, add_device_arg, finite_float


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "answer",
        help="answer training prompts with the target (greedy or sampled, batched) into a JSONL file",
        description="Self-distillation data: the target answers each prompt greedily in fp32, batched: on the CPU through "
        "onnxruntime plain decoding with continuous batching (an engine directory), else transformers generate. "
        "Rows {source, prompt, answer, answer_ids, finish} are appended to --out; prompts already answered "
        "there are skipped, so rerunning resumes. Feed the file to `train-drafter --answers`, or to `label "
        "--replay-answers`. With --temperature above 0 every answer is one draw from the target's distribution "
        "(its seed derived from --seed and the prompt; the row records temperature, top_k, top_p and seed): "
        "replaying speculative decoding on such answers labels block sizes at that temperature exactly.",
    )
    p.add_argument("--target", type=Path, help="target model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", required=True,
                   help="JSONL file, one {\"prompt\": ...} a line (or {\"messages\": [...]}: a conversation ending "
                   "in the user turn to answer), or a training set: sharegpt, stdlib-code")
    p.add_argument("--out", type=Path, required=True, help="answers JSONL (appended to; resumes)")
    p.add_argument("--limit", type=int, help="answer only the first N prompts of the file")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most")
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    p.add_argument("--time-budget", type=finite_float, help="minutes; no new batch starts after it (resume later)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="onnxruntime: plain decoding of an engine directory's target, continuously batched (the "
                   "embedded default's cached engine dir, or --engine-dir); torch: transformers generate (default: "
                   "onnxruntime on the CPU when an engine dir is at hand, the embedded target or --engine-dir, "
                   "else torch)")
    p.add_argument("--engine-dir", type=Path,
                   help="engine directory of --target (from blockpilot build) for --backend onnxruntime")
    p.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: all cores)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass (1 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (each prompt's is derived from it and the prompt)")
    add_device_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from blockpilot.assets.prompts import load_train_prompts
    from blockpilot.devices import resolve_device
    from blockpilot.errors import UserError
    from blockpilot.runtime.sampling import SamplingParams
    from blockpilot.training.data import regenerate_answers

    for name in ("limit", "max_new_tokens", "batch_size", "time_budget", "threads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive (got {value})")
    if args.target is not None and not (args.target / "config.json").is_file():
        raise UserError(f"--target {args.target}: no config.json there; give a Hugging Face model dir")
    if args.backend == "tensorrt":
        raise UserError("answer runs on onnxruntime (the CPU, batched) or torch (any device); drop --backend tensorrt")
    if args.backend == "onnxruntime" and args.device not in ("auto", "cpu"):
        raise UserError(f"--backend onnxruntime runs on the CPU; drop --device {args.device} or use --backend torch")
    sampling = SamplingParams.checked(args.temperature, args.top_k, args.top_p,
                                      "; fix --temperature, --top-k or --top-p")
    device = resolve_device(args.device)
    prompts = load_train_prompts(args.prompts)[: args.limit]
    if args.out.is_dir():
        raise UserError(f"--out {args.out} is a folder; give the answers file to write (a .jsonl path)")
    backend = args.backend
    if backend is None:
        backend = "onnxruntime" if device == "cpu" and (args.target is None or args.engine_dir) else "torch"
    if backend == "onnxruntime":
        _answer_with_runner(args, prompts, sampling, *_onnxruntime_runner(args))
        print(f"answers in {args.out}")
        return 0
    if args.engine_dir is not None:
        raise UserError("--engine-dir is for --backend onnxruntime; drop it or choose that backend")
    if args.target is None:
        from blockpilot.assets.smollm2 import smollm2_dir

        args.target = smollm2_dir()
    if not sampling.greedy:  # sampled: the runtime's own sampler, plain decoding on torch
        from blockpilot.runtime.runner import Runner

        _answer_with_runner(args, prompts, sampling, Runner.from_dir(args.target, device=device), args.target)
        print(f"answers in {args.out}")
        return 0
    regenerate_answers(args.target, [p.text for p in prompts], max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, out_path=args.out, sources=[p.category for p in prompts],
                       device=device, time_budget_s=args.time_budget * 60 if args.time_budget else None,
                       histories=[p.history for p in prompts])
    print(f"answers in {args.out}")
    return 0


def _onnxruntime_runner(args: argparse.Namespace):
    """(runner, engine dir) for plain decoding on onnxruntime: --engine-dir, else the embedded default's."""
    from blockpilot.errors import UserError
    from blockpilot.runtime.runner import Runner

    engine_dir = args.engine_dir
    if engine_dir is None:
        if args.target is not None:
            raise UserError(f"--backend onnxruntime needs --engine-dir for --target {args.target}; build one with "
                            "`blockpilot build` or use --backend torch")
        from blockpilot.builder.embedded import embedded_engine_dir

        engine_dir = embedded_engine_dir()
    # plain decoding: no predictor (the directory's may be for another drafter while a new one is labelled)
    return Runner.from_engine_dir(engine_dir, backend="onnxruntime", threads=args.threads, use_predictor=False), engine_dir


def _answer_with_runner(args: argparse.Namespace, prompts, sampling, runner, tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    from blockpilot.training.data import answer_with_runner

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    answer_with_runner(runner, tokenizer, [p.text for p in prompts], max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, out_path=args.out, sources=[p.category for p in prompts],
                       time_budget_s=args.time_budget * 60 if args.time_budget else None, sampling=sampling,
                       seed=args.seed, histories=[p.history for p in prompts])
