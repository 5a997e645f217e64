"""Point-to-point messages between ranks: tagged, asynchronous, metered, with timeouts."""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import (
    CLOSED_BY_TIMEOUT,
    ClosedByTimeout,
    CommError,
    CommTimeout,
    PeerLost,
    is_timeout,
)
from .meter import RECV, SENT, TrafficMeter
from .tags import RESPONSE, channel_of
from .topology import Topology

__all__ = ["Transport", "Handle"]

_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "Socket closed", "connection closed")


class Handle:
    """An outstanding send or receive; :meth:`wait` finishes it or raises a clear error.

    A wait that times out is fatal for the group: gloo then closes every
    connection of it. So wait only as long as a peer may legitimately take.
    """

    def __init__(self, transport: Transport, work: Any, peer: int, nbytes: int,
                 direction: str, what: str, staged: torch.Tensor | None = None,
                 target: torch.Tensor | None = None,
                 length_of: Callable[[torch.Tensor], int] | None = None) -> None:
        self._transport = transport
        self._work = work
        self._peer = peer
        self._nbytes = nbytes
        self._direction = direction
        self._what = what
        self._staged = staged  # CPU copy of a device tensor (kept alive while in flight)
        self._target = target  # device tensor a staged receive is copied into
        self._done = False
        self._length_of = length_of

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the message has moved."""
        if self._done:
            return
        t = self._transport
        timeout = t.timeout_s if timeout_s is None else timeout_s
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise t.error(e, self._peer, self._what, timeout) from None
        if self._direction == RECV:
            if self._length_of is not None and self._staged is not None:
                self._nbytes = self._length_of(self._staged)  # a shorter message than the buffer
            t.meter.record(self._peer, self._nbytes, RECV)
            if self._target is not None and self._staged is not None:
                self._target.copy_(self._staged)
        self._done = True


class Transport:
    """Metered ``isend``/``irecv`` of tensors over one process group that spans every rank.

    Tensors on a GPU are staged through CPU copies (gloo moves CPU memory); a
    peer that stops or does not answer within ``timeout_s`` raises an error
    naming its rank, role and machine and what was being moved.

    ``group`` spans every rank in rank order, so its ranks are the global ones and
    messages go straight to its ``send``/``recv``: torch's ``isend``/``irecv``
    wrappers re-check the group and translate ranks on every call, about 15 us of
    Python per message, and the summation service moves hundreds per step.

    Servers' answers (the RESPONSE tag channel) travel on ``answers``, a second
    group over every rank (so a second TCP connection between each pair), and
    everything else on ``group``.
    gloo sends a message only once the receiver has told it the receive is
    posted; that notice travels behind whatever the receiver itself is sending
    to the sender on the same connection. A server answering a worker while the
    worker pushes its next partition would hold the push's notice behind
    megabytes of answers, so each direction's bytes waited for the other's and a
    shaped link sat idle half the step. With one connection per direction, a
    notice only ever queues behind other notices.
    """

    def __init__(self, *, rank: int, topology: Topology, group: Any, meter: TrafficMeter,
                 timeout_s: float, answers: Any = None) -> None:
        self.rank = rank
        self.topology = topology
        self.group = group
        self.answers = group if answers is None else answers
        self.meter = meter
        self.timeout_s = timeout_s
        for g in {id(group): group, id(self.answers): self.answers}.values():
            ranks = dist.get_process_group_ranks(g)
            if ranks != list(range(len(ranks))):
                raise CommError(f"the transport's groups must span every rank in order (got "
                                f"ranks {ranks})",
                                "make them with dist.new_group(range(world_size))")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, what: str = "a message") -> Handle:
        staged = tensor.detach()
        if staged.device.type != "cpu":
            staged = staged.cpu()
        staged = staged.contiguous()
        nbytes = staged.numel() * staged.element_size()
        try:
            work = self._group(tag).send([staged], dst, tag)
        except RuntimeError as e:
            raise self.error(e, dst, what, self.timeout_s) from None
        self.meter.record(dst, nbytes, SENT)
        return Handle(self, work, dst, nbytes, SENT, what, staged=staged)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, what: str = "a message",
              length_of: Callable[[torch.Tensor], int] | None = None) -> Handle:
        """Receive into ``tensor`` from ``src``.
        gloo takes a message shorter than ``tensor`` (a longer one aborts this process):
        ``length_of(message)`` says how many bytes came, for the meter."""
        if not tensor.is_contiguous():
            raise CommError(f"irecv needs a contiguous tensor ({what})",
                            "receive into a contiguous buffer and copy from it")
        staged = tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        try:
            work = self._group(tag).recv([staged], src, tag)
        except RuntimeError as e:
            raise self.error(e, src, what, self.timeout_s) from None
        nbytes = staged.numel() * staged.element_size()
        return Handle(self, work, src, nbytes, RECV, what, staged=staged,
                      target=tensor if staged is not tensor else None, length_of=length_of)

    def _group(self, tag: int) -> Any:
        return self.answers if channel_of(tag) == RESPONSE else self.group

    def error(self, exc: Exception, peer: int | None, what: str, timeout_s: float) -> CommError:
        """Turn torch's error for a message with ``peer`` into one that says who and what."""
        who = "any peer" if peer is None else self.topology.name(peer)
        text = str(exc)
        if CLOSED_BY_TIMEOUT in text:
            return ClosedByTimeout(f"rank {self.rank}: {what} with {who} was cut off: another "
                                   f"wait of this process timed out, and gloo closed the group")
        if is_timeout(exc):
            return CommTimeout(
                f"rank {self.rank}: {what} did not complete within {timeout_s:g} s, waiting "
                f"for {who}",
                "if that process is alive but slow, raise the timeout (--timeout or "
                "POLYTRAIN_TIMEOUT); otherwise look at its log", waited_s=timeout_s)
        if any(m in text for m in _LOST_MARKERS):
            return PeerLost(f"rank {self.rank}: lost {who} during {what}: the process stopped",
                            "look at that process's log for its error", peer=peer)
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return CommError(f"rank {self.rank}: {what} with {who} failed: {first}")
