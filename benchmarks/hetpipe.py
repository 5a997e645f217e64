"""HetPipe against ddp on the same emulated heterogeneous devices: throughput and time to a loss.

Two machines, ``m0`` with two ``fast`` devices and ``m1`` with two ``slow`` ones
(half the speed). ddp trains on all four (each step waits for the slow ones);
HetPipe trains with the allocation policies (np, ed; hd makes ed's virtual
workers on two machines; bd, beyond HetPipe, ed's virtual workers and twins
running the other way with N_m = 1), its partitioner's cut and N_m, and WSP
through one parameter server; ``ed-own`` is ED with each virtual worker's own optimizer
instead of the servers' (``--no-server-optimizer``), ``ed-paper`` is ED with
neither the servers' optimizer nor weight prediction, and the late stage at the
full learning rate with the optimizer's beta2 (the paper). Every run
is tuned over the same grid of Adam learning rates:
its time to a loss is at the learning rate that gets there first. Runs
alternate (ddp, np, ed, bd, ed-own, ed-paper, then the next learning rate) so
machine noise hits them alike; throughput is the median over all of a run's
learning rates and repeats.

    ./dev bench hetpipe            # default: 3 learning rates, ddp 300 steps
    ./dev bench hetpipe --runs ddp bd --staleness 0 --name hetpipe_bd_d0   # bd, synchronous
    ./dev bench hetpipe --quick    # 1 learning rate, 40 steps (a smoke run)

Saves benchmarks/results/NAME.json and NAME.png (loss against time; default NAME
hetpipe). The results, with the commands that made them, are in docs/hetpipe.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from polytrain import TrainConfig
from polytrain.emulation import parse_cluster, profile_model
from polytrain.models import get_model
from polytrain.pipeline import plan_hetpipe
from polytrain.train import run_config

DEVICES = "m0:fast*2,m1:slow*2"
MODEL = {"seq_len": 32, "d_model": 64, "layers": 12, "heads": 4}
POLICIES = ("np", "ed", "hd", "bd")
VARIANTS = ("ed-own", "ed-paper")  # own: optimizer per VW; paper: that and no prediction
RESULTS = Path(__file__).resolve().parent / "results"


def config_for(name: str, args: argparse.Namespace, steps: int | None = None,
               lr: float | None = None) -> TrainConfig:
    common: dict[str, Any] = dict(devices=DEVICES, steps=steps or args.steps,
                                  batch_size=args.batch_size,
                                  optimizer="adam", lr=lr or args.lrs[0],
                                  model_options=MODEL, quiet=True,
                                  timeout_s=120.0, seed=0)
    if name == "ddp":
        return TrainConfig(strategy="ddp", **common)
    policy, _, variant = name.partition("-")
    return TrainConfig(strategy="hetpipe", servers=1, **common,
                       strategy_options={"policy": policy, "staleness": args.staleness,
                                         "predict": variant != "paper",
                                         "server_optimizer": variant == "",
                                         **({"lag_lr": 1.0, "lag_beta2": None}
                                            if variant == "paper" else {})})


def run(config: TrainConfig) -> dict[str, Any]:
    started = time.perf_counter()
    metrics = run_config(config, env={"OMP_NUM_THREADS": "1"})
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
    p.add_argument("--quick", action="store_true", help="1 learning rate, 40 steps")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 7e-4, 1e-3],
                   help="Adam learning rates: every run is tuned over the same grid")
    p.add_argument("--staleness", type=int, default=1, help="WSP's D for HetPipe")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window of losses")
    p.add_argument("--runs", nargs="+", default=["ddp", "np", "ed", "bd", *VARIANTS],
                   choices=["ddp", *POLICIES, *VARIANTS],
                   help="which runs (default: ddp np ed bd ed-own ed-paper; on two machines "
                        "hd makes ed's virtual workers)")
    p.add_argument("--name", default="hetpipe", help="results file name (default hetpipe)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats, args.lrs = 40, 1, args.lrs[:1]
    names = list(dict.fromkeys(["ddp", *args.runs]))  # ddp is the reference
    model = predicted(args)
    print(f"cluster {DEVICES}; GPT {MODEL}; batch {args.batch_size}, adam lr {args.lrs}, "
          f"ddp {args.steps} steps (HetPipe: as many more as its predicted speed-up) x "
          f"{args.repeats} repeats; HetPipe D = {args.staleness}",
          file=sys.stderr)
    for policy in POLICIES:
        print(model[policy]["plan"], file=sys.stderr)
    keys = [(n, lr) for lr in args.lrs for n in names]
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {k: [] for k in keys}
    # Every run trains for about ddp's time: its steps scaled by the cost model's speed-up.
    steps = {n: args.steps if n == "ddp" else round(args.steps * min(
        1.5, max(1.0, model[n.partition("-")[0]]["speedup"]))) for n in names}
    for r in range(args.repeats):
        order = keys if r % 2 == 0 else keys[::-1]
        for name, lr in order:
            m = run(config_for(name, args, steps[name], lr))
            runs[name, lr].append(m)
            print(f"repeat {r}: {name:>8} lr {lr:g}: {m['samples_per_s']:7.1f} samples/s, "
                  f"final loss {m['final_loss']:.3f}, {m['launch_wall_s']:.0f} s",
                  file=sys.stderr)
    curves = {k: [smooth(m["losses"], args.smooth) for m in ms] for k, ms in runs.items()}
    # The fixed loss: the best smoothed loss ddp reaches at its best learning rate (the end
    # of its run); and a ladder of losses above it, to show where the runs part.
    target = min(min(c[args.smooth:] or c) for (n, _), cs in curves.items() if n == "ddp"
                 for c in cs)
    target = math.ceil(target * 1000) / 1000
    ladder = [x / 10 for x in range(36, 23, -2) if x / 10 > target] + [target]

    def seconds_to(level: float, key: tuple[str, float]) -> float | None:
        ts = [time_to(level, timeline(m), c) for m, c in zip(runs[key], curves[key])]
        return statistics.median(ts) if all(t is not None for t in ts) else None  # type: ignore

    rows: dict[str, Any] = {}
    for name in names:
        per_lr: dict[str, Any] = {}
        for lr in args.lrs:
            ms = runs[name, lr]
            per_lr[f"{lr:g}"] = {
                "samples_per_s": statistics.median(m["samples_per_s"] for m in ms),
                "time_to_loss_s": {f"{x:g}": seconds_to(x, (name, lr)) for x in ladder},
                "final_smoothed_loss": statistics.median(c[-1] for c in curves[name, lr])}
        # Tuned: for each loss, the learning rate that reaches it first.
        best: dict[str, Any] = {}
        for x in ladder:
            found = [(t, lr) for lr, row in per_lr.items()
                     if (t := row["time_to_loss_s"][f"{x:g}"]) is not None]
            best[f"{x:g}"] = min(found) if found else None
        rows[name] = {"samples_per_s": statistics.median(r["samples_per_s"]
                                                         for r in per_lr.values()),
                      "time_to_loss_s": {x: b and b[0] for x, b in best.items()},
                      "best_lr": {x: b and float(b[1]) for x, b in best.items()},
                      "per_lr": per_lr}
    base = rows["ddp"]
    for row in rows.values():
        row["throughput_vs_ddp"] = row["samples_per_s"] / base["samples_per_s"]
        row["time_to_loss_vs_ddp"] = {
            x: (base["time_to_loss_s"][x] / t if t and base["time_to_loss_s"][x] else None)
            for x, t in row["time_to_loss_s"].items()}
    print(f"\n{'run':<9} {'samples/s':>10} {'x ddp':>7} {'model x ddp':>12}")
    for name, row in rows.items():
        policy = name.partition("-")[0]
        pred = model[policy]["speedup"] if policy in model else 1.0
        print(f"{name:<9} {row['samples_per_s']:10.1f} {row['throughput_vs_ddp']:7.2f} "
              f"{pred:12.2f}")
    print(f"\nseconds to a smoothed loss at each run's best learning rate (x ddp; - : not "
          f"reached); the last is ddp's best, {target:.3f}")
    print(f"{'run':<9} " + " ".join(f"{x:>16g}" for x in ladder))
    for name, row in rows.items():
        cells = []
        for x in ladder:
            t, ratio, lr = (row["time_to_loss_s"][f"{x:g}"], row["time_to_loss_vs_ddp"][f"{x:g}"],
                            row["best_lr"][f"{x:g}"])
            cells.append(f"{t:5.1f} {ratio:4.2f}x {lr:5.0e}" if t and ratio else f"{'-':>16}")
        print(f"{name:<9} " + " ".join(cells))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"devices": DEVICES, "model_options": MODEL, "batch_size": args.batch_size,
           "optimizer": "adam", "lrs": args.lrs, "steps": steps, "repeats": args.repeats,
           "staleness": args.staleness, "smooth_window": args.smooth, "target_loss": target,
           "note": "time axis: worker 0's cumulative step times after the first step (for "
                   "hetpipe, stage 0 of virtual worker 0, whose step t ends within a step of "
                   "the last stage's loss of step t); each run's time to a loss is at the "
                   "learning rate of the grid that reaches it first",
           "predicted": model, "results": rows,
           "runs": {f"{n} lr {lr:g}": [{"losses": m["losses"], "step_times": m["step_times"],
                                       "samples_per_s": m["samples_per_s"],
                                       "wall_time_s": m["wall_time_s"],
                                       "strategy_options": m["strategy_options"]} for m in ms]
                    for (n, lr), ms in runs.items()},
           "versions": {"torch": torch.__version__}}
    name = f"{args.name}_quick" if args.quick else args.name
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(runs, curves, rows, target, RESULTS / f"{name}.png", args)
    print(f"wrote {RESULTS / name}.json and .png")
    return 0


def plot(runs: dict[tuple[str, float], list[dict[str, Any]]],
         curves: dict[tuple[str, float], list[list[float]]], rows: dict[str, Any],
         target: float, path: Path, args: argparse.Namespace) -> None:
    """Loss against time: each run at the learning rate that reaches the target (else the
    lowest loss) first, in full; the other learning rates faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {"ddp": "black", "np": "tab:orange", "ed": "tab:blue", "hd": "tab:green",
              "bd": "tab:red",
              "ed-own": "tab:cyan", "ed-paper": "tab:purple"}
    styles = {"hd": "--", "ed-own": "-.", "ed-paper": ":"}
    for name, row in rows.items():
        lr = row["best_lr"][f"{target:g}"]
        if lr is None:
            lr = min(args.lrs, key=lambda x: row["per_lr"][f"{x:g}"]["final_smoothed_loss"])
        for key, ms in runs.items():
            if key[0] != name:
                continue
            main = key[1] == lr
            title = name.replace("-paper", ", the paper").replace("-own", ", own optimizers")
            for i, (m, c) in enumerate(zip(ms, curves[key])):
                label = (f"{'ddp' if name == 'ddp' else 'hetpipe ' + title} (lr {lr:g})"
                         if main and i == 0 else None)
                ax.plot(timeline(m), c, color=colors[name], alpha=0.9 if main else 0.2,
                        linewidth=1.4 if main else 0.8, linestyle=styles.get(name, "-"),
                        label=label)
    ax.axhline(target, color="grey", linewidth=0.8, linestyle=":", label=f"target {target:.3f}")
    ax.set_ylim(top=4.0)
    ax.set_xlabel("seconds (after the first step)")
    ax.set_ylabel(f"training loss (mean of {args.smooth} steps)")
    ax.set_title(f"{DEVICES}: HetPipe (D={args.staleness}) vs ddp, "
                 f"Adam lr in {', '.join(f'{x:g}' for x in args.lrs)}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
