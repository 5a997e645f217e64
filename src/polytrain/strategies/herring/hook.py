"""Herring as a DDP communication hook: torch's DDP and its buckets, Herring's servers.

The route SageMaker's product took (a c10d backend under native DDP): keep
``torch.nn.parallel.DistributedDataParallel`` and send each of its buckets
through Herring's sharded servers instead of an all-reduce.

Example::

    from polytrain.herring import HerringHookState, herring_hook

    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ctx.groups.workers)
    ddp.register_comm_hook(HerringHookState(ctx), herring_hook)
"""

from __future__ import annotations

import gc
import queue
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ... import runtime
from ...comm.partition import TensorSpec
from ...errors import ConfigError
from ...kinds import check_kinds
from ...ps.engine import Engine, SumTensor, engine_for, forget_if_alive
from ...ps.grads import travels_divided
from ...runtime import Context
from ..checks import check_even_machines, check_same_values
from .ddp import EVEN_MACHINES, check_every_worker, herring_servers
from .plan import plan_herring

__all__ = ["HerringHookState", "herring_hook"]

# Keys reserved per bucket layout: DDP may rebuild its buckets once (after the first
# iteration), so a bucket index can come with a second size or dtype.
_MAX_BUCKETS = 4096
_LAYOUTS = 2
_ONE_PER_DDP = "make one HerringHookState per DistributedDataParallel"
#: What the waiter waits for: the engine, a bucket's sum, its buffer, what to divide the sum
#: by (1: it travelled divided), its future, and where a failure goes (None: the future).
_Waited = tuple[Engine, SumTensor, torch.Tensor, int, Any, list[BaseException] | None]



