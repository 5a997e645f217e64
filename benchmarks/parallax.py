"""Parallax against ddp on wordlm, on the emulated cluster; the partition search against fixed P.

Part 1 (``speed``): on shaped links (``--bandwidth``, default 1gbit), N machines
of one worker each (default 4), the same wordlm job under

- ``parallax``: sparse rows through servers on every machine, the body all-reduced
  (``--partitions 1,4``: a run per row-range count, named ``parallax P=1``, ...);
- ``ddp sparse``: torch's DDP on the sparse gradients (gloo's sparse all-reduce:
  an all-gather of indices and values);
- ``ddp dense``: torch's DDP on the same model with dense embedding gradients
  (``--dense-grads``: the whole tables all-reduced every step).

Rounds alternate between the three; the medians of each run's step times, the
NIC bytes per step, and the time each took to reach a fixed loss (the first
step whose mean loss over the last 5 steps is at or below ``--target``) are
reported. Part 2 (``partitions``): parallax with ``--partitions P`` for P in
``--counts`` against the in-run search, same job. Saves
``benchmarks/results/parallax.json`` and a plot; the figures, with the command
that made them, are in docs/parallax.md. Needs root (network namespaces).

    ./dev bench parallax                       # both parts
    ./dev bench parallax --parts speed --steps 30
    ./dev bench parallax --parts speed --partitions 1,4 --negatives 4096   # a larger job
    ./dev bench parallax --quick               # a smoke run, small model
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import polytrain
from polytrain.train import run_config

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"OMP_NUM_THREADS": "1"}


def time_to_loss(losses: list[float], times: list[float], target: float,
                 window: int = 5) -> float | None:
    """Seconds of steps until the mean of the last ``window`` losses is <= ``target``."""
    elapsed = 0.0
    for i, t in enumerate(times):
        elapsed += t
        if i + 1 >= window and sum(losses[i + 1 - window:i + 1]) / window <= target:
            return elapsed
    return None


def summary(m: dict[str, Any], target: float) -> dict[str, Any]:
    times = m.get("step_times")
    workers = [x for x in m["traffic"]["machines"] if x["kind"] == "worker"]
    nic = [x.get("nic_sent_bytes_per_step") for x in workers]
    return {"step_s": m["step_time_s"]["median"], "final_loss": m["final_loss"],
            "losses": m["losses"], "step_times_s": times,
            "time_to_loss_s": time_to_loss(m["losses"], times, target) if times else None,
            # ddp's first step carries its set-up (~0.5 s): the same clock without it
            "time_to_loss_after_first_s": time_to_loss(m["losses"], [0.0, *times[1:]],
                                                       target) if times else None,
            "nic_sent_bytes_per_step": nic,
            "meter_sent_bytes_per_step": [x["sent_bytes_per_step"] for x in workers],
            "partitions": m.get("plan", {}).get("partitions"),
            "partition_search": m.get("partition_search"), "sparse": m.get("sparse")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, few steps, one round")
    p.add_argument("--parts", default="curve,speed,partitions")
    p.add_argument("--curve-steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--negatives", type=int, default=None,
                   help="sampled negatives per step (default: the model's, 512)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--target", type=float, default=None,
                   help="the fixed loss (default: parallax's first-round loss at 80%% of "
                        "the steps)")
    p.add_argument("--partitions", default=None,
                   help="parallax's row ranges per table in the speed part, a run per count "
                        "(e.g. 1,4; default: one per machine)")
    p.add_argument("--counts", default="1,2,4,8,16,32")
    p.add_argument("--out", type=Path, default=RESULTS / "parallax.json")
    p.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                   help="only redraw the plot of a saved result")
    args = p.parse_args(argv)
    if args.plot_only is not None:
        _plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return 0
    model: dict[str, Any] = {"vocab": args.vocab}
    if args.negatives is not None:
        model["negatives"] = args.negatives
    if args.quick:
        model = {"vocab": 5000, "seq_len": 8, "d_model": 32, "layers": 1}
        args.rounds, args.steps, args.counts = 1, 8, "1,4"
    base = polytrain.TrainConfig(strategy="parallax", model="wordlm", workers=args.nodes,
                                 nodes=args.nodes, steps=args.steps,
                                 batch_size=args.batch_size, optimizer="sgd", lr=args.lr,
                                 quiet=True, model_options=model, timeout_s=600,
                                 bandwidth=args.bandwidth)
    counts = [int(c) for c in (args.partitions or str(args.nodes)).split(",")]
    ours = {f"parallax P={c}" if len(counts) > 1 else "parallax": c for c in counts}
    runs = {**{name: base.replace(strategy_options={"partitions": c})
               for name, c in ours.items()},
            "ddp sparse": base.replace(strategy="ddp"),
            "ddp dense": base.replace(strategy="ddp",
                                      model_options={**model, "dense_grads": True})}
    parts = set(args.parts.split(","))
    given = sys.argv[1:] if argv is None else argv
    out: dict[str, Any] = {"command": " ".join(["./dev bench parallax", *given]),
                           "nodes": args.nodes, "bandwidth": args.bandwidth,
                           "model": model, "steps": args.steps, "batch_size": args.batch_size,
                           "partitions": counts}
    raw: dict[str, list[dict[str, Any]]] = {}
    if "curve" in parts:  # wordlm trains on its own: one process, the default optimizer
        m = run_config(polytrain.TrainConfig(strategy="single", model="wordlm",
                                             steps=args.curve_steps, quiet=True,
                                             model_options=model), env=ENV)
        out["curve"] = {"steps": args.curve_steps, "optimizer": "adam (lazy on the embeddings)",
                        "lr": m.get("lr", 2e-3), "losses": m["losses"],
                        "step_s": m["step_time_s"]["median"]}
        print(f"single: loss {m['losses'][0]:.3f} -> {m['final_loss']:.3f} in "
              f"{args.curve_steps} steps", flush=True)
    if "speed" in parts:
        for r in range(args.rounds):
            order = list(runs)  # alternate, and rotate who goes first: drift spreads evenly
            for name in order[r % len(order):] + order[:r % len(order)]:
                m = run_config(runs[name], env=ENV)
                raw.setdefault(name, []).append(m)
                print(f"round {r} {name}: step {m['step_time_s']['median'] * 1e3:.1f} ms, "
                      f"final loss {m['final_loss']:.3f}", flush=True)
        target = args.target
        if target is None:
            first = raw[next(iter(ours))][0]["losses"]
            end = max(1, int(0.8 * len(first)))  # a short run (--steps 5) has a target too
            cut = first[max(0, end - 5):end]
            target = sum(cut) / len(cut)
        out["target_loss"] = target
        out["speed"] = {name: [summary(m, target) for m in ms] for name, ms in raw.items()}
        med = {name: statistics.median(s["step_s"] for s in v)
               for name, v in out["speed"].items()}
        out["median_step_s"] = med
        out["speedup"] = {name: {"vs ddp dense": med["ddp dense"] / med[name],
                                 "vs ddp sparse": med["ddp sparse"] / med[name]}
                          for name in ours}
        print(json.dumps(out["speedup"]))
    if "partitions" in parts:
        fixed = {}
        for c in [int(x) for x in args.counts.split(",")]:
            m = run_config(base.replace(strategy_options={"partitions": c}), env=ENV)
            fixed[c] = m["step_time_s"]["median"]
            print(f"P = {c}: step {fixed[c] * 1e3:.1f} ms", flush=True)
        m = run_config(base.replace(steps=max(args.steps, 40)), env=ENV)
        search = m["partition_search"]
        chosen = search["chosen"]
        best = min(fixed, key=fixed.get)
        # Its own key: "partitions" holds the speed runs' counts (it was written over).
        out["partition_sweep"] = {"fixed_step_s": fixed, "search": search, "chosen": chosen,
                                  "best_fixed": best,
                                  "chosen_fixed_step_s": fixed.get(chosen),
                                  "within_of_best": (fixed[chosen] / fixed[best] - 1)
                                  if chosen in fixed else None}
        print(json.dumps({k: v for k, v in out["partition_sweep"].items() if k != "search"}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    _plot(out, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


def _plot(out: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if "curve" in out:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(out["curve"]["losses"])
        ax.set_xlabel("step")
        ax.set_ylabel("sampled-softmax loss")
        ax.set_title("wordlm, single, vocab " + str(out["model"].get("vocab")))
        fig.tight_layout()
        fig.savefig(path.with_name(path.stem + "_curve.png"), dpi=100)
    if "speed" not in out:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name, runs in out["speed"].items():
        s = runs[0]
        if "step_times_s" in s:  # loss against the clock: time to the target loss
            clock = [sum(s["step_times_s"][:i + 1]) for i in range(len(s["step_times_s"]))]
            ax[1].plot(clock, s["losses"], label=name)
        else:
            ax[1].plot(s["losses"], label=name)
    names = list(out["median_step_s"])
    ax[0].bar(names, [out["median_step_s"][n] * 1e3 for n in names])
    ax[0].set_ylabel("median step (ms)")
    ax[0].set_title(f"wordlm, {out['nodes']} machines at {out['bandwidth']}")
    if "step_times_s" in next(iter(out["speed"].values()))[0]:
        ax[1].set_xscale("log")
        ax[1].set_xlabel("seconds of steps")
        ax[1].axhline(out["target_loss"], color="gray", linestyle=":", label="target loss")
    else:
        ax[1].set_xlabel("step")
    ax[1].set_ylabel("loss")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
