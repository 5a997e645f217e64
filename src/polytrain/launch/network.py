"""The emulated cluster network: a namespace per machine, shaped links to a hub, NIC counters.

With ``--bandwidth``, every emulated machine of a run runs its processes in a
network namespace of its own, and one veth pair joins it to a bridge in the
run's hub namespace::

    pt-<run>-node0             pt-<run>-hub                    pt-<run>-server0
    +-----------------+        +--------------------------+    +-----------------+
    | lo (same machine)|       |        pt-<run>-br       |    | lo              |
    | pt-<run>-n0 -----+--veth-+-- pt-<run>-n0h   ...  ---+----+ pt-<run>-s0     |
    | 10.111.0.1/24   |        |  (htb: node0's ingress)  |    | 10.111.0.3/24   |
    | htb (+netem)    |        +--------------------------+    | htb (+netem)    |
    +-----------------+                                        +-----------------+

A machine's upload is shaped on egress of its own veth end (htb at the rate,
netem under it for the delay), its download on egress of the hub's end (htb at
the rate): so each NIC carries RATE each way and every packet between two
machines is delayed once by the latency. Processes of one machine reach each
other over that namespace's loopback, unshaped, as inside a real machine.
Nothing is made in the host's own namespace: deleting the run's namespaces
removes every link and qdisc it made.

Cleanup: a run claims its id in ``/run/polytrain/netns/<run>.json`` (the owning
launcher's pid and start time) before it makes anything, and removes the
namespaces, then the claim, on every way out. A launcher killed with SIGKILL
leaves them behind; the next run's :meth:`Network.open` finds them by name,
sees that their owner is gone and removes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .. import _env
from ..errors import ConfigError, LaunchError, PeerLost, first_line
from .host import own_status, proc_stat
from .layout import Layout

__all__ = ["LinkShape", "Network", "NicSampler", "link_shape", "check_links", "parse_rate",
           "parse_time",
           "check_tools", "netem_check", "nic_bytes", "start_time", "sweep_stale", "STATE_DIR",
           "owner_record", "owner_alive", "recorded_here", "pid_namespace"]

log = logging.getLogger(__name__)

STATE_DIR = Path("/run/polytrain/netns")
_SUBNET = "10.111.0"  # only ever inside the run's own namespaces
_MAX_MACHINES = 253
_PREFIX = "pt-"
_RUN_ID = re.compile(r"[0-9a-f]{6}")
_NAMESPACE = re.compile(r"pt-([0-9a-f]{6})-(hub|[A-Za-z0-9_.]+)")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}
_QUANTITY = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([a-z]*)\s*")
# The shaper's bucket: what a link sends at once after it was idle. A real NIC saves no
# credit while idle; the bucket is a millisecond at the rate (the timer's grain), and at
# least two frames (so the segments below stay above the kernel's least, about 320 B).
# htb lets a whole GSO segment through whenever its bucket is not empty, and a sender's
# TCP builds segments up to its NIC's gso_max_size (64 KiB unless told): each machine's
# NIC is told the bucket, so both shapers on a path (its upload, the receiver's download
# at the hub, where the bridge forwards the sender's segments) see segments no larger.
# An idle link so sends about 2 ms at the rate at once (three frames below 24 Mbit/s).
_BURST_S = 1e-3
_FRAME_BYTES = 1500 + 14
_MIN_BURST_BYTES = 2 * _FRAME_BYTES
_GSO_MAX_BYTES = 65536  # the most a GSO segment can be
#: The most bytes one TCP socket may hold queued below it (the kernel's TSQ bound,
#: ``net.ipv4.tcp_limit_output_bytes``, 4 MiB by default), per emulated machine.
_QUEUE_S = 1e-3
_MIN_QUEUE_BYTES = 1 << 16
_INT_MAX = 2**31 - 1  # the most a sysctl of type int (tcp_limit_output_bytes) takes
# tc's range for a link (and it keeps nan and inf out). Below a byte a second tc refuses
# ('"rate" is required'); below about 96 bit/s the least bucket takes longer than 2**32 of
# the kernel's 64 ns ticks to fill, and tc silently wraps it (50bit: 279 bytes, not 3028).
# Above about 34.4 Tbit/s a millisecond's bucket overflows tc's 32-bit burst.
_MIN_RATE_BIT_S = 100
_MAX_RATE_BIT_S = 34 * 10**12
_MAX_DELAY_S = 60.0  # a delay per packet; beyond it a link is a different problem
_TOOL_TIMEOUT_S = 30.0  # ip, tc and sysctl answer in milliseconds; a hung one must not hang us
_KILLED_TOOL_S = 5.0  # how long a killed tool may take to end before we go on without it


def _tool(cmd: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one of iproute2's tools (or sysctl); its output as text, bounded in time (also
    after a kill: not subprocess.run's unbounded wait, for a tool stuck in the kernel)."""
    # In a session of its own: a terminal's Ctrl-C interrupts the launcher, which then removes
    # what it made; it killed the tool too, and a half-made network was reported as a kernel
    # that lacks namespaces or veth.
    proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(input, timeout=_TOOL_TIMEOUT_S)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_KILLED_TOOL_S)
        raise LaunchError(f"`{' '.join(cmd)}` did not end within {_TOOL_TIMEOUT_S:g} s",
                          "look for a hung ip or tc process on this host (ps -C ip,tc) and "
                          "stop it, then rerun") from None
    finally:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _quantity(text: str, units: Mapping[str, float], flag: str, example: str) -> float:
    if not isinstance(text, str):  # a number from Python: which unit was meant?
        raise ConfigError(f"{flag} {text!r} has no unit", f"pass it as a string with its "
                          f"unit, e.g. {flag} {example}")
    m = _QUANTITY.fullmatch(text.lower())
    if m is not None:
        number, unit = float(m.group(1)), m.group(2)
        if unit in units:
            return number * units[unit]
        if unit == "" and number == 0:
            return 0.0
    kind = "rate" if "bit" in units else "time"
    raise ConfigError(f"{flag} {text!r} is not a {kind}: a number and one of the units "
                      f"{', '.join(units)} is", f"pass e.g. {flag} {example}")


