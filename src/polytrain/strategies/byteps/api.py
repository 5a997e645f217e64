"""The calls BytePS users know: init, push_pull, broadcasts, DistributedOptimizer, Compression.

``import polytrain.byteps as bps`` stands where ``import byteps.torch as bps`` stood;
docs/from-byteps.md maps every call and environment variable.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from ... import _env, runtime
from ...comm.partition import DEFAULT_PARTITION_BYTES, TensorSpec
from ...errors import ConfigError, left_run
from ...kinds import check_kinds
from ...ps.compression import (
    FP16,
    CompressOptions,
    Compressor,
    Dithering,
    OneBit,
    RandomK,
    TopK,
    compressor,
)
from ...ps.engine import Engine, SumTensor, engine_for
from ...ps.grads import travels_divided
from ...runtime import Context
from ..checks import check_same_tensors, check_same_values, tensor_signature
from .async_mode import AsyncOptimizer, check_async_passes
from .optimizer import Choice, _resolve, checked_options, named_params_of, same_options
from .optimizer import DistributedOptimizer as _SyncOptimizer
from .plan import plan_for

log = logging.getLogger(__name__)

__all__ = ["init", "shutdown", "push_pull", "push_pull_async", "push_pull_inplace",
           "push_pull_async_inplace", "poll", "synchronize", "declare", "PushPullHandle",
           "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
           "Compression", "size", "rank", "local_rank", "local_size"]

#: The unnamed push_pull call that warns that each keeps keys of its own (the 100th).
UNNAMED_WARN = 100
# By engine: one that a closed byteps strategy closed is replaced, and its tensors with it
# (a name declared on the old one was queued on the new one, never started: a timeout).
_names: weakref.WeakKeyDictionary[Engine, dict[str, tuple[SumTensor, str]]] = (
    weakref.WeakKeyDictionary())
_unnamed: weakref.WeakKeyDictionary[Context, itertools.count[int]] = weakref.WeakKeyDictionary()
_declared: weakref.WeakKeyDictionary[Context, list[str]] = weakref.WeakKeyDictionary()
_joined: list[Context] = []  # the run bps.init() joined, while it lasts


class Compression:
    """BytePS's ``Compression`` namespace, with the compressors of the summation service.

    ``none`` and ``fp16`` as in ``byteps.torch``; ``onebit`` (signs times the mean |x|
    of each block of 128), ``topk(K)``, ``randomk(K)`` (K a count or a fraction of each tensor),
    ``dithering(S, natural=False)``, or any ``named("topk:0.01")``. Pass one as
    ``DistributedOptimizer(..., compression=...)``, or a dict of them by parameter name.
    """

    none: Compressor | None = None
    fp16: Compressor = FP16()
    onebit: Compressor = OneBit()

    @staticmethod
    def topk(k: float) -> Compressor:
        """The K largest magnitudes (K a count, or a fraction of each tensor)."""
        return _checked(TopK(k=k))

    @staticmethod
    def randomk(k: float) -> Compressor:
        """K elements drawn at random (seeded by the key, the same on every machine)."""
        return _checked(RandomK(k=k))

    @staticmethod
    def dithering(levels: int, natural: bool = False) -> Compressor:
        """Stochastic quantization to ``levels`` levels, linear or natural (powers of 2)."""
        return _checked(Dithering(levels=levels, natural=natural))

    @staticmethod
    def named(text: str) -> Compressor | None:
        """A compressor from its name as ``--compress`` takes it (``"none"``: None)."""
        return compressor(text)


def _checked(c: Compressor) -> Compressor:
    compressor(c.spec())  # the name's rules (topk:0, dithering:1, ...) hold for objects too
    return c


def init(*, device: str | torch.device | None = None,
         timeout_s: float | None = None) -> Context:
    """Join the run (:func:`polytrain.init`): servers serve inside this call until the
    workers finish, as BytePS scripts expect. Called once per process."""
    if _joined and runtime.is_initialized() and runtime.current() is _joined[0]:
        raise ConfigError("bps.init() was called twice in this process",
                          "call bps.init() once, at the start of the script")
    ctx = runtime.init(device=device, timeout_s=timeout_s)
    _joined[:] = [ctx]
    return ctx


def shutdown() -> None:
    """Leave the run (the context's shutdown: the servers are told, the groups closed)."""
    if runtime.is_initialized():
        runtime.current().shutdown()
    _joined.clear()


def _worker_ctx(ctx: Context | None, call: str = "this call") -> Context:
    if ctx is None:
        # A launched process joins its run once; a plain one may init again after it.
        if not runtime.is_initialized() and runtime.has_joined() and _env.started_by():
            raise left_run(f"bps.{call}() was called", "make every BytePS call before the "
                           "shutdown: a launched process joins its run once")
        if not runtime.is_initialized():
            raise ConfigError(f"bps.{call}() was called before bps.init()",
                              "call bps.init() (or polytrain.init()) first")
        ctx = runtime.current()
    if not ctx.is_worker:
        raise ConfigError(f"rank {ctx.rank} is a server; BytePS calls run on workers",
                          "call them from worker code only (servers serve inside init())")
    return ctx


def size(ctx: Context | None = None) -> int:
    """Number of workers."""
    return _worker_ctx(ctx, "size").num_workers


def rank(ctx: Context | None = None) -> int:
    """This worker's index among all workers."""
    return _worker_ctx(ctx, "rank").worker_index


def local_rank(ctx: Context | None = None) -> int:
    """This worker's index among its machine's workers."""
    return _worker_ctx(ctx, "local_rank").local_index


def local_size(ctx: Context | None = None) -> int:
    """Workers on this worker's machine."""
    return len(_worker_ctx(ctx, "local_size").local_workers)


def declare(name: str, *, ctx: Context | None = None) -> None:
    """Note a tensor name before its first push_pull (BytePS's ``declare``).

    Keys are taken at a name's first :func:`push_pull`, in the order every worker
    reaches it (the servers refuse workers whose first uses differ, naming both),
    so a declaration only records the name; declaring it twice is an error.
    """
    names = _declared.setdefault(_worker_ctx(ctx, "declare"), [])
    if name in names:
        raise ConfigError(f"tensor name {name!r} was declared twice",
                          "declare every name once")
    names.append(name)


@dataclass
class PushPullHandle:
    """A push_pull in flight; :func:`synchronize` finishes it."""

    engine: Engine
    tensor: SumTensor
    like: torch.Tensor
    average: bool
    inplace: bool = False
    #: The values travelled divided by the workers, so their sum is the average already.
    divided: bool = False
    #: :func:`synchronize` returned its result (a handle is synchronised once).
    done: bool = False


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                    version: int = 0, priority: int = 0,
                    compression: Compressor | str | None = Compression.none, *,
                    ctx: Context | None = None) -> PushPullHandle:
    """Start summing (or averaging) ``tensor`` over every worker; see :func:`push_pull`."""
    return _push_pull_async(tensor, average, name, priority, compression, False, ctx,
                            "push_pull_async")


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True,
                            name: str | None = None, version: int = 0, priority: int = 0,
                            compression: Compressor | str | None = Compression.none, *,
                            ctx: Context | None = None) -> PushPullHandle:
    """:func:`push_pull_async` whose :func:`synchronize` writes the result into ``tensor``."""
    return _push_pull_async(tensor, average, name, priority, compression, True, ctx,
                            "push_pull_async_inplace")


