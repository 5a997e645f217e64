"""Building blocks shared by the reference models and the MoE experts (imports torch only)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    """``proj(activation(fc(x)))``, GELU by default: the GPT block's MLP, and one MoE expert
    of the same shape (another activation: a torch layer's that ``moefy`` replaced)."""

    def __init__(self, d_model: int, d_hidden: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_hidden)
        self.proj = nn.Linear(d_hidden, d_model)
        self.activation = activation  # a module among the children, a function as is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.fc(x)))
