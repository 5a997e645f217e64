"""The first code a launched process runs: set up, run the target, report how it ended.

``python -m polytrain.launch.child PAYLOAD`` where PAYLOAD is the launcher's
pickle: a function with its arguments, or a script with its argv. A failure is
written to ``POLYTRAIN_ERROR_FILE`` as JSON (cause, time, whether it only
followed another process's failure) for the launcher to report.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import itertools
import json
import os
import pickle
import re
import runpy
import signal
import sys
import sysconfig
import threading
import time
import traceback
import types
from typing import Any, Iterator

from .. import _env
from ..errors import is_timeout

__all__ = ["main", "die_with"]

_BEAT_S = 0.5  # how often a child rewrites its heartbeat file (the launcher watches it)
# Errors that mean "a peer went away first": the launcher prefers other causes.
_SECONDARY_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "peer_lost")


def _hold_membership() -> None:
    """Open this process's member file in the run's work directory and never close it: what
    it forks without an exec (a multiprocessing helper) keeps the descriptor, so that the
    launcher, or the next one after a kill -9 of this one, finds and stops it where its
    /proc environ (the fork server's, for a forked child) does not name the run; inheritable,
    for an exec that keeps its descriptors."""
    run_dir = _env.run_dir()
    if not run_dir:
        return
    rank, role, _ = _env.identity()
    with contextlib.suppress(OSError):  # the launcher then finds its orphans less well
        fd = os.open(os.path.join(run_dir, f"{_env.MEMBER_PREFIX}{role}-{rank}"),
                     os.O_RDONLY | os.O_CREAT, 0o600)
        os.set_inheritable(fd, True)


def die_with(parent: int | None) -> None:
    """Ask Linux to kill this process when its parent ``parent`` (the launcher, or its fork
    server) dies, so no orphan survives it."""
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


# Where a main thread waits for its peers: torch.distributed, autograd (backward hooks wait
# for collectives), torch's futures and CUDA synchronisation, polytrain's communication
# machinery, and this module (a script that has ended, joining its threads). Anywhere else
# it is working.
_WAITING_IN = tuple(os.sep + os.path.join(*p) for p in (
    ("torch", "distributed", ""), ("torch", "autograd", ""), ("torch", "nn", "parallel", ""),
    ("torch", "futures", ""), ("torch", "cuda", ""), ("polytrain", "comm", ""),
    ("polytrain", "ps", ""), ("polytrain", "pipeline", ""), ("polytrain", "strategies", ""),
    ("polytrain", "runtime.py"), ("polytrain", "launch", "child.py")))
_STDLIB = sysconfig.get_paths()["stdlib"]
_POLYTRAIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SAMPLE_S = 0.05  # how often the heartbeat thread looks at the main thread
# What this interpreter's start put first on sys.path: '' for the fork server's `python -c`
# (which imports this module before it forks), the working directory for `python -m` (none
# under -P or PYTHONSAFEPATH, Python 3.11's).
_START_PATH = None if getattr(sys.flags, "safe_path", False) or not sys.path else sys.path[0]


def _frames(thread: threading.Thread) -> Iterator[types.FrameType]:
    """``thread``'s frames now, innermost first."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _thread_place(thread: threading.Thread) -> tuple[str, bool]:
    """Where ``thread`` is, as ``file:line in function`` of its innermost frame outside
    the standard library (and not ``<frozen ...>`` or ``<string>``), and whether that frame
    waits for the peers (see ``_WAITING_IN``)."""
    frames = _frames(thread)
    innermost = next(frames, None)
    if innermost is None:
        return "", False
    frame = next((f for f in itertools.chain([innermost], frames)
                  if not (name := f.f_code.co_filename).startswith("<")
                  and (not name.startswith(_STDLIB) or "-packages" in name)), innermost)
    name = frame.f_code.co_filename
    return (f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}",
            any(m in name for m in _WAITING_IN))


def _stack_files(thread: threading.Thread) -> set[str]:
    """The files of every frame on ``thread``'s stack now."""
    return {f.f_code.co_filename for f in _frames(thread)}


_script_ended: float | None = None  # when the script (or function) returned: the heartbeat says
_joined: bool | None = None  # whether it had joined the run (polytrain.init) when it returned
# The end record and the heartbeat thread's records are written under one lock: a beat built
# before the script ended must not replace the end record written after it.
_beat_lock = threading.Lock()


