"""The drafter training loop: AdamW, warm-up + cosine schedule, time budget, resumable checkpoints.

The schedule is fitted to the time budget: the step rate measured after a few warm-up steps (which
pay one-off costs such as CUDA initialisation) fixes the total number of steps, refined a few times
early in the run, so the cosine reaches zero when the budget ends. A checkpoint (drafter weights in
safetensors + optimizer state loadable with `weights_only=True`) is written every few minutes into
the work directory; `resume=True` continues from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from blockpilot.errors import UserError
from blockpilot.models.checkpoint import load_drafter, save_drafter
from blockpilot.models.decoder import Decoder
from blockpilot.models.dflash import DFlashDrafter
from blockpilot.training.data import Sequence
from blockpilot.training.objective import Batch, DraftHead, drafter_loss, sample_anchors, simulated_tau


MAX_STEPS_UNSET = 1_000_000
"""`max_steps` when only the time budget bounds a run (the schedule is then fitted to the budget)."""


@dataclasses.dataclass
class TrainConfig:
    time_budget_s: float
    max_steps: int = MAX_STEPS_UNSET
    sequences_per_step: int = 8
    anchors_per_sequence: int = 16
    lr: float = 6e-4
    warmup_frac: float = 0.04
    clip: float = 1.0
    gamma: float = 7.0
    distill: float = 0.0
    """Weight of the target's own distribution in every slot's target (0: hard labels only)."""
    distill_temperature: float = 1.0
    eval_every_s: float = 300.0
    checkpoint_every_s: float = 600.0
    autocast: bool = True
    length_group: int = 4
    """Sequences per length-sorted sub-batch of a step (see `make_length_groups`)."""
    seed: int = 0
    device: str = "cpu"

    def autocast_context(self):
        """bf16 autocast on the training device (disabled with `autocast=False`)."""
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.autocast)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the products: bf16 under autocast (AVX512-BF16 / AMX kernels where the CPU
        has them, tensor cores on CUDA), else fp32."""
        return torch.bfloat16 if self.autocast else torch.float32


Item = tuple  # (Sequence, taps (L, tH)) or (Sequence, taps, SoftLabels)
"""One training sequence with its cached target features."""


@dataclasses.dataclass
class TrainData:
    train: list[Item]
    valid: list[Item]


