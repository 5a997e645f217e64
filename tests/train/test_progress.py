"""The progress bar: periodic lines off a terminal, one redrawn line on it."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.train.progress import Progress

pytestmark = pytest.mark.timeout(10)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_error_mid_run_starts_on_its_own_line() -> None:
    stream = Terminal()
    with pytest.raises(RuntimeError), Progress(10, stream=stream) as bar:
        bar.update(0, 2.5, 100.0)
        raise RuntimeError("a step failed")
    assert stream.getvalue().startswith("\r[") and stream.getvalue().endswith("\n")
    assert stream.getvalue().count("\n") == 1


def test_a_finished_bar_ends_its_line_once() -> None:
    stream = Terminal()
    with Progress(2, stream=stream) as bar:
        bar.update(0, 2.5, 100.0)
        bar.update(1, 2.0, 100.0)
    assert stream.getvalue().endswith("2/2 loss  2.000    100.0 samples/s\n")
    assert stream.getvalue().count("\n") == 1


def test_off_a_terminal_it_writes_a_line_every_tenth() -> None:
    stream = io.StringIO()
    with Progress(20, stream=stream) as bar:
        for step in range(20):
            bar.update(step, None, 50.0)
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [f"{n}/20" for n in range(2, 21, 2)]


def test_a_bar_that_stops_drawing_ends_its_line_and_writes_no_more() -> None:
    # PipeTransformer's bar moves to another process when a new plan moves pipeline 0's
    # last stage: the process that drew it ends its open line and stops.
    stream = Terminal()
    with Progress(10, stream=stream) as bar:
        bar.update(0, 2.5, 100.0)
        bar.show(False)
        bar.update(1, 2.0, 100.0)
        bar.note("a new plan")
    assert stream.getvalue().count("\r[") == 1 and stream.getvalue().endswith("100.0 samples/s\n")
    later = Terminal()
    with Progress(10, stream=later, enabled=False) as bar:
        bar.show(True)
        bar.update(1, 2.0, 100.0)
    assert later.getvalue().startswith("\r[") and "2/10 loss  2.000" in later.getvalue()


def test_a_bar_over_several_replicas_names_whose_loss_it_shows() -> None:
    stream = io.StringIO()
    with Progress(2, stream=stream) as bar:
        bar.update(0, 2.5, 100.0, replica=(0, 2))
        bar.update(1, 2.0, 100.0, replica=(0, 1))  # one replica: the batch's loss
    assert stream.getvalue().splitlines() == [
        "train 1/2 loss  2.500 (replica 0 of 2)    100.0 samples/s",
        "train 2/2 loss  2.000    100.0 samples/s"]


@pytest.mark.timeout(120)
def test_the_bar_of_a_data_parallel_run_says_its_loss_is_replica_0s(tmp_path) -> None:
    # The bar showed worker 0's slice's loss as 'loss' (ddp, 2 workers: 'loss 5.321', then
    # 'final loss 5.3340', the mean over the replicas that metrics.json has): only worker 0
    # draws it, with its own loss. The global loss would cost a collective where the bar
    # redraws, one that a pipeline's stages or an asynchronous strategy cannot take mid-run.
    exe = Path(sys.executable).with_name("polytrain")
    run = subprocess.run(
        [str(exe), "train", "--strategy", "ddp", "--workers", "2", "--model", "gpt",
         "--d-model", "32", "--layers", "2", "--seq-len", "16", "--batch-size", "16",
         "--steps", "3", "--timeout", "60", "--out", str(tmp_path)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    bars = [line for line in run.stderr.splitlines() if line.startswith("train ")]
    final = json.loads((tmp_path / "metrics.json").read_text())["final_loss"]
    assert re.fullmatch(r"train 3/3 loss +\d+\.\d{3} \(replica 0 of 2\) .*", bars[-1]), bars
    assert f"final loss {final:.4f}" in run.stdout
