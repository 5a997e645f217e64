"""Fault injection: every strategy against every fault; how the run stopped and came back.

For each strategy and fault it records: seconds from the fault until the run
stopped (the launcher's report), whether the report named the process (role,
rank, machine) and the cause, whether any process of the run was left
running, and, with ``--max-restarts 1``, whether the run came back and ended
with the uninterrupted run's weights (``final.pt`` bit for bit; asynchronous
BytePS: the loss fell instead), and how many trained steps were lost beyond
the last checkpoint (must be none: a restart redoes only steps after it).

After every row it also looks for what the run left behind besides processes: its
shared-memory folders (``/dev/shm/polytrain-run-PID-*``), network namespaces (``ip netns
list``, claimed by this process) and work directories (``/tmp/polytrain-PID-*``), new since
the row began and of this process or the launcher it started (``leftovers``).

Faults (``--faults``): worker 1 killed (``kill-worker``), worker 0 killed (``kill-worker0``:
the rendezvous host, the process that writes checkpoints), the last server killed, worker 1
stopped (``sigstop``), raising (``raise``, SIGUSR1) or spinning in a Python busy loop
(``busy-hang``: its heartbeat thread runs on; SIGRTMIN+2 through ``tests/faults.py``'s
``spin_env``, a ``sitecustomize`` of the benchmark's, no hook in polytrain), all shortly after
step 20 is saved; worker 1 killed as soon as it exists (``kill-setup``: before any
checkpoint or step); worker 0 killed while it writes step 20 (``kill-in-save``: once the
save's temporary directory appears, before its rename; the restart must come back from step
10); the launcher killed; the newest checkpoint cut short on disk (``truncated``).

    ./dev bench faults                                # everything (about 25 minutes here)
    ./dev bench faults --strategies ddp,moe --faults kill-worker,sigstop
    ./dev bench faults --strategies herring,parallax --faults kill-worker,kill-server
    ./dev bench faults --strategies ddp --faults kill-worker0,kill-setup,kill-in-save,busy-hang

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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tests.faults import SPIN, Injector, alive, children, spin_env  # noqa: E402

from polytrain import LaunchError, TrainConfig  # noqa: E402
from polytrain.checkpoint.manifest import temporary_dir  # noqa: E402
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


@dataclass(frozen=True)
class Injection:
    """A fault made by signalling one process of a running run (``--max-restarts 1``)."""

    role: str
    rank: int  # -1: the role's highest rank (the last server)
    sig: int
    # When: "checkpoint", shortly after step FAULT_AT is saved; "saving", as soon as step
    # FAULT_AT's temporary directory appears (the save under way, before its rename);
    # "start", as soon as the process is listed (before any step or checkpoint).
    trigger: str
    hang: bool = False  # found as a hang: the run gets --timeout HANG_TIMEOUT_S
    spin: bool = False  # the run's processes start with spin_env() (SPIN makes them spin)


FAULT_AT = 2 * EVERY  # between the second and third checkpoints
INJECTIONS: dict[str, Injection] = {
    "kill-worker": Injection("worker", 1, signal.SIGKILL, "checkpoint"),
    "kill-server": Injection("server", -1, signal.SIGKILL, "checkpoint"),
    "sigstop": Injection("worker", 1, signal.SIGSTOP, "checkpoint", hang=True),
    "raise": Injection("worker", 1, signal.SIGUSR1, "checkpoint"),
    "kill-worker0": Injection("worker", 0, signal.SIGKILL, "checkpoint"),
    "kill-setup": Injection("worker", 1, signal.SIGKILL, "start"),
    "kill-in-save": Injection("worker", 0, signal.SIGKILL, "saving"),
    "busy-hang": Injection("worker", 1, SPIN, "checkpoint", hang=True, spin=True),
}
FAULTS = ["kill-worker", "kill-server", "sigstop", "raise", "kill-launcher", "truncated",
          "kill-worker0", "kill-setup", "kill-in-save", "busy-hang"]
# After the fault, the longest wait for the launcher's report before the benchmark interrupts
# the run (SIGINT to itself) and records a miss; and for the whole run.
REPORT_LIMIT_S, RUN_LIMIT_S = 150.0, 900.0
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


def injector(fault: str, out: Path) -> Injector:
    """The (not yet started) Injector of ``fault`` for the run writing to ``out``."""
    kind = INJECTIONS[fault]
    checkpoints = out / "checkpoints"
    if kind.trigger == "checkpoint":
        return Injector(kind.role, kind.rank, sig=kind.sig,
                        trigger=checkpoints / f"step-{FAULT_AT}", delay_s=0.05)
    if kind.trigger == "saving":  # the save's own temporary name (checkpoint/manifest.py)
        return Injector(kind.role, kind.rank, sig=kind.sig,
                        trigger=temporary_dir(checkpoints, FAULT_AT), poll_s=0.001)
    if kind.trigger == "start":
        return Injector(kind.role, kind.rank, sig=kind.sig, trigger=None, poll_s=0.005,
                        folder=checkpoints)
    raise ValueError(f"unknown trigger {kind.trigger!r} of fault {fault!r}")


def _watch(inj: Injector, heard: list[tuple[float, str]], done: threading.Event,
           why: list[str]) -> None:
    """Interrupt this process's run (SIGINT, as Ctrl-C) where no report came within
    REPORT_LIMIT_S of the fault or the run took RUN_LIMIT_S: a miss measured, not a hang of
    the benchmark."""
    began = time.monotonic()
    while not done.wait(0.5):
        now = time.monotonic()
        if inj.sent_at is not None and not heard and now - inj.sent_at > REPORT_LIMIT_S:
            why.append(f"no report {REPORT_LIMIT_S:.0f} s after the fault: interrupted")
        elif now - began > RUN_LIMIT_S:
            why.append(f"the run took over {RUN_LIMIT_S:.0f} s: interrupted")
        else:
            continue
        os.kill(os.getpid(), signal.SIGINT)
        return


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
    kind = INJECTIONS[fault]
    timeout = HANG_TIMEOUT_S if kind.hang else 30.0
    env = {**ENV, **spin_env(tmp / "spin")} if kind.spin else ENV
    started = time.monotonic()
    inj = injector(fault, out).start()
    heard: list[tuple[float, str]] = []
    done, why = threading.Event(), list[str]()
    threading.Thread(target=_watch, args=(inj, heard, done, why), daemon=True).start()
    metrics: dict[str, Any] | None = None
    error: str | None = None
    try:
        metrics = run_config(config_of(name, out, timeout_s=timeout, max_restarts=1), env=env,
                             report=lambda line: heard.append((time.monotonic(), line)))
    except (LaunchError, KeyboardInterrupt) as e:
        error = "; ".join(why + [f"{type(e).__name__}: {e}"])
    finally:
        done.set()
    inj.join()
    row["wall_s"] = round(time.monotonic() - started, 1)
    if inj.sent_at is None:
        return {**row, "restarted": False,
                "error": error or "the fault was not injected before the run ended"}
    row["left_running"] = sorted(p for p in inj.pids.values() if alive(p))
    for pid in row["left_running"]:  # measured above; this run's, not to spin on for minutes
        os.kill(pid, signal.SIGKILL)
    if kind.trigger == "saving":  # cut short: its temporary directory there and no step-S
        row["save_cut_short"] = (temporary_dir(out, FAULT_AT).name in inj.listing
                                 and f"step-{FAULT_AT}" not in inj.listing)
        row["save_files_at_fault"] = inj.trigger_listing
    if kind.trigger == "start":  # before any checkpoint: seconds into the run, what was saved
        row["fired_after_s"] = round(inj.sent_at - started, 2)
        row["checkpoints_at_fault"] = [n for n in inj.listing if n.startswith("step-")]
    if not heard:  # the run stopped without a restart (its error) or never stopped
        return {**row, "restarted": False, "named": None,
                "error": error or "the run ended without a report of the fault"}
    when, line = heard[0]
    row.update({
        "stopped_s": round(when - inj.sent_at, 2),
        "timeout_s": timeout,
        "report": line,
        "named": f"{kind.role} rank {inj.rank} (machine {inj.machine}" in line,
        "resumed_at": int(line.rsplit("step-", 1)[1]) if "step-" in line else 0,
        "losses_equal": None,
    })
    # Checkpointed work lost: the newest checkpoint on disk at the fault, minus where the
    # restart resumed (0: nothing that was checkpointed was lost).
    row["newest_checkpoint_at_fault"] = inj.newest_step
    row["lost_checkpointed_steps"] = max(0, inj.newest_step - row["resumed_at"])
    if metrics is None:  # reported, and then the restart failed too
        return {**row, "restarted": False, "error": error}
    row["restarted"] = metrics.get("restarts") == 1
    row["temporary_left"] = sorted(p.name for p in (out / "checkpoints").glob(".step-*"))
    ref = json.loads((reference / "metrics.json").read_text())
    row.update(outcome(name, reference, out, ref, metrics))
    return row


def leftovers_now() -> dict[str, list[str]]:
    """polytrain's shared-memory folders, network namespaces and work directories now."""
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        listed = []
    return {"shm": sorted(p.name for p in Path("/dev/shm").glob("polytrain-*")),
            "netns": sorted(line.split()[0] for line in listed if line.startswith("pt-")),
            "tmp": sorted(p.name for p in Path(tempfile.gettempdir()).glob("polytrain-*"))}


