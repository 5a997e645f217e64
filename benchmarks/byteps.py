"""BytePS (k = 0, 1, 2 CPU servers) against torch's DDP on the same model and emulated machines.

Measures, in alternating runs on this machine: the median step time of each
configuration relative to ddp's in the same round (median over rounds), and
the bytes each machine sends per step (metered; ddp's are torch's ring cost).
It also prints what Theorem 1 predicts for a cluster, where the NIC is the
bottleneck. Saves ``benchmarks/results/byteps.json`` and ``byteps.png``; the
results, with the commands that made them, are in docs/byteps.md.

    ./dev bench byteps            # default: the default GPT, 4 machines of 1 worker
    ./dev bench byteps --quick    # a smoke run: tiny model, few steps, one round
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import polytrain
from polytrain.strategies.byteps import optimal_shares
from polytrain.train import run_config

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"OMP_NUM_THREADS": "1"}


def configs(args: argparse.Namespace) -> dict[str, polytrain.TrainConfig]:
    model = {"seq_len": 16, "d_model": 32, "layers": 2} if args.quick else {}
    base = polytrain.TrainConfig(strategy="ddp", workers=args.workers, nodes=args.nodes,
                                 steps=args.steps, batch_size=args.batch_size, quiet=True,
                                 model_options=model, timeout_s=300)
    out = {"ddp": base}
    for k in args.servers:
        out[f"byteps k={k}"] = base.replace(strategy="byteps", servers=k)
    return out


def run(config: polytrain.TrainConfig) -> dict[str, Any]:
    started = time.perf_counter()
    metrics = run_config(config, env=ENV)
    metrics["bench_wall_s"] = time.perf_counter() - started
    return metrics


def traffic(metrics: dict[str, Any], kind: str) -> float:
    """The busiest machine of ``kind``: max of sent and received bytes per step."""
    values = [max(m["sent_bytes_per_step"], m["recv_bytes_per_step"])
              for m in metrics["traffic"]["machines"] if m["kind"] == kind]
    return max(values, default=0.0)


def predicted(name: str, config: polytrain.TrainConfig) -> dict[str, float]:
    """Bytes per machine per step in units of the model, from the formulas."""
    n = config.nodes
    if name == "ddp":  # torch's ring over all workers: each machine's one outgoing edge
        p = config.layout().workers
        return {"worker": 2 * (p - 1) / p if n > 1 else 0.0, "server": 0.0}
    s = optimal_shares(n, config.servers)
    return {"worker": s.worker_machine_traffic(), "server": s.cpu_machine_traffic()}


def cluster_table(n: int) -> list[dict[str, float]]:
    """Theorem 1 on a cluster of n GPU machines: busiest NIC's bytes per step, in M."""
    rows = []
    for k in range(0, n + 1):
        s = optimal_shares(n, k)
        classic = max(1.0, n / k) if k else float("nan")
        rows.append({"n": n, "k": k, "byteps": s.traffic_per_machine(), "cpu_share": s.cpu,
                     "all_reduce": 2 * (n - 1) / n, "classic_ps": classic})
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    byteps = [n for n in names if n != "ddp"]
    ratios = [result["configs"][n]["step_time_ratio_vs_ddp"] for n in byteps]
    ax.bar(byteps, ratios, color="tab:blue")
    for i, n in enumerate(byteps):
        ax.scatter([i] * len(result["configs"][n]["ratios"]), result["configs"][n]["ratios"],
                   color="black", s=12, zorder=3)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_ylabel("step time / ddp's (median of rounds)")
    ax.set_title(f"step time on this machine ({result['setup']['cores']} cores)")

    ax = axes[1]
    width = 0.38
    xs = range(len(names))
    measured_w = [result["configs"][n]["worker_bytes_per_step_M"] for n in names]
    measured_s = [result["configs"][n]["server_bytes_per_step_M"] for n in names]
    ax.bar([x - width / 2 for x in xs], measured_w, width, label="worker machine (measured)")
    ax.bar([x + width / 2 for x in xs], measured_s, width, label="CPU machine (measured)")
    ax.scatter([x - width / 2 for x in xs],
               [result["configs"][n]["predicted_M"]["worker"] for n in names],
               marker="_", s=400, color="black", label="formula", zorder=3)
    ax.scatter([x + width / 2 for x in xs],
               [result["configs"][n]["predicted_M"]["server"] for n in names],
               marker="_", s=400, color="black", zorder=3)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("bytes per machine per step (units of M)")
    ax.set_title("traffic of the busiest machine of each kind")
    ax.set_ylim(0, 1.25 * max(measured_w + measured_s + [1.0]))
    ax.legend(fontsize=8, loc="upper right")

    ax = axes[2]
    table = result["cluster"]
    ks = [r["k"] for r in table]
    ax.plot(ks, [r["byteps"] for r in table], "o-", label="BytePS (Theorem 1)")
    ax.plot(ks, [r["all_reduce"] for r in table], "--", label="all-reduce")
    ax.plot(ks[1:], [r["classic_ps"] for r in table[1:]], ":", label="classic PS (k servers)")
    ax.set_xlabel("CPU machines k")
    ax.set_ylabel("busiest NIC, bytes per step (units of M)")
    ax.set_title(f"predicted for a cluster of n={table[0]['n']} GPU machines")
    ax.set_ylim(0, 2.6)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 4 steps, 1 round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--servers", type=int, nargs="+", default=[0, 1, 2],
                   help="CPU servers k of each BytePS run (default 0 1 2)")
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/byteps.json (--quick: byteps_quick.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.batch_size = 1, 4, 8
    args.out = args.out or RESULTS / ("byteps_quick.json" if args.quick else "byteps.json")
    cfgs = configs(args)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfgs}
    for r in range(args.rounds):
        # Alternate, and rotate who goes first, so drift in the machine's load spreads evenly.
        order = list(cfgs)
        order = order[r % len(order):] + order[:r % len(order)]
        for name in order:
            m = run(cfgs[name])
            runs[name].append(m)
            print(f"round {r + 1}/{args.rounds} {name:12s} step "
                  f"{m['step_time_s']['median'] * 1e3:7.1f} ms median  "
                  f"final loss {m['final_loss']:.4f}  ({m['bench_wall_s']:.0f} s)", flush=True)

    model_bytes = runs["ddp"][0]["model_bytes"]
    result: dict[str, Any] = {
        "setup": {"workers": args.workers, "nodes": args.nodes, "steps": args.steps,
                  "batch_size": args.batch_size, "rounds": args.rounds,
                  "model_options": dict(cfgs["ddp"].model_options) or "gpt defaults",
                  "model_bytes": model_bytes, "cores": _cores(), "quick": args.quick},
        "configs": {}, "cluster": cluster_table(8)}
    for name, ms in runs.items():
        medians = [m["step_time_s"]["median"] for m in ms]
        ratios = [m["step_time_s"]["median"] / d["step_time_s"]["median"]
                  for m, d in zip(ms, runs["ddp"])]
        last = ms[-1]
        result["configs"][name] = {
            "step_time_median_s": statistics.median(medians),
            "step_time_medians_s": medians,
            "ratios": ratios,
            "step_time_ratio_vs_ddp": statistics.median(ratios),
            "samples_per_s": statistics.median(m["samples_per_s"] for m in ms),
            "final_loss": last["final_loss"],
            "worker_bytes_per_step_M": traffic(last, "worker") / model_bytes,
            "server_bytes_per_step_M": traffic(last, "server") / model_bytes,
            "traffic_estimated": last["traffic"]["estimated"],
            "predicted_M": predicted(name, cfgs[name]),
            "machines": last["traffic"]["machines"],
        }

    print(f"\n{args.workers} workers on {args.nodes} emulated machines, model "
          f"{model_bytes / 1e6:.2f} MB of gradients, {args.rounds} alternating rounds of "
          f"{args.steps} steps")
    print(f"{'config':12s} {'step ms':>8s} {'vs ddp':>7s} {'worker M':>9s} {'(formula)':>9s} "
          f"{'CPU M':>7s} {'(formula)':>9s}")
    for name, c in result["configs"].items():
        print(f"{name:12s} {c['step_time_median_s'] * 1e3:8.1f} "
              f"{c['step_time_ratio_vs_ddp']:7.2f} {c['worker_bytes_per_step_M']:9.3f} "
              f"{c['predicted_M']['worker']:9.3f} {c['server_bytes_per_step_M']:7.3f} "
              f"{c['predicted_M']['server']:9.3f}")
    print("\nTheorem 1 on a cluster of 8 GPU machines (busiest NIC, bytes per step in M):")
    print(f"{'k':>3s} {'BytePS':>7s} {'x (CPU)':>8s} {'all-reduce':>10s} {'classic PS':>10s}")
    for row in result["cluster"]:
        print(f"{row['k']:3d} {row['byteps']:7.3f} {row['cpu_share']:8.3f} "
              f"{row['all_reduce']:10.3f} {row['classic_ps']:10.3f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot(result, png)
    print(f"\nwrote {args.out} and {png}")
    return 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
