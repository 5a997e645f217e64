"""What the kernel says about this host's memory (how much is free, and whether it killed for
it) and about its processes (``/proc/PID/stat``).

Every process of a local run (every emulated machine) shares this host's
memory, so a job too large for it ends with the kernel's out-of-memory
killer sending SIGKILL: no traceback, no error file. The launcher reads the
kill counter around a run to name that cause; ``TrainConfig`` refuses a job
whose weights alone cannot fit. Both read this process's memory cgroup
first (a container's limit and its own kills), then the whole host's.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_memory_bytes", "oom_kills", "own_status", "proc_stat"]

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _field(text: str | None, name: str, base: int = 10) -> int | None:
    """The number after ``name`` in ``key value`` or ``key: value kB`` lines."""
    for line in (text or "").splitlines():
        key, _, value = line.partition(":") if ":" in line else line.partition(" ")
        if key.strip() == name:
            try:
                return int(value.split()[0], base)
            except (ValueError, IndexError):
                return None
    return None


def own_status(name: str, base: int = 10) -> int | None:
    """A number of this process's ``/proc/self/status`` (``Umask``: base 8, ``CapEff``:
    16); None where Linux does not say."""
    return _field(_read(Path("/proc/self/status")), name, base)


def _cgroups() -> list[tuple[int, Path]]:
    """This process's memory cgroup folders with their version: v2 first, then v1."""
    out = []
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            out.append((2, Path("/sys/fs/cgroup") / path.lstrip("/")))
        elif "memory" in controllers.split(","):
            out.append((1, Path("/sys/fs/cgroup/memory") / path.lstrip("/")))
    return sorted(out, key=lambda c: -c[0])


def available_memory_bytes() -> int | None:
    """The memory new work can use: Linux's ``MemAvailable``, or less where this process's
    cgroup has a limit closer to its use; None if neither is known."""
    kib = _field(_read(Path("/proc/meminfo")), "MemAvailable")
    room = [kib * 1024] if kib is not None else []
    for version, folder in _cgroups():
        limit_file, used_file = (("memory.max", "memory.current") if version == 2
                                 else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        limit, used = _read(folder / limit_file), _read(folder / used_file)
        if limit is None or used is None or not limit.strip().isdigit():
            continue  # no such file, or v2's "max": no limit
        if int(limit) < _UNLIMITED:
            room.append(max(0, int(limit) - int(used)))
    return min(room) if room else None


def oom_kills() -> int | None:
    """How many processes the out-of-memory killer has killed: in this process's memory
    cgroup where the kernel counts them there, else on the whole host; None if unknown."""
    for version, folder in _cgroups():
        count = _field(_read(folder / ("memory.events" if version == 2
                                       else "memory.oom_control")), "oom_kill")
        if count is not None:
            return count
    return _field(_read(Path("/proc/vmstat")), "oom_kill")


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the process's name (state, parent pid, ...;
    ``man 5 proc`` counts them from 3); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
