"""Fault injection: every strategy against every fault; how the run stopped and came back.

For each strategy and fault it records: seconds from the fault until the run
stopped (the launcher's report), whether the report named the process (role,
rank, machine) and the cause, whether any process of the run was left
running, and, with ``--max-restarts 1``, whether the run came back and ended
with the uninterrupted run's weights (``final.pt`` bit for bit; asynchronous
BytePS: the loss fell instead), and how many trained steps were lost beyond
the last checkpoint (must be none: a restart redoes only steps after it).

    ./dev bench faults                                # everything (about 15 minutes here)
    ./dev bench faults --strategies ddp,moe --faults kill-worker,sigstop
    ./dev bench faults --strategies herring,parallax --faults kill-worker,kill-server

Results merge into benchmarks/results/faults.json (one entry per strategy and fault).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tests.faults import Injector, alive, children  # noqa: E402

from polytrain import LaunchError, TrainConfig  # noqa: E402
from polytrain.train import run_config  # noqa: E402

TINY = {"seq_len": 16, "d_model": 32, "layers": 2}
ENV = {"OMP_NUM_THREADS": "1"}
STEPS, EVERY = 60, 10
HANG_TIMEOUT_S = 10.0

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": dict(strategy="ddp", workers=2, nodes=2),
    "byteps": dict(strategy="byteps", workers=2, nodes=2, servers=1),
    "byteps-async": dict(strategy="byteps", workers=2, nodes=2, servers=1,
                         strategy_options={"async_": True, "staleness": 1}),
    "moe": dict(strategy="moe", model="gpt-moe", workers=2, nodes=2,
                model_options={**TINY, "experts": 4}),
    "hetpipe": dict(strategy="hetpipe", workers=4, nodes=2, servers=1, optimizer="sgd",
                    lr=0.05, strategy_options={"inflight": 1, "staleness": 0}),
    "herring": dict(strategy="herring", workers=2, nodes=2, servers=1),
    # The partition count fixed: the search times steps (the weights do not depend on it).
    "parallax": dict(strategy="parallax", model="wordlm", workers=2, nodes=2, servers=1,
                     model_options={"vocab": 2000, "seq_len": 8, "d_model": 16, "layers": 1,
                                    "heads": 2, "negatives": 32},
                     strategy_options={"partitions": 3}),
    # A freeze point at step 20, where the fault comes: the restart re-plans there.
    "pipetransformer": dict(strategy="pipetransformer", workers=4, nodes=2,
                            strategy_options={"freeze_every": 20, "freeze_threshold": 100.0,
                                              "freeze_alpha": 0.5}),
}
FAULTS = ["kill-worker", "kill-server", "sigstop", "raise", "kill-launcher", "truncated"]
SYNC = {"ddp", "byteps", "moe", "hetpipe", "herring", "parallax", "pipetransformer"}


def config_of(name: str, out: Path, **changes: Any) -> TrainConfig:
    base: dict[str, Any] = dict(steps=STEPS, batch_size=8, model_options=TINY, quiet=True,
                                timeout_s=30.0, out=str(out), checkpoint_every=EVERY)
    base.update(STRATEGIES[name])
    base.update(changes)
    return TrainConfig(**base)


def same(a: Path, b: Path) -> tuple[bool, float]:
    x, y = torch.load(a), torch.load(b)
    diff = max(float((x[k].double() - y[k].double()).abs().max()) for k in x)
    return all(torch.equal(x[k], y[k]) for k in x), diff


def one(name: str, fault: str, reference: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{name}-{fault}"
    row: dict[str, Any] = {"strategy": name, "fault": fault}
    if fault == "kill-server" and not STRATEGIES[name].get("servers"):
        return {**row, "applies": False, "note": "no servers in this strategy"}
    row["applies"] = True
    if fault == "truncated":
        return {**row, **truncated(name, reference, out)}
    if fault == "kill-launcher":
        return {**row, **kill_launcher(name, reference, out)}
    role, rank, sig = {"kill-worker": ("worker", 1, signal.SIGKILL),
                       "kill-server": ("server", -1, signal.SIGKILL),
                       "sigstop": ("worker", 1, signal.SIGSTOP),
                       "raise": ("worker", 1, signal.SIGUSR1)}[fault]
    timeout = HANG_TIMEOUT_S if fault == "sigstop" else 30.0
    fault_at = 2 * EVERY  # between the second and third checkpoints
    inj = Injector(role, rank, sig=sig, trigger=out / "checkpoints" / f"step-{fault_at}",
                   delay_s=0.05).start()
    heard: list[tuple[float, str]] = []
    started = time.monotonic()
    try:
        metrics = run_config(config_of(name, out, timeout_s=timeout, max_restarts=1), env=ENV,
                             report=lambda line: heard.append((time.monotonic(), line)))
    except LaunchError as e:
        return {**row, "error": str(e), "restarted": False}
    inj.join()
    if inj.sent_at is None or not heard:
        return {**row, "error": "the fault was not injected before the run ended",
                "wall_s": time.monotonic() - started}
    when, line = heard[0]
    machine = inj.machine
    row.update({
        "stopped_s": round(when - inj.sent_at, 2),
        "report": line,
        "named": f"{role} rank {inj.rank} (machine {machine}" in line,
        "left_running": sorted(p for p in inj.pids.values() if alive(p)),
        "restarted": metrics.get("restarts") == 1,
        "resumed_at": int(line.rsplit("step-", 1)[1]) if "step-" in line else 0,
        "losses_equal": None, "wall_s": round(time.monotonic() - started, 1),
    })
    # Checkpointed work lost: the newest checkpoint on disk at the fault, minus where the
    # restart resumed (0: nothing that was checkpointed was lost).
    row["newest_checkpoint_at_fault"] = inj.newest_step
    row["lost_checkpointed_steps"] = max(0, inj.newest_step - row["resumed_at"])
    ref = json.loads((reference / "metrics.json").read_text())
    row.update(outcome(name, reference, out, ref, metrics))
    return row


def outcome(name: str, reference: Path, out: Path, ref: dict[str, Any],
            metrics: dict[str, Any]) -> dict[str, Any]:
    if name in SYNC:
        equal, diff = same(reference / "final.pt", out / "final.pt")
        return {"same_weights": equal, "max_abs_diff": diff,
                "losses_equal": metrics["losses"] == ref["losses"]}
    losses = metrics["losses"]
    return {"same_weights": None, "loss_fell": losses[-1] < losses[0],
            "final_loss": losses[-1], "reference_final_loss": ref["losses"][-1]}


def truncated(name: str, reference: Path, out: Path) -> dict[str, Any]:
    """The newest checkpoint cut short on disk: --resume skips it for the one before."""
    import shutil
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    newest = out / "checkpoints" / f"step-{STEPS}"
    with open(newest / "model.pt", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    cfg = config_of(name, out, resume=str(out), checkpoint_every=None)
    metrics = run_config(cfg, env=ENV)
    resumed = metrics["checkpoints"]["resumed_at"]
    ref = json.loads((reference / "metrics.json").read_text())
    return {"stopped_s": None, "named": None, "left_running": [], "restarted": True,
            "resumed_at": resumed, "skipped_damaged": resumed == STEPS - EVERY,
            "lost_checkpointed_steps": 0, **outcome(name, reference, out, ref, metrics)}


def kill_launcher(name: str, reference: Path, out: Path) -> dict[str, Any]:
    """SIGKILL the launcher (the `polytrain train` process): its children must die with it;
    then `--resume OUT` finishes the run."""
    cfg = config_of(name, out)
    args = [sys.executable, "-c", "import sys; from polytrain.cli import main; sys.exit(main())",
            "train", "--strategy", cfg.strategy,
            "--model", cfg.model, "--workers", str(cfg.workers), "--nodes", str(cfg.nodes),
            "--servers", str(cfg.servers), "--steps", str(STEPS), "--batch-size", "8",
            "--optimizer", cfg.optimizer, "--lr", str(cfg.lr), "--quiet", "--timeout", "30",
            "--out", str(out), "--checkpoint-every", str(EVERY)]
    args += _flags(cfg.model_options) + _flags(cfg.strategy_options)
    launcher = subprocess.Popen(args, env=dict(os.environ, **ENV, PYTHONPATH=str(ROOT / "src")),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trigger = out / "checkpoints" / f"step-{2 * EVERY}"
    try:
        deadline = time.monotonic() + 300
        while not trigger.exists() and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.05)
        time.sleep(0.05)
        pids = children(launcher.pid)
        newest = max((int(p.name[5:]) for p in trigger.parent.glob("step-*")), default=0)
        injected = trigger.exists() and launcher.poll() is None
    finally:  # on any path out: the launcher is killed (its children die with it)
        launcher.kill()
        killed = time.monotonic()
        launcher.wait()
    if not injected:  # never a row that reads as a fault survived when none was made
        return {"restarted": False, "named": None,
                "error": f"the fault was not injected: no {trigger.name} while the launcher "
                         f"ran (it ended with {launcher.returncode}, -9: killed after 300 s)"}
    while any(alive(p) for p in pids.values()) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    gone_s = time.monotonic() - killed
    left = sorted(p for p in pids.values() if alive(p))
    metrics = run_config(config_of(name, out, resume=str(out)), env=ENV)
    ref = json.loads((reference / "metrics.json").read_text())
    resumed = metrics["checkpoints"]["resumed_at"]
    return {"stopped_s": round(gone_s, 2), "named": None, "processes": len(pids),
            "left_running": left, "restarted": True, "resumed_at": resumed,
            "newest_checkpoint_at_fault": newest,
            "lost_checkpointed_steps": max(0, newest - resumed),
            "note": "the launcher itself is the victim: nothing is left to report; "
                    "the children die with it (PR_SET_PDEATHSIG); --resume OUT finishes",
            **outcome(name, reference, out, ref, metrics)}


def _flags(options: dict[str, Any]) -> list[str]:
    """The CLI flags of a config's model or strategy options (``async_`` is ``--async``)."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.rstrip("_").replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def table(rows: list[dict[str, Any]]) -> str:
    """The docs' table: one line per strategy and fault, every miss shown as measured."""
    def yes(v: Any) -> str:
        return "n/a" if v is None else "yes" if v is True else "no" if v is False else str(v)

    lines = ["| strategy | fault | stopped (s) | named | left running | came back | resumed at "
             "| same weights | lost |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r.get("applies", True):
            lines.append(f"| {r['strategy']} | {r['fault']} | - | - | - | - | - | - | "
                         f"n/a: {r['note']} |")
            continue
        if "error" in r:
            lines.append(f"| {r['strategy']} | {r['fault']} | **failed**: {r['error'][:120]} "
                         f"| | | | | | |")
            continue
        same = yes(r.get("same_weights"))
        if r.get("same_weights") is None and "loss_fell" in r:
            same = f"n/a (async; loss fell: {yes(r['loss_fell'])})"
        elif r.get("same_weights") is False:
            same = f"**no** (max diff {r['max_abs_diff']:.3g})"
        stopped = "-" if r.get("stopped_s") is None else f"{r['stopped_s']:.2f}"
        lines.append(f"| {r['strategy']} | {r['fault']} | {stopped} | {yes(r.get('named'))} | "
                     f"{len(r.get('left_running', []))} | {yes(r.get('restarted'))} | "
                     f"{r.get('resumed_at', '-')} | {same} | "
                     f"{r.get('lost_checkpointed_steps', '-')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults.json"))
    p.add_argument("--table", action="store_true", help="print the saved results' table only")
    a = p.parse_args()
    torch.set_num_threads(1)
    path = Path(a.out)
    results = json.loads(path.read_text()) if path.exists() else {"rows": []}
    if a.table:
        order = {(s, f): i for i, (s, f) in enumerate((s, f) for s in STRATEGIES
                                                      for f in FAULTS)}
        print(table(sorted(results["rows"], key=lambda r: order.get((r["strategy"],
                                                                      r["fault"]), 99))))
        return
    rows = {(r["strategy"], r["fault"]): r for r in results["rows"]}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name in a.strategies.split(","):
            reference = tmp / f"{name}-reference"
            run_config(config_of(name, reference), env=ENV)
            for fault in a.faults.split(","):
                t0 = time.monotonic()
                try:
                    row = one(name, fault, reference, tmp)
                except Exception as e:  # noqa: BLE001 - a benchmark records every outcome
                    row = {"strategy": name, "fault": fault, "applies": True,
                           "error": f"{type(e).__name__}: {e}"}
                row["bench_s"] = round(time.monotonic() - t0, 1)
                rows[(name, fault)] = row
                print(json.dumps(row), flush=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                results = {"steps": STEPS, "checkpoint_every": EVERY,
                           "hang_timeout_s": HANG_TIMEOUT_S, "machine_cpus": os.cpu_count(),
                           "torch": torch.__version__, "rows": list(rows.values())}
                path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