def _push_pull_async(tensor: torch.Tensor, average: bool, name: str | None, priority: int,
                     compression: Compressor | str | None, inplace: bool,
                     ctx: Context | None, caller: str) -> PushPullHandle:
    """The call behind every push_pull variant; ``caller``: the one the user made."""
    if not isinstance(tensor, torch.Tensor):  # a numpy array failed on is_floating_point
        kind = type(tensor)
        raise ConfigError(f"{caller}() takes a torch.Tensor (got a "
                          f"{'' if kind.__module__ == 'builtins' else kind.__module__ + '.'}"
                          f"{kind.__qualname__})", "pass torch.as_tensor(...) of it "
                          "(torch.from_numpy for a numpy array)")
    checked = check_kinds(push_pull, {"average": average, "name": name, "priority": priority},
                          what=f"{caller}() ")
    average, priority = checked["average"], checked["priority"]
    ctx = _worker_ctx(ctx, "push_pull")
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ConfigError(f"push_pull(average=True) of a {tensor.dtype} tensor would round",
                          "pass average=False for integer tensors, or a float tensor")
    compression = _resolve(compression)  # a name as DistributedOptimizer takes, or an object
    if compression is not None and not isinstance(compression, Compressor):
        raise ConfigError(f"push_pull's compression must be a polytrain compressor or its "
                          f"name (got {compression!r})",
                          "pass polytrain.byteps.Compression.fp16, say, or 'topk:0.01'")
    if compression is not None and tensor.dtype != torch.float32:
        raise ConfigError(f"push_pull compresses float32 tensors only (got {tensor.dtype})",
                          "pass compression=Compression.none for this tensor")
    if name is None:
        n = next(_unnamed.setdefault(ctx, itertools.count()))
        name = f"push_pull.{n}"
        if n + 1 == UNNAMED_WARN:
            log.warning("%d push_pull calls without a name: each declares keys of its own on "
                        "the servers, kept for the run, so memory grows with every call; pass "
                        "name=... for a tensor pushed every step", n + 1)
    engine = engine_for(ctx)
    declared = _names.setdefault(engine, {})
    spec = TensorSpec(name, tuple(tensor.shape), tensor.dtype)
    how = "none" if compression is None else compression.spec()
    t, first_how = declared.get(name, (None, how))
    if t is None:
        if compression is not None:  # held to its name's rules, as the servers will parse it
            _checked(compression)
        plan = plan_for(ctx.topology, [spec], partition_bytes=DEFAULT_PARTITION_BYTES)
        packing = None if compression is None else [CompressOptions(compression)]
        [t] = engine.sums([spec], plan.placement, compression=packing)
        declared[name] = (t, how)
    elif t.spec != spec:
        raise ConfigError(f"push_pull name {name!r} was first used for {list(t.spec.shape)} "
                          f"{t.spec.dtype}, now for {list(spec.shape)} {spec.dtype}",
                          "give every distinct tensor its own name")
    elif first_how != how:  # the servers hold the first: this one would be ignored
        raise ConfigError(f"push_pull name {name!r} was first used with compression "
                          f"{first_how}, now with {how}",
                          "give the tensor another name for another compression")
    # A 16-bit average travels divided, as GradientSync's gradients do: the servers add in
    # float32 but answer in the tensor's dtype, so a sum past 65,504 was inf in float16.
    divided = average and travels_divided(tensor.dtype)
    if t.busy:
        raise ConfigError(f"push_pull name {name!r} has a push_pull in flight already",
                          f"synchronize the earlier handle for name {name!r} first "
                          f"(bps.synchronize(handle)), or give this tensor another name")
    engine.submit(t, tensor.detach().div(ctx.num_workers) if divided else tensor, priority)
    return PushPullHandle(engine, t, tensor, average, inplace, divided)


