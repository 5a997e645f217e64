"""The partitioner: layers cut into contiguous stages over ordered devices, exactly (DP).

A stage's time is its layers' forward and backward on its device plus the
time to send what it sends: its output activation forward and its input
gradient backward, at the bandwidth of the link to the neighbour. A stage's
memory at ``N_m`` minibatches in flight is its weights (the live copy plus up
to ``N_m`` stashed versions), one gradient, the optimizer's state, and the
activations of ``N_m`` minibatches. For each ``N_m`` the plan minimises the
period ``max(slowest stage, round trip / N_m)`` over all cuts that fit: from
``N_m`` = the stage count on that is the slowest stage (:func:`minmax_cut`),
below it the round trip may bind (:func:`period_cut`; at ``N_m = 1`` a
minibatch takes the whole round trip). ``N_m`` is the smallest that reaches
the best period.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from ..emulation.devices import DeviceType
from ..emulation.profile import ModelProfile
from ..errors import ConfigError

__all__ = ["PipelinePlan", "plan_pipeline", "plan_pipeline_brute", "minmax_cut",
           "minmax_cut_brute", "period_cut", "period_cut_brute", "StageCosts"]

_MIB = 1 << 20

# stage j holds layers [a, e): cost, or None where it does not fit
Cost = Callable[[int, int, int], "float | None"]
# (n, k, cost, N_m) -> (period, bounds) of the cut of the least period, or None
PeriodSearch = Callable[[int, int, Cost, int], "tuple[float, tuple[int, ...]] | None"]
# runs j..k-1 of a cut over items [a, n): (largest cost, sum of costs, bounds a..n)
_Suffix = tuple[float, float, tuple[int, ...]]


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds, on which device type, and what that costs.

    ``bounds[j]:bounds[j+1]`` are stage ``j``'s layers. Times are seconds per
    minibatch (forward + backward + sends); memory is bytes at ``inflight``.
    """

    devices: tuple[str, ...]          # device type per stage
    layers: tuple[str, ...]           # all layer names
    bounds: tuple[int, ...]
    minibatch: int
    inflight: int
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    memory_limits: tuple[float, ...]

    @property
    def stages(self) -> int:
        return len(self.devices)

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    @property
    def round_trip(self) -> float:
        return sum(self.stage_times)

    @property
    def period(self) -> float:
        """Seconds per minibatch in steady state: the slowest stage, or the round trip / N_m."""
        return max(self.bottleneck, self.round_trip / self.inflight)

    def stage_layers(self, j: int) -> tuple[str, ...]:
        return self.layers[self.bounds[j]:self.bounds[j + 1]]

    def span(self, j: int) -> str:
        """Stage ``j``'s layers as printed: ``first..last``, or the one."""
        names = self.stage_layers(j)
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"

    def describe(self) -> str:
        """One line per stage: device, layers, time per minibatch, memory against its limit."""
        lines = []
        for j, dev in enumerate(self.devices):
            span = self.span(j)
            limit = self.memory_limits[j] / _MIB
            # Without --devices the nominal devices' memory is unlimited (2^30 MiB, halved by bd).
            memory = f"{self.stage_memory[j] / _MIB:8.1f} MiB" + \
                ("" if limit >= 1 << 29 else f" / {limit:.0f} MiB")
            lines.append(f"  stage {j} on {dev:<8} layers {span:<12} "
                         f"{self.stage_times[j] * 1e3:8.1f} ms  {memory}")
        lines.append(f"  N_m = {self.inflight} in flight, minibatch {self.minibatch}: "
                     f"{self.period * 1e3:.1f} ms per minibatch (slowest stage "
                     f"{self.bottleneck * 1e3:.1f} ms, round trip {self.round_trip * 1e3:.1f} ms)")
        return "\n".join(lines)


def minmax_cut(n: int, k: int, cost: Cost) -> tuple[float, tuple[int, ...]] | None:
    """Cut ``n`` items into ``k`` non-empty contiguous runs minimising the largest ``cost``.

    Exact dynamic programming over suffixes, O(k n^2) cost calls. Among equally
    good cuts it returns the lexicographically smallest bounds. None if no cut
    has every run feasible.
    """
    if k < 1 or n < k:
        return None
    inf = math.inf
    # best[j][a]: the smallest largest cost of runs j..k-1 over items [a, n)
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[k][n] = -inf
    for j in range(k - 1, -1, -1):
        for a in range(j, n - (k - 1 - j)):
            for e in range(a + 1, n - (k - 1 - j) + 1):
                if best[j + 1][e] == inf:
                    continue
                c = cost(j, a, e)
                if c is not None:
                    best[j][a] = min(best[j][a], max(c, best[j + 1][e]))
    if best[0][0] == inf:
        return None
    # The smallest next bound from which the rest can still stay within the optimum.
    value = best[0][0]
    bounds, a = [0], 0
    for j in range(k):
        for e in range(a + 1, n - (k - 1 - j) + 1):
            if best[j + 1][e] > value:
                continue
            c = cost(j, a, e)
            if c is not None and c <= value:
                bounds.append(e)
                a = e
                break
    return value, tuple(bounds)


