"""Partitions: tensors cut into pieces of at most ``partition_bytes``, as plain data."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ConfigError

__all__ = ["TensorSpec", "Partition", "partition", "even_cuts", "DEFAULT_PARTITION_BYTES"]

#: The largest partition of a tensor on the summation service, unless a strategy says
#: otherwise (BytePS's BYTEPS_PARTITION_BYTES default).
DEFAULT_PARTITION_BYTES = 4_096_000


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor's shape and dtype, as workers declare it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Partition:
    """Elements ``[offset, offset+numel)`` of the flattened tensor ``tensor`` (index in the specs).

    ``key`` numbers partitions across all tensors in declaration order, so every
    worker that declares the same tensors in the same order gets the same keys.
    """

    key: int
    tensor: int
    name: str
    index: int  # partition index within its tensor
    offset: int
    numel: int
    nbytes: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.name}[{self.index}]"


def even_cuts(numel: int, count: int) -> list[tuple[int, int]]:
    """``count`` near-equal (offset, numel) pieces of ``numel`` elements, the first ones one
    longer: ``even_cuts(10, 3) == [(0, 4), (4, 3), (7, 3)]``."""
    base, extra = divmod(numel, count)
    sizes = [base + (1 if i < extra else 0) for i in range(count)]
    return list(zip(itertools.accumulate(sizes, initial=0), sizes))


def partition(specs: Sequence[TensorSpec], partition_bytes: int,
              first_key: int = 0) -> tuple[Partition, ...]:
    """Cut every tensor into the fewest near-equal pieces of at most ``partition_bytes``.

    Example::

        >>> [p.numel for p in partition([TensorSpec("w", (10,), torch.float32)], 16)]
        [4, 3, 3]
    """
    if partition_bytes < 1:
        raise ConfigError(f"partition_bytes must be positive (got {partition_bytes})",
                          "pass --partition-bytes 4096000 (BytePS's default) or another size")
    parts: list[Partition] = []
    key = first_key
    for t, spec in enumerate(specs):
        per = max(1, partition_bytes // spec.itemsize)  # elements that fit in one partition
        count = max(1, math.ceil(spec.numel / per))
        for i, (offset, n) in enumerate(even_cuts(spec.numel, count)):
            parts.append(Partition(key, t, spec.name, i, offset, n, n * spec.itemsize, spec.dtype))
            key += 1
    return tuple(parts)
