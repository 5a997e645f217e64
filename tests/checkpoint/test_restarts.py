"""``--max-restarts`` and the heartbeat: a dead or hung process stops the run, which comes back
from its newest checkpoint and ends with the uninterrupted run's weights."""

from __future__ import annotations

import random
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from polytrain import LaunchError, TrainConfig
from polytrain.train import run_config as run_job
from tests.faults import Injector, alive

TINY = {"seq_len": 16, "d_model": 32, "layers": 2}
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, servers", [
    ("ddp", 0), pytest.param("byteps", 1, marks=pytest.mark.long)])
def test_a_worker_killed_at_a_random_step_restarts_and_ends_with_the_uninterrupted_weights(
        strategy, servers):
    config = TrainConfig(strategy=strategy, workers=2, nodes=2, servers=servers, steps=8,
                         batch_size=8, model_options=TINY, quiet=True, timeout_s=30)
    rng = random.Random(strategy)
    at, delay = rng.choice([2, 4]), rng.uniform(0.0, 0.3)
    with tempfile.TemporaryDirectory() as tmp:
        plain = run_job(config.replace(out=f"{tmp}/plain"), env=ENV)
        out = Path(tmp) / "faulty"
        fault = Injector("worker", 1, trigger=out / "checkpoints" / f"step-{at}",
                         delay_s=delay).start()
        said: list[str] = []
        metrics = run_job(config.replace(out=str(out), checkpoint_every=2, max_restarts=2), env=ENV,
                          report=said.append)
        fault.join()
        assert fault.sent_at is not None, "the fault was never injected"
        assert len(said) == 1 and "worker rank 1 (machine node1) failed: killed by SIGKILL" \
            in said[0] and "restart 1 of 2 from checkpoint step-" in said[0], said
        resumed_at = int(said[0].rsplit("step-", 1)[1])
        assert resumed_at >= at
        assert metrics["restarts"] == 1
        # metrics.json says where the run started and where its restart resumed.
        assert metrics["checkpoints"]["resumed_from"] is None
        assert metrics["checkpoints"]["resumed_at"] == 0
        assert metrics["restarted_from"] == [str(out / "checkpoints" / f"step-{resumed_at}")]
        a = torch.load(Path(tmp) / "plain" / "final.pt")
        b = torch.load(out / "final.pt")
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert metrics["losses"] == plain["losses"]
        assert not any(alive(p) for p in fault.pids.values())


@pytest.mark.timeout(120)
def test_a_stopped_process_is_found_by_its_heartbeat_and_named():
    config = TrainConfig(strategy="ddp", workers=2, nodes=2, steps=100000, batch_size=8,
                         model_options=TINY, quiet=True, timeout_s=5)
    with tempfile.TemporaryDirectory() as tmp:
        hang = Injector("worker", 1, sig=signal.SIGSTOP, after_s=0.0,
                        trigger=None).start()
        # Stop it once it trains: after the first steps' metrics, i.e. a few seconds in.
        hang.after_s = 8.0
        start = time.monotonic()
        with pytest.raises(LaunchError, match=r"worker rank 1 \(machine node1\) failed: stopped "
                                              r"answering") as info:
            run_job(config.replace(out=tmp), env=ENV)
        hang.join()
        assert hang.sent_at is not None
        found = time.monotonic() - hang.sent_at
        assert found < 5, f"found after {found:.1f} s with --timeout 5"
        assert "process state T" in str(info.value) or "no heartbeat" in str(info.value)
        # It said its traceback was printed above: a stopped process prints none.
        assert "(kill -CONT)" in str(info.value.hint), info.value.hint
        assert info.value.rank == 1
        assert not any(alive(p) for p in hang.pids.values())
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_a_resumed_run_that_dies_before_its_first_checkpoint_restarts_from_its_resume_point(
        tmp_path, monkeypatch):
    # The restart took the newest checkpoint in --out, else step 0: a run resumed from
    # another directory went back to step 0 (or to an older run's checkpoint in its --out).
    from polytrain.train import run as run_module
    config = TrainConfig(strategy="ddp", workers=2, nodes=2, steps=4, batch_size=8,
                         model_options=TINY, quiet=True, timeout_s=30)
    first = tmp_path / "first"
    run_job(config.replace(out=str(first), checkpoint_every=2), env=ENV)
    out = tmp_path / "second"  # holds an older checkpoint: at step 2, before the resume point
    shutil.copytree(first / "checkpoints" / "step-2", out / "checkpoints" / "step-2")
    started: list[str | None] = []

    class DiesOnce:  # the launcher, whose first run loses a worker
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def run_fn(self, fn: object, args: tuple) -> list[dict]:
            started.append(args[0].resume)
            if len(started) == 1:
                raise LaunchError("worker rank 1 (machine node1) failed: killed by SIGKILL (9)",
                                  rank=1, exitcode=-9)
            return [{"losses": []}]

    monkeypatch.setattr(run_module, "Launcher", DiesOnce)
    said: list[str] = []
    metrics = run_job(config.replace(steps=8, out=str(out), resume=str(first),
                                     checkpoint_every=2, max_restarts=1), report=said.append)
    resumed = str(first / "checkpoints" / "step-4")
    assert started == [resumed, resumed] and metrics["restarts"] == 1
    assert metrics["restarted_from"] == [resumed]
    assert said == [f"polytrain: worker rank 1 (machine node1) failed: killed by SIGKILL (9); "
                    f"restart 1 of 1 from {resumed} (no checkpoint of its own yet)"]

    # A fine-tuning run (--init) that dies after its first checkpoint goes on from that
    # checkpoint, without --init (refused beside --resume, the restart raised instead).
    inits: list[str | None] = []

    class WritesThenDies(DiesOnce):
        def run_fn(self, fn: object, args: tuple) -> list[dict]:
            inits.append(args[0].init)
            if len(inits) == 1:  # this run's own checkpoint, then the death
                shutil.copytree(first / "checkpoints" / "step-2",
                                tmp_path / "tuned" / "checkpoints" / "step-2")
            return super().run_fn(fn, args)

    started.clear()
    monkeypatch.setattr(run_module, "Launcher", WritesThenDies)
    metrics = run_job(config.replace(steps=8, out=str(tmp_path / "tuned"), checkpoint_every=2,
                                     max_restarts=1, init=str(first / "final.pt")),
                      report=said.append)
    assert started == [None, str(tmp_path / "tuned" / "checkpoints" / "step-2")]
    assert inits == [str(first / "final.pt"), None] and metrics["restarts"] == 1
    assert metrics["init"] == str(first / "final.pt")  # what the run started from