def make_batch(items: list[Item], anchors: int, generator: torch.Generator, device: str = "cpu") -> Batch:
    """Right-pad `items` (sequence, taps[, soft labels]) and draw `anchors` anchors in each answer, on `device`.

    Anchors are drawn on the CPU with `generator` (so runs are reproducible on any device); the taps
    are padded where they live (GPU memory when the features were extracted there)."""
    width = max(len(item[0].ids) for item in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    taps = torch.nn.utils.rnn.pad_sequence([item[1] for item in items], batch_first=True)
    soft_ids = soft_logprobs = None
    if all(len(item) > 2 for item in items):
        soft_ids = torch.nn.utils.rnn.pad_sequence([item[2].ids.long() for item in items], batch_first=True)
        soft_logprobs = torch.nn.utils.rnn.pad_sequence([item[2].logprobs for item in items], batch_first=True)
    anchor_pos = torch.zeros(len(items), anchors, dtype=torch.long)
    valid = torch.zeros(len(items), anchors, dtype=torch.bool)
    for row, (seq, *_) in enumerate(items):
        ids[row, : len(seq.ids)] = torch.tensor(seq.ids)
        drawn = sample_anchors(seq.answer_start, len(seq.ids), anchors, generator)
        anchor_pos[row, : len(drawn)] = drawn
        valid[row, : len(drawn)] = True
    lengths = torch.tensor([len(item[0].ids) for item in items])
    return Batch(ids, taps, lengths, anchor_pos, valid, soft_ids, soft_logprobs).to(device)


def make_length_groups(items: list[Item], anchors: int, generator: torch.Generator,
                       device: str = "cpu", group_size: int = 4) -> list[Batch]:
    """`items` sorted by length and cut into batches of `group_size`, each padded to its own longest:
    a block's attention spans its batch's padded length, so similar lengths waste little."""
    ordered = sorted(items, key=lambda item: len(item[0].ids))
    return [make_batch(ordered[i:i + group_size], anchors, generator, device) for i in range(0, len(ordered), group_size)]


def lr_factor(step: int, total: int, warmup_frac: float) -> float:
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target: Decoder, data: list[Item],
             config: TrainConfig, head: DraftHead | None = None) -> dict:
    """Simulated tau and slot-1 accuracy on validation sequences (fixed anchors), overall and per data
    source (`sim_tau/<source>`) when there are several; drafts range over `head` (default: the
    drafter's draft vocabulary of the target's lm_head). With soft labels also `sim_tau_t1`: the expected
    tau of drafts drawn from the drafter at T = 1 and accepted by rejection sampling (anchored, lower bound)."""
    head = head or DraftHead.of(drafter, target.lm_head.weight, config.compute_dtype)
    generator = torch.Generator().manual_seed(1234)
    sources = sorted({item[0].source for item in data})
    correct, valid, accept, per_source = [], [], [], {}
    for source in sources:
        items = [item for item in data if item[0].source == source]
        c_src, v_src, a_src = [], [], []
        for start in range(0, len(items), config.sequences_per_step):
            batches = make_length_groups(items[start:start + config.sequences_per_step], 32, generator, config.device,
                                         config.length_group)
            with config.autocast_context():
                _, stats = drafter_loss(drafter, target.embed_tokens.weight, head, batches, config.gamma)
            c_src.append(stats["correct"])
            v_src.append(stats["valid"])
            if "accept" in stats:
                a_src.append(stats["accept"])
        per_source[f"sim_tau/{source or 'unnamed'}"] = simulated_tau(torch.cat(c_src), torch.cat(v_src))
        correct += c_src
        valid += v_src
        accept += a_src
    c, v = torch.cat(correct), torch.cat(valid)
    metrics = {"sim_tau": simulated_tau(c, v), "slot1_acc": float(c[:, 0][v[:, 0]].float().mean())}
    if len(accept) == len(correct):
        metrics["sim_tau_t1"] = simulated_tau(torch.cat(accept), v)
    return {**metrics, **per_source} if len(sources) > 1 else metrics