def parse_rate(text: str, flag: str = "--bandwidth") -> int:
    """Bits per second from a rate as tc writes it: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``.

    Units are decimal and case-insensitive, as tc's are; 100bit to 34tbit, tc's range for a
    link (see _MIN_RATE_BIT_S)::

        >>> parse_rate("200mbit"), parse_rate("1Gbit"), parse_rate("1.5kbit")
        (200000000, 1000000000, 1500)
    """
    bits = _quantity(text, _RATE_UNITS, flag, "1gbit")
    if not _MIN_RATE_BIT_S <= bits <= _MAX_RATE_BIT_S:
        raise ConfigError(f"{flag} must be a rate of at least {_MIN_RATE_BIT_S}bit and at most "
                          f"{_MAX_RATE_BIT_S // 10**12}tbit, tc's range for a link (got "
                          f"{text!r})", f"pass e.g. {flag} 1gbit")
    return int(round(bits))


def parse_time(text: str, flag: str = "--latency") -> float:
    """Seconds from a time as tc writes it (``us``, ``ms``, ``s``; a bare ``0`` is zero).

        >>> parse_time("0.2ms"), parse_time("5us"), parse_time("0")
        (0.0002, 5e-06, 0.0)
    """
    seconds = _quantity(text, _TIME_UNITS, flag, "0.2ms")
    if not 0 <= seconds <= _MAX_DELAY_S:
        raise ConfigError(f"{flag} must be 0 or more, and at most {_MAX_DELAY_S:g}s (got "
                          f"{text!r})", f"pass e.g. {flag} 0.2ms")
    return round(seconds, 9)


