"""``polytrain launch``: run a script in local worker and server processes."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ..launch.launcher import launch_script
from ..launch.layout import Layout
from .options import add_network_flags

__all__: list[str] = []


def add_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="run SCRIPT in local worker and server processes",
                       description="Start W workers (spread over N emulated machines) and K "
                                   "servers on this machine, each running SCRIPT; roles and "
                                   "machines reach polytrain.init() through the environment.")
    p.add_argument("--workers", type=int, default=1, metavar="W", help="default 1")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="default 1")
    p.add_argument("--servers", type=int, default=0, metavar="K",
                   help="dedicated server processes (default 0)")
    p.add_argument("--colocated", type=int, default=0, metavar="C",
                   help="server processes on every worker machine (default 0)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="longest wait on another process (default: POLYTRAIN_TIMEOUT, "
                        "else 120)")
    p.add_argument("--no-rank-prefix", dest="rank_prefix", action="store_false",
                   help="print the processes' lines as they are (default: each starts with "
                        "[rank R role@machine] where there are several processes)")
    add_network_flags(p)
    p.add_argument("script", metavar="SCRIPT", nargs="?")  # none: refused by run(), clearly
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(run=run)


def _script_args(ns: argparse.Namespace) -> list[str]:
    """SCRIPT's ARGS as given: argparse drops a '--' right after SCRIPT, which ``python
    SCRIPT -- A`` passes on (a script may read what follows it as positionals)."""
    given = list(getattr(ns, "argv", []))
    for i, arg in enumerate(given):
        if arg == ns.script and given[i + 1:i + 2] == ["--"] and given[i + 2:] == ns.args:
            return given[i + 1:]
    return list(ns.args)


def run(ns: argparse.Namespace) -> int:
    if ns.script is None:  # argparse said "required: SCRIPT, ARGS", and ARGS are not
        raise ConfigError("polytrain launch needs the SCRIPT to run",
                          "pass it and its own arguments last: polytrain launch --workers 2 "
                          "train.py --lr 0.1")
    layout = Layout(workers=ns.workers, nodes=ns.nodes, servers=ns.servers,
                    colocated=ns.colocated)
    launch_script(ns.script, _script_args(ns), layout=layout, port=ns.port, timeout_s=ns.timeout,
                  bandwidth=ns.bandwidth, latency=ns.latency, rank_prefix=ns.rank_prefix)
    return 0
