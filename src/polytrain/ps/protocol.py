"""The wire format between workers and servers: fixed headers, tags, dtype codes.

A request is one message on tag ``tags.HEADER``, which a server has a
receive posted for from every worker at all times: a header of 7 int64
(56 bytes) followed, when ``numel > 0`` and the payload is at most
``INLINE_BYTES``, by the payload's bytes. The
server receives every request into a buffer of ``HEADER_BYTES +
INLINE_BYTES`` (gloo takes a shorter message into a larger buffer, and
aborts the receiving process on a longer one, so the limit is part of the
protocol), and the header says how long the message is. A larger payload
follows its header as a message of its own on ``tags.tag(PAYLOAD, seq)``.
A response, when the op has one, comes on ``tags.tag(RESPONSE, seq)``; its
size is known to the worker in advance (see each op), so the worker posts
the receive before it sends the request.

    worker                           server
    ------------------------------------------------------------------
    irecv(response, seq)        |
    isend(header | payload) --> |  irecv(request buffer, this worker)
                                |  store handles it (now or later)
    wait(response) <----------- |  isend(response, seq)

    a payload over INLINE_BYTES: isend(header), then isend(payload) on
    tag(PAYLOAD, seq), which the server receives from that rank

Why one message: gloo moves a message only once the receiver has posted its
receive, so a payload of its own waited for a round trip after its header,
and each message costs both ends about 100-150 us of CPU (docs/byteps.md,
"Engine cost"). Why a receive per worker: for the same reason, one receive
from any rank at a time let one worker's request move at a time (stop 36).

A PUSHPULL's payload is acknowledged as soon as the server holds it (one
int64, the sequence number, on ``tags.tag(ACK, seq)``): the worker's credit
counts bytes not yet at the server, and a finished ``isend`` only says they
left this process (the kernel may hold megabytes of them).

docs/architecture.md lists what each op sends and gets for each store kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from ..comm import tags

__all__: list[str] = []


HEADER_TAG = tags.HEADER
HEADER_LEN = 7
HEADER_BYTES = HEADER_LEN * 8
#: Payloads up to this many bytes travel in their header's message. Above BytePS's
#: 4,096,000-byte partitions, so a synchronous sum's request is always one message.
INLINE_BYTES = 4 << 20
#: The buffer a server receives every request into.
REQUEST_BYTES = HEADER_BYTES + INLINE_BYTES
STATUS_BYTES = 2048  # a declaration's answer: JSON, zero-padded

# Header fields. LANE tells apart pushers inside one process (0 for most). The sender's rank
# is not one: each worker's requests come on a receive of their own.
OP, KEY, ROUND, NUMEL, DTYPE, SEQ, LANE = range(HEADER_LEN)


class Op(IntEnum):
    DECLARE = 1    # payload: JSON declaration; answer: JSON status
    PUSH = 2       # payload: this rank's contribution to round ROUND of KEY
    PULL = 3       # answer: the result of round ROUND of KEY
    PUSHPULL = 4   # PUSH then PULL in one request
    FINISH = 5     # this worker sends nothing more
    SET = 6        # payload: new value of KEY (parameter stores)
    GET = 7        # answer: current value of KEY (parameter stores)
    FREE = 8       # forget KEY: its store and declaration (no answer)


class Kind(IntEnum):
    """What a key's store does with pushes: the store kinds a server knows."""

    SUM = 1        # synchronous summation per round
    PARAM = 2      # parameters that pushes update (asynchronous, clocked)
    OPTIM = 3      # parameters that an optimizer on the server updates with summed gradients
    COMPRESSED = 4  # synchronous summation of compressed payloads (ps/compressed.py)
    SPARSE = 5     # rows of a sparse parameter, updated on the server (ps/sparse.py)


DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype)


def inline(nbytes: int) -> bool:
    """Whether a payload of ``nbytes`` travels in its header's message."""
    return nbytes <= INLINE_BYTES


def _fields(message: torch.Tensor) -> torch.Tensor:
    """The header of a request message (a uint8 buffer, or the int64 fields themselves)."""
    return message[:HEADER_BYTES].view(torch.int64) if message.dtype == torch.uint8 else message


