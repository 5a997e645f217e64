"""save() and load() are collective: one called by some workers only is named as that."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import polytrain
from polytrain import LaunchError

_TIMEOUT_S = 4  # each wait for the workers that never call is the whole --timeout
# How worker 0's wait ended: its own timeout, or the others' leaving the run when theirs (at
# the exit, waiting for worker 0) ran out first.
_ENDED = r"(within --timeout 4 s|before its wait for them failed \(RuntimeError\))\. HINT"


def _distributed(ctx: polytrain.Context) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    model, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      strategy="ddp")
    model(torch.full((1, 2), float(ctx.worker_index))).sum().backward()
    opt.step()
    return model, opt


def save_on_worker_0_only(root: str) -> None:
    """Every worker saves step 1; then worker 0 alone saves step 2 (its save #2)."""
    ctx = polytrain.init()
    model, opt = _distributed(ctx)
    polytrain.save(root, model, opt, step=1)
    if ctx.worker_index == 0:
        polytrain.save(root, model, opt, step=2)


def late_save_on_worker_0_only(root: str) -> None:
    """Worker 0 alone saves, after the others have begun to leave the run: its wait ends as
    they exit (their own wait there timed out), not with a timeout of its own."""
    import time
    ctx = polytrain.init()
    model, opt = _distributed(ctx)
    if ctx.worker_index == 0:
        time.sleep(_TIMEOUT_S / 2)
        polytrain.save(root, model, opt, step=1)


def busy_before_a_save(root: str) -> None:
    """Every worker saves, but worker 1 works (a loop that never waits) for three timeouts
    first: the others' save times out waiting for it."""
    import time
    ctx = polytrain.init()
    model, opt = _distributed(ctx)
    if ctx.worker_index == 1:
        end = time.monotonic() + 3 * _TIMEOUT_S
        while time.monotonic() < end:  # the line the launcher names
            pass
    polytrain.save(root, model, opt, step=1)


def exits_before_a_save(root: str) -> None:
    """Worker 1 ends with os._exit(3) (as a C library's exit() would) while the others save."""
    import os
    import time
    ctx = polytrain.init()
    model, opt = _distributed(ctx)
    if ctx.worker_index == 1:
        time.sleep(1.0)
        os._exit(3)
    polytrain.save(root, model, opt, step=1)


def load_on_worker_0_only(root: str) -> None:
    """Every worker saves step 1; then worker 0 alone loads it (its load #1)."""
    ctx = polytrain.init()
    model, opt = _distributed(ctx)
    polytrain.save(root, model, opt, step=1)
    if ctx.worker_index == 0:
        polytrain.load(root, model, opt)


def failure_of(script, root: Path) -> LaunchError:
    with pytest.raises(LaunchError) as e:
        polytrain.launch(script, workers=3, args=(str(root),), timeout_s=_TIMEOUT_S,
                         env={"OMP_NUM_THREADS": "1"})
    return e.value


@pytest.mark.timeout(90)
def test_a_save_on_worker_0_alone_names_the_workers_that_never_called_it(tmp_path):
    # "worker rank 2 (machine node0) failed: ended its script 4.0 s before worker rank 0's
    # wait timed out (after 4 s)", worker 0's own error gloo's "Timed out waiting 4000ms" in
    # the gather inside save(): not the rule broken. Cause: save() is collective, and only
    # the timeout of its first collective told of workers that never called it.
    error = failure_of(save_on_worker_0_only, tmp_path)
    said = str(error)
    assert error.rank == 0, said
    assert re.search(
        r"^worker rank 0 \(machine node0\) failed: (CommTimeout|PeerLost): save\(\) is collective: "
        r"every worker must call it; workers 1, 2 of 3 never called save #2 \(worker 0 did, "
        rf"at step 2, into {re.escape(str(tmp_path))}\) " + _ENDED, said), said
    assert error.hint is not None and "call polytrain.save() on every worker" in error.hint, said
    assert not (tmp_path / "step-2").exists()


@pytest.mark.timeout(90)
def test_a_save_whose_wait_ends_as_the_others_leave_names_the_rule_not_them(tmp_path):
    # "worker rank 2 (machine node0) failed: ended its script 4.1 s before worker rank 0 lost
    # a peer": worker 0's wait in save() ended with "Connection closed by peer" as the others
    # left the run, which the launcher takes for a failure another caused. Cause: as above;
    # and the rule's error must not quote that text, or it is taken for such a failure too.
    said = str(error := failure_of(late_save_on_worker_0_only, tmp_path))
    assert error.rank == 0, said
    assert re.search(
        r"^worker rank 0 \(machine node0\) failed: (CommTimeout|PeerLost): save\(\) is collective: "
        r"every worker must call it; workers 1, 2 of 3 never called save #1 \(worker 0 did, "
        rf"at step 1, into {re.escape(str(tmp_path))}\) " + _ENDED, said), said


@pytest.mark.timeout(90)
def test_a_load_on_worker_0_alone_names_the_workers_that_never_called_it(tmp_path):
    # As a save on one worker: "worker rank 1 (machine node0) failed: ended its script 4.0 s
    # before worker rank 0's wait timed out", gloo's timeout in the gather inside load().
    error = failure_of(load_on_worker_0_only, tmp_path)
    said = str(error)
    assert error.rank == 0, said
    assert re.search(
        r"^worker rank 0 \(machine node0\) failed: (CommTimeout|PeerLost): load\(\) is collective: "
        r"every worker must call it; workers 1, 2 of 3 never called load #1 \(worker 0 did, "
        rf"from {re.escape(str(tmp_path))}\) " + _ENDED, said), said
    assert error.hint is not None and "call polytrain.load() on every worker" in error.hint, said


@pytest.mark.timeout(90)
def test_a_worker_busy_before_a_save_is_named_where_it_works_not_as_one_that_never_called(
        tmp_path):
    # "worker rank 0 ... save() is collective: every worker must call it; worker 1 of 3 never
    # called save #1": a worker still working before the save was taken for one that never
    # calls it (and told to call save on every worker, which the script does), and its
    # stacks were not shown. Cause: the rule's error was no timeout, so the launcher did not
    # look for a process still working, as it does for any wait that timed out.
    said = str(error := failure_of(busy_before_a_save, tmp_path))
    assert error.rank == 1, said
    assert re.search(r"^worker rank 1 \(machine node0\) failed: stopped making progress: its "
                     r"main thread has worked for [\d.]+ s without waiting for any peer, now at "
                     r"test_collective\.py:\d+", said), said


@pytest.mark.timeout(90)
def test_a_worker_that_exits_during_the_others_save_is_named_not_the_rule(tmp_path):
    # "worker rank 0 ... save() is collective: every worker must call it; worker 1 of 3
    # never called save #1": a worker that died with exit code 3 (no error file of its own)
    # was hidden behind the rule's error, whose time came first. Cause: that error was no
    # longer a lost peer's (secondary), so it sorted before the dead worker's exit.
    said = str(error := failure_of(exits_before_a_save, tmp_path))
    assert error.rank == 1, said
    assert re.search(r"^worker rank 1 \(machine node0\) failed: exited with code 3", said), said
