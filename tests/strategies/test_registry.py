import pytest
import torch

import polytrain
from polytrain import ConfigError, LaunchError
from polytrain.models import GPT
from tests.harness import spawn


def test_unknown_strategy_lists_the_valid_names():
    with pytest.raises(ConfigError, match=r"unknown strategy 'bytepz'; the strategies are: .*ddp"
                                          r".*single.*HINT"):
        polytrain.get_strategy("bytepz")


def test_unknown_strategy_option_lists_the_valid_ones():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"strategy 'single' has no option 'bucket_mb'; its "
                                          r"options are: none"):
        polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "single",
                             bucket_mb=25)


def test_single_returns_the_model_and_its_full_state():
    model = torch.nn.Linear(2, 3)
    wrapped, _ = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      "single")
    state = polytrain.full_state_dict(wrapped)
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], model.weight)


def build_and_distribute(strategy: str) -> None:
    ctx = polytrain.init()
    torch.manual_seed(ctx.rank)  # different seeds: distribute must still agree the weights
    d_model = 32 if ctx.worker_index != 1 else 48
    model = GPT(seq_len=8, d_model=d_model, layers=1, heads=4)
    polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)


def agree_on_weights(strategy: str) -> list[torch.Tensor]:
    ctx = polytrain.init()
    torch.manual_seed(ctx.rank)
    model = GPT(seq_len=8, d_model=16, layers=1, heads=2)
    wrapped, _ = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      strategy)
    return [p.detach().clone() for p in wrapped.parameters()]


# herring's drop-in DDP does the check and the copy itself (distribute leaves them to it).
@pytest.mark.parametrize("strategy", ["ddp", "herring"])
@pytest.mark.timeout(60)
def test_workers_whose_models_differ_get_one_clear_error(strategy):
    with pytest.raises(LaunchError, match=r"ConfigError: worker rank 1's model differs from "
                                          r"worker rank 0's: .*'embed.tok.weight' is \[256, 32\] "
                                          r"torch.float32 there but \[256, 48\].*HINT: build the "
                                          r"same model"):
        spawn(build_and_distribute, workers=3, colocated=int(strategy == "herring"),
              args=(strategy,))


@pytest.mark.parametrize("strategy", ["ddp", "herring"])
@pytest.mark.timeout(60)
def test_parameters_start_identical_on_every_worker(strategy):
    a, b = spawn(agree_on_weights, workers=2, colocated=int(strategy == "herring"),
                 args=(strategy,))
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
