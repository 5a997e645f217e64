"""BytePS's worker side: reduce inside the machine, push and pull each share once, share it back.

For every partition one worker of each machine is its *handler* (the plan
spreads partitions over a machine's workers by bytes, a reduce-scatter). A
partition's life in one round, on a machine with workers a (handler) and b:

    b: gradient ready --isend--> a          b: irecv(sum) posted at the same time
    a: gradient ready -> queue (priority = layer order, credit bounds bytes in flight)
    a: scheduler: wait b's piece, add (local rank order), push_pull to the owner server
    a: the push has left -> its credit comes back
    a: completer: sum arrives -> isend to b

All local messages are tagged per (key, round), so they match whatever order
gradients become ready in; the only blocking waits live in two threads per
worker (scheduler, send drain, completer) and in :meth:`SumEngine.wait`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...comm.p2p import Handle
from ...comm.partition import Partition, TensorSpec
from ...errors import CommError, CommTimeout, ConfigError
from ...ps.protocol import Kind, Op
from ...ps.store import Declaration
from ...runtime import Context
from .plan import Plan, plan_placement
from .scheduler import CreditQueue

__all__ = ["SumEngine", "SumTensor", "engine_for", "allocate_keys", "next_key", "server_ranks"]

log = logging.getLogger(__name__)

_WAKE_S = 0.05
# Local messages use channel 3 of the service's tag space (requests use 0-2), so they never
# match a request or an answer. Four rounds of a key may be in flight between two workers.
_LOCAL_CHANNEL = 3


def _local_tag(key: int, round_: int) -> int:
    return (key * 4 + round_ % 4 + 1) * 4 + _LOCAL_CHANNEL


_next_key: weakref.WeakKeyDictionary[Context, int] = weakref.WeakKeyDictionary()
_engines: weakref.WeakKeyDictionary[Context, SumEngine] = weakref.WeakKeyDictionary()


def next_key(ctx: Context) -> int:
    """The first service key nobody has taken in this run."""
    return _next_key.get(ctx, 0)


def allocate_keys(ctx: Context, count: int) -> int:
    """Take ``count`` fresh service keys; every worker takes them in the same order."""
    first = next_key(ctx)
    _next_key[ctx] = first + count
    return first


def server_ranks(ctx: Context, *, colocate: bool) -> tuple[list[int], list[int]]:
    """(one colocated server per worker machine, or none; the dedicated CPU servers)."""
    topo = ctx.topology
    per_machine = [topo.servers_on(m) for m in topo.worker_machines]
    colocated = [s[0] for s in per_machine if s] if colocate else []
    if colocated and len(colocated) != len(per_machine):
        missing = [m for m, s in zip(topo.worker_machines, per_machine) if not s]
        raise ConfigError(f"byteps needs a colocated server on every worker machine or on "
                          f"none; machines {missing} have none",
                          "launch with --colocated 1 (polytrain train does this itself)")
    dedicated = list(topo.dedicated_servers)
    if not colocated and not dedicated:
        raise ConfigError("byteps needs summation servers, but this run has none",
                          "launch with --colocated 1 and/or --servers K (polytrain train "
                          "starts colocated servers itself)")
    return colocated, dedicated


@dataclass
class _Part:
    part: Partition
    owner: int
    handler: int  # the rank on this machine that reduces and pushes this partition
    tensor: SumTensor


@dataclass
class _Task:
    """One partition of one round, on its handler."""

    part: _Part
    round: int
    own: torch.Tensor  # this worker's piece, (numel,) on CPU
    contributions: list[tuple[int, torch.Tensor, Handle]]  # (rank, buffer, receive)
    out: torch.Tensor  # where the sum lands: a slice of the tensor's result


@dataclass(eq=False)
class SumTensor:
    """A declared tensor: its partitions and the state of its current round."""

    name: str
    spec: TensorSpec
    parts: list[_Part] = field(default_factory=list)
    round: int = 0
    result: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    busy: bool = False
    pending: int = 0  # this worker's handler partitions not yet summed in this round
    done: threading.Event = field(default_factory=threading.Event)
    recvs: list[Handle] = field(default_factory=list)
    sends: list[Handle] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # buffers in flight


class SumEngine:
    """Synchronous sums of declared tensors over all workers, through the summation service.

    Example::

        engine = engine_for(ctx)
        [t] = engine.declare([TensorSpec.of("g", g)])
        engine.submit(t, g)          # returns at once; the sum moves in the background
        total = engine.wait(t)       # (numel,) on CPU: the sum over every worker

    Args:
        ctx: the run. partition_bytes: largest partition (BytePS's default 4,096,000).
        colocate: place a share on the servers of the worker machines (False: classic PS).
        credit_bytes: bytes handed to the network and not yet sent, at most (0: no bound).
    """

    def __init__(self, ctx: Context, *, partition_bytes: int = 4_096_000, colocate: bool = True,
                 credit_bytes: int = 8_192_000) -> None:
        self.ctx = ctx
        self.partition_bytes = partition_bytes
        self.credit_bytes = credit_bytes
        self.colocated, self.dedicated = server_ranks(ctx, colocate=colocate)
        self.colocate = colocate  # as asked; the plan colocates only if servers are there
        self.local = ctx.local_workers
        self.me = ctx.rank
        self.queue: CreditQueue[_Task] = CreditQueue(credit_bytes)
        self.sent: queue.Queue[tuple[_Task, list[Handle], torch.Tensor] | None] = queue.Queue()
        self.answers: queue.Queue[tuple[_Task, Handle] | None] = queue.Queue()
        self.tensors: list[SumTensor] = []
        self.error: BaseException | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True, name=name)
                         for fn, name in ((self._schedule, "polytrain-byteps-schedule"),
                                          (self._drain_sends, "polytrain-byteps-sent"),
                                          (self._complete, "polytrain-byteps-complete"))]
        for t in self._threads:
            t.start()

    # -- declaring ---------------------------------------------------------------------------

    def plan(self, specs: Sequence[TensorSpec]) -> Plan:
        """Theorem 1's placement of ``specs`` on this run's servers, with fresh keys."""
        plan = plan_placement(specs, partition_bytes=self.partition_bytes,
                              machines=self.ctx.num_nodes, colocated=self.colocated,
                              dedicated=self.dedicated, colocate=bool(self.colocated),
                              local_workers=len(self.local), first_key=next_key(self.ctx))
        allocate_keys(self.ctx, len(plan.placement.partitions))
        return plan

    def declare(self, specs: Sequence[TensorSpec]) -> list[SumTensor]:
        """Declare tensors (in the same order on every worker); servers check they agree."""
        plan = self.plan(specs)
        tensors = [SumTensor(s.name, s, result=torch.empty(s.numel, dtype=s.dtype))
                   for s in specs]
        for p, owner, h in zip(plan.placement.partitions, plan.placement.owners, plan.handlers):
            t = tensors[p.tensor]
            t.parts.append(_Part(p, owner, self.local[h], t))
            shape = "x".join(map(str, t.spec.shape)) or "scalar"
            decl = Declaration(key=p.key, kind=int(Kind.SUM), name=f"{p.label} of {shape}",
                               numel=p.numel, dtype=str(p.dtype), pushers=self.ctx.num_nodes,
                               pullers=self.ctx.num_nodes)
            self.ctx.ps_client.declare(decl, owner)
        if self.ctx.worker_index == 0:
            log.info("byteps placement of %d tensors:\n%s", len(specs), plan.describe())
        self.tensors += tensors
        return tensors

    # -- one round -------------------------------------------------------------------------

    def submit(self, t: SumTensor, tensor: torch.Tensor) -> None:
        """Start summing ``tensor`` (shaped as declared) over the workers; returns at once."""
        self._raise()
        if t.busy:
            raise ConfigError(f"{t.name!r} was submitted again before its last sum was waited "
                              f"for", "call wait() (or optimizer.step()) between rounds")
        if tuple(tensor.shape) != t.spec.shape or tensor.dtype != t.spec.dtype:
            raise ConfigError(f"{t.name!r} was declared {list(t.spec.shape)} {t.spec.dtype} but "
                              f"got {list(tensor.shape)} {tensor.dtype}",
                              "use a new name for a tensor of another shape")
        flat = tensor.detach().reshape(-1).to("cpu")  # gloo moves CPU memory
        rnd = t.round
        t.round += 1
        t.busy = True
        t.recvs, t.sends, t.keep = [], [], [flat]
        mine = [p for p in t.parts if p.handler == self.me]
        t.pending = len(mine)
        t.done.clear()
        transport = self.ctx.transport
        for p in t.parts:
            lo, n = p.part.offset, p.part.numel
            piece, out = flat[lo:lo + n], t.result[lo:lo + n]
            tag = _local_tag(p.part.key, rnd)
            if p.handler == self.me:
                contributions = []
                for peer in self.local:
                    if peer != self.me:
                        buf = torch.empty(n, dtype=piece.dtype)
                        contributions.append((peer, buf, transport.irecv(
                            buf, peer, tag, f"local piece of {p.part.label}")))
                self.queue.put(p.part.key, p.part.nbytes, _Task(p, rnd, piece, contributions, out))
            else:
                recv = transport.irecv(out, p.handler, tag, f"local sum of {p.part.label}")
                send = transport.isend(piece, p.handler, tag, f"local piece of {p.part.label}")
                with self._lock:  # the completer adds its sends to the same list
                    t.recvs.append(recv)
                    t.sends.append(send)
        if not mine:
            t.done.set()

    def wait(self, t: SumTensor) -> torch.Tensor:
        """The sum over every worker of the last submitted round, flat on CPU."""
        if not t.busy:
            raise ConfigError(f"{t.name!r} has no sum in flight", "submit() it first")
        deadline = time.monotonic() + self.ctx.timeout_s
        while not t.done.wait(_WAKE_S):
            self._raise()
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {self.me}: the sum of {t.name!r} did not arrive within "
                                  f"{self.ctx.timeout_s:g} s", "if the servers and workers are "
                                  "alive but slow, raise the timeout (--timeout)")
        self._raise()
        for h in t.recvs + t.sends:
            h.wait()
        t.busy = False
        t.keep = []
        return t.result

    def close(self) -> None:
        """Stop the threads (the servers stay for the context's shutdown)."""
        if self.closed:
            return
        self.closed = True
        self.queue.close()
        self.sent.put(None)
        self.answers.put(None)
        for t in self._threads:
            t.join(timeout=1.0)
        if _engines.get(self.ctx) is self:
            del _engines[self.ctx]

    # -- the threads -------------------------------------------------------------------------

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            if self.error is None:
                self.error = e if isinstance(e, CommError) else CommError(
                    f"rank {self.me}: byteps {fn.__name__.strip('_')} thread failed: "
                    f"{type(e).__name__}: {e}")
            self.queue.close()
            for t in self.tensors:
                t.done.set()

    def _schedule(self) -> None:
        client = self.ctx.ps_client
        while (task := self.queue.take()) is not None:
            own = task.own
            if task.contributions:
                pieces = {self.me: own}
                for peer, buf, handle in task.contributions:
                    handle.wait()
                    pieces[peer] = buf
                ordered = [pieces[r] for r in sorted(pieces)]  # local rank order: deterministic
                own = ordered[0].clone()
                for x in ordered[1:]:
                    own.add_(x)
            part = task.part.part
            answer, *sends = client.request(task.part.owner, Op.PUSHPULL, key=part.key,
                                            round=task.round, payload=own, answer=task.out,
                                            what=f"push_pull of {part.label}")
            self.sent.put((task, sends, own))
            self.answers.put((task, answer))

    def _drain_sends(self) -> None:
        # Credit comes back when a push has left, not when its sum is back: the sum waits
        # for the other machines' pushes, which may wait for credit themselves (a deadlock).
        while (item := self.sent.get()) is not None:
            task, sends, _ = item
            for h in sends:
                h.wait()
            self.queue.release(task.part.part.nbytes)

    def _complete(self) -> None:
        transport = self.ctx.transport
        while (item := self.answers.get()) is not None:
            task, answer = item
            answer.wait()
            t = task.part.tensor
            tag = _local_tag(task.part.part.key, task.round)
            sends = [transport.isend(task.out, peer, tag, f"local sum of {task.part.part.label}")
                     for peer in self.local if peer != self.me]
            with self._lock:
                t.sends += sends
                t.pending -= 1
                if t.pending == 0:
                    t.done.set()


def engine_for(ctx: Context, **options: Any) -> SumEngine:
    """This run's engine with ``options`` (made on first use, again if the options change).

    Keys come from one counter per run, so engines never share a service key.
    """
    engine = _engines.get(ctx)
    if engine is not None and not engine.closed and all(
            getattr(engine, k) == v for k, v in options.items()):
        return engine
    engine = SumEngine(ctx, **options)
    _engines[ctx] = engine
    return engine
