"""The local launcher: starts a layout's processes, watches them, stops them all on a failure."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

from .. import _env
from ..errors import ConfigError, LaunchError, check_whole
from ..kinds import check_kinds
from .forkserver import ForkedProcess, ForkServer, Process, server_for
from .host import oom_kills
from .layout import WORKER, Layout, ProcessSpec
from .network import (
    LinkShape,
    Network,
    check_links,
    check_tools,
    link_shape,
    owner_alive,
    owner_record,
    recorded_here,
    start_time,
)

__all__ = ["launch", "launch_script", "Launcher", "free_port", "refuse_at_import",
           "take_interrupts", "interrupted_error"]

log = logging.getLogger(__name__)

_CAUSE_GRACE_S = 2.0  # how long processes that lost a peer wait for the peer's own error
_POLL_S = 0.05
_GRACE_S = 3.0
_NETWORK_PORT = 29500  # in the run's own namespaces every port is free
_FIRST_BEAT_S = 60.0  # a child's first heartbeat comes after it has imported torch
_START_HINT = ("this host refused a new process: see `ulimit -u` (processes per user) and "
               "free memory, or run fewer --workers/--servers")
_PAUSED_S = 5.0  # a launcher whose heartbeat checks are this far apart was stopped itself
_STACKS_S = 2.0  # how long a stalled child is given to write its stacks before it is stopped
_STALL_SLACK_S = 1.0  # "working since before the peer's wait began", give or take a beat


#: What stops a run: Ctrl-C, kill (timeout, docker stop, Slurm), the terminal closing.
INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def take_interrupts(handler: Callable[[int, Any], None], *,
                    always: Collection[int] = ()) -> dict[signal.Signals, Any]:
    """Put ``handler`` on :data:`INTERRUPTS`, in the main thread (where Python runs handlers;
    elsewhere none); returns the handlers it replaced, to put back. One this process was
    started with ignored stays ignored, in it and in its children, as in any program
    (``nohup``'s SIGHUP, a shell script's background job's SIGINT), unless in ``always``."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in INTERRUPTS
            if s in always or signal.getsignal(s) != signal.SIG_IGN}


def interrupted_error(caught: Sequence[int], what: str) -> LaunchError:
    """The error of a run the first of ``caught`` (none: Ctrl-C) interrupted, after ``what``
    was done about it; its exit code is 128 + the signal, as a shell's."""
    how = signal.Signals(caught[0]) if caught else signal.SIGINT
    return LaunchError(f"interrupted ({'Ctrl-C' if how == signal.SIGINT else how.name}): "
                       f"{what}", exitcode=128 + how, interrupted=True)


