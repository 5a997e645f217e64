"""``moe``: expert parallelism (FastMoE) with data parallelism for everything else."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.bucket import flatten, plan_buckets, unflatten_into
from ..comm.partition import TensorSpec
from ..errors import ConfigError, at_least, divisors
from ..launch.layout import Layout
from ..moe.checkpoint import canonical_names, full_state_dict, local_state_dict, moe_layers
from ..ps.grads import travels_divided
from ..wrapper import Wrapper, unwrap
from .base import Strategy, register
from .synced import check_still_frozen

__all__ = ["ExpertParallel", "MoEOptions", "ExpertPlacement", "place_experts"]

log = logging.getLogger(__name__)

_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """Options of ``--strategy moe``."""

    expert_parallel: int | None = field(default=None, metadata={
        "help": "workers each MoE layer's experts are split over (default: all workers); "
                "workers / P such groups hold replicas of the experts", "metavar": "P"})

    def __post_init__(self) -> None:
        if self.expert_parallel is not None:  # (2.0 met a TypeError inside; True was 1)
            at_least("--expert-parallel", self.expert_parallel, "pass --expert-parallel 2",
                     whole=True)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which workers split the experts, and which hold the same ones (plain data).

    ``expert_groups[g]``: the ranks of expert-parallel group g (consecutive workers,
    so a group stays on as few machines as it can); ``replica_groups[j]``: the
    ranks holding the j-th slice of the experts, one from each expert group.

    >>> place_experts((0, 1, 2, 3), 2)
    ExpertPlacement(expert_groups=((0, 1), (2, 3)), replica_groups=((0, 2), (1, 3)))
    """

    expert_groups: tuple[tuple[int, ...], ...]
    replica_groups: tuple[tuple[int, ...], ...]

    def of(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(expert group, replica group) of ``rank``."""
        eg = next(g for g in self.expert_groups if rank in g)
        rg = next(g for g in self.replica_groups if rank in g)
        return eg, rg


def place_experts(workers: Sequence[int], expert_parallel: int) -> ExpertPlacement:
    """Split ``workers`` into groups of ``expert_parallel`` consecutive ranks."""
    w, p = len(workers), expert_parallel
    if w % p:
        raise ConfigError(f"--expert-parallel {p} does not divide --workers {w}",
                          f"pass --expert-parallel one of {divisors(w)}")
    groups = tuple(tuple(workers[g * p:(g + 1) * p]) for g in range(w // p))
    replicas = tuple(tuple(workers[j::p]) for j in range(p))
    return ExpertPlacement(groups, replicas)


class _SyncAfterBackward(Wrapper):
    """The model, plus one gradient synchronisation at the end of every backward pass.

    Every trainable parameter has a hook on the gradient coming into it. The first hook
    of a backward queues :meth:`ExpertParallel.sync_gradients` for when the backward ends
    (every gradient in place, the auxiliary losses' too), whatever the model returns and
    however forwards and backwards interleave. Each hook also sets aside the gradient its
    parameter holds from an earlier backward (already synchronised), so a backward
    reduces only its own gradients, which are then added to it: accumulation over
    several backwards sums their averages, as one process sums (before, expert
    gradients were divided by W again at every backward).
    """

    def __init__(self, module: nn.Module, strategy: ExpertParallel) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_strategy", strategy)
        self._handles = [q.register_hook(functools.partial(strategy.arrived, q))
                         for q in module.parameters() if q.requires_grad]
        #: Parameters frozen at the wrap: no hook, so no sum (:func:`check_still_frozen`).
        self._frozen = [(n, q) for n, q in module.named_parameters() if not q.requires_grad]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_still_frozen(self._frozen, "set requires_grad before distribute() (a model "
                                         "is given to it once: its experts are sharded)")
        self.__dict__["_strategy"].abandon()
        return self.module(*args, **kwargs)


@register
class ExpertParallel(Strategy[MoEOptions]):
    """Experts split over groups of workers; every other parameter data-parallel.

    FastMoE (He et al., arXiv 2103.13262). Each worker is a data-parallel
    replica (its slice of the global batch). Each MoE layer's experts are
    split over ``--expert-parallel`` consecutive workers; tokens reach their
    expert through all-to-all. Gradients, synchronised when backward ends:

    - non-expert parameters: averaged over all W workers;
    - expert parameters: each already sums the gradients of every token of its
      expert group (they came through the all-to-all); they are summed over the
      replicas of the same experts (none when P = W) and divided by W, as the
      mean over W replicas' losses asks.

    The gates route over the global batch of all W workers, as under every
    data-parallel strategy (random numbers by global token, capacity and
    balance statistics over every worker's tokens; see ``moe/gates.py``),
    so a run ends where ``--strategy single`` with the same model ends, with
    every gate.
    """

    name = "moe"
    whole_model = False  # experts are sharded over the workers
    Options = MoEOptions
    # Experts are named canonically in checkpoints: any expert-parallel size loads them.
    resumes_on_other_layouts = True

    @classmethod
    def check_layout(cls, layout: Layout, options: MoEOptions) -> None:
        super().check_layout(layout, options)
        place_experts(range(layout.workers), options.expert_parallel or layout.workers)

    @classmethod
    def check_model(cls, model: nn.Module, layout: Layout, options: MoEOptions) -> None:
        layers = moe_layers(model)
        if not layers:
            raise ConfigError(f"strategy 'moe' needs a model with MoE layers ("
                              f"{type(model).__name__} has none)",
                              "pass --model gpt-moe, or moefy() the model")
        p = options.expert_parallel or layout.workers
        for prefix, layer in layers:
            if layer.num_experts % p:
                raise ConfigError(
                    f"MoE layer {prefix.rstrip('.')!r} has {layer.num_experts} experts, which "
                    f"do not split evenly over an expert-parallel group of {p} workers",
                    f"pass --experts a multiple of {p}, or --expert-parallel one of "
                    f"{divisors(layout.workers, layer.num_experts)}")

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        if optimizer.state:
            raise ConfigError("the optimizer has stepped already; strategy 'moe' shards the "
                              "experts and cannot shard optimizer state",
                              "call distribute() before the first optimizer step")
        workers = ctx.topology.workers
        p = self.options.expert_parallel or len(workers)
        self.placement = place_experts(workers, p)
        mine, replicas = self.placement.of(ctx.rank)
        cuda = ctx.device.type == "cuda"
        # Groups among some workers: created by their members only.
        expert_group = (ctx.groups.workers if len(mine) == len(workers)
                        else ctx.new_group(mine, cuda=cuda) if len(mine) > 1 else None)
        self.replica_group = (ctx.groups.workers if len(replicas) == len(workers)
                              else ctx.new_group(replicas, cuda=cuda) if len(replicas) > 1
                              else None)
        self.replica_ranks = replicas
        kept: list[nn.Parameter] = []
        # Each layer once: a shared one is listed under each of its names.
        for layer in {id(layer): layer for _, layer in moe_layers(model)}.values():
            layer.shard_experts(expert_group)  # distribute() gives the gates the batch group
            kept += list(layer.experts.parameters())
        # After the cut: a GPU holds its experts only, never every expert at once.
        model.to(ctx.device)
        alive = {id(q) for q in model.parameters()}
        for group in optimizer.param_groups:  # listed experts of other ranks are gone
            group["params"] = [q for q in group["params"] if id(q) in alive]
        expert_ids = {id(q) for q in kept}
        self.expert_params = [q for q in model.parameters() if id(q) in expert_ids]
        self.dense_params = [q for q in model.parameters() if id(q) not in expert_ids]
        self._queued = False  # the synchronisation is queued for this backward's end
        self._held: dict[int, torch.Tensor | None] = {}  # id -> earlier backwards' gradient
        return _SyncAfterBackward(model, self), optimizer

    def arrived(self, q: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """``q``'s hook: a backward's gradient comes in (see :class:`_SyncAfterBackward`)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.sync_gradients)
        if id(q) not in self._held:
            self._held[id(q)] = q.grad
            q.grad = None
        return grad

    def abandon(self) -> None:
        """Before a forward: forget a backward that raised before its end (its
        synchronisation never ran), so the next one synchronises; the gradients it set
        aside are dropped (the usual next step, zero_grad(), would drop them too)."""
        if self._queued:
            log.warning("a backward pass raised before its end: its gradients were not "
                        "synchronised, and those accumulated before it are dropped")
            self._held, self._queued = {}, False

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """This backward's gradients: dense ones averaged over all workers, expert ones over
        their replicas; then added to what each parameter held before it."""
        ctx = self.ctx
        assert ctx is not None
        held, self._held, self._queued = self._held, {}, False
        for q in self.dense_params + self.expert_params:  # no gradient came: only the held
            if id(q) not in held:
                held[id(q)] = q.grad
                q.grad = None
        w = ctx.num_workers
        self._reduce(self.dense_params, ctx.groups.workers if w > 1 else None,
                     ctx.topology.workers, w)
        self._reduce(self.expert_params, self.replica_group, self.replica_ranks, w)
        for q in self.dense_params + self.expert_params:
            before = held[id(q)]
            if before is not None:
                q.grad = before if q.grad is None else before.add_(q.grad)

    def _reduce(self, params: list[nn.Parameter], group: Any, ranks: Sequence[int],
                divisor: int) -> None:
        trainable = [q for q in params if q.requires_grad]
        if not trainable:
            return
        if group is None:
            for q in trainable:
                if q.grad is not None:
                    q.grad.div_(divisor)
            return
        assert self.ctx is not None
        # A parameter may have no gradient on some ranks (unused there): count who has one.
        present = torch.tensor([float(q.grad is not None) for q in trainable],
                               device=trainable[0].device)
        dist.all_reduce(present, group=group)
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in trainable]
        specs = [TensorSpec.of(str(i), g) for i, g in enumerate(grads)]
        for bucket in plan_buckets(specs, _BUCKET_BYTES):
            flat = flatten(bucket, grads)
            first = travels_divided(flat.dtype)  # a 16-bit sum could overflow: divide first
            if first:
                flat.div_(divisor)
            dist.all_reduce(flat, group=group)
            if not first:
                flat.div_(divisor)
            unflatten_into(bucket, flat, grads)
            self.ctx.meter.record_ring_allreduce(list(ranks), bucket.nbytes)
        for q, g, n in zip(trainable, grads, present.tolist()):
            if n and q.grad is None:
                q.grad = g

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(unwrap(model))

    def parameter_names(self, model: nn.Module) -> dict[str, nn.Parameter]:
        inner = unwrap(model)
        names = canonical_names(inner)
        return {names[k]: p for k, p in inner.named_parameters()}

    def load_model_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        inner = unwrap(model)
        inner.load_state_dict(local_state_dict(dict(state), inner))
