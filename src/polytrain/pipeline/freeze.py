"""AutoFreeze (PipeTransformer): how many front layers to freeze, from gradient norms.

The paper's rule at freeze point ``T``, for a model of ``L`` freezable layers
(those before the last layer with parameters, which always trains:
:func:`freezable_layers`)::

    L_frozen(T) = min(L_frozen(T-1) + alpha (L - L_frozen(T-1)),      # geometric cap
                      argmin over l in [L_frozen(T-1), L) of ||g_l(T)||)

The released code runs only the cap (its gradient-norm branch is
unreachable). Here the signal is used, as one number per layer that is
scale-free (so a small layer and a large one compare); a layer's learning
"has stopped" once its number is at most ``threshold``, and the front is
frozen through the stopped layer with the smallest number, never past the
cap (of equal numbers, the deepest). With no stopped layer nothing more
freezes. Three signals (:data:`SIGNALS`), all from the layer's mean gradient
norm over the interval that just ended:

- ``change``: its relative change from the interval before (the paper's
  gradient-norm change; before the first interval, the layer's first steps):
  the norm has settled, whatever its level. In fine-tuning the norms sit at
  their noise floor from the first steps, so a level says little.
- ``level``: its ratio to the layer's first steps: the norm has shrunk.
- ``relative``: its change over the median change of the still trained
  freezable layers: the norm has settled while the others' still move. The
  changes of all layers rise and fall together from one interval to the next
  (the same batches drive them), so a fixed threshold on ``change`` lets most
  layers through at some freeze points and none at others; the ratio cancels that
  common level and leaves what sets one layer apart. With one layer left its
  ratio is 1.0, so under a threshold below 1 the last freezable layer never
  freezes by this signal.

A layer's first steps are at most half the first interval
(:func:`reference_length`), so the first freeze point never compares an
interval with itself.

    >>> next_frozen(0, 5, [0.9, 0.3, 0.2, 0.6, 0.8], alpha=1 / 3, threshold=0.5)
    2
    >>> next_frozen(0, 5, [0.1, 0.1, 0.05, 0.01, 0.01], alpha=1 / 3, threshold=0.5)
    2
    >>> next_frozen(2, 5, [0.9, 0.8, 0.7], alpha=1 / 3, threshold=0.5)
    2
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import ConfigError, unknown

__all__ = ["freezable_layers", "freeze_cap", "next_frozen", "reference_length",
           "GradNormTracker", "REFERENCE_STEPS", "SIGNALS", "DEFAULT_THRESHOLDS"]

#: A layer's reference norm is its mean over its first steps of training: this many, or
#: fewer where freeze points come sooner (:func:`reference_length`).
REFERENCE_STEPS = 5

#: The gradient-norm signals a freeze point can read (``--freeze-signal``).
SIGNALS = ("change", "level", "relative")

#: Each signal's default ``--freeze-threshold``: ``change`` moved by at most 10%; ``level``
#: no longer shrinks; ``relative`` at most half the median change (docs/pipetransformer.md,
#: "Stop 25", reads the choice off the benchmark's recorded signals).
DEFAULT_THRESHOLDS = {"change": 0.1, "level": 1.0, "relative": 0.5}


def freezable_layers(has_parameters: Sequence[bool]) -> int:
    """L, the front layers that may ever freeze: those before the last layer with parameters,
    which always trains. Layers after it (an activation, a ``LogSoftmax``) have nothing to
    train; counting them froze the model's last weights too, and then every weight.

    >>> freezable_layers([True, False, True, False, True, False])  # ..., Linear, LogSoftmax
    4
    """
    return max((i for i, has in enumerate(has_parameters) if has), default=0)


def freeze_cap(frozen: int, freezable: int, alpha: float) -> int:
    """The geometric cap ``ceil(L_frozen + alpha (L - L_frozen))`` (alpha 1/3, L 12: 4, 7, 9,
    10, 11, 12 from nothing frozen), never more than ``freezable``.

    >>> [freeze_cap(f, 12, 1 / 3) for f in (0, 4, 7, 9, 10, 11)]
    [4, 7, 9, 10, 11, 12]
    """
    if not 0 < alpha < 1:
        raise ConfigError(f"--freeze-alpha must be in (0, 1) (got {alpha})",
                          "pass --freeze-alpha 0.333 (the paper's 1/3)")
    # the epsilon keeps 4 + 8/3 = 6.666... from rounding up past 7 through float error
    return min(freezable, math.ceil(frozen + alpha * (freezable - frozen) - 1e-9))


def reference_length(freeze_every: int) -> int:
    """The steps a layer's reference norm is the mean of, with a freeze point every
    ``freeze_every`` steps: the first :data:`REFERENCE_STEPS`, at most half the first
    interval. The first freeze point compares the interval's mean with them: where they were
    the whole interval (``freeze_every`` up to 5), every layer's change was 0.0 and its
    level 1.0, so every layer counted as stopped and the cap alone decided. One step has
    nothing to compare (``--freeze-every 1`` is refused).

    >>> [reference_length(n) for n in (2, 3, 8, 9, 10, 40)]
    [1, 1, 4, 4, 5, 5]
    """
    return min(REFERENCE_STEPS, freeze_every // 2)


def next_frozen(frozen: int, freezable: int, ratios: Sequence[float | None], *,
                alpha: float, threshold: float) -> int:
    """How many front layers are frozen after this freeze point (never fewer than ``frozen``).

    Args:
        frozen: layers frozen now (L_frozen(T-1)).
        freezable: L, the layers that may ever freeze (:func:`freezable_layers`).
        ratios: for each still trained freezable layer ``frozen .. freezable - 1``, its
            signal (:meth:`GradNormTracker.signal`), None for a layer with no gradient
            norm (no parameters: an activation), which never counts as stopped.
        alpha: the cap's fraction of the remaining layers, in (0, 1).
        threshold: a layer whose ratio is at most this has stopped learning.
    """
    if len(ratios) != freezable - frozen:
        raise ValueError(f"{freezable - frozen} layers are freezable but {len(ratios)} "
                         f"ratios were given")
    cap = freeze_cap(frozen, freezable, alpha)
    signal = {i: r for i, r in enumerate(ratios) if r is not None}
    stopped = [i for i, r in signal.items() if r <= threshold]
    if not stopped:
        return frozen
    smallest = min(stopped, key=lambda i: (signal[i], -i))  # argmin; ties: the deepest
    return min(cap, frozen + smallest + 1)


@dataclass
class GradNormTracker:
    """Per layer: its reference gradient norm (the mean over its first ``reference_steps``
    steps: :func:`reference_length` of the freeze points' interval) and the norms of the
    current interval. Plain data; every worker merges the others' at a freeze point."""

    reference: dict[str, list[float]] = field(default_factory=dict)  # first reference_steps
    interval: dict[str, list[float]] = field(default_factory=dict)
    previous: dict[str, float] = field(default_factory=dict)  # the last interval's mean
    reference_steps: int = REFERENCE_STEPS

    def record(self, norms: Mapping[str, float]) -> None:
        """One step's gradient norm of each layer this worker trains."""
        for name, value in norms.items():
            ref = self.reference.setdefault(name, [])
            if len(ref) < self.reference_steps:
                ref.append(value)
            self.interval.setdefault(name, []).append(value)

    def merge(self, others: Sequence[GradNormTracker]) -> None:
        """Take every layer's longest reference and interval from ``others`` (and self)."""
        for other in others:
            for name, ref in other.reference.items():
                if len(ref) > len(self.reference.get(name, [])):
                    self.reference[name] = list(ref)
            for name, values in other.interval.items():
                if len(values) > len(self.interval.get(name, [])):
                    self.interval[name] = list(values)
            for name, mean in other.previous.items():
                self.previous.setdefault(name, mean)

    def ratios(self, layers: Sequence[str]) -> list[float | None]:
        """Each layer's mean norm over the interval over its reference (None if unmeasured:
        a layer without parameters has no norm, and 1.0 there counted as stopped under
        ``level``'s threshold of 1.0, freezing layers that still learned)."""
        out: list[float | None] = []
        for name in layers:
            ref, now = self.reference.get(name), self.interval.get(name)
            if not ref or not now or sum(ref) == 0:
                out.append(None)
                continue
            out.append((sum(now) / len(now)) / (sum(ref) / len(ref)))
        return out

    def changes(self, layers: Sequence[str]) -> list[float | None]:
        """Each layer's relative change of its mean norm, from the interval before this one
        (before the first: its reference) to this one (None if unmeasured)."""
        out: list[float | None] = []
        for name in layers:
            ref, now = self.reference.get(name), self.interval.get(name)
            before = self.previous.get(name, sum(ref) / len(ref) if ref else 0.0)
            if not now or before == 0:
                out.append(None)
                continue
            out.append(abs(sum(now) / len(now) - before) / before)
        return out

    def relative_changes(self, layers: Sequence[str]) -> list[float | None]:
        """Each layer's :meth:`changes` over the median of the measured ones (all 1.0 if the
        median is 0: nothing stands out; None where unmeasured)."""
        changes = self.changes(layers)
        measured = [c for c in changes if c is not None]
        middle = statistics.median(measured) if measured else 0.0
        if middle == 0:
            return [None if c is None else 1.0 for c in changes]
        return [None if c is None else c / middle for c in changes]

    def signal(self, kind: str, layers: Sequence[str]) -> list[float | None]:
        """The ``kind`` signal (one of :data:`SIGNALS`) of each of ``layers``."""
        if kind == "change":
            return self.changes(layers)
        if kind == "level":
            return self.ratios(layers)
        if kind == "relative":
            return self.relative_changes(layers)
        raise unknown("freeze signal", kind, SIGNALS, "pass change, level or relative",
                      plural="signals")

    def new_interval(self) -> None:
        """Close the interval: its means become the next one's ``previous``."""
        for name, values in self.interval.items():
            if values:
                self.previous[name] = sum(values) / len(values)
        self.interval = {}
