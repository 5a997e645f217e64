"""BytePS's ``byteps.torch.parallel.DistributedDataParallel``: gradients summed during backward.

Example::

    import polytrain.byteps as bps
    from polytrain.byteps.parallel import DistributedDataParallel as DDP  # was: byteps.torch

    bps.init()
    model = DDP(model, device_ids=[bps.local_rank()])
    for x, y in batches:                   # this worker's slice
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from torch import nn

from ... import runtime
from ...errors import ConfigError
from ...kinds import check_kinds
from ...ps.engine import engine_for
from ...runtime import Context
from ..synced import SyncedModule, keep_missing_for
from .optimizer import Choice, checked_options, gradient_sync, same_options

__all__ = ["DistributedDataParallel"]

log = logging.getLogger(__name__)


class DistributedDataParallel(SyncedModule):
    """BytePS (Jiang et al., OSDI 2020) as a module wrapper: when ``backward()`` returns,
    every ``.grad`` holds the average over workers, summed by the summation service.

    Gradients are pushed from hooks as backward produces them, in BytePS's
    fusion groups and Theorem 1's placement (as :func:`DistributedOptimizer`),
    and waited for at the end of the backward pass. Every worker must build the
    same model; worker 0's parameters and buffers are copied to every worker at
    construction (as BytePS's, whatever ``broadcast_buffers`` says).

    Args:
        module: the model (on this worker's device).
        device_ids: the forward's inputs are moved to ``device_ids[0]``, as BytePS's and
            torch's DDP move them (one device per process).
        broadcast_buffers: copy worker 0's buffers to every worker at a forward, when torch's
            DDP does: one after a forward that trains outside ``no_sync()`` (the first too),
            not after one under ``torch.no_grad()`` (default True).
        compression: as :func:`DistributedOptimizer`'s (default none).
        ctx: the run (default: the one ``bps.init()`` joined).
        options: :class:`BytePSOptions` fields (``partition_bytes``, ``fuse_bytes``,
            ``colocate``, ``credit_bytes``, ``error_feedback``, ...); not ``async_``.
            ``compress_momentum`` takes the place of the optimizer's momentum, which this
            wrapper cannot see: worker 0 warns that the optimizer must have none.

    ``broadcast_buffers``, the compression and those options must be the same on every
    worker (compared at the wrap, naming the first that differs), but ``credit_bytes``:
    each worker's own send window.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Any] | None = None,
                 broadcast_buffers: bool = True,
                 compression: Choice | Mapping[str, Choice] = None, *,
                 ctx: Context | None = None, **options: Any) -> None:
        ctx = ctx or runtime.current()
        opts, chosen = checked_options("DistributedDataParallel", compression, options)
        if opts.async_:
            raise ConfigError("DistributedDataParallel sums gradients synchronously; "
                              "async_ does not apply", "use DistributedOptimizer(..., "
                              "async_=True) for asynchronous BytePS")
        if opts.compress_adam:
            raise ConfigError("compress_adam (1-bit Adam) replaces the optimizer's step; "
                              "DistributedDataParallel does not see the optimizer",
                              "use DistributedOptimizer(torch.optim.Adam(...), "
                              "compress_adam=True, compress_warmup=N)")
        broadcast_buffers = check_kinds(
            DistributedDataParallel.__init__, {"broadcast_buffers": broadcast_buffers},
            what="DistributedDataParallel option ")["broadcast_buffers"]
        # Differing on some workers, these declare other keys or sum other payloads: refused
        # at the wrap (with broadcast_buffers), not after the timeouts.
        same = same_options(opts, chosen)
        # BytePS's DDP copies worker 0's whole state_dict at the wrap, buffers too, whatever
        # broadcast_buffers says (torch's copies them only with it).
        super().__init__(module, ctx, broadcast_buffers=broadcast_buffers, method="BytePS",
                         device_ids=device_ids, init_buffers=True, same=same)
        if opts.compress_momentum and ctx.worker_index == 0:
            # DistributedOptimizer refuses it beside the optimizer's own momentum
            # (check_compress_momentum); this wrapper never sees the optimizer.
            log.warning("compress_momentum %s puts a momentum on the gradients before "
                        "compression, and DistributedDataParallel cannot see the optimizer: "
                        "give it no momentum of its own (SGD's momentum=0, Adam's betas=(0.0, "
                        "b2)), or the update has two; bps.DistributedOptimizer(..., "
                        "compress_momentum=%s) checks it", opts.compress_momentum,
                        opts.compress_momentum)
        self.plan, self.sync = gradient_sync(
            engine_for(ctx, credit_bytes=opts.credit_bytes), self.trained(),
            compression=chosen,
            error_feedback=opts.error_feedback, compress_momentum=opts.compress_momentum,
            compress_min_bytes=opts.compress_min_bytes, fuse_bytes=opts.fuse_bytes,
            compress_warmup=opts.compress_warmup,
            compress_warmup_with=opts.compress_warmup_with,
            partition_bytes=opts.partition_bytes, colocate=opts.colocate, in_backward=True,
            owner="DistributedDataParallel")
        keep_missing_for(self.sync, module)

    def synchronize(self) -> None:
        """BytePS's, for models with branches (``loss.backward(); model.synchronize();
        optimizer.step()``): wait for every gradient's sum. Here the end of ``backward()``
        waits for them already, so after a backward it has nothing to do."""
        self.sync.synchronize()
