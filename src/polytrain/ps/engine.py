"""The worker side of the service: one engine for every strategy that pushes and pulls.

A caller brings a placement plan (plain data, :class:`~polytrain.ps.placement.Placement`:
which server owns which byte range of which tensor); the engine gives its
partitions fresh keys from the run's :class:`~polytrain.ps.keys.KeySpace`,
checks it against the tensors and the run, declares the keys on their owners,
and then moves the data:

- synchronous sums (``sums``, ``submit``, ``wait``): reduce inside the machine,
  push and pull each partition once per machine, share the sum back, with
  priorities (earlier layers first) and a credit bound. BytePS, its
  ``push_pull`` and Herring use them.
- plain requests on any store kind (``declare``, ``push``, ``pull``, ``set``,
  ``get``): BytePS's asynchronous mode and HetPipe's WSP use them.

For every partition one worker of each machine is its *handler* (the plan,
or by default an even spread by bytes: a reduce-scatter). A partition's life
in one round of a sum, on a machine with workers a (handler) and b:

    b: gradient ready --isend--> a          b: irecv(sum) posted at the same time
    a: gradient ready -> queue (priority = layer order; a credit per server bounds bytes
       in flight to it)
    a: scheduler: wait b's piece, add (local rank order), push_pull to the owner server
    a: the server holds the push (its receipt) -> its credit comes back
    a: completer: sum arrives -> isend to b

Local messages are tagged per (key, round) on their own channel
(:mod:`polytrain.comm.tags`), so they match whatever order gradients become
ready in; the only blocking waits live in four threads per worker
(scheduler, send drain, completer, and a watcher of the rounds that
:meth:`Engine.ready` was asked about) and in :meth:`Engine.wait`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..comm import tags
from ..comm.p2p import Handle
from ..comm.partition import Partition, TensorSpec
from ..errors import CommError, CommTimeout, ConfigError, kept_error, left_run
from ..tensors import sum_dtype
from .client import Pending
from .compression import Codec, CompressOptions, codec_states_fit
from .credit import CreditQueue
from .placement import Placement, spread_handlers
from .protocol import DTYPES, Kind, Op
from .stores import WHOLE_STATE, Declaration

if TYPE_CHECKING:
    from ..runtime import Context

__all__ = ["Engine", "SumTensor", "engine_for", "forget_if_alive", "DEFAULT_CREDIT_BYTES"]

log = logging.getLogger(__name__)

_WAKE_S = 0.05
#: Bytes pushed to one server and not yet held by it, at most, by default: one partition
#: at a time per server (a larger one goes alone), so a server's partitions arrive one after
#: another and its answers start early, while every server's link stays busy.
DEFAULT_CREDIT_BYTES = 1_024_000


def _local_tag(key: int, round_: int) -> int:
    # Four rounds of a key may be in flight between two workers.
    return tags.tag(tags.LOCAL_REDUCE, key * 4 + round_ % 4)


#: Each run's engines, one per credit bound (a script's own calls and a strategy with
#: another ``--credit-bytes`` each keep theirs).
_engines: weakref.WeakKeyDictionary[Context, dict[int, Engine]] = weakref.WeakKeyDictionary()


@dataclass
class _Part:
    part: Partition
    owner: int
    handler: int  # the rank on this machine that reduces and pushes this partition
    tensor: SumTensor
    peers: tuple[int, ...]  # the other ranks that hand the handler their piece
    codec: Codec | None = None  # on the handler: this partition's compression (None: plain)


@dataclass
class _Task:
    """One partition of one round, on its handler."""

    part: _Part
    round: int
    own: torch.Tensor  # this worker's piece, (numel,) on CPU
    contributions: list[tuple[int, torch.Tensor, Handle]]  # (rank, buffer, receive)
    out: torch.Tensor  # where the sum lands: a slice of the tensor's result
    packed: torch.Tensor | None = None  # the compressed sum's answer, decoded into ``out``


@dataclass(eq=False)
class SumTensor:
    """A declared tensor: its partitions and the state of its current round."""

    name: str
    spec: TensorSpec
    parts: list[_Part] = field(default_factory=list)
    round: int = 0
    result: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    busy: bool = False
    # This worker's handler partitions not yet summed in this round, by key (a timeout
    # names their owners).
    unanswered: dict[int, _Part] = field(default_factory=dict)
    # Set when this worker's handler partitions are summed: the others' sums may still be
    # on their way from their handlers (``recvs``).
    done: threading.Event = field(default_factory=threading.Event)
    # With :meth:`Engine.ready` asked this round: the watcher thread waits for every
    # message of the round and sets ``arrived``; :meth:`Engine.wait` waits for that.
    watched: bool = False
    arrived: threading.Event = field(default_factory=threading.Event)
    recvs: list[Handle] = field(default_factory=list)
    sends: list[Handle] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # buffers in flight


class Engine:
    """The worker side of the summation / parameter service for one run.

    Example::

        engine = engine_for(ctx)
        placement = Placement(partition([spec], 4096), owners)   # the caller's plan
        [t] = engine.sums([spec], placement)
        engine.submit(t, g)          # returns at once; the sum moves in the background
        total = engine.wait(t)       # (numel,) on CPU: the sum over every worker

    Args:
        ctx: the run.
        credit_bytes: bytes pushed to one server and not yet held by it, at most (0: no
            bound); every server has its own window (:class:`~polytrain.ps.credit.CreditQueue`).
    """

    def __init__(self, ctx: Context, *, credit_bytes: int = DEFAULT_CREDIT_BYTES) -> None:
        self.ctx = ctx
        self.credit_bytes = credit_bytes
        self.client = ctx.ps_client
        self.local = ctx.local_workers
        self.me = ctx.rank
        self.queue: CreditQueue[_Task] = CreditQueue(credit_bytes)
        self.sent: queue.Queue[tuple[_Task, list[Handle], torch.Tensor] | None] = queue.Queue()
        self.answers: queue.Queue[tuple[_Task, Handle] | None] = queue.Queue()
        self.watching: queue.Queue[SumTensor | None] = queue.Queue()
        self.tensors: list[SumTensor] = []
        self._closed: set[int] = set()  # ids of tensors forgotten, listed until the next sums()
        self.error: BaseException | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._awaiting: _Task | None = None  # whose answer the completer waits for now

    # -- placements and keys -------------------------------------------------------------------

    def keyed(self, specs: Sequence[TensorSpec], placement: Placement, *,
              first_key: int | None = None) -> Placement:
        """``placement`` checked against ``specs`` and the run, with fresh service keys
        (or keys from ``first_key`` on, in a range the caller took from ``ctx.keys``).

        Raises ConfigError, with the values, for a byte range past a tensor's end,
        an owner that is not a server, a handler that is not a local worker:
        before any key is declared, so no worker waits on a bad plan.
        """
        placement.check(specs, self.ctx.topology.servers, local_workers=len(self.local))
        if first_key is None:
            first_key = self.ctx.keys.take(len(placement.partitions))
        return placement.renumbered(first_key)

    def declare(self, placement: Placement, *, kind: int, pushers: int, pullers: int,
                options: dict[str, Any] | None = None, only: Sequence[int] | None = None,
                name: Callable[[Partition], str] | None = None) -> None:
        """Declare the placement's keys (or those of indices ``only``) on their owners.

        Every worker that uses a key declares it the same way; the owner refuses
        (ConfigError) a declaration that differs from the first one.
        """
        for i in range(len(placement.partitions)) if only is None else only:
            p = placement.partitions[i]
            self.client.declare(Declaration(
                key=p.key, kind=int(kind), name=name(p) if name else p.label, numel=p.numel,
                dtype=str(p.dtype), pushers=pushers, pullers=pullers,
                options=dict(options or {})), placement.owners[i])

    def free(self, placement: Placement) -> None:
        """Forget the placement's keys on their owners (see :meth:`PSClient.free`); one
        worker calls it, once every worker is done with them."""
        for p in [self.client.free(q.key, owner)
                  for q, owner in zip(placement.partitions, placement.owners)]:
            p.wait()

    def push(self, placement: Placement, i: int, *, round: int, tensor: torch.Tensor,
             lane: int = 0) -> Pending:
        """Push partition ``i``'s ``tensor`` for ``round`` (``lane``: which pusher of this
        process, default 0)."""
        p = placement.partitions[i]
        return self.client.push(placement.owners[i], key=p.key, round=round, tensor=tensor,
                                lane=lane)

    def pull(self, placement: Placement, i: int, *, round: int, out: torch.Tensor) -> Pending:
        """Pull partition ``i``'s value of ``round`` into ``out`` (its size: see the store)."""
        p = placement.partitions[i]
        return self.client.pull(placement.owners[i], key=p.key, round=round, out=out)

    def set(self, placement: Placement, i: int, tensor: torch.Tensor) -> Pending:
        """Replace partition ``i``'s value on a parameter or optimizer store."""
        return self.client.set(placement.owners[i], key=placement.partitions[i].key,
                               tensor=tensor)

    def get(self, placement: Placement, i: int, out: torch.Tensor, *, round: int = 0) -> Pending:
        """Read partition ``i``'s current value, without waiting on clocks (``round``: see
        :meth:`PSClient.get`)."""
        return self.client.get(placement.owners[i], key=placement.partitions[i].key, out=out,
                               round=round)

    # -- synchronous sums ----------------------------------------------------------------------

    def sums(self, specs: Sequence[TensorSpec], placement: Placement, *,
             local_reduce: bool = True, describe: str = "",
             first_key: int | None = None,
             compression: Sequence[CompressOptions | None] | None = None) -> list[SumTensor]:
        """Declare tensors to sum over every worker (same order on every worker).

        ``placement`` partitions ``specs`` (keys are renumbered: see :meth:`keyed`).
        With ``local_reduce`` each machine pushes each partition once, after its
        workers' reduce inside the machine; without, every worker pushes its own.
        ``compression[i]``, when given, compresses tensor i's partitions between the
        handler and the servers (the reduce inside the machine stays exact), with the
        handler's own error feedback; the servers' compressed sum stores answer packed sums.
        """
        for s in specs:
            if s.dtype not in DTYPES:
                raise ConfigError(f"{s.name!r} is {s.dtype}, which the summation service does "
                                  f"not carry", "pass a tensor of one of: " + ", ".join(
                                      str(d).removeprefix("torch.") for d in DTYPES)
                                  + " (a complex one as torch.view_as_real(t))")
        placement = self.keyed(specs, placement, first_key=first_key)
        handlers = placement.handlers or spread_handlers(placement.partitions, len(self.local))
        tensors = [SumTensor(s.name, s, result=torch.empty(s.numel, dtype=s.dtype))
                   for s in specs]
        for p, owner, h in zip(placement.partitions, placement.owners, handlers):
            handler = self.local[h] if local_reduce else self.me
            peers = tuple(r for r in self.local if r != handler) if local_reduce else ()
            packing = compression[p.tensor] if compression else None
            codec = Codec(packing, p.numel, seed=p.key, stream=handler,
                          segments=packing.segments(p.offset, p.numel)) if packing else None
            tensors[p.tensor].parts.append(_Part(p, owner, handler, tensors[p.tensor], peers,
                                                 codec))

        def label(p: Partition) -> str:
            shape = "x".join(map(str, specs[p.tensor].shape)) or "scalar"
            return f"{p.label} of {shape}"
        pushers = self.ctx.num_nodes if local_reduce else self.ctx.num_workers
        packed = [i for i, p in enumerate(placement.partitions)
                  if compression and compression[p.tensor]]
        plain = sorted(set(range(len(placement.partitions))) - set(packed))
        self.declare(placement, kind=Kind.SUM, pushers=pushers, pullers=pushers, name=label,
                     only=plain)
        if packed:
            self._declare_packed(placement, packed, compression or (), pushers, label)
        if describe and self.ctx.worker_index == 0:
            log.info("%s of %d tensors:\n%s", describe, len(specs), placement.describe())
        self._start()
        # The sums closed before (a model closed and wrapped again) go now, and their results
        # with their last user; not at their close, which a save of their codecs may follow.
        # A new list: the threads' error path may be reading the old one.
        self.tensors = [t for t in self.tensors if id(t) not in self._closed] + tensors
        self._closed = set()
        return tensors

    def forget(self, tensors: Sequence[SumTensor]) -> None:
        """Stop listing ``tensors`` (a closed caller's: none in flight) at the next
        :meth:`sums`. Their keys stay declared on the owners: :meth:`free` needs every
        worker done with them, a point their closer does not know."""
        self._closed |= {id(t) for t in tensors}

    def _declare_packed(self, placement: Placement, indices: Sequence[int],
                        compression: Sequence[CompressOptions | None], pushers: int,
                        label: Callable[[Partition], str]) -> None:
        """Declare compressed partitions: uint8 payloads whose size the codec fixes."""
        for i in indices:
            p = placement.partitions[i]
            packing = compression[p.tensor]
            assert packing is not None
            segments = packing.segments(p.offset, p.numel)
            self.client.declare(Declaration(
                key=p.key, kind=int(Kind.COMPRESSED), name=f"{label(p)}, {packing.compressor}",
                numel=packing.compressor.nbytes(p.numel, segments), dtype=str(torch.uint8),
                pushers=pushers, pullers=pushers,
                options=packing.declaration(p.numel, segments)),
                placement.owners[i])

    # -- what compressed sums carry across steps (checkpoints) ---------------------------------

    def _packed(self) -> list[tuple[_Part, Codec]]:
        return [(p, p.codec) for t in self.tensors for p in t.parts if p.codec is not None]

    def codec_states(self) -> dict[int, torch.Tensor]:
        """By key, the state of the codecs this worker compresses with (its machine's
        partitions it pushes: error feedback, momentum, random draws); between rounds."""
        return {p.part.key: c.state() for p, c in self._packed() if p.handler == self.me}

    def server_codec_states(self) -> dict[int, torch.Tensor]:
        """By key, the servers' codec state of every compressed partition (their error
        feedback and draws), read at once: one worker calls it, when every round is done."""
        parts = self._packed()
        outs = {p.part.key: torch.empty(Codec.state_bytes(c.numel), dtype=torch.uint8)
                for p, c in parts}
        Pending.all([self.client.get(p.owner, key=p.part.key, out=outs[p.part.key],
                                     round=WHOLE_STATE) for p, _ in parts]).wait()
        return outs

    def codecs_fit(self, mine: dict[int, torch.Tensor],
                   servers: dict[int, torch.Tensor] | None = None) -> bool:
        """Whether :meth:`codec_states` (and :meth:`server_codec_states`) of a run fit this
        one's partitions: the same keys, of the same sizes (a server's codec has its
        partition's size, as the handler's has)."""
        parts = self._packed()
        return (codec_states_fit(mine, {p.part.key: c for p, c in parts if p.handler == self.me})
                and (servers is None
                     or codec_states_fit(servers, {p.part.key: c for p, c in parts})))

    def restore_codecs(self, mine: dict[int, torch.Tensor],
                       servers: dict[int, torch.Tensor] | None = None) -> None:
        """Carry on from :meth:`codec_states` (and, from one worker, :meth:`server_codec_states`:
        set on the servers and waited for, so a barrier after it orders every worker's
        pushes after them), that :meth:`codecs_fit`; before the first round."""
        parts = self._packed()
        for p, c in parts:
            if p.handler == self.me:
                c.load_state(mine[p.part.key])
        if servers is not None:
            Pending.all([self.client.set(p.owner, key=p.part.key, tensor=servers[p.part.key])
                         for p, _ in parts]).wait()

    def _start(self) -> None:
        if self._threads:
            return
        self._threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True, name=name)
                         for fn, name in ((self._schedule, "polytrain-engine-schedule"),
                                          (self._drain_sends, "polytrain-engine-sent"),
                                          (self._complete, "polytrain-engine-complete"),
                                          (self._watch, "polytrain-engine-watch"))]
        for t in self._threads:
            t.start()

    # -- one round -------------------------------------------------------------------------

    def submit(self, t: SumTensor, tensor: torch.Tensor, priority: int = 0) -> None:
        """Start summing ``tensor`` (shaped as declared) over the workers; returns at once.

        Its partitions queue by ``priority`` (BytePS's: a larger one goes first; it must be
        the same on every worker), then by key (earlier layers first)."""
        if self.ctx.closed:  # its groups are gone: a send failed as a lost peer
            raise left_run(f"{t.name!r} was submitted")
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
        t.unanswered = {p.part.key: p for p in mine}
        t.done.clear()
        t.watched = False
        t.arrived.clear()
        transport = self.ctx.transport
        for p in t.parts:
            lo, n = p.part.offset, p.part.numel
            piece, out = flat[lo:lo + n], t.result[lo:lo + n]
            tag = _local_tag(p.part.key, rnd)
            if p.handler == self.me:
                contributions = []
                for peer in p.peers:
                    buf = torch.empty(n, dtype=piece.dtype)
                    contributions.append((peer, buf, transport.irecv(
                        buf, peer, tag, f"local piece of {p.part.label}")))
                self.queue.put((-priority, p.part.key), p.part.nbytes,
                               _Task(p, rnd, piece, contributions, out), lane=p.owner)
            else:
                recv = transport.irecv(out, p.handler, tag, f"local sum of {p.part.label}")
                send = transport.isend(piece, p.handler, tag, f"local piece of {p.part.label}")
                with self._lock:  # the completer adds its sends to the same list
                    t.recvs.append(recv)
                    t.sends.append(send)
        if not mine:
            t.done.set()

    def ready(self, t: SumTensor) -> bool:
        """Whether :meth:`wait` would return at once: every partition's sum is here, and
        every message of the round has moved. Never blocks.

        gloo cannot tell whether a message has arrived without waiting for it, so the first
        call of a round hands the round's messages to the watcher thread, which waits for
        them (a round never asked about is waited for by :meth:`wait` itself)."""
        if not t.busy or self.error is not None:
            return True  # wait() returns the sum, or raises the error, at once
        if t.done.is_set() and not t.recvs and not t.sends:  # (the completer's are in)
            return True  # no peer on this machine: nothing left to move
        if not t.watched:
            t.watched = True
            self.watching.put(t)
        return t.arrived.is_set()

    def wait(self, t: SumTensor) -> torch.Tensor:
        """The sum over every worker of the last submitted round, flat on CPU."""
        if not t.busy:
            raise ConfigError(f"{t.name!r} has no sum in flight", "submit() it first")
        self._wait_for(t.arrived if t.watched else t.done, t)
        if not t.watched:  # the watcher waited for them, and a handle is waited for once
            for h in t.recvs + t.sends:
                h.wait()
        t.busy = False
        t.keep = []
        return t.result

    def _wait_for(self, event: threading.Event, t: SumTensor) -> None:
        deadline = time.monotonic() + self.ctx.timeout_s
        while not event.wait(_WAKE_S):
            self._raise()
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {self.me}: the sum of {t.name!r} did not arrive within "
                                  f"{self.ctx.timeout_s:g} s, waiting for {self._missing(t)}",
                                  "if that process is alive but slow, raise the timeout "
                                  "(--timeout); a server's report (the launcher's, or its "
                                  "log) says why it held its answers",
                                  waited_s=self.ctx.timeout_s)
        self._raise()

    def _missing(self, t: SumTensor) -> str:
        """Who ``t``'s round still waits for: the server whose answer the completer waits
        for (it takes them in push order, so the others wait behind it), else the owners of
        the partitions not pushed yet, else the workers of this machine that sum the rest."""
        name = self.ctx.topology.name
        with self._lock:
            unanswered = list(t.unanswered.values())
        task = self._awaiting
        if unanswered and task is not None:
            p = task.part.part
            behind = len(unanswered) - (p.key in t.unanswered)
            return (f"{name(task.part.owner)}: its answer for key {p.key} ({p.label!r}) has "
                    f"not come back" + (f", and {behind} more of this sum's partitions wait "
                                        f"behind it" if behind else ""))
        if unanswered:
            keys: dict[int, list[int]] = {}
            for q in unanswered:
                keys.setdefault(q.owner, []).append(q.part.key)
            return "; ".join(f"{name(owner)}, the owner of key{'s' if len(k) > 1 else ''} "
                             f"{', '.join(map(str, sorted(k)))} (not pushed yet)"
                             for owner, k in sorted(keys.items()))
        handlers = sorted({q.handler for q in t.parts if q.handler != self.me})
        return "the sums of this machine's other partitions, from " + ", ".join(map(name,
                                                                                  handlers))

    def close(self) -> None:
        """Stop the threads (the servers stay for the context's shutdown)."""
        if self.closed:
            return
        self.closed = True
        self.queue.close()
        self.sent.put(None)
        self.answers.put(None)
        self.watching.put(None)
        for t in self._threads:
            t.join(timeout=1.0)
        mine = _engines.get(self.ctx, {})
        if mine.get(self.credit_bytes) is self:
            del mine[self.credit_bytes]

    # -- the threads -------------------------------------------------------------------------

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            self.error = kept_error(self.error, e if isinstance(e, CommError) else CommError(
                f"rank {self.me}: engine {fn.__name__.strip('_')} thread failed: "
                f"{type(e).__name__}: {e}"))
            self.queue.close()
            for t in self.tensors:
                t.done.set()
                t.arrived.set()

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
                # In the servers' sum dtype: where the sum is taken must not change it
                # (16-bit partial sums lost bits; integers stay exact).
                acc = sum_dtype(ordered[0].dtype)
                total = ordered[0].to(acc, copy=True)
                for x in ordered[1:]:
                    total.add_(x)
                own = total.to(ordered[0].dtype)
            part, codec = task.part.part, task.part.codec
            if codec is not None:  # compress the machine's sum; the answer is packed too
                own = codec.encode(own)
                task.packed = torch.empty(codec.nbytes, dtype=torch.uint8)
            answer, receipt, *sends = client.request(task.part.owner, Op.PUSHPULL, key=part.key,
                                            round=task.round, payload=own,
                                            answer=task.out if task.packed is None
                                            else task.packed,
                                            what=f"push_pull of {part.label}")
            self.sent.put((task, [*sends, receipt], own))
            self.answers.put((task, answer))

    def _drain_sends(self) -> None:
        # Credit comes back when the server holds a push (its receipt), not when its sum is
        # back: the sum waits for the other machines' pushes, which may wait for credit
        # themselves (a deadlock). Nor when the send is done: that only means the bytes
        # left this process, and the kernel may hold megabytes of them for every server,
        # which then share the link and all finish late, their answers with them.
        while (item := self.sent.get()) is not None:
            task, sends, _ = item
            for h in sends:
                h.wait()
            self.queue.release(task.part.part.nbytes, lane=task.part.owner)

    def _complete(self) -> None:
        transport = self.ctx.transport
        while (item := self.answers.get()) is not None:
            task, answer = item
            self._awaiting = task
            answer.wait()
            self._awaiting = None
            if task.packed is not None:
                assert task.part.codec is not None
                task.out.copy_(task.part.codec.decode(task.packed))
            t = task.part.tensor
            tag = _local_tag(task.part.part.key, task.round)
            sends = [transport.isend(task.out, peer, tag, f"local sum of {task.part.part.label}")
                     for peer in task.part.peers]
            with self._lock:
                t.sends += sends
                del t.unanswered[task.part.part.key]
                if not t.unanswered:
                    t.done.set()

    def _watch(self) -> None:
        # Rounds that ready() was asked about: every message of the round, as wait() would.
        while (t := self.watching.get()) is not None:
            while not (t.done.wait(_WAKE_S) or self.closed):
                pass
            if self.closed or self.error is not None:  # wait() raises it (or nobody waits)
                return
            for h in t.recvs:
                h.wait()
            with self._lock:  # the completer has added its last sends before ``done``
                sends = list(t.sends)
            for h in sends:
                h.wait()
            t.arrived.set()


def engine_for(ctx: Context, *, credit_bytes: int = DEFAULT_CREDIT_BYTES) -> Engine:
    """This run's engine with this credit bound (made on first use; one per bound, so a
    tensor declared on one is always summed by it).

    Keys come from the run's one :class:`~polytrain.ps.keys.KeySpace`, so engines,
    strategies and a script's own calls never share a service key.
    """
    mine = _engines.setdefault(ctx, {})
    engine = mine.get(credit_bytes)
    if engine is None or engine.closed:
        engine = mine[credit_bytes] = Engine(ctx, credit_bytes=credit_bytes)
    return engine


def forget_if_alive(engine: weakref.ref[Engine], tensors: Sequence[SumTensor]) -> None:
    """:meth:`Engine.forget` ``tensors`` if the engine still lives: a finalizer's call, for
    an owner dropped without close() (which must not hold its engine alive for it)."""
    alive = engine()
    if alive is not None:
        alive.forget(tensors)
