"""``polytrain plan``: predict every strategy's step time for a job and cluster, recommend one."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import _env
from ..errors import ConfigError
from ..plan import HOSTS, Job, plan_job
from ..strategies.base import get_strategy, strategy_names
from .job import add_devices_flag, add_job_flags, add_model_flags, model_options
from .options import OptionFlag, Owner, add_hidden_flags

__all__: list[str] = []

_flags: dict[str, OptionFlag] = {}
_model_flags: dict[str, OptionFlag] = {}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="predict each strategy's step time and recommend one",
                       description="Predict the step time of every strategy that can run the "
                                   "job (ddp, byteps and herring on 0..K servers) from a "
                                   "compute profile of the model and each strategy's bytes on "
                                   "the busiest NIC; recommend the fastest. Nothing is "
                                   "launched, so the cluster may be larger than this machine.")
    add_job_flags(p, planning=True)
    add_devices_flag(p, planning=True)
    p.add_argument("--hosts", default="emulated", choices=HOSTS,
                   help="emulated (default): every machine on this host, as `polytrain train` "
                        "runs them; real: each machine its own host")
    p.add_argument("--cores", type=int, default=None, metavar="C",
                   help="with --hosts emulated: the host's cores (default: this machine's)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="the run's longest wait on another process (default: "
                        "POLYTRAIN_TIMEOUT, else 120): a strategy whose first message "
                        "outlasts it on --bandwidth is left out, as train refuses it")
    p.add_argument("--json", action="store_true",
                   help='print {"predictions": {NAME: {...}}, "recommended": NAME, ...}')
    _model_flags.update(add_model_flags(p))
    _flags.update(add_hidden_flags(p, [Owner(n, "", get_strategy(n).Options)
                                       for n in strategy_names()]))
    p.set_defaults(run=run)


def job_from_args(ns: argparse.Namespace) -> Job:
    for name, opt in _flags.items():
        if getattr(ns, name, None) is not None:
            raise ConfigError(f"{opt.flag} is an option of {', '.join(opt.owners)}; polytrain "
                              f"plan predicts every strategy with its defaults",
                              f"leave {opt.flag} out")
    return Job(model=ns.model, model_options=model_options(ns, _model_flags),
               workers=ns.workers, nodes=ns.nodes, servers=ns.servers,
               batch_size=ns.batch_size, optimizer=ns.optimizer, bandwidth=ns.bandwidth,
               latency=ns.latency, devices=ns.devices, hosts=ns.hosts, cores=ns.cores,
               data=ns.data, timeout_s=ns.timeout if ns.timeout is not None else _env.timeout_of())


def run(ns: argparse.Namespace) -> int:
    plan = plan_job(job_from_args(ns))
    if ns.json:
        print(json.dumps(plan.as_dict(), indent=1))
    else:
        print(plan.describe())
    return 0
