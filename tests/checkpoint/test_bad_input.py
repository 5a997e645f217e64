"""Bad input around checkpoints: one line each, before (or instead of) training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polytrain import ConfigError
from polytrain.cli import main
from polytrain.launch.layout import Layout
from polytrain.strategies.base import Strategy, get_strategy, make_options

TINY = ["--steps", "4", "--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--quiet"]
LONGER = [("6" if a == "4" and i and TINY[i - 1] == "--steps" else a)
          for i, a in enumerate(TINY)]  # TINY's run with --steps 6: it trains on past step-4


def copied(saved: Path, tmp_path: Path) -> Path:
    """A copy of the ``saved`` run's --out, to resume in without changing it."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run


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


def test_max_restarts_of_a_one_process_run_is_refused(capsys, tmp_path):
    # It was accepted and did nothing: single trains in the calling process, and a failure
    # ended the run with no restart.
    line = error_of(capsys, "--strategy", "single", "--max-restarts", "2", "--checkpoint-every",
                    "2", "--out", str(tmp_path), *TINY)
    assert "--max-restarts 2 starts a run's processes again when one dies, and --strategy " \
           "single trains in this one process, with none to restart" in line
    assert f"HINT: leave out --max-restarts (and, after a failure, go on with --resume " \
           f"{tmp_path})" in line


