"""``ddp``: a parameter that gets no gradient is named, or allowed with find_unused_parameters."""

import pytest
import torch
from torch import nn

import polytrain
from polytrain import LaunchError
from tests.harness import spawn


class HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def train(options: dict) -> dict[str, torch.Tensor]:
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = HalfUsed()
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp",
                                   loss_fn=lambda out, y: (out - y).square().mean(), **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 4, generator=g)
        trainer.step(x, x.flip(1))
    assert ctx.num_workers == 2
    return {k: v.clone() for k, v in trainer.state_dict().items()}


@pytest.mark.timeout(60)
def test_unused_parameters_are_named_with_the_option_that_allows_them():
    with pytest.raises(LaunchError, match=r"ConfigError: parameters 'unused.weight', "
                                          r"'unused.bias' got no gradient in the last backward"
                                          r".*HINT: pass --find-unused-parameters"):
        spawn(train, workers=2, args=({},))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def freeze_after_wrapping() -> None:
    polytrain.init()
    torch.manual_seed(0)
    model = Chain()
    wrapped, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        "ddp")
    model.a.requires_grad_(False)  # after wrapping: ddp still waits for a's gradients
    for _ in range(2):
        wrapped(torch.randn(2, 4)).sum().backward()


@pytest.mark.timeout(60)
def test_the_names_are_ddps_parameters_even_when_requires_grad_changed_after_wrapping():
    with pytest.raises(LaunchError, match=r"parameters 'a.weight', 'a.bias', 'd.weight', "
                                          r"'d.bias' got no gradient"):
        spawn(freeze_after_wrapping, workers=2)


@pytest.mark.timeout(60)
def test_with_find_unused_parameters_ddp_trains_and_leaves_them_alone():
    first, second = spawn(train, workers=2, args=({"find_unused_parameters": True},))
    torch.manual_seed(0)
    untouched = HalfUsed()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(first["unused.weight"], untouched.unused.weight)
    assert not torch.equal(first["used.weight"], untouched.used.weight)