def _end_script() -> None:
    """Note when the script returned, and whether it had joined the run, in the heartbeat at
    once: a process that leaves while its peers still wait for it in a collective, or in the
    join it never made, is what they waited for."""
    global _script_ended, _joined
    runtime = sys.modules.get("polytrain.runtime")  # only if the script imported it
    path = _env.heartbeat_file()
    with _beat_lock:
        _joined = runtime is not None and runtime.has_joined()
        _script_ended = time.time()
        if path:
            with contextlib.suppress(OSError):  # a tmp file of its own: the thread's beside
                _write_json(path, {"where": "", "working_since": None,
                                   "script_ended": _script_ended, "joined": _joined},
                            tmp=".end")


def _start_heartbeat() -> None:
    """Rewrite the heartbeat file from a thread of its own, saying where the main thread is
    and since when it has worked without being seen waiting for its peers (it looks every
    50 ms; a training loop waits for its peers every step). A process that stops (SIGSTOP)
    or is frozen stops rewriting it, and the launcher reports it as hung; one that has
    worked since before a peer began the wait that timed out is what the peer waited for,
    and the launcher names it."""
    path = _env.heartbeat_file()
    if not path:
        return

    def beat() -> None:
        working_since: float | None = None
        written = 0.0
        while True:
            where, waiting = _thread_place(threading.main_thread())
            if waiting:
                working_since = None
            elif working_since is None:
                working_since = time.time()
            if time.monotonic() - written >= _BEAT_S:
                written = time.monotonic()
                try:
                    with _beat_lock:
                        if _script_ended is not None:
                            where, working_since = "", None  # as the end record says
                        _write_json(path, {"where": where, "working_since": working_since,
                                           "script_ended": _script_ended, "joined": _joined})
                except OSError as e:
                    if not _touch(path, e):
                        return
            time.sleep(_SAMPLE_S)

    threading.Thread(target=beat, name="polytrain-heartbeat", daemon=True).start()


_touch_warned = False


def _who() -> str:
    """How this process names itself in what it prints: ``[polytrain rank 3 worker@node1]``."""
    rank, role, node = _env.identity()
    return f"[polytrain rank {rank} {role}@{node}]"


def _touch(path: str, error: OSError) -> bool:
    """A beat whose record cannot be written (a full disk, say): renew the heartbeat file's
    time alone, which needs no space, so that the launcher does not take a working process
    for a hung one; say so once. False when even that fails (the thread then stops)."""
    global _touch_warned
    try:
        os.utime(path)
    except OSError as e:
        print(f"{_who()} its heartbeat file {path} cannot be "
              f"written ({error.strerror or error}) nor touched ({e.strerror or e}): the "
              f"launcher will report this process as hung", file=sys.stderr, flush=True)
        return False
    if not _touch_warned:
        _touch_warned = True
        print(f"{_who()} its heartbeat record cannot be written "
              f"({error.strerror or error}): only the file's time is renewed, so a hang is "
              f"still found, but not where the process was", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):  # a partial temporary file takes space
        os.remove(path + ".tmp")
    return True


class InjectedFault(RuntimeError):
    """Raised in a child's main thread on SIGUSR1: how fault-injection suites make a worker
    raise from outside (``kill -USR1 PID``), through the same path as any error."""


def _raise_injected(signum: int, frame: Any) -> None:
    raise InjectedFault(f"injected fault (signal {signal.Signals(signum).name})")


def _write_error(cause: str, secondary: bool, hint: str | None = None,
                 waited_s: float | None = None, lost: int | None = None,
                 bad_input: bool = False, names_waited_for: bool = False) -> None:
    path = _env.error_file()
    if path:
        _write_json(path, {"cause": cause, "time": time.time(), "secondary": secondary,
                           "hint": hint, "waited_s": waited_s, "lost": lost,
                           "bad_input": bad_input, "names_waited_for": names_waited_for})


def _record_leaving() -> None:
    """Record a leaving of the run at exit that failed (polytrain's shutdown, which logged
    it): the process still exits with code 0, a peer merely late is no failure, but the
    launcher reads a timed-out wait here and names a peer still working alone since."""
    runtime = sys.modules.get("polytrain.runtime")  # only if the script imported it
    error = None if runtime is None else runtime.left_with()
    if error is not None:
        with contextlib.suppress(OSError):  # advice for the launcher: the exit goes on
            _write_error(f"{type(error).__name__}: {error.what}", _is_secondary(error),
                         waited_s=_waited_s(error), lost=getattr(error, "peer", None))


