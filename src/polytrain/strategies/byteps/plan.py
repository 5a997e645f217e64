"""BytePS's optimal placement (Theorem 1) as plain data: who owns which gradient bytes.

With n worker machines and k CPU machines, every machine runs a summation
service. Worker machine traffic per step (one direction, in units of the
model's gradient M) is ``1 - g + (n-1) g`` for a colocated share g, a CPU
machine's is ``n c`` for a CPU share c. Equal times give

    x = 2k(n-1) / (n^2 + kn - 2k)        share of M on all CPU servers together
    t_opt = 2n(n-1) / (n^2 + kn - 2k)    bytes per machine per step, in M

k = 0 is ring all-reduce's 2(n-1)/n, k = n the parameter server's 1.

Example::

    >>> optimal_shares(8, 4).traffic_per_machine() # doctest: +ELLIPSIS
    1.27...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...comm.partition import Partition, TensorSpec, partition
from ...comm.topology import Topology
from ...errors import ConfigError
from ...ps.placement import Placement, server_ranks, spread_handlers
from ..checks import check_even_machines

__all__ = ["Shares", "optimal_shares", "Plan", "plan_placement", "plan_for", "MIN_SPLIT_BYTES"]

#: A partition is cut at an owner's boundary only into pieces of at least this many bytes,
#: so a piece is never dwarfed by its 56-byte request header.
MIN_SPLIT_BYTES = 1024


@dataclass(frozen=True)
class Shares:
    """How much of the model each kind of summation server owns.

    Attributes:
        machines: n, worker machines. cpu_servers: k, CPU machines in use (Theorem 1
            counts NICs: servers on one CPU machine split its share, ``per_cpu_server``).
        colocated: whether the worker machines' own servers hold a share.
        cpu: x, the fraction of the model on all CPU machines together (``1 - cpu`` is
            split equally over the n colocated servers).
    """

    machines: int
    cpu_servers: int
    colocated: bool
    cpu: float

    @property
    def per_cpu_server(self) -> float:
        return self.cpu / self.cpu_servers if self.cpu_servers else 0.0

    @property
    def per_colocated_server(self) -> float:
        return (1.0 - self.cpu) / self.machines if self.colocated else 0.0

    def worker_machine_traffic(self) -> float:
        """Bytes a worker machine sends (and receives) per step, in units of M.

        It pushes everything its own server does not own and answers the other
        machines' pulls of what its server owns: ``1 - g + (n-1) g``.
        """
        g = self.per_colocated_server
        return 1.0 - g + (self.machines - 1) * g

    def cpu_machine_traffic(self) -> float:
        """Bytes a CPU machine receives (and sends) per step, in M: n pushes of its share."""
        return self.machines * self.per_cpu_server

    def traffic_per_machine(self) -> float:
        """The busiest machine's bytes per step in M (t_opt * B / M at the optimum)."""
        return max(self.worker_machine_traffic(),
                   self.cpu_machine_traffic() if self.cpu_servers else 0.0)

    def describe(self) -> str:
        kind = ("all-reduce placement" if self.cpu == 0.0 and self.colocated else
                "parameter-server placement" if not self.colocated else "BytePS placement")
        return (f"{kind}: n={self.machines} worker machines, k={self.cpu_servers} CPU machines; "
                f"CPU machines hold x={self.cpu:.4f} of the model "
                f"({self.per_cpu_server:.4f} each), colocated servers "
                f"{self.per_colocated_server:.4f} each; traffic per worker machine "
                f"{self.worker_machine_traffic():.4f} M, per CPU machine "
                f"{self.cpu_machine_traffic():.4f} M per step")


