"""``polytrain env``: versions, backends and devices, for bug reports."""

from __future__ import annotations

import argparse
import platform
from typing import Any

__all__: list[str] = []


def add_parser(sub: Any) -> None:
    p = sub.add_parser("env", help="print versions, backends and devices (for bug reports)")
    p.set_defaults(run=run)


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return "not installed"


def report() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    import polytrain
    from polytrain import _env

    cpus = _env.usable_cores()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or "none"
    try:
        import torch.distributed.pipelining  # noqa: F401
        pipelining = "yes"
    except ImportError as e:
        pipelining = f"no ({e})"
    from polytrain.launch.network import missing_tools, netem_check

    missing = missing_tools()
    network = ("no: missing " + ", ".join(missing) if missing
               else "root, ip and tc present (the kernel must allow namespaces too)")
    return [
        ("polytrain", polytrain.__version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("numpy", _version("numpy")),
        ("cuda (torch build)", str(torch.version.cuda)),
        ("cpus", str(cpus)),
        ("gpus", f"{gpus} ({names})"),
        ("backend gloo", str(dist.is_gloo_available())),
        ("backend nccl", str(dist.is_nccl_available())),
        ("backend mpi", str(dist.is_mpi_available())),
        ("torch.distributed.pipelining", pipelining),
        ("strategies", ", ".join(polytrain.strategy_names())),
        ("fork server", "on" if _env.forkserver_on() else "off (POLYTRAIN_FORKSERVER)"),
        ("--bandwidth (emulated network)", network),
        ("--latency (tc netem)", netem_check()),
    ]


def run(ns: argparse.Namespace) -> int:
    rows = report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
