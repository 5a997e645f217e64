"""The flags that describe a job and its cluster, shared by ``train`` and ``plan``."""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from ..config import OPTIMIZERS, TrainConfig
from ..data import dataset_names
from ..errors import ConfigError
from ..models import SIZE_OPTIONS, get_model, model_names
from .options import OptionFlag, Owner, add_network_flags, add_option_groups, given_options

__all__: list[str] = []


def add_job_flags(p: argparse.ArgumentParser, *, planning: bool = False) -> None:
    """``--model --data --workers --nodes --servers --batch-size --optimizer`` and the network;
    ``--devices`` is :func:`add_devices_flag`, the model options :func:`add_model_flags`.
    ``planning``: for ``polytrain plan``, which predicts the job and runs nothing."""
    d = TrainConfig.__dataclass_fields__
    p.add_argument("--model", default=d["model"].default, metavar="NAME",
                   help=f"one of {', '.join(model_names())} (default gpt)")
    p.add_argument("--data", default=d["data"].default, metavar="NAME",
                   help=f"one of {', '.join(dataset_names())} (default text)")
    p.add_argument("--workers", type=int, default=None, metavar="W",
                   help="worker processes in all (default 2" +
                        (")" if planning else "; 1 for single)"))
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="emulated machines the workers are spread over (default 1; with "
                        "--devices, its machines)")
    p.add_argument("--servers", type=int, default=0, metavar="K",
                   help="dedicated server processes, each its own CPU machine (default 0)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"].default, metavar="B",
                   help="GLOBAL batch per step (default 32)")
    p.add_argument("--optimizer", default=d["optimizer"].default, choices=OPTIMIZERS,
                   help="default adam")
    add_network_flags(p, planning=planning)


def add_devices_flag(p: argparse.ArgumentParser, *, planning: bool = False) -> None:
    """``--devices``: emulated heterogeneous devices (last, as the usage line ends with it)."""
    speed = ("each worker's compute is predicted at its device's speed" if planning
             else "every worker runs at its device's speed")
    p.add_argument("--devices", default=None, metavar="SPEC",
                   help=f"emulated heterogeneous devices, e.g. 'm0:fast*2,m1:slow*2' or a JSON "
                        f"file: sets --workers and --nodes, {speed} (built-in types fast, mid, "
                        f"slow; define more as NAME=GFLOPS/MIB)")


def add_model_flags(p: argparse.ArgumentParser) -> dict[str, OptionFlag]:
    """The model options group; returns the flags of the models' own Options."""
    m = p.add_argument_group("model options")
    for name, what in zip(SIZE_OPTIONS, ("sequence length", "width",
                                          "blocks or hidden layers", "attention heads")):
        m.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"{what} (default {_defaults(name)})")
    specs = [get_model(n) for n in model_names()]
    return add_option_groups(
        p, [Owner(s.name, s.description, s.options) for s in specs if s.options], kind="model")


def _defaults(field: str) -> str:
    """Each model's default for ``field``, read off its constructor: '64 for gpt, mlp; 32
    for wordlm' (models without the field left out)."""
    by_value: dict[Any, list[str]] = {}
    for name in model_names():
        param = inspect.signature(get_model(name).build).parameters.get(field)
        if param is not None and param.default is not inspect.Parameter.empty:
            by_value.setdefault(param.default, []).append(name)
    return "; ".join(f"{v} for {', '.join(names)}" for v, names in by_value.items())


def model_options(ns: argparse.Namespace, flags: dict[str, OptionFlag]) -> dict[str, Any]:
    """The model options given on the command line (another model's are refused)."""
    out = {k: getattr(ns, k) for k in SIZE_OPTIONS if getattr(ns, k) is not None}
    out.update(given_options(ns, ns.model, _model_options(ns.model), flags, kind="model"))
    return out


def _model_options(name: str) -> type | None:
    try:
        return get_model(name).options
    except ConfigError:
        return None  # an unknown model: TrainConfig names the valid ones
