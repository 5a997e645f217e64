"""``polytrain train``: train a reference model with a strategy and write its metrics."""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import traceback
from typing import Any, Sequence

from .. import _env
from ..checkpoint.manifest import newest, read_manifest, resolve, run_out
from ..config import ON_SAVE_ERROR, SAMPLINGS, SCHEDULES, TrainConfig
from ..errors import ConfigError, LaunchError, unknown
from ..plan import AUTO, Job, auto_record, chosen, plan_job
from ..plan.cost import STRATEGIES as PLANNED
from ..strategies.base import get_strategy, strategy_names
from ..train import run_config
from ..train.run import results_in, steps_gone_on
from .job import add_devices_flag, add_job_flags, add_model_flags, model_options
from .options import OptionFlag, Owner, add_option_groups, flag_value, given_options

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
                   help=f"one of {', '.join(strategy_names())} (default ddp), or {AUTO}: "
                        f"of {', '.join(PLANNED)}, the one `polytrain plan` predicts fastest "
                        f"for the job")
    add_job_flags(p)
    p.add_argument("--steps", type=int, default=d["steps"].default, metavar="T",
                   help="training steps (default 500)")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="learning rate (default 2e-3)")
    p.add_argument("--lr-schedule", default=d["lr_schedule"].default, choices=SCHEDULES,
                   help="constant (default) or cosine: down to lr/10 at the last step")
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"].default, metavar="N",
                   help="the learning rate rises linearly to --lr over the first N steps "
                        "(default 0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="default 0")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write DIR/metrics.json and DIR/final.pt")
    p.add_argument("--init", default=None, metavar="PATH",
                   help="start from PATH, the final.pt of an earlier run of the same model "
                        "(any strategy; e.g. a pre-trained model to fine-tune)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="every N steps and after the last: loss and accuracy on held-out data "
                        "(the data set's last tenth, then never trained on) in metrics.json")
    p.add_argument("--sampling", default=d["sampling"].default, choices=SAMPLINGS,
                   help="random windows (default), or epoch: fixed samples, each once per "
                        "epoch")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="longest wait on another process before failing (default: "
                        "POLYTRAIN_TIMEOUT, else 120)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write OUT/checkpoints/step-S/ every N steps (model, optimizer, "
                        "scheduler, data position, RNG, strategy state)")
    p.add_argument("--keep", type=int, default=None, metavar="K",
                   help="keep only the newest K whole checkpoints (default: all)")
    p.add_argument("--on-save-error", default=d["on_save_error"].default, choices=ON_SAVE_ERROR,
                   help="when a checkpoint cannot be written: continue (default: say so, "
                        "train on) or stop")
    p.add_argument("--resume", default=None, metavar="OUT|DIR",
                   help="continue from the newest whole checkpoint of a run's --out, or from "
                        "one checkpoint directory (without --out: the run's --out, when "
                        "this is its newest)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="when a process dies or hangs, restart the run from the newest "
                        "checkpoint it wrote (none yet: where it started), up to R times "
                        "(default 0)")
    add_devices_flag(p)
    # The usage names the option groups rather than every strategy's and model's flags.
    p.usage = (p.format_usage().removeprefix("usage: ").replace(p.prog, "%(prog)s", 1).rstrip()
               + "\n" + " " * len(f"usage: {p.prog} ") + "[model options] [strategy options]")
    _model_flags.update(add_model_flags(p))
    strategies = [get_strategy(n) for n in strategy_names()]
    _flags.update(add_option_groups(
        p, [Owner(c.name, _summary(c), c.Options) for c in strategies], kind="strategy",
        chosen=flag_value(argv, "--strategy")))
    p.set_defaults(run=run)


