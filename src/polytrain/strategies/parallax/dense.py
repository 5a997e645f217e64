"""Parallax's dense parameters: averaged by all-reduce, reduced inside each machine first."""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ...ps.grads import travels_divided
from ...runtime import Context

__all__ = ["DenseSync"]


class DenseSync:
    """Average the dense gradients over every worker: reduce to the machine's leader, ring
    all-reduce among the leaders (what crosses machines: 2 (N - 1) / N of the gradient per
    machine, recorded on the meter as estimated), broadcast inside the machine.

    Args:
        ctx: the run. named: the dense parameters by name, in the same order on every worker.
    """

    def __init__(self, ctx: Context, named: list[tuple[str, nn.Parameter]]) -> None:
        self.ctx = ctx
        self.named = named
        self.params = [p for _, p in named]
        # What the all-reduce moves: the gradients and a count per parameter.
        self.nbytes = sum((p.numel() + 1) * p.element_size() for p in self.params)
        self.leaders = list(ctx.topology.leaders)

    def start(self) -> Callable[[], None]:
        """Start averaging; returns the call that finishes it (the leaders' all-reduce runs
        in the background in between, so the caller's own work overlaps it)."""
        if not self.params:
            return lambda: None
        for name, p in self.named:  # before any exchange: every worker refuses alike
            if p.grad is not None and p.grad.is_sparse:
                raise ConfigError(
                    f"parameter {name!r} has a sparse gradient (F.embedding(..., sparse=True) "
                    f"on it?), and is not one of the sparse tables parallax holds on servers "
                    f"(embedding modules' weights, looked up through the module): every other "
                    f"parameter's gradient is all-reduced dense",
                    "look its rows up through its nn.Embedding module, or pass sparse=False")
        ctx = self.ctx
        # After the gradients, one count per parameter of the workers that have its gradient:
        # a parameter no worker used keeps .grad None, as in one process (summed as zeros,
        # Adam's momentum and AdamW's decay would move it).
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params]
                         + [torch.tensor([float(p.grad is not None) for p in self.params],
                                         dtype=self.params[0].dtype,
                                         device=self.params[0].device)]).cpu()
        # A 16-bit sum of the workers' gradients can overflow (two of 40,000 are inf in
        # float16): those travel divided, as torch's DDP does; the rest divide the sum.
        divided = travels_divided(flat.dtype)
        if divided:
            flat.div_(ctx.num_workers)
        local = len(ctx.local_workers) > 1
        leader = ctx.local_workers[0]
        if local:
            dist.reduce(flat, dst=leader, group=ctx.groups.local)
        work = None
        if ctx.rank == leader and len(self.leaders) > 1:
            work = dist.all_reduce(flat, group=ctx.groups.leaders, async_op=True)
            ctx.meter.record_ring_allreduce(self.leaders, self.nbytes)

        def finish() -> None:
            if work is not None:
                try:
                    work.wait(timeout=timedelta(seconds=ctx.timeout_s))
                except RuntimeError as e:
                    # As a timeout (CommTimeout, with the wait): the launcher then looks for
                    # a leader that stalled and names it, not this one that waited for it.
                    raise ctx.transport.error(
                        e, None, f"the dense gradients' all-reduce among the machines' leaders "
                        f"{self.leaders}", ctx.timeout_s) from None
            if local:
                dist.broadcast(flat, src=leader, group=ctx.groups.local)
            if not divided:
                flat.div_(ctx.num_workers)
            had = flat[-len(self.params):]
            at = 0
            for p, used in zip(self.params, had.tolist()):
                n = p.numel()
                g = flat[at:at + n].view_as(p).to(device=p.device, dtype=p.dtype)
                at += n
                if not used:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        return finish
