"""Parallax's dense parameters: averaged by all-reduce, reduced inside each machine first."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...runtime import Context

__all__ = ["DenseSync"]


class DenseSync:
    """Average the dense gradients over every worker: reduce to the machine's leader, ring
    all-reduce among the leaders (what crosses machines: 2 (N - 1) / N of the gradient per
    machine, recorded on the meter as estimated), broadcast inside the machine.

    Args:
        ctx: the run. params: the dense parameters, in the same order on every worker.
    """

    def __init__(self, ctx: Context, params: list[nn.Parameter]) -> None:
        self.ctx = ctx
        self.params = params
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.leaders = list(ctx.topology.leaders)

    def __call__(self) -> None:
        if not self.params:
            return
        ctx = self.ctx
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params]).cpu()
        local = len(ctx.local_workers) > 1
        leader = ctx.local_workers[0]
        if local:
            dist.reduce(flat, dst=leader, group=ctx.groups.local)
        if ctx.rank == leader and len(self.leaders) > 1:
            dist.all_reduce(flat, group=ctx.groups.leaders)
            ctx.meter.record_ring_allreduce(self.leaders, self.nbytes)
        if local:
            dist.broadcast(flat, src=leader, group=ctx.groups.local)
        flat /= ctx.num_workers
        at = 0
        for p in self.params:
            n = p.numel()
            g = flat[at:at + n].view_as(p).to(p.device)
            at += n
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
