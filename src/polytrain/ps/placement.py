"""Placements: which server owns each partition, as plain data."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from ..comm.partition import Partition
from ..errors import ConfigError

__all__ = ["Placement", "balanced"]


@dataclass(frozen=True)
class Placement:
    """``owners[i]`` is the server rank that owns ``partitions[i]``."""

    partitions: tuple[Partition, ...]
    owners: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.partitions) != len(self.owners):
            raise ConfigError(f"placement has {len(self.partitions)} partitions but "
                              f"{len(self.owners)} owners", "give one owner per partition")

    @cached_property
    def _by_tensor(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(self.partitions):
            out[p.tensor].append(i)
        return {t: tuple(ix) for t, ix in out.items()}

    def by_tensor(self, tensor: int) -> tuple[int, ...]:
        """Indices of the partitions of tensor ``tensor``."""
        return self._by_tensor.get(tensor, ())

    def bytes_by_owner(self) -> dict[int, int]:
        load: dict[int, int] = defaultdict(int)
        for p, o in zip(self.partitions, self.owners):
            load[o] += p.nbytes
        return dict(load)

    def describe(self) -> str:
        """A table: each owner, its partition count and bytes."""
        count: dict[int, int] = defaultdict(int)
        for o in self.owners:
            count[o] += 1
        load = self.bytes_by_owner()
        return "\n".join(f"server rank {o}: {count[o]} partitions, {load[o]} bytes"
                         for o in sorted(load))


def balanced(partitions: Sequence[Partition], servers: Sequence[int]) -> Placement:
    """Give each partition, largest first, to the server that owns the fewest bytes so far.

    Balanced by bytes (unlike BytePS's ``hash(key) % servers``); ties go to
    the lower rank, so every worker computes the same placement.
    """
    if not servers:
        raise ConfigError("a placement needs at least one server (got none)",
                          "start servers with --servers K")
    load = {s: 0 for s in servers}
    owners = [0] * len(partitions)
    for i in sorted(range(len(partitions)), key=lambda i: (-partitions[i].nbytes, i)):
        s = min(servers, key=lambda s: (load[s], s))
        owners[i] = s
        load[s] += partitions[i].nbytes
    return Placement(tuple(partitions), tuple(owners))
