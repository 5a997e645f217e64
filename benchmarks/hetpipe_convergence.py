"""HetPipe with N_m > 1 and D > 0 against single on the default GPT task, over seeds.

For each seed: ``single`` (the reference) and HetPipe (ED, 2 virtual workers
of 2 stages, N_m = 2, D = 1, one server) five ways: polytrain's default
(the servers run the optimizer, weight prediction, the late stage at a
quarter of the learning rate with Adam's beta2 0.9), the late stage's beta2
0.999 (``--lag-beta2 0.999``, the default until then), the late stage at the
full learning rate (``--lag-lr 1``), each virtual worker's own optimizer
(``--no-server-optimizer``), and the paper's semantics (own optimizers, no
prediction, full learning rate, beta2 0.999), all on the default task: GPT d_model 128,
4 blocks, 500 steps, batch 32, Adam 2e-3. Reports each run's final loss (mean
of the last 20 steps: the same batches in every run) and its ratio to single's
of the same seed; single's own loss varies with the seed, so the ratios are
paired by seed and summarised by their mean and median.

    ./dev bench hetpipe_convergence              # seeds 0-3
    ./dev bench hetpipe_convergence --runs hetpipe --seeds 0 1 2 3 4 5 6 7 \
        --name hetpipe_convergence_beta2         # the default over eight seeds
    ./dev bench hetpipe_convergence --seeds 0    # one seed
    ./dev bench hetpipe_convergence --runs hetpipe --lr-schedule cosine --warmup-steps 50 \
        --name hetpipe_convergence_cosine        # the same task with warm-up and cosine decay

Saves benchmarks/results/NAME.json and .png (default NAME hetpipe_convergence). The
results, with the commands that made them, are in docs/hetpipe.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from polytrain import TrainConfig
from polytrain.train import run_config

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = {
    "hetpipe": {"policy": "ed", "inflight": 2, "staleness": 1},
    "hetpipe-beta2-0.999": {"policy": "ed", "inflight": 2, "staleness": 1, "lag_beta2": None},
    "hetpipe-lag-lr-1": {"policy": "ed", "inflight": 2, "staleness": 1, "lag_lr": 1.0},
    "hetpipe-own-optimizer": {"policy": "ed", "inflight": 2, "staleness": 1,
                              "server_optimizer": False},
    "hetpipe-paper": {"policy": "ed", "inflight": 2, "staleness": 1, "predict": False,
                      "server_optimizer": False, "lag_lr": 1.0, "lag_beta2": None},
}
TAIL = 20


def run(config: TrainConfig) -> dict[str, Any]:
    return run_config(config, env={"OMP_NUM_THREADS": "1"})


def tail(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"))
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--name", default="hetpipe_convergence")
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = {n: RUNS[n] for n in args.runs}
    rows: dict[str, Any] = {}
    curves: dict[str, dict[int, list[float]]] = {"single": {}, **{n: {} for n in runs}}
    for seed in args.seeds:
        base = TrainConfig(quiet=True, seed=seed, timeout_s=120.0, lr=args.lr,
                           lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps)
        single = run(base.replace(strategy="single", workers=1))
        curves["single"][seed] = single["losses"]
        row: dict[str, Any] = {"single": tail(single["losses"])}
        for name, options in runs.items():
            m = run(base.replace(strategy="hetpipe", workers=4, nodes=2, servers=1,
                                 strategy_options=options))
            curves[name][seed] = m["losses"]
            row[name] = tail(m["losses"])
            row[f"{name}_vs_single"] = row[name] / row["single"]
        rows[str(seed)] = row
        print(f"seed {seed}: single {row['single']:.3f}, " + ", ".join(
            f"{n} {row[n]:.3f} ({row[f'{n}_vs_single'] - 1:+.1%})" for n in runs),
            file=sys.stderr)
    summary = {}
    for name in runs:
        ratios = [r[f"{name}_vs_single"] for r in rows.values()]
        summary[name] = {"mean_vs_single": statistics.mean(ratios),
                         "median_vs_single": statistics.median(ratios),
                         "min_vs_single": min(ratios), "max_vs_single": max(ratios),
                         "seeds_within_5pct": sum(r <= 1.05 for r in ratios),
                         "mean_loss_vs_mean_single": statistics.mean(
                             r[name] for r in rows.values()) / statistics.mean(
                             r["single"] for r in rows.values())}
        print(f"{name:>14}: vs single mean {summary[name]['mean_vs_single'] - 1:+.1%}, median "
              f"{summary[name]['median_vs_single'] - 1:+.1%}, range "
              f"{min(ratios) - 1:+.1%} .. {max(ratios) - 1:+.1%}, "
              f"{summary[name]['seeds_within_5pct']} of {len(ratios)} seeds within 5%")
    RESULTS.mkdir(parents=True, exist_ok=True)
    schedule = "constant" if args.lr_schedule == "constant" and not args.warmup_steps else \
        f"{args.lr_schedule}, {args.warmup_steps} warm-up steps"
    out = {"task": f"default GPT (d_model 128, 4 blocks, seq 64), 500 steps, batch 32, adam "
                   f"{args.lr:g}, learning rate {schedule}",
           "runs": runs, "loss": f"mean of the last {TAIL} steps", "seeds": rows,
           "summary": summary, "curves": curves, "versions": {"torch": torch.__version__}}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(curves, RESULTS / f"{args.name}.png", out["task"])
    print(f"wrote {RESULTS / args.name}.json and .png")
    return 0


def plot(curves: dict[str, dict[int, list[float]]], path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"single": "black", "hetpipe": "tab:blue", "hetpipe-beta2-0.999": "tab:green",
              "hetpipe-lag-lr-1": "tab:red", "hetpipe-own-optimizer": "tab:orange",
              "hetpipe-paper": "tab:purple"}
    labels = {"single": "single", "hetpipe": "hetpipe N_m=2 D=1",
              "hetpipe-beta2-0.999": "hetpipe N_m=2 D=1, late stage's beta2 0.999",
              "hetpipe-lag-lr-1": "hetpipe N_m=2 D=1, late stage at the full lr",
              "hetpipe-own-optimizer": "hetpipe N_m=2 D=1, optimizer per virtual worker",
              "hetpipe-paper": "hetpipe N_m=2 D=1, the paper (neither)"}
    for name, by_seed in curves.items():
        for i, losses in enumerate(by_seed.values()):
            smooth = [sum(losses[max(0, j - TAIL + 1):j + 1]) / min(j + 1, TAIL)
                      for j in range(len(losses))]
            ax.plot(smooth, color=colors[name], alpha=0.8, linewidth=1,
                    label=labels[name] if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {TAIL} steps)")
    ax.set_title(f"HetPipe vs single, one line per seed\n{task}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
