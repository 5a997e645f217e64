"""The errors polytrain raises: each names the rule, the values and the fix."""

from __future__ import annotations

__all__ = ["PolytrainError", "ConfigError", "LaunchError", "CommError", "CommTimeout", "PeerLost",
           "ClosedByTimeout"]


class PolytrainError(Exception):
    """Base of polytrain's errors; the text reads ``what went wrong. HINT: what to do``."""

    def __init__(self, what: str, hint: str | None = None) -> None:
        self.what = what
        self.hint = hint
        super().__init__(what if hint is None else f"{what}. HINT: {hint}")


class ConfigError(PolytrainError, ValueError):
    """Bad input: options, layouts or models that cannot work together."""


class LaunchError(PolytrainError, RuntimeError):
    """A launched process failed, died or was interrupted; the text names it."""

    def __init__(self, what: str, hint: str | None = None, *, rank: int | None = None,
                 role: str | None = None, machine: str | None = None,
                 exitcode: int | None = None) -> None:
        super().__init__(what, hint)
        self.rank = rank
        self.role = role
        self.machine = machine
        self.exitcode = exitcode


class CommError(PolytrainError, RuntimeError):
    """Communication with a peer failed: it stopped, or the peers disagree."""


class CommTimeout(CommError, TimeoutError):
    """A peer did not answer within the timeout."""


class PeerLost(CommError):
    """A peer process stopped (crashed, was killed, or closed its connections)."""

    peer_lost = True


class ClosedByTimeout(CommError):
    """Another wait of this process on the same group timed out, and gloo closed every
    connection of the group: that wait's own error is the cause."""
