"""Heterogeneous clusters as plain data: device types, machines, links; parsed from a spec."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["DeviceType", "Device", "Machine", "Cluster", "BUILTIN_TYPES", "parse_cluster",
           "homogeneous"]

_MIB = 1 << 20
_MB = 10 ** 6


@dataclass(frozen=True, kw_only=True)
class DeviceType:
    """A kind of accelerator: how fast it computes and how much memory it has.

    On CPU a device of this type is *emulated*: each layer runs for real, then
    the process waits until the time the layer would take at ``gflops``.

    Args:
        name: what specs call it (``fast``).
        gflops: sustained compute rate in GFLOP/s (emulated on CPU).
        memory_mb: device memory in MiB.
    """

    name: str
    gflops: float
    memory_mb: float

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", self.name):
            raise ConfigError(f"device type name {self.name!r} is not a plain name",
                              "use letters, digits, '_' or '-', starting with a letter")
        if not 0 < self.gflops < math.inf or not 0 < self.memory_mb < math.inf:
            raise ConfigError(f"device type {self.name!r} needs a positive, finite rate and memory "
                              f"(got {self.gflops} GFLOP/s, {self.memory_mb} MiB)",
                              f"define it as {self.name}=GFLOPS/MEMORY_MIB, e.g. "
                              f"{self.name}=3/1024")

    @property
    def flops_per_s(self) -> float:
        return self.gflops * 1e9

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mb * _MIB)

    def describe(self) -> str:
        return f"{self.name} ({self.gflops:g} GFLOP/s, {self.memory_mb:g} MiB)"


# Slow enough that emulated time dominates real compute when four processes share two
# CPU cores (a process computes the reference GPT at ~25-50 GFLOP/s there).
BUILTIN_TYPES: dict[str, DeviceType] = {
    t.name: t for t in (
        DeviceType(name="fast", gflops=4.0, memory_mb=1024),
        DeviceType(name="mid", gflops=3.0, memory_mb=1024),
        DeviceType(name="slow", gflops=2.0, memory_mb=1024),
    )
}


@dataclass(frozen=True)
class Device:
    """One device of a cluster: its global index (= worker index), machine, and type."""

    index: int
    machine: str
    machine_index: int
    local_index: int
    type: DeviceType

    def describe(self) -> str:
        return f"{self.machine}/{self.local_index} {self.type.name}"


@dataclass(frozen=True)
class Machine:
    name: str
    types: tuple[str, ...]  # one type name per device, in local order


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Machines of devices, and the bandwidth of the links between devices.

    Device ``i`` (machine-major order) is worker ``i`` of the run: machine ``m``
    of the spec is the launcher's ``node{m}``.

    Example::

        >>> c = parse_cluster("m0:fast*2,m1:slow*2")
        >>> [d.describe() for d in c.devices]
        ['m0/0 fast', 'm0/1 fast', 'm1/0 slow', 'm1/1 slow']

    Args:
        machines: in order; every machine holds at least one device.
        types: the device types the machines use, by name.
        intra_mb_s, inter_mb_s: link bandwidth in MB/s inside a machine and across.
    """

    machines: tuple[Machine, ...]
    types: Mapping[str, DeviceType] = field(default_factory=dict)
    intra_mb_s: float = 1000.0
    inter_mb_s: float = 100.0

    def __post_init__(self) -> None:
        if not self.machines:
            raise ConfigError("a cluster needs at least one machine (got none)",
                              "pass e.g. --devices 'm0:fast*2,m1:slow*2'")
        names = [m.name for m in self.machines]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"machine {dup[0]!r} appears twice in the cluster",
                              "name each machine once and list all its devices there")
        for m in self.machines:
            if not m.types:
                raise ConfigError(f"machine {m.name!r} has no devices", f"write {m.name}:fast*2")
            for t in m.types:
                if t not in self.types:
                    raise ConfigError(
                        f"machine {m.name!r} uses unknown device type {t!r}; the types are: "
                        f"{', '.join(sorted(self.types))}",
                        f"define it in the spec as {t}=GFLOPS/MEMORY_MIB, e.g. {t}=3/1024")
        if not 0 < self.intra_mb_s < math.inf or not 0 < self.inter_mb_s < math.inf:
            raise ConfigError(f"link bandwidths must be positive and finite (got "
                              f"{self.intra_mb_s:g} and {self.inter_mb_s:g} MB/s)",
                              "write link=1000/100 (MB/s)")
        for m in self.machines:
            if not _NAME.match(m.name):
                raise ConfigError(f"machine name {m.name!r} is not a plain name (letters, "
                                  f"digits, _ - .)", "name machines as m0, m1, ...")
            if len(m.types) > MAX_DEVICES:
                raise ConfigError(f"machine {m.name!r} holds {len(m.types)} devices, and a "
                                  f"machine holds 1 to {MAX_DEVICES}",
                                  "list each machine's own devices")

    @property
    def devices(self) -> tuple[Device, ...]:
        out: list[Device] = []
        for mi, m in enumerate(self.machines):
            for li, t in enumerate(m.types):
                out.append(Device(len(out), m.name, mi, li, self.types[t]))
        return tuple(out)

    @property
    def size(self) -> int:
        return sum(len(m.types) for m in self.machines)

    def bandwidth(self, a: Device, b: Device) -> float:
        """Bytes per second between two devices."""
        mb_s = self.intra_mb_s if a.machine_index == b.machine_index else self.inter_mb_s
        return mb_s * _MB

    def fit_layout(self, workers: int | None, nodes: int | None) -> tuple[int, int]:
        """``--workers`` and ``--nodes`` as a run on this cluster takes them: each left out
        (None) is the cluster's, and ones given that disagree with it are refused (an
        ``--nodes 1`` among them: it was taken for the default, and overridden)."""
        nodes_given = nodes is not None
        workers = self.size if workers is None else workers
        nodes = len(self.machines) if nodes is None else nodes
        self.check_layout(workers, nodes, nodes_given=nodes_given)
        return workers, nodes

    def check_layout(self, workers: int, nodes: int, *, nodes_given: bool = True) -> None:
        """Refuse a launch layout that is not this cluster's machines and devices
        (``nodes_given``: whether the user passed ``nodes``, or it came from the cluster)."""
        per = {len(m.types) for m in self.machines}
        if len(per) > 1:
            raise ConfigError(
                f"the cluster's machines hold different numbers of devices "
                f"({', '.join(f'{m.name}: {len(m.types)}' for m in self.machines)}); the local "
                f"launcher puts the same number of workers on every machine",
                "give every machine the same number of devices")
        if workers != self.size or nodes != len(self.machines):
            raise ConfigError(
                f"--devices describes {self.size} devices on {len(self.machines)} machines but the "
                f"run has {workers} workers{f' on {nodes} machines' if nodes_given else ''}",
                "leave out --workers and --nodes (--devices sets them), or make them agree")

    def describe(self) -> str:
        """One line per machine, then the links."""
        lines = [f"{m.name}: " + ", ".join(self.types[t].describe() for t in m.types)
                 for m in self.machines]
        lines.append(f"links: {self.intra_mb_s:g} MB/s inside a machine, "
                     f"{self.inter_mb_s:g} MB/s across")
        return "\n".join(lines)


