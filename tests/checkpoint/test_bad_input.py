"""Bad input around checkpoints: one line each, before (or instead of) training."""

from __future__ import annotations

import json

import pytest

from polytrain.cli import main

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


@pytest.mark.parametrize("strategy", ["pipetransformer"])
def test_strategies_whose_state_a_checkpoint_lacks_refuse_it(capsys, tmp_path, strategy):
    # Its own state (freeze timeline and plans) is not saved yet: a resume would be
    # another run, so they say so instead of saving half of it.
    line = error_of(capsys, "--strategy", strategy, "--workers", "4", "--nodes", "2",
                    "--checkpoint-every", "2", "--out", str(tmp_path), *TINY)
    assert f"strategy {strategy!r} cannot save or resume checkpoints yet" in line