def _write_json(path: str, record: dict[str, Any], tmp: str = ".tmp") -> None:
    """Write ``record`` to ``path`` whole, through ``path + tmp``: the launcher, reading at
    any time, sees the old record or the new one, never half of one."""
    with open(path + tmp, "w") as f:
        json.dump(record, f)
    os.replace(path + tmp, path)


def _raised_at(exc: BaseException) -> str:
    """`` at job.py:40`` for the innermost frame of ``exc``'s traceback in the script's own
    code (not polytrain's, torch's or the standard library's); "" if none."""
    place = ""
    for frame, line in traceback.walk_tb(exc.__traceback__):
        name = frame.f_code.co_filename
        if not (name.startswith("<") or name.startswith(_POLYTRAIN_DIR)
                or name.startswith(_STDLIB) or "-packages" in name):
            place = f" at {os.path.basename(name)}:{line}"
    return place


def _is_secondary(exc: BaseException) -> bool:
    if getattr(exc, "peer_lost", False):
        return True
    if isinstance(exc, BrokenPipeError):  # Python's own write (gloo's errors are RuntimeError)
        return False
    return any(m in str(exc) for m in _SECONDARY_MARKERS)


#: What to do about a write to a closed pipe: the output's reader ended (``| head``).
_PIPE_HINT = ("it wrote to a pipe whose reader had ended: when the run's output goes to a "
              "command (| head, | grep -m 1), let that command read all of it, or write the "
              "output to a file and read that")


def _waited_s(exc: BaseException) -> float | None:
    """How long it waited for its peers before it timed out (None: it did not time out; 0:
    it did, for a time not known)."""
    if not is_timeout(exc):
        return None
    waited = getattr(exc, "waited_s", None)
    if waited is None and (m := re.search(r"(?:Timed out waiting|wait timeout after) (\d+)ms",
                                          str(exc))):
        waited = int(m.group(1)) / 1e3  # gloo's text, the store's
    return float(waited or 0.0)


def _load_main(path: str | None, name: str | None) -> None:
    """Make the launching script's functions importable as ``__main__``, as multiprocessing's
    spawn does: by its module ``name`` where it was run as ``python -m NAME`` (its relative
    imports need its package), else by its ``path``."""
    if not name and not (path and os.path.isfile(path)):
        return
    module = types.ModuleType("__mp_main__")
    os.environ[_env.LOADING_MAIN] = "1"  # a launch() at import would start a run in each child
    try:
        if name:  # runpy holds a module of its own as __mp_main__ while the import runs
            module.__dict__.update(runpy.run_module(name, run_name="__mp_main__",
                                                    alter_sys=True))
        elif path:
            module.__file__ = path
            sys.modules["__mp_main__"] = sys.modules["__main__"] = module
            with open(path, "rb") as f:
                exec(compile(f.read(), path, "exec"), module.__dict__)
    finally:
        del os.environ[_env.LOADING_MAIN]
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module


class RankPrefixed:
    """A text stream that starts every line it passes on with ``prefix`` and passes each
    line on whole (processes share one terminal: the parts of one ``print`` were
    interleaved with other processes' where Python writes through). A line ends at a
    newline or a carriage return (a progress bar redrawn in place keeps its prefix), or
    where the stream is flushed. A line that names its process already (polytrain's own,
    ``[polytrain ...``) passes as it is."""

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream, self._prefix = stream, prefix
        self._line: list[str] = []  # the current line's text not passed on yet
        self._started = False  # whether the current line's start was passed on (a flush)
        # Reentrant: a signal handler (the child's SIGTERM flush), a finaliser or a warning
        # may run in this thread inside write(), and print or flush: it passes on as it is
        # (depth > 1). A fork while another thread writes must not leave it held.
        self._lock = threading.RLock()
        self._depth = 0
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock, self._depth = threading.RLock(), 0

    def write(self, text: str) -> int:
        with self._lock:
            self._depth += 1
            try:
                if self._depth > 1:
                    self._stream.write(text)
                    return len(text)
                lines = []
                for part in _LINE_ENDS.split(text):
                    if part:
                        self._line.append(part)
                        if part in ("\n", "\r"):
                            lines.append(self._take())
                if lines:
                    self._stream.write("".join(lines))
            finally:
                self._depth -= 1
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            self._depth += 1
            try:
                rest = self._take() if self._depth == 1 else ""
                if rest:
                    self._stream.write(rest)
            finally:
                self._depth -= 1
        self._stream.flush()

    def _take(self) -> str:
        text = "".join(self._line)
        self._line.clear()
        if not text:
            return ""
        if not self._started and text not in ("\n", "\r") \
                and not text.startswith("[polytrain "):
            text = self._prefix + text
        self._started = not text.endswith(("\n", "\r"))
        return text

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...
        return getattr(self._stream, name)


