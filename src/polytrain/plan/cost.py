"""The cost model: predicted step time of each data-parallel strategy, as pure functions.

A step is the workers' compute, then whatever communication backward does
not hide, plus a fixed cost per step::

    step = overhead + compute + max(0, comm - overlap * backward)
    comm = max(link, host) + combine * min(link, host) + latency
    link = (busiest NIC bytes + tail * fan-out bytes) / (efficiency * B)
    host = host CPU bytes * c / cores + server * summation servers

- busiest NIC bytes per step, one direction, in units of the gradient M (the
  formulas of the papers; ``nic_traffic``): torch's ring over p workers
  2(p-1)/p; BytePS's Theorem 1 2n(n-1)/(n^2+kn-2k); Herring M(2n+k-2)/(n+k) on a
  worker machine and nM/(n+k) on a CPU machine.
- ``efficiency``: per strategy family, the fraction of the link's rate its
  transfers keep busy (at best the payload per byte on the wire, 1448/1514 for
  TCP/IP on 1500-byte frames; less where a strategy leaves the link idle
  between messages); fitted on ``./dev bench cluster``.
- fan-out bytes (``fanout_traffic``): a server can answer a partition only when
  every machine's push of it is in, so a step's first partition arrives and its
  last one leaves with the links otherwise idle: n machines times the largest
  partition a server holds (BytePS's partition, a Herring shard; none for a
  ring); ``tail`` weighs it (fitted).
- host CPU: when every emulated machine runs on this one host, all bytes that
  cross any NIC are copied by the same ``cores``; ``c`` (seconds per byte, per
  strategy family), ``server`` (seconds per step per summation server holding a
  share: its threads and messages), ``overhead`` and ``combine`` (how much of
  the smaller of link and host adds to the larger: 0 when they overlap
  entirely, 1 when not at all) are fitted on ``./dev bench cluster``.
- latency: ring all-reduce pays it 2(p-1) times per bucket, Herring twice per
  bucket (its n+k shards travel together), BytePS once each way per partition
  of the server holding the most (the largest share, as for the fan-out: the
  engine sends each server one at a time, to every server at once).
- real machines (``shared_host_cores=None``): the papers' model, with the
  wire's efficiency, no host term, no fan-out term and no overhead (the fitted
  constants describe this host's emulation only).

Example::

    >>> nic_traffic("ddp", machines=4, local_workers=1, servers=0)
    1.5
    >>> round(nic_traffic("byteps", machines=4, local_workers=1, servers=2), 4)
    1.2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..comm.partition import DEFAULT_PARTITION_BYTES
from ..errors import ConfigError
from ..strategies.byteps.plan import optimal_shares
from ..strategies.herring.plan import herring_traffic

__all__ = ["STRATEGIES", "Constants", "Candidate", "Compute", "Network", "Prediction",
           "nic_traffic", "host_traffic", "fanout_traffic", "summation_servers", "candidates",
           "predict", "recommend", "WIRE_EFFICIENCY"]

#: The strategies the cost model knows: every data-parallel one that trains any model.
STRATEGIES = ("ddp", "byteps", "herring")
_MB = 1 << 20
#: Payload bytes per byte on the wire: a 1448-byte TCP segment in a 1514-byte frame.
WIRE_EFFICIENCY = 1448 / 1514


@dataclass(frozen=True, kw_only=True)
class Constants:
    """The model's constants; see docs/cluster.md for how each was obtained.

    Args:
        efficiency: per strategy, the fraction of the link's rate its transfers use
            (default 1448/1514, TCP/IP's payload per byte on the wire; fitted).
        host_s_per_byte: per strategy, CPU seconds per byte crossing a NIC when every
            machine shares one host (fitted on ``./dev bench cluster``).
        overhead_s: per strategy, fixed seconds per step (fitted there too).
        tail: per strategy, the weight of the fan-out bytes on the link (fitted; default 0).
        server_s: per strategy, host seconds per step per summation server that holds a
            share (fitted; default 0).
        combine: per strategy, the share of the smaller of link and host time that adds to
            the larger (0: they overlap entirely, the default; 1: not at all; fitted).
        overlap: the fraction of backward that communication can hide behind (assumed).
        bucket_bytes: ddp's and Herring's fusion buffer (25 MiB), for the latency term.
        partition_bytes: BytePS's partition (4,096,000), for the latency term.
    """

    efficiency: Mapping[str, float] = field(default_factory=lambda: {
        s: WIRE_EFFICIENCY for s in STRATEGIES})
    host_s_per_byte: Mapping[str, float] = field(default_factory=lambda: {
        "ddp": 0.0, "byteps": 0.0, "herring": 0.0})
    overhead_s: Mapping[str, float] = field(default_factory=lambda: {
        "ddp": 0.0, "byteps": 0.0, "herring": 0.0})
    tail: Mapping[str, float] = field(default_factory=dict)
    server_s: Mapping[str, float] = field(default_factory=dict)
    combine: Mapping[str, float] = field(default_factory=dict)
    overlap: float = 0.5
    bucket_bytes: int = 25 * _MB
    partition_bytes: int = DEFAULT_PARTITION_BYTES

    def as_dict(self) -> dict[str, object]:
        return {"efficiency": dict(self.efficiency), "host_s_per_byte": dict(self.host_s_per_byte),
                "overhead_s": dict(self.overhead_s), "tail": dict(self.tail),
                "server_s": dict(self.server_s), "combine": dict(self.combine),
                "overlap": self.overlap, "bucket_bytes": self.bucket_bytes,
                "partition_bytes": self.partition_bytes}


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run the job: a strategy and how many dedicated CPU servers it uses."""

    strategy: str
    servers: int = 0

    @property
    def key(self) -> str:
        """``ddp``, ``byteps k=2``: the name predictions are listed under."""
        return self.strategy if self.strategy == "ddp" else f"{self.strategy} k={self.servers}"


@dataclass(frozen=True, kw_only=True)
class Compute:
    """One worker's compute per step at its batch: forward, backward, optimizer (seconds).

    ``emulated``: the times are an emulated device's (``--devices``), which a worker waits
    out whatever else runs on the host, so the workers' sharing of its cores does not
    stretch them (they are measured here otherwise, on one core, and it does)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    emulated: bool = False

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass(frozen=True, kw_only=True)
class Network:
    """The cluster's machines and links.

    Args:
        machines: n, worker machines. local_workers: workers on each.
        servers: k, dedicated CPU machines available.
        bandwidth_bit_s: each NIC's rate, each way (None: loopback, no network bound).
        latency_s: delay of every packet a machine sends.
        shared_host_cores: every machine runs on one host of this many cores, as
            ``polytrain train`` emulates them (None: each machine is its own host).
    """

    machines: int
    local_workers: int = 1
    servers: int = 0
    bandwidth_bit_s: float | None = None
    latency_s: float = 0.0
    shared_host_cores: int | None = None

    def __post_init__(self) -> None:
        if self.machines < 1 or self.local_workers < 1 or self.servers < 0:
            raise ConfigError(f"a cluster needs at least one machine of at least one worker "
                              f"and 0 or more servers (got {self.machines} machines of "
                              f"{self.local_workers}, {self.servers} servers)",
                              "pass --nodes 1 or more, --workers a multiple of it")

    @property
    def workers(self) -> int:
        return self.machines * self.local_workers


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The predicted step of one candidate, and its parts (seconds; bytes in units of M)."""

    candidate: Candidate
    step_time_s: float
    comm_s: float
    compute_s: float
    nic_bytes_M: float
    link_s: float
    host_s: float
    latency_s: float

    def as_dict(self) -> dict[str, object]:
        return {"strategy": self.candidate.strategy, "servers": self.candidate.servers,
                "step_time_s": self.step_time_s, "comm_s": self.comm_s,
                "compute_s": self.compute_s, "nic_bytes_per_step_M": self.nic_bytes_M,
                "link_s": self.link_s, "host_s": self.host_s, "latency_s": self.latency_s}


def _unknown(strategy: str) -> ConfigError:
    return ConfigError(f"the cost model knows no strategy {strategy!r}; it knows: "
                       f"{', '.join(STRATEGIES)}", "pass one of them")


def nic_traffic(strategy: str, *, machines: int, local_workers: int, servers: int) -> float:
    """The busiest NIC's bytes per step, one direction, in units of the gradient M."""
    n, k = machines, servers
    if strategy == "ddp":  # torch's ring over every worker: one cross-machine edge per machine
        p = n * local_workers
        return 2 * (p - 1) / p if n > 1 else 0.0
    if strategy == "byteps":
        return optimal_shares(n, k).traffic_per_machine() if n > 1 or k else 0.0
    if strategy == "herring":
        t = herring_traffic(n, k)
        return max(t["worker"], t["server"]) if n > 1 or k else 0.0
    raise _unknown(strategy)


def _crosses_nics(strategy: str, machines: int, servers: int) -> bool:
    """Whether any of a step's bytes cross a NIC (not on one machine without servers, nor
    for BytePS's on one machine: Theorem 1 gives them nothing)."""
    return nic_traffic(strategy, machines=machines, local_workers=1, servers=servers) > 0


def host_traffic(strategy: str, *, machines: int, local_workers: int, servers: int) -> float:
    """Bytes sent per step over every NIC together, in units of M (what one host copies)."""
    n, k = machines, servers
    if strategy == "ddp":
        return n * nic_traffic("ddp", machines=n, local_workers=local_workers, servers=0)
    if strategy == "byteps":
        s = optimal_shares(n, k)
        return n * s.worker_machine_traffic() + k * s.cpu_machine_traffic() if n > 1 or k \
            else 0.0
    if strategy == "herring":
        t = herring_traffic(n, k)
        return n * t["worker"] + k * t["server"] if n > 1 or k else 0.0
    raise _unknown(strategy)


def summation_servers(strategy: str, *, machines: int, servers: int) -> int:
    """Processes that hold a share of the sums (each costs the host its threads and messages):
    BytePS's colocated servers only while they own bytes (not with k >= n), its dedicated
    ones only while they do (not on one machine), Herring's always."""
    if strategy == "ddp":
        return 0
    if strategy == "byteps":
        shares = optimal_shares(machines, servers)
        return (machines if shares.per_colocated_server > 0 else 0) + shares.cpu_servers
    if strategy == "herring":
        return machines + servers
    raise _unknown(strategy)


def fanout_traffic(strategy: str, *, machines: int, servers: int, model_bytes: float,
                   constants: Constants) -> float:
    """Bytes of one partition from (or to) every machine: the largest a server holds, n times.

    A server answers a partition once every machine's push of it is in, so the
    step's first partition comes in, and its last goes out, while the links are
    otherwise idle.
    """
    n = machines
    if strategy == "ddp" or not _crosses_nics(strategy, n, servers):
        return 0.0
    if strategy == "byteps":
        shares = optimal_shares(n, servers)
        largest = max(shares.per_colocated_server, shares.per_cpu_server) * model_bytes
        return n * min(constants.partition_bytes, largest)
    if strategy == "herring":
        return n * min(constants.bucket_bytes, model_bytes) / (n + servers)
    raise _unknown(strategy)


def _messages(candidate: Candidate, network: Network, model_bytes: float,
              constants: Constants) -> int:
    """Packets' delays a step waits out one after another (for the latency term)."""
    n, p = network.machines, network.workers
    if not _crosses_nics(candidate.strategy, n, candidate.servers):
        return 0
    buckets = max(1, math.ceil(model_bytes / constants.bucket_bytes))
    if candidate.strategy == "ddp":
        return 2 * (p - 1) * buckets
    if candidate.strategy == "herring":
        # Every bucket is cut into n+k shards that travel together: a push and a pull each.
        return 2 * buckets
    # The engine sends each server one partition at a time (a credit per server), and
    # partitions to different servers travel together: a push and a pull per round of the
    # busiest server, the one with the largest share of the model's partitions (a CPU
    # server's x/k with 0 < k < n; none for the colocated ones with k >= n). A share that
    # ends inside a partition takes a piece of it, one round more.
    shares = optimal_shares(n, candidate.servers)
    largest = max(shares.per_colocated_server, shares.per_cpu_server)
    partitions = max(1, math.ceil(model_bytes / constants.partition_bytes))
    return 2 * max(1, math.ceil(round(partitions * largest, 9)))


def candidates(network: Network) -> list[Candidate]:
    """Every strategy the job can run with: ddp, and BytePS and Herring on 0..k servers; ddp
    alone for one worker, which has nothing to sum (servers would only add their cost);
    BytePS on one worker machine without servers only (Theorem 1 gives them nothing: k >= 1
    runs k = 0's sums, and no byte crosses their links)."""
    out = [Candidate(strategy="ddp")]
    if network.workers < 2:
        return out
    for strategy in ("byteps", "herring"):
        most = 0 if strategy == "byteps" and network.machines == 1 else network.servers
        out += [Candidate(strategy=strategy, servers=k) for k in range(most + 1)]
    return out


def predict(candidate: Candidate, *, network: Network, compute: Compute, model_bytes: float,
            constants: Constants = Constants()) -> Prediction:
    """The step time of ``candidate`` on ``network`` (seconds), with its parts."""
    shape = {"machines": network.machines, "local_workers": network.local_workers,
             "servers": candidate.servers}
    s = candidate.strategy
    nic = nic_traffic(s, **shape)
    emulated = network.shared_host_cores is not None
    # The fixed costs (overhead_s, server_s) were fitted on runs whose sums cross machines:
    # where none of a candidate's bytes does (one machine, no dedicated server) they do not
    # apply (on one machine of 2 workers ddp's 7 ms put it behind byteps, which ran slower).
    fitted = emulated and nic > 0
    # The fitted constants describe this host's emulation; real machines get the papers'
    # model: the wire's efficiency, no host term, no overhead.
    efficiency = constants.efficiency.get(s, WIRE_EFFICIENCY) if emulated else WIRE_EFFICIENCY
    fanout = 0.0
    if emulated:
        fanout = constants.tail.get(s, 0.0) * fanout_traffic(
            s, machines=network.machines, servers=candidate.servers, model_bytes=model_bytes,
            constants=constants)
    if network.bandwidth_bit_s is None:
        link = 0.0
    else:
        link = (nic * model_bytes + fanout) / (efficiency * network.bandwidth_bit_s / 8)
    per_byte = constants.host_s_per_byte.get(s, 0.0)
    if network.shared_host_cores is not None:
        host = (host_traffic(s, **shape) * model_bytes * per_byte / network.shared_host_cores
                + (constants.server_s.get(s, 0.0) if fitted else 0.0) * summation_servers(
                    s, machines=network.machines, servers=candidate.servers))
        # The workers' compute shares the same cores (an emulated device's is waited out).
        share = 1.0 if compute.emulated else max(1.0, network.workers
                                                 / network.shared_host_cores)
    else:  # real machines, each with its own CPUs: the NIC is the bound, as in the papers
        host, share = 0.0, 1.0
    latency = _messages(candidate, network, model_bytes, constants) * network.latency_s
    comm = max(link, host) + constants.combine.get(s, 0.0) * min(link, host) + latency
    compute_s = compute.step_s * share
    hidden = constants.overlap * compute.backward_s * share
    overhead = constants.overhead_s.get(s, 0.0) if fitted else 0.0
    step = overhead + compute_s + max(0.0, comm - hidden)
    return Prediction(candidate=candidate, step_time_s=step, comm_s=comm, compute_s=compute_s,
                      nic_bytes_M=nic, link_s=link, host_s=host, latency_s=latency)


def recommend(predictions: Sequence[Prediction], *, tolerance: float = 0.01) -> Prediction:
    """The fastest prediction; within ``tolerance`` of it, the one with fewer servers, and
    ddp (torch's own) before BytePS before Herring."""
    if not predictions:
        raise ConfigError("no strategy can run this job", "check --workers and --nodes")
    best = min(p.step_time_s for p in predictions)
    close = [p for p in predictions if p.step_time_s <= best * (1 + tolerance)]
    return min(close, key=lambda p: (p.candidate.servers, STRATEGIES.index(p.candidate.strategy),
                                     p.step_time_s))
