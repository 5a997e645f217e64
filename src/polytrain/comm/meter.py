"""The traffic meter: every byte the library sends or receives, per peer and per step."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Iterable, Mapping, Sequence

from .topology import Topology

__all__ = ["TrafficMeter", "MeterReport", "MachineTraffic", "NicCounters", "machine_traffic",
           "server_traffic", "sent_bytes_by_step", "without_steps", "SENT", "RECV"]

SENT = "sent"
RECV = "recv"

# (peer rank, SENT or RECV, estimated) -> bytes
_Key = tuple[int, str, bool]
# machine -> the kernel's (sent, received) byte counters of its NIC
NicCounters = Mapping[str, tuple[int, int]]


@dataclass(frozen=True)
class MeterReport:
    """One rank's meter readings, picklable: the totals and one window per marked step.

    ``nics``, on the rank that samples the NICs of an emulated network: the
    counters when sampling began, then after every marked step.
    """

    rank: int
    totals: dict[_Key, int]
    steps: list[dict[_Key, int]] = field(default_factory=list)
    nics: list[dict[str, tuple[int, int]]] = field(default_factory=list)

    def bytes(self, direction: str, peers: Iterable[int] | None = None) -> int:
        """Total bytes sent (or received) to ``peers`` (default: all), measured and estimated."""
        wanted = None if peers is None else set(peers)
        return sum(n for (p, d, _), n in self.totals.items()
                   if d == direction and (wanted is None or p in wanted))


class TrafficMeter:
    """Counts the bytes of every message this process sends or receives.

    The communication core calls :meth:`record` for each point-to-point
    message; collectives whose bytes move inside torch are recorded as
    ``estimated`` from their algorithm's cost. :meth:`mark_step` closes a
    training step's window, so reports give bytes per step.
    """

    def __init__(self, rank: int, topology: Topology) -> None:
        self.rank = rank
        self.topology = topology
        self._lock = threading.Lock()
        self._totals: dict[_Key, int] = defaultdict(int)
        self._window: dict[_Key, int] = defaultdict(int)
        self._steps: list[dict[_Key, int]] = []
        self._nic_sampler: Callable[[], NicCounters] | None = None
        self._nics: list[dict[str, tuple[int, int]]] = []
        # Per machine, the NIC bytes discarded so far: left out of every later sample.
        self._nic_discarded: dict[str, tuple[int, int]] = {}

    def sample_nics(self, sampler: Callable[[], NicCounters]) -> None:
        """Read the machines' NIC counters now and at every :meth:`mark_step` from here on."""
        self._nic_sampler = sampler
        self._nics, self._nic_discarded = [dict(sampler())], {}

    def record(self, peer: int, nbytes: int, direction: str, *, estimated: bool = False) -> None:
        key = (peer, direction, estimated)
        with self._lock:
            self._totals[key] += nbytes
            self._window[key] += nbytes

    def mark_step(self) -> None:
        """End the current step: what was recorded since the last mark becomes one step."""
        with self._lock:
            self._steps.append(dict(self._window))
            self._window.clear()
            if self._nic_sampler is not None:
                self._nics.append(self._nic_sample())

    def discard(self) -> None:
        """Leave out of every step what was recorded since the last mark (a held-out
        evaluation's or a checkpoint's bytes between two steps), the NICs' too; the totals
        keep it."""
        with self._lock:
            self._window.clear()
            if self._nic_sampler is not None and self._nics:
                # Later samples go on from the last mark's: the bytes since are left out.
                now, last = self._nic_sampler(), self._nics[-1]
                self._nic_discarded = {m: (now[m][0] - last[m][0], now[m][1] - last[m][1])
                                       for m in now if m in last}

    def _nic_sample(self) -> dict[str, tuple[int, int]]:
        assert self._nic_sampler is not None
        off = self._nic_discarded
        return {m: (sent - off.get(m, (0, 0))[0], recv - off.get(m, (0, 0))[1])
                for m, (sent, recv) in self._nic_sampler().items()}

    def report(self) -> MeterReport:
        with self._lock:
            return MeterReport(self.rank, dict(self._totals), [dict(s) for s in self._steps],
                               [dict(n) for n in self._nics])

    def total(self, direction: str, *, inter: bool | None = None) -> int:
        """Bytes sent or received so far; ``inter`` keeps only cross-machine (or local) peers."""
        with self._lock:
            items = list(self._totals.items())
        return sum(n for (p, d, _), n in items if d == direction and (
            inter is None or self.topology.is_inter(self.rank, p) == inter))

    def record_ring_allreduce(self, ranks: Sequence[int], nbytes: int) -> None:
        """Record a ring all-reduce of ``nbytes`` over ``ranks`` (estimated: torch moved it).

        A ring of p ranks has every rank send 2(p-1)/p of the buffer to its
        successor and receive as much from its predecessor.
        """
        p = len(ranks)
        if p < 2 or self.rank not in ranks:
            return
        i = list(ranks).index(self.rank)
        share = 2 * (p - 1) * nbytes // p
        self.record(ranks[(i + 1) % p], share, SENT, estimated=True)
        self.record(ranks[(i - 1) % p], share, RECV, estimated=True)

    def record_ring_allgather(self, ranks: Sequence[int], nbytes: int) -> None:
        """Record a ring all-gather over ``ranks`` of this rank's ``nbytes`` (estimated: torch
        moved it; the others' parts taken as large as this one's).

        A ring of p ranks has every rank pass on p - 1 parts to its successor (its own and
        p - 2 others') and receive as many from its predecessor: how gloo sums sparse
        gradients (every rank's rows and their indices, gathered).
        """
        p = len(ranks)
        if p < 2 or self.rank not in ranks:
            return
        i = list(ranks).index(self.rank)
        self.record(ranks[(i + 1) % p], (p - 1) * nbytes, SENT, estimated=True)
        self.record(ranks[(i - 1) % p], (p - 1) * nbytes, RECV, estimated=True)

    def record_broadcast(self, ranks: Sequence[int], src: int, nbytes: int) -> None:
        """Record a broadcast of ``nbytes`` from ``src`` over ``ranks`` (estimated: torch
        moved it), as a chain from ``src`` through the others in order: every rank but
        ``src`` receives the buffer once, from the one before it, and passes it to the next,
        so each machine of ranks taken in machine order receives it once (a tree's least;
        gloo's binomial tree sends from fewer machines, more copies each)."""
        chain = [src, *(r for r in ranks if r != src)]
        if len(chain) < 2 or self.rank not in chain:
            return
        i = chain.index(self.rank)
        if i > 0:
            self.record(chain[i - 1], nbytes, RECV, estimated=True)
        if i + 1 < len(chain):
            self.record(chain[i + 1], nbytes, SENT, estimated=True)