def free_port(host: str = "") -> int:
    """A TCP port that nobody listens on right now, on ``host`` (default: on any address,
    as the rendezvous store listens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(port: int | None) -> None:
    """Refuse a rendezvous port that is not a TCP port (None: a free one is taken)."""
    hint = "pass --port 29500, or leave it out to take a free one"
    check_whole("--port", port, hint)
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"--port must be a TCP port, 1..65535 (got {port})", hint)


def _check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the rendezvous store binds: on every address (a port another program listens on
        # at 127.0.0.2 or the NIC's address is taken too), and a port the last run's
        # connections still hold in TIME_WAIT (a rerun or a restart, for a minute) is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise ConfigError(
                f"port {port} on this host is in use ({e.strerror}); the rendezvous needs a "
                f"free one",
                "pass another --port, or leave --port out to pick a free port") from None


@dataclass
class _Child:
    spec: ProcessSpec
    proc: Process
    error_file: Path
    result_file: Path
    label_file: Path
    heartbeat_file: Path
    stacks_file: Path
    held_file: Path
    crash_file: Path
    started: float = 0.0  # time.monotonic() when it was started
    # Its heartbeat file's mtime as last seen, and when (monotonic) the launcher saw it
    # change: the age of a beat is the launcher's own time since, not the wall clock's
    # (which steps, and runs on through a suspend that stops every timeout).
    beat_mtime: int | None = None
    beat_seen: float = 0.0
    stopped_by_us: bool = False
    hung: str = ""  # why the heartbeat says it stopped answering ("" while it answers)
    hint: str = ""  # what to do about ``hung``, if not the traceback's fix


def _files(workdir: Path, rank: int) -> tuple[Path, Path, Path, Path, Path, Path, Path]:
    """A child's files in the run's directory, in :class:`_Child`'s order: error, result,
    label, heartbeat, stacks, held answers (a server's), crash dump."""
    return (workdir / f"error-{rank}.json", workdir / f"result-{rank}.pkl",
            workdir / f"label-{rank}.txt", workdir / f"heartbeat-{rank}",
            workdir / f"stacks-{rank}.txt", workdir / f"held-{rank}.txt",
            workdir / f"crash-{rank}.txt")


_SEE_TRACEBACK = "the traceback of that process is printed above; fix its cause and rerun"
# Processes that wrote no traceback of their own:
_STOPPED_HINT = ("it was stopped (kill -STOP, a debugger, a shell's Ctrl-Z): continue it "
                 "(kill -CONT) or leave it running, and rerun")
_SILENT_HINT = ("its heartbeat thread stopped too: the whole process is stuck (in C code that "
                "holds the GIL, or swapped out); raise --timeout if it was only slow")
_SIGNALLED_HINT = ("a signal ended it without a traceback: SIGSEGV, SIGBUS or SIGABRT, a "
                   "crash in C code (faulthandler's dump above, under its name, shows where); "
                   "SIGKILL, SIGTERM or SIGINT, "
                   "something outside the run (the kernel's OOM killer, a job scheduler, a "
                   "user)")
_LEFT_HINT = ("if they waited in a collective every worker makes, find why it returned (or "
              "called sys.exit(0)) before them, e.g. fewer steps or batches on it")
_UNJOINED_HINT = ("every process of a run, servers too, must call polytrain.init(): a server "
                  "serves the workers inside that call (the script is written from a "
                  "worker's point of view), so call it before any branch on the role")
_EXITED_HINT = ("find what ended it (os._exit or sys.exit in one of its threads or signal "
                "handlers, a library that exits; its output above may say); a script that "
                "ends with os._exit(0) on purpose must first leave the run: call "
                "polytrain.current().shutdown() before os._exit (it waits for every peer, and "
                "tells the servers this worker has finished; a barrier does not)")
_SERVER_LEFT_HINT = ("a server ends only once every worker has finished: find what ended it "
                     "early (os._exit or sys.exit in one of its threads or signal handlers, a "
                     "library that exits); its output above may say")
_STALLED_HINT = ("its threads' stacks are printed above: find why it did not reach the "
                 "communication its peers waited in (a loop or a wait that does not end, a "
                 "slow read); if it is only slow, raise --timeout")
_BEHIND_HINT = ("its threads' stacks are printed above: it was working, not waiting for an "
                "answer; if it is only slower than the others (a slower device, a larger share "
                "of the work), raise --timeout")
#: ... and for one that waits elsewhere (another server, a collective) while its push is due.
_BEHIND_WAITING_HINT = ("its threads' stacks are printed above: it waits elsewhere, not pushing "
                        "here: look for a push_pull, a layer or a step that only some workers "
                        "run (a branch on the rank, fewer batches on one worker); if a peer it "
                        "waits for is only slower, raise --timeout")


@dataclass(frozen=True)
class _Failure:
    spec: ProcessSpec
    exitcode: int
    cause: str
    time: float
    secondary: bool  # it failed because another process had failed first
    label: str = ""  # what the process said it is (Context.set_label), e.g. a pipeline stage
    hint: str = _SEE_TRACEBACK
    waited_s: float | None = None  # it timed out waiting for peers, after so long (0: unknown)
    lost: int | None = None  # the rank of the peer it lost, where it knows
    bad_input: bool = False  # it raised ConfigError
    names_waited_for: bool = False  # its cause names whom it waited for (CommTimeout's)

    def order(self) -> tuple[int, float]:
        return (1 if self.secondary else 0, self.time)

    def describe(self) -> str:
        label = f", {self.label}" if self.label else ""
        return (f"{self.spec.role} rank {self.spec.rank} (machine {self.spec.machine}{label}) "
                f"failed: {self.cause}")


def refuse_at_import(call: str) -> None:
    """Refuse ``call`` (one that starts a run) in a launched process importing the launching
    script: the script makes it when imported, so every process would start a run."""
    if _env.loading_main():
        name = call.removeprefix("polytrain.").removeprefix("train.")
        raise ConfigError(f"{call} ran in a launched process, as it imported the launching "
                          f"script: the script calls {name} when imported, so every process "
                          f"would start a run of its own",
                          "put the call under `if __name__ == \"__main__\":`, as in the "
                          "README's example (as multiprocessing requires)")


class Launcher:
    """Runs one :class:`Layout` as local processes on ``127.0.0.1``.

    Every process gets its rank, role and machine in its environment (the
    variables torchrun sets, each machine a group, but ``TORCHELASTIC_RUN_ID``;
    plus ``POLYTRAIN_ROLE`` and ``POLYTRAIN_NODE``). If
    one fails or dies, the others are stopped and :class:`LaunchError` names the
    first one to fail: its rank, role, machine and the cause.

    With a ``shape``, every machine runs in a network namespace of its own,
    joined to the others by links of that shape (:class:`~.network.Network`),
    made before the first process starts and removed after the last one ends.

    Args:
        layout: the processes to start.
        port: rendezvous port (default: a free one); a port in use is refused.
        env: extra environment variables for every process.
        timeout_s: polytrain's communication timeout inside the processes (default 120 s);
            a process without a heartbeat for half of it is reported as hung.
        shape: emulate the machines' network with links of this rate and delay (default:
            none, every process on this host's loopback).
        rank_prefix: start each line a process's script prints (on its ``sys.stdout`` and
            ``sys.stderr``) with ``[rank R role@machine]``, where there are several
            processes (default True).
    """

    def __init__(self, layout: Layout, *, port: int | None = None,
                 env: Mapping[str, str] | None = None, timeout_s: float | None = None,
                 shape: LinkShape | None = None, rank_prefix: bool = True) -> None:
        check_port(port)
        for key, value in (env or {}).items():  # Popen's TypeError, in the fork server
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"env[{key!r}] = {value!r}: environment variables are "
                                  f"strings", f"pass env={{{key!r}: {str(value)!r}}}")
        if timeout_s is not None:
            _env.check_seconds(timeout_s, "--timeout", "pass --timeout 120")
        else:  # POLYTRAIN_TIMEOUT (else the default), read once here: a bad value is one line
            timeout_s = _env.timeout_of({**os.environ, **(env or {})})
        self.layout = layout
        self.shape = shape
        self.host = "127.0.0.1"
        if shape is not None:
            check_tools()  # before anything starts: one line on what is missing
            port = _NETWORK_PORT if port is None else port
        elif port is None:
            port = free_port()
        else:
            _check_port(port)
        self.port = port
        self.env = dict(env or {})
        self.timeout_s = timeout_s
        self.rank_prefix = rank_prefix and layout.world_size > 1
        self._last_check = 0.0  # time.monotonic() of the last heartbeat check

    def run_fn(self, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` in every process; return the workers' results by rank."""
        refuse_at_import("polytrain.launch()")
        try:
            target = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ConfigError(
                f"launch() cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to "
                f"the processes ({e})",
                "pass a function defined at module level, with picklable arguments") from None
        main = sys.modules.get("__main__")
        fn_module = getattr(fn, "__module__", None)
        if fn_module == "__main__" and not getattr(main, "__file__", None):
            # A process finds the function by importing the launching script, and `python -c`,
            # stdin, a REPL or a notebook have none (it ran polytrain's own main, or failed
            # to find the function, in every process).
            raise ConfigError(
                f"launch() cannot send {getattr(fn, '__qualname__', fn)!r}: it is defined in "
                f"an interactive session, `python -c` or stdin, which the processes cannot "
                f"import", "define the function in a module or script file, and launch it "
                "from there (or run the script with `polytrain launch`)")
        # A script run as `python -m pkg.job` is imported by that name, as multiprocessing's
        # spawn does (its relative imports need its package); `python job.py` by its path.
        # A package's __main__.py (`python -m pkg`, `python -m pytest`) is not imported by
        # name, as spawn skips it too: it usually calls launch() unguarded. Its path is
        # run only where the function is defined in it (else its own module holds it).
        name = getattr(getattr(main, "__spec__", None), "name", None)
        main_file = getattr(main, "__file__", None)
        if name is not None and (name == "__main__" or name.endswith(".__main__")):
            name, main_file = None, (main_file if fn_module == "__main__" else None)
        payload = {"kind": "fn", "target": target, "sys_path": list(sys.path),
                   "main_file": main_file, "main_module": name,
                   "argv": list(sys.argv), "rank_prefix": self.rank_prefix}
        return self._run(payload)

    def run_script(self, script: str, argv: Sequence[str] = ()) -> None:
        """Run ``python SCRIPT ARGV...`` in every process."""
        if not Path(script).is_file():
            what = "is a directory" if Path(script).is_dir() else "does not exist"
            raise ConfigError(f"script {script!r} {what}", "pass the path of a Python file")
        payload = {"kind": "script", "script": str(Path(script).resolve()), "argv": list(argv),
                   "sys_path": [], "main_file": None, "rank_prefix": self.rank_prefix}
        self._run(payload)

    # -- processes --------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        """Every process's environment before its own variables: what this process has, and
        what the launcher was given."""
        return {**_env.inherited(), **self.env}

    def _child_env(self, spec: ProcessSpec, files: tuple[Path, ...], shm: Path | None,
                   network: Network | None) -> dict[str, str]:
        error, result, label, heartbeat, stacks, held, crash = files
        env = self._base_env()
        env[_env.RUN_DIR] = str(error.parent)  # the work directory
        if network is not None:
            env.update(network.child_env(spec.machine))
        on_machine = sum(1 for p in self.layout.processes() if p.machine == spec.machine)
        env.update({
            _env.RANK: str(spec.rank),
            _env.WORLD_SIZE: str(self.layout.world_size),
            _env.LOCAL_RANK: str(spec.local_rank),
            _env.LOCAL_WORLD_SIZE: str(on_machine),
            _env.MASTER_ADDR: (self.host if network is None
                               else network.address(self.layout.processes()[0].machine)),
            _env.MASTER_PORT: str(self.port),
            _env.ROLE: spec.role,
            _env.NODE: spec.machine,
            _env.ERROR_FILE: str(error),
            _env.RESULT_FILE: str(result),
            _env.LABEL_FILE: str(label),
            _env.HEARTBEAT_FILE: str(heartbeat),
            _env.STACKS_FILE: str(stacks),
            _env.HELD_FILE: str(held),
            _env.CRASH_FILE: str(crash),
            _env.PARENT_PID: str(os.getpid()),
        })
        env.update(_torchrun_env(self.layout, spec, self.env))
        if spec.role == WORKER:  # every machine here is on this host: workers are ranks 0..W-1
            env[_env.HOST_WORKER] = str(spec.rank)
        if self.timeout_s is not None:
            env[_env.TIMEOUT] = str(self.timeout_s)
        if shm is not None:
            env[_env.SHM_DIR] = str(shm)
        if not _env.user_set(_env.OMP_NUM_THREADS) and _env.OMP_NUM_THREADS not in self.env:
            env[_env.OMP_NUM_THREADS] = str(_env.process_threads(self.layout.world_size))
        return env

    def _run(self, payload: dict[str, Any]) -> list[Any]:
        # The launcher's pid in the name: tools find a run's processes.json by it, and the
        # next launcher removes it if this one is killed before it can.
        tmp_root = Path(tempfile.gettempdir())
        sweep_stale(tmp_root, "polytrain-", "the work directory")
        with tempfile.TemporaryDirectory(prefix=run_prefix("polytrain-"), dir=tmp_root) as tmp:
            workdir = Path(tmp)
            mark_owner(workdir)
            payload_file = workdir / "payload.pkl"
            payload_file.write_bytes(pickle.dumps(payload))
            children: list[_Child] = []
            interrupted = threading.Event()
            caught: list[int] = []  # the signals that interrupted the run

            def interrupt(signum: int, frame: Any) -> None:
                caught.append(signum)
                interrupted.set()
            # Our own handlers, not Python's default: SIGTERM (timeout, docker stop, Slurm)
            # ended the launcher at once, leaving its work directory and shared memory
            # behind; SIGHUP: the terminal or ssh session closed. A flag, checked between
            # polls, also keeps the interrupt out of the middle of subprocess's own
            # bookkeeping. (SIGTERM is how the run stops its processes: always caught.)
            previous = take_interrupts(interrupt, always=(signal.SIGTERM,))
            network: Network | None = None
            shm: Path | None = None
            oom_kills_before = oom_kills()
            adopters: list[ForkServer] = []  # the fork server: it adopts its children's orphans
            try:
                shm = run_shm()
                if self.shape is not None:
                    network = Network(self.layout.machines(), self.shape)
                    network.open()
                server = server_for(self._base_env())
                if server is not None:
                    adopters.append(server)
                for spec in self.layout.processes():
                    if interrupted.is_set():
                        break  # Ctrl-C while starting: those started are stopped below
                    files = _files(workdir, spec.rank)
                    try:
                        proc = _start(payload_file, self._child_env(spec, files, shm, network),
                                      server, network, spec.machine)
                    except OSError as e:
                        raise LaunchError(
                            f"could not start {spec.role} rank {spec.rank} (machine "
                            f"{spec.machine}): {e}", _START_HINT, rank=spec.rank,
                            role=spec.role, machine=spec.machine) from None
                    now = time.monotonic()
                    children.append(_Child(spec, proc, *files, started=now, beat_seen=now))
                    # One warning, not one each: a start the server failed (it may not yet
                    # have been seen to end) leaves it out for the run's other processes.
                    if server is not None and (not server.alive or
                                               not isinstance(proc, ForkedProcess)):
                        server = None
                _write_processes(workdir, children)
                log.info("started %d processes on port %d: %s", len(children), self.port,
                         self.layout.describe())
                self._watch(children, interrupted, oom_kills_before)
            except KeyboardInterrupt:
                interrupted.set()
            finally:
                try:
                    self._stop(children)
                    _stop_left_behind(workdir, {c.proc.pid for c in children}, adopters,
                                      clean=not interrupted.is_set() and all(
                                          c.proc.poll() == 0 for c in children))
                finally:
                    if shm is not None:
                        shutil.rmtree(shm, ignore_errors=True)
                    if network is not None:
                        network.close()
                    # Only now: a second SIGTERM while stopping would have ended the launcher
                    # before it removed what the run made.
                    for s, handler in previous.items():
                        signal.signal(s, handler)
            if interrupted.is_set():
                raise interrupted_error(caught, f"stopped all {len(children)} processes")
            return [_read_result(c.result_file) for c in children if c.spec.role == "worker"]

    def _hang_after_s(self) -> float:
        # Half the timeout: a hang is found (and named) before its peers' waits time out.
        return 0.5 * self._timeout()

    def _check_heartbeats(self, children: list[_Child]) -> list[_Child]:
        """The running children whose heartbeat has not changed for half the timeout (hung),
        on the launcher's monotonic clock. A launcher that was itself stopped for a while
        (Ctrl-Z then fg stops the children too) gives every child that long again."""
        now, limit = time.monotonic(), self._hang_after_s()
        if now - self._last_check > _PAUSED_S:
            for c in children:
                c.beat_seen = max(c.beat_seen, now)
        self._last_check = now
        hung = []
        for c in children:
            if c.proc.poll() is not None:
                continue
            try:
                mtime: int | None = c.heartbeat_file.stat().st_mtime_ns
            except OSError:  # no beat yet: the child is still importing
                mtime = None
            if mtime != c.beat_mtime:
                c.beat_mtime, c.beat_seen = mtime, now
            age, first = now - c.beat_seen, c.beat_mtime is None
            if age > (max(limit, _FIRST_BEAT_S) if first else limit):
                state = _proc_state(c.proc.pid)
                c.hung = (f"stopped answering: no heartbeat for {age:.1f} s (half of "
                          f"--timeout {2 * limit:g}){f'; process state {state}' if state else ''}")
                c.hint = _STOPPED_HINT if state.startswith("T") else _SILENT_HINT
                hung.append(c)
        return hung

    def _left_early(self, children: list[_Child], waiter: _Failure) -> list[_Child]:
        """What ``waiter``, which failed waiting for its peers (a timeout, or a peer gone), may
        have waited for, when nobody stalled: the workers whose script had ended (well) before
        it failed; the servers that ended without joining the run; the peer it lost, if that
        one exited with code 0 (a server ends only after every worker has finished); any
        process that exited with code 0 before its script ended (``os._exit(0)``). Not the
        workers whose script ended where ``waiter``'s cause names whom it waited for."""
        found = []
        for c in children:
            if c.spec == waiter.spec or c.proc.returncode not in (None, 0):
                continue
            beat = _last_beat(c)
            ended = beat.get("script_ended")
            if not isinstance(ended, (int, float)) or ended > waiter.time:
                ended = None
            if c.spec.role == "worker" and ended is not None:
                if waiter.names_waited_for:  # its cause names them already, and says why
                    continue
                how = (f"'s wait timed out (after {waiter.waited_s:g} s)" if waiter.waited_s
                       else " lost a peer")
                c.hung = (f"ended its script {waiter.time - ended:.1f} s before "
                          f"{waiter.spec.role} rank {waiter.spec.rank}{how}: its peers may "
                          f"have waited for it")
                c.hint = _LEFT_HINT
            elif c.spec.role != "worker" and ended is not None and beat.get("joined") is False:
                c.hung = (f"ended its script without joining the run (polytrain.init() was "
                          f"never called there), {waiter.time - ended:.1f} s before "
                          f"{waiter.spec.role} rank {waiter.spec.rank} failed waiting for it")
                c.hint = _UNJOINED_HINT
            elif c.proc.returncode == 0 and (
                    c.spec.rank == waiter.lost or (beat and beat.get("script_ended") is None)):
                ended = waiter.time  # when, the launcher cannot tell: before the waiter failed
                who = f"{waiter.spec.role} rank {waiter.spec.rank}"
                c.hung = (f"exited with code 0 while {who} still needed it: {who} lost it "
                          f"mid-run" if c.spec.rank == waiter.lost else
                          f"exited with code 0 without returning from its script (its "
                          f"heartbeat never said it returned), while {who} still needed it")
                c.hint = _EXITED_HINT if c.spec.role == "worker" else _SERVER_LEFT_HINT
            else:
                continue
            found.append((ended, c))
        return [c for _, c in sorted(found, key=lambda ec: ec[0])]

    def _holding(self, children: list[_Child], waiter: _Failure) -> list[_Child]:
        """The servers that report answers held past half the timeout, why each waits and
        what to do (``ps/server.py`` writes them, as JSON): what ``waiter`` may have timed
        out on, when no process stalled or left early (pushes that never came: a push_pull
        only some workers make). Where a server says whose pushes the answers wait for
        (processes behind the others, working), those are named instead, the one that has
        worked longest without waiting first, and write their stacks."""
        def working(c: _Child) -> float:  # since when it has worked (inf: it waits)
            since = _last_beat(c).get("working_since")
            return since if isinstance(since, (int, float)) else float("inf")

        found, behind = [], []
        for c in children:
            # A server that ended well has removed its file; one that failed since (it lost
            # the worker that timed out, say) still says what it held.
            if c.spec == waiter.spec or c.proc.poll() == 0:
                continue
            try:
                held = json.loads(c.held_file.read_text())
            except (OSError, ValueError):
                continue
            late = [b for b in children if b.spec.rank in held.get("behind", ())
                    and b.proc.poll() is None and b not in behind]
            for b in late:
                b.hung = (f"fell behind the others: {c.spec.role} rank {c.spec.rank} held "
                          f"answers that wait for its pushes, and {waiter.spec.role} rank "
                          f"{waiter.spec.rank} timed out waiting"
                          f"{f' {waiter.waited_s:g} s' if waiter.waited_s else ''}: "
                          f"{held['held']}")
                # One that waits itself (a push it skipped, say) is not "working".
                b.hint = _BEHIND_HINT if working(b) < float("inf") else _BEHIND_WAITING_HINT
            behind += late
            if not late:
                c.hung = ("held answers the workers waited for, and could not give them: "
                          f"{held['held']}")
                c.hint = held["hint"]
                found.append(c)
        if not behind:
            return found
        behind.sort(key=lambda c: (working(c), c.spec.rank))
        _print_stacks(behind, "named as behind")
        return behind

    def _left_waiting(self, children: list[_Child], looked: set[int]) -> _Failure | None:
        """A process that exited with code 0 after its wait in leaving the run at exit timed
        out (a warning; its error record says how long it waited), among those not
        ``looked`` at yet (ranks)."""
        for c in children:
            if c.proc.returncode != 0 or c.spec.rank in looked:
                continue
            looked.add(c.spec.rank)
            if c.error_file.exists():
                left = _failure(c, None)
                if left.waited_s is not None:
                    return left
        return None

    def _warn_alone(self, children: list[_Child], left: _Failure) -> None:
        """Name, without stopping them, the processes still working without waiting for any
        peer since ``left`` timed out leaving the run at exit: one stuck after the last
        collective hangs the run, as no process fails on it; one finishing work of its own
        (a save on rank 0) must not be cut short, so the run ends when it does."""
        for c in self._stalled(children, [], left, "named as still running alone"):
            # Printed, as its stacks are: a warning the launching script's logging may hide.
            print(f"polytrain: warning: {c.spec.role} rank {c.spec.rank} (machine "
                  f"{c.spec.machine}) is still running: "
                  f"{c.hung.replace('stopped making progress: ', '')}; the run ends when it "
                  f"does. HINT: if it is stuck, stop the run (Ctrl-C: its stacks are printed "
                  f"above); if it is finishing work of its own, its peers left without it: do "
                  f"that work before the script's last collective, or raise --timeout",
                  file=sys.stderr, flush=True)
            c.hung, c.hint = "", ""  # named only: it fails the run no more than before

    def _timeout(self) -> float:
        return self.timeout_s if self.timeout_s is not None else _env.DEFAULT_TIMEOUT_S

    def _stalled(self, children: list[_Child], failed: list[_Child], waiter: _Failure,
                 why: str = "named as stalled") -> list[_Child]:
        """The running children whose main thread has worked, without being seen waiting for
        any peer, since before ``waiter`` began the wait that timed out, or for half the
        timeout (oldest first): what it waited for. Each writes its threads' stacks (SIGUSR2:
        faulthandler), printed here under its name."""
        assert waiter.waited_s is not None
        began = (waiter.time - waiter.waited_s if waiter.waited_s > 0
                 else time.time() - self._hang_after_s())
        # Or for half the timeout (what a silent process gets before it is taken for hung),
        # if it began after the wait did: the waiter may have waited on it through a third
        # process (a server's answer that needs its pushes) from before it stopped.
        began = max(began, time.time() - self._hang_after_s())
        found = []
        for c in children:
            if c in failed or c.proc.poll() is not None:
                continue
            beat = _last_beat(c)
            since, where = beat.get("working_since"), beat.get("where")
            if isinstance(since, (int, float)) and since <= began + _STALL_SLACK_S:
                c.hung = (f"stopped making progress: its main thread has worked for "
                          f"{time.time() - since:.1f} s without waiting for any peer, now at "
                          f"{where}, while {waiter.spec.role} rank {waiter.spec.rank} timed out "
                          f"waiting{f' {waiter.waited_s:g} s' if waiter.waited_s else ''}")
                c.hint = _STALLED_HINT
                found.append((since, c))
        stalled = [c for _, c in sorted(found, key=lambda sc: sc[0])]
        _print_stacks(stalled, why)
        return stalled

    def _watch(self, children: list[_Child], interrupted: threading.Event,
               oom_kills_before: int | None) -> None:
        """Poll the children until all end well, or name the first failure's root cause
        (``oom_kills_before``: the kernel's OOM kill count when the run started)."""
        beat_check = 0.0
        self._last_check = time.monotonic()
        # A process that left the run at exit after its wait there timed out, and when
        # (monotonic) those still running are looked at once for one working alone since.
        left: _Failure | None = None
        look_at, looked = math.inf, set[int]()
        while not interrupted.is_set():
            codes = [c.proc.poll() for c in children]
            failed = [c for c, code in zip(children, codes) if code not in (None, 0)]
            if not failed and time.monotonic() - beat_check > 0.5:
                beat_check = time.monotonic()
                failed = self._check_heartbeats(children)
                if left is None and (left := self._left_waiting(children, looked)):
                    look_at = time.monotonic() + self._timeout()
                if not failed and left is not None and time.monotonic() >= look_at:
                    look_at = math.inf
                    self._warn_alone(children, left)
            if failed:
                # A stopped process (SIGSTOP) is the root cause of its peers' timeouts.
                for c in children:
                    if c not in failed and c.proc.poll() is None and not c.hung:
                        state = _proc_state(c.proc.pid)
                        if state.startswith("T"):
                            c.hung = f"stopped answering: process state {state}"
                            c.hint = _STOPPED_HINT
                            failed.append(c)
            if failed and interrupted.is_set():
                return  # Ctrl-C in a terminal reaches the children too: not a failure
            if failed:
                failures = [_failure(c, oom_kills_before) for c in failed]
                hung = [c for c in failed if c.hung]
                if all(f.secondary for f in failures):
                    # They lost a peer: the peer, still exiting, holds the cause. Let it write it.
                    deadline = time.monotonic() + _CAUSE_GRACE_S
                    while time.monotonic() < deadline and all(
                            c.proc.poll() in (None, 0) for c in children if c not in failed):
                        time.sleep(_POLL_S)
                waiter = min(failures, key=_Failure.order)
                if waiter.waited_s is not None or waiter.secondary:
                    timed_out = waiter.waited_s is not None
                    stalled = ((self._stalled(children, failed, waiter) if timed_out else [])
                               or self._left_early(children, waiter)
                               or (self._holding(children, waiter) if timed_out else []))
                    # A failed server the held answers name (_holding) is failed already:
                    # its report replaces its own failure.
                    named = {c.spec for c in stalled}
                    failures = [f for f in failures if f.spec not in named]
                    failures += [_failure(c, oom_kills_before) for c in stalled]
                    failed += [c for c in stalled if c not in failed]
                    hung += stalled
                self._stop(children, kill=hung)
                # Whoever else died before we stopped them counts too: pick the root cause.
                failures += [_failure(c, oom_kills_before) for c in children
                             if c not in failed and c.proc.returncode not in (None, 0)
                             and not c.stopped_by_us]
                first = min(failures, key=_Failure.order)
                others = len(failures) - 1
                tail = f" ({others} other process{'es' if others > 1 else ''} failed after it)" \
                    if others else ""
                raise LaunchError(
                    first.describe() + tail, first.hint,
                    rank=first.spec.rank, role=first.spec.role, machine=first.spec.machine,
                    exitcode=first.exitcode, bad_input=first.bad_input)
            if all(code == 0 for code in codes):
                return
            time.sleep(_POLL_S)

    def _stop(self, children: list[_Child], kill: Sequence[_Child] = ()) -> None:
        running = [c for c in children if c.proc.poll() is None]
        for c in running:
            c.stopped_by_us = True
            # A hung process may be stopped (SIGSTOP): SIGTERM would wait until it resumes.
            c.proc.send_signal(signal.SIGKILL if c in kill else signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for c in running:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                try:
                    c.proc.wait(timeout=_GRACE_S)
                except subprocess.TimeoutExpired:  # stuck in the kernel (state D): leave it
                    log.warning("%s rank %d (pid %d) did not end %g s after SIGKILL (%s)",
                                c.spec.role, c.spec.rank, c.proc.pid, _GRACE_S,
                                _proc_state(c.proc.pid) or "state unknown")


def _torchrun_env(layout: Layout, spec: ProcessSpec, given: Mapping[str, str]) -> dict[str, str]:
    """The rest of what torchrun's agent sets in ``spec``'s environment: its machine as the
    group, its role's name, rank and size; restarts as ``given`` says (a run_config restart
    may), else none. Not ``TORCHELASTIC_RUN_ID``: it says torchrun started the process."""
    machines = layout.machines()
    peers = [p.rank for p in layout.processes() if p.role == spec.role]
    return {"GROUP_RANK": str(machines.index(spec.machine)),
            "GROUP_WORLD_SIZE": str(len(machines)),
            "ROLE_NAME": spec.role,
            "ROLE_RANK": str(peers.index(spec.rank)),
            "ROLE_WORLD_SIZE": str(len(peers)),
            **{name: given.get(name, "0")
               for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")}}


def _write_processes(workdir: Path, children: list[_Child]) -> None:
    """``processes.json`` in the run's directory: every process's rank, role, machine and
    pid (a forked child's command line and /proc environ are its fork server's, so tools
    that look for a rank's process, fault injectors or a profiler, read it here)."""
    record = [{"rank": c.spec.rank, "role": c.spec.role, "machine": c.spec.machine,
               "pid": c.proc.pid} for c in children]
    (workdir / "processes.json.tmp").write_text(json.dumps(record))
    os.replace(workdir / "processes.json.tmp", workdir / "processes.json")


def _start(payload_file: Path, env: dict[str, str], server: ForkServer | None,
           network: Network | None, machine: str) -> Process:
    """Start ``python -m polytrain.launch.child PAYLOAD`` with ``env`` on ``machine`` (in its
    namespace of ``network``, if any): forked from the fork ``server`` (no import of torch of
    its own), or as a fresh interpreter where there is none or it failed."""
    netns = network.namespace_file(machine) if network else None
    if server is not None and (network is None or netns is not None):
        try:
            return server.start(str(payload_file), env, netns)
        except OSError as e:
            log.warning("the fork server could not start a process (%s): it starts as a fresh "
                        "interpreter", e)
    return subprocess.Popen(
        [*(network.exec_prefix(machine) if network else []), sys.executable, "-m",
         "polytrain.launch.child", str(payload_file)],
        env=env)


SHM_ROOT = Path("/dev/shm")


def run_shm(root: Path = SHM_ROOT) -> Path | None:
    """A fresh directory in host shared memory for one run's processes (their
    ``POLYTRAIN_SHM_DIR``; the launcher removes it when the run ends, however it ends), after
    removing those of launchers that no longer run (killed before they could). None where
    there is no ``root``."""
    if not root.is_dir():
        return None
    return owned_dir(root, "polytrain-run-", "the shared memory")


def owned_dir(root: Path, kind: str, what: str) -> Path:
    """A fresh directory ``kind``... in ``root`` that this process owns, after removing
    those (:func:`sweep_stale`) whose owner no longer runs; ``what`` names them in its log."""
    sweep_stale(root, kind, what)
    path = root / f"{run_prefix(kind)}{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    mark_owner(path)
    return path


def run_prefix(kind: str) -> str:
    """``kind`` + this process's pid and start time: the name :func:`sweep_stale` reads."""
    me = os.getpid()
    return f"{kind}{me}-{start_time(me)}-"


_OWNER = ".polytrain-owner"  # in a run's directory: the process (a launcher) that made it


def mark_owner(path: Path) -> None:
    """Mark ``path`` as a directory this process made: :func:`sweep_stale` removes only
    marked ones."""
    (path / _OWNER).write_text(json.dumps(owner_record()))


def sweep_stale(root: Path, kind: str, what: str) -> None:
    """Remove ``root``'s directories that a process made (named by :func:`run_prefix` of
    ``kind`` and a random suffix, and marked by :func:`mark_owner`) and that process no
    longer runs (killed before it could remove them itself): the pid is gone or reused.

    The processes still running with such a directory in their environment, or holding a
    member file there open (what the dead run's processes started or forked), are stopped
    first.

    Anything else is left alone: a user's folder named ``polytrain-2024-06-01``; a directory
    of a process in another PID namespace (a container sharing /tmp or /dev/shm) or on
    another host (a shared file system), whose pid says nothing here; one a process was
    killed in before it marked it (empty).
    """
    name = re.compile(rf"{re.escape(kind)}(\d+)-(\d+)-[a-z0-9_]{{8}}")
    for stale in root.glob(f"{kind}*"):
        if not name.fullmatch(stale.name) or stale.is_symlink() or not stale.is_dir():
            continue
        try:
            owner = owner_alive(json.loads((stale / _OWNER).read_text()))
        except (OSError, ValueError):
            continue
        if owner is not None and not owner[1]:
            pid = owner[0]
            # What its processes started outlives a kill -9 of that launcher (Linux's
            # parent-death signal reaches its children, not theirs): stopped here.
            _stop_left_behind(stale, set(), clean=False)
            shutil.rmtree(stale, ignore_errors=True)
            log.warning("removed %s of a run whose process (pid %d) is gone: %s", what, pid,
                        stale)


def _last_beat(child: _Child) -> dict[str, Any]:
    """The child's last heartbeat record (where its main thread is, since when it has worked
    without waiting for a peer, when its script ended); {} if none was written yet."""
    try:
        beat = json.loads(child.heartbeat_file.read_text())
    except (OSError, ValueError):
        return {}
    return beat if isinstance(beat, dict) else {}


def _run_processes(workdir: Path, adopters: Collection[ForkServer] = ()) -> dict[int, str]:
    """The live processes whose environment names this run's work directory, with their
    role and rank: what the run's processes started (a forked child's own /proc environ is
    its fork server's, so the children themselves mostly do not show); those the fork
    servers ``adopters`` adopted, not their own children: what a forked child forked (a
    multiprocessing helper: its environ is the server's too) and left when it ended; and
    those that hold a run's process's member file open (launch/child.py), which what it
    forked inherits: found so once no fork server is left to adopt them (its launcher was
    killed, and init adopted them)."""
    entry = f"{_env.RUN_DIR}={workdir}".encode()
    member = os.path.join(os.path.realpath(workdir), _env.MEMBER_PREFIX)
    since = _made_at(workdir)  # nothing that started before the run's launcher is of the run
    adopted = set().union(*(s.adopted() for s in adopters))
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            variables = environ.read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if pid == os.getpid() or (entry in variables and _proc_state(pid).startswith("Z")):
            continue  # (an adopted process is never a zombie: adopted() leaves them out)
        if entry in variables:
            named = dict(v.split(b"=", 1) for v in variables if b"=" in v)
            found[pid] = (f"{named.get(_env.ROLE.encode(), b'?').decode()} rank "
                          f"{named.get(_env.RANK.encode(), b'?').decode()}")
        elif pid in adopted:
            found[pid] = "a worker or server that ended"
        elif (since is None or (start_time(pid) or 0) >= since) and \
                (held := _member_held(pid, member)) is not None:
            role, _, rank = held.partition("-")
            found[pid] = f"{role} rank {rank}"
    return found


def _made_at(workdir: Path) -> int | None:
    """When the launcher that made ``workdir`` started (clock ticks since boot, its mark's),
    or None where the mark does not say or is of another boot or PID namespace."""
    try:
        record = json.loads((workdir / _OWNER).read_text())
        if recorded_here(record):
            return int(record["start"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _member_held(pid: int, member: str) -> str | None:
    """The ``ROLE-RANK`` of the run's member file that ``pid`` holds open (``member``: the
    files' path up to it), or None."""
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except OSError:  # gone, or another user's
        return None
    for name in names:
        try:
            target = os.readlink(f"{fds}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(member):
            return target[len(member):]
    return None


def _stop_left_behind(workdir: Path, children: set[int],
                      adopters: Collection[ForkServer] = (), *, clean: bool) -> None:
    """Stop what the run's processes started and left running (a script's helper, a failed
    worker's orphans), found by the work directory in their environment; under --bandwidth
    such a process would also keep its machine's namespace alive. After a clean end they
    get a grace period to end by themselves (a data loader's workers do, within seconds)."""
    deadline = time.monotonic() + (_GRACE_S if clean else 0.0)
    while left := {p: who for p, who in _run_processes(workdir, adopters).items()
                   if p not in children}:
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    if not left:
        return
    by: dict[str, list[int]] = {}
    for pid, who in left.items():
        by.setdefault(who, []).append(pid)
    for who, pids in by.items():
        log.warning("%s left %d process%s running (pid %s): stopping %s", who, len(pids),
                    "" if len(pids) == 1 else "es", ", ".join(map(str, pids)),
                    "it" if len(pids) == 1 else "them")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(OSError):  # ended meanwhile
                os.kill(pid, sig)
        deadline = time.monotonic() + _GRACE_S
        while left and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            left = {p: who for p, who in _run_processes(workdir, adopters).items() if p in left}
        if not left:
            return


def _print_stacks(children: Sequence[_Child], why: str) -> None:
    """Have the children write their threads' stacks (SIGUSR2: faulthandler), and print each
    under its name."""
    for c in children:
        with contextlib.suppress(OSError):
            c.proc.send_signal(signal.SIGUSR2)
    for c in children:
        stacks = _written(c.stacks_file, _STACKS_S)
        print(f"[polytrain rank {c.spec.rank} {c.spec.role}@{c.spec.machine}] its "
              f"threads when {why}:\n{stacks or '(not written in time)'}",
              file=sys.stderr, end="" if stacks.endswith("\n") else "\n", flush=True)


def _proc_state(pid: int) -> str:
    """Linux's state of ``pid`` (``T (stopped)``, ``S (sleeping)``...), or "" if unknown."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].splitlines()[0].strip()
    except (OSError, IndexError):
        return ""


def _failure(child: _Child, oom_kills_before: int | None) -> _Failure:
    label = ""
    try:
        label = child.label_file.read_text().strip()
    except OSError:
        pass
    if child.hung:  # found by its heartbeat: the root cause, whatever it later exited with
        return _Failure(child.spec, child.proc.returncode or 1, child.hung, 0.0, False, label,
                        child.hint or _SEE_TRACEBACK)
    code = child.proc.returncode
    assert code is not None
    if child.error_file.exists():
        try:
            info = json.loads(child.error_file.read_text())
            hint = info.get("hint")
            return _Failure(child.spec, code, info["cause"], info["time"], info["secondary"],
                            label, hint or _SEE_TRACEBACK, info.get("waited_s"), info.get("lost"),
                            bool(info.get("bad_input")), bool(info.get("names_waited_for")))
        except (ValueError, KeyError, OSError):
            pass
    def oom(code: int) -> bool:
        return (code == -signal.SIGKILL and oom_kills_before is not None
                and (oom_kills() or 0) > oom_kills_before)

    server = getattr(child.proc, "server_end", None)
    if server is not None:  # it was forked, and its fork server died: it died with it
        pid, how, why = server
        return _Failure(child.spec, code, f"ended with the fork server that started it (pid "
                        f"{pid}), which {'was ' if how < 0 else ''}{_ended_how(how)}"
                        f"{f' ({why})' if why else _OOM_CAUSE if oom(how) else ''}",
                        0.0, False, label,
                        _OOM_HINT if oom(how) and not why else _SERVER_DIED_HINT)
    if code in _SIGNAL_EXITS:  # the child's own handler: a signal from outside the run,
        # reported as the signal (the CLI exits 1, not 143: a launcher's own interrupt's code)
        return _Failure(child.spec, 128 - code, f"ended by {_SIGNAL_EXITS[code]} (exit code "
                        f"{code})",
                        0.0, False, label, _SIGNALLED_HINT)
    if code < 0:
        # A process killed by a signal nobody in the run sent is the likeliest root cause.
        if oom(code):
            return _Failure(child.spec, code, f"{_ended_how(code)}{_OOM_CAUSE}", 0.0, False,
                            label, _OOM_HINT)
        _print_crash(child)
        return _Failure(child.spec, code, _ended_how(code), 0.0, False, label, _SIGNALLED_HINT)
    # No error of Python's (each writes its file): os._exit, or a library that exits.
    return _Failure(child.spec, code, _ended_how(code), time.time(), False, label,
                    _EXITED_HINT if child.spec.role == WORKER else _SERVER_LEFT_HINT)


#: The exit codes a child gives itself on a signal (launch/child.py: SIGTERM, SIGINT) without
#: an error file: they end it at once, as the signal would.
_SIGNAL_EXITS = {128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGINT: "SIGINT"}

_OOM_CAUSE = (", likely by the kernel's out-of-memory killer (its kill count rose during the "
              "run): the run needed more memory than this machine has")
_OOM_HINT = ("run fewer processes on this machine, or a smaller model or batch (every emulated "
             "machine shares this one's memory)")
_SERVER_DIED_HINT = ("find what ended the fork server (one per launching process: "
                     "polytrain.launch.forkserver); POLYTRAIN_FORKSERVER=0 starts every process "
                     "as a fresh interpreter instead")


def _print_crash(child: _Child) -> None:
    """Print what the child's faulthandler wrote when it crashed (SIGSEGV, SIGABRT...), under
    its name: every process shares the terminal, and the dump itself names no one."""
    try:
        dump = child.crash_file.read_text(errors="replace")
    except OSError:
        return
    if dump.strip():
        print(f"[polytrain rank {child.spec.rank} {child.spec.role}@{child.spec.machine}] "
              f"where it crashed (faulthandler):\n{dump}", file=sys.stderr,
              end="" if dump.endswith("\n") else "\n", flush=True)


def _ended_how(code: int) -> str:
    """How a process with exit status ``code`` (``Popen.returncode``'s) ended."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name} ({-code})"


def _written(path: Path, within_s: float) -> str:
    """The text another process is writing to ``path``, once its size has held for a poll
    (at most ``within_s``; "" if nothing came)."""
    deadline, size = time.monotonic() + within_s, -1
    while time.monotonic() < deadline:
        try:
            now = path.stat().st_size
        except OSError:
            now = 0
        if now and now == size:
            break
        size = now
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


def _read_result(path: Path) -> Any:
    if not path.exists():
        return None
    with path.open("rb") as f:
        return pickle.load(f)


def launch(fn: Callable[..., Any], *, workers: int = 1, nodes: int = 1, servers: int = 0,
           colocated: int = 0, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
           port: int | None = None, env: Mapping[str, str] | None = None,
           timeout_s: float | None = None, bandwidth: str | None = None,
           latency: str | None = None, rank_prefix: bool = True) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in every process of a local layout.

    Workers are spread evenly over ``nodes`` emulated machines; each of the
    ``servers`` runs on a CPU machine of its own, and ``colocated`` more servers
    run on every worker machine. Inside ``fn``, :func:`polytrain.init` joins the
    run (a server serves there and exits when the workers finish). With
    ``bandwidth`` (``"1gbit"``; and ``latency``, ``"0.2ms"``), every machine runs
    in a network namespace of its own behind a NIC of that shape (needs root and
    iproute2). Each line a process prints starts with ``[rank R role@machine]``
    where there are several (``rank_prefix=False``: as printed).

    Example::

        def main(steps):
            ctx = polytrain.init()
            ...
            return ctx.rank

        ranks = polytrain.launch(main, workers=4, nodes=2, args=(100,))

    In a process that ``polytrain launch SCRIPT`` or torchrun started, it calls
    ``fn`` in this process and returns ``[its return value]``: the same script
    runs either way. That launcher's options then apply; its run must have as
    many processes as the layout asked for here.

    Returns:
        the workers' return values, by rank.

    Raises:
        LaunchError: a process failed or died (the others are stopped); the
            message names its rank, role, machine and the cause.
    """
    # Before any process starts: launch(42) started processes that died, env=["A"] was an
    # AttributeError, rank_prefix="no" was taken for True, and args="abc" was fn('a', 'b', 'c').
    # Other iterables (a numpy array, a generator) were unpacked, as fn(*args): still so.
    if not isinstance(args, (str, bytes, Sequence)) and isinstance(args, Iterable):
        args = tuple(args)
    check_kinds(launch, {"fn": fn, "args": args, "kwargs": kwargs, "env": env,
                         "rank_prefix": rank_prefix}, what="launch() ")
    if isinstance(args, (str, bytes)):
        raise ConfigError(f"launch() args must be a sequence of fn's arguments, not a "
                          f"{type(args).__name__} (got {args!r:.60})", f"pass args=({args!r:.60},)")
    layout = Layout(workers=workers, nodes=nodes, servers=servers, colocated=colocated)
    by = None if _env.loading_main() else _env.started_by()
    if by is not None:
        if layout.world_size != _env.world_size():
            raise ConfigError(
                f"launch() asks for a run of {layout.world_size} processes, but {by} started "
                f"this process as one of {_env.world_size()}",
                f"give {by} the layout launch() asks for (workers={workers}, nodes={nodes}, "
                f"servers={servers}, colocated={colocated}), or the same to launch()")
        return [fn(*args, **dict(kwargs or {}))]
    return Launcher(layout, port=port, env=env, timeout_s=timeout_s,
                    shape=_link(layout, bandwidth, latency, python=True),
                    rank_prefix=rank_prefix).run_fn(fn, args, kwargs)


def launch_script(script: str, argv: Sequence[str] = (), *, layout: Layout,
                  port: int | None = None, env: Mapping[str, str] | None = None,
                  timeout_s: float | None = None, bandwidth: str | None = None,
                  latency: str | None = None, rank_prefix: bool = True) -> None:
    """Run a Python script in every process of ``layout`` (what ``polytrain launch`` does)."""
    Launcher(layout, port=port, env=env, timeout_s=timeout_s,
             shape=_link(layout, bandwidth, latency),
             rank_prefix=rank_prefix).run_script(script, argv)


def _link(layout: Layout, bandwidth: str | None, latency: str | None, *,
          python: bool = False) -> LinkShape | None:
    """``--bandwidth`` and ``--latency``'s shape for ``layout``, refused where it has no link
    between machines (as ``polytrain train`` refuses it: TrainConfig's check_link)."""
    shape = link_shape(bandwidth, latency)
    if shape is not None:
        check_links(layout, str(bandwidth), python=python)
    return shape
