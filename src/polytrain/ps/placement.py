"""Placements: which server owns each byte range of each tensor, as plain data."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from ..comm.partition import Partition, TensorSpec
from ..comm.topology import Topology
from ..errors import ConfigError

__all__ = ["Placement", "balanced", "server_machines", "server_ranks", "spread_handlers"]


@dataclass(frozen=True)
class Placement:
    """``owners[i]`` is the server rank that owns ``partitions[i]``.

    ``handlers[i]``, when given, is the index among a machine's workers of the
    one that reduces partition ``i`` inside the machine, pushes it and shares
    the sum (the same on every machine); None leaves that to the engine
    (:func:`spread_handlers`). Keys are the partitions' ``key`` fields: a plan
    may number them from 0, and the engine gives them fresh service keys
    (:meth:`renumbered`).
    """

    partitions: tuple[Partition, ...]
    owners: tuple[int, ...]
    handlers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.partitions) != len(self.owners):
            raise ConfigError(f"placement has {len(self.partitions)} partitions but "
                              f"{len(self.owners)} owners", "give one owner per partition")
        if self.handlers is not None and len(self.handlers) != len(self.partitions):
            raise ConfigError(f"placement has {len(self.partitions)} partitions but "
                              f"{len(self.handlers)} handlers", "give one handler per partition")

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

    def renumbered(self, first_key: int) -> Placement:
        """The same placement with keys ``first_key, first_key + 1, ...`` in partition order."""
        parts = tuple(dataclasses.replace(p, key=first_key + i)
                      for i, p in enumerate(self.partitions))
        return dataclasses.replace(self, partitions=parts)

    def check(self, specs: Sequence[TensorSpec], servers: Sequence[int], *,
              local_workers: int = 1) -> None:
        """Refuse a placement that does not fit ``specs`` or the run (ConfigError, values).

        Every partition must lie inside its tensor with the tensor's dtype, the
        partitions must cover every element once (a sum leaves an element no partition
        holds as whatever memory was there), every owner must be a server rank, every
        handler a worker of the machine.
        """
        for i, (p, owner) in enumerate(zip(self.partitions, self.owners)):
            if not 0 <= p.tensor < len(specs):
                raise ConfigError(f"placement: partition {i} ({p.label}) is of tensor "
                                  f"{p.tensor}, but {len(specs)} tensors were declared",
                                  "place only the declared tensors")
            spec = specs[p.tensor]
            if p.offset < 0 or p.numel < 0 or p.offset + p.numel > spec.numel:
                raise ConfigError(
                    f"placement: partition {i} ({p.label}) covers elements [{p.offset}, "
                    f"{p.offset + p.numel}) of {spec.name!r}, which has {spec.numel}",
                    "keep every byte range inside its tensor")
            if p.dtype != spec.dtype or p.nbytes != p.numel * spec.itemsize:
                raise ConfigError(f"placement: partition {i} ({p.label}) is {p.numel} x "
                                  f"{p.dtype} in {p.nbytes} bytes, but {spec.name!r} is "
                                  f"{spec.dtype}", "cut partitions from the declared specs")
            if owner not in servers:
                raise ConfigError(f"placement: partition {i} ({p.label}) is owned by rank "
                                  f"{owner}, which is not a server (the servers are "
                                  f"{list(servers)})", "give every partition a server rank")
        ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for p in self.partitions:
            ranges[p.tensor].append((p.offset, p.offset + p.numel))
        for t, spec in enumerate(specs):
            at = 0
            for lo, hi in sorted(ranges[t]) + [(spec.numel, spec.numel)]:
                if lo != at:
                    what = (f"elements [{at}, {lo}) of {spec.name!r} are in no partition"
                            if lo > at else f"elements [{lo}, {min(at, hi)}) of {spec.name!r} "
                                            f"are in two partitions")
                    raise ConfigError(f"placement: {what}",
                                      "cut every tensor into partitions that cover it once "
                                      "(polytrain.comm.partition does)")
                at = hi
        if self.handlers is not None:
            bad = [h for h in self.handlers if not 0 <= h < local_workers]
            if bad:
                raise ConfigError(f"placement: handlers {sorted(set(bad))} are not workers of "
                                  f"a machine of {local_workers}",
                                  f"use handler indices 0 .. {local_workers - 1}")

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
                          "start servers: --servers K on the command line, servers=K in "
                          "polytrain.launch()")
    load = {s: 0 for s in servers}
    owners = [0] * len(partitions)
    for i in sorted(range(len(partitions)), key=lambda i: (-partitions[i].nbytes, i)):
        s = min(servers, key=lambda s: (load[s], s))
        owners[i] = s
        load[s] += partitions[i].nbytes
    return Placement(tuple(partitions), tuple(owners))


def spread_handlers(parts: Sequence[Partition], local_workers: int) -> tuple[int, ...]:
    """Each partition to the machine's worker with the fewest bytes so far (a reduce-scatter)."""
    load = [0] * local_workers
    handlers = []
    for p in parts:
        h = min(range(local_workers), key=lambda i: (load[i], i))
        handlers.append(h)
        load[h] += p.nbytes
    return tuple(handlers)


