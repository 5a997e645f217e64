"""Message tags: one range per channel, so two channels' tags never meet, even at wrap.

Every point-to-point message of a run travels on the service group
(``Context.groups.service``), but for the RESPONSE channel, which has a group
of its own (``Context.groups.answers``: see ``comm.p2p.Transport``); a receive
matches any send with its tag on its group. Each channel owns a disjoint
range of ``SPAN`` tags and numbers its messages inside it modulo ``SPAN``:

    tag            channel    what
    -------------------------------------------------------------------------
    0              HEADER     a request: header, payload up to 4 MiB (from any worker)
    CH(k) + n      k          message n (mod SPAN) of channel k, k in CHANNELS

``CH(k) = FIRST + k * SPAN``. A channel wraps around inside its range only.

Example::

    >>> tag(PAYLOAD, 5) == tag(PAYLOAD, 5 + SPAN)
    True
    >>> tag(PAYLOAD, 5) != tag(RESPONSE, 5)
    True
"""

from __future__ import annotations

__all__ = ["HEADER", "PAYLOAD", "RESPONSE", "LOCAL_REDUCE", "PIPELINE", "ACK",
           "CHANNELS", "SPAN", "tag", "channel_of"]

HEADER = 0

#: Channels with a range of their own: a request's payload and its response (numbered by
#: the request's sequence number), the engine's messages among a machine's workers
#: (numbered by key and round), a pipeline's activations and gradients (by micro-batch),
#: a server's word that a request's payload has arrived (by the request's sequence number).
PAYLOAD, RESPONSE, LOCAL_REDUCE, PIPELINE, ACK = range(5)
CHANNELS = {PAYLOAD: "service payloads", RESPONSE: "service responses",
            LOCAL_REDUCE: "local reduce", PIPELINE: "pipeline stages", ACK: "payload receipts"}

SPAN = 1 << 26
_FIRST = 16  # above the fixed tags


def tag(channel: int, number: int) -> int:
    """The tag of message ``number`` (taken modulo ``SPAN``) of ``channel``."""
    if channel not in CHANNELS:
        raise ValueError(f"unknown tag channel {channel} (the channels are {sorted(CHANNELS)})")
    return _FIRST + channel * SPAN + number % SPAN


def channel_of(tag_: int) -> int | None:
    """The channel that ``tag_`` belongs to (None for the fixed tags)."""
    if tag_ < _FIRST:
        return None
    channel = (tag_ - _FIRST) // SPAN
    return channel if channel in CHANNELS else None