def poll(handle: PushPullHandle) -> bool:
    """Whether the push_pull has finished, so that :func:`synchronize` returns at once
    (the sum of every partition is on this worker); never blocks."""
    _check_open(handle, "poll")
    return handle.engine.ready(handle.tensor)


def _check_open(handle: PushPullHandle, call: str) -> None:
    """Refuse a handle whose run this process left (a wait would blame a lost server, or
    a peer that is alive: the shutdown closed the groups its messages move in)."""
    if handle.engine.ctx.closed:
        raise left_run(f"bps.{call}() of push_pull name {handle.tensor.spec.name!r} was "
                       f"called", "synchronize every handle before the shutdown: a launched "
                       "process joins its run once")


def synchronize(handle: PushPullHandle) -> torch.Tensor:
    """Wait for a push_pull in flight and return the result (shaped like its input; for an
    in-place one, the input itself, now holding the result)."""
    _check_open(handle, "synchronize")
    if handle.done:
        raise ConfigError(f"this handle (push_pull name {handle.tensor.spec.name!r}) was "
                          f"already synchronized", "synchronize each handle once, and keep "
                          "the tensor that call returned")
    total = handle.engine.wait(handle.tensor).view(handle.like.shape)
    handle.done = True
    out = handle.like if handle.inplace else torch.empty_like(handle.like)
    with torch.no_grad():
        out.copy_(total)
        if handle.average and not handle.divided:
            out.div_(handle.engine.ctx.num_workers)
    return out


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None,
              version: int = 0, priority: int = 0,
              compression: Compressor | str | None = Compression.none, *,
              ctx: Context | None = None) -> torch.Tensor:
    """The sum (or average) of ``tensor`` over every worker, through the summation service.

    BytePS's signature (``version`` is accepted and unused). Partitions of a larger
    ``priority`` are sent first (BytePS's rule; the same on every worker), then in the
    order of first use. Every worker calls it with the same names
    in the same order (the servers check: a name declared with another shape is
    an error naming it). The result is a new tensor on ``tensor``'s device;
    ``tensor`` is unchanged. ``compression`` compresses it on the way (float32). A 16-bit
    average travels divided by the workers, so that its sum cannot overflow.

    Example::

        mean_loss = polytrain.byteps.push_pull(loss.detach(), name="loss")
    """
    return synchronize(_push_pull_async(tensor, average, name, priority, compression, False,
                                        ctx, "push_pull"))


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                      version: int = 0, priority: int = 0,
                      compression: Compressor | str | None = Compression.none, *,
                      ctx: Context | None = None) -> torch.Tensor:
    """:func:`push_pull` that writes the result into ``tensor`` and returns it."""
    return synchronize(_push_pull_async(tensor, average, name, priority, compression, True,
                                        ctx, "push_pull_inplace"))


