"""What a run reports: ``metrics.json`` (the contract of DESIGN.md) from losses, times, meters."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Collection, Sequence

import torch

from ..checkpoint.manifest import write_atomically
from ..comm.meter import (
    MeterReport,
    machine_traffic,
    sent_bytes_by_step,
    server_traffic,
    without_steps,
)
from ..comm.topology import Topology

__all__ = ["warmup_steps", "steady_steps", "steady", "step_times", "build_metrics",
           "write_metrics"]


def warmup_steps(count: int) -> int:
    """How many of ``count`` steps are warm-up: the first, or the first 10% if that is more."""
    return max(1, count // 10) if count > 1 else 0


def steady_steps(count: int, cold: Collection[int] = ()) -> list[int]:
    """The steady steps of ``count`` (indices): not the warm-up (:func:`warmup_steps`) nor
    the ``cold`` steps (a resumed run's first, which its new processes take cold, as a
    fresh run its first; a step whose strategy re-planned, moving state: Parallax's new
    partition count, PipeTransformer's new plan)."""
    return [i for i in range(warmup_steps(count), count) if i not in cold]


def steady(values: Sequence[float], cold: Collection[int] = ()) -> list[float]:
    """``values`` at the steady steps (:func:`steady_steps`)."""
    return [values[i] for i in steady_steps(len(values), cold)]


def step_times(times: Sequence[float], cold: Collection[int] = ()) -> dict[str, float]:
    s = sorted(steady(times, cold))
    if not s:
        return {"median": 0.0, "p90": 0.0, "mean": 0.0}
    p90 = s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]
    return {"median": statistics.median(s), "p90": p90, "mean": statistics.fmean(s)}


def build_metrics(*, config: Any, losses: Sequence[float], times: Sequence[float],
                  model_bytes: int, topology: Topology | None,
                  reports: Sequence[MeterReport], wall_s: float,
                  cold: Collection[int] = ()) -> dict[str, Any]:
    """The metrics of one run; traffic is per machine, cross-machine bytes per steady step.

    ``cold``: the steps (indices into ``times``) that are not steady state (:func:`steady`);
    the step times and the traffic leave them out, ``step_times`` and
    ``sent_bytes_by_step`` keep them. The traffic averages the steady steps that this run
    measured (a resumed run measured its own only); where it measured none, it is 0 (the
    step times still average those of the runs it resumed from, where there are any).
    """
    import polytrain

    warm = steady(times, cold)
    samples_per_s = config.batch_size * len(warm) / sum(warm) if warm and sum(warm) > 0 else 0.0
    machines: list[dict[str, Any]] = []
    servers: list[dict[str, Any]] = []
    by_step: list[float | None] = []
    if topology is not None and reports:
        measured = sent_bytes_by_step(reports, topology)
        # A resumed run measured its own steps only: None for those before, so that the
        # list lines up with the losses.
        by_step = [None] * max(0, len(times) - len(measured)) + list(measured)
        # The steps the step times count, by this run's index: the others are taken out.
        first = len(times) - len(measured)
        kept = {i - first for i in steady_steps(len(times), cold)}
        steps = [without_steps(r, set(range(len(measured))) - kept) for r in reports]
        machines = [m.as_dict() for m in machine_traffic(steps, topology, warmup=0)]
        servers = server_traffic(steps, topology, warmup=0)
    auto = getattr(config, "auto", None)
    return {
        **({"auto": dict(auto)} if auto else {}),
        "strategy": config.strategy,
        "model": config.model,
        "data": config.data,
        "workers": config.workers,
        "nodes": config.nodes,
        "servers": config.servers,
        "steps": config.steps,
        "batch_size": config.batch_size,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "lr_schedule": getattr(config, "lr_schedule", "constant"),
        "warmup_steps": getattr(config, "warmup_steps", 0),
        "seed": config.seed,
        "sampling": getattr(config, "sampling", "random"),
        "eval_every": getattr(config, "eval_every", None),
        "device": config.device,
        "devices": getattr(config, "devices", None),
        "bandwidth": getattr(config, "bandwidth", None),
        "latency": getattr(config, "latency", None),
        "model_options": dict(config.model_options),
        "strategy_options": dict(config.strategy_options),
        "losses": list(losses),
        "final_loss": losses[-1] if losses else None,
        "samples_per_s": samples_per_s,
        "step_time_s": step_times(times, cold),
        "step_times": list(times),
        "wall_time_s": wall_s,
        "model_bytes": model_bytes,
        "traffic": {
            "machines": machines,
            "servers": servers,
            "sent_bytes_by_step": by_step,
            "estimated": any(m["estimated"] for m in machines),
            "note": "bytes crossing machines per steady-state step (not the warm-up, a "
                    "resumed run's first step, nor a step where the strategy re-planned, "
                    "moving state: Parallax's new partition count, PipeTransformer's new "
                    "plan; step_time_s leaves out the same steps); 'estimated' marks bytes "
                    "moved inside torch collectives, counted from their algorithm's cost; "
                    "nic_* (with --bandwidth): the kernel's counters of each machine's NIC, "
                    "headers included; sent_bytes_by_step: every step's, all machines together "
                    "(None: a step before the resume this run started from), those left out "
                    "too; what held-out evaluations and checkpoints move between steps is in "
                    "no step",
        },
        "versions": {"polytrain": polytrain.__version__, "torch": torch.__version__},
    }


def write_metrics(out: Path, metrics: dict[str, Any]) -> None:
    """``out/metrics.json``, replaced whole (a crash leaves the old file or the new one). A
    number that is not finite (the loss of a run that diverged) is written as null: JSON has
    no NaN, and strict readers refused the file."""
    text = json.dumps(_finite(metrics), indent=1, allow_nan=False) + "\n"
    write_atomically(out / "metrics.json", lambda tmp: tmp.write_text(text))


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None, in lists and dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