def leftovers(before: dict[str, list[str]], owners: set[int]) -> dict[str, list[str]]:
    """What of :func:`leftovers_now` is new since ``before`` and made by a launcher in
    ``owners`` (its pid in the name; a namespace: in its run's claim): other jobs' runs on
    this machine are left out."""
    after = leftovers_now()

    def mine(kind: str, name: str) -> bool:
        if kind == "netns":
            claim = Path("/run/polytrain/netns") / f"{name[3:].split('-')[0]}.json"
            try:
                return int(json.loads(claim.read_text())["pid"]) in owners
            except (OSError, ValueError, KeyError, TypeError):
                return False
        rest = name.partition("-run-")[2] if kind == "shm" else name.partition("-")[2]
        return rest.split("-", 1)[0] in {str(p) for p in owners}  # "": none of ours

    return {k: [n for n in after[k] if n not in before[k] and mine(k, n)] for k in after}


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
            "launcher_pid": launcher.pid,
            "left_running": left, "restarted": True, "resumed_at": resumed,
            "newest_checkpoint_at_fault": newest,
            "lost_checkpointed_steps": max(0, newest - resumed),
            "note": "the launcher itself is the victim: nothing is left to report; "
                    "the children die with it (PR_SET_PDEATHSIG); --resume OUT finishes",
            **outcome(name, reference, out, ref, metrics)}


