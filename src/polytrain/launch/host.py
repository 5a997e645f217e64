"""What the kernel says about this host's memory: how much is free, and whether it killed for it.

Every process of a local run (every emulated machine) shares this host's
memory, so a job too large for it ends with the kernel's out-of-memory
killer sending SIGKILL: no traceback, no error file. The launcher reads the
kill counter around a run to name that cause; ``TrainConfig`` refuses a job
whose weights alone cannot fit.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_memory_bytes", "oom_kills"]


def _field(path: str, name: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ") if ":" not in line else line.partition(":")
            if key.strip() == name:
                return int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory_bytes() -> int | None:
    """Linux's estimate of the memory new work can use (``MemAvailable``), or None if unknown."""
    kib = _field("/proc/meminfo", "MemAvailable")
    return None if kib is None else kib * 1024


def oom_kills() -> int | None:
    """How many processes the out-of-memory killer has killed since boot, or None if unknown."""
    return _field("/proc/vmstat", "oom_kill")