def server_machines(topology: Topology, *, colocate: bool, strategy: str = "this strategy"
                    ) -> list[tuple[int, ...]]:
    """Every server machine by its server ranks: each worker machine's (unless not
    ``colocate``), in machine order, then each CPU machine's. A machine that runs several
    servers (torchrun's ``POLYTRAIN_ROLE=...,server,server``) lists them all, for a strategy
    that splits the machine's share over them."""
    per_machine = [topology.servers_on(m) for m in topology.worker_machines]
    colocated = [s for s in per_machine if s] if colocate else []
    if colocated and len(colocated) != len(per_machine):
        missing = [m for m, s in zip(topology.worker_machines, per_machine) if not s]
        raise ConfigError(f"{strategy} needs a colocated server on every worker machine or "
                          f"on none; machines {missing} have none",
                          "launch with --colocated 1 (polytrain.launch(..., colocated=1); "
                          "polytrain train does this itself)")
    dedicated = [topology.servers_on(m) for m in topology.cpu_machines]
    left_out = [r for s in per_machine for r in s] if not colocate else []
    if not colocated and not dedicated and left_out:
        raise ConfigError(f"{strategy} needs summation servers, and colocate=False leaves out "
                          f"the run's colocated ones (rank{'s' if len(left_out) > 1 else ''} "
                          f"{', '.join(map(str, left_out))}), with no dedicated one",
                          "leave out colocate=False (--no-colocate) to use them, or launch "
                          "with --servers K (polytrain.launch(..., servers=K))")
    if not colocated and not dedicated:
        raise ConfigError(f"{strategy} needs summation servers, but this run has none",
                          "launch with --colocated 1 and/or --servers K (polytrain.launch"
                          "(..., colocated=1, servers=K); polytrain train starts colocated "
                          "servers itself)")
    return colocated + dedicated


def server_ranks(topology: Topology, *, colocate: bool, strategy: str = "this strategy"
                 ) -> tuple[list[int], list[int]]:
    """(one colocated server per worker machine, or none; the dedicated CPU servers), for a
    strategy that sums on one server per worker machine: a worker machine of several is
    refused (all but one would sum nothing)."""
    machines = server_machines(topology, colocate=colocate, strategy=strategy)
    colocated = [s for s in machines if topology.machine(s[0]) in topology.worker_machines]
    several = [(topology.machine(s[0]), s) for s in colocated if len(s) > 1]
    if several:
        (first, ranks), *rest = several
        named = f"machine {first!r} runs server ranks {', '.join(map(str, ranks))}" + "".join(
            f" and machine {m!r} {', '.join(map(str, r))}" for m, r in rest)
        raise ConfigError(f"{strategy} sums on one server per worker machine, but {named}: "
                          f"all but the first of each would sum nothing",
                          "start one server on each worker machine (--colocated 1; one "
                          "'server' in POLYTRAIN_ROLE there under torchrun) and any more on "
                          "CPU machines of their own (--servers K), or train with herring, "
                          "which splits a machine's share over its servers")
    return [s[0] for s in colocated], list(topology.dedicated_servers)