@dataclass(frozen=True, kw_only=True)
class LinkShape:
    """How every emulated machine's NIC is shaped: ``rate_bit_s`` each way, ``delay_s`` per packet.

    Example::

        shape = LinkShape.parse("200mbit", "0.2ms")   # --bandwidth 200mbit --latency 0.2ms

    Args:
        rate_bit_s: the NIC's rate in each direction, bits per second.
        delay_s: added once to every packet a machine sends (the one-way delay between two
            machines; a round trip takes twice it). Default 0.
    """

    rate_bit_s: int
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not _MIN_RATE_BIT_S <= self.rate_bit_s <= _MAX_RATE_BIT_S:
            raise ConfigError(f"a link's rate must be {_MIN_RATE_BIT_S} to {_MAX_RATE_BIT_S} "
                              f"bit/s, tc's range (got {self.rate_bit_s})",
                              "pass e.g. --bandwidth 1gbit")
        if self.delay_s < 0:
            raise ConfigError(f"a link's delay must be 0 or more (got {self.delay_s} s)",
                              "pass e.g. --latency 0.2ms")

    @classmethod
    def parse(cls, bandwidth: str, latency: str | None = None) -> LinkShape:
        """The shape of ``--bandwidth RATE`` and ``--latency TIME`` (default 0)."""
        return cls(rate_bit_s=parse_rate(bandwidth),
                   delay_s=parse_time(latency) if latency is not None else 0.0)

    def describe(self) -> str:
        delay = f", {self.delay_s * 1e3:g} ms one-way delay" if self.delay_s else ""
        return f"{self.rate_bit_s / 1e6:g} Mbit/s each way{delay}"

    def as_dict(self) -> dict[str, float]:
        return {"rate_bit_s": self.rate_bit_s, "delay_s": self.delay_s}


def link_shape(bandwidth: str | None, latency: str | None = None) -> LinkShape | None:
    """The shape of ``--bandwidth`` and ``--latency``; None without a bandwidth (no emulation)."""
    if bandwidth is None:
        if latency is not None and parse_time(latency) > 0:
            raise ConfigError(f"--latency {latency} needs --bandwidth: only an emulated network "
                              f"has links to delay", "pass --bandwidth too, e.g. 1gbit")
        return None
    return LinkShape.parse(bandwidth, latency)


def check_links(layout: Layout, bandwidth: str, *, serverless: str | None = None,
                python: bool = False) -> None:
    """Refuse ``--bandwidth`` where ``layout`` has no link between machines to shape: one
    machine of workers and no server machines (colocated servers share it).
    ``serverless``: the strategy's name where it uses no servers (the hint leaves out
    --servers); the launcher, which knows no strategy, names none. ``python``: the caller
    is ``polytrain.launch()``, whose keywords the hint names too."""
    if layout.nodes > 1 or layout.servers:
        return
    where = (f"strategy {serverless!r} uses no servers, and this run's workers share one "
             f"machine" if serverless else
             "this run has one machine of workers and no server machines")
    raise ConfigError(f"--bandwidth {bandwidth} shapes the links between machines, and "
                      f"{where}: no link would be shaped", "pass --nodes 2 or more" +
                      ("" if serverless else " (or --servers K)") +
                      (" (polytrain.launch(..., nodes=2))" if python else "") +
                      ", or leave --bandwidth and --latency out")


#: What root needs to make a run's network, by capability: its bit in the mask, and why.
_CAPABILITIES = {"CAP_SYS_ADMIN": (21, "to mount the namespaces"),
                 "CAP_NET_ADMIN": (12, "to make links and qdiscs")}


def _capabilities() -> int | None:
    """This process's effective capabilities, a bit mask (``CapEff`` in /proc/self/status);
    None where Linux does not say."""
    return own_status("CapEff", 16)


def missing_tools() -> list[str]:
    """What ``--bandwidth`` needs and this host lacks: root, and root's CAP_SYS_ADMIN and
    CAP_NET_ADMIN (a container drops them), ``ip``, ``tc`` (empty: none)."""
    missing = []
    uid = os.geteuid()
    if uid != 0:
        missing.append(f"root (running as uid {uid})")
    elif (caps := _capabilities()) is not None:
        missing += [f"{name} ({why})" for name, (bit, why) in _CAPABILITIES.items()
                    if not caps >> bit & 1]
    return missing + [f"{name} (not on PATH)" for name in ("ip", "tc") if not shutil.which(name)]