@pytest.mark.timeout(120)
def test_results_that_cannot_be_written_stop_the_run_in_one_line_without_a_restart(tmp_path):
    # A raw OSError: a traceback, and --max-restarts trained again from the last checkpoint
    # to fail the same way.
    out = tmp_path / "out"
    (out / "final.pt").mkdir(parents=True)  # in the way of the file
    (out / "final.pt" / "keep").write_text("")
    config = TrainConfig(strategy="ddp", workers=2, steps=4, batch_size=8, model_options=TINY,
                         quiet=True, timeout_s=30)
    said: list[str] = []
    with pytest.raises(LaunchError) as e:
        run_job(config.replace(out=str(out), checkpoint_every=2, max_restarts=1), env=ENV,
                report=said.append)
    assert "ConfigError: cannot write the results to --out" in str(e.value), str(e.value)
    assert str(e.value).endswith("HINT: free space there, or pass another --out; the run's "
                                 "checkpoints, if any, hold it up to the last")
    assert said == []  # no restart


@pytest.mark.timeout(30)
def test_each_restart_tells_the_processes_its_count_as_torchrun_does(tmp_path, monkeypatch):
    # Symptom: every attempt's processes read TORCHELASTIC_RESTART_COUNT=0 and
    # TORCHELASTIC_MAX_RESTARTS=0, though the launcher sets torchrun's variables. Cause:
    # run_config built every attempt's Launcher with the same env.
    from polytrain.launch import launcher
    from polytrain.train import run as run_module
    envs: list[dict[str, str]] = []

    class DiesTwice:  # the launcher, whose first two runs lose a worker
        def __init__(self, *args: object, env: dict[str, str], **kwargs: object) -> None:
            envs.append(dict(env))

        def run_fn(self, fn: object, args: tuple) -> list[dict]:
            if len(envs) < 3:
                raise LaunchError("worker rank 1 (machine node1) failed: killed by SIGKILL (9)",
                                  rank=1, exitcode=-9)
            return [{"losses": []}]

    monkeypatch.setattr(run_module, "Launcher", DiesTwice)
    config = TrainConfig(strategy="ddp", workers=2, nodes=2, steps=4, batch_size=8,
                         model_options=TINY, quiet=True, out=str(tmp_path), checkpoint_every=2,
                         max_restarts=3)
    assert run_job(config, env=ENV, report=lambda said: None)["restarts"] == 2
    assert envs == [{**ENV, "TORCHELASTIC_RESTART_COUNT": str(count),
                     "TORCHELASTIC_MAX_RESTARTS": "3"} for count in range(3)]
    # ... which the launcher passes on as they are.
    run = launcher.Launcher(config.layout(), env=envs[1])
    spec = config.layout().processes()[0]
    seen = run._child_env(spec, launcher._files(tmp_path, spec.rank), None, None)
    assert (seen["TORCHELASTIC_RESTART_COUNT"], seen["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "3")
