"""The wire format between workers and servers: fixed headers, tags, dtype codes.

A request is a header (8 int64 on tag ``tags.HEADER``, so a server can
receive it from any rank) and, when ``numel > 0``, a payload on
``tags.tag(PAYLOAD, seq)``. A response, when the op has one, comes on
``tags.tag(RESPONSE, seq)``; its size is known to the worker in advance (see
each op), so the worker posts the receive before it sends the request.

    worker                         server
    ------------------------------------------------------------
    irecv(response, seq)      |
    isend(header)  ---------> |  irecv(header, any source)
    isend(payload) ---------> |  irecv(payload, src, seq)
                              |  store handles it (now or later)
    wait(response) <--------- |  isend(response, seq)

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


def sender_of(header: torch.Tensor) -> int:
    """The rank that sent a request header."""
    return int(header[SRC])

HEADER_TAG = tags.HEADER
LIVENESS_TAG = tags.LIVENESS  # a worker's last message; its receive fails if the worker dies
HEADER_LEN = 8
STATUS_BYTES = 2048  # a declaration's answer: JSON, zero-padded

# Header fields. LANE tells apart pushers inside one process (0 for most); SRC is the
# sender's rank (a receive from any source learns it from the header, not from gloo).
OP, KEY, ROUND, NUMEL, DTYPE, SEQ, LANE, SRC = range(HEADER_LEN)


class Op(IntEnum):
    DECLARE = 1    # payload: JSON declaration; answer: JSON status
    PUSH = 2       # payload: this rank's contribution to round ROUND of KEY
    PULL = 3       # answer: the result of round ROUND of KEY
    PUSHPULL = 4   # PUSH then PULL in one request
    FINISH = 5     # this worker sends nothing more
    SET = 6        # payload: new value of KEY (parameter stores)
    GET = 7        # answer: current value of KEY (parameter stores)


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

    @classmethod
    def parse(cls, src: int, header: torch.Tensor) -> Request:
        h = header.tolist()
        return cls(src, Op(h[OP]), h[KEY], h[ROUND], h[NUMEL], DTYPES[h[DTYPE]], h[SEQ],
                   h[LANE])


def header(op: Op, *, key: int = 0, round: int = 0, numel: int = 0,
           dtype: torch.dtype = torch.uint8, seq: int = 0, lane: int = 0,
           src: int = 0) -> torch.Tensor:
    return torch.tensor([int(op), key, round, numel, dtype_code(dtype), seq, lane, src],
                        dtype=torch.int64)


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
