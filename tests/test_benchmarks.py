"""Every benchmark script imports against the current library (a moved function broke one)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_the_benchmark_imports_and_has_a_main(path, monkeypatch):
    module = _load(path.stem, monkeypatch)  # the module's top level only: main() is guarded
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def _load(name, monkeypatch):
    path = next(p for p in BENCHMARKS if p.stem == name)
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_onebit_replay_runs_take_their_defaults_by_position(monkeypatch):
    # A run of three parts got variance "none" (the padding came from the front), and one
    # of two parts crashed on int("none").
    parse = _load("onebit_adam_replay", monkeypatch).parse_run
    assert parse("none") == ("none", "none", "0", "sums")
    assert parse("onebit/dithering:4") == ("onebit", "dithering:4", "0", "sums")
    assert parse("onebit:1024/dithering:4/30") == ("onebit:1024", "dithering:4", "30", "sums")
    assert parse("onebit/none/1/refresh4") == ("onebit", "none", "1", "refresh4")


@pytest.mark.timeout(180)
def test_the_pipetransformer_benchmark_runs_its_quick_settings(monkeypatch, tmp_path):
    # --quick was refused before any run: its base config (12 steps) kept the default freeze
    # points, one epoch of 108 steps ("no layer would freeze"), though no run uses it as is.
    out = tmp_path / "quick.json"
    pytest.importorskip("matplotlib")  # (the plot: ./dev installs it, .[test] does not)
    main = _load("pipetransformer", monkeypatch).main
    assert main(["--quick", "--only", "no freeze", "--out", str(out)]) == 0
    import json
    said = json.loads(out.read_text())
    assert said["summary"]["no freeze"]["speedup_rounds"] == [1.0]
    assert (tmp_path / "quick.png").exists()


def test_each_fault_injection_signals_its_process_at_its_trigger(monkeypatch, tmp_path):
    # The fault kinds of benchmarks/faults.py: a fault that signalled another process, or at
    # another moment, than its name says would be measured and tabled as that fault.
    import signal

    from tests.faults import SPIN
    faults = _load("faults", monkeypatch)
    checkpoints = tmp_path / "checkpoints"
    want = {"kill-worker": ("worker", 1, signal.SIGKILL, checkpoints / "step-20"),
            "kill-worker0": ("worker", 0, signal.SIGKILL, checkpoints / "step-20"),
            "kill-server": ("server", -1, signal.SIGKILL, checkpoints / "step-20"),
            "sigstop": ("worker", 1, signal.SIGSTOP, checkpoints / "step-20"),
            "raise": ("worker", 1, signal.SIGUSR1, checkpoints / "step-20"),
            # the save's temporary name, before its rename (checkpoint/manifest.py)
            "kill-in-save": ("worker", 0, signal.SIGKILL, checkpoints / ".step-20.tmp"),
            "kill-setup": ("worker", 1, signal.SIGKILL, None),  # as soon as it is listed
            "busy-hang": ("worker", 1, SPIN, checkpoints / "step-20")}
    assert set(faults.INJECTIONS) == set(want)
    assert set(faults.FAULTS) == set(want) | {"kill-launcher", "truncated"}
    for fault, (role, rank, sig, trigger) in want.items():
        inj = faults.injector(fault, tmp_path)
        assert (inj.role, inj.rank, inj.sig, inj.trigger) == (role, rank, sig, trigger), fault
    assert faults.injector("kill-setup", tmp_path).folder == checkpoints
    assert faults.injector("kill-in-save", tmp_path).poll_s <= 0.005  # the save lives ms
    # SIGUSR1 makes a child raise, SIGUSR2 asks it for its stacks: neither is a spin.
    assert SPIN not in (signal.SIGUSR1, signal.SIGUSR2)
    assert faults.INJECTIONS["busy-hang"].spin and faults.INJECTIONS["busy-hang"].hang


@pytest.mark.timeout(60)
def test_a_process_started_with_the_spin_environment_spins_on_its_signal(tmp_path):
    # busy-hang's spin comes from a sitecustomize on PYTHONPATH (no hook in polytrain): one
    # that is not imported leaves the signal's default, and the process dies instead.
    import os
    import subprocess
    import time

    from tests.faults import SPIN, spin_env
    code = ("import sys, time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.01)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **spin_env(tmp_path / "site", seconds=30)})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        cpu = _cpu_ticks(proc.pid)
        proc.send_signal(SPIN)
        time.sleep(1.0)
        assert proc.poll() is None, f"it ended ({proc.returncode}) on the spin signal"
        assert _cpu_ticks(proc.pid) - cpu >= 20, "it did not spin (under 0.2 s of CPU in 1 s)"
    finally:
        proc.kill()
        proc.wait()


def _cpu_ticks(pid):
    return sum(int(x) for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]
               .split()[11:13])


def test_the_fault_table_shows_what_was_left_behind_and_every_miss(monkeypatch):
    # The table's "left behind" and "misses" columns: a row that left a run's files or
    # processes, lost checkpointed steps or hung past --timeout must say so, and only the
    # leftovers of this benchmark's own runs count (other jobs share /tmp and /dev/shm).
    faults = _load("faults", monkeypatch)
    me, other = os.getpid(), 999999
    before = {"shm": [], "netns": [], "tmp": [f"polytrain-{me}-1-old"]}
    monkeypatch.setattr(faults, "leftovers_now", lambda: {
        "shm": [f"polytrain-run-{me}-5-ab", f"polytrain-run-{other}-5-cd"], "netns": [],
        "tmp": [f"polytrain-{me}-1-old", f"polytrain-{other}-2-x", "polytrain-cpu.lock"]})
    left = faults.leftovers(before, {me})
    assert left == {"shm": [f"polytrain-run-{me}-5-ab"], "netns": [], "tmp": []}
    clean = {"strategy": "ddp", "fault": "kill-worker0", "applies": True, "stopped_s": 0.04,
             "named": True, "left_running": [], "restarted": True, "resumed_at": 20,
             "same_weights": True, "lost_checkpointed_steps": 0,
             "leftovers": {"shm": [], "netns": [], "tmp": []}}
    bad = {**clean, "fault": "busy-hang", "stopped_s": 12.5, "timeout_s": 10.0,
           "left_running": [123], "leftovers": left, "lost_checkpointed_steps": 10,
           "named": False}
    old = {k: v for k, v in clean.items() if k != "leftovers"}  # saved before the check
    failed = {"strategy": "ddp", "fault": "kill-setup", "applies": True, "named": None,
              "left_running": [], "error": "LaunchError: worker rank 0 | failed"}
    lines = faults.table([clean, bad, old, failed]).splitlines()
    assert len({line.count("|") for line in lines}) == 1, lines  # every row, every column
    assert "left behind (shm/netns/tmp)" in lines[0] and "misses" in lines[0]
    assert lines[2].endswith("| 0/0/0 | yes | 20 | yes | 0 | none |"), lines[2]
    for miss in ("not named", "1 left running", "stopped 2.50 s past --timeout 10",
                 "lost 10 checkpointed steps", "left 1 shm"):
        assert f"**{miss}**" in lines[3], (miss, lines[3])
    assert "| - | yes |" in lines[4] and lines[4].endswith("| none |"), lines[4]
    assert "**stopped with an error, no restart**" in lines[5], lines[5]


def test_a_fault_row_that_did_not_test_its_fault_is_a_miss(monkeypatch):
    # Rows that read as passes though their fault never happened as named: a busy hang whose
    # victim died of the signal (no spin handler) and was reported at once; a save "cut
    # short" whose restart came back from that very step; a setup kill that came after a
    # checkpoint. And a /dev/shm entry of another kind (no "-run-") crashed the leftovers.
    faults = _load("faults", monkeypatch)
    base = {"strategy": "ddp", "applies": True, "named": True, "left_running": [],
            "restarted": True, "same_weights": True, "lost_checkpointed_steps": 0}
    died = {**base, "fault": "busy-hang", "timeout_s": 10.0, "stopped_s": 0.05,
            "report": "worker rank 1 (machine node0) failed: killed by signal 36"}
    assert any("no hang" in m for m in faults.misses(died))
    spun = {**died, "stopped_s": 10.3, "report": "worker rank 1 stopped making progress"}
    assert not any("no hang" in m for m in faults.misses(spun))
    late = {**base, "fault": "kill-in-save", "save_cut_short": True, "resumed_at": 20}
    assert any("resumed at 20" in m for m in faults.misses(late))
    assert faults.misses({**late, "resumed_at": 10}) == []
    setup = {**base, "fault": "kill-setup", "fired_after_s": 2.0, "resumed_at": 10,
             "checkpoints_at_fault": ["step-10"]}
    assert any("not at setup" in m for m in faults.misses(setup))
    assert faults.misses({**setup, "resumed_at": 0, "checkpoints_at_fault": []}) == []
    monkeypatch.setattr(faults, "leftovers_now", lambda: {
        "shm": ["polytrain-cache-abc"], "netns": [], "tmp": []})
    assert faults.leftovers({"shm": [], "netns": [], "tmp": []}, {os.getpid()})["shm"] == []


def test_an_injector_that_never_fired_does_not_fire_after_join(tmp_path):
    # One with no trigger (kill-setup's) watches this process's runs: left looking after its
    # run ended, it would have killed worker 1 of the benchmark's next run.
    from tests.faults import Injector
    inj = Injector("worker", 1, trigger=tmp_path / "never", poll_s=0.01).start()
    inj.join()
    (tmp_path / "never").mkdir()
    assert inj._thread is not None and not inj._thread.is_alive() and inj.sent_at is None
