"""Bad arguments to the Python API (TrainConfig, save/load, init, shard, distribute, launch):
each refused in one line, a ConfigError naming the argument, the value and what to pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import polytrain
from polytrain import ConfigError, TrainConfig


def trained():
    """A one-process trainer (``single``) and its optimizer, on a tiny model."""
    model = nn.Linear(4, 2)
    return polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "single")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call, said", [
    (lambda tmp: TrainConfig(resume=""), "--resume is empty"),
    (lambda tmp: TrainConfig(init=" "), "--init is empty"),
    (lambda tmp: TrainConfig(devices=""), "--devices is empty"),
    (lambda tmp: polytrain.save("", *trained(), step=1), "save() root is empty"),
    (lambda tmp: polytrain.load("", *trained()), "load() path is empty"),
    (lambda tmp: polytrain.load("", *trained(), missing_ok=True), "load() path is empty"),
])
def test_a_blank_path_is_refused_not_taken_for_the_current_directory(call, said, tmp_path,
                                                                    monkeypatch):
    # An empty --resume '' (or save("", ...), load("", ...)) meant the current directory:
    # Path("") is "." (resolve(), checkpoint_dir()); only an empty --out was refused.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        call(tmp_path)
    assert said in str(e.value) and "HINT: pass" in str(e.value)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing written in the working directory


def distributed(**change):
    """distribute()'s arguments, a tiny model's, with ``change`` made."""
    model = nn.Linear(4, 2)
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "strategy": "single", **change}
    return polytrain.distribute(**args)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("change, said", [
    ({"model": None}, r"^distribute\(\) model must be a torch\.nn\.Module \(got None\)\. HINT: "),
    ({"optimizer": None}, r"^distribute\(\) optimizer must be an optimizer \(param_groups and "
                          r"step\(\), as torch\.optim\.Optimizer's\) \(got None\)\. HINT: "),
    ({"ctx": "x"}, r"^distribute\(\) ctx must be polytrain\.init\(\)'s Context, or None \(got "
                   r"'x'\)\. HINT: "),
    ({"loss_fn": 3}, r"^distribute\(\) loss_fn must be a function loss_fn\(outputs, targets\), "
                     r"or None \(got 3\)\. HINT: "),
])
def test_distributes_arguments_of_another_kind_are_refused_by_name(change, said):
    # model=None was a TypeError of weakref, optimizer=None an AttributeError 'param_groups',
    # ctx="x" an AttributeError 'closed', and loss_fn=3 was accepted (the first step failed).
    # Cause: distribute() checked only its strategy's options.
    with pytest.raises(ConfigError, match=said) as e:
        distributed(**change)
    assert "\n" not in str(e.value)


class Wrapping:
    """An optimizer wrapper that is no torch.optim.Optimizer (as apex's FP16_Optimizer,
    DeepSpeed's): what distribute() uses of an optimizer, passed through."""

    def __init__(self, inner):
        self.inner = inner
        self.param_groups, self.state = inner.param_groups, inner.state

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()


@pytest.mark.timeout(30)
def test_distribute_takes_an_optimizer_wrapper_that_is_no_optimizer_subclass():
    # The argument check refused it (isinstance torch.optim.Optimizer), where it had worked.
    model = nn.Linear(4, 2)
    _, opt = distributed(model=model,
                         optimizer=Wrapping(torch.optim.SGD(model.parameters(), lr=0.1)))
    before = model.weight.detach().clone()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call, said", [
    (lambda tmp, tr: polytrain.save(3, *tr, step=1),
     r"^save\(\) root must be a str or a Path \(got 3, an int\)\. HINT: pass root as "),
    (lambda tmp, tr: polytrain.save(tmp, *tr, step=1, extra=3),
     r"^save\(\) extra must be a mapping or a Callable, or None \(got 3, an int\)"),
    (lambda tmp, tr: polytrain.save(tmp, *tr, step=1, run=3),
     r"^save\(\) run must be a mapping, or None \(got 3, an int\)"),
    (lambda tmp, tr: polytrain.load(3, *tr),
     r"^load\(\) path must be a str or a Path \(got 3, an int\)"),
    (lambda tmp, tr: polytrain.load(tmp, *tr, missing_ok="no"),
     r"^load\(\) missing_ok must be True or False \(got 'no', a str\)\. HINT: pass "
     r"missing_ok=True or missing_ok=False$"),
])
def test_saves_and_loads_arguments_of_another_kind_are_refused_by_name(call, said, tmp_path):
    # save(3, ...) was pathlib's TypeError, extra=3 or run=3 "TypeError: 'int' object is not
    # iterable", and load(..., missing_ok="no") was taken for True. Cause: save() and load()
    # checked only step and keep.
    with pytest.raises(ConfigError, match=said) as e:
        call(tmp_path, trained())
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
