"""The server process: receives requests from any worker and runs them on engine threads."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _env
from ..comm.p2p import Handle, Transport
from ..comm.topology import Topology
from ..errors import ClosedByTimeout, CommError, PolytrainError, kept_error
from .protocol import (
    HEADER_TAG,
    REQUEST_BYTES,
    STATUS_BYTES,
    Op,
    Request,
    ack_tag,
    decode,
    encode,
    message_length,
    payload_tag,
    receipted,
    response_tag,
)
from .stores import STORES, Declaration, Store

__all__ = ["Server"]

log = logging.getLogger(__name__)

_POLL_S = 0.5
_TRAINING_S = 365 * 24 * 3600.0  # a worker's next request: no bound on a run's length
_COPIED_BYTES = 64 << 10  # inline payloads up to this size are copied out of their buffer
_ANSWERED = (Op.PULL, Op.PUSHPULL, Op.GET)  # the ops a store answers (now or once it can)
_HELD_SHOWN = 6  # answers named in the report of those held long
#: What to do about answers a server holds long (its log's hint, and the launcher's).
_HELD_HINT = ("every worker must push and pull the same tensors in the same rounds: look for a "
             "push_pull, a layer or a step that only some workers run (a branch on the rank, "
             "fewer batches on one worker, a parameter unused on some)")
#: ... about answers short of a push that may still be crossing a slow link: a process that
#: asked for the same answer and whose push is still arriving (before the script's fault).
_IN_FLIGHT_HINT = ("a push may still be crossing a slow link (an emulated --bandwidth, a busy "
                   "network): if so, raise --timeout or the bandwidth; otherwise " + _HELD_HINT)
#: ... about answers that wait for the pushes of processes behind the others, and working.
_BEHIND_HINT = ("the answers wait for the pushes of processes behind the others, which are not "
                "waiting for an answer here: if they are only slower (a slower device, a larger "
                "share of the work), raise --timeout; otherwise find what holds them up")
#: ... and about answers held while an engine thread has not come back from a key's store.
_STUCK_HINT = ("the server is stuck or slow, not the workers: its engine thread did not return "
               "from a key's store (a store or a server-side optimizer step that loops or "
               "waits, a server starved of CPU); if it is only slow, raise --timeout")


@dataclass
class _Held:
    """An answer not given yet (``Server._report_held``)."""

    op: Op
    key: int
    round: int
    since: float  # time.monotonic() of its request's arrival
    handled: bool = False  # whether its store has the request (before: its engine's queue)


class _Engine(threading.Thread):
    """One summation thread: runs the requests of the keys pinned to it, in arrival order."""

    def __init__(self, server: Server, index: int) -> None:
        super().__init__(name=f"polytrain-engine-{index}", daemon=True)
        self.server = server
        self.queue: queue.Queue[tuple[Request, Handle | None] | None] = queue.Queue()
        self.load = 0  # bytes of the keys pinned here
        # The request its store is handling, and since when (time.monotonic()): one that
        # does not come back holds every answer of the keys pinned here (_report_held).
        self.busy: tuple[Request, float] | None = None

    def run(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                req, payload = item
                if payload is not None:
                    payload.wait()
                if receipted(req.op, req.numel):
                    self.server.acknowledge(req)
                if req.op == Op.FREE:  # after every request of the key that came before it
                    self.server.forget(req.key)
                    continue
                store = self.server.stores.get(req.key)
                if store is None:  # a FREE queued here before it, after its dispatch
                    raise self.server.undeclared(req)
                self.server.handling(req)
                self.busy = (req, time.monotonic())
                store.handle(req)
                self.busy = None
        except BaseException as e:  # noqa: BLE001 - handed to the main loop, which raises it
            self.server.fail(e)


class _Outbox(threading.Thread):
    """Waits for the server's sends (answers, receipts) in the order they were posted.

    An engine thread only posts its sends: when it waited for each answer to
    leave, four answers of a partition to four workers went one after another,
    and the receipts of the pushes queued behind them on the same thread waited
    too, and with them the workers' credit (a shaped link sat idle meanwhile).
    A handle keeps its tensor alive until the send is done; stores answer with
    tensors they no longer change.
    """

    def __init__(self, server: Server) -> None:
        super().__init__(name="polytrain-outbox", daemon=True)
        self.server = server
        self.queue: queue.Queue[Handle | None] = queue.Queue()

    def run(self) -> None:
        try:
            while (handle := self.queue.get()) is not None:
                handle.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the main loop, which raises it
            self.server.fail(e)


class _RequestBuffers:
    """Buffers of ``protocol.REQUEST_BYTES`` to receive requests into, reused once free.

    An inline payload is a view of the buffer its request came in, and a store
    may keep it until a round completes (a sum store holds every push of a
    round), so a buffer is free only once no tensor uses its memory any more.
    Each buffer is a numpy array under a tensor made with ``torch.from_numpy``:
    the tensor's storage, and so every view of it, holds a reference to the
    array, which the storage drops when the last view is gone; the array's
    reference count tells whether it is free. Buffers are reused rather than
    made per request: a fresh 4 MiB buffer costs a page fault per 4 KiB
    received (about 50 us a request more for a 867 KB payload, measured).

    A held payload pins its whole buffer, 4 MiB however small it is, so at
    most ``pinned`` buffers may be held: past that, :meth:`hold` says to copy
    a payload out (memory then grows by the payloads' own bytes, as with
    small payloads, and not by 4 MiB each: 400 held 256 KiB pushes would
    otherwise pin 1.6 GB for 100 MB of data).
    """

    def __init__(self, keep: int = 4, pinned: int = 16) -> None:
        self._arrays: list[np.ndarray] = []
        self._keep = keep  # free buffers kept at most (each may hold 4 MiB of memory)
        self._pinned = pinned  # buffers in use at most before payloads are copied out
        self._lock = threading.Lock()  # every worker's receive takes buffers

    def take(self) -> torch.Tensor:
        with self._lock:
            free = [i for i in range(len(self._arrays)) if self._free(i)]
            for i in reversed(free[self._keep:]):  # let go of what a burst of held payloads took
                del self._arrays[i]
            if free:
                return torch.from_numpy(self._arrays[free[0]])
            self._arrays.append(np.empty(REQUEST_BYTES, dtype=np.uint8))
            return torch.from_numpy(self._arrays[-1])

    def hold(self, nbytes: int) -> bool:
        """Whether a store may keep a payload of ``nbytes`` as a view of the buffer it came
        in (still in use); if not, the caller copies it out."""
        if nbytes <= _COPIED_BYTES:
            return False  # small: copied, without counting the buffers in use
        with self._lock:
            return sum(not self._free(i) for i in range(len(self._arrays))) <= self._pinned

    def _free(self, i: int) -> bool:
        # The references to a free array: the list's and getrefcount's own argument.
        return sys.getrefcount(self._arrays[i]) <= 2

    def __len__(self) -> int:
        return len(self._arrays)


class Server:
    """The summation / parameter service of one server process.

    Workers declare keys (each owned by one server), then push and pull them.
    Requests (a header and, up to ``protocol.INLINE_BYTES``, the payload)
    arrive on a receive thread per worker, always posted; each key is pinned to the
    least-loaded of ``threads`` engine threads (by declared bytes), which
    receives its larger payloads, applies requests to the key's store and
    answers. The server returns from :meth:`serve` once every worker has sent
    FINISH.

    Args:
        transport: metered point-to-point messages over a group of all ranks.
        topology: the run's roles and machines.
        threads: engine threads (default 4, as BytePS).
        idle_timeout_s: how long to wait for the next request before failing.
    """

    def __init__(self, transport: Transport, topology: Topology, *, threads: int = 4,
                 idle_timeout_s: float) -> None:
        self.transport = transport
        self.topology = topology
        self.rank = transport.rank
        self.idle_timeout_s = idle_timeout_s
        self.stores: dict[int, Store] = {}
        self.declarations: dict[int, tuple[int, Declaration]] = {}  # key -> (first rank, decl)
        # Per key, the ranks that declared it and the round each last pushed (0: none yet):
        # whose pushes a pull held long waits for (_report_held).
        self._pushed: dict[int, dict[int, int]] = {}
        self.pinned: dict[int, _Engine] = {}
        self.engines = [_Engine(self, i) for i in range(max(1, threads))]
        self.outbox = _Outbox(self)
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # declarations, and the workers not finished
        self._pending: set[int] = set()
        self._finished = threading.Event()
        self._last_request = 0.0  # time.monotonic() of the newest request
        # The answers not given yet, by (src, seq) (_report_held).
        self._held_path = _env.held_file()  # None: no launcher reads it (torchrun): logged
        self._logged: set[tuple[int, int, bool]] = set()  # (src, seq, handled) logged
        self._held: dict[tuple[int, int], _Held] = {}
        self._held_lock = threading.Lock()
        self._reported = ""

    def fail(self, error: BaseException) -> None:
        self._error = kept_error(self._error, error)

    def serve(self) -> None:
        """Answer requests until every worker has finished; raise the first failure."""
        # Threads do all waiting on gloo: a timed-out wait closes every connection of the
        # group, so nothing here may poll with a timeout. The main thread only supervises.
        for t in [*self.engines, self.outbox]:
            t.start()
        try:
            self._receive()
        finally:
            for e in self.engines:
                e.queue.put(None)
            for e in self.engines:
                e.join(timeout=self.transport.timeout_s)
            self.outbox.queue.put(None)  # after the engines: every answer has been posted
            self.outbox.join(timeout=self.transport.timeout_s)
        if self._error is not None:
            raise self._cause()
        if self._held_path:  # every worker finished: nothing is held any more
            with contextlib.suppress(OSError):
                os.remove(self._held_path)

    def _cause(self) -> BaseException:
        """The failure to raise. A receive cut off because another wait timed out (gloo then
        closes the whole group) wakes before that wait's thread reports its own error: that
        error replaces it (``fail``) within a poll."""
        deadline = time.monotonic() + _POLL_S
        while isinstance(self._error, ClosedByTimeout) and time.monotonic() < deadline:
            time.sleep(_POLL_S / 50)
        assert self._error is not None
        return self._error

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - the main thread raises it
            self.fail(e)

    def _receive(self) -> None:
        """Take the workers' requests as they come, each worker's in its order, until every
        worker has finished; raise the first failure, and fail if no request comes for the
        idle timeout.

        Every worker has a receive posted at all times (:meth:`_listen`): gloo moves
        a message only once its receive is posted, so one receive from any source
        at a time let one worker's request in at a time, and on shaped links the
        others' waited (BytePS k = 0 at 1 Gbit/s: 702 ms a step against 532 ms with
        concurrent receives; docs/byteps.md, "Stop 36")."""
        workers = list(self.topology.workers)
        self._pending = set(workers)
        # Each worker's posted receive holds a buffer too.
        buffers = _RequestBuffers(pinned=16 + len(workers))
        self._last_request = time.monotonic()
        for w in workers:
            threading.Thread(target=self._guard, args=(self._listen, w, buffers),
                             daemon=True, name=f"polytrain-listen-{w}").start()
        while not self._finished.wait(_POLL_S):
            if self._error is not None:
                raise self._cause()
            self._report_held()
            # A server that holds no store has nothing for anyone to wait on (Parallax with
            # no sparse parameter): it waits for the workers' FINISH, however long.
            if self.stores and time.monotonic() - self._last_request > self.idle_timeout_s:
                # Not a wait for a peer gone quiet (that is a CommTimeout, whose waiting the
                # launcher blames on whoever works on instead) but the bound on the workers'
                # idle time between requests, which is reached working.
                with self._lock:
                    pending = sorted(self._pending)
                raise CommError(
                    f"server rank {self.rank}: no request from the workers {pending} "
                    f"for {self.idle_timeout_s:g} s",
                    "if the workers are alive but slow between steps, raise the timeout "
                    "(--timeout or POLYTRAIN_TIMEOUT) or polytrain.init(server_idle_s=...)")

    def _listen(self, worker: int, buffers: _RequestBuffers) -> None:
        """Receive ``worker``'s requests one after another until its FINISH, and hand each to
        its key's engine thread (on this thread: a hand-off to one receive loop first cost
        every request a thread switch more).

        A receive from one worker fails at once if that worker dies, so this also watches
        it. Its waits last the worker's whole training, however long (bounding them by the
        idle timeout failed every run longer than that): the idle bound is :meth:`_receive`'s,
        and a worker alive but stuck is found there and by its peers' own waits."""
        name = self.topology.name(worker)
        while self._error is None:
            message = buffers.take()
            self.transport.irecv(message, worker, HEADER_TAG, f"a request from {name}",
                                 length_of=message_length).wait(_TRAINING_S)
            self._last_request = time.monotonic()
            req = Request.parse(worker, message)
            if req.payload is not None and not buffers.hold(req.nbytes):
                req.payload = req.payload.clone()  # small, or too many buffers held already
            del message  # a payload left inline keeps the buffer; otherwise it is free again
            if req.op == Op.FINISH:
                with self._lock:
                    self._pending.discard(worker)
                    log.debug("rank %d finished; waiting for %s", worker, sorted(self._pending))
                    if not self._pending:
                        self._finished.set()
                return
            if req.op == Op.DECLARE:
                with self._lock:  # workers declare the same keys at once
                    self._declare(req)
            else:
                self._dispatch(req)

    def _receive_payload(self, req: Request) -> Handle | None:
        """Post the receive of a payload too large to come inline (None: no such payload)."""
        if req.numel == 0 or req.inline:
            return None
        req.payload = torch.empty(req.numel, dtype=req.dtype)
        return self.transport.irecv(req.payload, req.src, payload_tag(req.seq),
                                    f"payload of {req.op.name} key {req.key}")

    def undeclared(self, req: Request) -> CommError:
        """The error for ``req`` of a key this server does not hold (never declared, or
        freed)."""
        return CommError(
            f"server rank {self.rank}: rank {req.src} sent {req.op.name} for key {req.key}, "
            f"which nobody declared here",
            "declare every key (with its owner server) before pushing or pulling it")

    def _dispatch(self, req: Request) -> None:
        engine = self.pinned.get(req.key)
        if engine is None:
            raise self.undeclared(req)
        if req.op in (Op.PUSH, Op.PUSHPULL):
            self._pushed.setdefault(req.key, {})[req.src] = req.round
        if req.op in _ANSWERED:
            with self._held_lock:
                self._held[(req.src, req.seq)] = _Held(req.op, req.key, req.round,
                                                       time.monotonic())
        engine.queue.put((req, self._receive_payload(req)))

    def handling(self, req: Request) -> None:
        """Note that ``req``'s store has it now (before, it waits in its engine's queue)."""
        with self._held_lock:
            held = self._held.get((req.src, req.seq))
            if held is not None:
                held.handled = True

    def _report_held(self) -> None:
        """Keep the held file (``POLYTRAIN_HELD_FILE``, from the launcher) saying which
        answers the server has held past half the timeout, and why each waits: a worker that
        times out waiting for one is then told what it waited for (pushes that never came, a
        push_pull only some workers make), not only that the server was slow. Without a
        launcher (torchrun), the server logs it, once for each request."""
        now, limit = time.monotonic(), 0.5 * self.transport.timeout_s
        with self._held_lock:
            old = sorted(((k, h) for k, h in self._held.items()
                          if now - h.since > limit
                          and (self._held_path or (*k, h.handled) not in self._logged)),
                         key=lambda item: item[1].since)
            if not self._held_path:  # logged once each (and once more when its store has it)
                self._logged = ({k for k in self._logged if k[:2] in self._held}
                                | {(*k, h.handled) for k, h in old[:_HELD_SHOWN]})
            # (key, round): who asked for it with a push not in yet (its payload arriving)
            asking: dict[tuple[int, int], set[int]] = {}
            for (src, _), h in self._held.items():
                if not h.handled:
                    asking.setdefault((h.key, h.round), set()).add(src)
        lines, stuck, behind, in_flight = [], False, set(), False
        waiting = {src for (src, _), _ in old}
        for (src, _), h in old[:_HELD_SHOWN]:
            store, decl = self.stores.get(h.key), self.declarations.get(h.key)
            if not h.handled:
                why = ("still queued for its engine thread (behind other requests, or its "
                       "payload still arriving)")
            else:
                try:  # the store's engine thread may change it meanwhile: a glimpse will do
                    why = store.waiting_for(h.round) if store is not None else ""
                except Exception as e:  # noqa: BLE001 - a report must not fail the server
                    log.debug("waiting_for of key %d failed: %r", h.key, e)
                    why = ""
            name = f"{decl[1].name!r} (key {h.key})" if decl else f"key {h.key}"
            engine = self.pinned.get(h.key)
            busy = engine.busy if engine is not None else None
            if engine is not None and busy is not None and now - busy[1] > limit:
                # Every answer of the keys pinned to it waits for it, whatever its store says.
                stuck = True
                req, key = busy[0], busy[0].key
                in_decl = self.declarations.get(key)
                where = f"{in_decl[1].name!r} (key {key})" if in_decl else f"key {key}"
                why = (f"{why}, and " if why else "") + (
                    f"the server's engine thread {engine.name} has been in the store of "
                    f"{where}, handling {req.op.name} round {req.round} from "
                    f"{self.topology.name(req.src)}, for {now - busy[1]:.0f} s: busy or stuck "
                    f"there")
            elif h.op == Op.PULL and (late := self._behind(h.key, waiting)):
                behind |= set(late)
                why = (f"{why}; " if why else "") + "pushes behind: " + ", ".join(
                    f"{self.topology.name(r)} "
                    f"{f'last pushed round {n}' if n else 'has pushed none yet'}"
                    for r, n in late.items())
            elif h.handled and (others := sorted(asking.get((h.key, h.round), set()) - {src})):
                # They run this push_pull too: their pushes are coming, if slowly.
                in_flight = True
                why = (f"{why}; " if why else "") + (
                    f"{', '.join(self.topology.name(r) for r in others)} asked for this answer "
                    f"too: {'its push' if len(others) == 1 else 'their pushes'} may still be "
                    f"in flight")
            lines.append(f"{h.op.name} of {name} round {h.round} for {self.topology.name(src)}, "
                         f"held {now - h.since:.0f} s{f': {why}' if why else ''}")
        if len(old) > _HELD_SHOWN:
            lines.append(f"and {len(old) - _HELD_SHOWN} more")
        text = "; ".join(lines)
        hint = (_STUCK_HINT if stuck else _BEHIND_HINT if behind else
                _IN_FLIGHT_HINT if in_flight else _HELD_HINT)
        path = self._held_path
        if not path:
            if text:
                log.warning("server rank %d holds answers the workers wait for, and cannot "
                            "give them yet: %s. HINT: %s", self.rank, text, hint)
            return
        if text == self._reported:
            return
        self._reported = text
        with contextlib.suppress(OSError):
            if text:
                with open(path + ".tmp", "w") as f:
                    json.dump({"held": text, "hint": hint, "behind": sorted(behind)}, f)
                os.replace(path + ".tmp", path)
            else:
                os.remove(path)

    def _behind(self, key: int, waiting: set[int]) -> dict[int, int]:
        """The ranks that declared ``key`` (its pushers, where a PULL waits for pushes: the
        clocked stores) and pushed it less far than another did, with the round each last
        pushed; but not those that wait for an answer here themselves (a push_pull only some
        workers make holds both sides)."""
        pushed = dict(self._pushed.get(key, {}))  # a glimpse: the listen threads update it
        front = max(pushed.values(), default=0)
        return {r: n for r, n in sorted(pushed.items()) if n < front and r not in waiting}

    def _declare(self, req: Request) -> None:
        handle = self._receive_payload(req)
        if handle is not None:
            handle.wait()
        assert req.payload is not None
        decl = Declaration(**decode(req.payload))
        answer: dict[str, Any] = {"ok": True}
        if decl.key in self.declarations:
            first, known = self.declarations[decl.key]
            what = known.mismatch(decl)
            if what is not None:
                answer = {"ok": False, "error": (
                    f"{self.topology.name(req.src)} declared {decl.describe()}, but "
                    f"{self.topology.name(first)} declared {known.describe()} "
                    f"(they differ in {what})")}
        elif decl.kind not in STORES:
            answer = {"ok": False, "error": f"server rank {self.rank} knows no store kind "
                                            f"{decl.kind} (declared for {decl.describe()})"}
        else:
            try:
                store = STORES[decl.kind](decl, self.respond)
            except (PolytrainError, TypeError, ValueError, KeyError) as e:
                # Settings the store cannot take (an optimizer's, say): the worker raises it.
                self.respond(req, encode({
                    "ok": False, "error": f"server rank {self.rank}: {decl.describe()}: {e}",
                    "hint": "the server builds this key's store from the declaration's "
                            "options: fix them"},
                    STATUS_BYTES))
                return
            self.declarations[decl.key] = (req.src, decl)
            engine = min(self.engines, key=lambda e: e.load)
            engine.load += decl.numel * decl.torch_dtype.itemsize
            self.pinned[decl.key] = engine
            self.stores[decl.key] = store
        if answer["ok"]:
            self._pushed.setdefault(decl.key, {}).setdefault(req.src, 0)
        self.respond(req, encode(answer, STATUS_BYTES))

    def forget(self, key: int) -> None:
        """Drop ``key``'s store and declaration (its memory); a later request for it is
        refused as undeclared."""
        with self._lock:
            _, decl = self.declarations.pop(key)
            self._pushed.pop(key, None)
            del self.stores[key]
            self.pinned.pop(key).load -= decl.numel * decl.torch_dtype.itemsize

    def acknowledge(self, req: Request) -> None:
        """Tell the worker that ``req``'s payload is here (its credit comes back)."""
        self.outbox.queue.put(self.transport.isend(
            torch.tensor([req.seq], dtype=torch.int64), req.src, ack_tag(req.seq),
            f"receipt of {req.op.name} of key {req.key}"))

    def respond(self, req: Request, tensor: torch.Tensor) -> None:
        """Post the answer to ``req`` (called from engine threads; ``tensor`` must not change
        until it has left: the outbox waits for it)."""
        with self._held_lock:
            self._held.pop((req.src, req.seq), None)
        self.outbox.queue.put(self.transport.isend(
            tensor, req.src, response_tag(req.seq), f"answer to {req.op.name} of key {req.key}"))
