"""Joining a run: ``polytrain.init()`` and the context it returns."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before init()'s
import contextlib
import datetime
import gc
import logging
import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from . import _env
from .comm.meter import MeterReport, TrafficMeter
from .comm.p2p import Transport
from .comm.topology import Topology
from .errors import CommError, CommTimeout, ConfigError, PeerLost, at_least, left_run
from .kinds import check_kinds
from .launch.launcher import free_port
from .launch.network import NicSampler
from .log import set_identity
from .ps.client import PSClient
from .ps.keys import KeySpace
from .ps.server import Server

__all__ = ["Context", "init", "current", "is_initialized", "hint_for"]

log = logging.getLogger(__name__)

# A server notices dead workers at once; this bounds how long live but stuck ones may idle
# (the default of init's server_idle_s, when the timeout is shorter).
_SERVER_IDLE_S = 3600.0


@dataclass(frozen=True)
class Groups:
    """The process groups strategies use; ``None`` where this rank is not a member."""

    workers: Any
    local: Any      # the workers of this rank's machine
    leaders: Any    # the first worker of every worker machine
    service: Any    # every rank: point-to-point traffic, apart from collectives
    answers: Any    # every rank: what servers send (one TCP stream per direction: see Transport)


class Context:
    """This process's place in the run, returned by :func:`init`.

    Attributes:
        rank, world_size: in the whole run (servers included).
        role: ``"worker"`` or ``"server"``; machine: its machine's name.
        topology: every rank's role and machine (:class:`~polytrain.comm.Topology`).
        groups: process groups among workers (all, same machine, leaders) and of all ranks.
        meter: the traffic meter; transport: metered point-to-point messages.
        ps_client: requests to the servers (workers only).
        keys: the run's one allocator of service keys.
        device: where this worker computes (``cpu`` or ``cuda:i``).
        timeout_s: how long any wait on a peer may take.
    """

    def __init__(self, *, rank: int, topology: Topology, groups: Groups, timeout_s: float,
                 device: torch.device, backend: str) -> None:
        self.rank = rank
        self.topology = topology
        self.groups = groups
        self.timeout_s = timeout_s
        self.device = device
        self.backend = backend
        self.meter = TrafficMeter(rank, topology)
        self.transport = Transport(rank=rank, topology=topology, group=groups.service,
                                   answers=groups.answers,
                                   meter=self.meter, timeout_s=timeout_s)
        self.ps_client = PSClient(self.transport, topology)
        #: The run's service keys: every user of the service takes fresh ones here.
        self.keys = KeySpace()
        self.final_reports: list[MeterReport] = []
        #: The emulated devices of the run (a ``pipeline.Cluster``), when it has them.
        self.cluster: Any = None
        #: Whether every machine is an emulated one with a NIC (``--bandwidth``): worker 0
        #: then reads the NICs' counters at its step marks.
        self.emulated_network = False
        self.label = ""
        self._closed = False
        self._lock = threading.Lock()
        self._open: list[_Closeable] = []  # what close_open() closes: trainers left open

    @property
    def closed(self) -> bool:
        """Whether this process left the run (:meth:`shutdown`): its groups are gone."""
        return self._closed

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def role(self) -> str:
        return self.topology.role(self.rank)

    @property
    def machine(self) -> str:
        return self.topology.machine(self.rank)

    @property
    def is_worker(self) -> bool:
        return self.role == "worker"

    @property
    def num_workers(self) -> int:
        return len(self.topology.workers)

    @property
    def worker_index(self) -> int:
        """This worker's position among all workers (0 .. num_workers-1)."""
        return self.topology.worker_index(self.rank)

    @property
    def local_workers(self) -> tuple[int, ...]:
        return self.topology.workers_on(self.machine)

    @property
    def local_index(self) -> int:
        """This worker's position among its machine's workers."""
        return self.local_workers.index(self.rank)

    @property
    def num_nodes(self) -> int:
        return len(self.topology.worker_machines)

    @property
    def node_index(self) -> int:
        return self.topology.worker_machines.index(self.machine)

    @property
    def is_leader(self) -> bool:
        return self.rank in self.topology.leaders

    @property
    def store(self) -> Any:
        """The run's key-value store (torch's c10d store of its rendezvous, on rank 0): small
        records any rank writes and reads without waiting for its peers."""
        return dist.distributed_c10d._get_default_store()

    def set_label(self, label: str) -> None:
        """Say what this process is (``virtual worker 1 stage 0``) in logs and failure reports.

        The launcher names a failed process by rank, role, machine and this label.
        """
        self.label = label
        set_identity(self.rank, self.role, self.machine, label)
        path = _env.label_file()
        if path:
            with open(path, "w") as f:
                f.write(label)

    def new_group(self, ranks: Sequence[int], *, cuda: bool = False) -> Any:
        """A process group of ``ranks`` that only its members create (others need not call).

        torch names such a group by its ranks and the number of groups each member
        holds, so its members must have created equally many groups since init().
        """
        backend = self.backend if cuda else "gloo"
        return dist.new_group(sorted(ranks), backend=backend,
                              timeout=datetime.timedelta(seconds=self.timeout_s),
                              use_local_synchronization=True)

    def keep_open(self, closeable: _Closeable) -> None:
        """Have :meth:`close_open` close ``closeable`` (a trainer) unless :meth:`closed_one`
        says it was closed: a pipeline's trainer left open holds minibatches in flight that
        the servers wait for before they let the workers leave the run."""
        self._open.append(closeable)

    def closed_one(self, closeable: _Closeable) -> None:
        """``closeable`` was closed: :meth:`close_open` leaves it (and it may be freed)."""
        with contextlib.suppress(ValueError):
            self._open.remove(closeable)

    def close_open(self) -> None:
        """Close what :meth:`keep_open` was given and is still open, the newest first: at
        the script's end, before its threads are stopped, and in :meth:`shutdown`."""
        first: BaseException | None = None
        while self._open:
            try:
                self._open.pop().close()  # once, even if it fails; then the others
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def shutdown(self) -> list[MeterReport]:
        """Leave the run: close what the script left open (:meth:`close_open`), tell the
        servers, gather every rank's meter report, close the groups.

        Idempotent; called at exit if the script does not. Returns the reports by rank.
        """
        with self._lock:
            if self._closed:
                return self.final_reports
            self._closed = True
        global _context
        try:
            self.close_open()
            if self.is_worker:
                self.ps_client.finish()
            reports: list[Any] = [None] * self.world_size
            try:
                dist.all_gather_object(reports, self.meter.report())
            except RuntimeError as e:  # gloo's text names no one: say what and with whom
                raise self.transport.error(e, None, "leaving the run (gathering every "
                                           "process's meter report)", self.timeout_s) from None
            self.final_reports = reports
        finally:
            gc.collect()  # a cycle that holds a process group must not be freed during exit
            dist.destroy_process_group()
            _context = None
        return self.final_reports


