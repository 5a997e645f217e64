"""Fault injection from outside a run: find a launcher's children by role and rank, and signal
one when the run reaches a checkpoint (shared by the tests and benchmarks/faults.py)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["children", "alive", "Injector"]


def children(parent: int | None = None) -> dict[tuple[str, int], int]:
    """The running processes of launcher ``parent``'s run (default: this process's):
    (role, rank) -> pid, from the ``processes.json`` the launcher writes in its run's
    directory (``polytrain-PID-*`` in the temporary folder)."""
    return {(p["role"], p["rank"]): p["pid"] for p in _processes(parent) if alive(p["pid"])}


def _processes(parent: int | None) -> list[dict]:
    parent = os.getpid() if parent is None else parent
    out = []
    for path in Path(tempfile.gettempdir()).glob(f"polytrain-{parent}-*/processes.json"):
        try:
            out += json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not count)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class Injector:
    """Send ``sig`` to the process ``(role, rank)`` of this process's run once ``trigger``
    (a checkpoint directory, say) exists, ``delay_s`` later; or after ``after_s`` seconds.
    ``rank`` -1: the role's highest rank (a dedicated server). SIGUSR1 makes a child raise."""

    role: str
    rank: int
    sig: int = signal.SIGKILL
    trigger: Path | None = None
    delay_s: float = 0.0
    after_s: float = 0.0
    parent: int | None = None
    timeout_s: float = 120.0
    sent_at: float | None = None
    pid: int | None = None
    machine: str = ""  # the victim's machine (POLYTRAIN_NODE), read when it fired
    newest_step: int = 0  # the newest checkpoint beside ``trigger`` when it fired
    pids: dict[tuple[str, int], int] = field(default_factory=dict)  # the run's, when it fired
    _thread: threading.Thread | None = None

    def start(self) -> Injector:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        begin = time.monotonic()
        while time.monotonic() < deadline:
            ready = (self.trigger is None or self.trigger.exists()) and \
                time.monotonic() - begin >= self.after_s
            procs = children(self.parent)
            if self.rank < 0:  # the highest rank of the role
                self.rank = max((r for role, r in procs if role == self.role), default=-1)
            if ready and (self.role, self.rank) in procs:
                time.sleep(self.delay_s)
                procs = children(self.parent)
                if (self.role, self.rank) not in procs:
                    continue
                self.pids = procs
                self.pid = procs[(self.role, self.rank)]
                self.machine = next((p["machine"] for p in _processes(self.parent)
                                     if p["pid"] == self.pid), "?")
                os.kill(self.pid, self.sig)
                if self.trigger is not None:
                    steps = [int(p.name[5:]) for p in self.trigger.parent.glob("step-*")]
                    self.newest_step = max(steps, default=0)
                self.sent_at = time.monotonic()
                return
            time.sleep(0.02)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=1)
