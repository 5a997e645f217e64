"""Message tags: one range per channel, so two channels' tags never meet, even at wrap.

Every point-to-point message of a run travels on the one service group
(``Context.groups.service``), so a receive matches any send with its tag.
Each channel owns a disjoint range of ``SPAN`` tags and numbers its
messages inside it modulo ``SPAN``:

    tag            channel    what
    -------------------------------------------------------------------------
    0              HEADER     a request header (a server receives from anyone)
    1              LIVENESS   a worker's last message to each server
    CH(k) + n      k          message n (mod SPAN) of channel k, k in CHANNELS

``CH(k) = FIRST + k * SPAN``. A channel wraps around inside its range only.

Example::

    >>> tag(PAYLOAD, 5) == tag(PAYLOAD, 5 + SPAN)
    True
    >>> tag(PAYLOAD, 5) != tag(RESPONSE, 5)
    True
"""

from __future__ import annotations

__all__ = ["HEADER", "LIVENESS", "PAYLOAD", "RESPONSE", "LOCAL_REDUCE", "PIPELINE",
           "CHANNELS", "SPAN", "tag"]

HEADER = 0
LIVENESS = 1

#: Channels with a range of their own: a request's payload and its response (numbered by
#: the request's sequence number), the engine's messages among a machine's workers
#: (numbered by key and round), a pipeline's activations and gradients (by micro-batch).
PAYLOAD, RESPONSE, LOCAL_REDUCE, PIPELINE = range(4)
CHANNELS = {PAYLOAD: "service payloads", RESPONSE: "service responses",
            LOCAL_REDUCE: "local reduce", PIPELINE: "pipeline stages"}

SPAN = 1 << 26
_FIRST = 16  # above the fixed tags


def tag(channel: int, number: int) -> int:
    """The tag of message ``number`` (taken modulo ``SPAN``) of ``channel``."""
    if channel not in CHANNELS:
        raise ValueError(f"unknown tag channel {channel} (the channels are {sorted(CHANNELS)})")
    return _FIRST + channel * SPAN + number % SPAN