class _Closeable(Protocol):
    def close(self) -> None: ...


_context: Context | None = None
_joined = False  # whether init() ever joined a run in this process (shutdown leaves it set)


def current() -> Context:
    """The context of this process (after :func:`init`)."""
    if _context is None:
        raise ConfigError("polytrain is not initialised in this process",
                          "call polytrain.init() first")
    return _context


def is_initialized() -> bool:
    return _context is not None


def has_joined() -> bool:
    """Whether this process joined a run (:func:`init`), even one it has left since."""
    return _joined


def _check_again(ctx: Context, device: str | torch.device | None,
                 timeout_s: float | None) -> None:
    """A second :func:`init` returns the run it joined: refuse a device or timeout that
    differs from that run's (it was ignored, and a script meant for a GPU trained on the CPU,
    silently). The first call may be another's: ``distribute()``'s, ``bps.init()``'s."""
    differs = []
    if device is not None:
        try:
            wanted = torch.device(device)
        except (RuntimeError, TypeError):  # "tpu": refused as by the first call
            wanted = _device_of(device)
        if wanted.type != ctx.device.type or wanted.index not in (None, ctx.device.index):
            differs.append(f"device={str(device)!r} (it has {ctx.device})")
    if timeout_s is not None and timeout_s != ctx.timeout_s:
        differs.append(f"timeout_s={timeout_s:g} (it has {ctx.timeout_s:g})")
    if differs:
        raise ConfigError(f"polytrain.init() was called again with {' and '.join(differs)}, "
                          f"but this process joined its run already, and keeps it",
                          "pass them to the first call: polytrain.init(...) before "
                          "distribute() or bps.init(), which join the run themselves")


