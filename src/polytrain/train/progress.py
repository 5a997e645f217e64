"""A one-line progress bar with loss and throughput (periodic lines when not on a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Shows ``step/total``, the loss and samples/s; redraws at most 10 times a second."""

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 label: str = "train") -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.label = label
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._every = max(1, total // 10)
        self._open = False  # a redrawn line without its newline yet

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        """Ends a redrawn line left open (a step that raised): the error starts on its own line."""
        self._end_line()

    def _end_line(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def show(self, enabled: bool) -> None:
        """Draw from now on or not (a strategy whose bar moves to another process when its
        plan changes); stopping ends a redrawn line left open."""
        if not enabled:
            self._end_line()
        self.enabled = enabled

    def note(self, text: str) -> None:
        """Print ``text`` (lines) between the bar's updates, on lines of its own."""
        if not self.enabled:
            return
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def update(self, step: int, loss: float | None, samples_per_s: float, *,
               replica: tuple[int, int] = (0, 1)) -> None:
        """Show step ``step`` (from 0) with ``loss``, the mean over ``replica`` (index, count)'s
        slice of the batch: with more than one replica the bar says whose it is (the mean over
        all of them, what metrics.json has, would cost a collective where the bar redraws)."""
        if not self.enabled:
            return
        done = step + 1
        loss_txt = "   -  " if loss is None else f"{loss:6.3f}"
        whose = f" (replica {replica[0]} of {replica[1]})" if replica[1] > 1 else ""
        text = (f"{self.label} {done:>{len(str(self.total))}}/{self.total} loss {loss_txt}"
                f"{whose} {samples_per_s:8.1f} samples/s")
        if self.tty:
            now = time.monotonic()
            if now - self._last < 0.1 and done < self.total:
                return
            self._last = now
            width = 24
            filled = width * done // self.total
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            self._open = done < self.total
            if not self._open:
                self.stream.write("\n")
        elif done % self._every == 0 or done == self.total:
            self.stream.write(text + "\n")
        self.stream.flush()
