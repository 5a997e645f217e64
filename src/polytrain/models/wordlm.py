"""``wordlm``: a word-level language model whose bytes are mostly in two sparse embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..data.words import id_to_rank, rank_to_id
from ..errors import ConfigError, check_whole
from .gpt import Block, _init_weights, check_sizes

__all__ = ["WordLM", "WordLMOptions"]


@dataclass(frozen=True, kw_only=True)
class WordLMOptions:
    """The options that make a wordlm model (each a ``polytrain train`` flag)."""

    vocab: int = field(default=100_000, metadata={
        "help": "words in the vocabulary, the unknown token included; rarer words are "
                "unknown (default 100000)", "metavar": "V"})
    negatives: int = field(default=512, metadata={
        "help": "negatives the sampled softmax draws per step, shared by the whole global "
                "batch (default 512)", "metavar": "S"})
    dense_grads: bool = field(default=False, metadata={
        "help": "embeddings with dense gradients (the whole table every step): the baseline "
                "that densifies sparse updates"})


class WordLM(nn.Module):
    """A next-word model: sparse input embedding, a few transformer blocks, sampled softmax.

    Both embeddings (``tok``, and ``out``, whose last column is the output bias)
    are ``nn.Embedding(sparse=True)``: a step's gradient holds only the rows its
    words (and, for ``out``, its sampled negatives) touch. The forward takes a
    window of ``seq_len + 1`` ids and returns every position's loss, so that the
    targets reach the sampled softmax. The negatives of each forward are drawn
    log-uniformly over frequency ranks (Jean et al.'s sampled softmax with the
    log-Q correction, as TensorFlow's ``sampled_softmax_loss``) from a generator
    seeded by a number drawn at construction (so by the run's seed) and the
    count of forwards: every worker and the ``single`` run draw the same
    negatives at the same step, so a step's loss is the same however the batch
    is split.

    Example::

        model = WordLM(vocab=1000, seq_len=16, d_model=32, layers=1)
        losses = model(torch.randint(0, 1000, (4, 17)))   # (4, 16)

    Args:
        vocab: words, the unknown token 0 included (default 100,000).
        seq_len: positions per window (default 32).
        d_model: width (default 64); heads must divide it.
        layers: transformer blocks (default 2). heads: attention heads (default 4).
        negatives: sampled negatives per forward (default 512).
        dense_grads: ``sparse=False`` embeddings (default False): a baseline.
    """

    draws: torch.Tensor

    def __init__(self, *, vocab: int = 100_000, seq_len: int = 32, d_model: int = 64,
                 layers: int = 2, heads: int = 4, negatives: int = 512,
                 dense_grads: bool = False) -> None:
        super().__init__()
        check_sizes(seq_len=seq_len, d_model=d_model, layers=layers, heads=heads)
        check_whole("--vocab", vocab)  # 100.0 met torch's TypeError; negatives 8.5, a forward's
        check_whole("--negatives", negatives)
        if vocab < 2 or negatives < 1:
            raise ConfigError(f"wordlm needs --vocab >= 2 and --negatives >= 1 (got {vocab} "
                              f"and {negatives})", "pass --vocab 100000 --negatives 512")
        self.vocab, self.seq_len, self.negatives = vocab, seq_len, negatives
        self.tok = nn.Embedding(vocab, d_model, sparse=not dense_grads)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.Sequential(*(Block(d_model, heads, 4 * d_model) for _ in range(layers)))
        for block in self.blocks:
            assert isinstance(block, Block)
            # No attention bias: softmax ignores a key bias, so its gradient is rounding noise,
            # which optimizers that scale per element (Adagrad) would turn into whole steps.
            block.attn.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.ln = nn.LayerNorm(d_model)
        # The bias is the last column: one row per word, not a second table of 4-byte rows
        # whose indices would outweigh them on the wire.
        self.out = nn.Embedding(vocab, d_model + 1, sparse=not dense_grads)
        self.apply(_init_weights)
        nn.init.normal_(self.pos, std=0.02)
        with torch.no_grad():
            self.out.weight[:, -1] = 0.0
        # From the global generator, on CPU even under a meta-device context: the run's seed.
        self.sample_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        # The training forwards so far: a buffer, so a checkpoint's model carries it and a resumed
        # run draws the uninterrupted run's negatives.
        self.register_buffer("draws", torch.zeros((), dtype=torch.int64, device="cpu"))

    def sample(self) -> torch.Tensor:
        """The next forward's negatives: (negatives,) word ids, log-uniform over ranks."""
        gen = torch.Generator().manual_seed(self.sample_seed + int(self.draws))
        span = self.vocab - 1
        u = torch.rand(self.negatives, generator=gen, dtype=torch.float64)
        ranks = (torch.exp(u * math.log(span + 1)).floor().long() - 1).clamp(0, span - 1)
        return rank_to_id(ranks, self.vocab)

    def log_expected(self, ids: torch.Tensor) -> torch.Tensor:
        """log(negatives x Q(id)): the log-Q correction of the sampled logits."""
        span = self.vocab - 1
        ranks = id_to_rank(ids, self.vocab).clamp(max=span - 1).double()
        q = torch.log((ranks + 2) / (ranks + 1)) / math.log(span + 1)
        return torch.log(self.negatives * q).float()

    def sparse_reads(self, window: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows of each embedding the next forward on ``window`` reads: its words, its
        targets and the negatives it will draw (a strategy that keeps the tables on
        servers, parallax, fetches them all in one round trip before the forward)."""
        targets = window[:, 1:].reshape(-1)
        return {"tok.weight": window[:, :-1],
                "out.weight": torch.cat([targets, self.sample().to(window.device)])}

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """(batch, seq_len + 1) ids -> (batch, seq_len) losses of predicting each next word."""
        if window.shape[1] > self.pos.shape[0] + 1:  # the positions' shape error, in torch
            raise ValueError(f"the model takes windows of at most seq_len + 1 = "
                             f"{self.pos.shape[0] + 1} words, and got {window.shape[1]}")
        x, y = window[:, :-1], window[:, 1:]
        neg = self.sample().to(window.device)
        if self.training:  # an evaluation draws the next step's negatives, and leaves them
            self.draws.add_(1)
        h = self.tok(x) + self.pos[:x.shape[1]]
        h = self.ln(self.blocks(h))
        h = torch.cat([h, torch.ones_like(h[..., :1])], -1)               # (b, t, d + 1)
        true = (h * self.out(y)).sum(-1) - self.log_expected(y).to(h.device)      # (b, t)
        sampled = h @ self.out(neg).T - self.log_expected(neg).to(h.device)      # (b, t, S)
        sampled = sampled.masked_fill(neg == y[..., None], float("-inf"))  # accidental hits
        return torch.logsumexp(torch.cat([true[..., None], sampled], -1), -1) - true
