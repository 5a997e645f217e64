"""The engine's own cost: BytePS k = 0 against ddp where the network does not bound the step.

Runs, as a new user would, ``polytrain train --strategy ddp --workers 4 --nodes 4
--optimizer sgd --steps N --quiet`` and the same with ``--strategy byteps`` (k = 0:
one colocated server per machine, all-reduce's bytes), in alternating rounds that
rotate who goes first; reports each run's median step time, the ratio per round
and the median ratio. Extra configurations (``--fuse-bytes 262144``, say: the old
default) join with ``--also``. Saves ``benchmarks/results/engine_cost.json``;
docs/byteps.md ("Engine cost") has the figures and the commands that made them.

    python benchmarks/engine_cost.py                              # 3 rounds of 60 steps
    python benchmarks/engine_cost.py --also "--fuse-bytes 262144"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def command(strategy: str, extra: list[str], args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-c", "import sys; from polytrain.cli import main; sys.exit(main())",
            "train", "--strategy", strategy, "--workers", str(args.workers), "--nodes",
            str(args.nodes), "--optimizer", "sgd", "--steps", str(args.steps), "--quiet",
            "--out", str(out), *extra]


def run(name: str, argv: list[str], out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"median_s": metrics["step_time_s"]["median"], "p90_s": metrics["step_time_s"]["p90"],
            "final_loss": metrics["final_loss"], "wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--also", action="append", default=[], metavar="FLAGS",
                   help="another byteps configuration, as flags (repeatable)")
    p.add_argument("--out", type=Path, default=RESULTS / "engine_cost.json")
    args = p.parse_args(argv)
    configs: dict[str, tuple[str, list[str]]] = {"ddp": ("ddp", []), "byteps k=0": ("byteps", [])}
    for flags in args.also:
        configs[f"byteps k=0 {flags}"] = ("byteps", shlex.split(flags))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="engine-cost-") as tmp:
        for r in range(args.rounds):
            order = list(configs)
            order = order[r % len(order):] + order[:r % len(order)]
            for name in order:
                out = Path(tmp) / f"{r}-{len(runs[name])}-{name.replace(' ', '_')}"
                strategy, extra = configs[name]
                m = run(name, command(strategy, extra, args, out), out)
                runs[name].append(m)
                print(f"round {r + 1}/{args.rounds} {name:28s} step {m['median_s'] * 1e3:6.1f} ms "
                      f"median, {m['p90_s'] * 1e3:6.1f} p90  ({m['wall_s']:.0f} s)", flush=True)
    result: dict[str, Any] = {
        "setup": {"workers": args.workers, "nodes": args.nodes, "steps": args.steps,
                  "rounds": args.rounds, "optimizer": "sgd", "model": "gpt defaults",
                  "cores": len(os.sched_getaffinity(0)),
                  "command": "polytrain train --strategy S --workers "
                             f"{args.workers} --nodes {args.nodes} --optimizer sgd --steps "
                             f"{args.steps} --quiet"},
        "configs": {}}
    print(f"\n{'config':28s} {'median ms':>9s} {'vs ddp':>7s}  ratios per round")
    for name, ms in runs.items():
        ratios = [m["median_s"] / d["median_s"] for m, d in zip(ms, runs["ddp"])]
        result["configs"][name] = {
            "flags": configs[name][1], "step_time_medians_s": [m["median_s"] for m in ms],
            "step_time_p90s_s": [m["p90_s"] for m in ms],
            "step_time_median_s": statistics.median(m["median_s"] for m in ms),
            "ratios": ratios, "ratio_vs_ddp": statistics.median(ratios),
            "final_loss": ms[-1]["final_loss"]}
        c = result["configs"][name]
        print(f"{name:28s} {c['step_time_median_s'] * 1e3:9.1f} {c['ratio_vs_ddp']:7.2f}  "
              + " ".join(f"{x:.2f}" for x in ratios))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