def test_on_save_error_stop_needs_checkpoints(capsys, tmp_path):
    # It was accepted and did nothing: no checkpoint was ever written to fail.
    line = error_of(capsys, "--on-save-error", "stop", "--out", str(tmp_path), *TINY)
    assert "--on-save-error stop says what a checkpoint that cannot be written does, and no " \
        "--checkpoint-every is given" in line


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
    assert "is of another model: its options differ from this run's in d_model (32 there, " \
           "64 here)" in line
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
@pytest.mark.parametrize("edit, said", [
    (lambda m: m.pop("workers"), "its manifest.json has no workers"),  # was KeyError
    (lambda m: m.update(workers="x"), "manifest.json is not a save's (its workers is 'x')"),
    (lambda m: m.update(model_options="x"),  # was TypeError: 'str' object is not a mapping
     "manifest.json is not a save's (its model_options is 'x')"),
    (lambda m: m.update(steps="x"), "manifest.json is not a save's (its steps is 'x')"),
])
def test_a_resume_of_an_edited_manifest_is_refused_as_damaged(capsys, saved, tmp_path, edit,
                                                              said):
    # A manifest whose fields are of the wrong kind gave a traceback (ValueError for workers
    # "x"), or was taken as it was (steps "x", strategy_options null).
    import shutil
    copy = tmp_path / "step-2"
    shutil.copytree(saved / "checkpoints" / "step-2", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    line = error_of(capsys, "--strategy", "single", "--resume", str(copy), "--out",
                    str(tmp_path / "out"), *TINY)
    assert f"checkpoint {copy} is damaged: {said}. HINT: resume from another checkpoint" \
        in line, line


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


def test_hetpipe_refuses_a_checkpoint_of_another_policy_or_machines():
    # Every worker started and failed deep in its first step ("the stages differ"), and
    # --max-restarts ran it again.
    cls = get_strategy("hetpipe")
    saved = {"workers": 4, "nodes": 2, "strategy_options": {}}  # the default policy, hd
    cls.check_resume(saved, Layout(workers=4, nodes=2), make_options(cls, {"policy": "hd"}))
    with pytest.raises(ConfigError, match=r"cannot resume a checkpoint of --policy hd on 2 "
                                          r"machines as --policy np on 2.*HINT: resume with "
                                          r"--policy hd --nodes 2"):
        cls.check_resume(saved, Layout(workers=4, nodes=2), make_options(cls, {"policy": "np"}))
    with pytest.raises(ConfigError, match=r"as --policy hd on 1"):
        cls.check_resume(saved, Layout(workers=4, nodes=1), make_options(cls, {}))
    # The optimizer's state is the servers' with the servers' optimizer and the stages'
    # without: switching started it afresh, silently (a review found it).
    with pytest.raises(ConfigError, match=r"resumes a checkpoint's optimizer state only with "
                                          r"the options that made them \(--server-optimizer "
                                          r"True there, False here\)"):
        cls.check_resume(saved, Layout(workers=4, nodes=2),
                         make_options(cls, {"server_optimizer": False}))


@pytest.mark.timeout(120)
def test_checkpoints_of_another_run_in_out_are_not_mixed_with_this_runs(capsys, saved, tmp_path):
    # A fresh run into an --out that held another run's step-2 and step-4 wrote its own beside
    # them, and a --max-restarts restart (or a later --resume OUT) took the other run's newest.
    line = error_of(capsys, "--strategy", "single", "--out", str(saved), "--checkpoint-every",
                    "2", *TINY)
    assert f"--out {saved} already holds an earlier run's checkpoints (2 checkpoints up to " \
           f"step-4)" in line and f"HINT: continue that run with --resume {saved}" in line
    # Going back to step-2 in the same --out: step-4 is past it, and not this run's.
    line = error_of(capsys, "--strategy", "single", "--resume",
                    str(saved / "checkpoints" / "step-2"), "--out", str(saved),
                    "--checkpoint-every", "2", *TINY)
    assert "holds checkpoints past step 2, the one this run resumes (1 checkpoint up to " \
           "step-4)" in line
    # Without checkpoints of its own, a fresh run may still write into that --out.
    assert main(["train", "--strategy", "single", "--out", str(tmp_path), "--checkpoint-every",
                 "2", *TINY]) == 0


@pytest.mark.timeout(120)
def test_resuming_another_runs_checkpoint_into_an_out_with_checkpoints_is_refused(
        capsys, saved, tmp_path):
    # Only checkpoints past the resumed step counted: resumed at step-4 of another run, this
    # one was accepted, wrote its final.pt over the folder's, and --keep 1 pruned its step-2
    # and step-4.
    other = tmp_path / "other"
    assert main(["train", "--strategy", "single", "--out", str(other), "--lr", "0.05",
                 "--checkpoint-every", "2", *TINY]) == 0
    run = copied(saved, tmp_path)
    before = (run / "final.pt").read_bytes()
    line = error_of(capsys, "--strategy", "single", "--lr", "0.05", "--resume",
                    str(other / "checkpoints" / "step-4"), "--out", str(run),
                    "--checkpoint-every", "2", "--keep", "1", *LONGER)
    assert f"--out {run} holds checkpoints that the run this one resumes ({other}/checkpoints/" \
           f"step-4) did not write (2 checkpoints up to step-4)" in line
    assert f"HINT: pass another --out (or remove {run}/checkpoints), or --resume {run}" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert (run / "final.pt").read_bytes() == before
    # The same run's own checkpoint, resumed from where it was made, goes on there.
    assert main(["train", "--strategy", "single", "--resume",
                 str(saved / "checkpoints" / "step-4"), "--out", str(run),
                 "--checkpoint-every", "2", "--keep", "1", *LONGER]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-6"]


@pytest.mark.timeout(120)
def test_resume_with_another_lr_or_schedule_or_with_init_is_refused(capsys, saved):
    # The checkpoint's optimizer settings replaced --lr silently, while metrics.json said it.
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), "--lr", "0.5", *TINY)
    assert "was written with --lr 0.002, and this run has 0.5. HINT: resume with --lr 0.002" \
        in line
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), "--lr-schedule",
                    "cosine", *TINY)
    assert "was written with --lr-schedule constant, and this run has cosine" in line
    # --init was ignored: the checkpoint's weights replaced it.
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), "--init",
                    str(saved / "final.pt"), *TINY)
    assert "continues a checkpoint, whose weights would replace it. HINT: pass one of them" \
        in line


def test_resume_of_a_cosine_schedule_with_other_steps_is_refused(capsys, tmp_path):
    # The schedule follows --steps: the learning rate jumped to another curve at the resume.
    out = tmp_path / "run"
    assert main(["train", "--strategy", "single", "--out", str(out), "--checkpoint-every", "2",
                 "--lr-schedule", "cosine", *TINY]) == 0
    capsys.readouterr()
    line = error_of(capsys, "--strategy", "single", "--resume", str(out / "checkpoints" /
                                                                    "step-2"),
                    "--out", str(tmp_path / "longer"), "--lr-schedule", "cosine", *LONGER)
    assert ("was written by a run of --steps 4, and this run has 6: its cosine learning-rate "
            "schedule, fixed by --steps, would jump to another curve") in line
    assert "HINT: resume with --steps 4, or start a run of 6 steps from its weights" in line


