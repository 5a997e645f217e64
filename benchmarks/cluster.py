"""Every data-parallel strategy side by side on shaped links, and the planner's predictions.

A communication-bound job (a wide MLP: large gradients, little compute per
step) on 4 emulated machines of one worker, each in its own network
namespace with its NIC shaped to each bandwidth; ddp, BytePS with k = 0, 1,
2, 4 CPU servers and Herring with k = 0 and 2, in alternating rounds; plus one
round on loopback (no shaping: what the host's CPU alone allows). For each
configuration: the median step time (median over rounds of each run's
median), its speed-up over ddp beside the busiest-NIC formula's, the NIC
bytes per step, and ``polytrain plan``'s prediction. Needs root and iproute2.
Saves ``benchmarks/results/cluster.json`` and ``cluster.png``; the figures, with
the command that made them, are in docs/cluster.md.

    sudo ./dev bench cluster                 # the default: about 25 minutes here
    sudo ./dev bench cluster --quick         # a smoke run: a small MLP, 3 steps, one round
                                             # at 1gbit and one on loopback (in place of
                                             # --bandwidths, --rounds, --steps), to
                                             # cluster_quick.json
    ./dev bench cluster --analyse            # the tables again from cluster.json, its constants
    ./dev bench cluster --analyse --fit      # ... and the constants the data suggest
    ./dev bench cluster --analyse --fit --fit-with small.json   # ... from two model sizes
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import polytrain
from polytrain.launch.network import parse_rate
from polytrain.plan import CONSTANTS, Constants, Job, nic_traffic, plan_job
from polytrain.plan.compute import measure_compute
from polytrain.plan.cost import Candidate, Compute, Network, host_traffic, predict, recommend
from polytrain.plan.planner import host_cores
from polytrain.ps.engine import DEFAULT_CREDIT_BYTES
from polytrain.train import run_config

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"OMP_NUM_THREADS": "1"}
LOOPBACK = "off"


def configs(args: argparse.Namespace) -> dict[str, tuple[str, int, str]]:
    """name -> (strategy, CPU servers k, BytePS compressor or "none")."""
    out = {"ddp": ("ddp", 0, "none")}
    out.update({f"byteps k={k}": ("byteps", k, "none") for k in args.byteps})
    k = max(args.byteps, default=0)
    out.update({f"byteps k={k} {c}": ("byteps", k, c) for c in args.compress})
    out.update({f"herring k={k}": ("herring", k, "none") for k in args.herring})
    return out


def train_config(args: argparse.Namespace, strategy: str, servers: int,
                 bandwidth: str | None, compress: str = "none") -> polytrain.TrainConfig:
    options = dict(args.byteps_options) if strategy == "byteps" else {}
    if compress != "none":
        options.update(compress=compress, error_feedback=True)
    return polytrain.TrainConfig(
        strategy=strategy, model="mlp", model_options=args.model_options, workers=args.nodes,
        nodes=args.nodes, servers=servers, steps=args.steps, batch_size=args.batch_size,
        optimizer="sgd", lr=0.05, quiet=True, timeout_s=300, bandwidth=bandwidth,
        strategy_options=options)


def run(config: polytrain.TrainConfig) -> dict[str, Any]:
    started = time.perf_counter()
    m = run_config(config, env=ENV)
    machines = m["traffic"]["machines"]
    nic = [max(x.get("nic_sent_bytes_per_step", 0.0), x.get("nic_recv_bytes_per_step", 0.0))
           for x in machines]
    return {"step_time_s": m["step_time_s"]["median"], "step_times": m["step_times"],
            "model_bytes": m["model_bytes"], "final_loss": m["final_loss"],
            "busiest_nic_bytes_per_step": max(nic, default=0.0),
            "busiest_metered_bytes_per_step": max(
                (max(x["sent_bytes_per_step"], x["recv_bytes_per_step"]) for x in machines),
                default=0.0),
            "machines": machines, "servers": m["traffic"]["servers"],
            "overlap": m.get("overlap"), "wall_s": time.perf_counter() - started}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cfgs = configs(args)
    bandwidths = [*args.bandwidths]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {b: {n: [] for n in cfgs}
                                                       for b in [*bandwidths, LOOPBACK]}
    plan_rounds = [(r, b) for r in range(args.rounds) for b in bandwidths]
    plan_rounds += [(r, LOOPBACK) for r in range(args.loopback_rounds)]
    for r, bw in plan_rounds:
        # Alternate, and rotate who goes first, so drift in the machine's load spreads evenly:
        # by round, so that each bandwidth's rounds start with another configuration (by
        # the pair's index, as before, a bandwidth count that the configurations divide
        # gave each bandwidth the same order every round).
        order = list(cfgs)
        shift = (r + [*bandwidths, LOOPBACK].index(bw)) % len(order)
        order = order[shift:] + order[:shift]
        for name in order:
            strategy, k, compress = cfgs[name]
            m = run(train_config(args, strategy, k, None if bw == LOOPBACK else bw, compress))
            runs[bw][name].append(m)
            print(f"round {r + 1} {bw:>8} {name:12s} step {m['step_time_s'] * 1e3:8.1f} ms "
                  f"median, busiest NIC {m['busiest_nic_bytes_per_step'] / m['model_bytes']:.3f}"
                  f" M  ({m['wall_s']:.0f} s)", flush=True)
    compute = measure_compute("mlp", args.model_options, batch=args.batch_size // args.nodes,
                              optimizer="sgd")
    return {"setup": {"nodes": args.nodes, "workers": args.nodes, "steps": args.steps,
                      "batch_size": args.batch_size, "rounds": args.rounds,
                      "loopback_rounds": args.loopback_rounds, "model": "mlp",
                      "model_options": args.model_options, "optimizer": "sgd",
                      "byteps_options": args.byteps_options, "cores": host_cores(),
                      "quick": args.quick, "configs": {n: list(c) for n, c in cfgs.items()}},
            "compute": {"forward_s": compute.forward_s, "backward_s": compute.backward_s,
                        "optimizer_s": compute.optimizer_s},
            "runs": runs}


def analyse(result: dict[str, Any], constants: Constants) -> dict[str, Any]:
    """Medians, speed-ups against the formulas, and the planner's predictions, per bandwidth."""
    setup = result["setup"]
    compute = Compute(**result["compute"])
    n = setup["nodes"]
    cfgs = {name: tuple(c) for name, c in setup["configs"].items()}
    table: dict[str, Any] = {}
    for bw, by_name in result["runs"].items():
        if not any(by_name.values()):
            continue
        job = Job(model="mlp", model_options=setup["model_options"], workers=n, nodes=n,
                  servers=max(c[1] for c in cfgs.values()), batch_size=setup["batch_size"],
                  optimizer="sgd", bandwidth=None if bw == LOOPBACK else bw,
                  cores=setup["cores"])
        plan = plan_job(job, constants=constants, compute=compute)
        measured = {name: statistics.median(r["step_time_s"] for r in rs)
                    for name, rs in by_name.items() if rs}
        ddp = measured["ddp"]
        ddp_nic = nic_traffic("ddp", machines=n, local_workers=1, servers=0)
        rows = {}
        for name, t in measured.items():
            strategy, k, *compress = cfgs[name]
            if compress and compress[0] != "none":
                rows[name] = compressed_row(by_name[name], t, ddp)
                continue
            nic = nic_traffic(strategy, machines=n, local_workers=1, servers=k)
            pred = plan.get(name)
            model_bytes = by_name[name][0]["model_bytes"]
            rows[name] = {
                "step_time_s": t, "step_times_by_round_s": [r["step_time_s"] for r in
                                                            by_name[name]],
                "speedup_vs_ddp": ddp / t, "formula_speedup": ddp_nic / nic if nic else None,
                "formula_M": nic, "host_bytes_M": host_traffic(strategy, machines=n,
                                                                local_workers=1, servers=k),
                "nic_busiest_M": statistics.median(r["busiest_nic_bytes_per_step"]
                                                   for r in by_name[name]) / model_bytes,
                "predicted_s": pred.step_time_s, "predicted_over_measured": pred.step_time_s / t,
                "prediction": pred.as_dict(), "hidden_fraction": hidden_fraction(by_name[name])}
        # The planner's candidates are the uncompressed configurations.
        plain = {name: t for name, t in measured.items() if rows[name]["predicted_s"]}
        fastest = min(plain, key=plain.__getitem__)
        among = recommend([plan.get(name) for name in plain]).candidate.key
        table[bw] = {"configs": rows, "measured_fastest": fastest,
                     "recommended_among_measured": among,
                     "recommended_within_5pct": measured[among] <= 1.05 * measured[fastest],
                     "recommended_overall": plan.recommended.candidate.key}
    return table


