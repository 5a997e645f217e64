"""Requests to servers: one message exchange per call, and handles to wait on."""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Sequence

import torch

from ..comm.p2p import Handle, Transport
from ..comm.topology import Topology
from ..errors import ConfigError
from .protocol import (
    HEADER_TAG,
    STATUS_BYTES,
    Op,
    ack_tag,
    decode,
    encode,
    inline,
    payload_tag,
    receipted,
    response_tag,
)
from .protocol import request as make_request
from .stores import Declaration

__all__ = ["PSClient", "Pending"]


class Pending:
    """Outstanding requests; :meth:`wait` finishes them, then runs ``then`` once."""

    def __init__(self, handles: Sequence[Handle], then: Callable[[], None] | None = None) -> None:
        self._handles = list(handles)
        self._then = then
        self._done = False

    def wait(self, timeout_s: float | None = None) -> None:
        if self._done:
            return
        for h in self._handles:
            h.wait(timeout_s)
        self._done = True
        if self._then is not None:
            self._then()

    @staticmethod
    def all(pendings: Sequence[Pending]) -> Pending:
        """One pending that waits for all of ``pendings``."""
        def finish() -> None:
            for p in pendings:
                p.wait()
        return Pending([], finish)


class PSClient:
    """Sends requests to server processes and receives their answers (thread-safe).

    Example::

        client = ctx.ps_client
        client.declare(Declaration(key=ctx.keys.take(1), kind=Kind.SUM, name="g", numel=4,
                                   dtype="float32", pushers=2, pullers=2), server=3)
        out = torch.empty(4)
        client.push_pull(3, key=0, round=0, tensor=torch.ones(4), out=out).wait()
    """

    def __init__(self, transport: Transport, topology: Topology) -> None:
        self.transport = transport
        self.topology = topology
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def request(self, server: int, op: Op, *, key: int = 0, round: int = 0,
                payload: torch.Tensor | None = None, answer: torch.Tensor | None = None,
                lane: int = 0, what: str = "") -> list[Handle]:
        """Send one request; the answer (if any) lands in ``answer``. Returns its handles:
        the answer's, then (a PUSHPULL or SET with a payload) the server's receipt, then the
        sends (one, or two for a payload over ``protocol.INLINE_BYTES``).
        """
        with self._lock:
            seq = next(self._seq)
        what = what or f"{op.name} of key {key}"
        handles = []
        if answer is not None:
            handles.append(self.transport.irecv(answer, server, response_tag(seq),
                                                f"answer to {what}"))
        flat = None if payload is None else payload.detach().reshape(-1)
        numel = 0 if flat is None else flat.numel()
        if receipted(op, numel):
            handles.append(self.transport.irecv(torch.empty(1, dtype=torch.int64), server,
                                                ack_tag(seq), f"receipt of {what}"))
        # One message, header then payload, unless the payload is too large to go inline.
        message = make_request(op, key=key, round=round, seq=seq, lane=lane, payload=flat)
        handles.append(self.transport.isend(message, server, HEADER_TAG, what))
        if flat is not None and numel and not inline(numel * flat.element_size()):
            handles.append(self.transport.isend(flat, server, payload_tag(seq), what))
        return handles

    def declare(self, decl: Declaration, server: int) -> None:
        """Declare a key to its owner; ConfigError if another worker declared it otherwise."""
        status = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        for h in self.request(server, Op.DECLARE, key=decl.key, payload=encode(decl.as_json()),
                              answer=status, what=f"declaration of {decl.name!r}"):
            h.wait()
        answer = decode(status)
        if not answer["ok"]:
            raise ConfigError(answer["error"], answer.get(
                "hint", "build the same model with the same options on every worker, and "
                        "declare tensors in the same order"))

    def free(self, key: int, server: int) -> Pending:
        """Forget a key on its owner (its store's memory), once nobody uses it any more:
        after the requests of every worker that used it (a barrier after their waits)."""
        return Pending(self.request(server, Op.FREE, key=key))

    def push(self, server: int, *, key: int, round: int, tensor: torch.Tensor,
             lane: int = 0) -> Pending:
        """Push ``tensor``; ``lane`` tells apart pushers in one process (default 0)."""
        return Pending(self.request(server, Op.PUSH, key=key, round=round, payload=tensor,
                                    lane=lane))

    def pull(self, server: int, *, key: int, round: int, out: torch.Tensor) -> Pending:
        return Pending(self.request(server, Op.PULL, key=key, round=round, answer=out))

    def push_pull(self, server: int, *, key: int, round: int, tensor: torch.Tensor,
                  out: torch.Tensor) -> Pending:
        return Pending(self.request(server, Op.PUSHPULL, key=key, round=round, payload=tensor,
                                    answer=out))

    def set(self, server: int, *, key: int, tensor: torch.Tensor) -> Pending:
        """Replace a parameter store's value. Once waited for, any request sent afterwards,
        by any worker (after a barrier, say), is handled after it (the server's receipt)."""
        return Pending(self.request(server, Op.SET, key=key, payload=tensor))

    def get(self, server: int, *, key: int, out: torch.Tensor, round: int = 0) -> Pending:
        """Read a parameter store's current value, without waiting on clocks (``round``
        ``stores.WHOLE_STATE``: an optimizer store's whole state)."""
        return Pending(self.request(server, Op.GET, key=key, round=round, answer=out))

    def finish(self) -> None:
        """Tell every server this worker is done (servers exit once all workers are)."""
        handles = []
        for s in self.topology.servers:
            handles += self.request(s, Op.FINISH)
        for h in handles:
            h.wait()