@pytest.mark.timeout(120)
def test_resume_with_other_batches_is_refused(capsys, saved):
    # Both changed the batches a resumed run trained on, silently.
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), "--sampling",
                    "epoch", *TINY)
    assert "was written with --sampling random, and this run has epoch" in line
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), "--eval-every", "2",
                    *TINY)
    assert "was written without --eval-every, which trains on the data less its held-out " \
           "tenth, and this run has it. HINT: resume without --eval-every" in line


@pytest.mark.timeout(120)
def test_resume_without_out_goes_on_in_the_resumed_runs_out(capsys, saved, tmp_path):
    # It trained and wrote nothing, saying nothing.
    import shutil
    run = copied(saved, tmp_path)
    for resume in (run, run / "checkpoints" / "step-4"):
        assert main(["train", "--strategy", "single", "--resume", str(resume), *LONGER]) == 0
        assert f"wrote {run}/metrics.json and {run}/final.pt" in capsys.readouterr().out
        assert json.loads((run / "metrics.json").read_text())["steps"] == 6
    # An older checkpoint of the run: going on in its --out would write over its results.
    line = error_of(capsys, "--strategy", "single", "--resume",
                    str(run / "checkpoints" / "step-2"), *LONGER)
    assert f"is not the newest checkpoint of {run} (step-4 is), and no --out is given: going " \
           f"on there would write over that run's final.pt and metrics.json" in line
    # The run went on to step 6 from step-4: a run of 5 steps from there would write over
    # its results (it was accepted: metrics.json went from 6 steps to 5).
    before = (run / "metrics.json").read_text()
    shorter = [("5" if a == "6" and i and LONGER[i - 1] == "--steps" else a)
               for i, a in enumerate(LONGER)]
    line = error_of(capsys, "--strategy", "single", "--resume", str(run), *shorter)
    assert f"--resume {run} is of a run of --steps 6, this one has --steps 5, and no --out " \
           f"is given: ending there would write over that run's final.pt and metrics.json. " \
           f"HINT: pass --out DIR, or --steps 6" in line, line
    assert (run / "metrics.json").read_text() == before
    # Following that hint with the run's own folder wrote over it all the same (metrics.json
    # of 5 steps), and so did an older checkpoint resumed there: with --out, a resume into
    # the run's own --out was not checked as one without.
    line = error_of(capsys, "--strategy", "single", "--resume", str(run), "--out", str(run),
                    *shorter)
    assert f"--resume {run}/checkpoints/step-4 is of a run of --steps 6, this one has --steps " \
           f"5, and --out {run} is that run's: ending there would write over its final.pt and " \
           f"metrics.json. HINT: pass another --out, or --steps 6" in line, line
    line = error_of(capsys, "--strategy", "single", "--resume",
                    str(run / "checkpoints" / "step-2"), "--out", str(run), *LONGER)
    assert f"--out {run} holds checkpoints past step 2, the one this run resumes (1 checkpoint " \
           f"up to step-4): their run went on past it, and this run would write its final.pt " \
           f"and metrics.json over that run's. HINT: pass another --out, or --resume {run} to " \
           f"go on from its newest" in line, line
    assert (run / "metrics.json").read_text() == before
    # An interrupted run (step-2 only, no results): ending before its --steps loses nothing,
    # with --out its own folder or without (the diff's review: refused, "would write over its
    # final.pt and metrics.json", which were not there).
    for i, own_out in enumerate((True, False)):
        cut = tmp_path / f"cut{i}"
        shutil.copytree(saved, cut, ignore=shutil.ignore_patterns("final.pt", "metrics.json",
                                                                  "step-4"))
        fewer = [("3" if a == "4" and j and TINY[j - 1] == "--steps" else a)
                 for j, a in enumerate(TINY)]
        assert main(["train", "--strategy", "single", "--resume", str(cut),
                     *(["--out", str(cut)] if own_out else []), *fewer]) == 0
        assert json.loads((cut / "metrics.json").read_text())["steps"] == 3
    capsys.readouterr()
    # Another run's newer checkpoints in --out: not "their run went on past it" with the hint
    # to go on with it (the diff's review), but what the same resume with checkpoints says.
    other = tmp_path / "other"
    assert main(["train", "--strategy", "single", "--out", str(other), "--checkpoint-every",
                 "4", "--seed", "7", *TINY]) == 0
    line = error_of(capsys, "--strategy", "single", "--resume",
                    str(saved / "checkpoints" / "step-2"), "--out", str(other), *LONGER)
    assert f"--out {other} holds checkpoints past step 2, the one this run resumes (1 " \
           f"checkpoint up to step-4): they are not this run's" in line, line
    outside = tmp_path / "step-4"
    shutil.copytree(saved / "checkpoints" / "step-4", outside)
    backup = tmp_path / "backup"  # a folder of step-S, not a run's checkpoints/
    shutil.copytree(saved / "checkpoints", backup)
    for where in (outside, backup):
        line = error_of(capsys, "--strategy", "single", "--resume", str(where), *LONGER)
        assert f"--resume {where} is not inside a run's --out, and no --out is given: the run " \
               f"would write nothing. HINT: pass --out DIR" in line


