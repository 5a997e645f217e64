"""One process that has imported torch and polytrain, and forks a run's processes from it.

A launched process that started as a fresh interpreter would import torch and
polytrain itself: about 3 s of CPU each, so a run of 6 processes on 2 cores
spent some 9 s starting, and a test suite of a few hundred runs most of its
time. The fork server imports them once per launching process and forks each
child from there (as multiprocessing's forkserver does), handing it the
launcher's environment, working directory and standard streams of that moment.

What it keeps of a fresh process's contract:

- the child is the launcher's child in all that the launcher watches: it is in
  the launcher's process group (Ctrl-C reaches it), its exit code comes back as
  ``Popen.returncode`` does (negative: the signal), and it dies with the
  launcher (``PR_SET_PDEATHSIG`` on the server, and on the child with the
  server as its parent);
- its environment is the launcher's, whole: a server is started per base
  environment (what the launcher inherited and was given, before it adds each
  process's own variables), so a variable read at import (``OMP_NUM_THREADS``,
  ``PYTHONPATH``, torch's) is the one the child would have read; the
  ``OMP_NUM_THREADS`` the launcher sets per run reaches torch's thread pools
  through ``torch.set_num_threads``;
- what the server's imports made is frozen (``gc.freeze()``): a child's collections
  skip it, and ``gc.get_objects()`` does not list it (a fresh interpreter's would);
- its random generators are seeded afresh, as a new interpreter's are (Python's
  string hashes are not: every forked child has the server's hash seed, so the
  order of a set of strings is the same on every rank; a bug that orders
  collectives by it shows only with ``POLYTRAIN_FORKSERVER=0`` or torchrun);
- its CPU affinity, resource limits (open files, core size, memory...; as
  ``setrlimit`` sets them: the main thread's stack size was fixed at the
  server's start) and umask are the launcher's of that moment;
- SIGINT and SIGHUP are ignored in it where the launcher ignores them (``nohup``,
  a shell script's background job), as a fresh interpreter inherits SIG_IGN; the
  server itself ignores both (it ends with the launcher).

The server never runs a tensor operation, starts no thread of its own and
touches no GPU, so forking it is safe. On an emulated network a child enters
its machine's network namespace (``setns``, before its script starts), where
``ip netns exec`` would have put a fresh interpreter (which would also see the
namespace's ``/sys``).
``POLYTRAIN_FORKSERVER=0`` turns the server off.
Should the server fail, the launcher falls back to fresh interpreters. A server that
ends before it started any process (an import failed, CUDA was initialised) or that
the launcher killed for not answering is not started again for that environment in
this launching process: the next runs start fresh interpreters at once, without a
server's start and failure each time.

Protocol (one ``SOCK_SEQPACKET`` socket pair, a pickled message per packet):
the launcher sends ``{"payload", "env", "cwd", "stdio", "netns", "affinity",
"limits", "umask", "ignored"}`` with its standard
streams' descriptors attached (``SCM_RIGHTS``); the server answers
``("started", pid)`` or ``("failed", reason)``, and later ``("exited", pid,
returncode)`` for every child it reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import pickle
import queue
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Mapping, Protocol

from .. import _env
from .host import own_status, proc_stat

__all__ = ["Process", "ForkedProcess", "ForkServer", "server_for"]

log = logging.getLogger(__name__)

# torch._dynamo: torch imports it on the first optimizer a process builds (1.2 s of CPU, more
# than a tiny test run's training); importing it starts no thread.
_PRELOAD = ("polytrain", "polytrain.train", "polytrain.launch.child", "torch._dynamo")
_MAX_MESSAGE = 1 << 20
_PR_SET_CHILD_SUBREAPER = 36
_START_S = 120.0  # the server imports torch before its first answer; a loaded machine is slow


class Process(Protocol):
    """What the launcher uses of a child process (``subprocess.Popen``'s names)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ForkedProcess:
    """A child of the fork server, seen from the launcher as a ``Popen``."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None
        self.args = ["polytrain fork server child", str(pid)]
        # Signals go through a pidfd: the server may reap the child before the launcher
        # hears of it, and a signal by pid could then reach a process that took the pid.
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self.server.returncode(self.pid))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.server.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self._ended(code)
        return code

    def _ended(self, code: int | None) -> None:
        self.returncode = code
        if code is not None and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:  # no pidfd (an old kernel): not reaped yet, so the pid is still this child's
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def server_end(self) -> tuple[int, int, str] | None:
        """The fork server's pid, exit code and, if the launcher killed it, why, if this child
        ended with it (killed when the server died, its own exit status then unknown); None
        otherwise."""
        code = self.server.orphaned.get(self.pid)
        return None if code is None else (self.server.pid, code, self.server.killed_because)


class ForkServer:
    """The launcher's side of one fork server (see the module's text)."""

    def __init__(self, base_env: Mapping[str, str]) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()  # one request at a time
        self._answers: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._ended = threading.Condition()
        self._codes: dict[int, int] = {}
        self._children: set[int] = set()
        self._gone = False
        self.orphaned: dict[int, int] = {}  # children that died with the server: its exit code
        self.killed_because = ""  # why the launcher killed the server, if it did
        self.served = False  # whether it ever started a process
        started = threading.Event()
        failed: list[BaseException] = []

        def keep() -> None:
            # The server dies with the thread that started it (PR_SET_PDEATHSIG): this one
            # lives as long as the server does, whatever thread launches.
            try:
                signal.pthread_sigmask(signal.SIG_BLOCK, _LAUNCHERS_SIGNALS)  # see _SERVER_CODE
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _SERVER_CODE, str(theirs.fileno()), str(os.getpid())],
                    pass_fds=(theirs.fileno(),), env=dict(base_env), stdin=subprocess.DEVNULL)
            except OSError as e:
                failed.append(e)
                return
            finally:
                theirs.close()
                started.set()
            self._proc.wait()

        threading.Thread(target=keep, name="polytrain-forkserver", daemon=True).start()
        started.wait()
        if failed:
            raise failed[0]
        self.pid = self._proc.pid
        threading.Thread(target=self._read, name="polytrain-forkserver-reader",
                         daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                message = b""
            if not message:
                break
            answer = pickle.loads(message)
            if answer[0] == "exited":
                with self._ended:
                    self._codes[answer[1]] = answer[2]
                    self._children.discard(answer[1])
                    self._ended.notify_all()
            else:
                self._answers.put(answer)
        # The server is gone; its children die with it (PR_SET_PDEATHSIG).
        try:
            code = self._proc.wait(timeout=_START_S)
        except subprocess.TimeoutExpired:  # its socket closed, but it lives on: kill it
            self._proc.kill()
            code = self._proc.wait()
        with self._ended:
            if self._children:
                log.warning("the fork server (pid %d) ended (code %d) with %d of its processes "
                            "running: they end with it", self.pid, code, len(self._children))
            self._gone = True
            for pid in self._children:
                self._codes.setdefault(pid, -signal.SIGKILL)
                self.orphaned[pid] = code
            self._children.clear()
            self._ended.notify_all()
        self._answers.put(("failed", "the fork server ended"))

    @property
    def alive(self) -> bool:
        return not self._gone and self._proc.poll() is None

    @property
    def unusable(self) -> str | None:
        """Why a server that ended cannot serve this environment (it never started a process,
        or the launcher killed it); None while it lives, or where it served and then ended
        (killed from outside, say: a new one may serve)."""
        if self.alive:
            return None
        if self.killed_because:
            return self.killed_because
        if not self.served:
            return f"it ended (code {self._proc.poll()}) before it started any process"
        return None

    def start(self, payload: str, env: Mapping[str, str],
              netns: str | None = None) -> ForkedProcess:
        """Fork a child that runs ``python -m polytrain.launch.child PAYLOAD`` with ``env``
        (in the network namespace of file ``netns``, if given); raises OSError where the
        server cannot."""
        env = {**env, _env.PARENT_PID: str(self.pid)}
        stdio = [fd for fd in (0, 1, 2) if _open(fd)]
        request = pickle.dumps({"payload": payload, "env": env, "cwd": os.getcwd(),
                                "netns": netns,
                                "stdio": stdio, "affinity": sorted(os.sched_getaffinity(0)),
                                "limits": {n: resource.getrlimit(n) for n in _LIMITS},
                                "umask": _umask(),
                                "ignored": [int(s) for s in _LAUNCHERS_SIGNALS
                                            if signal.getsignal(s) == signal.SIG_IGN]})
        with self._lock:
            if not self.alive:
                raise OSError("the fork server ended")
            socket.send_fds(self._sock, [request], stdio)
            try:
                answer = self._answers.get(timeout=_START_S)
            except queue.Empty:
                # Never used again: a late answer would be taken for the next request's.
                with self._ended:
                    self._gone = True
                    self.killed_because = (f"the launcher killed it: it did not answer a "
                                           f"request within {_START_S:g} s")
                with contextlib.suppress(OSError):
                    self._proc.kill()  # its children die with it
                raise OSError(f"the fork server did not answer within {_START_S:g} s") from None
            if answer[0] != "started":
                raise OSError(answer[1])
            pid = answer[1]
            self.served = True
            with self._ended:
                if self._gone:  # it died right after forking: so did the child
                    self._codes.setdefault(pid, -signal.SIGKILL)
                    code = self._proc.poll()
                    self.orphaned[pid] = -signal.SIGKILL if code is None else code
                elif pid not in self._codes:
                    self._children.add(pid)
            return ForkedProcess(self, pid)

    def returncode(self, pid: int) -> int | None:
        with self._ended:
            return self._codes.get(pid)

    def adopted(self) -> set[int]:
        """The live processes the server adopted (what its children forked and left when
        they ended), not the children it started: read while no start is in flight, so a
        child being forked for another run is never among them."""
        with self._lock:
            if not self.alive:  # its pid may be another process's now
                return set()
            with self._ended:
                own = set(self._children)
            return {pid for pid in live_children(self.pid) if pid not in own}

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._ended:
            self._ended.wait_for(lambda: pid in self._codes, timeout)
            return self._codes.get(pid)

    def close(self) -> None:
        """No more children; the server ends when the last one has (it keeps them alive)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)


