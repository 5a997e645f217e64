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

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ... import runtime
from ...errors import ConfigError
from ...ps.engine import engine_for
from ...runtime import Context
from ..checks import broadcast_module
from .optimizer import Choice, gradient_sync
from .options import BytePSOptions

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """BytePS (Jiang et al., OSDI 2020) as a module wrapper: when ``backward()`` returns,
    every ``.grad`` holds the average over workers, summed by the summation service.

    Gradients are pushed from hooks as backward produces them, in BytePS's
    fusion groups and Theorem 1's placement (as :func:`DistributedOptimizer`),
    and waited for at the end of the backward pass. Worker 0's parameters and
    buffers are copied to every worker at construction.

    Args:
        module: the model (on this worker's device).
        device_ids: accepted for the signature (one device per process).
        broadcast_buffers: copy worker 0's buffers to every worker at each forward
            (default True).
        compression: as :func:`DistributedOptimizer`'s (default none).
        ctx: the run (default: the one ``bps.init()`` joined).
        options: :class:`BytePSOptions` fields (``partition_bytes``, ``fuse_bytes``,
            ``colocate``, ``credit_bytes``, ``error_feedback``, ...); not ``async_``.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Any] | None = None,
                 broadcast_buffers: bool = True,
                 compression: Choice | Mapping[str, Choice] = None, *,
                 ctx: Context | None = None, **options: Any) -> None:
        super().__init__()
        ctx = ctx or runtime.current()
        if not ctx.is_worker:
            raise ConfigError(f"rank {ctx.rank} is a server; BytePS trains on workers",
                              "wrap the model on workers only (servers serve inside init())")
        opts = BytePSOptions(**options)
        if opts.async_:
            raise ConfigError("DistributedDataParallel sums gradients synchronously; "
                              "async_ does not apply", "use DistributedOptimizer(..., "
                              "async_=True) for asynchronous BytePS")
        if opts.compress_adam:
            raise ConfigError("compress_adam (1-bit Adam) replaces the optimizer's step; "
                              "DistributedDataParallel does not see the optimizer",
                              "use DistributedOptimizer(torch.optim.Adam(...), "
                              "compress_adam=True, compress_warmup=N)")
        broadcast_module(ctx, module)
        self.module = module
        self.ctx = ctx
        self.broadcast_buffers = broadcast_buffers
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.plan, self.sync = gradient_sync(
            engine_for(ctx, credit_bytes=opts.credit_bytes), named,
            compression=opts.compress if compression is None else compression,
            error_feedback=opts.error_feedback, compress_momentum=opts.compress_momentum,
            compress_min_bytes=opts.compress_min_bytes, fuse_bytes=opts.fuse_bytes,
            compress_warmup=opts.compress_warmup,
            compress_warmup_with=opts.compress_warmup_with,
            partition_bytes=opts.partition_bytes, colocate=opts.colocate, in_backward=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.ctx.num_workers > 1:
            src = self.ctx.topology.workers[0]
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b.data, src=src, group=self.ctx.groups.workers)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the first one after syncs them."""
        before = self.sync.enabled
        self.sync.enabled = False
        try:
            yield
        finally:
            self.sync.enabled = before

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The bare model's (keys without ``module.``)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def close(self) -> None:
        """Remove the gradient hooks."""
        self.sync.close()
