"""The calls BytePS users know: push_pull, broadcasts, and the DistributedOptimizer wrapper."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from ... import runtime
from ...comm.partition import DEFAULT_PARTITION_BYTES, TensorSpec
from ...errors import ConfigError
from ...ps.engine import Engine, SumTensor, engine_for
from ...runtime import Context
from .async_mode import AsyncOptimizer
from .optimizer import DistributedOptimizer as _SyncOptimizer
from .options import BytePSOptions
from .plan import plan_for

__all__ = ["push_pull", "push_pull_async", "synchronize", "PushPullHandle",
           "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
           "size", "rank", "local_rank", "local_size"]

_names: weakref.WeakKeyDictionary[Context, dict[str, SumTensor]] = weakref.WeakKeyDictionary()
_unnamed: weakref.WeakKeyDictionary[Context, itertools.count[int]] = weakref.WeakKeyDictionary()


def _worker_ctx(ctx: Context | None) -> Context:
    ctx = ctx or runtime.current()
    if not ctx.is_worker:
        raise ConfigError(f"rank {ctx.rank} is a server; BytePS calls run on workers",
                          "call them from worker code only (servers serve inside init())")
    return ctx


def size(ctx: Context | None = None) -> int:
    """Number of workers."""
    return _worker_ctx(ctx).num_workers


def rank(ctx: Context | None = None) -> int:
    """This worker's index among all workers."""
    return _worker_ctx(ctx).worker_index


def local_rank(ctx: Context | None = None) -> int:
    """This worker's index among its machine's workers."""
    return _worker_ctx(ctx).local_index


def local_size(ctx: Context | None = None) -> int:
    """Workers on this worker's machine."""
    return len(_worker_ctx(ctx).local_workers)


@dataclass
class PushPullHandle:
    """A push_pull in flight; :func:`synchronize` finishes it."""

    engine: Engine
    tensor: SumTensor
    like: torch.Tensor
    average: bool


def push_pull_async(tensor: torch.Tensor, name: str | None = None, average: bool = True, *,
                    ctx: Context | None = None) -> PushPullHandle:
    """Start summing (or averaging) ``tensor`` over every worker; see :func:`push_pull`."""
    ctx = _worker_ctx(ctx)
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ConfigError(f"push_pull(average=True) of a {tensor.dtype} tensor would round",
                          "pass average=False for integer tensors, or a float tensor")
    if name is None:
        name = f"push_pull.{next(_unnamed.setdefault(ctx, itertools.count()))}"
    engine = engine_for(ctx)
    declared = _names.setdefault(ctx, {})
    spec = TensorSpec(name, tuple(tensor.shape), tensor.dtype)
    t = declared.get(name)
    if t is None:
        plan = plan_for(ctx.topology, [spec], partition_bytes=DEFAULT_PARTITION_BYTES)
        [t] = engine.sums([spec], plan.placement)
        declared[name] = t
    elif t.spec != spec:
        raise ConfigError(f"push_pull name {name!r} was first used for {list(t.spec.shape)} "
                          f"{t.spec.dtype}, now for {list(spec.shape)} {spec.dtype}",
                          "give every distinct tensor its own name")
    engine.submit(t, tensor)
    return PushPullHandle(engine, t, tensor, average)


def synchronize(handle: PushPullHandle) -> torch.Tensor:
    """Wait for a :func:`push_pull_async` and return the result (shaped like its input)."""
    total = handle.engine.wait(handle.tensor).view(handle.like.shape)
    out = total.to(handle.like.device, copy=True)
    if handle.average:
        out.div_(handle.engine.ctx.num_workers)
    return out


def push_pull(tensor: torch.Tensor, name: str | None = None, average: bool = True, *,
              ctx: Context | None = None) -> torch.Tensor:
    """The sum (or average) of ``tensor`` over every worker, through the summation service.

    Every worker calls it with the same names in the same order (the servers
    check: a name declared with another shape is an error naming it). The
    result is a new tensor on ``tensor``'s device; ``tensor`` is unchanged.

    Example::

        mean_loss = polytrain.byteps.push_pull(loss.detach(), name="loss")
    """
    return synchronize(push_pull_async(tensor, name, average, ctx=ctx))


@torch.no_grad()
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0, *, ctx: Context | None = None) -> None:
    """Copy worker ``root_rank``'s tensors into every worker's (a state_dict or named pairs)."""
    ctx = _worker_ctx(ctx)
    if not 0 <= root_rank < ctx.num_workers:
        raise ConfigError(f"root_rank {root_rank} is not a worker (there are "
                          f"{ctx.num_workers})", f"pass 0 .. {ctx.num_workers - 1}")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    src = ctx.topology.workers[root_rank]
    for _, t in items:
        buf = t.detach()
        if buf.device.type != "cpu" and ctx.backend == "gloo":
            cpu = buf.cpu()
            dist.broadcast(cpu, src=src, group=ctx.groups.workers)
            buf.copy_(cpu)
        else:
            dist.broadcast(buf, src=src, group=ctx.groups.workers)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, *,
                              ctx: Context | None = None) -> None:
    """Give every worker worker ``root_rank``'s optimizer state (moments, steps, lr)."""
    ctx = _worker_ctx(ctx)
    if not 0 <= root_rank < ctx.num_workers:
        raise ConfigError(f"root_rank {root_rank} is not a worker (there are "
                          f"{ctx.num_workers})", f"pass 0 .. {ctx.num_workers - 1}")
    box = [_to_cpu(optimizer.state_dict()) if ctx.worker_index == root_rank else None]
    dist.broadcast_object_list(box, src=ctx.topology.workers[root_rank],
                               group=ctx.groups.workers)
    state: Any = box[0]
    optimizer.load_state_dict(state)  # moves state to each parameter's device


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - BytePS's name
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         backward_passes_per_step: int = 1, *, ctx: Context | None = None,
                         **options: Any) -> torch.optim.Optimizer:
    """Wrap any torch optimizer so that ``step()`` uses the gradients summed over every worker.

    Gradients are pushed from hooks as soon as backward produces them (after
    ``backward_passes_per_step`` passes: gradient accumulation); ``step()``
    waits for the sums, averages them over workers and runs ``optimizer``.
    Works with CUDA parameters (the servers stay on CPU). ``options`` are the
    strategy's (:class:`BytePSOptions`: ``partition_bytes``, ``fuse_bytes``,
    ``colocate``, ``credit_bytes``, ``async_``, ``staleness``). Launch with colocated servers
    (``polytrain launch --colocated 1``) and/or ``--servers K``.

    Example::

        opt = polytrain.byteps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(), backward_passes_per_step=2)
    """
    ctx = _worker_ctx(ctx)
    opts = BytePSOptions(**options)
    engine = engine_for(ctx, credit_bytes=opts.credit_bytes)
    placing: dict[str, Any] = {"partition_bytes": opts.partition_bytes,
                               "colocate": opts.colocate}
    if opts.async_:
        if backward_passes_per_step != 1:
            raise ConfigError("asynchronous BytePS pushes each step's update; "
                              "backward_passes_per_step does not apply",
                              "leave backward_passes_per_step at 1 with async_=True")
        return AsyncOptimizer(optimizer, engine=engine, named_parameters=named_parameters,
                              staleness=opts.staleness, **placing)
    return _SyncOptimizer(optimizer, engine=engine, named_parameters=named_parameters,
                          backward_passes_per_step=backward_passes_per_step,
                          fuse_bytes=opts.fuse_bytes, **placing)
