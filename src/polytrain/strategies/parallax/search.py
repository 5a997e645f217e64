"""Parallax's partition search, inside the run: sample partition counts, fit, keep the best.

Parallax (Kim et al., EuroSys 2019, section 4.3) relaunches the job per trial;
here the samples are the first steps of the run itself. From ``start`` the
count doubles while the step time falls; then counts below ``start`` are
halved while it falls. The samples are fitted to ``t(P) = b / P + a (P - 1) + c``
(least squares) and the argmin over the sampled range is kept; with fewer than
three samples, or a fit that is not convex (a <= 0 or b <= 0), the fastest
sample is.

Example::

    >>> s = PartitionSearch(2, high=16)
    >>> s.record(2, 1.0); s.record(4, 0.8); s.record(8, 0.9); s.record(1, 1.5)
    >>> s.next_count() is None, s.choose()
    (True, 5)
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["PartitionSearch", "fit_cost"]


def fit_cost(samples: list[tuple[int, float]]) -> tuple[float, float, float] | None:
    """Least-squares (a, b, c) of ``t = b / P + a (P - 1) + c``; None below three counts."""
    if len({p for p, _ in samples}) < 3:
        return None
    x = torch.tensor([[p - 1.0, 1.0 / p, 1.0] for p, _ in samples], dtype=torch.float64)
    y = torch.tensor([[t] for _, t in samples], dtype=torch.float64)
    a, b, c = torch.linalg.lstsq(x, y).solution[:, 0].tolist()
    return a, b, c


class PartitionSearch:
    """The search's state: what was sampled, what to sample next, and the choice.

    Args:
        start: the first count (Parallax: max(min partitions, machines)).
        low, high: the counts allowed (default 1 .. 64).
    """

    def __init__(self, start: int, *, low: int = 1, high: int = 64) -> None:
        self.start = max(low, min(start, high))
        self.low, self.high = low, high
        self.samples: list[tuple[int, float]] = []
        self.going_up = True
        #: The count kept, once :meth:`choose` ended the search (None until then).
        self.chosen: int | None = None

    def record(self, count: int, step_s: float) -> None:
        self.samples.append((count, step_s))

    def next_count(self) -> int | None:
        """The next count to sample, or None: the search is over."""
        if not self.samples:
            return self.start
        count, t = self.samples[-1]
        times = dict(self.samples)
        if self.going_up:
            faster = len(self.samples) == 1 or t < min(v for p, v in self.samples[:-1])
            if faster and count * 2 <= self.high:
                return count * 2
            self.going_up = False
            below = self.start // 2
            return below if below >= self.low and below not in times else None
        if t <= min(times.values()) and count // 2 >= self.low and count // 2 not in times:
            return count // 2
        return None

    def best(self) -> int:
        """The count the fit puts lowest, within the sampled range (or the fastest sample)."""
        fastest = min(self.samples, key=lambda s: s[1])[0]
        fit = fit_cost(self.samples)
        if fit is None or fit[0] <= 0 or fit[1] <= 0:
            return fastest
        a, b, c = fit
        lo, hi = min(p for p, _ in self.samples), max(p for p, _ in self.samples)
        p = math.sqrt(b / a)
        candidates = {max(lo, min(hi, math.floor(p))), max(lo, min(hi, math.ceil(p)))}
        return min(candidates, key=lambda q: (b / q + a * (q - 1) + c, q))

    def choose(self) -> int:
        """End the search (after :meth:`next_count` said it is over): the count kept,
        :meth:`best`, from now on ``chosen``."""
        self.chosen = self.best()
        return self.chosen

    def as_json(self) -> dict[str, Any]:
        """The samples, the fit and the choice; ``chosen`` is None until :meth:`choose`
        ended the search (a run that ended first: its plan holds the count it used)."""
        fit = fit_cost(self.samples)
        return {"samples": [{"partitions": p, "step_s": t} for p, t in self.samples],
                "fit": None if fit is None else dict(zip(("a", "b", "c"), fit)),
                "model": "t(P) = b / P + a (P - 1) + c",
                "chosen": self.chosen}
