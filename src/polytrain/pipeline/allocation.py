"""Allocation policies NP, ED and HD: a cluster's devices grouped into virtual workers (plain data).

HetPipe (Park et al., USENIX ATC 2020) places GPUs into virtual workers (VWs)
three ways, for clusters whose machines each hold one device type:

- ``np`` (node partition): one VW per machine; no activation crosses machines,
  but VWs run at their machine's speed.
- ``ed`` (equal distribution): VW ``i`` takes device ``i`` of every machine, so
  all VWs are identical; every stage boundary crosses machines.
- ``hd`` (hybrid distribution): machines are paired fastest with slowest and
  each pair forms two VWs of half of each machine's devices: VWs of even
  speed with one machine crossing per VW. A machine of several types is cut
  into halves of its types' devices alike (fast + slow, not fast + fast), and
  the faster half of one machine goes with the slower half of the other.
- ``bd`` (bidirectional, beyond HetPipe; two machines): ED's VWs, each with a
  twin that runs its devices in the opposite order, so every device holds a
  stage of two VWs (Chimera's bidirectional pipelines, Li and Hoefler, SC 2021).
  Each VW keeps one minibatch in flight (no local staleness); its twin's work
  fills the device while it waits.

Within a virtual worker the devices run slowest first (ties in the policy's
order; hd: the slower machine's half first, each half slowest first, so that it
crosses machines once). The order hardly changes the period: the partitioner balances the
stages whatever the order (only the links between neighbours differ; on 2
fast + 2 slow devices slowest-first is even 4% faster by the cost model, as
the head lands on a fast device). It changes which layers learn late: stage ``j``
applies its gradients ``N_m - 1 - j`` updates after the forward that made
them, so the first stages are the stale ones, and a slow device there takes
the fewest layers. On 2 fast + 2 slow devices (ED, N_m = 2, D = 1) that cut
the loss gap to ddp after 300 steps from 9% to 1% (docs/hetpipe.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..emulation.devices import Cluster, Device
from ..emulation.profile import ModelProfile
from ..errors import ConfigError, unknown
from .partition import PipelinePlan, minmax_cut, period_cut, plan_pipeline

__all__ = ["POLICIES", "VirtualWorker", "allocate", "check_batch", "check_policy",
           "count_virtual_workers",
           "HetPipePlan", "plan_hetpipe", "roles_of"]

POLICIES = ("np", "ed", "hd", "bd")


@dataclass(frozen=True)
class VirtualWorker:
    """A virtual worker: its devices, in pipeline order (stage ``j`` runs on ``devices[j]``),
    slowest first."""

    index: int
    devices: tuple[Device, ...]

    def describe(self) -> str:
        return f"virtual worker {self.index}: " + " -> ".join(d.describe() for d in self.devices)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise unknown("allocation policy", policy, POLICIES, "pass --policy np, ed, hd or bd",
                      plural="policies")


def count_virtual_workers(workers: int, nodes: int, policy: str) -> int:
    """How many VWs ``policy`` makes of ``workers`` devices on ``nodes`` machines."""
    check_policy(policy)
    per = workers // nodes
    if policy == "np":
        return nodes
    if policy == "ed":
        return per
    if policy == "bd":
        if nodes != 2:
            raise ConfigError(f"policy 'bd' pairs the devices of two machines into VWs running "
                              f"both ways, but the run has {nodes} machine(s)",
                              "use 2 machines (--nodes 2, or two in --devices), or --policy ed")
        return 2 * per
    if nodes == 1:
        return 1
    if per % 2:
        raise ConfigError(f"policy 'hd' splits each machine's devices in halves, but machines "
                          f"hold {per} devices", "use --policy ed or np, or machines with an "
                          "even number of devices")
    return nodes  # two VWs per pair of machines; an odd one out forms one VW of its own


def allocate(cluster: Cluster, policy: str) -> tuple[VirtualWorker, ...]:
    """Group ``cluster``'s devices into virtual workers by ``policy``.

    Example::

        >>> vws = allocate(parse_cluster("m0:fast*2,m1:slow*2"), "np")
        >>> [[d.index for d in vw.devices] for vw in vws]
        [[0, 1], [2, 3]]
    """
    count_virtual_workers(cluster.size, len(cluster.machines), policy)
    by_machine: list[list[Device]] = [[] for _ in cluster.machines]
    for d in cluster.devices:
        by_machine[d.machine_index].append(d)
    groups: list[list[Device]]
    if policy == "np":
        groups = by_machine
    else:
        counts = [len(m) for m in by_machine]
        if len(set(counts)) > 1:  # a virtual worker takes one device of every machine (ed,
            # bd), or half of two machines' (hd)
            how = ("splits the machines' devices in halves, pairing machines," if policy == "hd"
                   else "takes one device of every machine for each virtual worker,")
            raise ConfigError(f"--policy {policy} {how} and the machines hold {counts} devices",
                              "give every machine as many devices (training starts as "
                              "many workers on each, whatever the policy)")
        groups = ([[m[i] for m in by_machine] for i in range(counts[0])]
                  if policy in ("ed", "bd") else _hybrid(by_machine))
    if policy != "hd":  # hd orders its own: a machine's half stays together
        groups = [_slowest_first(g) for g in groups]
    groups.sort(key=lambda g: min(d.index for d in g))
    if policy == "bd":  # each VW, then its twin the other way
        groups = [h for g in groups for h in (g, g[::-1])]
    return tuple(VirtualWorker(i, tuple(g)) for i, g in enumerate(groups))


def _hybrid(by_machine: list[list[Device]]) -> list[list[Device]]:
    if len(by_machine) == 1:
        return [_slowest_first(by_machine[0])]
    # Fastest machine with slowest, second with second slowest, ... (ties by machine order).
    order = sorted(range(len(by_machine)), key=lambda m: (-_rate(by_machine[m]), m))
    groups: list[list[Device]] = []
    while len(order) >= 2:
        a, b = sorted((order.pop(0), order.pop(-1)))
        fast_a, slow_a = _halves(by_machine[a])
        fast_b, slow_b = _halves(by_machine[b])
        if _rate(fast_b) > _rate(slow_b):  # the faster half of one with the slower of the other
            fast_b, slow_b = slow_b, fast_b
        groups.append(_machine_halves(fast_a, fast_b))
        groups.append(_machine_halves(slow_a, slow_b))
    if order:
        groups.append(_slowest_first(by_machine[order[0]]))
    return groups


def _slowest_first(devices: Sequence[Device]) -> list[Device]:
    return sorted(devices, key=lambda d: d.type.gflops)  # stable: ties keep order


def _machine_halves(a: list[Device], b: list[Device]) -> list[Device]:
    """A virtual worker of two machines' halves: the slower half first (ties: ``a``), each
    slowest first, so that it crosses machines once (sorting its devices as one, a half of
    fast and slow devices crossed three times)."""
    first, second = (b, a) if _rate(b) < _rate(a) else (a, b)
    return _slowest_first(first) + _slowest_first(second)


def _halves(devices: list[Device]) -> tuple[list[Device], list[Device]]:
    """A machine's devices in two halves as even in speed as its types allow, the faster
    first: each type's devices cut in halves in machine order (a machine of one type: its
    first half and its second), each type's odd one out dealt in turn, fastest first."""
    first: list[Device] = []
    second: list[Device] = []
    odd: list[Device] = []
    for kind in dict.fromkeys(d.type for d in devices):
        same = [d for d in devices if d.type == kind]
        half = len(same) // 2
        first += same[:half]
        second += same[half:2 * half]
        odd += same[2 * half:]
    odd.sort(key=lambda d: -d.type.gflops)  # stable: ties keep machine order
    return (sorted(first + odd[0::2], key=lambda d: d.index),
            sorted(second + odd[1::2], key=lambda d: d.index))