class Trainer:
    def __init__(self, drafter: DFlashDrafter, target: Decoder, data: TrainData, config: TrainConfig,
                 work_dir: Path):
        self.drafter, self.target, self.data, self.config = drafter, target, data, config
        self.work_dir = work_dir
        for p in target.parameters():
            p.requires_grad_(False)
        self.head = DraftHead.of(drafter, target.lm_head.weight, config.compute_dtype)  # gathered and cast once
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
        self.step, self.total_steps, self.elapsed = 0, config.max_steps, 0.0
        self.generator = torch.Generator().manual_seed(config.seed)
        self.log: list[dict] = []

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> None:
        ckpt = self.work_dir / "checkpoint"
        save_drafter(self.drafter, ckpt)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step, "total_steps": self.total_steps,
                    "elapsed": self.elapsed, "max_steps": self.config.max_steps, "generator": self.generator.get_state()}, ckpt / "train_state.pt")
        (self.work_dir / "train_log.json").write_text(json.dumps(self.log, indent=1))

    def load_checkpoint(self) -> bool:
        ckpt = self.work_dir / "checkpoint"
        if not (ckpt / "train_state.pt").is_file():
            return False
        saved = load_drafter(ckpt)
        if saved.config != self.drafter.config:
            raise UserError(f"checkpoint in {ckpt} was made with other drafter settings; drop --resume or use another --work-dir")
        self.drafter.load_state_dict(saved.state_dict())
        state = torch.load(ckpt / "train_state.pt", weights_only=True, map_location=self.config.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.total_steps, self.elapsed = state["step"], state["total_steps"], state["elapsed"]
        if self.total_steps == state["max_steps"]:  # the schedule was set by --max-steps, not the budget
            self.total_steps = self.config.max_steps
        self.generator.set_state(state["generator"].cpu())
        log_path = self.work_dir / "train_log.json"
        self.log = json.loads(log_path.read_text()) if log_path.is_file() else []
        return True

    # ------------------------------------------------------------ loop

    def train_step(self) -> float:
        c = self.config
        picks = torch.randint(len(self.data.train), (c.sequences_per_step,), generator=self.generator).tolist()
        batches = make_length_groups([self.data.train[i] for i in picks], c.anchors_per_sequence, self.generator,
                                     c.device, c.length_group)
        for group in self.optimizer.param_groups:
            group["lr"] = c.lr * self.lr_factor()
        with c.autocast_context():
            loss, _ = drafter_loss(self.drafter, self.target.embed_tokens.weight, self.head, batches, c.gamma,
                                   distill=c.distill, distill_temperature=c.distill_temperature)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), c.clip)
        self.optimizer.step()
        self.step += 1
        return float(loss.detach())

    def lr_factor(self) -> float:
        """Warm-up + cosine over the step count; until a budget-driven run has fitted its step count,
        the warm-up runs over the first `warmup_frac` of the time budget instead."""
        c = self.config
        if self.total_steps >= MAX_STEPS_UNSET:
            return min(1.0, self.elapsed / (c.warmup_frac * c.time_budget_s))
        return lr_factor(self.step, self.total_steps, c.warmup_frac)

    def run(self) -> list[dict]:
        """Train until the step count or the time budget is reached; returns the log."""
        c = self.config
        if self.step == 0 and self.data.valid:
            self._log_eval([])  # the starting point: a random drafter, or the one being fine-tuned
        began = time.perf_counter() - self.elapsed
        last_eval = last_ckpt = time.perf_counter()
        first_step = self.step
        rate_mark = (self.step, self.elapsed)
        self.drafter.train()
        bar = tqdm(total=self.total_steps if self.total_steps < MAX_STEPS_UNSET else None, initial=self.step,
                   desc="train-drafter", unit="step")
        losses = []
        while self.step < self.total_steps and time.perf_counter() - began < c.time_budget_s:
            losses.append(self.train_step())
            self.elapsed = time.perf_counter() - began
            if self.step - first_step == self.RATE_FROM:
                rate_mark = (self.step, self.elapsed)
            if self.step - first_step in self.FIT_AT:
                self._fit_schedule_to_budget(bar, rate_mark)
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{self.optimizer.param_groups[0]['lr']:.1e}")
            now = time.perf_counter()
            if now - last_eval > c.eval_every_s:
                self._log_eval(losses)
                losses, last_eval = [], now
            if now - last_ckpt > c.checkpoint_every_s:
                self.save_checkpoint()
                last_ckpt = now
        bar.close()
        self._log_eval(losses)
        self.save_checkpoint()
        return self.log

    RATE_FROM = 5
    """The first steps of a run are not timed for the schedule (one-off start-up costs)."""
    FIT_AT = (20, 60, 200, 1000)
    """Steps into a run at which the total step count is (re)fitted to the remaining budget."""

    def _fit_schedule_to_budget(self, bar, rate_mark: tuple[int, float]) -> None:
        rate = (self.step - rate_mark[0]) / max(self.elapsed - rate_mark[1], 1e-6)
        fitted = self.step + int(rate * (self.config.time_budget_s - self.elapsed) * 0.97)
        self.total_steps = max(self.step + 1, min(self.config.max_steps, fitted))
        bar.total = self.total_steps
        bar.refresh()

    def _log_eval(self, losses: list[float]) -> None:
        self.drafter.eval()
        metrics = evaluate(self.drafter, self.target, self.data.valid, self.config, self.head) if self.data.valid else {}
        self.drafter.train()
        entry = {"step": self.step, "elapsed_s": round(self.elapsed, 1),
                 "train_loss": sum(losses) / len(losses) if losses else None, **metrics}
        self.log.append(entry)
        tqdm.write(json.dumps(entry))
