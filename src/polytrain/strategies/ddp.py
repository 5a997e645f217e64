"""``ddp``: torch's own DistributedDataParallel: the peer every method is measured by."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from .base import NoOptions, Strategy, register

__all__ = ["DDP"]


@register
class DDP(Strategy[NoOptions]):
    """Data parallelism with :class:`torch.nn.parallel.DistributedDataParallel` over the workers.

    Its bytes move inside torch, so the traffic meter records the cost of a
    ring all-reduce of the gradients (2(p-1)/p of them per worker per step)
    marked ``estimated``.
    """

    name = "ddp"
    resumes_on_other_layouts = True  # every worker holds the whole model and optimizer

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        model.to(ctx.device)
        if ctx.device.type == "cuda" and any(p.device.type != "cuda" for p in model.parameters()):
            raise ConfigError("ddp on CUDA needs every parameter on the GPU",
                              "move the model with model.to('cuda') before distribute()")
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids,
                                          process_group=ctx.groups.workers)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                         if p.requires_grad)
        workers = list(ctx.topology.workers)
        meter = ctx.meter

        def record(module: nn.Module, args: Any) -> None:
            # DDP all-reduces every gradient once per backward of a forward that syncs.
            if torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True):
                meter.record_ring_allreduce(workers, grad_bytes)

        wrapped.register_forward_pre_hook(record)
        return wrapped, optimizer