@dataclass(frozen=True)
class MachineTraffic:
    """Bytes one machine sends to and receives from other machines per steady-state step.

    On an emulated network, ``nic_*`` are the same figures from the kernel's
    counters of the machine's NIC: every byte on the wire, headers included.
    """

    name: str
    kind: str  # "worker" or "server"
    sent_bytes_per_step: float
    recv_bytes_per_step: float
    estimated: bool
    nic_sent_bytes_per_step: float | None = None
    nic_recv_bytes_per_step: float | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name, "kind": self.kind,
            "sent_bytes_per_step": self.sent_bytes_per_step,
            "recv_bytes_per_step": self.recv_bytes_per_step, "estimated": self.estimated}
        if self.nic_sent_bytes_per_step is not None:
            out["nic_sent_bytes_per_step"] = self.nic_sent_bytes_per_step
            out["nic_recv_bytes_per_step"] = self.nic_recv_bytes_per_step
        return out


def machine_traffic(reports: Sequence[MeterReport], topology: Topology, *,
                    warmup: int = 1) -> list[MachineTraffic]:
    """Cross-machine bytes per step for every machine, from the ranks' reports.

    Each message is counted once: from its sender's report when the sender
    reported, else from its receiver's (so workers' reports alone cover their
    traffic with servers). Steps after the first ``warmup`` are averaged. Reports that
    counted no step (servers': they never call ``mark_step``) are left out, so
    ``machine_traffic(ctx.shutdown(), ...)`` sees the workers' steps.
    """
    reports = _stepped(reports)
    reporting = {r.rank for r in reports}
    first, nsteps = _steady_window(reports, warmup)
    counted = max(1, nsteps - first)
    sent: dict[str, float] = defaultdict(float)
    recv: dict[str, float] = defaultdict(float)
    estimated: set[str] = set()
    for rep in reports:
        here = topology.machine(rep.rank)
        for step in rep.steps[first:nsteps]:
            for (peer, direction, est), n in step.items():
                there = topology.machine(peer)
                if there == here or (direction == RECV and peer in reporting):
                    continue
                src, dst = (here, there) if direction == SENT else (there, here)
                sent[src] += n / counted
                recv[dst] += n / counted
                if est:
                    estimated.update((src, dst))
    worker_machines = set(topology.worker_machines)
    nics = _nic_traffic(reports, first, nsteps)
    return [MachineTraffic(m, "worker" if m in worker_machines else "server",
                           sent[m], recv[m], m in estimated,
                           *(nics[m] if m in nics else (None, None)))
            for m in topology.machines]


