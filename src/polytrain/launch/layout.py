"""Process layouts: which rank is a worker or a server, on which (emulated) machine."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, at_least, divisors

__all__ = ["Layout", "ProcessSpec", "WORKER", "SERVER"]

WORKER = "worker"
SERVER = "server"


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a run: its rank, role, machine and rank among its machine's workers."""

    rank: int
    role: str
    machine: str
    local_rank: int


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How many processes of each role run on which emulated machines.

    Ranks are workers first (machine ``node0`` holds ranks ``0..W/N-1``, then
    ``node1``, ...), then the servers colocated on worker machines (``colocated``
    per machine), then the dedicated servers, each its own CPU machine
    ``server0``, ``server1``, ...

    Example::

        >>> Layout(workers=4, nodes=2, servers=1).describe()
        'node0: worker 0, worker 1 | node1: worker 2, worker 3 | server0: server 4'

    Args:
        workers: total worker processes (default 1), spread evenly over ``nodes``.
        nodes: emulated worker machines (default 1).
        servers: dedicated server processes, one CPU machine each (default 0).
        colocated: server processes on every worker machine (default 0).
    """

    workers: int = 1
    nodes: int = 1
    servers: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "nodes"):
            at_least(f"--{name}", getattr(self, name), f"pass --{name} 1 or more", whole=True)
        for name in ("servers", "colocated"):
            at_least(f"--{name}", getattr(self, name), f"pass --{name} 0 or more", minimum=0,
                     whole=True)
        if self.workers % self.nodes:
            raise ConfigError(
                f"--workers {self.workers} is not divisible by --nodes {self.nodes}: every "
                f"emulated machine holds the same number of workers",
                f"pass --nodes one of {divisors(self.workers)}, or --workers a multiple of "
                f"{self.nodes}")

    @property
    def workers_per_node(self) -> int:
        return self.workers // self.nodes

    @property
    def world_size(self) -> int:
        return self.workers + self.nodes * self.colocated + self.servers

    def processes(self) -> tuple[ProcessSpec, ...]:
        """Every process of the run, in rank order."""
        specs: list[ProcessSpec] = []
        per = self.workers_per_node
        for rank in range(self.workers):
            specs.append(ProcessSpec(rank, WORKER, f"node{rank // per}", rank % per))
        for node in range(self.nodes):
            for i in range(self.colocated):
                specs.append(ProcessSpec(len(specs), SERVER, f"node{node}", per + i))
        for i in range(self.servers):
            specs.append(ProcessSpec(len(specs), SERVER, f"server{i}", 0))
        return tuple(specs)

    def machines(self) -> tuple[str, ...]:
        """Every machine of the run, in rank order: ``node0``, ..., then ``server0``, ..."""
        return tuple(dict.fromkeys(p.machine for p in self.processes()))

    def describe(self) -> str:
        """One line: each machine and its processes."""
        machines: dict[str, list[str]] = {}
        for p in self.processes():
            machines.setdefault(p.machine, []).append(f"{p.role} {p.rank}")
        return " | ".join(f"{m}: {', '.join(ps)}" for m, ps in machines.items())