_LINE_ENDS = re.compile(r"([\n\r])")


@contextlib.contextmanager
def _rank_prefixed(payload: dict[str, Any]) -> Iterator[None]:
    """Start the lines the script prints on this process's ``sys.stdout`` and
    ``sys.stderr`` with its rank, role and machine, where the launcher asks (a run of
    several processes, not ``--no-rank-prefix``): while it runs, and after, until the
    process ends (its threads and exit handlers print then; every way out flushes the
    streams), but where it raised an error that ``main`` reports (its traceback goes out
    as printed)."""
    if not payload.get("rank_prefix"):
        yield
        return
    rank, role, node = _env.identity()
    out, err = sys.stdout, sys.stderr
    sys.stdout = RankPrefixed(out, f"[rank {rank} {role}@{node}] ")
    sys.stderr = RankPrefixed(err, f"[rank {rank} {role}@{node}] ")
    try:
        yield
    except SystemExit:
        raise  # it ends as a return does
    except BaseException:
        for stream in (sys.stdout, sys.stderr):  # a last line without its newline
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        sys.stdout, sys.stderr = out, err
        raise


def _run(payload: dict[str, Any]) -> Any:
    with _rank_prefixed(payload):
        return _run_payload(payload)


def _run_payload(payload: dict[str, Any]) -> Any:
    for entry in reversed(payload["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if payload["kind"] == "script":
        script = payload["script"]
        sys.argv = [script, *payload["argv"]]
        # As `python SCRIPT` has it: the script's folder first, in place of what this
        # interpreter's start put there (the working directory, importable ahead of
        # site-packages); polytrain stays importable from where it was found.
        if sys.path[:1] == [_START_PATH]:
            del sys.path[0]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
        return None
    sys.argv = list(payload["argv"])  # the launching script's, as multiprocessing's spawn keeps
    _load_main(payload["main_file"], payload["main_module"])
    fn, args, kwargs = pickle.loads(payload["target"])
    return fn(*args, **kwargs)


def _hint_for(exc: BaseException) -> str | None:
    # polytrain.runtime only if the script imported it: the child itself stays light.
    runtime = sys.modules.get("polytrain.runtime")
    return None if runtime is None else runtime.hint_for(exc)


def fail_to_start(cause: str, hint: str) -> None:
    """End a process that could not become the run's (its launcher names it with ``cause``)."""
    print(f"polytrain: {cause}. HINT: {hint}", file=sys.stderr, flush=True)
    _fail(cause, False, hint=hint)


def _fail(cause: str, secondary: bool, code: int = 1, hint: str | None = None,
          waited_s: float | None = None, lost: int | None = None,
          bad_input: bool = False, names_waited_for: bool = False) -> None:
    _write_error(cause, secondary, hint, waited_s, lost, bad_input, names_waited_for)
    with contextlib.suppress(OSError):  # a closed pipe
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    # Skip atexit hooks: a graceful shutdown would wait on peers that may be gone.
    os._exit(code)


def _exit_flushed(code: int) -> None:
    """End now, with what the process printed: a stream that is not a terminal is
    block-buffered, and os._exit dropped its last lines (the launcher's SIGTERM to the
    peers of a failed process, say), often what tells why."""
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe; or the signal came while that stream was writing (reentrant call).
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            stream.flush()
    os._exit(code)


def main() -> None:
    # A crash inside torch still shows where Python was: in a file of its own under a
    # launcher, which prints it under this process's name (processes share one terminal).
    crash = _env.crash_file()
    faulthandler.enable(file=open(crash, "w") if crash else sys.stderr, all_threads=True)
    # The launcher asks a process it names as stalled for its threads' stacks.
    stacks = _env.stacks_file()
    faulthandler.register(signal.SIGUSR2, all_threads=True,
                          file=open(stacks, "w") if stacks else sys.stderr)
    die_with(_env.parent_pid())
    _hold_membership()
    _start_heartbeat()
    signal.signal(signal.SIGTERM, lambda *_: _exit_flushed(143))
    signal.signal(signal.SIGUSR1, _raise_injected)
    with open(sys.argv[1], "rb") as f:
        payload = pickle.load(f)
    who = _who()
    try:
        result = _run(payload)
    except SystemExit as e:
        if isinstance(e.code, int) and e.code != 0:
            _fail(f"exited with code {e.code}", False, e.code,
                  hint="it called sys.exit: its output above may say why")
        elif e.code not in (0, None):  # sys.exit("message"): Python would print it, exit 1
            _fail(f"exited: {e.code}", False, 1, hint="fix what it says, and rerun")
        result = None
    except KeyboardInterrupt:
        _exit_flushed(130)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        # By name: the child imports no more of polytrain than the script did.
        refused = any(c.__name__ == "ConfigError" for c in type(e).__mro__)
        with contextlib.suppress(OSError):  # stderr may be the pipe that broke
            if _is_secondary(e):  # its traceback (and torch's C++ frames) say it lost a peer
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                print(f"{who} stopped: {type(e).__name__}: {first[:300]} (it lost a peer; the "
                      f"launcher names the process that failed first)", file=sys.stderr,
                      flush=True)
            elif refused:  # a refusal says what to do: its traceback is noise, not a clue
                print(f"{who} refused{_raised_at(e)}: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
            else:
                print(f"{who} failed:\n{traceback.format_exc()}", file=sys.stderr, end="",
                      flush=True)
        hint = _PIPE_HINT if isinstance(e, BrokenPipeError) else _hint_for(e)
        # polytrain's errors carry their hint apart (what, hint): it goes last in the
        # launcher's message, not in the middle of it before a hint of the launcher's own.
        what, own = getattr(e, "what", None), getattr(e, "hint", None)
        if isinstance(what, str) and (own is None or isinstance(own, str)):
            e_text, hint = what, hint or own
        else:
            e_text = str(e)
        _fail(f"{type(e).__name__}: {e_text}", _is_secondary(e),
              hint=f"{hint} (its traceback is printed above)" if hint and not refused
              else hint, waited_s=_waited_s(e), lost=getattr(e, "peer", None),
              bad_input=refused, names_waited_for=getattr(e, "names_waited_for", False) is True)
    _end_script()
    # Free cycles that hold process groups now: torch aborts if it frees them during exit.
    gc.collect()
    if payload["kind"] == "fn" and (result_file := _env.result_file()):
        try:
            data = pickle.dumps(result)
        except Exception as e:  # noqa: BLE001 - any object's __reduce__ may raise anything
            _fail(f"the function returned a {type(result).__name__}, which cannot be sent "
                  f"back to the launcher ({type(e).__name__}: {e})", False,
                  hint="return plain data: tensors, numbers, strings, and lists or dicts of "
                       "them", bad_input=True)
        with open(result_file + ".tmp", "wb") as f:
            f.write(data)
        os.replace(result_file + ".tmp", result_file)
    _exit_cleanly(who)


def _exit_cleanly(who: str) -> None:
    """End as Python would, then leave without finalising the interpreter.

    The script's threads are joined and every exit hook runs (polytrain's own
    shutdown among them), as on a normal exit. What is skipped is the
    interpreter's teardown: gloo's threads can still hold tensors then, and
    freeing one takes the GIL of an interpreter that is going away, which
    aborts the process ("terminate called without an active exception", seen
    once in a few hundred runs of a script that leaves the run at exit).

    A thread of the script's that is still running is waited for, as Python would, not
    cut off (it may be saving something), and so is an exit handler; every timeout the
    one that runs is named, so that a process that does not end says why.
    """
    patience = _env.read().timeout_s
    # What Python's own shutdown runs first: executors tell their idle threads to stop.
    for stop in reversed(getattr(threading, "_threading_atexits", [])):
        stop()
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(patience)
            while t.is_alive():
                print(f"{who} its script has ended, but its thread {t.name!r} (not a daemon) "
                      f"still runs, now at {_thread_place(t)[0]}: the process waits for it "
                      f"to end, as Python does (make it a daemon thread if it should not be "
                      f"waited for)", file=sys.stderr, flush=True)
                t.join(patience)
    # So are the exit handlers (atexit), named every timeout while one runs (not polytrain's
    # own leaving of the run, whose waits have the timeout and say so themselves).
    done = threading.Event()
    own = os.path.join(_POLYTRAIN_DIR, "runtime.py")

    def watch() -> None:
        while not done.wait(patience):
            main = threading.main_thread()
            if own in _stack_files(main):
                continue
            print(f"{who} its script has ended, but an exit handler (atexit) still runs, now "
                  f"at {_thread_place(main)[0]}: the process waits for it to end, as Python "
                  f"does", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="polytrain-exit-watch", daemon=True).start()
    try:
        atexit._run_exitfuncs()
    finally:
        done.set()
    _record_leaving()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