def optimal_shares(machines: int, cpu_servers: int, *, colocate: bool = True) -> Shares:
    """Theorem 1's shares for n = ``machines`` worker machines and k = ``cpu_servers``.

    ``colocate=False`` puts everything on the CPU servers (a classic PS); k = 0
    puts everything on the colocated servers, equal shares (all-reduce's
    traffic). With one machine, or k >= n, the formula's end points hold:
    nothing crosses machines for n = 1, and the CPU servers hold all for k >= n.
    """
    n, k = machines, cpu_servers
    if n < 1 or k < 0:
        raise ConfigError(f"a placement needs n >= 1 worker machines and k >= 0 CPU servers "
                          f"(got n={n}, k={k})", "pass --nodes 1 or more and --servers 0 or more")
    if not colocate:
        if k == 0:
            raise ConfigError("a placement without colocated servers needs CPU servers (got "
                              "k=0)", "pass --servers K with K >= 1, or leave out --no-colocate")
        return Shares(n, k, False, 1.0)
    if k == 0 or n == 1:
        return Shares(n, 0, True, 0.0)
    if k >= n:
        return Shares(n, k, True, 1.0)
    x = 2 * k * (n - 1) / (n * n + k * n - 2 * k)
    return Shares(n, k, True, x)


@dataclass(frozen=True)
class Plan:
    """Where every gradient partition goes and which local worker reduces it.

    Attributes:
        shares: the Theorem 1 split this plan realises.
        placement: partitions (cut at owner boundaries so bytes meet the shares), their
            owner server ranks, and their handlers: per partition, the index among a
            machine's workers of the one that reduces it locally, pushes it, and shares
            the sum (the same on every machine).
        specs: the tensors, in declaration order (a partition's ``tensor`` indexes them).
    """

    shares: Shares
    placement: Placement
    specs: tuple[TensorSpec, ...]

    @property
    def handlers(self) -> tuple[int, ...]:
        assert self.placement.handlers is not None
        return self.placement.handlers

    def bytes_by_owner(self) -> dict[int, int]:
        return self.placement.bytes_by_owner()

    def describe(self) -> str:
        return f"{self.shares.describe()}\n{self.placement.describe()}"


def _targets(total: int, shares: Shares, colocated: Sequence[int],
             cpu_machines: Sequence[Sequence[int]]) -> dict[int, float]:
    targets: dict[int, float] = {}
    if shares.colocated:
        targets.update({s: shares.per_colocated_server * total for s in colocated})
    # A CPU machine's share is its NIC's: the servers on it split it evenly.
    for servers in cpu_machines[:shares.cpu_servers]:
        targets.update({s: shares.per_cpu_server * total / len(servers) for s in servers})
    return targets


def _cut(part: Partition, start: int, numel: int) -> Partition:
    itemsize = part.nbytes // part.numel if part.numel else 0
    return Partition(part.key, part.tensor, part.name, part.index, part.offset + start, numel,
                     numel * itemsize, part.dtype)