@pytest.mark.timeout(120)
def test_resume_of_a_checkpoint_at_the_last_step_is_refused(capsys, saved):
    # It "resumed", trained nothing, and wrote the run's metrics.json again with none of its
    # traffic.
    before = (saved / "metrics.json").read_text()
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), *TINY)
    assert f"checkpoint {saved}/checkpoints/step-4 is at step 4, the run's last (--steps 4): " \
           f"nothing is left to train" in line
    assert f"HINT: pass --steps N above 4 to train on; its weights are in " \
           f"{saved}/checkpoints/step-4/model.pt (--init takes them)" in line
    assert (saved / "metrics.json").read_text() == before


@pytest.mark.timeout(120)
def test_resume_with_a_model_option_given_at_its_default_goes_on(capsys, saved, tmp_path):
    # --heads 4 is gpt's default: "is of another model: its options are {...}, this run's
    # {..., 'heads': 4}", for the same model.
    run = copied(saved, tmp_path)
    assert main(["train", "--strategy", "single", "--resume", str(run), "--heads", "4",
                 *LONGER]) == 0, capsys.readouterr().err


def test_a_gpt_moe_option_given_at_its_gates_default_is_the_same_model():
    # --top-k 2, --capacity-factor 1.2 or --balance-loss 0.01 with the gshard gate, whose
    # defaults they are, was "another model ... top_k (None there, 2 here)": a gate resolves
    # None to its default, and only the signature's defaults were filled in.
    from polytrain import TrainConfig
    from polytrain.checkpoint import check_compatible, run_record

    options = {"seq_len": 16, "d_model": 16, "layers": 1, "experts": 2, "gate": "gshard"}
    config = TrainConfig(strategy="single", model="gpt-moe", steps=4, model_options=options)
    saved = {**run_record(config), "step": 2, "workers": 1}
    for given in ({"top_k": 2}, {"capacity_factor": 1.2}, {"balance_loss": 0.01}):
        check_compatible(saved, config.replace(model_options={**options, **given}), "ckpt")
        check_compatible({**saved, "model_options": {**options, **given}}, config, "ckpt")
    with pytest.raises(ConfigError, match=r"checkpoint ckpt is of another model: its options "
                                          r"differ from this run's in top_k \(2 there, 1 "
                                          r"here\)"):
        check_compatible(saved, config.replace(model_options={**options, "top_k": 1}), "ckpt")