def init(*, device: str | torch.device | None = None, timeout_s: float | None = None,
         server_threads: int = 4, server_idle_s: float | None = None) -> Context:
    """Join the run this process was launched into, and learn everyone's role and machine.

    Works under ``polytrain launch``/:func:`polytrain.launch`, under ``torchrun``
    (role from ``POLYTRAIN_ROLE``, machine from ``POLYTRAIN_NODE``), and in a plain
    ``python script.py`` (a run of one worker). A server-role process serves the
    workers inside this call and exits when they finish, so scripts are written
    from a worker's point of view.

    Example::

        ctx = polytrain.init()
        model, opt = polytrain.distribute(model, opt, strategy="ddp")

    Args:
        device: where workers compute: ``"cpu"`` (default), ``"cuda"`` (a GPU of this
            host by the worker's index among its workers under polytrain launch, by
            LOCAL_RANK under torchrun; groups among workers then use NCCL for CUDA
            tensors, or gloo where workers share a GPU: see :func:`cuda_backend`), or
            an explicit device.
        timeout_s: the longest wait on any peer (default POLYTRAIN_TIMEOUT, else 120 s).
        server_threads: engine threads of each server process (default 4).
        server_idle_s: how long a server waits with no request from any worker before it
            fails (default: the timeout, and at least an hour: workers may evaluate or save
            between steps). A run may last longer: only the gaps between requests count.
    """
    global _context, _joined
    # Checked on every call: a second one (which returns the run joined) failed on its
    # timeout_s="120" with format()'s ValueError, and took server_threads=0 silently.
    for name, value, usual in (("timeout_s", timeout_s, _env.DEFAULT_TIMEOUT_S),
                               ("server_idle_s", server_idle_s, _SERVER_IDLE_S)):
        if value is not None:  # before float(): "abc" was its ValueError
            _env.check_seconds(value, f"polytrain.init({name}=...)",
                               f"pass, say, {name}={usual:g}")
    # Unchecked, 1.5 or "2" killed every server with a TypeError, and 0 ran one thread.
    server_threads = check_kinds(init, {"server_threads": server_threads},
                                 what="polytrain.init() ")["server_threads"]
    at_least("polytrain.init() server_threads", server_threads, "pass, say, server_threads=4")
    if _context is not None:
        _check_again(_context, device, timeout_s)
        return _context
    # A launched process that left its run cannot join it again: its servers exited after
    # serving, and a run of workers alone met the old rendezvous (gloo's connect timed out
    # in 2 of 3 tries).
    if _joined and not dist.is_initialized() and _env.started_by():
        raise left_run("polytrain.init() (or bps.init(), or distribute()'s) was called again",
                       "join once, and make every call before the shutdown: a launched "
                       "process joins its run once")
    env = _env.read()
    timeout = float(timeout_s if timeout_s is not None else env.timeout_s)
    _join(env, timeout)
    _joined = True
    rank = dist.get_rank()
    worker_device = _pick_device(device, env.local_rank) if env.role == "worker" else None
    seats: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seats, (env.role, env.node, os.getpid(), _env.nic(),
                                   _gpu_of(worker_device)))
    topology = Topology.from_roles([(role, node) for role, node, *_ in seats])
    backend = cuda_backend([gpu for *_, gpu in seats])
    if backend == "gloo" and worker_device is not None and worker_device.type == "cuda":
        _warn_shared_gpus([gpu for *_, gpu in seats])
    groups = _make_groups(topology, rank, backend, timeout)
    set_identity(rank, env.role, env.node)
    ctx = Context(rank=rank, topology=topology, groups=groups, timeout_s=timeout,
                  device=worker_device or torch.device("cpu"), backend=backend)
    _context = ctx
    log.info("joined: %d processes\n%s", ctx.world_size, topology.describe())
    ctx.emulated_network = all(nic for _, _, _, nic, _ in seats)
    if topology.workers and rank == topology.workers[0] and ctx.emulated_network:
        # On an emulated network worker 0 reads every machine's NIC at its step marks,
        # through a process of that machine (the first rank there).
        nics: dict[str, tuple[int, str]] = {}
        for _, node, pid, nic, _ in seats:
            nics.setdefault(node, (pid, nic))
        ctx.meter.sample_nics(NicSampler(nics))
    if ctx.role == "server":
        Server(ctx.transport, topology, threads=server_threads,
               idle_timeout_s=max(timeout, _SERVER_IDLE_S) if server_idle_s is None
               else server_idle_s).serve()
        ctx.shutdown()
        sys.exit(0)
    atexit.register(_shutdown_at_exit)
    # Before Python's shutdown stops the executors' threads, which a pipeline's close needs
    # (from the exit hooks, a trainer's close failed a run that ended well without it): as
    # concurrent.futures registers its own stop, here, where hooks run newest first (it is
    # imported above, so its hook is older than this one whatever imports it later).
    register_early = getattr(threading, "_register_atexit", atexit.register)
    register_early(_close_open_at_exit)
    if _env.error_file() is None:  # not polytrain's launcher, which reports hints itself
        _hint_uncaught()
    return ctx