def _named(params: Mapping[str, torch.Tensor]
           | Iterable[tuple[str, torch.Tensor] | torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``params`` as (name, tensor) pairs: a state_dict's, named pairs, or bare tensors
    named by position (``params[3]``), as BytePS takes them."""
    if isinstance(params, torch.Tensor):
        raise ConfigError("broadcast_parameters() got one tensor, not a collection of them",
                          "pass model.state_dict(), model.named_parameters() or [tensor]")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            out.append((f"params[{i}]", item))
        elif (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], torch.Tensor)):
            out.append(item)
        else:
            raise ConfigError(f"broadcast_parameters() takes tensors or (name, tensor) pairs, "
                              f"and item {i} is a {type(item).__name__}",
                              "pass model.state_dict(), model.named_parameters() or "
                              "model.parameters()")
    return out


@torch.no_grad()
def broadcast_parameters(params: Mapping[str, torch.Tensor]
                         | Iterable[tuple[str, torch.Tensor] | torch.Tensor],
                         root_rank: int = 0, *, ctx: Context | None = None) -> None:
    """Copy worker ``root_rank``'s tensors into every worker's: a state_dict, named pairs
    (``model.named_parameters()``) or tensors (``model.parameters()``, named by position)."""
    root_rank = check_kinds(broadcast_parameters, {"root_rank": root_rank},
                            what="broadcast_parameters() ")["root_rank"]
    ctx = _worker_ctx(ctx)
    if not 0 <= root_rank < ctx.num_workers:
        raise ConfigError(f"root_rank {root_rank} is not a worker (there are "
                          f"{ctx.num_workers})", f"pass 0 .. {ctx.num_workers - 1}")
    items = _named(params)
    # gloo broadcasts into a buffer of another size without a word: check first.
    check_same_tensors(ctx, tensor_signature(items),
                       "broadcast_parameters() argument", "pass the same model's state_dict() "
                       "(or named_parameters()) on every worker", root=root_rank)
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
    root_rank = check_kinds(broadcast_optimizer_state, {"root_rank": root_rank},
                            what="broadcast_optimizer_state() ")["root_rank"]
    ctx = _worker_ctx(ctx)
    if not 0 <= root_rank < ctx.num_workers:
        raise ConfigError(f"root_rank {root_rank} is not a worker (there are "
                          f"{ctx.num_workers})", f"pass 0 .. {ctx.num_workers - 1}")
    check_same_tensors(ctx, tensor_signature((f"param_groups[{g}]['params'][{i}]", p)
                                             for g, group in enumerate(optimizer.param_groups)
                                             for i, p in enumerate(group["params"])),
                       "list of optimizer parameters", "build the same model and optimizer (the "
                       "same parameter groups, in the same order) on every worker",
                       root=root_rank)
    box = [_to_cpu(optimizer.state_dict()) if ctx.worker_index == root_rank else None]
    dist.broadcast_object_list(box, src=ctx.topology.workers[root_rank],
                               group=ctx.groups.workers)
    state: Any = box[0]
    optimizer.load_state_dict(state)  # moves state to each parameter's device


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - BytePS's name
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression: Choice | Mapping[str, Choice] = Compression.none,
                         backward_passes_per_step: int = 1, *,
                         ctx: Context | None = None, **options: Any) -> torch.optim.Optimizer:
    """Wrap any torch optimizer so that ``step()`` uses the gradients summed over every worker.

    Gradients are pushed from hooks as soon as backward produces them (after
    ``backward_passes_per_step`` passes: gradient accumulation); ``step()``
    waits for the sums, averages them over workers and runs ``optimizer``.
    ``compression``: a :class:`Compression` member, a name (``"topk:0.01"``), or a
    dict of them by parameter name (others travel uncompressed); tensors under
    ``compress_min_bytes`` always travel uncompressed. Works with CUDA parameters
    (the servers stay on CPU). ``options`` are the strategy's
    (:class:`BytePSOptions`: ``partition_bytes``, ``fuse_bytes``, ``colocate``,
    ``credit_bytes``, ``async_``, ``staleness``, ``error_feedback``,
    ``compress_momentum``, ``compress_min_bytes``, ``compress_warmup``,
    ``compress_warmup_with``, ``compress_adam``, ``compress_adam_refresh``
    (1-bit Adam: see :class:`polytrain.strategies.byteps.optimizer.DistributedOptimizer`),
    ``compress``: the default
    compression when ``compression`` is none; these and the compression must be the same
    on every worker, but ``credit_bytes``, each worker's own send window: compared here).
    Launch with colocated servers (``polytrain launch --colocated 1``) and/or
    ``--servers K``.

    Example::

        opt = polytrain.byteps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=polytrain.byteps.Compression.onebit, error_feedback=True)
    """
    ctx = _worker_ctx(ctx, "DistributedOptimizer")
    opts, chosen = checked_options("DistributedOptimizer", compression, options)
    # Differing on some workers, these declare other keys or sum other payloads: refused
    # here, as the drop-in's are, not after a timeout (or, a momentum, as mixed sums).
    check_same_values(ctx, {f"DistributedOptimizer option {name}": value
                            for name, value in same_options(opts, chosen).items()},
                      "pass the same options to DistributedOptimizer on every worker")
    # A fused key is declared by its first and last names and its size: other models of
    # the same size summed into each other, silently (polytrain.distribute compares models).
    if named_parameters is not None:
        named_parameters = list(named_parameters)  # a generator is read again by the wrap
    trained, _ = named_params_of(optimizer, named_parameters)
    check_same_tensors(ctx, tensor_signature(trained), "list of parameters to "
                       "DistributedOptimizer", "build the same model on every worker, and "
                       "freeze the same parameters before wrapping the optimizer")
    engine = engine_for(ctx, credit_bytes=opts.credit_bytes)
    placing: dict[str, Any] = {"partition_bytes": opts.partition_bytes,
                               "colocate": opts.colocate, "compression": chosen,
                               "error_feedback": opts.error_feedback,
                               "compress_momentum": opts.compress_momentum,
                               "compress_min_bytes": opts.compress_min_bytes}
    if opts.async_:
        check_async_passes(backward_passes_per_step)
        return AsyncOptimizer(optimizer, engine=engine, named_parameters=named_parameters,
                              staleness=opts.staleness, **placing)
    return _SyncOptimizer(optimizer, engine=engine, named_parameters=named_parameters,
                          backward_passes_per_step=backward_passes_per_step,
                          fuse_bytes=opts.fuse_bytes, compress_warmup=opts.compress_warmup,
                          compress_warmup_with=opts.compress_warmup_with,
                          compress_adam=opts.compress_adam,
                          compress_adam_refresh=opts.compress_adam_refresh, **placing)
