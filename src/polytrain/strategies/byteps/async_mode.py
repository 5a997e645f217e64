"""Asynchronous BytePS: servers hold the parameters; workers push updates and pull, unbarriered.

Each step a worker runs its own optimizer on its own gradient, pushes the
update ``(new - old) / workers`` of every partition to the partition's owner
and pulls the owner's current value. A parameter store's clock counts each
worker's pushes; a pull of step c waits until the slowest worker has pushed
step c - staleness (bounded staleness; the reference had no bound). With
staleness 0 every pull waits for every worker's push of that step, so the
pulled parameters are ``w + sum_i (new_i - w) / workers``; for plain SGD that
is exactly the synchronous step ``w - lr * mean_i g_i``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ...comm.partition import TensorSpec
from ...errors import ConfigError
from ...ps.client import Pending
from ...ps.protocol import Kind
from ...ps.store import Declaration
from .engine import SumEngine
from .optimizer import WrappedOptimizer, named_params_of

__all__ = ["AsyncOptimizer"]

log = logging.getLogger(__name__)


class AsyncOptimizer(WrappedOptimizer):
    """Wraps any torch optimizer for asynchronous training against parameter servers.

    Example::

        opt = AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), engine=engine,
                             named_parameters=model.named_parameters(), staleness=2)
        loss_fn(model(x), y).backward()
        opt.step()                # local update, push it, pull the servers' parameters

    Args:
        optimizer: the worker's own optimizer (its update is what gets pushed).
        engine: gives the placement of partitions on this run's servers.
        named_parameters: names in model order (earlier layers are pushed first).
        staleness: steps a worker may be ahead of the slowest (0: synchronous).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, engine: SumEngine,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 staleness: int = 0) -> None:
        if staleness < 0:
            raise ConfigError(f"staleness must be 0 or more (got {staleness})", "pass 0 or more")
        super().__init__(optimizer)
        self.ctx = engine.ctx
        self.staleness = staleness
        named = named_params_of(optimizer, named_parameters)
        self._params = [p for _, p in named]
        self.plan = engine.plan([TensorSpec.of(n, p) for n, p in named])
        self.clock = 0
        self._pulled = [torch.empty(p.numel(), dtype=p.dtype) for p in self._params]
        self._declare()

    def _parts(self) -> Iterable[tuple[Any, int]]:
        return zip(self.plan.placement.partitions, self.plan.placement.owners)

    def _declare(self) -> None:
        ctx = self.ctx
        client = ctx.ps_client
        for part, owner in self._parts():
            client.declare(Declaration(
                key=part.key, kind=int(Kind.PARAM), name=part.label, numel=part.numel,
                dtype=str(part.dtype), pushers=ctx.num_workers, pullers=ctx.num_workers,
                options={"staleness": self.staleness}), owner)
        if ctx.worker_index == 0:
            flats = [p.detach().reshape(-1).cpu() for p in self._params]
            sets = [client.set(owner, key=part.key,
                               tensor=flats[part.tensor][part.offset:part.offset + part.numel])
                    for part, owner in self._parts()]
            # A GET is answered after the SET before it (same key, same engine thread), so
            # once every GET is back the servers hold worker 0's parameters.
            check = [torch.empty(part.numel, dtype=part.dtype) for part, _ in self._parts()]
            gets = [client.get(owner, key=part.key, out=out)
                    for (part, owner), out in zip(self._parts(), check)]
            for pending in sets + gets:
                pending.wait()
            log.info("asynchronous byteps, staleness %d:\n%s", self.staleness,
                     self.plan.describe())
        dist.barrier(group=ctx.groups.workers)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        old = [p.detach().reshape(-1).to("cpu", copy=True) for p in self._params]
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.clock += 1
        client = self.ctx.ps_client
        pushes: list[Pending] = []
        for part, owner in self._parts():  # key order: earlier layers first
            lo, n = part.offset, part.numel
            new = self._params[part.tensor].detach().reshape(-1)[lo:lo + n].to("cpu")
            delta = (new - old[part.tensor][lo:lo + n]).div_(self.ctx.num_workers)
            pushes.append(client.push(owner, key=part.key, round=self.clock, tensor=delta))
        self._pull(self.clock, pushes)
        return loss

    def _pull(self, round_: int, before: list[Pending]) -> None:
        client = self.ctx.ps_client
        pulls = [client.pull(owner, key=part.key, round=round_,
                             out=self._pulled[part.tensor][part.offset:part.offset + part.numel])
                 for part, owner in self._parts()]
        for pending in before + pulls:
            pending.wait()
        for p, value in zip(self._params, self._pulled):
            p.detach().copy_(value.view(p.shape))

    def pull_final(self) -> None:
        """Load the servers' parameters once every worker has pushed as many steps as this one."""
        self._pull(self.clock + self.staleness, [])

    def __repr__(self) -> str:
        return f"byteps.AsyncOptimizer({self.optimizer!r}, staleness={self.staleness})"
