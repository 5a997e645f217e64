"""The one module that reads (and names) polytrain's environment variables."""

from __future__ import annotations

import numbers
import os
import socket
from dataclasses import dataclass
from typing import Mapping

from .errors import ConfigError

__all__: list[str] = []

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
ROLE = "POLYTRAIN_ROLE"
NODE = "POLYTRAIN_NODE"
TIMEOUT = "POLYTRAIN_TIMEOUT"
LOG_LEVEL = "POLYTRAIN_LOG_LEVEL"
ERROR_FILE = "POLYTRAIN_ERROR_FILE"
PARENT_PID = "POLYTRAIN_PARENT_PID"
LABEL_FILE = "POLYTRAIN_LABEL_FILE"
RESULT_FILE = "POLYTRAIN_RESULT_FILE"  # where a launched function's return value goes
HEARTBEAT_FILE = "POLYTRAIN_HEARTBEAT_FILE"  # the launcher watches its mtime: a hung child
STACKS_FILE = "POLYTRAIN_STACKS_FILE"  # where a child writes its threads' stacks on SIGUSR2
CRASH_FILE = "POLYTRAIN_CRASH_FILE"  # where a child's faulthandler writes a crash (SIGSEGV...)
HELD_FILE = "POLYTRAIN_HELD_FILE"  # where a server says which answers it has held long
NIC = "POLYTRAIN_NIC"  # the emulated machine's interface, under --bandwidth
SHM_DIR = "POLYTRAIN_SHM_DIR"  # the run's directory in host shared memory (the launcher's)
RUN_DIR = "POLYTRAIN_RUN_DIR"  # the launcher's work directory: the processes' scratch files
#: In the run's work directory, ``member-ROLE-RANK``: a file each launched process holds open
#: for good, and so everything it forks, which the launcher finds by it (launch/child.py's
#: ``_hold_membership``). Here, not in the child's module: the launcher importing that made
#: ``python -m polytrain.launch.child`` load it twice (runpy's RuntimeWarning).
MEMBER_PREFIX = "member-"
FORKSERVER = "POLYTRAIN_FORKSERVER"  # 0: every launched process is a fresh interpreter
# A worker's index among all workers on this host: polytrain launch runs every emulated
# machine on one host, where LOCAL_RANK (per emulated machine) would give two machines'
# workers the same GPU.
HOST_WORKER = "POLYTRAIN_HOST_WORKER"
LOADING_MAIN = "POLYTRAIN_LOADING_MAIN"  # set while a child imports the launching script
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"  # set by torchrun in the processes it starts
DEFAULT_TIMEOUT_S = 120.0
#: The longest timeout gloo can take: its milliseconds must fit a 32-bit int (24 days).
MAX_TIMEOUT_S = float((2**31 - 1) // 1000)


@dataclass(frozen=True)
class ProcessEnv:
    """What the launcher (ours or torchrun) told this process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int | None
    role: str
    node: str
    timeout_s: float
    launched: bool  # False: a plain `python script.py`, a world of one


def read(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    env = os.environ if environ is None else environ
    launched = RANK in env and WORLD_SIZE in env
    port = env.get(MASTER_PORT)
    local_rank = _whole(env, LOCAL_RANK, 0)
    return ProcessEnv(
        rank=_whole(env, RANK, 0),
        world_size=_whole(env, WORLD_SIZE, 1),
        local_rank=local_rank,
        master_addr=env.get(MASTER_ADDR, "127.0.0.1"),
        master_port=_whole(env, MASTER_PORT, 0) if port else None,
        role=_role(env.get(ROLE, "worker"), local_rank),
        node=env.get(NODE) or socket.gethostname(),
        timeout_s=timeout_of(env),
        launched=launched,
    )


def timeout_of(env: Mapping[str, str] | None = None) -> float:
    """The timeout ``env`` (default: this process's) sets: POLYTRAIN_TIMEOUT, else the
    default; checked."""
    return _seconds(os.environ if env is None else env, TIMEOUT, DEFAULT_TIMEOUT_S)


def _whole(env: Mapping[str, str], name: str, default: int) -> int:
    """``env``'s whole number ``name`` (a launcher's RANK, WORLD_SIZE...), else ``default``."""
    text = env.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number",
                          f"set {name} as a launcher does (a number, {name}={default}), or "
                          f"unset it") from None


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = (env.get(name) or "").strip() or None  # set to nothing: unset, as the others
    hint = f"set it to, say, {default:g}, or unset it"
    try:
        value = default if text is None else float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds", hint) from None
    check_seconds(value, name, hint)
    return value


#: The shortest timeout: a launched process whose heartbeat (every 0.5 s) is older than half
#: of it is taken for hung, and a shorter one would take a busy, healthy process for one.
MIN_TIMEOUT_S = 2.0


def check_seconds(value: float, what: str, hint: str) -> None:
    """Refuse a timeout that is not a number of seconds gloo can take, or is too short for
    the launcher to tell a hung process from a busy one."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's too
    if not number or not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:  # None, "120": a TypeError
        got = f"{float(value):g}" if number else repr(value)
        raise ConfigError(f"{what} must be a number of seconds from {MIN_TIMEOUT_S:g} to "
                          f"{MAX_TIMEOUT_S:.0f} (got {got})", hint)


def _role(spec: str, local_rank: int) -> str:
    """``worker``, ``server``, or a comma list indexed by LOCAL_RANK (``worker,worker,server``)."""
    roles = [r.strip() for r in spec.split(",")]
    if len(roles) == 1:
        return roles[0]
    if local_rank >= len(roles):
        return f"none: POLYTRAIN_ROLE={spec!r} lists {len(roles)} roles, one per local rank, " \
               f"and this is local rank {local_rank}"
    return roles[local_rank]


def log_level() -> str:
    return os.environ.get(LOG_LEVEL, "").strip().upper() or "WARNING"


def error_file() -> str | None:
    return os.environ.get(ERROR_FILE)


def label_file() -> str | None:
    return os.environ.get(LABEL_FILE)


def result_file() -> str | None:
    return os.environ.get(RESULT_FILE)


def heartbeat_file() -> str | None:
    return os.environ.get(HEARTBEAT_FILE)


def stacks_file() -> str | None:
    return os.environ.get(STACKS_FILE)


def crash_file() -> str | None:
    return os.environ.get(CRASH_FILE)


def held_file() -> str | None:
    return os.environ.get(HELD_FILE)


def parent_pid() -> int | None:
    pid = os.environ.get(PARENT_PID)
    return int(pid) if pid else None


def forkserver_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether local launches fork their processes from a fork server (launch/forkserver.py),
    by the environment the processes get (default: this process's)."""
    env = os.environ if environ is None else environ
    return env.get(FORKSERVER, "1").strip().lower() not in ("0", "false", "no", "off")


def nic() -> str | None:
    """The interface of this process's emulated machine (None: not on an emulated network)."""
    return os.environ.get(NIC) or None


def gloo_interface() -> str | None:
    """The interface gloo was told to use (``GLOO_SOCKET_IFNAME``), if any."""
    return os.environ.get(GLOO_SOCKET_IFNAME) or None


def single_host() -> bool:
    """Whether every process of the run is on this host (torchrun's LOCAL_WORLD_SIZE is the
    WORLD_SIZE); False where unknown."""
    local, world = os.environ.get(LOCAL_WORLD_SIZE), os.environ.get(WORLD_SIZE)
    return local is not None and local == world


def started_by() -> str | None:
    """``polytrain launch`` or ``torchrun`` where one of them started this very process
    (not a process this one started, nor a shell that merely has RANK set); else None."""
    if RANK not in os.environ or WORLD_SIZE not in os.environ:
        return None
    if parent_pid() == os.getppid():
        return "polytrain launch"
    if TORCHELASTIC_RUN_ID in os.environ:
        return "torchrun"
    return None


def world_size() -> int:
    return int(os.environ.get(WORLD_SIZE, "1"))


def loading_main() -> bool:
    """Whether this launched process is importing the launching script (see child.py)."""
    return bool(os.environ.get(LOADING_MAIN))


def shm_dir() -> str | None:
    """The run's directory in host shared memory, which the launcher removes at the end."""
    return os.environ.get(SHM_DIR) or None


def run_dir() -> str | None:
    """The launcher's work directory, for a process's scratch files: the launcher removes
    it at the end, and the next launch removes a killed launcher's (None: not launched)."""
    return os.environ.get(RUN_DIR) or None


def user_set(name: str) -> bool:
    return name in os.environ


def process_threads(world_size: int, cores: int | None = None) -> int:
    """The threads each process of a run of ``world_size`` launched here computes on:
    ``OMP_NUM_THREADS`` where the user set it, else torchrun's rule: processes that share
    the host's cores (``cores``, default :func:`usable_cores`) do not each take all of them."""
    given = os.environ.get(OMP_NUM_THREADS, "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (cores or usable_cores()) // world_size)


def usable_cores() -> int:
    """The cores this process may run on, which the processes it starts inherit: its CPU
    affinity (``taskset -c 0`` leaves one of the machine's), else the machine's."""
    if hasattr(os, "sched_getaffinity"):  # not on macOS or Windows
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def inherited() -> dict[str, str]:
    """This process's whole environment, for the processes it starts."""
    return dict(os.environ)


def identity() -> tuple[str, str, str]:
    """(rank, role, machine) as the launcher set them, without parsing ("?" where unset)."""
    return (os.environ.get(RANK, "?"), os.environ.get(ROLE, "?"), os.environ.get(NODE, "?"))


def gpu_index(local_rank: int, gpus: int) -> int:
    """Which of this host's ``gpus`` a worker computes on: its index among the host's
    workers (:data:`HOST_WORKER`, set by polytrain launch), else its LOCAL_RANK (torchrun),
    round-robin where there are more workers than GPUs."""
    host = os.environ.get(HOST_WORKER) if started_by() == "polytrain launch" else None
    return (int(host) if host is not None else local_rank) % gpus  # not one inherited


def cuda_visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")