def _flags(options: Mapping[str, Any]) -> list[str]:
    """The CLI flags of a config's model or strategy options (``async_`` is ``--async``)."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.rstrip("_").replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def misses(r: dict[str, Any]) -> list[str]:
    """What of row ``r`` missed the contract: the fault not stopped (within --timeout for a
    hang), not named, a process or file left behind, no restart, checkpointed steps lost,
    other weights; as measured (a row saved before a check existed is not held to it)."""
    out: list[str] = []
    if "error" in r:
        out.append("stopped with an error, no restart")
    if r.get("named") is False:
        out.append("not named")
    if r.get("left_running"):
        out.append(f"{len(r['left_running'])} left running")
    hang_limit = r.get("timeout_s")
    hang = r["fault"] in INJECTIONS and INJECTIONS[r["fault"]].hang
    if hang and hang_limit is not None and r.get("stopped_s") is not None \
            and r["stopped_s"] > hang_limit:
        out.append(f"stopped {r['stopped_s'] - hang_limit:.2f} s past --timeout {hang_limit:g}")
    # A hang that was no hang: the victim died of the signal (a spinner without its handler)
    # and was reported at once, which reads as a kill well handled.
    if hang and hang_limit is not None and (
            "killed by" in r.get("report", "") or
            (r.get("stopped_s") is not None and r["stopped_s"] < hang_limit / 2 - 1)):
        out.append("no hang: the victim died of the signal or was reported before a hang "
                   "could be found")
    if r.get("save_cut_short") is False:
        out.append("the kill came after the save was whole (not cut short)")
    elif r.get("save_cut_short") and r.get("resumed_at") not in (None, FAULT_AT - EVERY):
        out.append(f"resumed at {r['resumed_at']}, not at {FAULT_AT - EVERY} (the save cut "
                   f"short must not count)")
    if r.get("checkpoints_at_fault") or (r.get("fired_after_s") is not None
                                         and r.get("resumed_at")):
        out.append("not at setup: a checkpoint was there at the fault, or the run resumed "
                   "from one")
    if r.get("lost_checkpointed_steps"):
        out.append(f"lost {r['lost_checkpointed_steps']} checkpointed steps")
    if r.get("same_weights") is False:
        out.append("other weights")
    if r.get("loss_fell") is False:
        out.append("the loss did not fall")
    if r.get("restarted") is False and "error" not in r:
        out.append("did not come back")
    if r.get("temporary_left"):
        out.append(f"left {', '.join(r['temporary_left'])}")
    for kind, names in (r.get("leftovers") or {}).items():
        if names:
            out.append(f"left {len(names)} {kind}")
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The docs' table: one line per strategy and fault, every miss shown as measured.
    "left behind": new shared-memory folders / network namespaces / work directories of the
    run after it ("-": a row measured before they were looked for)."""
    def yes(v: Any) -> str:
        return "n/a" if v is None else "yes" if v is True else "no" if v is False else str(v)

    lines = ["| strategy | fault | stopped (s) | named | left running | left behind (shm/netns/"
             "tmp) | came back | resumed at | same weights | lost | misses |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r.get("applies", True):
            lines.append(f"| {r['strategy']} | {r['fault']} | - | - | - | - | - | - | - | - | "
                         f"n/a: {r['note']} |")
            continue
        left = r.get("leftovers")
        behind = "-" if left is None else "/".join(str(len(left.get(k, [])))
                                                  for k in ("shm", "netns", "tmp"))
        stopped = "-" if r.get("stopped_s") is None else f"{r['stopped_s']:.2f}"
        running = "-" if "left_running" not in r else str(len(r["left_running"]))
        missed = "; ".join(f"**{m}**" for m in misses(r)) or "none"
        if "error" in r:
            error = r["error"].replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {r['strategy']} | {r['fault']} | {stopped} | "
                         f"{yes(r.get('named'))} | {running} | {behind} | **no**: {error} | "
                         f"- | - | - | {missed} |")
            continue
        same = yes(r.get("same_weights"))
        if r.get("same_weights") is None and "loss_fell" in r:
            same = f"n/a (async; loss fell: {yes(r['loss_fell'])})"
        elif r.get("same_weights") is False:
            same = f"**no** (max diff {r['max_abs_diff']:.3g})"
        lines.append(f"| {r['strategy']} | {r['fault']} | {stopped} | {yes(r.get('named'))} | "
                     f"{running} | {behind} | {yes(r.get('restarted'))} | "
                     f"{r.get('resumed_at', '-')} | {same} | "
                     f"{r.get('lost_checkpointed_steps', '-')} | {missed} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults.json"))
    p.add_argument("--table", action="store_true", help="print the saved results' table only")
    a = p.parse_args()
    unknown = [f for f in a.faults.split(",") if f not in FAULTS] + \
        [s for s in a.strategies.split(",") if s not in STRATEGIES]
    if unknown:
        p.error(f"unknown {', '.join(unknown)}: the faults are {', '.join(FAULTS)}; the "
                f"strategies {', '.join(STRATEGIES)}")
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
            for fault in dict.fromkeys(a.faults.split(",")):  # once each: one --out a row
                t0 = time.monotonic()
                before = leftovers_now()
                try:
                    row = one(name, fault, reference, tmp)
                except Exception as e:  # noqa: BLE001 - a benchmark records every outcome
                    row = {"strategy": name, "fault": fault, "applies": True,
                           "error": f"{type(e).__name__}: {e}"}
                if row.get("applies", True):
                    row["leftovers"] = leftovers(before, {os.getpid(),
                                                          row.get("launcher_pid", 0)})
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
