"""Herring as a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

Example::

    import polytrain
    from polytrain.herring import DistributedDataParallel as DDP   # was: torch.nn.parallel

    ctx = polytrain.init()                 # launch with --colocated 1 (polytrain train does)
    model = DDP(model, bucket_cap_mb=25)
    for x, y in batches:                   # this worker's slice, as with torch's DDP
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch import nn

from ... import runtime
from ...comm.partition import TensorSpec
from ...errors import ConfigError
from ...kinds import check_kinds
from ...ps.engine import engine_for
from ...ps.grads import GradientSync
from ...ps.placement import server_machines
from ...runtime import Context
from ..checks import check_even_machines
from ..synced import SyncedModule, keep_missing_for
from .plan import HerringPlan, plan_herring

__all__ = ["DistributedDataParallel", "DEFAULT_BUCKET_CAP_MB", "check_every_worker"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_CAP_MB = 25.0  # torch DDP's and Herring's
#: A cap's MiB stay under this: its bytes fit an int64, as torch's reducer counts them.
_MAX_BUCKET_CAP_MB = 2.0**43
#: Why herring needs as many workers on every machine: machines of other worker counts would
#: declare other keys (a mismatch, or a hang).
EVEN_MACHINES = "cuts every shard into one piece per worker of a machine"


def bucket_cap_bytes(mb: float | None, name: str = "bucket_cap_mb") -> int:
    """A bucket cap of ``mb`` MiB in bytes (at least 1; None: the default, as torch's DDP
    reads it); ConfigError, naming the option ``name``, for one that is not a positive
    number under 2**43 MiB (a string, nan, inf, 0 or less, 1e308: bytes past an int64)."""
    if mb is None:
        mb = DEFAULT_BUCKET_CAP_MB
    if isinstance(mb, bool) or not isinstance(mb, numbers.Real):
        raise ConfigError(f"{name} must be a number of MiB (got {mb!r}, a "
                          f"{type(mb).__name__})", f"pass {name} 25")
    if not 0 < mb < _MAX_BUCKET_CAP_MB:  # nan too
        raise ConfigError(f"{name} must be positive and under 2**43 MiB, whose bytes an "
                          f"int64 holds (got {mb})", f"pass {name} 25")
    return max(1, int(mb * 2**20))


def check_every_worker(ctx: Context, process_group: Any, who: str, group: str,
                       hint: str) -> None:
    """Refuse a ``process_group`` (``group`` in the message) other than every worker: ``who``
    sums over every worker, whatever the group."""
    workers = sorted(ctx.topology.workers)
    if not isinstance(process_group, dist.ProcessGroup):  # torch's lookup: a bare KeyError
        raise ConfigError(f"{who} sums gradients over every worker (ranks {workers}), but "
                          f"{group} is {process_group!r}, a {type(process_group).__name__}, "
                          f"not a process group", hint)
    members = sorted(dist.get_process_group_ranks(process_group))
    if members != workers:
        raise ConfigError(f"{who} sums gradients over every worker (ranks {workers}), but "
                          f"{group} has ranks {members}", hint)


def herring_servers(ctx: Context, *, colocate: bool) -> list[tuple[int, ...]]:
    """Herring's server machines, each by its server ranks: every worker machine's (unless
    not ``colocate``), then each dedicated CPU machine's. Several on a machine (where
    torchrun's roles start them) share the machine's shard, on a worker machine as on a CPU
    one."""
    return server_machines(ctx.topology, colocate=colocate, strategy="herring")


class DistributedDataParallel(SyncedModule):
    """Herring (Thangakrishnan et al., SC 2020): gradients summed on servers everywhere.

    Gradients join fusion buffers of ``bucket_cap_mb`` in the order backward
    produces them; each buffer is cut into equal shards, one for every server
    (one on each worker machine, plus ``--servers K`` CPU machines), and each
    shard into one piece per local worker. A buffer leaves the moment backward
    fills it: the machine's workers reduce-scatter it, push their pieces to the
    servers, pull the sums and all-gather inside the machine. When
    ``backward()`` returns, ``.grad`` holds the average over every worker, as
    with torch's DDP.

    Args:
        module: the model (already on this worker's device).
        device_ids: as torch's DDP, the forward's inputs (nested ones and keywords too) are
            moved to ``device_ids[0]`` (an index of the model's device type, or a device);
            one device per process.
        output_device, dim: accepted for torch DDP's signature.
        broadcast_buffers: copy worker 0's buffers to every worker at a forward, when torch's
            DDP does: one after a forward that trains outside ``no_sync()`` (the first too),
            not after one under ``torch.no_grad()`` (default True, as torch's DDP; None too).
        init_sync: copy worker 0's parameters (and, with ``broadcast_buffers``, its buffers)
            to every worker at the wrap (default True, as torch's DDP); False: each keeps its
            own, and the user makes them equal.
            Every worker's model is checked either way (its sums' keys depend on it).
        process_group: accepted if it holds every worker and nothing else (as
            ``ctx.groups.workers``); gradients are summed over all workers.
        bucket_cap_mb: fusion buffer size in MiB (default 25; None too, as torch's DDP).
        find_unused_parameters: a parameter that no worker gave a gradient in a step keeps
            ``.grad`` None, as with torch's DDP (a flag per parameter summed a step more); without
            it (the default), such a gradient is summed as zeros, so every worker sends the
            same buffers.
        check_reduction: accepted, as torch (deprecated there; it does nothing).
        gradient_as_bucket_view: accepted; gradients are copied out of the buffers.
        static_graph: accepted; the hooks need no static graph.
        colocate: a server on every worker machine (default True).
        ctx: the run (default: :func:`polytrain.init`'s).

    ``broadcast_buffers``, ``init_sync``, ``bucket_cap_mb``, ``find_unused_parameters`` and
    ``colocate`` must be the same on every worker (compared at the wrap).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Any] | None = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool | None = True,
                 init_sync: bool = True, process_group: Any = None,
                 bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, *, static_graph: bool = False,
                 colocate: bool = True,
                 ctx: Context | None = None) -> None:
        # Kinds as the strategy's options are checked (colocate="no" was a true value);
        # bucket_cap_bytes checks the cap's.
        given = check_kinds(DistributedDataParallel.__init__, {
            "broadcast_buffers": broadcast_buffers, "init_sync": init_sync,
            "find_unused_parameters": find_unused_parameters, "colocate": colocate},
            what="DistributedDataParallel option ")
        broadcast_buffers, init_sync = given["broadcast_buffers"], given["init_sync"]
        find_unused_parameters, colocate = given["find_unused_parameters"], given["colocate"]
        cap = bucket_cap_bytes(bucket_cap_mb)
        ctx = ctx or runtime.current()
        if process_group is not None:
            check_every_worker(ctx, process_group, "herring", "process_group",
                               "leave process_group out, or pass ctx.groups.workers")
        check_even_machines("herring", ctx.topology, EVEN_MACHINES)
        # Differing on some workers, these declare other keys or copy other tensors: refused
        # at the wrap (with broadcast_buffers).
        same = {"bucket_cap_mb": cap / 2**20, "init_sync": bool(init_sync),
                "find_unused_parameters": bool(find_unused_parameters),
                "colocate": bool(colocate)}
        super().__init__(module, ctx, broadcast_buffers=broadcast_buffers, method="herring",
                         device_ids=device_ids, init_sync=init_sync, same=same)
        named = self.trained()
        self.plan: HerringPlan = plan_herring(
            [TensorSpec.of(n, p) for n, p in named],
            bucket_cap_bytes=cap,
            servers=herring_servers(ctx, colocate=colocate),
            local_workers=len(ctx.local_workers))
        self.sync = GradientSync(engine_for(ctx), named, self.plan.buckets,
                                 self.plan.placement, in_backward=True,
                                 describe=self.plan.describe())
        keep_missing_for(self.sync, module, find_unused=find_unused_parameters)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Refused: the drop-in sums through the servers itself (torch's DDP takes a hook)."""
        raise ConfigError("herring's DistributedDataParallel sums its gradients through "
                          "Herring's servers itself, and takes no comm hook",
                          "to keep torch's DDP and its buckets, wrap the model in "
                          "torch.nn.parallel.DistributedDataParallel(model, "
                          "process_group=ctx.groups.workers) and register herring_hook on that")