def homogeneous(workers: int, nodes: int) -> Cluster:
    """The cluster of a run without ``--devices``: equal nominal devices (nothing emulated)."""
    nominal = DeviceType(name="nominal", gflops=1000.0, memory_mb=1 << 30)
    per = workers // nodes
    return Cluster(machines=tuple(Machine(f"node{i}", ("nominal",) * per) for i in range(nodes)),
                   types={"nominal": nominal}, intra_mb_s=1e6, inter_mb_s=1e6)


_NAME = re.compile(r"^[A-Za-z0-9_\-.]+$")
_MACHINE = re.compile(r"^([A-Za-z0-9_\-.]+):(.+)$")
_TYPE_DEF = re.compile(r"^([A-Za-z_][A-Za-z0-9_\-]*)=([0-9.eE+\-]+)/([0-9.eE+\-]+)$")
_COUNT = re.compile(r"^([A-Za-z_][A-Za-z0-9_\-]*)(?:\*(\d+))?$")

_SPEC_HINT = ("write machines as NAME:TYPE*COUNT joined by ',' (several types with '+'), "
              "new types as NAME=GFLOPS/MEMORY_MIB and links as link=INTRA/INTER (MB/s), e.g. "
              "'m0:fast*2,m1:slow*2' or 'big=8/4096,m0:big+fast' (built-in types: "
              + ", ".join(t.describe() for t in BUILTIN_TYPES.values()) + ")")