def live_children(parent: int) -> set[int]:
    """The live (not zombie) processes whose parent is ``parent``, from /proc."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        fields = proc_stat(int(entry.name))
        if fields is not None and int(fields[1]) == parent and fields[0] not in ("Z", "X"):
            found.add(int(entry.name))
    return found


# The resource limits a forked child takes from its launcher (those this platform has).
_LIMITS = [getattr(resource, n) for n in (
    "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_RSS",
    "RLIMIT_NPROC", "RLIMIT_MEMLOCK", "RLIMIT_FSIZE", "RLIMIT_CPU") if hasattr(resource, n)]


def _umask() -> int | None:
    """This process's umask, read without setting it (``os.umask`` would change it for a
    moment, for every thread); None where Linux does not say (before 4.7)."""
    return own_status("Umask", 8)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


# Ctrl-C and a closed terminal are the launcher's to handle (or to ignore, as under
# `nohup`): the server ignores SIGINT and SIGHUP from its first line on, and the launcher's
# thread starts it with them blocked, so that one sent while the server starts, or imports
# torch, is discarded there (a pending signal set to be ignored is), not a KeyboardInterrupt
# traceback from the server beside the launcher's one line; it dies with the launcher. A
# child takes the launcher's SIG_IGN of them at its start (the request's "ignored"), and
# Python's own handling otherwise.
_LAUNCHERS_SIGNALS = (signal.SIGINT, signal.SIGHUP)
_SERVER_CODE = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "signal.signal(signal.SIGHUP, signal.SIG_IGN); "
                "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGHUP]); "
                "from polytrain.launch.forkserver import main; main()")
_Key = tuple[tuple[str, str], ...]
# Variables that change while the launching process runs and that no import reads: a child
# gets them as they are (its whole environment comes with each request), and a server is
# not started for each value. pytest names the test it runs in one: a server per test
# (torch imported again: some 3 s of CPU) had been most of the test suite's time. So would
# each attempt of a run_config, which sets torchrun's restart variables.
_NOT_READ_AT_IMPORT = frozenset({"PYTEST_CURRENT_TEST", "TORCHELASTIC_RESTART_COUNT",
                                 "TORCHELASTIC_MAX_RESTARTS"})
_servers: dict[_Key, ForkServer] = {}
_unusable: dict[_Key, str] = {}  # environments whose server failed: why
_servers_lock = threading.Lock()
# A process forked from the launcher (not by the server) does not share its servers.
os.register_at_fork(after_in_child=_servers.clear)
os.register_at_fork(after_in_child=_unusable.clear)


def server_for(base_env: Mapping[str, str]) -> ForkServer | None:
    """The fork server for children of base environment ``base_env`` (the launcher's, before
    each process's own variables; started on first use), or None where it is off
    (``POLYTRAIN_FORKSERVER=0``) or cannot start."""
    if not _env.forkserver_on(base_env):
        return None
    key = tuple(sorted((k, v) for k, v in base_env.items() if k not in _NOT_READ_AT_IMPORT))
    with _servers_lock:
        if key in _unusable:
            return None
        server = _servers.get(key)
        if server is not None and server.alive:
            return server
        if server is not None and (why := server.unusable) is not None:
            _unusable[key] = why
            log.warning("the fork server (pid %d) failed: %s; this process's launches start "
                        "fresh interpreters from now on (each imports torch itself)",
                        server.pid, why)
            return None
        for old in _servers.values():  # another environment now: its server ends
            old.close()
        _servers.clear()
        try:
            server = ForkServer(base_env)
        except OSError as e:
            log.warning("no fork server (%s): every process imports torch itself", e)
            return None
        _servers[key] = server
        return server


# -- the server ----------------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    accepting = True

    def answer(*message: Any) -> None:
        with contextlib.suppress(OSError):
            sock.send(pickle.dumps(message))

    while accepting or children:
        watched = [sock.fileno(), wake_r] if accepting else [wake_r]
        ready, _, _ = select.select(watched, [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # its children, and the orphans it adopted (reaped, not reported)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            if pid in children:
                children.discard(pid)
                answer("exited", pid, os.waitstatus_to_exitcode(status))
        if sock.fileno() in ready:
            try:
                message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            except OSError:
                message, fds = b"", []
            if not message:
                accepting = False
                continue
            request = pickle.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                answer("failed", f"fork: {e}")
                continue
            if pid == 0:
                _become_child(request, fds, sock, (wake_r, wake_w))
            for fd in fds:
                os.close(fd)
            children.add(pid)
            answer("started", pid)


def _become_child(request: dict[str, Any], fds: list[int], sock: socket.socket,
                  wake: tuple[int, int]) -> None:
    """In the forked child: become what ``python -m polytrain.launch.child`` would be."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ignored = request["ignored"]
        signal.signal(signal.SIGINT, signal.SIG_IGN if signal.SIGINT in ignored
                      else signal.default_int_handler)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if signal.SIGHUP in ignored
                      else signal.SIG_DFL)
        for target, fd in zip(request["stdio"], fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        os.chdir(request["cwd"])
        with contextlib.suppress(OSError, ValueError):  # the launcher's, not the server's
            os.sched_setaffinity(0, request["affinity"])
        for name, limit in request["limits"].items():
            with contextlib.suppress(OSError, ValueError):  # raising a hard limit needs root
                resource.setrlimit(name, limit)
        if request["umask"] is not None:
            os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        for stream in (sys.stdout, sys.stderr):  # a fresh interpreter decides per stream
            with contextlib.suppress(AttributeError, OSError, ValueError):
                stream.reconfigure(line_buffering=stream.isatty())  # type: ignore[union-attr]
        from . import child

        if request.get("netns"):  # its emulated machine's network, before any thread starts
            from .network import enter_namespace

            try:
                enter_namespace(request["netns"])
            except OSError as e:
                child.fail_to_start(f"could not enter its machine's network namespace ({e})",
                                    "set POLYTRAIN_FORKSERVER=0 to start each process through "
                                    "`ip netns exec` instead, and report this")
        _fresh_state()

        sys.argv = [child.__file__ or "polytrain.launch.child", request["payload"]]
        child.main()  # ends with os._exit on every path
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
    finally:
        os._exit(code)


def _fresh_state() -> None:
    """What a new interpreter would differ in: its thread count and its random seeds."""
    import random

    import torch

    random.seed()
    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    threads = os.environ.get(_env.OMP_NUM_THREADS, "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def main() -> None:
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    from .child import die_with

    die_with(parent)  # SIGINT and SIGHUP are ignored from _SERVER_CODE's first line on
    # What a forked child forks (a multiprocessing helper) has the server's /proc environ,
    # so the launcher cannot find it by the run's; orphaned, it comes to the server, whose
    # children the launcher can list.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    sock = socket.socket(fileno=fd)
    for name in _PRELOAD:
        __import__(name)
    import torch

    if torch.cuda.is_initialized():  # a fork would inherit a CUDA context it cannot use
        sys.exit("polytrain fork server: CUDA was initialised while importing; not forking")
    # What the imports made lives as long as the children: their collections skip it (a
    # child's gc.collect() at its end walked all of torch's objects, and copied their pages).
    gc.freeze()
    _serve(sock)
    os._exit(0)

