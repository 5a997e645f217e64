"""Building blocks shared by the reference models and the MoE experts (imports torch only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    """``proj(gelu(fc(x)))``: the GPT block's MLP, and one MoE expert of the same shape."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_hidden)
        self.proj = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))
