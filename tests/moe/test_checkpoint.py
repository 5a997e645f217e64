"""Checkpoints saved with expert-parallel size P load with P' (1 included) on other workers."""

import pytest
import torch
from torch import nn

import polytrain
from polytrain.models import GPT
from polytrain.models.gpt import Block
from polytrain.moe import (
    MoE,
    full_state_dict,
    load_sharded,
    local_state_dict,
    moefy,
    save_sharded,
)
from tests.harness import spawn


def small_expert(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, d))


def build(seed: int) -> nn.Module:
    """A GPT whose block 0 has stacked MLP experts and block 1 listed custom experts."""
    torch.manual_seed(seed)
    model = GPT(seq_len=8, d_model=16, layers=2, heads=2)
    moefy(model, 4, top_k=2)
    model.h1.mlp = MoE(16, 4, top_k=2, expert=small_expert)
    return model


def train_and_save(directory: str, expert_parallel: int) -> dict[str, torch.Tensor]:
    ctx = polytrain.init()
    model = build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = polytrain.distribute(model, opt, "moe", expert_parallel=expert_parallel)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    model(x).square().mean().backward()
    opt.step()
    # One expert group writes; the other groups hold replicas of the same experts.
    save_sharded(model.module, directory, write=ctx.worker_index < expert_parallel)
    return polytrain.full_state_dict(model)


def load(directory: str, full: dict[str, torch.Tensor]) -> tuple[float, float]:
    polytrain.init()
    model = build(1)  # other weights: loading must replace all of them
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, _ = polytrain.distribute(model, opt, "moe")
    load_sharded(model.module, directory)
    after_sharded = polytrain.full_state_dict(model)
    model.module.load_state_dict(local_state_dict(full, model.module))
    after_full = full_state_dict(model.module)
    return (max(float((after_sharded[k] - full[k]).abs().max()) for k in full),
            max(float((after_full[k] - full[k]).abs().max()) for k in full))


@pytest.mark.timeout(120)
def test_save_on_four_load_on_two_and_on_one(tmp_path):
    saved = spawn(train_and_save, workers=4, args=(str(tmp_path), 2))[0]
    untrained = build(0).state_dict()
    assert list(saved) == list(untrained)  # the all-local model's keys, in its order
    assert max(float((saved[k] - untrained[k]).abs().max()) for k in saved) > 1e-3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "shard-0.pt",
                                                         "shard-1.pt"]
    for diffs in spawn(load, workers=2, args=(str(tmp_path), saved)):
        assert diffs == (0.0, 0.0)
    one = build(1)
    load_sharded(one, tmp_path)
    assert all(torch.equal(v, saved[k]) for k, v in one.state_dict().items())


def test_a_checkpoint_of_another_expert_count_is_refused(tmp_path):
    save_sharded(build(0), tmp_path)
    torch.manual_seed(0)
    other = moefy(GPT(seq_len=8, d_model=16, layers=2, heads=2), 8)
    with pytest.raises(polytrain.ConfigError, match=r"MoE layer 'h0.mlp' has 8 experts but "
                                                    r"the checkpoint has 4"):
        load_sharded(other, tmp_path)


def test_a_checkpoint_of_another_model_or_missing_a_shard_is_refused_in_one_line(tmp_path):
    # Raw KeyError, torch's many-line load_state_dict error, FileNotFoundError.
    save_sharded(build(0), tmp_path)
    deeper = build(0)
    deeper.h2 = Block(16, 2, 64)  # a block the checkpoint lacks
    with pytest.raises(polytrain.ConfigError, match=r"h2\.\S+ is not in the checkpoint: .* is "
                                                    r"another model's"):
        load_sharded(deeper, tmp_path)
    wider = build(0)
    wider.head.out = nn.Linear(16, 300, bias=False)
    with pytest.raises(polytrain.ConfigError, match=r"head.out.weight is \(256, 16\) in the "
                                                    r"checkpoint, \(300, 16\) here"):
        load_sharded(wider, tmp_path)
    (tmp_path / "shard-0.pt").unlink()
    with pytest.raises(polytrain.ConfigError, match=r"lacks shard-0.pt, one of the 1 shards"):
        load_sharded(build(1), tmp_path)


def test_the_model_distribute_returns_saves_under_the_models_own_names(tmp_path):
    # distribute(..., strategy="moe") returns a wrapper holding the model as .module: its
    # shards were keyed "module.h0.mlp." and a plain model could not load them ("has 4
    # experts but the checkpoint has None").
    class Wrapper(nn.Module):  # as distribute()'s (and torch's DDP): marked by distribute()
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module
            self._polytrain_strategy = "moe"

    model = build(0)
    save_sharded(Wrapper(model), tmp_path)
    for into in (build(1), Wrapper(build(1))):
        load_sharded(into, tmp_path)
        plain = getattr(into, "module", into)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    # A model whose MoE layers are named otherwise is told which the checkpoint holds.
    other = nn.Sequential(build(1))
    with pytest.raises(polytrain.ConfigError, match=r"MoE layer '0.h0.mlp' is not in the "
                                                    r"checkpoint \(its MoE layers: \['h0.mlp', "
                                                    r"'h1.mlp'\]\)"):
        load_sharded(other, tmp_path)


def test_full_and_local_state_dicts_of_what_distribute_returned_use_the_models_names():
    # full_state_dict(wrapped) keyed the state "module.embed.tok.weight", and
    # local_state_dict(polytrain.full_state_dict(wrapped), wrapped) refused it ("the state has
    # no 'module.embed.tok.weight'"): they did not unwrap the model as save_sharded does.
    class Wrapper(nn.Module):  # as distribute()'s (and torch's DDP): marked by distribute()
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module
            self._polytrain_strategy = "moe"

    class Trainer:  # as the step API's: not a module, its .model is the wrapper
        def __init__(self, model: nn.Module) -> None:
            self.model = model

    model = build(0)
    want = model.state_dict()
    for wrapped in (Wrapper(model), Trainer(Wrapper(model))):
        full = full_state_dict(wrapped)
        assert list(full) == list(want)
        local = local_state_dict(full, wrapped)
        assert list(local) == list(want)
        assert all(torch.equal(local[k], want[k]) for k in want)
    # A model's own child named "module" is not a wrapper's: unwrapping it had dropped the
    # model's other layers from the state (21 keys became 17, silently).
    own = nn.Sequential()
    own.add_module("inp", nn.Linear(8, 8))
    own.add_module("module", build(0))
    marked = Wrapper(own)
    for model in (own, marked):
        assert list(full_state_dict(model)) == list(own.state_dict())
    own._polytrain_strategy = "single"  # single's wrap marks the model itself
    assert list(full_state_dict(own)) == list(own.state_dict())


def test_a_save_that_fails_midway_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    # shard-R.pt and meta.json were written in place: a save cut short (a full disk, a
    # killed process) left a truncated shard over the last good one, which then failed to load.
    save_sharded(build(0), tmp_path)
    real_save = torch.save

    def cut_short(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as out:
            out.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(OSError, match="No space left"):
        save_sharded(build(1), tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "shard-0.pt"]
    loaded = build(2)
    load_sharded(loaded, tmp_path)
    assert all(torch.equal(v, build(0).state_dict()[k]) for k, v in loaded.state_dict().items())
