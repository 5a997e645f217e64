"""A small GPT-style decoder, built as a sequence of layers (so pipelines can cut it)."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, at_least
from ..layers import FeedForward  # the block's MLP (what moe.moefy replaces with experts)

__all__ = ["GPT", "Block", "CausalSelfAttention", "FeedForward", "Embed", "Head"]


def check_sizes(*, heads: int | None = None, **sizes: int) -> None:
    """Refuse a model size that is not a whole number from 1 (named with its flag) and heads
    that do not divide d_model: one line, before any layer is built (a script's or a JSON
    config's 2.0 met torch's TypeError)."""
    for name, value in {**sizes, **({} if heads is None else {"heads": heads})}.items():
        flag = "--" + name.replace("_", "-")
        at_least(flag, value, f"pass a positive {flag}, or leave it out for the default",
                 whole=True)
    if heads is not None and sizes["d_model"] % heads:
        raise ConfigError(f"d_model {sizes['d_model']} is not divisible by heads {heads}",
                          f"pick heads among the divisors of {sizes['d_model']}")


class Embed(nn.Module):
    """Token plus learnt position embeddings: (batch, seq) ints -> (batch, seq, d_model)."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, *, sparse: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model, sparse=sparse)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.pos.num_embeddings:  # an IndexError, or a CUDA device assert
            raise ValueError(f"the model takes sequences of at most seq_len "
                             f"{self.pos.num_embeddings} tokens, and got {idx.shape[1]}")
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, heads, t, d / heads)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, heads: int, d_hidden: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp: nn.Module = FeedForward(d_model, d_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm and projection to the vocabulary: (..., d_model) -> (..., vocab)."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Sequential):
    """A GPT-style decoder: ``embed``, blocks ``h0 .. h{layers-1}``, ``head``.

    A plain :class:`torch.nn.Sequential`, so pipeline strategies cut it into
    contiguous stages by its children. Input (batch, seq) token ids, output
    (batch, seq, vocab) logits.

    Example::

        model = GPT(seq_len=64, d_model=64, layers=2, heads=4)
        logits = model(torch.randint(0, 256, (8, 64)))   # (8, 64, 256)

    Args:
        vocab: vocabulary size (default 256: bytes).
        seq_len: the longest sequence (default 64).
        d_model: width (default 128); heads must divide it.
        layers: transformer blocks (default 4).
        heads: attention heads (default 4).
        d_hidden: MLP width (default 4 * d_model).
        sparse_embedding: sparse gradients for the token embedding (default False).
    """

    def __init__(self, *, vocab: int = 256, seq_len: int = 64, d_model: int = 128,
                 layers: int = 4, heads: int = 4, d_hidden: int | None = None,
                 sparse_embedding: bool = False) -> None:
        check_sizes(vocab=vocab, seq_len=seq_len, d_model=d_model, layers=layers, heads=heads,
                    **({} if d_hidden is None else {"d_hidden": d_hidden}))
        hidden = 4 * d_model if d_hidden is None else d_hidden
        parts: OrderedDict[str, nn.Module] = OrderedDict()
        parts["embed"] = Embed(vocab, seq_len, d_model, sparse=sparse_embedding)
        for i in range(layers):
            parts[f"h{i}"] = Block(d_model, heads, hidden)
        parts["head"] = Head(d_model, vocab)
        super().__init__(parts)
        self.seq_len = seq_len
        self.apply(_init_weights)

    @property
    def blocks(self) -> list[Block]:
        return [m for m in self if isinstance(m, Block)]


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
