"""Deterministic global batches, and each replica's contiguous slice of them."""

from __future__ import annotations

from typing import Iterator

import torch

from ..errors import ConfigError, at_least, check_whole

__all__ = ["GlobalBatches", "EpochBatches", "windows", "shard", "check_divisible", "check_seed"]


def _whole(name: str, value: int, hint: str) -> int:
    """``value`` as an int (torch's generator and randint do not take numpy's: TypeError
    or OverflowError at the first batch), refused unless a whole number (None too)."""
    if value is None:
        raise ConfigError(f"{name} must be a whole number (got None)", hint)
    check_whole(name, value, hint)
    return int(value)


def check_seed(seed: int, name: str = "seed", hint: str = "pass seed=0") -> int:
    """``seed`` as an int, refused unless a whole number in 0..2**63-1 (-1 was taken as
    another seed, 2**64 failed at the first batch, and :class:`EpochBatches` takes it modulo
    2**63: a larger one repeats a smaller one's batches)."""
    seed = _whole(name, seed, hint)
    if not 0 <= seed < 2**63:
        raise ConfigError(f"{name} must be in 0..2**63-1 (got {seed})", hint)
    return seed


def _check_window(window: int) -> int:
    # 0 gave empty batches or a ZeroDivisionError, -3 and 1.5 torch's errors.
    hint = "pass window=65 (a model's seq_len + 1, for seq_len 64)"
    window = _whole("window", window, hint)
    at_least("window", window, hint)
    return window


def _check_batch_size(batch_size: int) -> int:
    hint = "pass --batch-size 32"
    batch_size = _whole("--batch-size", batch_size, hint)
    at_least("--batch-size", batch_size, hint)
    return batch_size


class GlobalBatches:
    """Windows of a corpus drawn at random, the same in every process for the same seed.

    Every process iterates the same sequence of (batch_size, window) int64
    batches; data-parallel replicas then :func:`shard` them.

    Example::

        batches = GlobalBatches(stdlib_corpus(), batch_size=32, window=65, seed=0)
        first = next(iter(batches))   # (32, 65)
    """

    def __init__(self, corpus: torch.Tensor, *, batch_size: int, window: int, seed: int) -> None:
        batch_size = _check_batch_size(batch_size)
        window, seed = _check_window(window), check_seed(seed)
        if corpus.numel() <= window:
            raise ConfigError(f"the corpus has {corpus.numel()} tokens, and windows of "
                              f"{window} need more (at least {window + 1})",
                              "pass a smaller --seq-len")
        self.corpus = corpus
        self.batch_size = batch_size
        self.window = window
        self.seed = seed

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iterate()

    def iterate(self, start: int = 0) -> Iterator[torch.Tensor]:
        """The batches from batch ``start`` on (a resumed run's data position): the
        generator draws the skipped batches' offsets without building them."""
        gen = torch.Generator().manual_seed(self.seed)
        offsets = torch.arange(self.window)
        high = self.corpus.numel() - self.window
        for _ in range(start):
            torch.randint(0, high, (self.batch_size,), generator=gen)
        while True:
            starts = torch.randint(0, high, (self.batch_size,), generator=gen)
            yield self.corpus[starts[:, None] + offsets].long()


def windows(corpus: torch.Tensor, window: int, *, limit: int | None = None) -> torch.Tensor:
    """The corpus cut into consecutive non-overlapping windows: (samples, window) int64."""
    window = _check_window(window)
    count = corpus.numel() // window
    if limit is not None:
        count = min(count, limit)
    return corpus[:count * window].long().view(count, window)