def without_steps(report: MeterReport, steps: Collection[int]) -> MeterReport:
    """``report`` less the given steps (indices into its steps): their bytes and their NICs'
    (the counters after each later step go down by what the counters grew in them)."""
    if not steps:
        return report
    nics = report.nics[:1]
    off: dict[str, tuple[int, int]] = {}
    for i, (before, after) in enumerate(zip(report.nics, report.nics[1:])):
        if i in steps:
            off = {m: (off.get(m, (0, 0))[0] + after[m][0] - before[m][0],
                       off.get(m, (0, 0))[1] + after[m][1] - before[m][1])
                   for m in after if m in before}
        else:
            nics.append({m: (sent - off.get(m, (0, 0))[0], recv - off.get(m, (0, 0))[1])
                         for m, (sent, recv) in after.items()})
    return replace(report, nics=nics,
                   steps=[s for i, s in enumerate(report.steps) if i not in steps])


def sent_bytes_by_step(reports: Sequence[MeterReport], topology: Topology) -> list[float]:
    """Cross-machine bytes sent in each step, all machines together (each message once, as
    :func:`machine_traffic` counts them): for runs whose traffic changes over time (a
    compression warm-up)."""
    reports = _stepped(reports)
    reporting = {r.rank for r in reports}
    nsteps = min((len(r.steps) for r in reports), default=0)
    out = [0.0] * nsteps
    for rep in reports:
        here = topology.machine(rep.rank)
        for i, step in enumerate(rep.steps[:nsteps]):
            for (peer, direction, _), n in step.items():
                if topology.machine(peer) == here or (direction == RECV and peer in reporting):
                    continue
                out[i] += n
    return out


def _stepped(reports: Sequence[MeterReport]) -> list[MeterReport]:
    """The reports that counted steps (a server's counts none: every window would be 0)."""
    return [r for r in reports if r.steps]


def _steady_window(reports: Sequence[MeterReport], warmup: int) -> tuple[int, int]:
    """The steps every report has, less the first ``warmup`` ones: ``(first, end)``."""
    nsteps = min((len(r.steps) for r in reports), default=0)
    # Fewer steps than the warm-up (a short run's reports): still not the cold first.
    return (warmup if nsteps > warmup else min(1, nsteps - 1) if nsteps else 0), nsteps


def _nic_traffic(reports: Sequence[MeterReport], first: int,
                 end: int) -> dict[str, tuple[float, float]]:
    """Per machine, NIC bytes (sent, received) per step over steps ``first..end-1``.

    The counters after step ``i`` are ``nics[i + 1]`` (``nics[0]``: before the first
    step), so the window's bytes are ``nics[end] - nics[first]``.
    """
    nics = next((r.nics for r in reports if r.nics), None)
    if nics is None or end >= len(nics):
        return {}
    counted = max(1, end - first)
    start, stop = nics[first], nics[end]
    return {m: ((stop[m][0] - start[m][0]) / counted, (stop[m][1] - start[m][1]) / counted)
            for m in stop if m in start}


def server_traffic(reports: Sequence[MeterReport], topology: Topology, *,
                   warmup: int = 1) -> list[dict[str, object]]:
    """Every server process's bytes received and sent per steady-state step (all its bytes,
    machine-local ones too), from the workers' reports: a server talks to workers only.

    Shows the balance of a placement: equal shards give equal bytes to every server.
    """
    workers = [r for r in reports if r.rank in set(topology.workers)]
    first, nsteps = _steady_window(workers, warmup)
    counted = max(1, nsteps - first)
    out = []
    for server in topology.servers:
        recv = sent = 0.0
        for rep in workers:
            for step in rep.steps[first:nsteps]:
                recv += sum(n for (p, d, _), n in step.items() if p == server and d == SENT)
                sent += sum(n for (p, d, _), n in step.items() if p == server and d == RECV)
        out.append({"rank": server, "machine": topology.machine(server),
                    "recv_bytes_per_step": recv / counted, "sent_bytes_per_step": sent / counted})
    return out
