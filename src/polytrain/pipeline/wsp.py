"""Wave Synchronous Parallel, a stage's side: push a wave's update, pull the global weights.

The servers hold the model in parameter stores (``ps.ParamStore``): a PUSH
adds an update and advances the pusher's clock, a PULL of round ``c`` is
answered once every virtual worker's clock is at least ``c - D``. A clock is
one wave. Keys are the partitions of the whole model's parameters, so virtual
workers cut differently still agree on them; each key's pushers are the
stages (one per virtual worker) that hold its tensor.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist

from ..comm.partition import Partition, TensorSpec, partition
from ..ps.client import Pending, PSClient
from ..ps.placement import Placement, balanced
from ..ps.protocol import Kind
from ..ps.store import Declaration
from ..runtime import Context

__all__ = ["WaveSync", "PARTITION_BYTES"]

log = logging.getLogger(__name__)

PARTITION_BYTES = 4_096_000  # BytePS's default partition size


class WaveSync:
    """One stage's parameters on the servers, and its clock.

    Example::

        wsp = WaveSync(ctx, model_specs, mine={"h0.ln1.weight": 2, ...}, tensors=params,
                       virtual_workers=2, staleness=1)
        wsp.start(initialise=(vw == 0))
        wsp.push(updates); wsp.pull()      # end of a wave: clock += 1, pull posted
        wsp.install(params, since_push)    # before the next forward: global + own newer

    Args:
        ctx: the run.
        specs: every parameter tensor of the whole model, in model order.
        mine: index in ``specs`` -> index in ``tensors`` of the tensors this stage holds.
        tensors: this stage's live parameters.
        virtual_workers: how many push every key (one stage per virtual worker).
        staleness: D, the most clocks a virtual worker may run ahead of the slowest.
    """

    def __init__(self, ctx: Context, specs: Sequence[TensorSpec], mine: dict[int, int],
                 tensors: Sequence[torch.Tensor], *, virtual_workers: int,
                 staleness: int) -> None:
        self.ctx = ctx
        self.client: PSClient = ctx.ps_client
        self.staleness = staleness
        self.virtual_workers = virtual_workers
        self.tensors = list(tensors)
        parts = partition(list(specs), PARTITION_BYTES)
        self.placement: Placement = balanced(parts, ctx.topology.servers)
        self.mine = [(i, p) for i, p in enumerate(parts) if p.tensor in mine]
        self._local = {p.tensor: mine[p.tensor] for _, p in self.mine}
        self.pulled = [torch.empty_like(t, device="cpu") for t in self.tensors]
        self.clock = 0
        self._pull: Pending | None = None
        self._pushes: Pending | None = None

    def _slice(self, tensors: Sequence[torch.Tensor], p: Partition) -> torch.Tensor:
        flat = tensors[self._local[p.tensor]].detach().reshape(-1)
        return flat[p.offset:p.offset + p.numel]

    def start(self, *, initialise: bool) -> None:
        """Declare this stage's keys; the first virtual worker writes the initial weights.

        Ends with a barrier of all workers, so nobody pushes before the weights are set.
        """
        for i, p in self.mine:
            decl = Declaration(key=p.key, kind=int(Kind.PARAM), name=p.label, numel=p.numel,
                               dtype=str(p.dtype), pushers=self.virtual_workers,
                               pullers=self.virtual_workers,
                               options={"staleness": self.staleness})
            self.client.declare(decl, self.placement.owners[i])
        if initialise:
            cpu = [t.detach().cpu() for t in self.tensors]
            for i, p in self.mine:
                self.client.set(self.placement.owners[i], key=p.key,
                                tensor=self._slice(cpu, p)).wait()
            # A GET is answered after the SET before it (same key, same server thread).
            for i, p in self.mine:
                self.client.get(self.placement.owners[i], key=p.key,
                                out=self._slice(self.pulled, p)).wait()
        dist.barrier(group=self.ctx.groups.workers)

    def push(self, updates: Sequence[torch.Tensor]) -> None:
        """End a wave: push its summed update; this stage's clock advances by one."""
        if self._pull is not None:
            # A pull older than this push was never installed: it is superseded.
            self._pull.wait()
            self._pull = None
        if self._pushes is not None:
            self._pushes.wait()
        # A copy: the caller reuses its buffers while the sends are in flight.
        cpu = [u.detach().to("cpu", copy=True) for u in updates]
        self.clock += 1
        self._pushes = Pending.all([
            self.client.push(self.placement.owners[i], key=p.key, round=self.clock,
                             tensor=self._slice(cpu, p)) for i, p in self.mine])

    def pull(self, *, ahead: int = 0, final: bool = False) -> None:
        """Post the pull of the global weights (answered later, see :meth:`install`).

        The servers answer the pull of round ``clock + ahead`` once every virtual
        worker has pushed ``clock + ahead - D`` waves; a ``final`` pull waits for
        ``clock`` waves from everyone (their last).
        """
        if self._pull is not None:
            self._pull.wait()
        if ahead > self.staleness:
            raise ValueError(f"a pull {ahead} clocks ahead would wait for this stage's own "
                             f"future pushes (D = {self.staleness})")
        rnd = self.clock + (self.staleness if final else ahead)
        self._pull = Pending.all([
            self.client.pull(self.placement.owners[i], key=p.key, round=rnd,
                             out=self._slice(self.pulled, p)) for i, p in self.mine])

    @property
    def pending(self) -> bool:
        return self._pull is not None

    @torch.no_grad()
    def install(self, params: Sequence[torch.Tensor], since_push: Sequence[torch.Tensor]) -> None:
        """Wait for the pull; the weights become the global ones plus this stage's newer updates."""
        assert self._pull is not None
        if self._pushes is not None:
            self._pushes.wait()
        self._pull.wait()
        self._pull = None
        for p, g, own in zip(params, self.pulled, since_push):
            p.copy_(g.to(p.device))
            p.add_(own)