class HerringHookState:
    """What :func:`herring_hook` keeps: the engine, each bucket's declared sum, a waiter.

    Buckets are declared when DDP first hands them over, in whatever order
    backward makes them ready, so their keys cannot come from the run's key
    space in order: the state takes one block of keys when it is made (every
    worker makes it at the same point) and gives bucket ``i`` of layout ``g``
    the keys ``block + (g * MAX + i) * pieces``.

    The DDP it is registered on must sum over every worker (``process_group=
    ctx.groups.workers``): another group is refused at the first bucket, naming its ranks.
    A state serves one DDP (make one per DDP): several registered before the first bucket
    are refused there, a later one when a third bucket layout appears. :meth:`close`
    lets its sums go at the first wrap after it.

    Args:
        ctx: the run (default: :func:`polytrain.init`'s).
        colocate: a server on every worker machine (default True; the same on every
            worker, compared here).
    """

    def __init__(self, ctx: Context | None = None, *, colocate: bool = True) -> None:
        # As the drop-in's: colocate="no" was a true value, and one that differs between
        # workers declared other servers (a hang, then a timeout blaming a push_pull).
        colocate = check_kinds(HerringHookState.__init__, {"colocate": colocate},
                               what="HerringHookState option ")["colocate"]
        self.ctx = ctx or runtime.current()
        check_even_machines("herring", self.ctx.topology, EVEN_MACHINES)
        check_same_values(self.ctx, {"HerringHookState option colocate": colocate},
                          "pass the same options to HerringHookState on every worker")
        self.engine = engine_for(self.ctx)
        self.servers = herring_servers(self.ctx, colocate=colocate)
        self.local = len(self.ctx.local_workers)
        self.pieces = sum(map(len, self.servers)) * self.local
        self.first_key = self.ctx.keys.take(_MAX_BUCKETS * _LAYOUTS * self.pieces)
        self.sums: dict[tuple[int, int], SumTensor] = {}
        #: bucket index -> the (numel, dtype) seen, in order
        self.layout: dict[int, list[tuple[int, torch.dtype]]] = {}
        self.group_checked = False  # the DDP's process_group (_check_group)
        self.closed = False  # close() called: herring_hook refuses the buckets after it
        self.waiting: queue.Queue[_Waited | None] = queue.Queue()
        # The waiter does not hold this state, so that one dropped without close() (with
        # the DDP it is registered on: torch's DDP has no close()) is collected, and this
        # finalizer stops the waiter and lets the sums go; close() calls it.
        self._thread = threading.Thread(target=_wait, args=(self.waiting,), daemon=True,
                                        name="polytrain-herring-hook")
        self._thread.start()
        self._let_go = weakref.finalize(self, _let_go, self.waiting,
                                        weakref.ref(self.engine), self.sums)

    def _check_group(self) -> None:
        """Refuse a DDP whose process_group is not every worker (a replica group of some):
        the hook sums over every worker; and a second DDP: the sums are keyed by bucket
        index. A bucket carries neither its group nor its DDP; torch's DDP keeps
        ``(hook, state)`` in its ``_comm_hooks``, so the DDPs that registered this state are
        found among the live objects, once, at the first bucket. (By their type: isinstance()
        reads ``__class__``, which a dead ``weakref.proxy`` among them raises on.)"""
        ddps = [ddp for ddp in gc.get_objects()
                if issubclass(type(ddp), DistributedDataParallel) and any(
                    s is self for _, s in getattr(ddp, "_comm_hooks", ()))]
        if len(ddps) > 1:
            raise ConfigError(f"herring_hook's HerringHookState is registered on {len(ddps)} "
                              f"DistributedDataParallel models, and keys its sums by bucket "
                              f"index, which each of them numbers from 0", _ONE_PER_DDP)
        for ddp in ddps:
            check_every_worker(
                self.ctx, ddp.process_group, "herring_hook",
                "the process_group of the DistributedDataParallel it is registered on",
                "pass process_group=ctx.groups.workers to that DistributedDataParallel, "
                "or leave the hook out of it")
        self.group_checked = True

    def _sum_of(self, index: int, numel: int, dtype: torch.dtype) -> SumTensor:
        seen = self.layout.setdefault(index, [])
        if (numel, dtype) not in seen:
            seen.append((numel, dtype))
        generation = seen.index((numel, dtype))
        if index >= _MAX_BUCKETS:
            raise ConfigError(f"herring_hook: bucket {index} of {numel} {dtype} elements is "
                              f"past the {_MAX_BUCKETS} buckets it reserved keys for",
                              "raise bucket_cap_mb on the DDP model (fewer buckets)")
        if generation >= _LAYOUTS:  # a DDP registered on this state after the first bucket
            before = ", ".join(f"{n} {d}" for n, d in seen[:_LAYOUTS])
            raise ConfigError(f"herring_hook's bucket {index} came in a third layout ({numel} "
                              f"{dtype} elements; before: {before} elements), where a "
                              f"DistributedDataParallel changes its buckets once (its rebuild "
                              f"after the first step): the HerringHookState serves another "
                              f"DistributedDataParallel's buckets too", _ONE_PER_DDP)
        key = (index, generation)
        if key not in self.sums:
            spec = TensorSpec(f"ddp bucket {index}", (numel,), dtype)
            plan = plan_herring([spec], bucket_cap_bytes=max(1, spec.nbytes),
                                servers=self.servers, local_workers=self.local)
            first = self.first_key + (generation * _MAX_BUCKETS + index) * self.pieces
            [self.sums[key]] = self.engine.sums(list(plan.specs), plan.placement,
                                                first_key=first)
        return self.sums[key]

    @staticmethod
    def _raise_failed(fut: torch.futures.Future[torch.Tensor],
                      failed: list[BaseException]) -> None:
        """At the end of backward: raise the error the bucket's sum met (a CommTimeout, say)."""
        fut.wait()
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Stop the waiter and let the engine drop this state's sums (a bucket-sized CPU
        result each) at the next wrap; the DDP it is registered on sums no more buckets (a
        backward there is refused)."""
        self.closed = True
        self._let_go()
        self._thread.join(timeout=1.0)
        self.sums = {}


def _wait(waiting: queue.Queue[_Waited | None]) -> None:
    """The waiter: each bucket's sum into its buffer, then its future set. Its items carry
    what it needs, so that it holds no state (one dropped is collected)."""
    while (item := waiting.get()) is not None:
        engine, t, buffer, divide, fut, failed = item
        try:
            total = engine.wait(t)
            buffer.copy_(total.view_as(buffer).to(buffer.device))
            if divide != 1:
                buffer.div_(divide)
        except BaseException as e:  # noqa: BLE001 - raised to the user (herring_hook)
            if failed is None:
                fut.set_exception(e)
                continue
            failed.append(e)
        fut.set_result(buffer)


def _let_go(waiting: queue.Queue[_Waited | None], engine: weakref.ref[Engine],
            sums: dict[tuple[int, int], SumTensor]) -> None:
    """Stop a state's waiter and let ``engine`` (if alive) forget its ``sums``: at its
    close(), or when it is dropped without one (once: a finalizer)."""
    waiting.put(None)
    forget_if_alive(engine, list(sums.values()))


def herring_hook(state: HerringHookState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket over every worker through Herring's servers (a comm hook)."""
    if state.closed:  # its waiter is gone: the bucket's future would never be set (a hang)
        raise ConfigError("herring_hook's HerringHookState was closed (close() stopped its "
                          "waiter and let its sums go), and sums no more buckets",
                          "close() it after the last backward; to train on, wrap the model "
                          "in a new DistributedDataParallel and register a new "
                          "HerringHookState on it")
    if not state.group_checked:
        state._check_group()
    buffer = bucket.buffer()
    t = state._sum_of(bucket.index(), buffer.numel(), buffer.dtype)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None)
    divided = travels_divided(buffer.dtype)
    if divided:
        buffer.div_(state.ctx.num_workers)
    state.engine.submit(t, buffer)
    # A failed sum's error: in backward, raised as it is by a callback at its end (DDP's
    # reducer reads an error set on the future as its value: "Unable to cast ... to
    # Tensor"); outside backward (DDP's Join), set on the future, which Python waits on.
    failed: list[BaseException] | None = \
        [] if torch._C._current_graph_task_id() != -1 else None
    state.waiting.put((state.engine, t, buffer, 1 if divided else state.ctx.num_workers, fut,
                       failed))
    if failed is not None:
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: state._raise_failed(fut, failed))
    return fut


# torch's DDP checks a hook's annotations by identity; postponed annotations are strings.
herring_hook.__annotations__.update(bucket=dist.GradBucket,
                                    state=HerringHookState,
                                    **{"return": torch.futures.Future[torch.Tensor]})