def _rate(devices: Sequence[Device]) -> float:
    return sum(d.type.gflops for d in devices)


@dataclass(frozen=True)
class HetPipePlan:
    """Virtual workers, each with its pipeline plan, a common ``N_m`` and WSP's bound ``D``."""

    policy: str
    staleness: int
    minibatch: int
    inflight: int
    virtual_workers: tuple[VirtualWorker, ...]
    pipelines: tuple[PipelinePlan, ...]

    def roles(self, worker: int) -> list[tuple[int, int]]:
        """(virtual worker, stage) of each stage worker index ``worker`` runs."""
        return roles_of(self.virtual_workers, worker)

    @property
    def period(self) -> float:
        """Seconds per wave-minibatch of the slowest VW (WSP holds the others to it)."""
        return max(p.period for p in self.pipelines)

    def describe(self) -> str:
        lines = [f"HetPipe plan: policy {self.policy}, {len(self.virtual_workers)} virtual "
                 f"workers, N_m = {self.inflight} (local staleness {self.inflight - 1}), "
                 f"D = {self.staleness}, minibatch {self.minibatch}"]
        for vw, plan in zip(self.virtual_workers, self.pipelines):
            lines.append(vw.describe())
            lines.append(plan.describe())
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        """The ``hetpipe_plan`` of ``metrics.json``: N_m, D, and per VW its stages' devices,
        layer bounds (and spans) and times per minibatch (ms, by the cost model)."""
        return {"policy": self.policy, "inflight": self.inflight, "staleness": self.staleness,
                "minibatch": self.minibatch, "period_ms": round(self.period * 1e3, 6),
                "virtual_workers": [
                    {"index": vw.index, "devices": [d.describe() for d in vw.devices],
                     "bounds": list(plan.bounds),
                     "layers": [plan.span(j) for j in range(plan.stages)],
                     "stage_times_ms": [round(t * 1e3, 6) for t in plan.stage_times],
                     "period_ms": round(plan.period * 1e3, 6)}
                    for vw, plan in zip(self.virtual_workers, self.pipelines)]}