def _hint_uncaught() -> None:
    """After an uncaught error's traceback (under torchrun, or a plain run), say what
    :func:`hint_for` can tell of it."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(kind, exc, tb)
        hint = hint_for(exc)
        if hint:
            log.error("HINT: %s", hint)

    sys.excepthook = hook


def hint_for(exc: BaseException) -> str | None:
    """What to do about an error torch raised in a worker's own torch.distributed call, where
    polytrain can tell more than torch's text; None where it cannot.

    A collective on the default group (``dist.all_reduce(t)``, torch's DDP without
    ``process_group``) waits for every process of the run, servers included, and the
    servers never join it: gloo times out after ``--timeout``, saying only where in gloo.
    """
    ctx = _context
    text = str(exc)
    if (ctx is None or not ctx.is_worker or not ctx.topology.servers
            or not isinstance(exc, RuntimeError) or "gloo" not in text
            or "Timed out" not in text):
        return None
    # Whose call was it: the innermost frame outside torch. polytrain's own collectives pass
    # their group; their timeouts mean a slow or lost peer, not this mistake.
    torch_dir = os.path.dirname(torch.__file__)
    callers = [f.filename for f in traceback.extract_tb(exc.__traceback__)
               if not f.filename.startswith(torch_dir)]
    if not callers or callers[-1].startswith(os.path.dirname(__file__)):
        return None
    return ("if that call was a collective on the default group: this run has server "
            "processes, which never join it; pass group=ctx.groups.workers to "
            "torch.distributed calls (process_group=ctx.groups.workers to torch's DDP), or "
            "use polytrain.distribute(...)")


def _interface_hint(env: _env.ProcessEnv) -> str:
    """On several hosts gloo advertises the address of this host's name; where that name
    resolves to loopback (a common /etc/hosts), peers on other hosts cannot reach it."""
    if (_env.gloo_interface() or _env.single_host()
            or env.master_addr in ("127.0.0.1", "localhost", "::1")):
        return ""
    try:
        here = socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""
    if not here.startswith("127."):
        return ""
    return (f"; this host's name resolves to {here}, so gloo offers peers on other hosts a "
            f"loopback address: set GLOO_SOCKET_IFNAME to the interface they reach (e.g. eth0)")


#: What gloo's and the TCP store's errors say of a connection a peer closed.
_CLOSED = ("Connection was likely closed", "Connection reset by peer",
           "Connection closed by peer", "Broken pipe")


def _join(env: _env.ProcessEnv, timeout: float) -> None:
    if dist.is_initialized():
        return
    if env.launched:
        if env.master_port is None:
            raise ConfigError(f"rank {env.rank}: MASTER_PORT is not set",
                              "start the script with polytrain launch or torchrun")
        init_method = f"tcp://{env.master_addr}:{env.master_port}"
        rank, world = env.rank, env.world_size
    else:
        init_method, rank, world = f"tcp://127.0.0.1:{free_port()}", 0, 1
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistStoreError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if env.launched and rank == 0 and "EADDRINUSE" in str(e):
            # Free when the launcher checked it, taken before rank 0 could listen (or a
            # launcher of its own, as torchrun, did not check it).
            raise CommError(f"rank 0 ({env.role}, machine {env.node}) could not listen for "
                            f"the run's rendezvous at {init_method}: the port is in use",
                            "rerun (a free port is taken again), or pass another --port "
                            "(torchrun: --master-port)") from None
        if any(m in str(e) for m in _CLOSED):
            # At once, not after the timeout: a peer (the rendezvous' host, rank 0) stopped.
            # Said as a timeout, each process printed its traceback as a cause of its own.
            raise PeerLost(
                f"rank {rank} ({env.role}, machine {env.node}) lost a peer while joining the "
                f"run of {world} processes at {init_method}: {first}",
                "look at the other processes' reports: the launcher names the one that "
                "stopped (it lost a peer)") from None
        raise CommTimeout(
            f"rank {rank} ({env.role}, machine {env.node}) could not join the run of {world} "
            f"processes at {init_method} within {timeout:g} s: {first}",
            "check that all WORLD_SIZE processes were started and can reach MASTER_ADDR"
            + _interface_hint(env), waited_s=timeout) from None


def _device_of(device: str | torch.device) -> torch.device:
    """``device`` as torch's, refused unless cpu or cuda (init()'s first call and again)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):  # meta or mps trained nothing here
        raise ConfigError(f"device {str(device)!r}: polytrain runs on cpu or cuda",
                          "pass device='cpu' or device='cuda' (or 'cuda:N')")
    return dev


