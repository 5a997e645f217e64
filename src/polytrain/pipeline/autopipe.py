"""AutoPipe and AutoDP (PipeTransformer): the pipeline's cuts, length and width, as plain data.

After ``frozen`` front layers stop training they leave the pipeline's trained
part: they run forward-only, without autograd, on the first stage, which is
charged their forward cost; the trained layers are cut over the stages by
the exact min-max partitioner (:func:`partition.minmax_cut`) on their forward
+ backward cost. When the trained part fits on half the stages without a
stage slower than the slowest of the plan in force, the pipeline halves and
the replicas double (AutoDP: the devices it frees run more pipelines), as
long as the global batch still splits evenly. The micro-batch count is
re-chosen for the new length.

    K = 4, R = 1, nothing frozen          K = 2, R = 2, embed..h3 frozen (forward only)
    pipe 0: [embed h0] [h1 h2] [h3 h4] [h5 head]   pipe 0: [(embed..h3) h4] [h5 head]
                                                   pipe 1: [(embed..h3) h4] [h5 head]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Union

from ..emulation.profile import ModelProfile
from ..errors import ConfigError
from .partition import minmax_cut

__all__ = ["PipePlan", "plan_pipe", "fewest_stages", "choose_microbatches", "CacheShare"]

#: The share of the frozen front's samples AutoCache serves: a number, or a function of a
#: candidate plan's (frozen layers, stages, replicas), as a re-plan changes which stages
#: hold the caches.
CacheShare = Union[float, Callable[[int, int, int], float]]


@dataclass(frozen=True)
class PipePlan:
    """One freeze point's plan: what is frozen, the cuts, K stages x R replicas, micro-batches.

    ``bounds`` cut the trained layers: stage ``j`` trains layers ``bounds[j]:bounds[j+1]``
    (``bounds[0] == frozen``); stage 0 also runs layers ``0:frozen`` forward-only.
    ``stage_cost`` is each stage's FLOPs per sample (frozen layers at their forward cost).
    """

    step: int
    frozen: int
    frozen_layers: tuple[str, ...]
    bounds: tuple[int, ...]
    stages: int
    replicas: int
    micro_batches: int
    stage_cost: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_cost)

    def pipeline_of(self, worker: int) -> tuple[int, int] | None:
        """(replica, stage) of worker ``worker``: pipeline r holds workers r*K .. r*K+K-1
        (None: idle, a device freed without AutoDP)."""
        if worker >= self.stages * self.replicas:
            return None
        return worker // self.stages, worker % self.stages

    def workers_of_stage(self, stage: int) -> list[int]:
        """The worker indices that hold stage ``stage``, one per replica (its data-parallel
        group)."""
        return [r * self.stages + stage for r in range(self.replicas)]

    def record(self) -> dict[str, Any]:
        """The ``freeze_timeline`` entry of ``metrics.json``."""
        out = asdict(self)
        out["frozen_layers"] = list(self.frozen_layers)
        out["bounds"] = list(self.bounds)
        out["stage_cost"] = [round(c) for c in self.stage_cost]
        return out

    def describe(self, names: tuple[str, ...]) -> str:
        lines = [f"step {self.step}: {self.frozen} layers frozen, {self.stages} stages x "
                 f"{self.replicas} replicas, {self.micro_batches} micro-batches"]
        for j in range(self.stages):
            a, e = self.bounds[j], self.bounds[j + 1]
            span = names[a] if e - a == 1 else f"{names[a]}..{names[e - 1]}"
            front = f"({names[0]}..{names[self.bounds[0] - 1]} forward only) " \
                if j == 0 and self.bounds[0] else ""
            lines.append(f"  stage {j}: {front}{span}  {self.stage_cost[j] / 1e6:.2f} MFLOP/sample")
        return "\n".join(lines)


def choose_microbatches(stages: int, per_replica: int) -> int:
    """The smallest divisor of the replica's batch that is at least 2 x stages (1 for one
    stage: no bubble to fill); the whole batch if none is."""
    if stages == 1:
        return 1
    for m in range(2 * stages, per_replica + 1):
        if per_replica % m == 0:
            return m
    return per_replica


def _costs(profile: ModelProfile, frozen: int, bounds: tuple[int, ...],
           cached: float = 0.0) -> tuple[float, ...]:
    """FLOPs per sample of each stage: its trained layers forward + backward, its frozen ones
    (and, on stage 0, the frozen front, but the share ``cached`` serves) forward only."""
    layers = profile.layers

    def one(i: int) -> float:
        return layers[i].fwd_flops if i < frozen else layers[i].flops

    front = (1.0 - cached) * sum(one(i) for i in range(bounds[0]))
    return tuple(sum(one(i) for i in range(bounds[j], bounds[j + 1])) + (front if j == 0 else 0.0)
                 for j in range(len(bounds) - 1))


@dataclass(frozen=True)
class _Job:
    """What a cut is planned for: the model, what is frozen, the batch, the devices' memory."""

    profile: ModelProfile
    frozen: int
    global_batch: int
    memory: float
    state_factor: int
    cached: CacheShare
    micro_batches: int | None

    def share(self, stages: int, replicas: int) -> float:
        """The share of the frozen front AutoCache serves with this cut's layout."""
        if callable(self.cached):
            return self.cached(self.frozen, stages, replicas)
        return self.cached

    def microbatches(self, stages: int, replicas: int) -> int:
        per = self.global_batch // replicas
        m = self.micro_batches if self.micro_batches is not None else \
            choose_microbatches(stages, per)
        m = max(1, min(m, per))
        while per % m:
            m -= 1
        return m

    def stage_memory(self, j: int, a: int, e: int, stages: int, replicas: int) -> float:
        """Bytes on stage ``j`` training layers [a, e) (stage 0 also holds the frozen front):
        trained weights with their gradient and optimizer state, frozen weights alone, and
        the activations of the micro-batches 1F1B keeps in flight there."""
        layers = self.profile.layers
        trained = layers[max(a, self.frozen):e]
        frozen = list(layers[a:min(e, self.frozen)]) + (list(layers[:a]) if j == 0 else [])
        m = self.microbatches(stages, replicas)
        in_flight = min(stages - j, m) * (self.global_batch // replicas) / m
        return (sum(x.param_bytes for x in trained) * (2 + self.state_factor)
                + sum(x.param_bytes for x in frozen)
                + in_flight * sum(x.act_bytes for x in trained))

    def cut(self, stages: int, replicas: int) -> tuple[float, tuple[int, ...]] | None:
        """The trained layers cut over ``stages`` minimising the slowest stage (frozen front
        on stage 0, but the share cached) among cuts that fit memory; None if none does (or
        fewer trained layers than stages)."""
        layers = self.profile.layers
        f = self.frozen
        n = len(layers) - f
        front = (1.0 - self.share(stages, replicas)) * sum(x.fwd_flops for x in layers[:f])

        def cost(j: int, a: int, e: int) -> float | None:
            if self.stage_memory(j, a + f, e + f, stages, replicas) > self.memory:
                return None
            return sum(x.flops for x in layers[f + a:f + e]) + (front if j == 0 else 0.0)

        found = minmax_cut(n, stages, cost)
        if found is None:
            return None
        value, bounds = found
        return value, tuple(b + f for b in bounds)


def _halvable(k: int, r: int, *, autodp: bool, global_batch: int | None) -> bool:
    # K halves while it is even and, with AutoDP, the global batch splits over twice the
    # replicas (None: a batch not known yet, taken to split).
    return k > 1 and k % 2 == 0 and (not autodp or global_batch is None
                                     or global_batch % (2 * r) == 0)


def fewest_stages(stages: int, replicas: int, *, autodp: bool,
                  global_batch: int | None = None) -> int:
    """The fewest stages a pipeline of ``stages`` x ``replicas`` can halve to (AutoPipe keeps
    a trained layer on each): K halves while it is even and, with ``autodp``, while the
    ``global_batch`` splits over twice the replicas (None: not known yet, taken to split).

    >>> [fewest_stages(k, 1, autodp=True) for k in (1, 3, 4, 6, 8)]
    [1, 3, 1, 3, 1]
    >>> fewest_stages(4, 1, autodp=True, global_batch=6)
    2
    """
    k, r = stages, replicas
    while _halvable(k, r, autodp=autodp, global_batch=global_batch):
        k, r = k // 2, r * 2 if autodp else r
    return k


def plan_pipe(profile: ModelProfile, *, step: int, frozen: int, stages: int, replicas: int,
              global_batch: int, previous: PipePlan | None = None, autopipe: bool = True,
              autodp: bool = True, micro_batches: int | None = None,
              cached: CacheShare = 0.0, memory: float = math.inf,
              state_factor: int = 2) -> PipePlan:
    """The plan with ``frozen`` front layers, from ``stages`` x ``replicas`` (the plan in force).

    Without ``autopipe`` (freeze only) the cuts stay ``previous``'s: frozen layers keep
    their stage and skip only their backward and update. With it, the frozen front moves
    to stage 0 (forward only) and the trained layers are re-cut; the pipeline halves while
    the trained part fits on half the stages at a bottleneck no slower than ``previous``'s
    (or must: fewer trained layers than stages). With ``autodp`` the replicas double when
    it halves, if the global batch splits over twice as many (else it does not halve), and
    each replica's batch halves, so a half-length stage may cost up to twice per sample
    for the step to be no slower; without, the freed workers idle. ``cached`` is the share
    of the frozen front's samples AutoCache is expected to serve (``cache.expected_hits``),
    or a function of the candidate's frozen layers, stages and replicas giving it: the
    front costs its forward on the rest. Every stage must fit
    ``memory`` bytes (a device's; ``state_factor``: optimizer state per weight). A first
    plan (no ``previous``) keeps ``stages``. With ``autopipe``, fewer layers than
    ``frozen`` freeze where the trained ones could not fill the fewest stages the
    pipeline can halve to, or where stage 0 could not hold the frozen front in
    ``memory`` (the plan's ``frozen`` says how many did).

    Raises:
        ConfigError: every layer frozen, no cut of the first plan fits memory, or no cut
            of the trained layers fits memory even with no more frozen than before.
    """
    names = profile.names
    if frozen >= len(names):
        raise ConfigError(f"{frozen} of the model's {len(names)} layers cannot all freeze",
                          "the last layer always trains")
    k, r = stages, replicas

    def halvable(k: int, r: int) -> bool:
        return _halvable(k, r, autodp=autodp, global_batch=global_batch)

    if previous is not None and autopipe:
        # Every stage trains a layer at least: with fewer trained layers than the fewest
        # stages the pipeline can halve to (an odd K, or a batch that does not split over
        # twice the replicas), freeze fewer (never fewer than before).
        fewest = fewest_stages(k, r, autodp=autodp, global_batch=global_batch)
        frozen = max(previous.frozen, min(frozen, len(names) - fewest))
    job = _Job(profile, frozen, global_batch, memory, state_factor, cached, micro_batches)
    if previous is None:  # the first plan: the cut of the stages asked for
        bounds = _require(job.cut(k, r), k, memory)[1]
    elif not autopipe:  # freeze only: the cuts stay
        bounds = previous.bounds
    else:
        # Stage 0 holds the whole frozen front: where no cut fits memory at any K it can
        # halve to, freeze fewer (never fewer than before; those fitted).
        for f in range(frozen, previous.frozen - 1, -1):
            job = _Job(profile, f, global_batch, memory, state_factor, cached, micro_batches)
            kk, rr, best = k, r, job.cut(k, r)
            while best is None and halvable(kk, rr):  # too few trained layers, or memory
                kk, rr = kk // 2, rr * 2 if autodp else rr
                best = job.cut(kk, rr)
            if best is not None:
                frozen, k, r = f, kk, rr
                break
        if best is None:
            raise ConfigError(f"no cut of the {len(names) - previous.frozen} trained layers "
                              f"into {k} stages or fewer fits a device's "
                              f"{memory / 2**20:g} MiB", "use devices with more memory or "
                              "a smaller --batch-size")
        # The slowest stage's time per step: its cost per sample times the replica's batch.
        limit = previous.bottleneck / previous.replicas
        while halvable(k, r):
            half = job.cut(k // 2, r * 2 if autodp else r)
            if half is None or half[0] / (r * 2 if autodp else r) > limit * (1 + 1e-9):
                break
            k, r, best = k // 2, r * 2 if autodp else r, half
        bounds = best[1]
    m = job.microbatches(k, r)
    return PipePlan(step=step, frozen=frozen, frozen_layers=names[:frozen], bounds=bounds,
                    stages=k, replicas=r, micro_batches=m,
                    stage_cost=_costs(profile, frozen, bounds, job.share(k, r)))


def _require(found: tuple[float, tuple[int, ...]] | None, stages: int, memory: float
             ) -> tuple[float, tuple[int, ...]]:
    if found is None:
        raise ConfigError(f"no cut of the model into {stages} stages fits a device's "
                          f"{memory / 2**20:g} MiB (or it has fewer layers than stages)",
                          "use devices with more memory, more --pipeline-stages, a smaller "
                          "--batch-size, or a model with more layers")
    return found