def _fill(parts: Sequence[Partition], targets: dict[int, float]
          ) -> list[tuple[Partition, int]]:
    """Give each partition, in order, to the server furthest below its target; cut it there.

    "Furthest" is relative (the largest fraction of its target still missing),
    a weighted round robin, so consecutive layers go to different servers and
    a burst of ready gradients spreads over every server. A partition larger
    than that server's deficit is cut so the server meets its target to the
    element; pieces are never cut under MIN_SPLIT_BYTES, so every server ends
    within about that of its share, whatever the tensor sizes.
    """
    targets = {s: t for s, t in targets.items() if t > 0}
    deficit = dict(targets)
    servers = sorted(deficit)
    out: list[tuple[Partition, int]] = []
    for part in parts:
        itemsize = part.nbytes // part.numel
        start = 0
        while start < part.numel:
            left = part.numel - start
            # Servers that can still take a piece worth a header; else the neediest one.
            open_ = [s for s in servers if deficit[s] >= MIN_SPLIT_BYTES] or servers
            s = max(open_, key=lambda s: (deficit[s] / targets[s], -s))
            fits = int(deficit[s] // itemsize)
            whole = (fits >= left or fits * itemsize < MIN_SPLIT_BYTES
                     or (left - fits) * itemsize < MIN_SPLIT_BYTES)
            take = left if whole else fits
            out.append((_cut(part, start, take), s))
            deficit[s] -= take * itemsize
            start += take
    return out


def plan_placement(specs: Sequence[TensorSpec], *, partition_bytes: int, machines: int,
                   colocated: Sequence[int], dedicated: Sequence[int], colocate: bool = True,
                   local_workers: int = 1, first_key: int = 0,
                   cpu_machines: Sequence[Sequence[int]] | None = None) -> Plan:
    """The placement of ``specs``' partitions that realises Theorem 1's shares.

    Args:
        specs: the tensors, in the order every worker declares them.
        partition_bytes: the largest partition (tensors are cut into near-equal pieces).
        machines: n, the worker machines.
        colocated: one server rank per worker machine, in machine order (empty: none runs).
        dedicated: the CPU servers' ranks.
        colocate: False for the classic PS (everything on ``dedicated``).
        local_workers: workers per machine (each machine reduces locally first).
        first_key: the first service key to number the partitions from.
        cpu_machines: ``dedicated`` grouped by machine (None: each on a machine of its
            own). Theorem 1's k counts CPU machines (NICs), and each machine's share is
            split evenly over its servers.

    Example::

        >>> from polytrain.comm import TensorSpec
        >>> import torch
        >>> specs = [TensorSpec("w", (6000,), torch.float32)]
        >>> plan_placement(specs, partition_bytes=8192, machines=2, colocated=[2, 3],
        ...                dedicated=[4]).bytes_by_owner()
        {2: 6000, 3: 6000, 4: 12000}
        >>> plan_placement(specs, partition_bytes=8192, machines=2, colocated=[2, 3],
        ...                dedicated=[4, 5], cpu_machines=[[4, 5]]).bytes_by_owner()
        {2: 6000, 3: 6000, 4: 6000, 5: 6000}
    """
    colocate = colocate and bool(colocated)
    if colocate and len(colocated) != machines:
        raise ConfigError(f"every worker machine needs one colocated server (got {machines} "
                          f"machines and colocated servers {list(colocated)})",
                          "launch with one colocated server per machine (--colocated 1)")
    if local_workers < 1:
        raise ConfigError(f"a machine needs at least one worker (got {local_workers})",
                          "start workers on every machine")
    groups = ([[s] for s in dedicated] if cpu_machines is None
              else [list(g) for g in cpu_machines])
    if sorted(s for g in groups for s in g) != sorted(dedicated) or not all(groups):
        raise ConfigError(f"cpu_machines {groups} must hold every dedicated server "
                          f"{list(dedicated)} once, in the group of its machine",
                          "group the dedicated server ranks by machine, none left out")
    shares = optimal_shares(machines, len(groups), colocate=colocate)
    parts = [p for p in partition(specs, partition_bytes) if p.numel > 0]
    total = sum(p.nbytes for p in parts)
    placed = _fill(parts, _targets(total, shares, colocated, groups)) if parts else []
    # Number the pieces again: keys in declaration order, indices within each tensor.
    final: list[Partition] = []
    owners: list[int] = []
    per_tensor: dict[int, int] = {}
    for i, (p, owner) in enumerate(placed):
        index = per_tensor.get(p.tensor, 0)
        per_tensor[p.tensor] = index + 1
        final.append(Partition(first_key + i, p.tensor, p.name, index, p.offset, p.numel,
                               p.nbytes, p.dtype))
        owners.append(owner)
    placement = Placement(tuple(final), tuple(owners), spread_handlers(final, local_workers))
    return Plan(shares, placement, tuple(specs))


def plan_for(topology: Topology, specs: Sequence[TensorSpec], *, partition_bytes: int,
             colocate: bool = True) -> Plan:
    """Theorem 1's placement of ``specs`` on the servers of the run ``topology`` describes.

    One colocated server per worker machine (if ``colocate`` and the run has them)
    and every dedicated server take part, k counting the CPU machines (the servers
    of one split its share); keys are numbered from 0 (the engine gives them fresh
    service keys).
    """
    # Every worker plans at the same point, so each refuses: none waits for the others.
    check_even_machines("byteps", topology, "reduces each machine's gradients among its "
                        "workers first (a piece each)")
    colocated, dedicated = server_ranks(topology, colocate=colocate, strategy="byteps")
    local = len(topology.workers_on(topology.worker_machines[0]))
    return plan_placement(specs, partition_bytes=partition_bytes,
                          machines=len(topology.worker_machines), colocated=colocated,
                          dedicated=dedicated, colocate=bool(colocated), local_workers=local,
                          cpu_machines=[topology.servers_on(m) for m in topology.cpu_machines])
