"""The credit queue: earlier layers first, bytes in flight bounded."""

import threading

from polytrain.ps.credit import CreditQueue


def test_the_earliest_layer_goes_first():
    q = CreditQueue[str](credit_bytes=0)
    for prio in (7, 2, 9, 0):
        q.put(prio, 10, f"p{prio}")
    assert [q.take() for _ in range(4)] == ["p0", "p2", "p7", "p9"]


def test_a_late_early_layer_overtakes_what_waits_for_credit():
    q = CreditQueue[int](credit_bytes=100)
    q.put(9, 80, 9)            # the last layer is ready first and goes at once
    assert q.take() == 9
    q.put(8, 80, 8)            # waits: 80 + 80 > 100
    q.put(1, 80, 1)            # an earlier layer becomes ready meanwhile
    got: list[int | None] = []
    taker = threading.Thread(target=lambda: got.append(q.take()))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and q.in_flight == 80  # no credit: nothing more went out
    q.release(80)
    taker.join(5)
    assert got == [1]          # the earlier layer, not the one queued before it
    q.release(80)
    assert q.take() == 8


def test_an_item_larger_than_the_credit_goes_alone_and_close_ends_takers():
    q = CreditQueue[str](credit_bytes=10)
    q.put(0, 1000, "big")
    assert q.take() == "big" and q.in_flight == 1000
    got: list[str | None] = []
    taker = threading.Thread(target=lambda: got.append(q.take()))
    taker.start()
    q.close()
    taker.join(5)
    assert got == [None]