def parse_cluster(spec: str) -> Cluster:
    """A cluster from a ``--devices`` string or a JSON file.

    String: ``m0:fast*2,m1:slow*2`` (machine ``m0`` with two ``fast`` devices,
    ...), optional type definitions ``big=8/4096`` (GFLOP/s / MiB) and link
    bandwidths ``link=1000/100`` (MB/s inside a machine / across machines).
    File (``.json``): ``{"types": {"big": {"gflops": 8, "memory_mb": 4096}},
    "machines": {"m0": ["big", "fast"]}, "link_mb_s": {"intra": 1000, "inter": 100}}``.
    """
    text = spec.strip()
    if text.endswith(".json") or Path(text).is_file():
        return _from_file(Path(text))
    types = dict(BUILTIN_TYPES)
    machines: list[Machine] = []
    links: dict[str, float] = {}
    for raw in text.split(",") if text else []:
        item = raw.strip()
        if not item:  # skipped, 'm0:fast*2,,m1:slow*2' read as if its typo were not there
            raise ConfigError(f"--devices: {text!r} has an empty item (two commas in a row, or "
                              f"one at an end)", "join the machines, types and links with one "
                              "',' each, e.g. 'm0:fast*2,m1:slow*2'")
        if item[:5].lower() == "link=":  # 'LINK=' was read as a device type no machine used
            parts = item[5:].split("/")
            try:
                if links or len(parts) != 2:
                    raise ValueError(item)
                links = {"intra_mb_s": float(parts[0]), "inter_mb_s": float(parts[1])}
            except ValueError:
                raise ConfigError(f"--devices: cannot read link bandwidths {item!r} (two "
                                  f"numbers, given once)", "write link=INTRA/INTER in MB/s, "
                                  "e.g. link=1000/100") from None
        elif (m := _TYPE_DEF.match(item)) is not None:
            try:
                gflops, memory = float(m[2]), float(m[3])
            except ValueError:
                raise ConfigError(f"--devices: cannot read the type definition {item!r}",
                                  _SPEC_HINT) from None
            if m[1] in types:  # the last one won, silently, and over a built-in's too
                raise ConfigError(f"--devices: device type {m[1]!r} is defined twice"
                                  f"{' (it is built in)' if m[1] in BUILTIN_TYPES else ''}",
                                  "give the new type a name of its own")
            types[m[1]] = DeviceType(name=m[1], gflops=gflops, memory_mb=memory)
        elif (m := _MACHINE.match(item)) is not None:
            names: list[str] = []
            for part in m[2].split("+"):
                c = _COUNT.match(part.strip())
                if c is None:
                    raise ConfigError(f"--devices: cannot read {part!r} in {item!r}", _SPEC_HINT)
                count = int(c[2] or 1)
                if not 1 <= count <= MAX_DEVICES:
                    raise ConfigError(f"--devices: {part.strip()!r} in {item!r} asks for {count} "
                                      f"devices, and a machine holds 1 to {MAX_DEVICES}",
                                      "write TYPE*N with N the machine's devices of that type")
                names += [c[1]] * count
            machines.append(Machine(m[1], tuple(names)))
        else:
            raise ConfigError(f"--devices: cannot read {item!r}", _SPEC_HINT)
    # A type defined for no machine is a typo's (a misspelt name, on a machine or here).
    used = sorted({t for m in machines for t in m.types})
    unused = [t for t in types if t not in BUILTIN_TYPES and t not in used]
    # None at all, or a machine's type that is defined nowhere: Cluster names what is wrong.
    if unused and machines and all(t in types for t in used):
        several = len(unused) > 1
        raise ConfigError(
            f"--devices defines device type{'s' * several} {', '.join(map(repr, unused))} "
            f"that no machine uses (the machines use {', '.join(used)})",
            f"list {'them' if several else 'it'} on a machine (e.g. {machines[0].name}:"
            f"{unused[0]}*2), or leave {'their definitions' if several else 'it'} out")
    return Cluster(machines=tuple(machines), types=types, **links)


