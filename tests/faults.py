"""Fault injection from outside a run: find a launcher's children by role and rank, and signal
one when the run reaches a checkpoint (shared by the tests and benchmarks/faults.py); and
``spin_env``, which makes a run's processes spin in Python on :data:`SPIN` (no hook in
polytrain itself)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["children", "alive", "Injector", "SPIN", "spin_env"]

# The signal on which a process started with spin_env()'s environment spins (a busy hang): a
# real-time one, which nothing of polytrain's takes (SIGUSR1 makes a child raise; SIGUSR2 is
# the launcher's request for its stacks, faulthandler's) and whose default ends the process
# (a child without the handler dies, visibly, rather than going on as if no fault came).
SPIN = signal.SIGRTMIN + 2
_SPIN_SITE = """\
# Written by tests/faults.py spin_env(): a busy hang for fault injection, never in polytrain.
import signal
import time


def _polytrain_test_spin(signum, frame):
    end = time.monotonic() + {seconds!r}  # bounded: a stray spinner ends by itself
    while time.monotonic() < end:  # pure Python: the GIL is released, threads run on
        pass


signal.signal({signum}, _polytrain_test_spin)
"""



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


def spin_env(folder: Path, seconds: float = 300.0) -> dict[str, str]:
    """The environment (for ``run_config(..., env=)`` or a Launcher) in which every process
    of a run spins in a pure-Python busy loop in its main thread for ``seconds`` when sent
    :data:`SPIN`: a ``sitecustomize.py`` written to ``folder``, put first on ``PYTHONPATH``
    (the fork server imports it at its start, and its children inherit the handler). Its
    other threads (the heartbeat's) run on: a hang that still answers."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        _SPIN_SITE.format(seconds=float(seconds), signum=int(SPIN)))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


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
    ``rank`` -1: the role's highest rank (a dedicated server). SIGUSR1 makes a child raise;
    :data:`SPIN` makes one started with :func:`spin_env` spin. ``poll_s``: how often the
    trigger is looked for (a checkpoint's temporary directory lives a few milliseconds)."""

    role: str
    rank: int
    sig: int = signal.SIGKILL
    trigger: Path | None = None
    delay_s: float = 0.0
    after_s: float = 0.0
    parent: int | None = None
    timeout_s: float = 120.0
    poll_s: float = 0.02
    folder: Path | None = None  # whose listing and newest step-S to record (default: trigger's)
    sent_at: float | None = None
    pid: int | None = None
    machine: str = ""  # the victim's machine (POLYTRAIN_NODE), read when it fired
    newest_step: int = 0  # the newest checkpoint in ``folder`` when it fired
    pids: dict[tuple[str, int], int] = field(default_factory=dict)  # the run's, when it fired
    # What ``folder`` held just after the signal (a save cut short: its .tmp, and no step-S),
    # and what ``trigger`` itself held (where it is a folder).
    listing: list[str] = field(default_factory=list)
    trigger_listing: list[str] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Injector:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        begin = time.monotonic()
        while time.monotonic() < deadline and not self._stop.is_set():
            ready = (self.trigger is None or self.trigger.exists()) and \
                time.monotonic() - begin >= self.after_s
            if not ready:  # a stat only: children() reads /tmp, too slow for a short trigger
                time.sleep(self.poll_s)
                continue
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
                sent = time.monotonic()
                folder = self.folder or (self.trigger.parent if self.trigger else None)
                if folder is not None:
                    with contextlib.suppress(OSError):
                        self.listing = sorted(p.name for p in folder.iterdir())
                    steps = [int(p.name[5:]) for p in folder.glob("step-*")]
                    self.newest_step = max(steps, default=0)
                if self.trigger is not None:
                    with contextlib.suppress(OSError):
                        self.trigger_listing = sorted(p.name for p in self.trigger.iterdir())
                self.sent_at = sent
                return
            time.sleep(0.02)

    def join(self) -> None:
        """Stop looking (one that has not fired never fires later, into the next run of this
        process: a trigger of None matches any) and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
