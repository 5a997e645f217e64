"""A small MLP that predicts the next byte from a window of bytes."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from .gpt import check_sizes

__all__ = ["MLP"]


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
        parts["flatten"] = nn.Flatten()
        width = seq_len * 16
        for i in range(layers):
            parts[f"fc{i}"] = nn.Linear(width, d_model)
            parts[f"act{i}"] = nn.GELU()
            width = d_model
        parts["out"] = nn.Linear(width, vocab)
        super().__init__(parts)
        self.seq_len = seq_len