def roles_of(vws: Sequence[VirtualWorker], worker: int) -> list[tuple[int, int]]:
    """(virtual worker, stage) of each stage the device of worker index ``worker`` runs: one,
    or with policy ``bd`` two (stage ``j`` of a VW and ``S - 1 - j`` of its twin)."""
    found = [(vw.index, j) for vw in vws for j, d in enumerate(vw.devices) if d.index == worker]
    if not found:
        raise ValueError(f"worker {worker} is in no virtual worker")
    return found


def check_batch(global_batch: int, virtual_workers: int, policy: str) -> None:
    """Refuse a global batch the virtual workers cannot take equal slices of (every step's:
    a DataLoader's last batch may be shorter)."""
    if global_batch % virtual_workers:
        raise ConfigError(f"global batch {global_batch} is not divisible by the "
                          f"{virtual_workers} virtual workers of policy {policy!r}: each "
                          f"trains an equal slice", f"pass --batch-size a multiple of "
                          f"{virtual_workers} (a DataLoader: drop_last=True)")


def plan_hetpipe(cluster: Cluster, profile: ModelProfile, *, policy: str, global_batch: int,
                 state_factor: int, inflight: int | None = None, staleness: int = 0,
                 search: object = minmax_cut) -> HetPipePlan:
    """Allocate VWs by ``policy`` and partition the model over each; one N_m for all VWs.

    Every VW must use the same N_m (a clock is one wave of N_m minibatches in
    every VW), so when ``inflight`` is None the N_m chosen is the smallest that
    minimises the slowest VW's period. Policy ``bd`` runs N_m = 1 (a VW's twin fills
    its bubble, so its cut minimises the slowest stage, not the round trip), and each of
    a device's two stages must fit half its memory. Where the
    ``inflight`` given does not fit, the refusal names the largest N_m that does.
    """
    vws = allocate(cluster, policy)
    if policy == "bd":
        if inflight not in (None, 1):
            raise ConfigError(f"policy 'bd' keeps one minibatch in flight per virtual worker "
                              f"(its twin fills the pipeline), so N_m = {inflight} does not "
                              f"apply", "leave out --inflight (or pass --inflight 1)")
        inflight = 1
        halves = {d.index: replace(d, type=replace(d.type, memory_mb=d.type.memory_mb / 2))
                  for d in cluster.devices}
        vws = tuple(VirtualWorker(vw.index, tuple(halves[d.index] for d in vw.devices))
                    for vw in vws)
    check_batch(global_batch, len(vws), policy)
    minibatch = global_batch // len(vws)
    stages = max(len(vw.devices) for vw in vws)
    candidates = [inflight] if inflight is not None else list(range(1, stages + 1))
    best: tuple[float, int, tuple[PipelinePlan, ...]] | None = None
    error: ConfigError | None = None
    halved = "policy bd runs two stages per device" if policy == "bd" else None

    # At N_m = 1 a VW's round trip is its time per minibatch, but with bd its twin's
    # stages fill it: a device runs a stage of each, so the cut balances the stages.
    period_search = None if policy == "bd" else period_cut

    def plan_all(nm: int) -> tuple[PipelinePlan, ...]:
        return tuple(_plan_vw(cluster, vw, profile, minibatch, state_factor, nm, search,
                              period_search, halved) for vw in vws)
    for nm in candidates:
        try:
            plans = plan_all(nm)
        except ConfigError as e:
            error = error or e
            continue
        period = max(p.period for p in plans)
        if best is None or period < best[0]:
            best = (period, nm, plans)
    if best is None:
        assert error is not None
        if inflight is not None and inflight > 1:
            # Memory grows with N_m: the largest that fits is the last from 1 up that does.
            fits = 0
            for nm in range(1, inflight):
                try:
                    plan_all(nm)
                except ConfigError:
                    break
                fits = nm
            if fits:
                raise ConfigError(error.what, f"pass a smaller --inflight (the largest N_m "
                                              f"that fits is {fits}), or {error.hint}") from None
        raise error
    return HetPipePlan(policy=policy, staleness=staleness, minibatch=minibatch,
                       inflight=best[1], virtual_workers=vws, pipelines=best[2])


def _plan_vw(cluster: Cluster, vw: VirtualWorker, profile: ModelProfile, minibatch: int,
             state_factor: int, inflight: int, search: object, period_search: object,
             halved: str | None) -> PipelinePlan:
    devs: Sequence[Device] = vw.devices
    links = [cluster.bandwidth(a, b) for a, b in zip(devs, devs[1:])]
    return plan_pipeline(profile, [d.type for d in devs], links, minibatch=minibatch,
                         state_factor=state_factor, inflight=inflight,
                         search=search, period_search=period_search,  # type: ignore[arg-type]
                         halved=halved,
                         who=f"virtual worker {vw.index} ({', '.join(d.describe() for d in devs)})")