def netem_check() -> str:
    """Whether ``--latency`` can work here: tc's netem qdisc is put once on the loopback of
    a throwaway namespace, which is removed again. ``yes``, ``no: ...`` or ``unknown: ...``."""
    missing = missing_tools()
    if missing:
        return "unknown: trying it needs " + ", ".join(missing)
    ip, tc = check_tools()
    # Named and claimed like a run's: a launcher's sweep leaves it while this process lives,
    # and removes it if this process dies here.
    run_id = secrets.token_hex(3)
    try:
        claim = take_claim(run_id, {})
    except ConfigError as e:  # a read-only /run, say: a run could not claim its network either
        return f"unknown: {e.what}"
    name = f"{_PREFIX}{run_id}-probe"
    try:
        made = _tool([ip, "netns", "add", name])
        if made.returncode != 0:
            return (f"unknown: could not make a namespace to try it "
                    f"({' '.join(made.stderr.split())})")
        try:
            out = _tool([tc, "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                         "1ms"])
        finally:
            _delete_namespaces(ip, [name])
    finally:
        claim.unlink(missing_ok=True)
    if out.returncode == 0:
        return "yes"
    if "qdisc kind is unknown" in out.stderr:
        return ("no: this kernel lacks tc's netem qdisc (CONFIG_NET_SCH_NETEM), so --latency "
                "is refused; modprobe sch_netem where it is a module")
    return f"unknown: {' '.join(out.stderr.split())}"


def check_tools() -> tuple[str, str]:
    """The paths of ``ip`` and ``tc``; one ConfigError naming all that is missing (root, its
    capabilities, the tools), with what to do about each."""
    missing = missing_tools()
    if missing:
        fixes = []
        if missing[0].startswith("root"):
            fixes.append("run as root")
        if caps := [name for name in _CAPABILITIES if any(m.startswith(name) for m in missing)]:
            cap_add = " ".join(f"--cap-add {name.removeprefix('CAP_')}" for name in caps)
            fixes.append(f"give this process {' and '.join(caps)} (a container: docker run "
                         f"{cap_add}, or --privileged)")
        if not shutil.which("ip") or not shutil.which("tc"):
            fixes.append("install iproute2 (apt-get install iproute2)")
        raise ConfigError(f"--bandwidth emulates machines in network namespaces, which needs "
                          f"root (with {' and '.join(_CAPABILITIES)}) and iproute2's ip and tc; "
                          f"missing: {', '.join(missing)}",
                          f"{' and '.join(fixes)}, or leave --bandwidth out")
    ip, tc = shutil.which("ip"), shutil.which("tc")
    assert ip is not None and tc is not None
    return ip, tc


def start_time(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot); None if gone or a zombie."""
    fields = proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def pid_namespace() -> str:
    """This process's PID namespace (``pid:[4026531836]``; "" where /proc does not say): a
    pid names a process only inside its namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def boot_id() -> str:
    """This kernel's boot (``/proc/sys/kernel/random/boot_id``): the same in every container
    of a host, another on another host or after a reboot; "" where it cannot be read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def owner_record() -> dict[str, Any]:
    """This process as the owner of what a later run may sweep (a run's directory, its
    network's claim): its pid, start time, PID namespace and kernel boot."""
    me = os.getpid()
    return {"pid": me, "start": start_time(me), "pid_ns": pid_namespace(), "boot": boot_id()}


def owner_alive(record: Any) -> tuple[int, bool] | None:
    """The pid an :func:`owner_record` names and whether that process still runs (one of
    another PID namespace or kernel boot counts as running: its pid says nothing here, and
    every host's first PID namespace has the same name, as on a shared file system); None
    if the record is not one."""
    try:
        pid, start = int(record["pid"]), int(record["start"])
        here = recorded_here(record)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return pid, not here or start_time(pid) == start


def recorded_here(record: Mapping[str, Any]) -> bool:
    """Whether an :func:`owner_record` is of this PID namespace and kernel boot, where its
    pid and start time name a process of this machine (a record without its namespace,
    written before stop 43, or boot, stop 47, is of this one)."""
    return (str(record.get("pid_ns", pid_namespace())) == pid_namespace()
            and str(record.get("boot", boot_id())) == boot_id())


def _owner(claim: Path) -> tuple[int, bool] | None:
    """The pid of a claim's launcher and whether it still runs; None if the claim is unreadable."""
    try:
        return owner_alive(json.loads(claim.read_text()))
    except (OSError, ValueError):
        return None


def _run_namespaces(ip: str) -> dict[str, list[str]]:
    """Every namespace named like a run's, by run id."""
    out = _tool([ip, "netns", "list"])
    runs: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        name = line.split(" ", 1)[0]
        m = _NAMESPACE.fullmatch(name)
        if m:
            runs.setdefault(m.group(1), []).append(name)
    return runs


def _delete_namespaces(ip: str, names: Sequence[str]) -> None:
    for name in names:
        # Already gone is fine: a concurrent sweep may have removed it. One that cannot be
        # removed must not keep the others (or the run's own error) from their clean-up.
        try:
            out = _tool([ip, "netns", "delete", name])
        except LaunchError as e:
            log.warning("could not remove network namespace %s: %s", name, e)
            continue
        if out.returncode != 0 and "No such file" not in out.stderr:
            log.warning("could not remove network namespace %s: %s", name,
                        " ".join(out.stderr.split()))


def take_claim(run_id: str, record: dict[str, Any]) -> Path:
    """Claim ``run_id`` for this process in :data:`STATE_DIR` (``record`` added to its owner
    record); the claim's path. ConfigError where a live run holds it, or where
    :data:`STATE_DIR` cannot be written (a read-only /run)."""
    try:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(e) from None
    claim = STATE_DIR / f"{run_id}.json"
    # Written whole under another name, then linked into place (which fails where the claim
    # exists): another launcher's sweep never reads a claim half written, which it would
    # take for an ownerless one and remove, with this run's namespaces after it.
    tmp = STATE_DIR / f".{run_id}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({**owner_record(), **record}, f)
        os.link(tmp, claim)
    except FileExistsError:
        owner = _owner(claim)
        pid = f"launcher pid {owner[0]}" if owner else "an unknown launcher"
        raise ConfigError(f"network namespace {_PREFIX}{run_id}-hub belongs to another live "
                          f"run ({run_id}, {pid})",
                          "let that run end, or start this one with another run id") from None
    except OSError as e:
        raise _unwritable(e) from None
    finally:
        with contextlib.suppress(OSError):  # a read-only /run refuses even this (EROFS)
            tmp.unlink(missing_ok=True)
    return claim


def _unwritable(e: OSError) -> ConfigError:
    """The refusal of a run whose claim :data:`STATE_DIR` cannot hold (``e``: the OS's error)."""
    return ConfigError(f"--bandwidth needs a writable {STATE_DIR}, where each run claims its "
                       f"emulated network ({first_line(e)})",
                       "make it writable (a read-only /run: mount a tmpfs there), or leave "
                       "--bandwidth out")


def sweep_stale() -> list[str]:
    """Remove the networks of runs whose launcher is gone; return their run ids.

    A run is stale when its claim names a launcher that no longer runs, or when
    its namespaces have no claim at all (a run writes its claim before it makes
    any namespace, so a live run always has one; every run of the host claims in
    :data:`STATE_DIR`). A claim's half-written copy whose writer is gone goes too.
    """
    ip, _ = check_tools()
    runs = _run_namespaces(ip)
    state_dir = STATE_DIR
    claims = {p.stem: p for p in state_dir.glob("*.json")} if state_dir.is_dir() else {}
    for tmp in state_dir.glob(".*.tmp") if state_dir.is_dir() else []:
        writer = tmp.name.split(".")[2]  # .RUN.PID.tmp
        if writer.isdigit() and start_time(int(writer)) is None:
            tmp.unlink(missing_ok=True)
    removed = []
    for run_id in sorted(set(runs) | set(claims)):
        owner = _owner(claims[run_id]) if run_id in claims else None
        if owner is not None and owner[1]:
            continue
        _delete_namespaces(ip, runs.get(run_id, []))
        if run_id in claims:
            claims[run_id].unlink(missing_ok=True)
        if runs.get(run_id):
            gone = f"launcher pid {owner[0]} is gone" if owner else "it has no owner"
            log.warning("removed the stale emulated network of run %s (%s): %s", run_id, gone,
                        ", ".join(runs[run_id]))
        removed.append(run_id)
    return removed


NETNS_DIRS = (Path("/run/netns"), Path("/var/run/netns"))  # where iproute2 keeps them
_CLONE_NEWNET = 0x40000000


def enter_namespace(path: str) -> None:
    """Move this process (its calling thread: call it before starting any) into the network
    namespace held by ``path`` (its network only: ``ip netns exec`` also remounts ``/sys``
    and applies ``/etc/netns``); OSError if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def nic_bytes(pid: int, nic: str) -> tuple[int, int]:
    """``(sent, received)`` bytes of interface ``nic`` as seen in process ``pid``'s namespace.

    ``/proc/PID/net/dev`` shows the kernel's counters of that process's network
    namespace, whichever namespace the reader is in.
    """
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, sep, counters = line.partition(":")
            if sep and name.strip() == nic:
                fields = counters.split()
                return int(fields[8]), int(fields[0])  # tx_bytes, rx_bytes
    raise LaunchError(f"process {pid} has no network interface {nic!r}",
                      "sample NICs only in runs launched with --bandwidth")


@dataclass(frozen=True)
class NicSampler:
    """Reads every machine's NIC counters at once: ``{machine: (sent, received)}``.

    Args:
        nics: per machine, a process running there and the machine's interface.
    """

    nics: Mapping[str, tuple[int, str]]

    def __call__(self) -> dict[str, tuple[int, int]]:
        out = {}
        for machine, (pid, nic) in self.nics.items():
            try:
                out[machine] = nic_bytes(pid, nic)
            except FileNotFoundError:  # its /proc is gone: a peer that ended (secondary)
                raise PeerLost(f"process {pid} of machine {machine}, whose NIC counters this "
                               f"process reads, has ended",
                               "look at that process's log for its error") from None
        return out


class Network:
    """One run's emulated cluster network (see the module's diagram).

    Example::

        with Network(["node0", "node1"], LinkShape.parse("200mbit")) as net:
            subprocess.run([*net.exec_prefix("node0"), "python", "job.py"],
                           env={**os.environ, **net.child_env("node0")})

    Args:
        machines: the emulated machines, each its own namespace (at most 253).
        shape: each machine's NIC rate and delay.
        run_id: six hex digits naming the run's namespaces (default: random); one a live run
            holds is refused.

    Every run of a host claims its id in :data:`STATE_DIR` (``/run/polytrain/netns``),
    where the others' sweeps look.
    """

    def __init__(self, machines: Sequence[str], shape: LinkShape, *,
                 run_id: str | None = None) -> None:
        if not 1 <= len(machines) <= _MAX_MACHINES:
            raise ConfigError(f"an emulated network holds 1 to {_MAX_MACHINES} machines (got "
                              f"{len(machines)})", "run fewer --nodes and --servers")
        if len(set(machines)) != len(machines):
            raise ConfigError(f"machine names repeat: {list(machines)}", "name each once")
        for m in machines:
            if _NAMESPACE.fullmatch(f"{_PREFIX}000000-{m}") is None or m == "hub":
                raise ConfigError(f"machine name {m!r} cannot name a namespace",
                                  "use letters, digits, '_' and '.' only")
        self.run_id = run_id if run_id is not None else secrets.token_hex(3)
        if _RUN_ID.fullmatch(self.run_id) is None:
            raise ConfigError(f"run id {self.run_id!r} is not six hex digits",
                              "pass e.g. run_id='a1b2c3', or none for a random one")
        self.machines = tuple(machines)
        self.shape = shape
        self._ip, self._tc = check_tools()
        self._claim: Path | None = None
        self._made: list[str] = []
        self._open = False

    # -- names -------------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        return f"{_PREFIX}{self.run_id}-"

    @property
    def hub(self) -> str:
        return self.prefix + "hub"

    def namespace(self, machine: str) -> str:
        return self.prefix + machine

    def nic(self, machine: str) -> str:
        """The machine's interface: ``pt-<run>-n0`` for node0, ``pt-<run>-s0`` for server0.

        Linux allows 15 characters, and the hub's end adds an ``h``: other names, and
        long numbers, take the machine's index (``pt-<run>-m7``).
        """
        i = self.machines.index(machine)
        m = re.fullmatch(r"(node|server)(\d{1,3})", machine)
        return self.prefix + (f"{machine[0]}{m.group(2)}" if m else f"m{i}")

    def address(self, machine: str) -> str:
        return f"{_SUBNET}.{self.machines.index(machine) + 1}"

    def exec_prefix(self, machine: str) -> list[str]:
        """The command line prefix that runs a program on ``machine`` (in its namespace)."""
        return [self._ip, "netns", "exec", self.namespace(machine)]

    def namespace_file(self, machine: str) -> str | None:
        """The file that holds ``machine``'s namespace (``ip netns add`` mounts it there),
        which a forked process enters with ``setns``; None if it is in neither of iproute2's
        places (the process then starts through ``ip netns exec``)."""
        for root in NETNS_DIRS:
            path = root / self.namespace(machine)
            if path.exists():
                return str(path)
        return None

    def child_env(self, machine: str) -> dict[str, str]:
        """What a process on ``machine`` needs: gloo binds the machine's NIC, polytrain knows it."""
        return {_env.GLOO_SOCKET_IFNAME: self.nic(machine), _env.NIC: self.nic(machine)}

    # -- life --------------------------------------------------------------------------------

    def __enter__(self) -> Network:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Remove stale runs, claim this run's id, make its namespaces, links and qdiscs."""
        sweep_stale()
        self._take_claim()
        self._open = True
        try:
            for name in [self.hub, *map(self.namespace, self.machines)]:
                self._add_namespace(name)
            self._make_links()
            self._shape_links()
        except BaseException:
            self.close()
            raise
        log.info("emulated network %s: %d machines, %s", self.prefix, len(self.machines),
                 self.shape.describe())

    def close(self) -> None:
        """Remove everything :meth:`open` made (idempotent)."""
        if not self._open:
            return
        # Machines first: their veth ends go with them, then the hub and its bridge. Those of
        # the run's name it did not see made too (an `ip netns add` that ended uncertain).
        try:
            ours = _run_namespaces(self._ip).get(self.run_id, [])
        except LaunchError as e:
            log.warning("could not list the network namespaces: %s", e)
            ours = []
        made = [*self._made, *(n for n in ours if n not in self._made)]
        _delete_namespaces(self._ip, [n for n in made if n != self.hub] +
                           [n for n in made if n == self.hub])
        self._made.clear()
        if self._claim is not None:
            self._claim.unlink(missing_ok=True)
            self._claim = None
        self._open = False

    def _take_claim(self) -> None:
        self._claim = take_claim(self.run_id, {"machines": list(self.machines)})

    def _add_namespace(self, name: str) -> None:
        out = _tool([self._ip, "netns", "add", name])
        if out.returncode != 0:
            if "exists" in out.stderr:
                raise ConfigError(f"network namespace {name} exists already, made by another "
                                  f"run", "let that run end, or start this one with another "
                                          "run id")
            raise LaunchError(f"could not make network namespace {name}: "
                              f"{out.stderr.strip()}", "check that this kernel has network "
                                                       "namespaces (CONFIG_NET_NS)")
        self._made.append(name)

    def _batch(self, tool: str, namespace: str, commands: Sequence[str]) -> None:
        """Run ``commands`` through ``ip -batch`` or ``tc -batch`` inside ``namespace``."""
        out = _tool([tool, "-n", namespace, "-batch", "-"], input="\n".join(commands))
        if out.returncode != 0:
            if "netem" in "".join(commands) and "qdisc kind is unknown" in out.stderr:
                raise ConfigError(f"--latency {self.shape.delay_s * 1e3:g}ms needs tc's netem "
                                  f"qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM)",
                                  "load it (modprobe sch_netem) or leave --latency out")
            raise LaunchError(f"setting up the emulated network failed in {namespace}: "
                              f"{' '.join(out.stderr.split())}",
                              "check that the kernel has veth, bridge and htb")

    def _make_links(self) -> None:
        bridge = self.prefix + "br"
        # addrgenmode none: no IPv6 link-local address, so no neighbour chatter on the counters.
        hub = ["link set lo up", f"link add name {bridge} type bridge",
               f"link set {bridge} addrgenmode none", f"link set {bridge} up"]
        for m in self.machines:
            nic = self.nic(m)
            hub += [f"link add {nic}h type veth peer name {nic} netns {self.namespace(m)} "
                    f"gso_max_size {self._segment_bytes()}",
                    f"link set {nic}h master {bridge} addrgenmode none", f"link set {nic}h up"]
        self._batch(self._ip, self.hub, hub)
        for m in self.machines:
            nic = self.nic(m)
            self._batch(self._ip, self.namespace(m), [
                "link set lo up", f"link set {nic} addrgenmode none",
                f"addr add {self.address(m)}/24 dev {nic}", f"link set {nic} up"])
            self._short_queues(m)

    def _short_queues(self, machine: str) -> None:
        # A real NIC holds about a millisecond of bytes (byte queue limits); the shaper's
        # queue here would take 4 MiB from every socket, and a small message (gloo's notice
        # that a receive is posted) would wait behind all of them: 33 ms per socket at
        # 1 Gbit/s, tens of them per step for a server's many connections.
        out = _tool([*self.exec_prefix(machine), "sysctl", "-qw",
                     f"net.ipv4.tcp_limit_output_bytes={self._queue_bytes()}"])
        if out.returncode != 0:
            log.warning("could not bound the TCP queue in %s (%s): small messages may wait "
                        "behind bulk data", self.namespace(machine), out.stderr.strip())

    def _shape_links(self) -> None:
        for m in self.machines:
            nic = self.nic(m)
            self._batch(self._tc, self.namespace(m), self._qdiscs(nic, self.shape.delay_s))
            self._batch(self._tc, self.hub, self._qdiscs(nic + "h", 0.0))

    def _burst_bytes(self) -> int:
        """The shaper's bucket (see _BURST_S)."""
        return max(_MIN_BURST_BYTES, int(self.shape.rate_bit_s / 8 * _BURST_S))

    def _queue_bytes(self) -> int:
        """The most bytes a TCP socket may queue below it (see _QUEUE_S); the sysctl is an
        int, which a millisecond above 17 Tbit/s overflows."""
        return min(_INT_MAX, max(_MIN_QUEUE_BYTES, int(self.shape.rate_bit_s / 8 * _QUEUE_S)))

    def _segment_bytes(self) -> int:
        """Each machine NIC's gso_max_size: its bucket, or less (TCP's segments are whole
        MSS below it less its headers' room, about 320 bytes)."""
        return min(_GSO_MAX_BYTES, self._burst_bytes())

    def _qdiscs(self, nic: str, delay_s: float) -> list[str]:
        """htb at the rate on egress of ``nic``; netem under it for a delay."""
        rate = self.shape.rate_bit_s
        burst = self._burst_bytes()
        commands = [f"qdisc add dev {nic} root handle 1: htb default 1",
                    f"class add dev {nic} parent 1: classid 1:1 htb rate {rate}bit "
                    f"ceil {rate}bit burst {burst}b cburst {burst}b quantum 65536"]
        if delay_s:
            # To the nanosecond (parse_time's grain) in microseconds: whole ones made 0.4us no
            # delay at all, and iproute2's tc (6.1) reads no "ns".
            commands.append(f"qdisc add dev {nic} parent 1:1 handle 10: netem delay "
                            f"{delay_s * 1e6:.3f}us limit 100000")
        return commands
