"""Pipeline schedules as plain data: each stage's ordered forwards and backwards.

Every schedule here is one rule: stage ``j`` keeps at most ``peak_j``
minibatches in flight, running forwards until it holds ``peak_j``, then one
backward and one forward in turn. Peaks never grow along the pipeline, so the
orders cannot deadlock (stage ``j``'s backward of ``m`` needs stage ``j+1``'s,
which comes no later in its own order).

    GPipe, 2 stages, 3 micro-batches     1F1B (peak = stages - j)      HetPipe, N_m = 3
    stage 0: F0 F1 F2 B0 B1 B2           stage 0: F0 F1 B0 F2 B1 B2    stage 0: F0 F1 F2 B0 F3 B1 ..
    stage 1: F0 F1 F2 B0 B1 B2           stage 1: F0 B0 F1 B1 F2 B2    stage 1: F0 F1 B0 F2 B1 F3 ..

1F1B's orders are those of ``torch.distributed.pipelining.Schedule1F1B`` (the
tests compare them); HetPipe's is 1F1B with ``N_m`` in flight and no flush.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import at_least

__all__ = ["Action", "FORWARD", "BACKWARD", "Order", "stage_order", "gpipe", "one_f_one_b",
           "asynchronous", "describe", "SCHEDULES"]

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    kind: str       # FORWARD or BACKWARD
    minibatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.minibatch}"


Order = tuple[Action, ...]


def stage_order(peak: int, count: int) -> Order:
    """``count`` minibatches with at most ``peak`` in flight: forwards first, then B/F in turn."""
    peak = max(1, min(peak, count))
    out = [Action(FORWARD, m) for m in range(peak)]
    for m in range(count):
        out.append(Action(BACKWARD, m))
        if m + peak < count:
            out.append(Action(FORWARD, m + peak))
    return tuple(out)


def gpipe(stages: int, microbatches: int) -> tuple[Order, ...]:
    """All forwards, then all backwards (GPipe; flush at the end)."""
    return tuple(stage_order(microbatches, microbatches) for _ in range(stages))


def one_f_one_b(stages: int, microbatches: int) -> tuple[Order, ...]:
    """1F1B (PipeDream-Flush): stage ``j`` keeps ``stages - j`` in flight; flush at the end."""
    return tuple(stage_order(stages - j, microbatches) for j in range(stages))


def asynchronous(stages: int, inflight: int, minibatches: int) -> tuple[Order, ...]:
    """HetPipe / PipeDream: ``inflight`` minibatches enter stage 0 before its first backward.

    Stage ``j`` keeps ``max(1, inflight - j)``: minibatch ``p`` starts on stage 0
    once minibatch ``p - inflight`` has finished there, so it sees the
    virtual worker's own updates of minibatches up to ``p - inflight``
    (local staleness ``inflight - 1``); later stages see more recent ones.
    """
    at_least("N_m (--inflight)", inflight,
             "pass --inflight 2, or leave it out to let the partitioner choose")
    return tuple(stage_order(inflight - j, minibatches) for j in range(stages))


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def describe(orders: Sequence[Order]) -> str:
    """One line per stage: ``stage 0: F0 F1 B0 F2 B1 B2``."""
    return "\n".join(f"stage {j}: " + " ".join(str(a) for a in order)
                     for j, order in enumerate(orders))
