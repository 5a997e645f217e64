"""PipeTransformer against its own no-freeze pipeline on 8 emulated devices: time to loss.

Pre-trains the GPT on the first three quarters of the corpus once (``single``, saved
under ``benchmarks/results/pretrained-*/final.pt`` and reused), then fine-tunes it on
the corpus's last 64th with ``--strategy pipetransformer`` on two emulated machines of
four devices: without freezing (4 stages x 2 replicas: the pipeline + data parallel
baseline), with freezing only, + AutoPipe, + AutoDP, + AutoCache (the paper's Figure 9
breakdown). Every run evaluates on held-out data every few steps; the figure is the
training time (worker 0's step times, evaluation excluded) each run takes to reach
the no-freeze run's final held-out loss within 1%, and each run's final held-out
loss. Rounds alternate the runs (the order rotates); times are medians over rounds, and a
speed-up is the median of the rounds' own ratios to the no-freeze run. Saves
``benchmarks/results/pipetransformer.json`` and ``.png`` (held-out loss against time).

    ./dev bench pipetransformer             # the default: 1 round
    ./dev bench pipetransformer --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import uuid
from pathlib import Path
from typing import Any

import torch

import polytrain
from polytrain.emulation.profile import profile_model
from polytrain.models import get_model
from polytrain.pipeline.autopipe import plan_pipe
from polytrain.pipeline.freeze import SIGNALS
from polytrain.train import run_config

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"OMP_NUM_THREADS": "1"}
#: torch threads of the pre-training (in this process). On 2, an AVX512 machine made the model
#: of stop 42's figures and earlier (first held-out loss 1.6408), an AVX2 one stop 41's and
#: stop 56's (1.6717): docs/pipetransformer.md.
PRETRAIN_THREADS = 2

VARIANTS: dict[str, dict[str, Any]] = {
    "no freeze": {"freeze": False},
    "freeze only": {"autopipe": False, "cache": False},
    "+ AutoPipe": {"autodp": False, "cache": False},
    "+ AutoDP": {"cache": False},
    "+ AutoCache": {},
}


def device_memory_mb(model: dict[str, Any], batch: int, stages: int) -> float:
    """A device memory that holds the model cut in ``stages`` but not in half as many (Adam)."""
    spec = get_model("gpt")
    net = spec.make(**model)
    prof = profile_model(net, torch.zeros((1, model["seq_len"]), dtype=torch.long))
    need = {}
    for k in (stages, stages // 2):
        for mb in (2.0 ** (i / 8) for i in range(-80, 160)):
            try:
                plan_pipe(prof, step=0, frozen=0, stages=k, replicas=8 // k,
                          global_batch=batch, memory=mb * 2**20)
            except polytrain.ConfigError:
                continue
            need[k] = mb
            break
    assert need[stages] < need[stages // 2], need
    return round((need[stages] * 1.15), 3)


def corpus_sha256() -> str:
    """The text corpus's fingerprint: it is read from this Python's standard library, so
    another Python version is another corpus (and another pre-trained model)."""
    from polytrain.data import stdlib_corpus

    return hashlib.sha256(stdlib_corpus().numpy().tobytes()).hexdigest()


def pretrained(folder: Path, model: dict[str, Any], steps: int) -> dict[str, Any]:
    """Pre-train the GPT once into ``folder`` (``single``, on PRETRAIN_THREADS threads) and
    say what made it. The float sums, so the model, depend on the thread count and on the
    CPU kernels torch picks (``ATEN_CPU_CAPABILITY``: avx2, avx512...); a model made from
    another corpus, torch, thread count or kernels is made again."""
    want = {"corpus_sha256": corpus_sha256(), "torch": torch.__version__,
            "python": platform.python_version(), "threads": PRETRAIN_THREADS,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "steps": steps}
    record = folder / "provenance.json"
    if (folder / "final.pt").exists() and record.exists():
        made = json.loads(record.read_text())
        if {k: made.get(k) for k in want} == want:
            return made
        print(f"re-training {folder.name}: made with {made}, this run has {want}", flush=True)
    # polytrain refuses to write over another run's results: the stale model goes first.
    for stale in ("final.pt", "metrics.json", "provenance.json"):
        (folder / stale).unlink(missing_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(PRETRAIN_THREADS)
    try:
        run_config(polytrain.TrainConfig(strategy="single", data="text-pretrain", steps=steps,
                                         batch_size=32, lr=2e-3, model_options=model,
                                         out=str(folder), quiet=True))
    finally:
        torch.set_num_threads(threads)
    made = {**want, "final_pt_sha256": hashlib.sha256(
        (folder / "final.pt").read_bytes()).hexdigest()}
    record.write_text(json.dumps(made, indent=1) + "\n")
    return made


def time_to(evals: list[dict[str, float]], target: float) -> float | None:
    for e in evals:
        if e["loss"] <= target:
            return e["train_time_s"]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    # Long enough that the front layers have converged before fine-tuning (shorter, they
    # still learn in it and any freezing costs loss: docs/pipetransformer.md, Benchmark).
    p.add_argument("--pretrain-steps", type=int, default=2400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--freeze-every", type=int, default=40)
    p.add_argument("--freeze-signal", default="change", choices=SIGNALS)
    p.add_argument("--freeze-threshold", type=float, default=None,
                   help="default: the signal's (0.1 for change, 1.0 for level, 0.5 for "
                        "relative)")
    p.add_argument("--freeze-alpha", type=float, default=1 / 3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--gflops", type=float, default=1.0, help="each emulated device's speed")
    p.add_argument("--only", nargs="*", default=None, help="run only these variants")
    p.add_argument("--merge", action="store_true",
                   help="add these runs to those already in --out (split a long benchmark)")
    p.add_argument("--out", type=Path, default=None, help="default: results/pipetransformer"
                                                         ".json (--quick: ..._quick.json)")
    args = p.parse_args(argv)
    args.out = args.out or RESULTS / ("pipetransformer_quick.json" if args.quick
                                      else "pipetransformer.json")
    model = {"seq_len": 32, "d_model": 64, "layers": 8, "heads": 4}
    if args.quick:
        model = {"seq_len": 16, "d_model": 32, "layers": 4, "heads": 4}
        args.steps, args.pretrain_steps, args.freeze_every, args.eval_every = 12, 20, 4, 4
    tag = "-".join(f"{k}{v}" for k, v in model.items())
    pre = RESULTS / f"pretrained-{tag}-{args.pretrain_steps}"
    provenance = pretrained(pre, model, args.pretrain_steps)
    memory = device_memory_mb(model, args.batch_size, 4)
    devices = f"d={args.gflops}/{memory},m0:d*4,m1:d*4"
    base = polytrain.TrainConfig(
        strategy="pipetransformer", devices=devices, data="text-finetune", sampling="epoch",
        steps=args.steps, batch_size=args.batch_size, lr=1e-3, model_options=model,
        init=str(pre / "final.pt"), eval_every=args.eval_every, quiet=True, timeout_s=300,
        strategy_options=VARIANTS["no freeze"])  # (each run's replace it; --quick's 12 steps
    # with the default freeze points, one epoch of 108 steps, are refused)
    names = [n for n in VARIANTS if args.only is None or n in args.only]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    # What makes runs comparable: merged runs must agree on all of it.
    task = {"devices": devices, "batch_size": args.batch_size, "steps": args.steps,
            "pretrain_steps": args.pretrain_steps, "freeze_every": args.freeze_every,
            "freeze_signal": args.freeze_signal, "freeze_threshold": args.freeze_threshold,
            "freeze_alpha": args.freeze_alpha, "eval_every": args.eval_every}
    if args.merge and args.out.exists():
        kept = json.loads(args.out.read_text())
        if kept.get("pretrained") != provenance:
            raise SystemExit(f"--merge: the runs in {args.out} fine-tuned another pre-trained "
                             f"model ({kept.get('pretrained')}; now {provenance}): run them "
                             f"all again, without --merge")
        other = [f"{k} {kept.get(k)} there, {v} now" for k, v in task.items()
                 if kept.get(k) != v]
        if other:
            raise SystemExit(f"--merge: the runs in {args.out} ran another task "
                             f"({'; '.join(other)}): pass the same settings, or run them all "
                             f"again without --merge")
        earlier = kept["runs"]
        runs = {n: list(earlier.get(n, [])) for n in VARIANTS if n in earlier or n in names}
    invocation = uuid.uuid4().hex[:8]  # (--merge adds runs of others: paired by both)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # who goes first rotates
            freezing = {"freeze_every": args.freeze_every, "freeze_signal": args.freeze_signal,
                        "freeze_threshold": args.freeze_threshold,
                        "freeze_alpha": args.freeze_alpha}
            options = {**(freezing if VARIANTS[name].get("freeze", True) else {}),
                       **VARIANTS[name]}
            m = run_config(base.replace(strategy_options=options), env=ENV)
            runs.setdefault(name, []).append({
                "eval": m["eval"], "final_eval_loss": m["final_eval_loss"],
                "wall_time_s": m["wall_time_s"], "train_time_s": m["eval"][-1]["train_time_s"],
                "step_time_s": m["step_time_s"], "freeze_timeline": m.get("freeze_timeline"),
                "cache": m.get("cache"), "invocation": invocation, "round": r})
            print(f"round {r} {name:12s} final held-out {m['final_eval_loss']:.4f} "
                  f"train time {runs[name][-1]['train_time_s']:.1f} s", flush=True)
    summary: dict[str, Any] = {}
    ref = runs.get("no freeze")
    # The must-show's target: the no-freeze run's final held-out loss + 1%; and, as one
    # evaluation can jump (an overfitting run's last), its best + 1% beside it.
    target = statistics.median(x["final_eval_loss"] for x in ref) * 1.01 if ref else None
    best = statistics.median(min(e["loss"] for e in x["eval"]) for x in ref) * 1.01 \
        if ref else None

    def median_time(rs: list[dict[str, Any]], loss: float | None) -> float | None:
        reach = [time_to(x["eval"], loss) for x in rs] if loss else []
        ok = [t for t in reach if t is not None]
        return statistics.median(ok) if len(ok) == len(reach) and ok else None

    for name, rs in runs.items():
        summary[name] = {
            "final_eval_loss": statistics.median(x["final_eval_loss"] for x in rs),
            "train_time_s": statistics.median(x["train_time_s"] for x in rs),
            "time_to_target_s": median_time(rs, target),
            "time_to_best_s": median_time(rs, best)}
    def paired_speedups(rs: list[dict[str, Any]], loss: float | None) -> list[float] | None:
        """Each round's no-freeze time to ``loss`` over this variant's in the same round of
        the same invocation (the runs of a round ran side by side, in a rotating order);
        None unless every run of both pairs (--merge adds runs alone) and reached it."""
        assert ref is not None
        if loss is None:
            return None
        mine = {(x.get("invocation"), x.get("round")): x for x in rs}
        pairs = [(time_to(a["eval"], loss), time_to(mine[k]["eval"], loss)) for a in ref
                 if (k := (a.get("invocation"), a.get("round"))) in mine and k[0] is not None]
        ok = len(pairs) == len(rs) == len(ref) and all(a and t for a, t in pairs)
        return [a / t for a, t in pairs] if ok else None  # type: ignore[operator]

    if ref and summary["no freeze"]["time_to_target_s"]:
        base_t = summary["no freeze"]["time_to_target_s"]
        base_b = summary["no freeze"]["time_to_best_s"]
        for name, s in summary.items():
            # The median of the rounds' own ratios (a ratio of medians pairs no rounds);
            # where a run pairs with none, the ratio of the medians, marked as such.
            for key, loss, of_medians in (("speedup", target, base_t),
                                          ("speedup_to_best", best, base_b)):
                ratios = paired_speedups(runs[name], loss)
                t = s["time_to_target_s" if key == "speedup" else "time_to_best_s"]
                s[key] = statistics.median(ratios) if ratios else (
                    of_medians / t if t and of_medians else None)
                s[key + "_rounds"] = ratios  # None: the ratio of medians
            s["final_within_1pct"] = abs(s["final_eval_loss"] / summary["no freeze"][
                "final_eval_loss"] - 1) <= 0.01 or s["final_eval_loss"] < summary[
                "no freeze"]["final_eval_loss"]
    out = {"model": model, "pretrained": provenance, **task, "rounds": args.rounds,
           "target_loss": target, "best_target_loss": best,
           "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:12s} time to {target or float('nan'):.4f}: {s['time_to_target_s']} s, "
              f"speed-up {s.get('speedup')}; to {best or float('nan'):.4f} (best + 1%): "
              f"{s['time_to_best_s']} s, speed-up {s.get('speedup_to_best')}; "
              f"final {s['final_eval_loss']:.4f}")
    plot(out, args.out.with_suffix(".png"))
    return 0


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rs in out["runs"].items():
        e = rs[0]["eval"]
        ax.plot([x["train_time_s"] for x in e], [x["loss"] for x in e], marker=".", label=name)
    if out["target_loss"]:
        ax.axhline(out["target_loss"], color="grey", ls="--", lw=0.8,
                   label="no-freeze final + 1%")
    if out.get("best_target_loss"):
        ax.axhline(out["best_target_loss"], color="grey", ls=":", lw=0.8,
                   label="no-freeze best + 1%")
    ax.set_xlabel("training time (s, emulated devices)")
    ax.set_ylabel("held-out loss")
    ax.legend()
    names = list(out["summary"])
    at = range(len(names))
    bx.bar([i - 0.2 for i in at], [out["summary"][n].get("speedup") or 0 for n in names],
           width=0.4, label="to the no-freeze final + 1%")
    bx.bar([i + 0.2 for i in at],
           [out["summary"][n].get("speedup_to_best") or 0 for n in names], width=0.4,
           label="to the no-freeze best + 1%")
    bx.set_xticks(at, names, rotation=20)
    bx.axhline(2.0, color="grey", ls="--", lw=0.8)
    bx.set_ylabel("speed-up (time to the loss)")
    bx.legend()
    fig.suptitle(f"PipeTransformer on 8 emulated devices ({out['devices']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
