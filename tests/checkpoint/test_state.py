"""save() and load() besides their files: who must call them, the generators they restore."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polytrain
from polytrain.checkpoint import CheckpointError
from polytrain.checkpoint.state import _arrivals, cuda_rng_states, rng_state, set_rng_state
from polytrain.errors import LaunchError


def fake_cuda(monkeypatch, count: int, current: int,
              states: list[torch.Tensor] | None = None) -> list[tuple[int, torch.Tensor]]:
    """torch.cuda on a machine of ``count`` GPUs, this process computing on ``current``, whose
    generators are ``states``: the (device, state) pairs set, in order. Setting one past the
    last device raises IndexError, as torch's does when its lazy call runs."""
    done: list[tuple[int, torch.Tensor]] = []

    def set_one(state: torch.Tensor, device: int = 0) -> None:
        if device >= count:
            raise IndexError("tuple index out of range")
        done.append((device, state))

    for name, value in {"is_available": lambda: True, "is_initialized": lambda: True,
                        "device_count": lambda: count, "current_device": lambda: current,
                        "get_rng_state_all": lambda: list(states or []),
                        "set_rng_state": set_one,
                        "set_rng_state_all": lambda all_: [set_one(s, i)
                                                           for i, s in enumerate(all_)]}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    return done


def test_a_resume_on_fewer_gpus_gives_its_device_the_generator_it_computed_on(monkeypatch):
    # A resume that saw fewer GPUs than the save failed after loading the weights: IndexError
    # in torch.cuda.set_rng_state_all, which set every saved device's generator. Those were
    # every device's as the saving process saw them, and it computed on one.
    states = [torch.full((8,), i, dtype=torch.uint8) for i in range(4)]
    fake_cuda(monkeypatch, count=4, current=2, states=states)
    saved = rng_state()
    assert saved["cuda_device"] == 2
    done = fake_cuda(monkeypatch, count=1, current=0)
    set_rng_state(saved)
    assert [(d, int(s[0])) for d, s in done] == [(0, 2)]
    # A checkpoint from before the device was recorded: the devices both processes see.
    done.clear()
    set_rng_state({k: v for k, v in saved.items() if k != "cuda_device"})
    assert [(d, int(s[0])) for d, s in done] == [(0, 0)]
    # The plan alone, as data.
    assert list(cuda_rng_states(states, None, 0, 8)) == [0, 1, 2, 3]
    assert {d: int(s[0]) for d, s in cuda_rng_states(states, 1, 3, 4).items()} == {3: 1}


def test_workers_that_do_not_call_a_collective_save_are_named_on_every_one_that_does():
    # Three workers in a store, as in a run: worker 1 calls late (after the others stopped
    # waiting), and then only, or never; the others go on or refuse alike.
    def call(store, key, index, out, delay=0.0):
        time.sleep(delay)
        out[index] = _arrivals(store, key, index, 3, wait_s=0.3)

    def run(key, workers, delays=None):
        store, out = dist.HashStore(), {}
        threads = [threading.Thread(target=call, args=(store, key, i, out,
                                                       (delays or {}).get(i, 0.0)))
                   for i in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return out

    assert run("all", [0, 1, 2], {2: 0.1}) == {0: None, 1: None, 2: None}
    assert run("one missing", [0, 2]) == {0: [1], 2: [1]}
    # Late: it refuses too (it would go on into a collective the others are not in).
    assert run("one late", [0, 1, 2], {1: 0.6}) == {0: [1], 1: [1], 2: [1]}


def save_or_load_on_worker_0_alone(root: str) -> None:
    """Worker 0 loads alone (its refusal written to root/load.txt), trains a step with worker
    1, then saves alone while worker 1 trains on (its refusal not caught)."""
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp",
                                   loss_fn=nn.functional.mse_loss)
    x = torch.ones(4, 2)
    polytrain.save(root, trainer, step=1)  # on both: something to load
    if ctx.worker_index == 0:
        try:
            polytrain.load(root, trainer)
        except CheckpointError as e:
            Path(root, "load.txt").write_text(str(e))
    trainer.step(x, x)  # together again: a refused load changed nothing
    if ctx.worker_index == 0:
        polytrain.save(root, trainer, step=2)
    trainer.step(x, x)


@pytest.mark.timeout(120)
def test_a_save_or_load_on_one_worker_alone_is_refused_there_naming_the_other(tmp_path):
    # `if ctx.worker_index == 0: polytrain.save(...)` failed after the timeout as gloo's
    # "Timed out waiting 8000ms for send operation", with torch's traceback; a load there
    # named worker 1, which did nothing wrong. Cause: save() and load() began with a gather,
    # which cannot say who did not come, and the launcher named whoever timed out first.
    root = tmp_path / "ckpt"
    with pytest.raises(LaunchError) as e:
        polytrain.launch(save_or_load_on_worker_0_alone, workers=2, args=(str(root),),
                         timeout_s=6, env={"OMP_NUM_THREADS": "1"})
    hint = ("call polytrain.{0}() on every worker at the same point, not under `if "
            "ctx.worker_index == 0` (each worker {0}s its own part); if a worker is only slower "
            "to get there, raise the timeout (--timeout or POLYTRAIN_TIMEOUT)")
    assert (root / "load.txt").read_text() == (
        "polytrain.load() is collective, and worker rank 1 (machine node0) did not call it: "
        "worker rank 0 (machine node0) waited 3 s, half the timeout. HINT: "
        + hint.format("load"))
    assert e.value.rank == 0 and e.value.bad_input, str(e.value)
    assert e.value.what.startswith(
        "worker rank 0 (machine node0) failed: CheckpointError: polytrain.save() is "
        "collective, and worker rank 1 (machine node0) did not call it: worker rank 0 "
        "(machine node0) waited 3 s, half the timeout"), e.value.what
    assert e.value.hint == hint.format("save")
    assert not (root / "step-2").exists()