def _pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is None or str(device) == "cpu":
        return torch.device("cpu")
    dev = _device_of(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for but torch sees no CUDA device",
                              "pass --device cpu, or install a CUDA build of torch")
        count = torch.cuda.device_count()
        if dev.index is None:
            dev = torch.device("cuda", _env.gpu_index(local_rank, count))
        elif dev.index >= count:
            raise ConfigError(f"device {str(device)!r}: this machine has {count} CUDA "
                              f"device(s), 0 to {count - 1}",
                              "pass device='cuda' (one GPU a process by its local rank)")
        torch.cuda.set_device(dev)
    return dev


def _gpu_of(device: torch.device | None) -> str | None:
    """The identity of the GPU a worker computes on (its UUID), None off CUDA."""
    if device is None or device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", "")) or f"{socket.gethostname()}: {props.name} " \
        f"#{device.index}"


def shared_gpus(gpus: Sequence[str | None]) -> list[list[int]]:
    """The ranks of each GPU that more than one rank computes on (``gpus``: every rank's)."""
    ranks: dict[str, list[int]] = {}
    for r, g in enumerate(gpus):
        if g is not None:
            ranks.setdefault(g, []).append(r)
    return [rs for rs in ranks.values() if len(rs) > 1]


def cuda_backend(gpus: Sequence[str | None]) -> str:
    """The backend of the workers' groups, from every rank's GPU (None: no GPU).

    NCCL needs one GPU per process: it refuses two ranks on one GPU ("Duplicate GPU
    detected"). Where workers share a GPU (more workers than GPUs on a machine, as when
    trying a layout on one GPU), CUDA tensors go over gloo, which stages them through
    host memory. All ranks decide alike: every rank sees every rank's GPU.
    """
    if all(g is None for g in gpus) or shared_gpus(gpus):
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def _warn_shared_gpus(gpus: Sequence[str | None]) -> None:
    shared = shared_gpus(gpus)
    if shared and dist.get_rank() == min(min(rs) for rs in shared):
        log.warning("ranks %s share a GPU: NCCL takes one GPU per process, so CUDA tensors "
                    "go over gloo through host memory (slower); give each worker its own GPU "
                    "(no more workers on a machine than it has GPUs) for NCCL",
                    " and ".join(",".join(map(str, rs)) for rs in shared))


