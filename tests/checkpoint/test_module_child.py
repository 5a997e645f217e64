"""A model's own child named ``module`` (an EMA's, a loss wrapper's) is the model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.harness import spawn


class Net(nn.Module):
    """A model that holds a layer as ``self.module``, beside a table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.module = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(self.emb(x).mean(1)).squeeze(1)


class Outer(nn.Module):
    """A model whose one child is named ``module`` (an EMA wrapper's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def keys_script(strategy: str) -> tuple[list[str], list[str]]:
    import polytrain
    polytrain.init()
    torch.manual_seed(0)
    model = Outer()
    plain = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = polytrain.distribute(model, opt, strategy=strategy)
    return list(polytrain.full_state_dict(model)), plain


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["single", "ddp", "parallax"])
def test_a_models_own_child_named_module_stays_in_its_state(strategy):
    # full_state_dict gave only the child's keys (['module.emb.weight', ...] became
    # ['emb.weight', ...]; a model of emb and self.module: ['bias', 'weight']) under the
    # strategies that hand back the user's own model: it unwrapped any attribute named
    # "module" as if the model were a DDP's wrapper.
    workers = 1 if strategy == "single" else 2
    keys, plain = spawn(keys_script, workers=workers, colocated=int(strategy == "parallax"),
                        args=(strategy,))[0]
    assert keys == plain


def resume_script(phase: str, where: str) -> tuple[list[float], list[str]]:
    import polytrain
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = polytrain.distribute(model, opt, strategy="parallax")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 10, (4, 3), generator=gen), torch.randn(4, generator=gen))
               for _ in range(4)]
    start = polytrain.load(where, model, opt).step if phase == "resume" else 0
    losses = []
    for step in range(start, 4):
        x, y = (polytrain.shard(t, ctx.worker_index, ctx.num_workers) for t in batches[step])
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if phase == "save" and step == 1:
            polytrain.save(where, model, opt, step=2)
    return losses, list(polytrain.full_state_dict(model))


@pytest.mark.timeout(180)
def test_parallax_resumes_a_model_with_a_child_named_module_as_the_run_went_on(tmp_path: Path):
    # The checkpoint held the Linear named "module" alone (keys 'bias', 'weight'): the resume
    # loaded it and left the table at its initial rows, and its losses were another run's.
    where = str(tmp_path / "ck")
    whole, keys = spawn(resume_script, workers=2, colocated=1, args=("save", where))[0]
    resumed, _ = spawn(resume_script, workers=2, colocated=1, args=("resume", where))[0]
    assert keys == ["emb.weight", "module.weight", "module.bias"]
    assert resumed == whole[2:]


def test_torchs_data_parallel_is_unwrapped_as_before_and_a_child_named_module_is_not():
    # The unwrap by class (not by an attribute's name) first left torch's nn.DataParallel
    # wrapped: final.pt of a model a user wrapped in it got "module." keys, which it had not.
    from polytrain.wrapper import unwrap
    inner = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(inner)) is inner
    own = nn.Module()
    own.module = inner
    assert unwrap(own) is own
