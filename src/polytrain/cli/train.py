"""``polytrain train``: train a reference model with a strategy and write its metrics."""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from typing import Any, Sequence

from ..config import OPTIMIZERS, SCHEDULES, TrainConfig
from ..data import dataset_names
from ..errors import ConfigError
from ..models import get_model, model_names
from ..strategies.base import get_strategy, strategy_names
from ..train import run_config
from .options import (
    OptionFlag,
    Owner,
    add_network_flags,
    add_option_groups,
    flag_value,
    given_options,
)

__all__: list[str] = []

_flags: dict[str, OptionFlag] = {}
_model_flags: dict[str, OptionFlag] = {}


def add_parser(sub: Any, argv: Sequence[str] = ()) -> None:
    """Add ``train``; ``argv`` is read ahead for ``--strategy NAME``, whose options ``--help``
    shows alone (argparse prints the help before it has parsed the rest)."""
    p = sub.add_parser("train", help="train a model with a strategy (GPT on text by default)",
                       description="Train a reference model with a distributed strategy in "
                                   "local processes; writes metrics.json and final.pt to --out.")
    d = TrainConfig.__dataclass_fields__
    p.add_argument("--strategy", default=d["strategy"].default, metavar="NAME",
                   help=f"one of {', '.join(strategy_names())} (default ddp)")
    p.add_argument("--model", default=d["model"].default, metavar="NAME",
                   help=f"one of {', '.join(model_names())} (default gpt)")
    p.add_argument("--data", default=d["data"].default, metavar="NAME",
                   help=f"one of {', '.join(dataset_names())} (default text)")
    p.add_argument("--workers", type=int, default=None, metavar="W",
                   help="worker processes in all (default 2; 1 for single)")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="emulated machines the workers are spread over (default 1)")
    p.add_argument("--servers", type=int, default=0, metavar="K",
                   help="dedicated server processes, each its own CPU machine (default 0)")
    p.add_argument("--steps", type=int, default=d["steps"].default, metavar="T",
                   help="training steps (default 500)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"].default, metavar="B",
                   help="GLOBAL batch per step (default 32)")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="learning rate (default 2e-3)")
    p.add_argument("--optimizer", default=d["optimizer"].default, choices=OPTIMIZERS,
                   help="default adam")
    p.add_argument("--lr-schedule", default=d["lr_schedule"].default, choices=SCHEDULES,
                   help="constant (default) or cosine: down to lr/10 at the last step")
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"].default, metavar="N",
                   help="the learning rate rises linearly to --lr over the first N steps "
                        "(default 0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="default 0")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write DIR/metrics.json and DIR/final.pt")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=d["timeout_s"].default, metavar="SECONDS",
                   help="longest wait on another process before failing (default 120)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    add_network_flags(p)
    p.add_argument("--devices", default=None, metavar="SPEC",
                   help="emulated heterogeneous devices, e.g. 'm0:fast*2,m1:slow*2' or a JSON "
                        "file: sets --workers and --nodes, every worker runs at its device's "
                        "speed (built-in types fast, mid, slow; define more as NAME=GFLOPS/MIB)")
    # The usage names the option groups rather than every strategy's and model's flags.
    p.usage = (p.format_usage().removeprefix("usage: ").replace(p.prog, "%(prog)s", 1).rstrip()
               + "\n" + " " * len(f"usage: {p.prog} ") + "[model options] [strategy options]")
    m = p.add_argument_group("model options")
    m.add_argument("--seq-len", type=int, default=None, help="sequence length (default 64)")
    m.add_argument("--d-model", type=int, default=None,
                   help="width (default 128 for gpt, 64 for mlp)")
    m.add_argument("--layers", type=int, default=None,
                   help="blocks or hidden layers (default 4 for gpt, 2 for mlp)")
    m.add_argument("--heads", type=int, default=None, help="attention heads (gpt; default 4)")
    specs = [get_model(n) for n in model_names()]
    _model_flags.update(add_option_groups(
        p, [Owner(s.name, s.description, s.options) for s in specs if s.options], kind="model"))
    strategies = [get_strategy(n) for n in strategy_names()]
    _flags.update(add_option_groups(
        p, [Owner(c.name, _summary(c), c.Options) for c in strategies], kind="strategy",
        chosen=flag_value(argv, "--strategy")))
    p.set_defaults(run=run)


def _summary(cls: type) -> str:
    """The first line of ``cls``'s docstring, without reST markup."""
    line = (inspect.getdoc(cls) or "").partition("\n")[0]
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", line).replace("``", "")


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    cls = get_strategy(ns.strategy)
    model_options = {k: getattr(ns, k) for k in ("seq_len", "d_model", "layers", "heads")
                     if getattr(ns, k) is not None}
    model_options.update(given_options(ns, ns.model, _model_options(ns.model), _model_flags,
                                       kind="model"))
    return TrainConfig(
        strategy=ns.strategy, model=ns.model, data=ns.data, workers=ns.workers, nodes=ns.nodes,
        servers=ns.servers, steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr,
        optimizer=ns.optimizer, lr_schedule=ns.lr_schedule, warmup_steps=ns.warmup_steps,
        seed=ns.seed, out=ns.out, quiet=ns.quiet, timeout_s=ns.timeout,
        port=ns.port, device=ns.device, devices=ns.devices, bandwidth=ns.bandwidth,
        latency=ns.latency, model_options=model_options,
        strategy_options=given_options(ns, ns.strategy, cls.Options, _flags))


def _model_options(name: str) -> type | None:
    try:
        return get_model(name).options
    except ConfigError:
        return None  # an unknown model: TrainConfig names the valid ones


def run(ns: argparse.Namespace) -> int:
    config = config_from_args(ns)
    layout = config.layout()
    if not config.quiet:
        print(f"polytrain: {config.model} on {config.data}, strategy {config.strategy}, "
              f"{config.steps} steps of {config.batch_size} | {layout.describe()}",
              file=sys.stderr)
        link = config.link()
        if link is not None:
            print(f"emulated network: every machine in its own namespace, {link.describe()}",
                  file=sys.stderr)
        summary = config.plan_summary()
        if summary:
            print(summary, file=sys.stderr)
    metrics = run_config(config)
    st = metrics["step_time_s"]
    print(f"final loss {metrics['final_loss']:.4f} | {metrics['samples_per_s']:.1f} samples/s | "
          f"step {st['median'] * 1e3:.1f} ms median, {st['p90'] * 1e3:.1f} ms p90 | "
          f"{metrics['wall_time_s']:.1f} s")
    if config.out:
        print(f"wrote {config.out}/metrics.json and {config.out}/final.pt")
    return 0