class EpochBatches:
    """A fixed set of samples (non-overlapping windows), every one once per epoch.

    Each epoch is a fresh permutation (from ``seed`` and the epoch number, the same in
    every process), cut into global batches; a last partial batch is dropped, so an
    epoch is ``samples // batch_size`` steps (:attr:`steps_per_epoch`). What data
    parallelism does to a global batch (equal contiguous slices) keeps each sample seen
    once per epoch whatever the number of replicas at each step.

    Example::

        batches = EpochBatches(stdlib_corpus(), batch_size=32, window=65, seed=0)
        steps = batches.steps_per_epoch    # samples // 32
    """

    def __init__(self, corpus: torch.Tensor, *, batch_size: int, window: int, seed: int) -> None:
        batch_size = _check_batch_size(batch_size)
        seed = check_seed(seed)
        self.samples = windows(corpus, window)
        if self.samples.shape[0] < batch_size:
            raise ConfigError(f"the corpus holds {self.samples.shape[0]} samples of {window} "
                              f"tokens, fewer than one batch of {batch_size}",
                              "pass a smaller --batch-size or --seq-len")
        self.batch_size = batch_size
        self.seed = seed

    @property
    def steps_per_epoch(self) -> int:
        return self.samples.shape[0] // self.batch_size

    def order(self, epoch: int) -> torch.Tensor:
        """The sample indices of ``epoch`` in the order they are trained."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        return torch.randperm(self.samples.shape[0], generator=gen)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iterate()

    def iterate(self, start: int = 0) -> Iterator[torch.Tensor]:
        """The batches from global step ``start`` on (a resumed run's data position)."""
        epoch, first = divmod(start, self.steps_per_epoch)
        while True:
            order = self.order(epoch)
            for s in range(first, self.steps_per_epoch):
                yield self.samples[order[s * self.batch_size:(s + 1) * self.batch_size]]
            epoch, first = epoch + 1, 0


def check_divisible(batch_size: int, replicas: int, hint: str | None = None) -> None:
    """Refuse a global batch that does not split equally over ``replicas``; ``hint`` (with
    ``{up}``, the next multiple) words the fix, by default the CLI's ``--batch-size``."""
    if batch_size % replicas:
        up = -(-batch_size // replicas) * replicas
        raise ConfigError(
            f"global batch {batch_size} is not divisible by {replicas} data-parallel replicas: "
            f"each replica takes an equal slice",
            (hint or "pass --batch-size {up} (or another multiple of {replicas})").format(
                up=up, replicas=replicas))


def shard(batch: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Replica ``index`` of ``count``'s contiguous, equal slice of a global batch (dim 0)."""
    if not isinstance(batch, torch.Tensor):  # a list or numpy's array: AttributeError 'dim'
        raise ConfigError(f"shard() takes a global batch as a torch.Tensor (got type "
                          f"{type(batch).__name__})",
                          "pass torch.as_tensor(batch), whose dim 0 is the samples")
    # A 0-d int tensor (one a broadcast carried) as an int, as it worked before.
    index, count = (int(v) if isinstance(v, torch.Tensor) and v.dim() == 0
                    and not v.is_floating_point() and v.dtype != torch.bool else v
                    for v in (index, count))
    for name, value in (("index", index), ("count", count)):  # True was a count of 1
        check_whole(f"shard() {name}", value,
                    "pass shard(batch, ctx.worker_index, ctx.num_workers)")
    if batch.dim() == 0:  # a bare IndexError from batch.shape[0]
        raise ConfigError("shard() takes a global batch whose dim 0 is the samples, but got a "
                          "tensor of 0 dims (one number)",
                          "pass a batch along dim 0 (one sample x is x.unsqueeze(0))")
    if not 0 <= index < count:  # a slice past the end, or from it, was an empty batch
        raise ConfigError(f"shard() takes a replica index in 0..count-1 and a count of at "
                          f"least 1 (got index {index}, count {count})",
                          "pass shard(batch, ctx.worker_index, ctx.num_workers)")
    check_divisible(batch.shape[0], count, "pass a global batch of a multiple of {replicas} "
                    "samples (--batch-size {up})")
    per = batch.shape[0] // count
    return batch[index * per:(index + 1) * per]
