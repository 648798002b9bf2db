"""Pure sampling and acceptance math: tensors in, tensors out, batch-aware, explicit generators.

Speculative decoding here is "sample, then match": the target's posterior token is drawn (or
arg-maxed at temperature 0) at every block position, and a draft token is accepted while it equals
the posterior of the position before it. Because the drafter is deterministic (greedy), the
committed tokens are distributed exactly as autoregressive samples from the target.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"invalid sampling parameters (temperature={self.temperature}, top_k={self.top_k}, "
                f"top_p={self.top_p}): need temperature >= 0, top_k >= 0 and 0 < top_p <= 1"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities `(..., V)` after temperature, then top-k, then top-p (nucleus) filtering."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of `logits` `(..., V)` -> `(...)`: argmax at T = 0, else a draw."""
    if params.greedy:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, params)
    return draw_categorical(probs.reshape(-1, probs.shape[-1]), generator).reshape(probs.shape[:-1])


def draw_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of `probs` `(N, V)` (non-negative, each row with a positive sum) -> `(N,)`,
    drawn with the row's probabilities: the inverse of its running sum (float64) at one uniform draw
    in (0, 1] per row, so a zero-probability index is never drawn. One uniform per row instead of
    `torch.multinomial`: 0.05 ms against 1.16 ms for a 49,152-wide row on one CPU core (quiet), which a
    sampled verify step pays once per block position."""
    device = generator.device if generator is not None else probs.device
    uniform = 1.0 - torch.rand(len(probs), 1, generator=generator, dtype=torch.float64, device=device)  # (N, 1)
    drawn = []
    for row, u in zip(probs.double(), uniform.to(probs.device)):  # row by row: a 1-D running sum is fastest
        cdf = row.cumsum(0)  # (V,)
        drawn.append(torch.searchsorted(cdf, u * cdf[-1]))
    return torch.cat(drawn).clamp_max(probs.shape[-1] - 1)


def accepted_draft_counts(draft: torch.Tensor, posterior: torch.Tensor) -> torch.Tensor:
    """How many leading draft tokens each row accepts.

    Args:
        draft: `(B, K)` drafted tokens for block positions 1..K.
        posterior: `(B, K + 1)` target tokens for positions 1..K+1, given the block prefix.
    Returns:
        `(B,)` int64 `a` with `draft[:, :a] == posterior[:, :a]`; the step commits `a + 1` tokens.
    """
    return (draft == posterior[:, :-1]).long().cumprod(dim=1).sum(dim=1)


def committed_tokens(draft: torch.Tensor, posterior: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """`(B, K + 1)` tokens committed by a step: the accepted drafts, then the bonus token
    `posterior[a]`; entries after index `a` are the posterior's and must be ignored."""
    idx = torch.arange(posterior.shape[1], device=posterior.device)[None, :]
    padded_draft = torch.cat((draft, posterior[:, -1:]), dim=1)
    return torch.where(idx < accepted[:, None], padded_draft, posterior)
