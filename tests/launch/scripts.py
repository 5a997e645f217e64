"""Functions the launcher tests run in child processes."""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import polytrain
from polytrain.ps import Declaration, Kind


def identity() -> dict:
    ctx = polytrain.init()
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total, group=ctx.groups.workers)
    return {"rank": ctx.rank, "role": ctx.role, "machine": ctx.machine,
            "workers": ctx.topology.workers, "servers": ctx.topology.servers,
            "leaders": ctx.topology.leaders, "local": ctx.local_workers,
            "sum_of_worker_ranks": float(total), "threads": os.environ["OMP_NUM_THREADS"],
            "group": os.environ["GROUP_RANK"]}


def worker_raises(bad_rank: int, config: bool = False) -> None:
    ctx = polytrain.init()
    if ctx.rank == bad_rank:
        if config:
            raise polytrain.ConfigError("bad on purpose", "pass a good one")
        raise RuntimeError(f"boom on purpose from rank {ctx.rank}")
    x = torch.zeros(1)
    dist.all_reduce(x, group=ctx.groups.workers)  # blocks: the bad rank never joins


def worker_exits(bad_rank: int, code: object) -> None:
    ctx = polytrain.init()
    if ctx.rank == bad_rank:
        if code == "os._exit(3)":  # no Python error, no traceback
            os._exit(3)
        sys.exit(code)
    x = torch.zeros(1)
    dist.all_reduce(x, group=ctx.groups.workers)  # blocks: the bad rank never joins


def worker_stalls(stuck_rank: int, busy: bool) -> None:
    """Rank ``stuck_rank`` never reaches the all-reduce: it sleeps, or spins in Python."""
    ctx = polytrain.init()
    while ctx.rank == stuck_rank:
        if busy:
            sum(range(10_000))  # the GIL taken and given back, as Python code does
        else:
            time.sleep(0.1)
    x = torch.zeros(1)
    dist.all_reduce(x, group=ctx.groups.workers)  # times out: the stuck rank never joins


def byteps_steps_then_os_exit(leave: bool) -> None:
    """Two BytePS steps, then a barrier of the workers (``leave``: polytrain's shutdown
    instead) and ``os._exit(0)``, as a script that skips the interpreter's exit does."""
    ctx = polytrain.init()  # the server serves in here
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = polytrain.distribute(model, opt, strategy="byteps")
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    if leave:
        polytrain.current().shutdown()
    else:
        dist.barrier(group=ctx.groups.workers)
    os._exit(0)


def late_to_leave(late_rank: int, delay_s: float) -> int:
    """Rank ``late_rank`` ends its script ``delay_s`` after the others: their leaving times out."""
    ctx = polytrain.init()
    if ctx.rank == late_rank:
        time.sleep(delay_s)
    return ctx.rank


def _upload(delay_s: float) -> None:
    time.sleep(delay_s)


def thread_outlives_script(delay_s: float) -> int:
    """Leave a thread of the script's (not a daemon) running ``delay_s`` past the end."""
    ctx = polytrain.init()
    threading.Thread(target=_upload, args=(delay_s,), name="uploader").start()
    return ctx.rank


def exit_handler_outlives_script(delay_s: float) -> int:
    """Register an exit handler (atexit) that runs ``delay_s`` after the script returns."""
    ctx = polytrain.init()
    atexit.register(_upload, delay_s)
    return ctx.rank


def executor_left_idle() -> int:
    """Leave a thread pool with an idle worker thread (not shut down), as scripts do."""
    ctx = polytrain.init()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(time.sleep, 0.01).result()
    return ctx.rank


def all_reduce_on_the_default_group() -> None:
    polytrain.init()
    dist.all_reduce(torch.ones(1))  # the world: the server never joins


def fill_shared_memory(victim: int) -> str:
    """Write a file into the run's shared-memory directory; rank ``victim`` then dies."""
    ctx = polytrain.init()
    shm = os.environ["POLYTRAIN_SHM_DIR"]
    with open(os.path.join(shm, f"rank-{ctx.rank}"), "wb") as f:
        f.write(b"x" * 4096)
    x = torch.zeros(1)
    dist.all_reduce(x, group=ctx.groups.workers)  # every file is written
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if victim >= 0:
        time.sleep(60)
    return shm


