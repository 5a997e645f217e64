"""Priority scheduling with a credit per server: earlier layers first, bounded bytes in flight."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import defaultdict
from typing import Generic, Hashable, TypeVar

__all__ = ["CreditQueue"]

T = TypeVar("T")


class CreditQueue(Generic[T]):
    """Items wait here until their lane's credit allows them out; the lowest priority goes
    first (a number, or a tuple of numbers compared in turn).

    BytePS's scheduler: partitions of earlier layers (lower numbers) go before
    later ones, because the next forward pass needs them first, and at most
    ``credit_bytes`` are in flight (taken but not yet released), so a
    partition that becomes ready late still overtakes the queued ones instead
    of waiting behind everything already handed to the network. An item larger
    than the credit goes out alone. ``credit_bytes=0`` means no bound.

    The credit is kept per *lane* (the engine's lane is the server a partition
    goes to): an item waits only for its own lane's window. With one credit for
    all servers, every worker pushes the same partitions in the same priority
    order and a server owns a contiguous range of them, so all workers pushed to
    the same one or two servers at a time (incast) while the others' links sat
    idle; with no bound, every partition was in flight at once, all arrived
    together at the end, and the answers only started then.

    Example::

        q = CreditQueue[int](credit_bytes=1000)
        q.put(priority=5, nbytes=800, item=5)
        q.put(priority=1, nbytes=800, item=1)
        q.take()   # 1 (earlier layer first); 5 waits until release(800)
        q.put(priority=7, nbytes=800, item=7, lane="server 2")
        q.take()   # 7: another lane has its own credit
    """

    def __init__(self, credit_bytes: int) -> None:
        self.credit_bytes = credit_bytes
        self._in_flight: defaultdict[Hashable, int] = defaultdict(int)
        # Sorted by priority, then order of arrival.
        self._waiting: list[tuple[tuple[int, ...], int, int, Hashable, T]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Bytes taken and not yet released, over every lane."""
        with self._cond:
            return sum(self._in_flight.values())

    def put(self, priority: int | tuple[int, ...], nbytes: int, item: T, *,
            lane: Hashable = None) -> None:
        order = priority if isinstance(priority, tuple) else (priority,)
        with self._cond:
            entry = (order, next(self._order), nbytes, lane, item)
            bisect.insort(self._waiting, entry, key=lambda e: (e[0], e[1]))
            self._cond.notify_all()

    def _fits(self, nbytes: int, lane: Hashable) -> bool:
        used = self._in_flight[lane]
        return self.credit_bytes <= 0 or used == 0 or used + nbytes <= self.credit_bytes

    def _first(self) -> int | None:
        # The earliest waiting item whose lane has room; a lane's items leave in their order.
        full: set[Hashable] = set()
        for i, (_, _, nbytes, lane, _) in enumerate(self._waiting):
            if lane in full:
                continue
            if self._fits(nbytes, lane):
                return i
            full.add(lane)
        return None

    def take(self) -> T | None:
        """The first item whose lane's credit allows it (its bytes count as in flight).

        Blocks while there is no work or no credit (an idle worker between steps
        may take any time; credit comes back from waits that have timeouts of
        their own); returns None once the queue is closed.
        """
        with self._cond:
            while True:
                if self._closed:
                    return None
                i = self._first()
                if i is not None:
                    break
                self._cond.wait()
            _, _, nbytes, lane, item = self._waiting.pop(i)
            self._in_flight[lane] += nbytes
            return item

    def release(self, nbytes: int, *, lane: Hashable = None) -> None:
        """An item's bytes have landed: give back their credit on its lane."""
        with self._cond:
            self._in_flight[lane] -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)