#: The most devices of one type a machine may list (each is a worker process).
MAX_DEVICES = 1024


def _from_file(path: Path) -> Cluster:
    try:
        data: Any = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
    except OSError as e:
        raise ConfigError(f"--devices: cannot read {str(path)!r} ({e.strerror})",
                          "pass an existing JSON file or a spec like 'm0:fast*2'") from None
    except ValueError as e:
        raise ConfigError(f"--devices: {str(path)!r} is not valid JSON ({e})",
                          "see polytrain.pipeline.parse_cluster for the format") from None
    types = dict(BUILTIN_TYPES)
    try:
        _known_keys(data, ("machines", "types", "link_mb_s"), "the file")
        for name, t in dict(data.get("types", {})).items():
            if name in types:
                raise ConfigError(f"--devices: {str(path)!r} defines device type {name!r}, "
                                  f"which is built in", "give the new type a name of its own")
            _known_keys(t, ("gflops", "memory_mb"), f"type {name!r}")
            types[name] = DeviceType(name=name, gflops=_number(t["gflops"]),
                                     memory_mb=_number(t["memory_mb"]))
        if not isinstance(data["machines"], dict):
            raise TypeError(f'"machines" must map each machine to its device types, not '
                            f'{data["machines"]!r}')
        machines = tuple(Machine(str(n), _type_names(ts)) for n, ts in data["machines"].items())
        link = dict(data.get("link_mb_s", {}))
        _known_keys(link, ("intra", "inter"), '"link_mb_s"')
        intra, inter = _number(link.get("intra", 1000.0)), _number(link.get("inter", 100.0))
    except ConfigError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ConfigError(f"--devices: {str(path)!r} lacks, misnames or mistypes a field "
                          f"({type(e).__name__}: {e})",
                          'write {"machines": {"m0": ["fast", "fast"]}, "types": {"fast": '
                          '{"gflops": 2.0, "memory_mb": 4096}}, "link_mb_s": {"intra": 1000, '
                          '"inter": 100}}') from None
    return Cluster(machines=machines, types=types, intra_mb_s=intra, inter_mb_s=inter)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json keeps a repeated key's last value:
    a machine listed twice lost its first devices, silently)."""
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise ConfigError(f"--devices: {dup!r} appears twice in one object of the file",
                          "name each machine and type once, and list all its devices there")
    return dict(pairs)


def _known_keys(obj: Any, known: tuple[str, ...], where: str) -> None:
    """Refuse a key the format does not have (a misnamed one fell back to its default)."""
    unknown_keys = sorted(set(dict(obj)) - set(known))
    if unknown_keys:
        raise TypeError(f"{where} has {unknown_keys[0]!r}, and takes only "
                        f"{', '.join(repr(k) for k in known)}")


def _number(value: Any) -> float:
    """A JSON number (true, or "4096", read as one before)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def _type_names(types: Any) -> tuple[str, ...]:
    """A machine's device types in a JSON spec: a list of names, not one string."""
    if not isinstance(types, list):
        raise TypeError(f"a machine's devices must be a list of type names, not {types!r}")
    return tuple(str(t) for t in types)
