"""HetPipe against ddp on the same emulated heterogeneous devices: throughput and time to a loss.

Two machines, ``m0`` with two ``fast`` devices and ``m1`` with two ``slow`` ones
(half the speed). ddp trains on all four (each step waits for the slow ones);
HetPipe trains with each allocation policy (np, ed, hd), its partitioner's cut
and N_m, and WSP through one parameter server; ``ed-paper`` is ED without
weight prediction (the paper's semantics). Runs alternate (ddp, np, ed, hd,
ed-paper, ...) so machine noise hits them alike; ratios are medians over
repeats.

    ./dev bench hetpipe            # default: 2 repeats, ddp 300 steps (~15-20 minutes)
    ./dev bench hetpipe --quick    # 1 repeat of 40 steps (a smoke run)

Saves benchmarks/results/hetpipe.json and hetpipe.png (loss against time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from polytrain import TrainConfig
from polytrain.launch import Launcher
from polytrain.models import get_model
from polytrain.pipeline import parse_cluster, plan_hetpipe, profile_model
from polytrain.train import train

DEVICES = "m0:fast*2,m1:slow*2"
MODEL = {"seq_len": 32, "d_model": 64, "layers": 12, "heads": 4}
POLICIES = ("np", "ed", "hd")
VARIANTS = ("ed-paper",)  # without weight prediction
RESULTS = Path(__file__).resolve().parent / "results"


def config_for(name: str, args: argparse.Namespace, steps: int | None = None) -> TrainConfig:
    common: dict[str, Any] = dict(devices=DEVICES, steps=steps or args.steps,
                                  batch_size=args.batch_size,
                                  optimizer="adam", lr=args.lr, model_options=MODEL, quiet=True,
                                  timeout_s=120.0, seed=0)
    if name == "ddp":
        return TrainConfig(strategy="ddp", **common)
    policy, _, variant = name.partition("-")
    return TrainConfig(strategy="hetpipe", servers=1, **common,
                       strategy_options={"policy": policy, "staleness": args.staleness,
                                         "predict": variant != "paper"})


def run(config: TrainConfig) -> dict[str, Any]:
    started = time.perf_counter()
    metrics = Launcher(config.layout(), env={"OMP_NUM_THREADS": "1"}).run_fn(train, (config,))[0]
    metrics["launch_wall_s"] = time.perf_counter() - started
    return metrics


def smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def timeline(metrics: dict[str, Any]) -> list[float]:
    """Seconds since the end of the first step (set-up excluded alike for every run)."""
    out, t = [], 0.0
    for i, dt in enumerate(metrics["step_times"]):
        if i:
            t += dt
        out.append(t)
    return out


def time_to(target: float, times: list[float], curve: list[float]) -> float | None:
    for t, x in zip(times, curve):
        if x <= target:
            return t
    return None


def predicted(args: argparse.Namespace) -> dict[str, Any]:
    """What the cost model says: ddp's step on the slow device against each plan's period."""
    spec = get_model("gpt")
    model = spec.make(**MODEL)
    sample = spec.split(torch.zeros((1, MODEL["seq_len"] + 1), dtype=torch.long))[0]
    profile = profile_model(model, sample)
    slow = min(d.type.flops_per_s for d in parse_cluster(DEVICES).devices)
    ddp_step = args.batch_size // 4 * profile.flops / slow
    out: dict[str, Any] = {"ddp_step_s": ddp_step}
    for policy in POLICIES:
        cfg = config_for(policy, args)
        plan = plan_hetpipe(parse_cluster(DEVICES), profile, policy=policy,
                            global_batch=args.batch_size, state_factor=2,
                            staleness=args.staleness)
        out[policy] = {"period_s": plan.period, "speedup": ddp_step / plan.period,
                       "inflight": plan.inflight, "plan": cfg.plan_summary()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 repeat of 40 steps")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--staleness", type=int, default=1, help="WSP's D for HetPipe")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window of losses")
    p.add_argument("--runs", nargs="+", default=["ddp", *POLICIES, *VARIANTS],
                   choices=["ddp", *POLICIES, *VARIANTS], help="which runs (default: all)")
    p.add_argument("--name", default="hetpipe", help="results file name (default hetpipe)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats = 40, 1
    names = list(dict.fromkeys(["ddp", *args.runs]))  # ddp is the reference
    model = predicted(args)
    print(f"cluster {DEVICES}; GPT {MODEL}; batch {args.batch_size}, adam lr {args.lr}, "
          f"ddp {args.steps} steps (HetPipe: as many more as its predicted speed-up) x "
          f"{args.repeats} repeats; HetPipe D = {args.staleness}",
          file=sys.stderr)
    for policy in POLICIES:
        print(model[policy]["plan"], file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    # Every run trains for about ddp's time: its steps scaled by the cost model's speed-up.
    steps = {n: args.steps if n == "ddp" else round(args.steps * min(
        1.5, max(1.0, model[n.partition("-")[0]]["speedup"]))) for n in names}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            m = run(config_for(name, args, steps[name]))
            runs[name].append(m)
            print(f"repeat {r}: {name:>4}: {m['samples_per_s']:7.1f} samples/s, final loss "
                  f"{m['final_loss']:.3f}, {m['launch_wall_s']:.0f} s", file=sys.stderr)
    # The fixed loss: the highest of the runs' best smoothed losses, so every run reaches it
    # (the paper's variant aside: it is there for comparison); and a ladder of losses, to
    # show where the asynchronous runs fall behind.
    curves = {n: [smooth(m["losses"], args.smooth) for m in ms] for n, ms in runs.items()}
    target = max(min(c[args.smooth:] or c) for n, cs in curves.items() if n not in VARIANTS
                 for c in cs)
    ladder = [x / 10 for x in range(36, 19, -2)]
    rows: dict[str, Any] = {}
    for name, ms in runs.items():
        tput = statistics.median(m["samples_per_s"] for m in ms)
        ttl = [time_to(target, timeline(m), c) for m, c in zip(ms, curves[name])]
        reached = [t for t in ttl if t is not None]
        levels = {}
        for level in ladder:
            ts = [time_to(level, timeline(m), c) for m, c in zip(ms, curves[name])]
            levels[f"{level:.1f}"] = statistics.median(ts) if all(t is not None for t in ts) \
                else None  # type: ignore[type-var]
        rows[name] = {"samples_per_s": tput, "time_to_target_s": (
            statistics.median(reached) if len(reached) == len(ttl) else None),
            "time_to_loss_s": levels,
            "final_smoothed_loss": statistics.median(c[-1] for c in curves[name]),
            "samples_per_s_runs": [m["samples_per_s"] for m in ms], "time_to_target_runs": ttl}
    base = rows["ddp"]
    print(f"\n{'run':<8} {'samples/s':>10} {'x ddp':>7} {'time to ' + format(target, '.3f'):>16} "
          f"{'x ddp':>7} {'final loss':>11} {'model x ddp':>12}")
    for name, row in rows.items():
        row["throughput_vs_ddp"] = row["samples_per_s"] / base["samples_per_s"]
        t, t0 = row["time_to_target_s"], base["time_to_target_s"]
        row["time_to_target_vs_ddp"] = t0 / t if t and t0 else None
        policy = name.partition("-")[0]
        pred = model[policy]["speedup"] if policy in model else 1.0
        ttl_text = f"{t:.1f} s" if t else "not reached"
        x_ttl = f"{row['time_to_target_vs_ddp']:.2f}" if row["time_to_target_vs_ddp"] else "-"
        print(f"{name:<8} {row['samples_per_s']:10.1f} {row['throughput_vs_ddp']:7.2f} "
              f"{ttl_text:>16} {x_ttl:>7} {row['final_smoothed_loss']:11.3f} {pred:12.2f}")
    print("\nseconds to reach a smoothed loss (median over repeats; - : not reached)")
    print(f"{'run':<8} " + " ".join(f"{level:>6.1f}" for level in ladder))
    for name, row in rows.items():
        cells = [row["time_to_loss_s"][f"{level:.1f}"] for level in ladder]
        print(f"{name:<8} " + " ".join(f"{c:6.1f}" if c is not None else f"{'-':>6}"
                                        for c in cells))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"devices": DEVICES, "model_options": MODEL, "batch_size": args.batch_size,
           "optimizer": "adam", "lr": args.lr, "steps": steps, "repeats": args.repeats,
           "staleness": args.staleness, "smooth_window": args.smooth, "target_loss": target,
           "note": "time axis: worker 0's cumulative step times after the first step (for "
                   "hetpipe, stage 0 of virtual worker 0, whose step t ends within a step of "
                   "the last stage's loss of step t)",
           "predicted": model, "results": rows,
           "runs": {n: [{"losses": m["losses"], "step_times": m["step_times"],
                         "samples_per_s": m["samples_per_s"], "wall_time_s": m["wall_time_s"],
                         "strategy_options": m["strategy_options"]} for m in ms]
                    for n, ms in runs.items()},
           "versions": {"torch": torch.__version__}}
    name = f"{args.name}_quick" if args.quick else args.name
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(runs, curves, target, RESULTS / f"{name}.png", args)
    print(f"wrote {RESULTS / name}.json and .png")
    return 0


def plot(runs: dict[str, list[dict[str, Any]]], curves: dict[str, list[list[float]]],
         target: float, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"ddp": "black", "np": "tab:orange", "ed": "tab:blue", "hd": "tab:green",
              "ed-paper": "tab:purple"}
    styles = {"hd": "--", "ed-paper": ":"}
    for name, ms in runs.items():
        for i, (m, c) in enumerate(zip(ms, curves[name])):
            title = name.replace("-paper", ", no prediction")
            label = ("ddp" if name == "ddp" else f"hetpipe {title}") if i == 0 else None
            ax.plot(timeline(m), c, color=colors[name], alpha=0.9 if i == 0 else 0.45,
                    linestyle=styles.get(name, "-"), label=label)
    ax.axhline(target, color="grey", linewidth=0.8, linestyle=":", label=f"target {target:.3f}")
    ax.set_xlabel("seconds (after the first step)")
    ax.set_ylabel(f"training loss (mean of {args.smooth} steps)")
    ax.set_title(f"{DEVICES}: HetPipe (D={args.staleness}) vs ddp")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
