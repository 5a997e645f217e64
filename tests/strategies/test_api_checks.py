"""What the library's optimizers and entry points take from a user's script as torch's do."""

import copy
import io
import os

import pytest
import torch

import polytrain
from polytrain.optim import LazyAdam
from polytrain.strategies import base
from tests.harness import refused, spawn


def test_lazy_adam_steps_with_a_closure_as_torchs_adam_does():
    # LazyAdam.step(closure) always failed ("element 0 of tensors does not require grad"):
    # step runs under no_grad, and so did the closure, whose backward had no graph.
    def closure_of(model, opt):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        return closure

    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    lazy = torch.nn.Linear(3, 1)
    by_hand = torch.nn.Linear(3, 1)
    by_hand.load_state_dict(lazy.state_dict())
    opt, hand_opt = LazyAdam(lazy.parameters(), lr=0.1), LazyAdam(by_hand.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        losses.append(float(opt.step(closure_of(lazy, opt)).detach()))
        hand_loss = closure_of(by_hand, hand_opt)()
        hand_opt.step()
        assert losses[-1] == float(hand_loss.detach())
    assert torch.equal(lazy.weight, by_hand.weight)
    assert not torch.equal(lazy.weight, torch.nn.Linear(3, 1).weight) and losses[2] < losses[0]


@pytest.mark.parametrize("options, said", [
    ({"lr": -0.1}, r"LazyAdam lr must be 0 or more \(got -0\.1\)\. HINT: pass, say, lr=0\.001$"),
    ({"eps": -1.0}, r"LazyAdam eps must be 0 or more \(got -1\.0\)\. HINT: pass, say, eps=1e-08$"),
    ({"weight_decay": float("nan")}, r"LazyAdam weight_decay must be 0 or more \(got nan\)"),
    ({"betas": (1.0, 0.999)}, r"LazyAdam betas must each be at least 0 and under 1 \(got "
                              r"\(1\.0, 0\.999\)\): .*HINT: pass, say, betas=\(0\.9, 0\.999\)$"),
    ({"betas": (0.9, 1.5)}, r"LazyAdam betas must each be at least 0 and under 1 \(got "
                            r"\(0\.9, 1\.5\)\)"),
])
def test_lazy_adam_refuses_the_settings_torchs_adam_refuses(options, said):
    # A negative lr was taken and stepped uphill, a negative eps too; beta1 = 1 met a bare
    # ZeroDivisionError at the first step, beta2 = 1.5 math's "domain error".
    with pytest.raises(polytrain.ConfigError, match=said):
        LazyAdam([torch.nn.Parameter(torch.ones(3))], **options)
    with pytest.raises(ValueError):
        torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], **options)


class MovesTheModel(base.Strategy[base.NoOptions]):
    """A strategy whose wrap moves the model, as every distributed one moves it to the
    worker's device (here the meta device: a CPU-only test has no other)."""

    name = "moves-the-model"
    distributed = False

    def wrap(self, model, optimizer):
        # Keep the parameter objects, which the optimizer holds, as a move to a GPU keeps them.
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to("meta")
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        return model, optimizer


def test_optimizer_state_loaded_before_distribute_follows_the_model_to_its_device(monkeypatch):
    # Symptom: state loaded on the CPU (check_same_optimizer's hint: load it on every worker
    # before distribute()) stayed there when the strategy moved the model to the GPU: torch's
    # device-mismatch RuntimeError at the first step. Cause: Module.to moves no optimizer
    # state, and torch's load_state_dict places it by where the parameters were then.
    monkeypatch.setitem(base._REGISTRY, MovesTheModel.name, MovesTheModel)
    model = torch.nn.Linear(3, 2)
    saved = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    saved.step()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.load_state_dict(saved.state_dict())
    wrapped, opt = polytrain.distribute(model, opt, MovesTheModel.name)
    for p in wrapped.parameters():
        state = opt.state[p]
        assert p.device.type == "meta"
        assert (state["exp_avg"].device.type, state["exp_avg_sq"].device.type) == ("meta",) * 2
        assert state["step"].device.type == "cpu"  # as torch's load_state_dict leaves it
        assert state["exp_avg"] is not saved.state[p]["exp_avg"]


def on_uneven_machines() -> list[str]:
    # As torchrun may start them: 2 workers on machine m0, 1 on m1 (no layout of the CLI's).
    os.environ["POLYTRAIN_NODE"] = "m0" if int(os.environ["RANK"]) < 2 else "m1"
    polytrain.init()

    def dense() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    said = [refused(lambda: polytrain.distribute(*dense(), "moe"))]
    model, opt = polytrain.distribute(*dense(), "parallax")  # hands back the user's model
    said += [type(polytrain.strategy_of(model)).__name__,
             refused(lambda: copy.deepcopy(model)),  # its module hooks would go with it
             refused(lambda: polytrain.strategy_of((model, opt)))]
    return said


@pytest.fixture(scope="module")
def uneven() -> list[list[str]]:
    return spawn(on_uneven_machines, workers=3)


@pytest.mark.timeout(60)
def test_a_model_a_strategy_cannot_train_is_refused_on_uneven_machines_too(uneven):
    # Symptom: moe took a model without MoE layers on machines of 2 and 1 workers, and
    # trained it. Cause: distribute() ran the strategy's check_model only where the run has
    # a layout of the CLI's (even machines).
    for said in uneven:
        assert said[0].startswith("strategy 'moe' needs a model with MoE layers (Sequential "
                                  "has none)"), said


@pytest.mark.timeout(60)
def test_the_users_own_model_handed_back_copies_and_saves_where_that_is_safe(uneven):
    # Symptom: copy.deepcopy(model) and torch.save(model) of the model byteps and single
    # hand back (the user's own) failed: "cannot pickle 'ProcessGroup' object". Cause:
    # distribute() set the strategy, which holds process groups, as an attribute of it.
    # Parallax's copy would keep its lookup hooks (run against the original's tables): a
    # copy is refused in one line. And strategy_of() of what is not a model: a TypeError.
    for said in uneven:
        assert said[1:] == [
            "Parallax",
            "a model distributed with strategy 'parallax' cannot be copied or pickled: its "
            "strategy holds the run's process groups. HINT: copy its weights: "
            "polytrain.full_state_dict(model) (or trainer.state_dict()) into a model of your "
            "own",
            "this model did not come from polytrain.distribute(). HINT: pass the model that "
            "distribute() returned"], said
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model, _ = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    "single")
    copied = copy.deepcopy(model)  # an EMA's or a best model's snapshot
    torch.save(model, io.BytesIO())
    assert torch.equal(copied.weight, model.weight)
    assert polytrain.strategy_of(model).name == "single"
    with pytest.raises(polytrain.ConfigError, match=r"^this model did not come from polytrain"):
        polytrain.strategy_of(copied)