def killed_by_signal(victim: int, how: str = "kill") -> None:
    ctx = polytrain.init()
    if ctx.rank == victim:
        if how == "segfault":  # a crash in C code
            import ctypes
            ctypes.string_at(0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def write_pid_and_hang(directory: str, fork: bool = False) -> None:
    """Write this process's pid (``fork``: and that of a child it forked, which sleeps), then
    wait for the launcher's end."""
    if fork:  # as multiprocessing's fork does: no exec, so the fork server's /proc environ
        import multiprocessing
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
        child.start()
        with open(os.path.join(directory, f"forked-{os.environ['RANK']}"), "w") as f:
            f.write(str(child.pid))
    with open(os.path.join(directory, f"pid-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    polytrain.init()
    time.sleep(60)


def started_pids(directory: str | os.PathLike[str], count: int,
                 launcher: subprocess.Popen[str] | None = None) -> list[int]:
    """The pids :func:`write_pid_and_hang` wrote in ``directory``, once ``count`` processes
    have (within 60 s: a loaded machine starts processes slowly); ``launcher``: still running
    meanwhile."""
    deadline = time.monotonic() + 60
    while len(pids := [int(p.read_text()) for p in Path(directory).glob("pid-*")]) < count:
        if launcher is not None:
            assert launcher.poll() is None, launcher.communicate()[1]
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.1)
    return pids


def signals_reach_the_run(launcher: int, signals: list[int]) -> list[bool]:
    """Send ``signals`` to the ``launcher``, to this process's parent (its fork server, where
    it was forked) and to itself, as a signal to the launcher's process group reaches them;
    once every worker has, return whether each signal is ignored here."""
    ctx = polytrain.init()
    for pid in {launcher, os.getppid(), os.getpid()}:
        for sig in signals:
            os.kill(pid, sig)
    time.sleep(0.5)  # delivered: what they would have ended has ended
    dist.barrier(group=ctx.groups.workers)
    return [signal.getsignal(sig) == signal.SIG_IGN for sig in signals]


def server_dies_mid_run(directory: str, how: str = "kill") -> None:
    """Workers push to a server; after the first round worker 0 kills the server (kill -9),
    or (``how="exit0"``) has it exit with code 0 (``os._exit(0)`` in a thread of its own)."""
    from polytrain.comm import TensorSpec, partition
    from polytrain.ps import balanced, engine_for

    with open(os.path.join(directory, f"pid-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    exit_file = os.path.join(directory, "exit0")
    if os.environ["POLYTRAIN_ROLE"] == "server":
        def exit_when_told() -> None:
            while not os.path.exists(exit_file):
                time.sleep(0.02)
            os._exit(0)
        threading.Thread(target=exit_when_told, daemon=True).start()
    ctx = polytrain.init()  # the server serves in here until it is killed
    parts = partition([TensorSpec("g", (256,), torch.float32)], 1 << 20)
    engine = engine_for(ctx)
    [sums] = engine.sums([TensorSpec("g", (256,), torch.float32)],
                         balanced(parts, ctx.topology.servers), local_reduce=False)
    g = torch.ones(256)
    engine.submit(sums, g)
    engine.wait(sums)
    if ctx.worker_index == 0 and how == "exit0":
        open(exit_file, "w").close()
    elif ctx.worker_index == 0:
        server = ctx.topology.servers[0]
        with open(os.path.join(directory, f"pid-{server}")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    for _ in range(200):
        engine.submit(sums, g)
        engine.wait(sums)
        time.sleep(0.05)


def fork_server_killed(launcher: int) -> None:
    """Worker 1 kills the fork server that started it (its parent) once every process has
    joined; the run's processes die with it. Where the parent is the ``launcher`` (the
    processes were not forked), it refuses instead."""
    ctx = polytrain.init()
    if ctx.rank == 1:
        if os.getppid() == launcher:
            raise RuntimeError("not forked from a fork server: the parent is the launcher")
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)


def pushes_that_differ() -> None:
    """Worker 0 push_pulls a tensor that worker 1 never does: each then waits in a round the
    other never pushes."""
    from polytrain import byteps as bps

    ctx = polytrain.init()
    t = torch.ones(8)
    bps.push_pull(t, name="both")
    if ctx.rank == 0:
        bps.push_pull(t, name="only_rank0")
    bps.push_pull(t, name="both")


def worker_exits_0_from_a_thread(victim: int) -> None:
    """Workers all-reduce in a loop (torch's collectives: a lost peer is not named there);
    a thread of worker ``victim`` ends its process with os._exit(0) after the first round."""
    ctx = polytrain.init()
    x = torch.ones(4)
    dist.all_reduce(x, group=ctx.groups.workers)
    if ctx.rank == victim:
        threading.Thread(target=os._exit, args=(0,)).start()
    for _ in range(6000):
        dist.all_reduce(x, group=ctx.groups.workers)
        time.sleep(0.01)


def server_never_joins() -> None:
    """The servers return before polytrain.init(), as a script that calls it only in a
    worker's branch: the workers wait for them to join."""
    if os.environ["POLYTRAIN_ROLE"] == "server":
        return
    polytrain.init()


def transfer_over_the_nic(nbytes: int) -> dict:
    """Worker 0 sends ``nbytes`` to worker 1 (its own machine), then to worker 2 (another).

    Returns, per transfer, this process's machine's NIC byte counters moved and
    the sender's time from the send to the receiver's acknowledgement of the whole tensor
    (never shorter than the transfer: a receiver's clock started late made it look faster).
    """
    from polytrain.launch.network import nic_bytes

    ctx = polytrain.init()
    nic = os.environ["POLYTRAIN_NIC"]
    x, ack = torch.zeros(nbytes // 4), torch.zeros(1)
    out = {"machine": ctx.machine}
    for name, dst in (("local", 1), ("remote", 2)):
        dist.barrier(group=ctx.groups.workers)
        sent0, recv0 = nic_bytes(os.getpid(), nic)
        t0 = time.perf_counter()
        if ctx.rank == 0:
            dist.send(x, dst)
            dist.recv(ack, dst)
        elif ctx.rank == dst:
            dist.recv(x, 0)
            dist.send(ack, 0)
        elapsed = time.perf_counter() - t0
        # A send returns once the kernel holds the bytes: count them when the receiver has all.
        dist.barrier(group=ctx.groups.workers)
        sent1, recv1 = nic_bytes(os.getpid(), nic)
        out[name] = {"sent": sent1 - sent0, "recv": recv1 - recv0, "seconds": elapsed}
    return out


def sends_after_idle_s(sizes: list[int], idle_s: float, rounds: int) -> dict[int, list[float]]:
    """Every worker but 0 sends each of ``sizes`` to worker 0 at once, ``rounds`` times each
    after ``idle_s`` of quiet links; worker 0 acknowledges once it has every sender's.

    Returns, per size, a sender's seconds from its send to the acknowledgement (never
    shorter than the transfer of all the senders' bytes into worker 0's machine).
    """
    ctx = polytrain.init()
    ack = torch.zeros(1)
    senders = range(1, ctx.num_workers)
    times: dict[int, list[float]] = {}
    for nbytes in sizes:
        x = [torch.ones(nbytes // 4) for _ in senders] if ctx.rank == 0 else torch.ones(
            nbytes // 4)
        for _ in range(rounds):
            dist.barrier(group=ctx.groups.workers)
            time.sleep(idle_s)
            t0 = time.perf_counter()
            if ctx.rank == 0:
                for w in [dist.irecv(buf, src) for buf, src in zip(x, senders)]:
                    w.wait()
                for src in senders:
                    dist.send(ack, src)
            else:
                dist.send(x, 0)
                dist.recv(ack, 0)
            times.setdefault(nbytes, []).append(time.perf_counter() - t0)
    return times


def round_trip_s(rounds: int) -> float:
    """The median round trip of a small message between worker 0 (node0) and worker 1 (node1)."""
    ctx = polytrain.init()
    x = torch.zeros(1)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if ctx.rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def what_a_process_starts_with() -> dict:
    # No init: what the process is before the run begins.
    return {"pid": os.getpid(), "parent": os.getppid(), "cwd": os.getcwd(),
            "rank": os.environ["RANK"], "var": os.environ.get("POLYTRAIN_TEST_VAR"),
            "test": os.environ.get("PYTEST_CURRENT_TEST"),
            "threads": torch.get_num_threads(), "seed": torch.initial_seed(),
            "draw": torch.rand(1).item(), "said": print(f"said by {os.environ['RANK']}"),
            "umask": _umask(), "core": resource.getrlimit(resource.RLIMIT_CORE)[0]}


def _umask() -> int:
    with open("/proc/self/status") as f:  # read, not set: the heartbeat thread writes files
        return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))


def set_then_get(times: int) -> list[float]:
    ctx = polytrain.init()
    server = ctx.topology.servers[0]
    client = ctx.ps_client
    numel = 700_000  # 2.8 MB: inline, and still arriving on a shaped link after the send
    client.declare(Declaration(key=3, kind=int(Kind.PARAM), name="w", numel=numel,
                               dtype="torch.float32", pushers=2, pullers=2), server)
    seen, out = [], torch.empty(numel)
    for i in range(times):
        if ctx.worker_index == 0:
            client.set(server, key=3, tensor=torch.full((numel,), float(i))).wait()
        dist.barrier(group=ctx.groups.workers)
        if ctx.worker_index == 1:
            client.get(server, key=3, out=out).wait()
            seen.append(float(out[-1]))
        dist.barrier(group=ctx.groups.workers)
    return seen


def heartbeat_unwritable(seconds: float) -> int:
    """Its heartbeat's record cannot be written (as on a full disk: here a directory takes
    the temporary file's name), and it works on for ``seconds``."""
    while True:
        try:
            os.mkdir(os.environ["POLYTRAIN_HEARTBEAT_FILE"] + ".tmp")
            break
        except FileExistsError:  # the heartbeat thread's own write, renamed in a moment
            time.sleep(0.01)
    time.sleep(seconds)
    return 7


def returns_a_lambda() -> object:
    return lambda: None


def leaves_a_helper(directory: str, fail: bool) -> None:
    """Start a helper process that would outlive the script, write its pid, then end (or
    fail)."""
    import subprocess
    from pathlib import Path

    ctx = polytrain.init()
    # Rank 1's leaves the process group and session too, as a daemon would.
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              start_new_session=ctx.rank == 1)
    Path(directory, f"helper-{ctx.rank}").write_text(str(helper.pid))
    # A forked one (a multiprocessing helper; a failed worker's outlived it): from a fork
    # server's child, its /proc environ was the server's, which names no run.
    import multiprocessing
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,),
                                                         daemon=True)
    forked.start()
    Path(directory, f"forked-{ctx.rank}").write_text(str(forked.pid))
    if fail and ctx.rank == 1:
        raise RuntimeError("the script failed")