def _make_groups(topology: Topology, rank: int, backend: str, timeout: float) -> Groups:
    # Every rank creates every group, in the same order (torch's rule for new_group).
    td = datetime.timedelta(seconds=timeout)

    def group(ranks: Sequence[int], backend: str = backend) -> Any:
        g = dist.new_group(list(ranks), backend=backend, timeout=td)
        return g if rank in ranks else None

    workers = group(topology.workers)
    local = None
    for m in topology.worker_machines:
        g = group(topology.workers_on(m))
        if g is not None:
            local = g
    leaders = group(topology.leaders)
    service = group(range(topology.world_size), "gloo")
    answers = group(range(topology.world_size), "gloo")
    made = Groups(workers=workers, local=local, leaders=leaders, service=service,
                  answers=answers)
    held = (workers, local, leaders, service, answers)
    _even_group_counts(1 + sum(g is not None for g in held), rank, td)
    return made


def _even_group_counts(held: int, rank: int, timeout: datetime.timedelta) -> None:
    """Make every rank hold as many process groups as the rank that holds most.

    torch names a members-only group (``use_local_synchronization``) by its ranks
    and the number of groups the calling process holds; a group only its members
    create (non-members of the groups above register none) would get different
    names on, say, a leader and a non-leader, and their rendezvous would hang.
    Padding with groups of one rank evens the counts, so :meth:`Context.new_group`
    works among any ranks that have created as many groups since.
    """
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, held)
    for _ in range(max(counts) - held):
        dist.new_group([rank], backend="gloo", timeout=timeout, use_local_synchronization=True)


_left_with: CommError | None = None  # why leaving the run at exit failed, if it did


def left_with() -> CommError | None:
    """Why this process's leaving the run at exit failed (a peer it waited for did not come
    within the timeout, or was lost), if it did: the process still exits with code 0, and
    the launcher's child records the error, so that the launcher looks, a timeout later,
    for a peer still working alone since, and names it in a warning."""
    return _left_with


def _close_open_at_exit() -> None:
    # As _shutdown_at_exit: not after an unhandled error, whose peers the launcher stops.
    if _context is None or getattr(sys, "last_value", None) is not None:
        return
    try:
        _context.close_open()
    except Exception as e:  # nothing may escape Python's thread shutdown: it stops there
        log.warning("closing what the script left open at exit failed: %s", e,
                    exc_info=not isinstance(e, CommError))


def _shutdown_at_exit() -> None:
    # After an unhandled error the peers are stopped by the launcher (ours or torchrun);
    # waiting on them here would only delay the exit. Python leaves the error that ended
    # the script in sys.last_value before it runs the exit hooks.
    global _left_with
    if _context is None or getattr(sys, "last_value", None) is not None:
        return
    try:
        _context.shutdown()
    except CommError as e:
        log.warning("shutdown at exit failed: %s", e)
        _left_with = e