def _summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring on one line, without reST markup."""
    line = " ".join((inspect.getdoc(cls) or "").partition("\n\n")[0].split())
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", line).replace("``", "")


def _check_name(name: str) -> None:
    """Refuse a ``--strategy`` that is neither a strategy nor ``auto``, naming both."""
    if name != AUTO and name not in strategy_names():
        raise unknown("strategy", name, (*strategy_names(), f"or {AUTO} (of {', '.join(PLANNED)}, "
                                         "the one `polytrain plan` predicts fastest)"),
                      "pass one of them, e.g. --strategy ddp", plural="strategies")


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    _check_name(ns.strategy)
    if ns.strategy == AUTO:
        return auto_config(ns)
    cls = get_strategy(ns.strategy)
    # Here, not in TrainConfig: its timeout_s cannot tell a given --timeout from the default.
    if ns.timeout is not None and not cls.distributed:
        raise ConfigError(f"--timeout {ns.timeout:g} is the longest wait on another of a run's "
                          f"processes, and strategy {ns.strategy!r} trains in this one process",
                          "leave --timeout out, or pick a distributed strategy such as ddp")
    return TrainConfig(
        strategy=ns.strategy, servers=ns.servers,
        strategy_options=given_options(ns, ns.strategy, cls.Options, _flags), **_common(ns))


def _common(ns: argparse.Namespace) -> dict[str, Any]:
    """The config's fields other than the strategy's."""
    return dict(
        model=ns.model, data=ns.data, workers=ns.workers, nodes=ns.nodes, steps=ns.steps,
        batch_size=ns.batch_size, lr=ns.lr, optimizer=ns.optimizer, lr_schedule=ns.lr_schedule,
        warmup_steps=ns.warmup_steps, seed=ns.seed, out=_out(ns), quiet=ns.quiet,
        timeout_s=ns.timeout if ns.timeout is not None else _env.timeout_of(),
        port=ns.port, device=ns.device, devices=ns.devices,
        bandwidth=ns.bandwidth, latency=ns.latency, model_options=model_options(ns, _model_flags),
        init=ns.init, eval_every=ns.eval_every, sampling=ns.sampling,
        checkpoint_every=ns.checkpoint_every, keep=ns.keep, on_save_error=ns.on_save_error,
        resume=ns.resume, max_restarts=ns.max_restarts)


def _out(ns: argparse.Namespace) -> str | None:
    """``--out``; with ``--resume`` of a run's newest checkpoint and no ``--out``, that run's
    (where it goes on). Anything else needs ``--out``: the run would write nothing, or write
    over a longer run's results (which ``run_config`` refuses alike where ``--out`` names
    that run's own folder)."""
    if ns.out is not None or ns.resume is None:
        return ns.out
    where, _ = resolve(ns.resume)  # a missing or damaged checkpoint says so first
    found = run_out(ns.resume)
    if found is None:
        raise ConfigError(f"--resume {ns.resume} is not inside a run's --out, and no --out is "
                          f"given: the run would write nothing",
                          "pass --out DIR for its metrics.json, final.pt and checkpoints")
    # The run that wrote the checkpoint, or one that went on from it, may have been longer.
    longest = steps_gone_on(where, found)
    if longest > ns.steps and results_in(found):  # an interrupted run's: nothing to lose
        raise ConfigError(f"--resume {ns.resume} is of a run of --steps {longest}, this one "
                          f"has --steps {ns.steps}, and no --out is given: ending there would "
                          f"write over that run's final.pt and metrics.json",
                          f"pass --out DIR, or --steps {longest}")
    # Only checkpoints past the resumed one are verified (usually none).
    last = newest(found / "checkpoints", after=int(read_manifest(where)["step"]))
    if last is not None:
        raise ConfigError(f"--resume {ns.resume} is not the newest checkpoint of {found} "
                          f"({last.name} is), and no --out is given: going on there would "
                          f"write over that run's final.pt and metrics.json",
                          f"pass --out DIR, or --resume {found} for its newest")
    return str(found)


def auto_config(ns: argparse.Namespace) -> TrainConfig:
    """``--strategy auto``: the config of the strategy (and servers) the planner recommends.

    A strategy's own flag is refused: the planner predicts every strategy with its defaults.
    So is ``--device cuda``: the planner times the model on this machine's CPU (or from
    ``--devices``, CPU workers at emulated speeds), and a GPU run was planned as a CPU one.
    """
    if ns.device != "cpu":
        raise ConfigError(f"--strategy {AUTO} with --device {ns.device}: the planner predicts "
                          f"CPU runs (it times the model on this machine's CPU), not GPU ones",
                          f"pass --strategy NAME (one of {', '.join(PLANNED)}) with --device "
                          f"{ns.device}, or leave --device out")
    for name, opt in _flags.items():
        if getattr(ns, name, None) is not None:
            raise ConfigError(f"{opt.flag} is an option of {', '.join(opt.owners)}, and "
                              f"--strategy {AUTO} chooses the strategy itself (with its "
                              f"defaults)", f"leave {opt.flag} out, or pass --strategy "
                              f"{opt.owners[0]}")
    common = _common(ns)
    job = Job(model=ns.model, model_options=common["model_options"], workers=ns.workers,
              nodes=ns.nodes, servers=ns.servers, batch_size=ns.batch_size,
              optimizer=ns.optimizer, bandwidth=ns.bandwidth, latency=ns.latency,
              devices=ns.devices, data=ns.data, timeout_s=common["timeout_s"])
    # The run's other options, checked before the planner times the model (seconds, a
    # minute for a long window): as ddp's, whose own checks refuse nothing the other
    # candidates take, on the job's layout. The network and the devices are each
    # candidate's to pass (Job.refusals).
    TrainConfig(strategy="ddp", **{**common, "workers": job.workers, "nodes": job.nodes,
                                   "bandwidth": None, "latency": None, "devices": None})
    plan = plan_job(job)
    pick = chosen(plan)
    return TrainConfig(strategy=pick.strategy, servers=pick.servers, auto=auto_record(plan),
                       **common)


def run(ns: argparse.Namespace) -> int:
    config = config_from_args(ns)
    layout = config.layout()
    if config.auto is not None:  # said even with --quiet: the run is not the one asked for
        print(f"polytrain: --strategy {AUTO} chose {config.auto['chosen']}: "
              f"{config.auto['why']}", file=sys.stderr)
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
    try:
        metrics = run_config(config, report=lambda line: print(line, file=sys.stderr, flush=True))
    except LaunchError as e:
        # A run in this process (single) failed: its traceback goes above main()'s one line,
        # as a launched process prints its own (a launcher's LaunchError has no cause).
        if e.__cause__ is not None:
            traceback.print_exception(e.__cause__, file=sys.stderr)
        raise
    st = metrics["step_time_s"]
    print(f"final loss {metrics['final_loss']:.4f} | {metrics['samples_per_s']:.1f} samples/s | "
          f"step {st['median'] * 1e3:.1f} ms median, {st['p90'] * 1e3:.1f} ms p90 | "
          f"{metrics['wall_time_s']:.1f} s")
    if metrics.get("final_eval_loss") is not None:
        last = metrics["eval"][-1]
        accuracy = "" if last["accuracy"] is None else f", accuracy {last['accuracy']:.3f}"
        print(f"held-out loss {last['loss']:.4f}{accuracy}")
    if config.out:
        print(f"wrote {config.out}/metrics.json and {config.out}/final.pt")
    return 0