def _every_cut(n: int, k: int, cost: Cost) -> Iterator[tuple[tuple[int, ...], list[float]]]:
    """Every cut of ``n`` layers into ``k`` stages that ``cost`` takes (no stage None), in
    lexicographic order, with its stages' times: the brute-force twins' search."""
    if k < 1 or n < k:
        return
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        costs = [cost(j, bounds[j], bounds[j + 1]) for j in range(k)]
        times = [c for c in costs if c is not None]
        if len(times) == k:
            yield bounds, times


def minmax_cut_brute(n: int, k: int, cost: Cost) -> tuple[float, tuple[int, ...]] | None:
    """:func:`minmax_cut` by trying every cut in lexicographic order (tests only)."""
    found: tuple[float, tuple[int, ...]] | None = None
    for bounds, times in _every_cut(n, k, cost):
        value = max(times)
        if found is None or value < found[0]:
            found = (value, bounds)
    return found


def period_cut(n: int, k: int, cost: Cost, inflight: int) -> tuple[float, tuple[int, ...]] | None:
    """Cut ``n`` items into ``k`` runs minimising ``max(largest cost, sum of costs / inflight)``.

    The period of a pipeline with ``inflight`` minibatches in flight: below ``k``
    the round trip may bind, and a cut with a higher slowest stage but a lower
    sum can be faster. Exact dynamic programming over suffixes keeping, per
    suffix, the Pareto front of (largest cost, sum) pairs: the period grows with
    both, so a dominated suffix never completes a better cut. Among equally good
    cuts it returns one of the least largest cost, then of the least sum. None if
    no cut has every run feasible.
    """
    if k < 1 or n < k:
        return None
    # front[j][a]: the suffixes of runs j..k-1 over items [a, n) that no other one
    # dominates (of equal pairs, the first bounds).
    front: list[dict[int, list[_Suffix]]] = [{} for _ in range(k + 1)]
    front[k][n] = [(-math.inf, 0.0, (n,))]
    for j in range(k - 1, -1, -1):
        for a in (range(j, n - (k - 1 - j)) if j else (0,)):
            found: list[_Suffix] = []
            for e in range(a + 1, n - (k - 1 - j) + 1):
                rest = front[j + 1].get(e)
                if not rest:
                    continue
                c = cost(j, a, e)
                if c is not None:
                    found.extend((max(c, m), c + s, (a, *bounds)) for m, s, bounds in rest)
            found.sort()
            kept: list[_Suffix] = []
            for m, s, bounds in found:
                if not kept or s < kept[-1][1]:
                    kept.append((m, s, bounds))
            front[j][a] = kept
    if not front[0].get(0):
        return None
    m, s, bounds = min(front[0][0], key=lambda x: (max(x[0], x[1] / inflight), x[0], x[1], x[2]))
    return max(m, s / inflight), bounds


def period_cut_brute(n: int, k: int, cost: Cost,
                     inflight: int) -> tuple[float, tuple[int, ...]] | None:
    """:func:`period_cut` by trying every cut in lexicographic order (tests only)."""
    found: tuple[tuple[float, float, float], tuple[int, ...]] | None = None
    for bounds, times in _every_cut(n, k, cost):
        top = max(times)
        period = max(top, sum(times) / inflight)
        key = (period, top, sum(times))
        if found is None or key < found[0]:
            found = (key, bounds)
    return None if found is None else (found[0][0], found[1])


class StageCosts:
    """Time and memory of any stage [a, e) on device j of a virtual worker (the cost model)."""

    def __init__(self, profile: ModelProfile, devices: Sequence[DeviceType],
                 links: Sequence[float], *, minibatch: int, state_factor: int) -> None:
        if len(links) != max(0, len(devices) - 1):
            raise ValueError(f"{len(devices)} devices need {len(devices) - 1} links")
        self.profile = profile
        self.devices = list(devices)
        self.links = list(links)  # bytes/s between device j and j+1
        self.minibatch = minibatch
        self.state_factor = state_factor

    def time(self, j: int, a: int, e: int) -> float:
        layers = self.profile.layers
        b = self.minibatch
        t = b * sum(x.flops for x in layers[a:e]) / self.devices[j].flops_per_s
        if j + 1 < len(self.devices):
            t += b * layers[e - 1].out_bytes / self.links[j]
        if j > 0:
            t += b * layers[a - 1].out_bytes / self.links[j - 1]
        return t

    def memory(self, j: int, a: int, e: int, inflight: int) -> float:
        layers = self.profile.layers[a:e]
        params = sum(x.param_bytes for x in layers)
        acts = sum(x.act_bytes for x in layers)
        return params * (inflight + 2 + self.state_factor) + inflight * self.minibatch * acts

    def fits(self, j: int, a: int, e: int, inflight: int) -> bool:
        return self.memory(j, a, e, inflight) <= self.devices[j].memory_bytes


