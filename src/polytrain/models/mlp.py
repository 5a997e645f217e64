"""A small MLP that predicts the next byte from a window of bytes."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .gpt import check_sizes

__all__ = ["MLP"]


class _Window(nn.Flatten):
    """Flatten the embedded window, refusing one of another length by name (a length other
    than ``seq_len`` met the first linear layer's shape error deep inside torch)."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.seq_len:
            raise ValueError(f"the model takes windows of exactly seq_len {self.seq_len} "
                             f"bytes, and got {x.shape[1]}")
        return super().forward(x)


class MLP(nn.Sequential):
    """Embed a window of bytes, flatten, two hidden GELU layers, logits of the next byte.

    Input (batch, seq_len) byte ids, output (batch, vocab) logits.

    Args:
        vocab: vocabulary size (default 256).
        seq_len: window length (default 64).
        d_model: hidden width (default 64); bytes are embedded in 16 dimensions.
        layers: hidden layers (default 2).
    """

    def __init__(self, *, vocab: int = 256, seq_len: int = 64, d_model: int = 64,
                 layers: int = 2) -> None:
        check_sizes(vocab=vocab, seq_len=seq_len, d_model=d_model, layers=layers)
        parts: OrderedDict[str, nn.Module] = OrderedDict()
        parts["embed"] = nn.Embedding(vocab, 16)
        parts["flatten"] = _Window(seq_len)
        width = seq_len * 16
        for i in range(layers):
            parts[f"fc{i}"] = nn.Linear(width, d_model)
            parts[f"act{i}"] = nn.GELU()
            width = d_model
        parts["out"] = nn.Linear(width, vocab)
        super().__init__(parts)
        self.seq_len = seq_len
