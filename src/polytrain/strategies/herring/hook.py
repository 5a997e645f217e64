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
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ... import runtime
from ...comm.partition import TensorSpec
from ...errors import ConfigError
from ...kinds import check_kinds
from ...ps.engine import SumTensor, engine_for
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
        self.waiting: queue.Queue[
            tuple[SumTensor, torch.Tensor, bool, Any, list[BaseException] | None] | None] = \
            queue.Queue()
        self._thread = threading.Thread(target=self._wait, daemon=True,
                                        name="polytrain-herring-hook")
        self._thread.start()

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

    def _wait(self) -> None:
        while (item := self.waiting.get()) is not None:
            t, buffer, divided, fut, failed = item
            try:
                total = self.engine.wait(t)
                buffer.copy_(total.view_as(buffer).to(buffer.device))
                if not divided:
                    buffer.div_(self.ctx.num_workers)
            except BaseException as e:  # noqa: BLE001 - raised to the user (herring_hook)
                if failed is None:
                    fut.set_exception(e)
                    continue
                failed.append(e)
            fut.set_result(buffer)

    @staticmethod
    def _raise_failed(fut: torch.futures.Future[torch.Tensor],
                      failed: list[BaseException]) -> None:
        """At the end of backward: raise the error the bucket's sum met (a CommTimeout, say)."""
        fut.wait()
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Stop the waiter and let the engine drop this state's sums (a bucket-sized CPU
        result each) at the next wrap; the DDP it is registered on sums no more buckets."""
        self.waiting.put(None)
        self._thread.join(timeout=1.0)
        self.engine.forget(list(self.sums.values()))
        self.sums = {}


def herring_hook(state: HerringHookState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket over every worker through Herring's servers (a comm hook)."""
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
    state.waiting.put((t, buffer, divided, fut, failed))
    if failed is not None:
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: state._raise_failed(fut, failed))
    return fut


# torch's DDP checks a hook's annotations by identity; postponed annotations are strings.
herring_hook.__annotations__.update(bucket=dist.GradBucket,
                                    state=HerringHookState,
                                    **{"return": torch.futures.Future[torch.Tensor]})