def plan_pipeline(profile: ModelProfile, devices: Sequence[DeviceType], links: Sequence[float],
                  *, minibatch: int, state_factor: int, inflight: int | None = None,
                  max_inflight: int | None = None,
                  search: Callable[[int, int, Cost], tuple[float, tuple[int, ...]] | None]
                  = minmax_cut, period_search: PeriodSearch | None = period_cut,
                  who: str = "the virtual worker",
                  halved: str | None = None) -> PipelinePlan:
    """The best contiguous cut of ``profile``'s layers over ``devices``, and ``N_m``.

    Args:
        devices: the virtual worker's device types, in pipeline order.
        links: bandwidth (bytes/s) between consecutive devices.
        minibatch: samples per minibatch. state_factor: optimizer state per weight.
        inflight: N_m, or None to choose it (1 .. ``max_inflight``, default the stage count).
        search: the exact cut search (the brute-force twin in tests).
        period_search: the exact search of the least period, for ``N_m`` below the stage
            count (the brute-force twin in tests); None: the cut of the least slowest stage
            whatever ``N_m`` (policy bd, whose twin's stages fill the round trip).
        halved: why each of ``devices`` is given with half of its memory (policy bd's
            "runs two stages per device"): the refusal names the whole and says why.

    Raises:
        ConfigError: no cut fits memory (the message names the tightest stage), or
            there are more devices than layers.
    """
    n, k = len(profile.layers), len(devices)
    if k > n:
        raise ConfigError(f"{who} has {k} devices but the model has only {n} layers: every "
                          f"stage needs at least one", "use fewer devices per virtual worker "
                          "(another --policy) or a model with more layers")
    costs = StageCosts(profile, devices, links, minibatch=minibatch, state_factor=state_factor)
    candidates = [inflight] if inflight is not None else list(range(1, (max_inflight or k) + 1))
    best: PipelinePlan | None = None

    def plan_of(bounds: tuple[int, ...], nm: int) -> PipelinePlan:
        return PipelinePlan(
            devices=tuple(d.name for d in devices), layers=profile.names, bounds=bounds,
            minibatch=minibatch, inflight=nm,
            stage_times=tuple(costs.time(j, bounds[j], bounds[j + 1]) for j in range(k)),
            stage_memory=tuple(costs.memory(j, bounds[j], bounds[j + 1], nm) for j in range(k)),
            memory_limits=tuple(float(d.memory_bytes) for d in devices))

    for nm in candidates:
        @functools.cache  # both searches ask for the same stages
        def cost(j: int, a: int, e: int, nm: int = nm) -> float | None:
            return costs.time(j, a, e) if costs.fits(j, a, e, nm) else None

        found = search(n, k, cost)
        if found is None:
            continue
        plan = plan_of(found[1], nm)
        if nm < k and period_search is not None and plan.period > plan.bottleneck:
            # Below k in flight the round trip / N_m may exceed the slowest stage: the cut
            # of the least slowest stage is kept unless another's period is less, by more
            # than rounding (on even devices many cuts have the same sum, in other orders).
            least = period_search(n, k, cost, nm)
            assert least is not None  # the cut above fits
            other = plan_of(least[1], nm)
            if other.period < plan.period * (1 - 1e-9):
                plan = other
        if best is None or plan.period < best.period:
            best = plan
    if best is None:
        raise _refusal(costs, n, k, candidates[0], search, who, halved)
    return best


def plan_pipeline_brute(profile: ModelProfile, devices: Sequence[DeviceType],
                        links: Sequence[float], **kwargs: object) -> PipelinePlan:
    """:func:`plan_pipeline` with the brute-force searches (tests only)."""
    return plan_pipeline(profile, devices, links, search=minmax_cut_brute,
                         period_search=period_cut_brute, **kwargs)  # type: ignore[arg-type]


def _refusal(costs: StageCosts, n: int, k: int, inflight: int,
             search: Callable[[int, int, Cost], tuple[float, tuple[int, ...]] | None],
             who: str, halved: str | None) -> ConfigError:
    """Why nothing fits: the cut that needs the least memory relative to the devices."""
    def ratio(j: int, a: int, e: int) -> float:
        return costs.memory(j, a, e, inflight) / costs.devices[j].memory_bytes

    found = search(n, k, ratio)
    assert found is not None
    bounds = found[1]
    j = max(range(k), key=lambda j: ratio(j, bounds[j], bounds[j + 1]))
    names = costs.profile.names[bounds[j]:bounds[j + 1]]
    dev = costs.devices[j]
    need = costs.memory(j, bounds[j], bounds[j + 1], inflight)
    memory = (f"{dev.memory_mb:g} MiB" if halved is None
              else f"half of its {2 * dev.memory_mb:g} MiB ({halved})")
    return ConfigError(
        f"the model does not fit {who}'s memory: with N_m = {inflight} in flight and minibatch "
        f"{costs.minibatch}, the cut that needs the least memory still needs "
        f"{need / _MIB:.1f} MiB on stage {j} (layers {', '.join(names)}) of device type "
        f"{dev.name} with {memory}",
        "use devices with more memory, more devices per virtual worker, a smaller "
        "--batch-size, or SGD instead of Adam")
