"""save() and load() besides their files: the generators they restore."""

from __future__ import annotations

import torch

from polytrain.checkpoint.state import cuda_rng_states, rng_state, set_rng_state


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
