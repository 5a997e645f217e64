"""The run's service keys: one allocator per context, so no two users of the service collide."""

from __future__ import annotations

import threading

from ..errors import ConfigError

__all__ = ["KeySpace"]


class KeySpace:
    """Hands out ranges of fresh service keys; one per run (``Context.keys``).

    Every worker that takes the same counts in the same order gets the same
    keys, and keys taken by one user (a strategy's plan, a script's own
    ``bps.push_pull``, a pipeline's parameter servers) are never another's.

    Example::

        >>> keys = KeySpace()
        >>> keys.take(3), keys.take(2), keys.next
        (0, 3, 5)
    """

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    @property
    def next(self) -> int:
        """The first key nobody has taken yet."""
        return self._next

    def take(self, count: int) -> int:
        """Take ``count`` fresh keys; returns the first (they are consecutive)."""
        if count < 0:
            raise ConfigError(f"cannot take {count} keys", "take 0 or more")
        with self._lock:
            first = self._next
            self._next += count
        return first