def compressed_row(runs: list[dict[str, Any]], t: float, ddp: float) -> dict[str, Any]:
    """A compressed BytePS configuration's row: measured only (no formula, no prediction)."""
    model_bytes = runs[0]["model_bytes"]
    return {"step_time_s": t, "step_times_by_round_s": [r["step_time_s"] for r in runs],
            "speedup_vs_ddp": ddp / t, "formula_speedup": None, "formula_M": None,
            "nic_busiest_M": statistics.median(r["busiest_nic_bytes_per_step"]
                                               for r in runs) / model_bytes,
            "predicted_s": None, "predicted_over_measured": None, "hidden_fraction": None}


def hidden_fraction(runs: list[dict[str, Any]]) -> float | None:
    """The median over runs of the fraction of communication that backward hid (Herring's
    ``overlap`` record; None for a strategy that does not measure it)."""
    fractions = [r["overlap"]["hidden_fraction"] for r in runs if r.get("overlap")]
    return statistics.median(fractions) if fractions else None


#: The constants ``fit`` searches, per strategy family, with their ranges.
FITTED = {"efficiency": (0.5, 1.0), "tail": (0.0, 2.0), "combine": (0.0, 1.5),
          "host_s_per_byte": (0.0, 2e-9), "server_s": (0.0, 0.04), "overhead_s": (0.0, 0.1)}


