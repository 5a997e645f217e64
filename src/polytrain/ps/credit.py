"""Priority scheduling with a credit: earlier layers first, bounded bytes in flight."""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Generic, TypeVar

__all__ = ["CreditQueue"]

T = TypeVar("T")


class CreditQueue(Generic[T]):
    """Items wait here until the credit allows them out; the lowest priority number goes first.

    BytePS's scheduler: partitions of earlier layers (lower numbers) go before
    later ones, because the next forward pass needs them first, and at most
    ``credit_bytes`` are in flight (taken but not yet released), so a
    partition that becomes ready late still overtakes the queued ones instead
    of waiting behind everything already handed to the network. An item larger
    than the credit goes out alone. ``credit_bytes=0`` means no bound.

    Example::

        q = CreditQueue[int](credit_bytes=1000)
        q.put(priority=5, nbytes=800, item=5)
        q.put(priority=1, nbytes=800, item=1)
        q.take()   # 1 (earlier layer first); 5 waits until release(800)
    """

    def __init__(self, credit_bytes: int) -> None:
        self.credit_bytes = credit_bytes
        self.in_flight = 0
        self._heap: list[tuple[int, int, int, T]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, priority: int, nbytes: int, item: T) -> None:
        with self._cond:
            heapq.heappush(self._heap, (priority, next(self._order), nbytes, item))
            self._cond.notify_all()

    def _fits(self) -> bool:
        if not self._heap:
            return False
        nbytes = self._heap[0][2]
        return (self.credit_bytes <= 0 or self.in_flight == 0
                or self.in_flight + nbytes <= self.credit_bytes)

    def take(self) -> T | None:
        """The first item once the credit allows it (its bytes count as in flight).

        Blocks while there is no work or no credit (an idle worker between steps
        may take any time; credit comes back from waits that have timeouts of
        their own); returns None once the queue is closed.
        """
        with self._cond:
            while not self._closed and not self._fits():
                self._cond.wait()
            if self._closed:
                return None
            _, _, nbytes, item = heapq.heappop(self._heap)
            self.in_flight += nbytes
            return item

    def release(self, nbytes: int) -> None:
        """An item's bytes have landed: give back their credit."""
        with self._cond:
            self.in_flight -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)
