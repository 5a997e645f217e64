"""Bad input around checkpoints: one line each, before (or instead of) training."""

from __future__ import annotations

import json

import pytest

from polytrain import ConfigError
from polytrain.cli import main
from polytrain.launch.layout import Layout
from polytrain.strategies.base import Strategy, get_strategy, make_options

TINY = ["--steps", "4", "--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--quiet",
        "--timeout", "30"]


def error_of(capsys, *args: str) -> str:
    code = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1, err
    return err[0]


def test_checkpoint_every_zero(capsys, tmp_path):
    line = error_of(capsys, "--checkpoint-every", "0", "--out", str(tmp_path), *TINY)
    assert "--checkpoint-every must be at least 1 step (got 0). HINT: pass --checkpoint-every" \
        in line


def test_checkpoint_every_past_the_last_step(capsys, tmp_path):
    # It ran and wrote no checkpoint, saying nothing.
    line = error_of(capsys, "--checkpoint-every", "100", "--out", str(tmp_path), *TINY)
    assert "--checkpoint-every 100 is past --steps 4: no checkpoint would be written" in line


def test_checkpoint_every_needs_out(capsys):
    assert "no --out is given" in error_of(capsys, "--checkpoint-every", "2", *TINY)


def test_max_restarts_needs_checkpoints(capsys, tmp_path):
    line = error_of(capsys, "--max-restarts", "2", "--out", str(tmp_path), *TINY)
    assert "restarts from the newest checkpoint, and no --checkpoint-every" in line


def test_resume_from_a_directory_without_checkpoints(capsys, tmp_path):
    line = error_of(capsys, "--strategy", "single", "--resume", str(tmp_path), *TINY)
    assert f"--resume {tmp_path}: no whole checkpoint in {tmp_path}" in line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "--strategy", "single", "--out", str(out), "--checkpoint-every", "2",
                 *TINY]) == 0
    return out


@pytest.mark.timeout(120)
def test_resume_of_another_strategy_model_or_optimizer_is_refused(capsys, saved):
    capsys.readouterr()
    line = error_of(capsys, "--strategy", "ddp", "--resume", str(saved), *TINY)
    assert "was written by strategy 'single', and this run is 'ddp'. HINT: resume with " \
           "--strategy single" in line
    wide = [("64" if a == "32" else a) for a in TINY]  # --d-model 64
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), *wide)
    assert "is of another model" in line and "'d_model': 32" in line
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), "--optimizer",
                    "sgd", *TINY)
    assert "was written with --optimizer adam, and this run has sgd" in line


@pytest.mark.timeout(120)
def test_a_truncated_checkpoint_named_by_resume_is_refused(capsys, saved, tmp_path):
    import shutil
    copy = tmp_path / "step-4"
    shutil.copytree(saved / "checkpoints" / "step-4", copy)
    with open(copy / "model.pt", "r+b") as f:
        f.truncate(100)
    line = error_of(capsys, "--strategy", "single", "--resume", str(copy), *TINY)
    assert "is damaged: model.pt has 100 bytes" in line and "(truncated?)" in line


@pytest.mark.timeout(120)
def test_an_unwritable_checkpoint_directory_stops_or_trains_on(capsys, caplog, tmp_path):
    # A path that cannot hold directories (root writes into read-only ones, so a file
    # stands where the checkpoints folder should be).
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    line = error_of(capsys, "--strategy", "single", "--out", str(out), "--checkpoint-every", "2",
                    "--on-save-error", "stop", *TINY)
    assert f"could not save checkpoint step-2 in {out}/checkpoints: " in line
    assert "HINT: free space or make the directory writable" in line
    assert main(["train", "--strategy", "single", "--out", str(out), "--checkpoint-every", "2",
                 *TINY]) == 0
    assert "could not save checkpoint step-2" in caplog.text and "training on" in caplog.text
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["checkpoints"]["save_errors"]) == 2  # steps 2 and 4
    assert (out / "checkpoints").read_text() == "not a directory"


@pytest.mark.timeout(30)
def test_a_strategy_whose_state_a_checkpoint_lacks_refuses_it():
    # No strategy has such a gap today; one that declares it is refused in one line.
    class Gappy(Strategy):
        name = "gappy"
        checkpoint_gap = "its clocks are not saved"
    with pytest.raises(ConfigError, match=r"strategy 'gappy' cannot save or resume "
                                          r"checkpoints yet: its clocks are not saved"):
        Gappy.check_checkpoints()


@pytest.mark.timeout(30)
def test_pipetransformer_refuses_a_checkpoint_of_other_machines_or_planning_options():
    cls = get_strategy("pipetransformer")
    saved = {"workers": 4, "nodes": 2, "strategy_options": {"freeze_every": 2}}
    same = make_options(cls, {"freeze_every": 2, "cache_mb": 64.0})  # the cache may move
    cls.check_resume(saved, Layout(workers=4, nodes=2), same)
    with pytest.raises(ConfigError, match=r"cannot resume a checkpoint of 2 machines on 1.*"
                                          r"HINT: resume with --nodes 2"):
        cls.check_resume(saved, Layout(workers=4, nodes=1), same)
    with pytest.raises(ConfigError, match=r"only with the options that made them "
                                          r"\(--freeze-every 2 there, 4 here\)"):
        cls.check_resume(saved, Layout(workers=4, nodes=2),
                         make_options(cls, {"freeze_every": 4}))
    with pytest.raises(ConfigError, match=r"cannot resume a checkpoint of 4 workers on 8"):
        cls.check_resume(saved, Layout(workers=8, nodes=2), same)