#: measured, candidate, network, M, compute, and the case (result, bandwidth) it belongs to
Point = tuple[float, Candidate, Network, float, Compute, tuple[int, str]]


def fit(results: list[dict[str, Any]], *, seed: int = 0) -> Constants:
    """Per strategy family, the constants (``FITTED``) that minimise the largest relative
    error of the predictions over every bandwidth and k of every result (runs of
    different model sizes tell a step's fixed cost from its cost per byte): a seeded
    random search, then coordinate steps that halve as they go (deterministic for
    given ``results``). ddp is fitted first; a BytePS or Herring configuration then
    predicted on the other side of ddp's prediction than it was measured (a wrong
    choice for ``--strategy auto``) counts as an error of at least 100%."""
    points: dict[str, list[Point]] = {}
    for index, result in enumerate(results):
        setup = result["setup"]
        compute = Compute(**result["compute"])
        n, cores = setup["nodes"], setup["cores"]
        for bw, by_name in result["runs"].items():
            for name, runs in by_name.items():
                if not runs:
                    continue
                strategy, k, *compress = setup["configs"][name]
                if compress and compress[0] != "none":
                    continue  # the planner models uncompressed bytes only
                net = Network(machines=n, servers=k, shared_host_cores=cores,
                              bandwidth_bit_s=None if bw == LOOPBACK else float(parse_rate(bw)))
                measured = statistics.median(r["step_time_s"] for r in runs)
                points.setdefault(strategy, []).append(
                    (measured, Candidate(strategy=strategy, servers=k), net,
                     runs[0]["model_bytes"], compute, (index, bw)))
    names, ranges = list(FITTED), list(FITTED.values())
    fitted: dict[str, dict[str, float]] = {name: {} for name in names}
    rng = random.Random(seed)
    ddp: dict[tuple[int, str], tuple[float, float]] = {}  # case -> ddp measured, predicted
    for family in sorted(points, key=lambda f: f != "ddp"):
        pts = points[family]

        def predicted(values: list[float], family: str = family,
                      pts: list[Point] = pts) -> list[float]:
            """Each point's predicted step under ``values`` of ``family``'s constants."""
            trial = Constants(**{name: {family: v} for name, v in zip(names, values)},
                              overlap=CONSTANTS.overlap)
            return [predict(cand, network=net, compute=compute, model_bytes=mb,
                            constants=trial).step_time_s
                    for _, cand, net, mb, compute, _ in pts]

        def error(values: list[float], pts: list[Point] = pts, predicted=predicted,
                  ddp: dict[tuple[int, str], tuple[float, float]] = ddp) -> float:
            worst = 0.0
            for (m, *_, case), p in zip(pts, predicted(values)):
                worst = max(worst, abs(p - m) / m)
                if case in ddp and (m > ddp[case][0]) != (p > ddp[case][1]):
                    worst = max(worst, 1.0 + abs(p - ddp[case][1]) / ddp[case][1])
            return worst
        best = min(([rng.uniform(lo, hi) for lo, hi in ranges] for _ in range(5000)), key=error)
        err, steps = error(best), [(hi - lo) / 10 for lo, hi in ranges]
        for i in range(3000):
            j = rng.randrange(len(names))
            trial = list(best)
            lo, hi = ranges[j]
            trial[j] = min(hi, max(lo, trial[j] + rng.gauss(0.0, steps[j])))
            if (e := error(trial)) < err:
                best, err = trial, e
            if i % 500 == 499:
                steps = [x / 2 for x in steps]
        for name, v in zip(names, best):
            fitted[name][family] = v
        if family == "ddp":
            ddp = {case: (m, p) for (m, *_, case), p in zip(pts, predicted(best))}
        print(f"fit {family}: " + ", ".join(f"{name} {v:.3g}" for name, v in zip(names, best))
              + f"; largest error {err:.1%} over {len(pts)} points")
    return Constants(**fitted, overlap=CONSTANTS.overlap)