@pytest.mark.timeout(120)
def test_a_run_without_checkpoints_does_not_write_over_a_checkpointed_runs_results(capsys, saved,
                                                                                  tmp_path):
    # It replaced that run's final.pt and metrics.json, and a later --resume of the folder went
    # on with the other run.
    before = (saved / "metrics.json").read_text()
    line = error_of(capsys, "--strategy", "single", "--out", str(saved), "--lr", "0.05", *TINY)
    assert f"--out {saved} holds another run's checkpoints (2 checkpoints up to step-4): this " \
           f"run would write its final.pt and metrics.json over that run's" in line
    assert (saved / "metrics.json").read_text() == before
    # A finished run without checkpoints: its final.pt and metrics.json were replaced without
    # a word (only checkpoints in --out were looked for).
    import shutil
    done = tmp_path / "done"
    shutil.copytree(saved, done, ignore=shutil.ignore_patterns("checkpoints"))
    line = error_of(capsys, "--strategy", "single", "--out", str(done), "--lr", "0.05", *TINY)
    assert f"--out {done} holds another run's final.pt and metrics.json: this run would write " \
           f"its own over them. HINT: pass another --out, or remove them from {done}" in line
    assert (done / "metrics.json").read_text() == before


def test_resume_of_a_final_pt_points_at_init(capsys, saved):
    # It said "no such directory" of a file that exists.
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved / "final.pt"), *TINY)
    assert f"checkpoint {saved}/final.pt is a file, and a checkpoint is a directory" in line
    assert "to start a new run from a final.pt's weights, pass it to --init" in line


def test_a_refused_run_leaves_no_out_directory_behind(capsys, tmp_path):
    # A --resume refused after the options were checked had already made --out.
    out = tmp_path / "new" / "out"
    line = error_of(capsys, "--strategy", "single", "--out", str(out), "--resume",
                    str(tmp_path / "missing"), *TINY)
    assert "no such directory" in line
    assert not (tmp_path / "new").exists()


@pytest.mark.timeout(120)
def test_resume_on_another_corpus_is_refused(capsys, saved, monkeypatch):
    # The data sets are this Python's standard library: after an upgrade, or on another
    # machine's Python, a resume trained on other batches, silently.
    import polytrain.data

    original = polytrain.data._DATASETS["text"]
    other = original().clone()
    other[:100] = ord("#")
    monkeypatch.setitem(polytrain.data._DATASETS, "text", lambda: other)
    line = error_of(capsys, "--strategy", "single", "--resume", str(saved), *TINY)
    assert "trained on another corpus than this run's --data text: the data sets are the " \
           "standard library of the Python that runs, and the files under " in line
    assert "differ from those it read" in line and "HINT: resume with that Python" in line
    # Another Python's version is named.
    manifest = saved / "checkpoints" / "step-4" / "manifest.json"
    kept = manifest.read_text()
    try:
        manifest.write_text(json.dumps({**json.loads(kept), "python": "3.9.0"}))
        line = error_of(capsys, "--strategy", "single", "--resume", str(saved), *TINY)
        assert "and it ran on Python 3.9.0, this on 3." in line
        assert "HINT: resume with Python 3.9.0, or start without --resume" in line
    finally:
        manifest.write_text(kept)
    monkeypatch.setitem(polytrain.data._DATASETS, "text", original)  # the same bytes: goes on
    assert main(["train", "--strategy", "single", "--resume", str(saved), *LONGER,
                 "--out", str(copied(saved, saved.parent / "again"))]) == 0


@pytest.mark.timeout(30)
def test_a_gpt_moe_checkpoint_of_dropless_on_a_gate_without_capacity_resumes(caplog):
    # From a review: --dropless with the naive gate did nothing before it was refused, and a
    # checkpoint of such a run no longer resumed: "is damaged: its model_options {...
    # 'dropless': True} make no gpt-moe model" (and with --dropless the run was refused).
    import logging

    from polytrain import TrainConfig
    from polytrain.checkpoint import check_compatible
    tiny = {"seq_len": 16, "d_model": 32, "layers": 1, "experts": 4}
    for gate in ({}, {"gate": "noisy"}):
        saved = {"strategy": "single", "model": "gpt-moe", "workers": 1, "step": 4,
                 "model_options": {**tiny, **gate, "dropless": True}}
        config = TrainConfig(strategy="single", model="gpt-moe", steps=6,
                             model_options={**tiny, **gate})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polytrain.checkpoint.resume"):
            check_compatible(saved, config, "run/step-4")
        assert [r.getMessage() for r in caplog.records] == [
            f"checkpoint run/step-4 was saved with --dropless on the {gate.get('gate', 'naive')} "
            f"gate, which did nothing there (it drops slots only with a capacity factor): "
            f"resuming it without"]