#: Ops whose payload the server acknowledges (one int64 on ``tag(ACK, seq)``) when the key's
#: thread takes it: a PUSHPULL's receipt gives the worker's credit back; a SET's says that any
#: request sent after the worker waited for it (after a barrier, by any worker) is handled
#: after it. (Each worker's requests arrive on their own receive, so arrival alone orders
#: only one worker's.) A FREE is acknowledged too, payload or not (:func:`receipted`).
RECEIPTED = (Op.PUSHPULL, Op.SET)


def receipted(op: Op, numel: int) -> bool:
    """Whether the server acknowledges a request of ``op`` with ``numel`` payload elements:
    the payload of a RECEIPTED op, and every FREE, so that a request of its key sent after
    the free was waited for (by any worker, after a barrier) finds the key gone (before, it
    could reach the key's thread first, and be summed)."""
    return op == Op.FREE or (op in RECEIPTED and numel > 0)


def message_length(message: torch.Tensor) -> int:
    """The bytes a request message took: its header, and its payload if inline."""
    h = _fields(message)
    nbytes = int(h[NUMEL]) * DTYPES[int(h[DTYPE])].itemsize
    return HEADER_BYTES + (nbytes if nbytes and inline(nbytes) else 0)


def payload_tag(seq: int) -> int:
    """The tag of request ``seq``'s payload."""
    return tags.tag(tags.PAYLOAD, seq)


def ack_tag(seq: int) -> int:
    """The tag of the server's receipt for request ``seq``'s payload (PUSHPULL)."""
    return tags.tag(tags.ACK, seq)


def response_tag(seq: int) -> int:
    """The tag of the answer to request ``seq``."""
    return tags.tag(tags.RESPONSE, seq)


@dataclass
class Request:
    """A header as the server received it, with its payload once that has arrived."""

    src: int
    op: Op
    key: int
    round: int
    numel: int
    dtype: torch.dtype
    seq: int
    lane: int
    payload: torch.Tensor | None = None

    @property
    def pusher(self) -> tuple[int, int]:
        """Who pushes: the rank, and its lane (one process may push for several, as
        HetPipe's policy bd does for its two virtual workers)."""
        return self.src, self.lane

    @property
    def nbytes(self) -> int:
        """The payload's size in bytes."""
        return self.numel * self.dtype.itemsize

    @property
    def inline(self) -> bool:
        """Whether the payload came in the header's message (or there is none)."""
        return inline(self.nbytes)

    @classmethod
    def parse(cls, src: int, message: torch.Tensor) -> Request:
        """The request in ``message`` (see :func:`request`), with its payload when inline: a
        view of ``message``, which the caller must not reuse while the request lives."""
        h = _fields(message).tolist()
        req = cls(src, Op(h[OP]), h[KEY], h[ROUND], h[NUMEL], DTYPES[h[DTYPE]], h[SEQ], h[LANE])
        if req.numel and req.inline and message.dtype == torch.uint8:
            # The header is 7 x 8 bytes, so the payload is aligned for every dtype.
            req.payload = message[HEADER_BYTES:HEADER_BYTES + req.nbytes].view(req.dtype)
        return req


def request(op: Op, *, key: int = 0, round: int = 0, seq: int = 0, lane: int = 0,
            payload: torch.Tensor | None = None) -> torch.Tensor:
    """A request's first message: its header, then ``payload`` (flat) if it fits inline."""
    numel = 0 if payload is None else payload.numel()
    dtype = torch.uint8 if payload is None else payload.dtype
    head = [int(op), key, round, numel, dtype_code(dtype), seq, lane]
    nbytes = numel * dtype.itemsize
    if not numel or not inline(nbytes):
        return torch.tensor(head, dtype=torch.int64)
    assert payload is not None
    message = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8)
    message[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(head, dtype=torch.int64))
    message[HEADER_BYTES:].view(dtype).copy_(payload)
    return message


def encode(obj: Any, size: int | None = None) -> torch.Tensor:
    """JSON as a uint8 tensor, zero-padded to ``size`` when given."""
    raw = json.dumps(obj).encode()
    if size is not None:
        if len(raw) > size:
            raw = json.dumps({"ok": False, "error": "answer too long: " + raw[:200].decode()}
                             ).encode()
        raw = raw.ljust(size, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.tolist()).rstrip(b"\0").decode())
