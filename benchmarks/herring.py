"""Herring's balance and bytes against BytePS's placement on the same job.

Runs Herring and BytePS (and ddp for the step time) on the same model and
layout, and reports, from metrics.json: every server process's received
bytes per step (the busiest over the least busy: Herring's equal shards
against Theorem 1's placement of whole partitions), each machine's bytes per
step against its formula, and the part of Herring's communication that
backward hid. Saves ``benchmarks/results/herring.json``; the figures, with
the command that made them, are in docs/herring.md. Speed on shaped links is
the cluster benchmark's (``./dev bench cluster``).

    ./dev bench herring                   # the default GPT, 2 machines of 2 workers, 2 servers
    ./dev bench herring --quick           # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import polytrain
from polytrain.herring import herring_traffic
from polytrain.strategies.byteps import optimal_shares
from polytrain.train import run_config

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"OMP_NUM_THREADS": "1"}


def predicted(name: str, nodes: int, servers: int, workers: int) -> dict[str, float]:
    if name == "herring":
        return herring_traffic(nodes, servers)
    if name == "byteps":
        s = optimal_shares(nodes, servers)
        return {"worker": s.worker_machine_traffic(), "server": s.cpu_machine_traffic()}
    return {"worker": 2 * (workers - 1) / workers, "server": 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, one round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/herring.json (--quick: herring_quick.json)")
    args = p.parse_args(argv)
    args.out = args.out or RESULTS / ("herring_quick.json" if args.quick else "herring.json")
    model = {"seq_len": 16, "d_model": 32, "layers": 2} if args.quick else {}
    if args.quick:
        args.rounds, args.steps = 1, 4
    base = polytrain.TrainConfig(strategy="ddp", workers=args.workers, nodes=args.nodes,
                                 steps=args.steps, batch_size=16, optimizer="sgd", lr=0.05,
                                 quiet=True, model_options=model, timeout_s=300)
    cfgs = {"ddp": base,
            "byteps": base.replace(strategy="byteps", servers=args.servers),
            "herring": base.replace(strategy="herring", servers=args.servers)}
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in cfgs}
    for r in range(args.rounds):
        order = list(cfgs)[r % 3:] + list(cfgs)[:r % 3]
        for name in order:
            m = run_config(cfgs[name], env=ENV)
            runs[name].append(m)
            print(f"round {r + 1} {name:8s} step {m['step_time_s']['median'] * 1e3:7.1f} ms",
                  flush=True)
    out: dict[str, Any] = {"setup": {"workers": args.workers, "nodes": args.nodes,
                                     "servers": args.servers, "steps": args.steps,
                                     "rounds": args.rounds, "model_options": model or "gpt"},
                           "configs": {}}
    for name, ms in runs.items():
        last = ms[-1]
        m_bytes = last["model_bytes"]
        servers = last["traffic"]["servers"]
        recv = [s["recv_bytes_per_step"] for s in servers]
        kinds: dict[str, list[float]] = {}
        for s in servers:  # Theorem 1 sizes the two kinds apart: compare within each
            kind = "dedicated" if s["machine"].startswith("server") else "colocated"
            kinds.setdefault(kind, []).append(s["recv_bytes_per_step"])
        ratios = [a["step_time_s"]["median"] / d["step_time_s"]["median"]
                  for a, d in zip(ms, runs["ddp"])]
        out["configs"][name] = {
            "step_time_median_s": statistics.median(m["step_time_s"]["median"] for m in ms),
            "step_time_ratio_vs_ddp": statistics.median(ratios),
            "server_recv_bytes_per_step": {s["rank"]: s["recv_bytes_per_step"] for s in servers},
            "busiest_over_least_busy": (max(recv) / min(recv) if recv and min(recv) > 0
                                        else None),
            "busiest_over_least_busy_by_kind": {k: max(v) / min(v) if min(v) > 0 else None
                                                for k, v in kinds.items()},
            "machines_M": {mm["name"]: mm["sent_bytes_per_step"] / m_bytes
                           for mm in last["traffic"]["machines"]},
            "predicted_M": predicted(name, args.nodes, args.servers, args.workers),
            "hidden_fraction": statistics.median(
                [m["overlap"]["hidden_fraction"] for m in ms]) if name == "herring" else None,
            "final_loss": last["final_loss"],
        }
    print(f"\n{'strategy':8s} {'step ms':>8s} {'vs ddp':>7s} {'server max/min':>14s} "
          f"{'worker M':>9s} {'formula':>8s}")
    for name, c in out["configs"].items():
        worker = max(v for k, v in c["machines_M"].items() if k.startswith("node"))
        balance = c["busiest_over_least_busy"]
        print(f"{name:8s} {c['step_time_median_s'] * 1e3:8.1f} {c['step_time_ratio_vs_ddp']:7.2f}"
              f" {balance if balance is None else round(balance, 4)!s:>14s} {worker:9.3f} "
              f"{c['predicted_M']['worker']:8.3f}")
    if out["configs"]["herring"]["hidden_fraction"] is not None:
        print(f"herring: backward hid {out['configs']['herring']['hidden_fraction']:.0%} of its "
              f"communication")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
