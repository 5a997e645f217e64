"""The layout of a run as plain data: every rank's role and machine."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..errors import ConfigError

__all__ = ["Peer", "Topology"]

ROLES = ("worker", "server")


@dataclass(frozen=True)
class Peer:
    """One process of the run."""

    rank: int
    role: str
    machine: str


@dataclass(frozen=True)
class Topology:
    """Who is who in a run, learnt collectively by :func:`polytrain.init`.

    Machines keep the order in which their lowest rank appears; "leaders" are
    the lowest-ranked worker of every worker machine.

    Example::

        >>> t = Topology.from_roles([("worker", "a"), ("worker", "a"), ("worker", "b"),
        ...                          ("server", "s")])
        >>> t.leaders, t.dedicated_servers, t.cpu_machines, t.is_inter(0, 2)
        ((0, 2), (3,), ('s',), True)
    """

    peers: tuple[Peer, ...]

    @classmethod
    def from_roles(cls, roles: list[tuple[str, str]]) -> Topology:
        """Build from ``(role, machine)`` per rank, checking the roles."""
        for rank, (role, _) in enumerate(roles):
            if role.startswith("none: "):  # a comma list shorter than the local ranks
                raise ConfigError(f"rank {rank} has no role: {role.removeprefix('none: ')}",
                                  "list a role for every process of the machine, e.g. "
                                  "POLYTRAIN_ROLE=worker,worker,server for --nproc-per-node 3")
            if role not in ROLES:
                raise ConfigError(
                    f"rank {rank} has role {role!r}; a role is one of {ROLES}",
                    "set POLYTRAIN_ROLE to 'worker' or 'server' (or a comma list by LOCAL_RANK)")
        topo = cls(tuple(Peer(r, role, m) for r, (role, m) in enumerate(roles)))
        if not topo.workers:
            raise ConfigError(f"all {len(roles)} processes are servers; a run needs a worker",
                              "start at least one process with POLYTRAIN_ROLE=worker")
        return topo

    @property
    def world_size(self) -> int:
        return len(self.peers)

    @cached_property
    def workers(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.peers if p.role == "worker")

    @cached_property
    def servers(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.peers if p.role == "server")

    @cached_property
    def machines(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.machine for p in self.peers))

    @cached_property
    def worker_machines(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.peers[r].machine for r in self.workers))

    @cached_property
    def leaders(self) -> tuple[int, ...]:
        return tuple(self.workers_on(m)[0] for m in self.worker_machines)

    @cached_property
    def colocated_servers(self) -> tuple[int, ...]:
        """Servers on a machine that also runs workers."""
        wm = set(self.worker_machines)
        return tuple(r for r in self.servers if self.peers[r].machine in wm)

    @cached_property
    def dedicated_servers(self) -> tuple[int, ...]:
        """Servers on CPU machines of their own."""
        wm = set(self.worker_machines)
        return tuple(r for r in self.servers if self.peers[r].machine not in wm)

    @cached_property
    def cpu_machines(self) -> tuple[str, ...]:
        """Machines of servers only, in machine order: a NIC each, whatever the servers on
        it (``servers_on`` lists them)."""
        wm = set(self.worker_machines)
        return tuple(m for m in self.machines if m not in wm)

    def role(self, rank: int) -> str:
        return self.peers[rank].role

    def machine(self, rank: int) -> str:
        return self.peers[rank].machine

    def workers_on(self, machine: str) -> tuple[int, ...]:
        return tuple(r for r in self.workers if self.peers[r].machine == machine)

    def servers_on(self, machine: str) -> tuple[int, ...]:
        return tuple(r for r in self.servers if self.peers[r].machine == machine)

    def worker_index(self, rank: int) -> int:
        """Position of ``rank`` among the workers (0 .. workers-1)."""
        return self.workers.index(rank)

    def is_inter(self, a: int, b: int) -> bool:
        """True when ranks ``a`` and ``b`` are on different machines."""
        return self.peers[a].machine != self.peers[b].machine

    def name(self, rank: int) -> str:
        """``server rank 4 (machine server0)``: how errors name a process."""
        p = self.peers[rank]
        return f"{p.role} rank {rank} (machine {p.machine})"

    def describe(self) -> str:
        """One line per machine with its ranks and roles."""
        lines = []
        for m in self.machines:
            ranks = [f"{p.rank}:{p.role}" for p in self.peers if p.machine == m]
            lines.append(f"{m}: {' '.join(ranks)}")
        return "\n".join(lines)
