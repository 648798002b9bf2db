"""The block-size predictor network: a 2-layer MLP over prefill features (released BlockPilot layout).

    x  = (features - mean) / std           standardisation with training-set statistics, in the graph
    x  = [x ; temperature]                 only when trained with temperature as an input
    h1 = dropout(relu(fc1(x)))             (B, hidden)
    h2 = h1 + dropout(relu(fc2(h1)))       residual second layer, (B, hidden)
    logits = head(h2)                      (B, K), one class per candidate block size

With `temperature_heads` (and the temperature input) there are two heads, one for greedy requests and
one for T >= 1, mixed by the clamped temperature t = min(max(T, 0), 1):

    logits = (1 - t) head(h2) + t head_sampled(h2)

so a T = 1 row trains only the sampled head and a greedy row only the greedy one, and what the
greedy rows say about a prompt cannot outvote what its sampled rows say (with one temperature column
in fc1, one input among hundreds of standardised features, they can). Temperatures between 0 and 1
interpolate. On session 20's labels it changed nothing; on session 21's (the stage-6 drafter) the
one-head predictor sent code prompts to block 6 at T = 1 and the two-head one did not, so the shipped
predictor has two heads (docs/predictor.md, sessions 20 and 21).

The standardisation is part of the module (buffers), so the exported ONNX takes raw features,
exactly what `blockpilot.runtime.policy.prefill_features` computes.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockSizeMLP(nn.Module):
    """K-way classifier over candidate block sizes.

    Args:
        in_features: feature width F.
        num_classes: number of candidates K.
        hidden: hidden width (released code: 2048).
        dropout: dropout probability after each hidden layer (released code: 0.2).
        with_temperature: take the sampling temperature `(B, 1)` as an extra input.
        temperature_heads: a second head for sampled requests, mixed in by temperature (needs
            `with_temperature`).
        mean, std: `(F,)` feature statistics of the training set (default: 0 and 1).
    """

    def __init__(self, in_features: int, num_classes: int, hidden: int = 2048, dropout: float = 0.2,
                 with_temperature: bool = False, mean: torch.Tensor | None = None, std: torch.Tensor | None = None,
                 temperature_heads: bool = False):
        super().__init__()
        if temperature_heads and not with_temperature:
            raise ValueError("temperature_heads needs with_temperature")
        self.with_temperature = with_temperature
        self.register_buffer("mean", torch.zeros(in_features) if mean is None else mean.float().clone())
        std = torch.ones(in_features) if std is None else std.float()
        self.register_buffer("std", torch.where(std > 1e-6, std, torch.ones_like(std)))  # constant features: 1
        self.fc1 = nn.Linear(in_features + int(with_temperature), hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)
        self.head_sampled = nn.Linear(hidden, num_classes) if temperature_heads else None
        self.dropout = nn.Dropout(dropout)

    def forward(self, features: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits `(B, K)` for features `(B, F)` [and temperature `(B, 1)`]."""
        x = (features - self.mean) / self.std
        if self.with_temperature:
            x = torch.cat((x, temperature), dim=-1)
        h = self.dropout(torch.relu(self.fc1(x)))  # (B, hidden)
        h = h + self.dropout(torch.relu(self.fc2(h)))  # (B, hidden)
        if self.head_sampled is None:
            return self.head(h)  # (B, K)
        t = temperature.clamp(0.0, 1.0)  # (B, 1)
        return (1 - t) * self.head(h) + t * self.head_sampled(h)  # (B, K)


class ProbabilityModel(nn.Module):
    """What is exported: softmax of a `BlockSizeMLP`'s logits, `(B, K)` probabilities."""

    def __init__(self, mlp: BlockSizeMLP):
        super().__init__()
        self.mlp = mlp

    def forward(self, features: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
        return torch.softmax(self.mlp(features, temperature), dim=-1)