def report(result: dict[str, Any]) -> None:
    print(f"\n{result['setup']['nodes']} machines of one worker, MLP "
          f"{result['setup']['model_options']}, compute per step here "
          f"{sum(result['compute'].values()) * 1e3:.1f} ms")
    for bw, t in result["table"].items():
        print(f"\n{bw}: measured fastest {t['measured_fastest']}, planner recommends (among "
              f"these) {t['recommended_among_measured']}, overall {t['recommended_overall']}")
        print(f"{'config':18s} {'step ms':>8s} {'x ddp':>6s} {'formula':>8s} {'NIC M':>6s} "
              f"{'(formula)':>9s} {'pred ms':>8s} {'pred/meas':>9s} {'hidden':>6s}")
        for name, c in t["configs"].items():
            def num(key: str, fmt: str, scale: float = 1.0, c: dict[str, Any] = c) -> str:
                return "-" if c.get(key) is None else format(c[key] * scale, fmt)
            print(f"{name:18s} {c['step_time_s'] * 1e3:8.1f} {c['speedup_vs_ddp']:6.2f} "
                  f"{num('formula_speedup', '.2f'):>8s} {c['nic_busiest_M']:6.3f} "
                  f"{num('formula_M', '.3f'):>9s} {num('predicted_s', '.1f', 1e3):>8s} "
                  f"{num('predicted_over_measured', '.2f'):>9s} "
                  f"{num('hidden_fraction', '.1%'):>6s}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = {bw: t for bw, t in result["table"].items() if bw != LOOPBACK}
    names = list(result["setup"]["configs"])
    xs = {bw: parse_rate(bw) / 1e6 for bw in shaped}
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, name in enumerate(names):
        color = f"C{i}"
        bws = sorted(shaped, key=xs.__getitem__)
        ax.plot([xs[b] for b in bws], [shaped[b]["configs"][name]["step_time_s"] for b in bws],
                "o-", color=color, label=name)
        predicted = [(xs[b], shaped[b]["configs"][name]["predicted_s"]) for b in bws]
        if all(p is not None for _, p in predicted):
            ax.plot(*zip(*predicted), "x:", color=color, alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("NIC bandwidth each way (Mbit/s)")
    ax.set_ylabel("step time (s; median of rounds)")
    ax.set_title(f"{result['setup']['nodes']} machines of 1 worker, MLP of "
                 f"{result['model_bytes'] / 1e6:.1f} MB of gradients "
                 "(o measured, x planner)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: a small MLP, 3 steps, one round at 1gbit and one on "
                        "loopback (in place of --bandwidths, --rounds, --steps)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    p.add_argument("--loopback-rounds", type=int, default=1,
                   help="rounds without shaping (default 1)")
    p.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--nodes", type=int, default=4, help="machines of one worker (default 4)")
    p.add_argument("--d-model", type=int, default=2048, help="MLP width (default 2048)")
    p.add_argument("--bandwidths", nargs="+", default=["200mbit", "1gbit", "5gbit"])
    p.add_argument("--byteps", type=int, nargs="+", default=[0, 1, 2, 4],
                   help="CPU servers k of each BytePS run (default 0 1 2 4)")
    p.add_argument("--herring", type=int, nargs="+", default=[0, 2],
                   help="CPU servers k of each Herring run (default 0 2)")
    p.add_argument("--credit-bytes", type=int, default=DEFAULT_CREDIT_BYTES,
                   help=f"BytePS's --credit-bytes (default {DEFAULT_CREDIT_BYTES}, the library's)")
    p.add_argument("--partition-bytes", type=int, default=None,
                   help="BytePS's --partition-bytes (default: the library's)")
    p.add_argument("--fuse-bytes", type=int, default=None,
                   help="BytePS's --fuse-bytes (default: the library's)")
    p.add_argument("--compress", nargs="*", default=[],
                   help="also BytePS with the most CPU servers and each of these compressors "
                        "(with --error-feedback), e.g. onebit fp16")
    p.add_argument("--analyse", action="store_true",
                   help="no runs: the tables again from --out's measurements, with the "
                        "constants stored there (the file and its plot are left as they are)")
    p.add_argument("--fit", action="store_true", help="with --analyse: fit the constants")
    p.add_argument("--fit-with", type=Path, nargs="+", default=[],
                   help="with --fit: more results (another model size) fitted together")
    p.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    args = p.parse_args(argv)
    args.model_options = {"d_model": args.d_model}
    args.byteps_options = {"credit_bytes": args.credit_bytes}
    for flag in ("partition_bytes", "fuse_bytes"):
        if getattr(args, flag) is not None:
            args.byteps_options[flag] = getattr(args, flag)
    if args.quick:
        args.rounds, args.loopback_rounds, args.steps, args.bandwidths = 1, 1, 3, ["1gbit"]
        args.model_options = {"d_model": 256}
        if args.out == RESULTS / "cluster.json":
            args.out = RESULTS / "cluster_quick.json"
    if args.analyse:
        result = json.loads(args.out.read_text())
        if args.fit:
            fitted = fit([result, *(json.loads(f.read_text()) for f in args.fit_with)])
            print(f"fitted: {fitted.as_dict()}")
        # The predictions of the constants stored with the measurement (the docs' tables),
        # and the file left as it is: it is the record of them (rewriting it with today's
        # constants lost the docs' figures).
        stored = result.get("constants")
        result["table"] = analyse(result, CONSTANTS if stored is None else Constants(**stored))
        report(result)
        return 0
    result = measure(args)
    result["constants"] = CONSTANTS.as_dict()
    result["model_bytes"] = next(r[0]["model_bytes"] for b in result["runs"].values()
                                 for r in b.values() if r)
    result["table"] = analyse(result, CONSTANTS)
    report(result)
    save(result, args.out)
    return 0


def save(result: dict[str, Any], out: Path) -> None:
    """The JSON at ``out`` and the plot beside it (same name, ``.png``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
