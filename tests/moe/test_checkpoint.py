"""Checkpoints saved with expert-parallel size P load with P' (1 included) on other workers."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polytrain
import polytrain.wrapper
from polytrain.checkpoint import CheckpointError
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
from polytrain.moe.checkpoint import moe_layers
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


def train_and_save(directory: str, expert_parallel: int) -> tuple[dict[str, torch.Tensor],
                                                                 dict[str, str]]:
    ctx = polytrain.init()
    model = build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = polytrain.distribute(model, opt, "moe", expert_parallel=expert_parallel)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    model(x).square().mean().backward()
    opt.step()
    # Every expert group wrote the same .shard-R.pt.pending (they hold replicas of the same
    # experts): the saves raised FileNotFoundError, or mixed two groups' shards silently.
    # What distribute() returned says which group writes: the first.
    save_sharded(model, directory)
    # The plain model's write= was trusted with no exchange: write=True on ranks 0 and 3
    # left each waiting for its group's other rank until the timeout; on every rank, the
    # groups raced to the same files (FileNotFoundError, with a 'free space' hint).
    plain = model.module
    # expert_parallel=1: each worker holds every expert; its plain model with write unset
    # had every worker write shard-0.pt at once (ranks 1-3: the same FileNotFoundError).
    # Each worker writes, with no exchange, as the replicas they are: four at once.
    every_expert = build(0)
    whole = polytrain.distribute(every_expert, torch.optim.SGD(every_expert.parameters(),
                                                               lr=0.5), "moe",
                                 expert_parallel=1)[0]
    refused: dict[str, str] = {}
    for name, given, write in (("every rank", model, True), ("one of a group", model,
                                                             ctx.rank in (0, 3)),
                               ("plain model", plain, None),
                               ("plain, every rank", plain, True),
                               ("plain, one of a group", plain, ctx.rank in (0, 3)),
                               ("plain, every expert on each", whole.module, None),
                               # A rank that passes write=True and others that write with
                               # it unset were all said to pass write=True.
                               ("mixed", model, True if ctx.rank == 3 else None),
                               # Two groups writing one directory, one by a link to it, were
                               # taken for two directories: both wrote the same files.
                               ("alias", plain, True)):
        into = Path(directory).parent / f"{Path(directory).name}-{name}"
        if name == "alias":
            into = into.with_name(f"{Path(directory).name}.{'alias' if ctx.rank > 1 else 'real'}")
        try:
            save_sharded(given, into, write=write)
            refused[name] = "saved"
        except polytrain.ConfigError as e:
            refused[name] = str(e)
    # The second group of the plain model writes; the first does not; a directory per
    # worker for the model of every expert.
    save_sharded(plain, Path(directory).parent / f"{Path(directory).name}.second",
                 write=ctx.rank in (2, 3))
    save_sharded(whole.module, Path(directory).parent / f"{Path(directory).name}.{ctx.rank}")
    return polytrain.full_state_dict(model), refused


def tied(seed: int) -> nn.Module:
    """A GPT whose one block is applied twice (ALBERT-style): its MoE layer has two names."""
    torch.manual_seed(seed)
    model = GPT(seq_len=8, d_model=16, layers=2, heads=2)
    model.h1 = model.h0
    return moefy(model, 4, top_k=2)


def distributed(model: nn.Module) -> nn.Module:
    return polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.5), "moe")[0]


def largest_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def load(directory: str, full: dict[str, torch.Tensor], scratch: str) -> dict[str, object]:
    ctx = polytrain.init()
    model = distributed(build(1))  # other weights: loading must replace all of them
    load_sharded(model.module, directory)
    after_sharded = polytrain.full_state_dict(model)
    model.module.load_state_dict(local_state_dict(full, model.module))
    after_full = full_state_dict(model.module)
    out: dict[str, object] = {"sharded": largest_diff(after_sharded, full),
                              "full": largest_diff(after_full, full)}
    # A tied block: its experts under the second name were taken for dense tensors.
    single = tied(0).state_dict()
    model = distributed(tied(1))
    model.module.load_state_dict(local_state_dict(single, model.module))
    layer = model.module.h0.mlp
    out["tied experts"] = max(float((layer.experts[i].fc.weight - single[
        f"h0.mlp.experts.{layer.first_expert + i}.fc.weight"]).abs().max())
        for i in range(layer.num_local))
    gathered = full_state_dict(model)
    out["tied keys"] = list(gathered) == list(single)
    out["tied full"] = largest_diff(gathered, single) if out["tied keys"] else None
    # A save cut short on rank 1 (a full disk): rank 0 renamed its new shard over the old
    # one, and the directory loaded half of each model without a word; rank 0 met gloo's
    # timeout, which names no one.
    old, new = distributed(build(2)), distributed(build(3))
    save_sharded(old, scratch)
    real_save = torch.save
    if ctx.rank == 1:
        def full_disk(*args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")
        torch.save = full_disk
    try:
        save_sharded(new, scratch)
        out["cut short"] = "saved"
    except CheckpointError as e:
        out["cut short"] = str(e)
    finally:
        torch.save = real_save
    # One expert group (every worker): write=True on rank 0 alone was trusted; rank 1
    # returned, and rank 0 waited for it until the timeout, leaving .shard-0.pt.pending.
    try:
        save_sharded(new, scratch, write=ctx.rank == 0)
        out["one group, rank 0"] = "saved"
    except polytrain.ConfigError as e:
        out["one group, rank 0"] = str(e)
    # One expert group, a directory per rank: "other expert groups hold copies" (there are
    # none) of the plain model, "rank 0 passes write=True" (none did) of the wrapped one.
    for name, given in (("plain", new.module), ("wrapped", new)):
        try:
            save_sharded(given, Path(scratch) / f"{name}-{ctx.rank}")
            out[f"a directory per rank, {name}"] = "saved"
        except polytrain.ConfigError as e:
            out[f"a directory per rank, {name}"] = str(e)
    # mkdir failing on rank 1 alone (a path below a file there) raised a bare
    # NotADirectoryError before the exchange: rank 0 waited in it until the timeout.
    real_mkdir = Path.mkdir
    if ctx.rank == 1:
        def below_a_file(self: Path, *args: object, **kwargs: object) -> None:
            raise NotADirectoryError(20, "Not a directory", str(self))
        Path.mkdir = below_a_file  # type: ignore[method-assign]
    try:
        save_sharded(new, Path(scratch) / "sub")
        out["no mkdir"] = "saved"
    except CheckpointError as e:
        out["no mkdir"] = str(e)
    finally:
        Path.mkdir = real_mkdir  # type: ignore[method-assign]
    into = distributed(build(4))
    load_sharded(into, scratch)
    # Under ddp (every worker holds every expert) each worker wrote shard-0.pt at once: one
    # failed in a rename, or both returned and the files mixed. Worker 0 writes, with no
    # exchange (torch's `if rank == 0: save` works: an exchange hung it), and a load on
    # every worker follows a barrier.
    under = Path(scratch) / "under-ddp"
    dense = build(5)
    wrapped = polytrain.distribute(dense, torch.optim.SGD(dense.parameters(), lr=0.5), "ddp")[0]
    save_sharded(wrapped, under)
    dist.barrier(group=ctx.groups.workers)
    load_sharded(wrapped, under)
    out["under ddp"] = sorted(p.name for p in under.iterdir())
    if ctx.rank == 0:
        save_sharded(wrapped, Path(scratch) / "rank-0-only")
    out["rank 0 alone"] = sorted(p.name for p in (Path(scratch) / "rank-0-only").iterdir()) \
        if ctx.rank == 0 else None
    # The plain model is each worker's own to save, as before; torch's `if rank == 0:` with
    # it waited in an exchange of the workers until the timeout (PeerLost).
    save_sharded(dense, Path(scratch) / f"own-{ctx.rank}")
    out["own"] = (Path(scratch) / f"own-{ctx.rank}" / "meta.json").exists()
    if ctx.rank == 0:
        save_sharded(dense, Path(scratch) / "plain-rank-0-only")
    out["plain, rank 0 alone"] = sorted(p.name for p in (Path(scratch) / "plain-rank-0-only"
                                                         ).iterdir()) if ctx.rank == 0 else None
    out["after the cut"] = largest_diff(full_state_dict(into), full_state_dict(old))
    # polytrain.load of a larger model's checkpoint: ddp's is refused, moe's loaded step 1.
    def trainer(layers: int) -> polytrain.Trainer:
        torch.manual_seed(0)
        model = moefy(GPT(seq_len=8, d_model=16, layers=layers, heads=2), 4)
        return polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.5), "moe",
                                    loss_fn=lambda y, t: y.square().mean())
    larger, smaller = trainer(2), trainer(1)
    polytrain.save(Path(scratch) / "run", larger, step=1)
    try:
        out["larger"] = f"loaded step {polytrain.load(Path(scratch) / 'run', smaller).step}"
    except CheckpointError as e:
        out["larger"] = str(e)
    larger.close()
    smaller.close()
    # The group's exchange failing (a peer gone): gloo's text, which names no one. (The
    # workers' exchange of who writes comes first, and passes.)
    real_gather = dist.all_gather_object
    calls = []

    def timed_out(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            return real_gather(*args, **kwargs)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Timed out waiting 30000ms for "
                           "recv operation to complete")
    dist.all_gather_object = timed_out
    try:
        save_sharded(new, Path(scratch) / "other")
        out["lost"] = "saved"
    except polytrain.CommError as e:
        out["lost"] = str(e)
    finally:
        dist.all_gather_object = real_gather
    return out


@pytest.mark.timeout(120)
def test_save_on_four_load_on_two_and_on_one(tmp_path):
    real = tmp_path.parent / f"{tmp_path.name}.real"
    real.mkdir()
    (tmp_path.parent / f"{tmp_path.name}.alias").symlink_to(real, target_is_directory=True)
    results = spawn(train_and_save, workers=4, args=(str(tmp_path), 2))
    saved = results[0][0]
    groups = "expert groups (0, 1), (2, 3)"
    hint = ("HINT: leave write unset (the first expert group writes), or pass write=True on "
            "the ranks of one expert group and write=False on the others")
    every = (f"save_sharded writes each shard once, from one expert group, but ranks 0, 1, 2, "
             f"3 pass write=True ({groups}): ranks 0 and 2 hold the same experts and would "
             f"both write shard-0.pt. {hint}")
    one_of = (f"save_sharded writes each shard once, from one expert group, but ranks 0, 3 "
              f"pass write=True ({groups}). {hint}")
    unset = ("HINT: pass what distribute() returned (its first expert group then writes), or "
             "write=True on the ranks of one expert group and write=False on the others")
    for _, refused in results:
        assert refused == {
            "every rank": every, "one of a group": one_of,
            "plain model": f"save_sharded: the MoE layers' experts are split over 2 of the 4 "
                           f"workers (other expert groups hold copies), and write is unset. "
                           f"{unset}",
            "plain, every rank": every, "plain, one of a group": one_of,
            "plain, every expert on each": "saved",
            "mixed": f"save_sharded writes each shard once, from one expert group, but rank 3 "
                     f"passes write=True and ranks 0, 1 write with write unset ({groups}): "
                     f"ranks 1 and 3 hold the same experts and would both write shard-1.pt. "
                     f"{hint}",
            "alias": every}, refused
    four = tmp_path.parent / f"{tmp_path.name}-plain, every expert on each"
    assert [p for p in tmp_path.parent.iterdir() if p.name.startswith(f"{tmp_path.name}-")] \
        == [four]
    assert sorted(p.name for p in four.iterdir()) == ["meta.json", "shard-0.pt"]
    loaded = build(1)
    load_sharded(loaded, four)
    assert all(torch.equal(v, build(0).state_dict()[k]) for k, v in loaded.state_dict().items())
    assert list(real.iterdir()) == []
    for name in ("second", "0", "1", "2", "3"):
        assert sorted(p.name for p in (tmp_path.parent / f"{tmp_path.name}.{name}").iterdir()
                      ) == ["meta.json", "shard-0.pt"] + ["shard-1.pt"] * (name == "second")
    untrained = build(0).state_dict()
    assert list(saved) == list(untrained)  # the all-local model's keys, in its order
    assert max(float((saved[k] - untrained[k]).abs().max()) for k in saved) > 1e-3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "shard-0.pt",
                                                         "shard-1.pt"]
    scratch = tmp_path.parent / f"{tmp_path.name}-scratch"
    for rank, out in enumerate(spawn(load, workers=2, args=(str(tmp_path), saved,
                                                             str(scratch)))):
        assert out["sharded"] == out["full"] == 0.0
        # The tied block's experts under both names (rank 1's had experts 0 and 1: 0.65 off,
        # and the gathered state lacked h1.mlp.experts.2 and 3).
        assert out["tied experts"] == 0.0
        assert out["tied keys"] is True
        assert out["tied full"] == 0.0
        assert out["cut short"] == (
            f"could not save the sharded MoE checkpoint in {scratch}: rank 1: OSError: [Errno "
            f"28] No space left on device. HINT: pass a directory this rank can write, with "
            f"free space; the last whole checkpoint there is untouched"), out["cut short"]
        assert out["after the cut"] == 0.0  # the last whole save, not half of each
        assert out["one group, rank 0"] == (
            "save_sharded writes each shard once, from one expert group, but rank 0 passes "
            "write=True (expert groups (0, 1)). HINT: leave write unset (the first expert "
            "group writes), or pass write=True on the ranks of one expert group and "
            "write=False on the others"), out["one group, rank 0"]
        assert out["no mkdir"] == (
            f"could not save the sharded MoE checkpoint in {scratch / 'sub'}: rank 1: "
            f"NotADirectoryError: [Errno 20] Not a directory: '{scratch / 'sub'}'. HINT: pass "
            f"a directory this rank can write, with free space; the last whole checkpoint "
            f"there is untouched"), out["no mkdir"]
        assert out["under ddp"] == ["meta.json", "shard-0.pt"] and out["own"] is True
        assert out["rank 0 alone"] == out["plain, rank 0 alone"] == (
            ["meta.json", "shard-0.pt"] if rank == 0 else None)
        for name in ("plain", "wrapped"):
            assert out[f"a directory per rank, {name}"] == (
                f"save_sharded: the ranks of expert group (0, 1) gave different directories: "
                f"{scratch / name}-0 (rank 0), {scratch / name}-1 (rank 1). HINT: pass every "
                f"rank of an expert group the same directory (it writes its shards side by "
                f"side)"), out[f"a directory per rank, {name}"]
        assert out["larger"] == (
            f"checkpoint {scratch / 'run' / 'step-1'} is of another model: it has "
            f"'h1.attn.proj.bias', which this model lacks. HINT: resume with the checkpoint's "
            f"--model and model options, or start without --resume"), out["larger"]
        assert out["lost"].startswith(
            f"rank {rank}: save_sharded's exchange with the expert-parallel group (ranks 0, 1) "
            f"did not complete within 30 s"), out["lost"]
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


def test_a_checkpoint_of_a_larger_model_is_refused(tmp_path):
    # Only this model's keys were looked up: a 2-layer model's checkpoint loaded into a
    # 1-layer model without a word, MoE layer h1 or dense h1 alike.
    def gpt(layers: int, every: int = 1) -> nn.Module:
        torch.manual_seed(0)
        return moefy(GPT(seq_len=8, d_model=16, layers=layers, heads=2), 4, every=every)

    save_sharded(gpt(2), tmp_path / "moe")
    with pytest.raises(polytrain.ConfigError, match=r"the checkpoint's MoE layer 'h1.mlp' is "
                                                    r"not in this model \(its MoE layers: "
                                                    r"\['h0.mlp'\]\)"):
        load_sharded(gpt(1), tmp_path / "moe")
    save_sharded(gpt(2, every=2), tmp_path / "dense")
    with pytest.raises(polytrain.ConfigError, match=r"the checkpoint has h1.ln1.weight, which "
                                                    r"this model lacks: .*dense is another "
                                                    r"model's"):
        load_sharded(gpt(1), tmp_path / "dense")


def test_every_name_of_a_shared_moe_layer_is_listed():
    # named_modules() lists a shared module once: the experts under its second name were
    # taken for dense tensors (see test_save_on_four_load_on_two_and_on_one).
    model = tied(0)
    assert moe_layers(model) == [("h0.mlp.", model.h0.mlp),
                                 ("h1.mlp.", model.h0.mlp)]


def test_a_shard_of_another_save_is_refused(tmp_path):
    # A save cut short between two ranks' renames left one rank's new shard beside the
    # other's old one and the old meta.json: it loaded half of each model silently.
    save_sharded(build(0), tmp_path / "a")
    save_sharded(build(1), tmp_path / "b")
    shutil.copy(tmp_path / "b" / "shard-0.pt", tmp_path / "a" / "shard-0.pt")
    with pytest.raises(polytrain.ConfigError, match=r"a[/\\]shard-0.pt is of another save "
                                                    r"than meta.json lists: a save_sharded\(\) "
                                                    r"was cut short there\. HINT: save the "
                                                    r"model again"):
        load_sharded(build(2), tmp_path / "a")


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
    class Wrapper(polytrain.wrapper.Wrapper):  # as distribute()'s (and torch's DDP)
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

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
    class Wrapper(polytrain.wrapper.Wrapper):  # as distribute()'s (and torch's DDP)
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

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
    own._polytrain_strategy = "single"  # a strategy that hands the model back marks it (parallax)
    assert list(full_state_dict(own)) == list(own.state_dict())
    # Nor when it is the model's one child (an EMA's shape), marked so: it had been unwrapped.
    alone = nn.Sequential()
    alone.add_module("module", build(0))
    alone._polytrain_strategy = "parallax"
    assert list(full_state_dict(alone)) == list(alone.state_dict())


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
    with pytest.raises(CheckpointError, match=r"rank 0: OSError: \[Errno 28\] No space left"):
        save_sharded(build(1), tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "shard-0.pt"]
    loaded = build(2)
    load_sharded(loaded, tmp_path)
    assert all(torch.equal(v, build(0).state_dict()[k]) for k, v in loaded.state_dict().items())


def test_replicas_that_save_one_directory_at_once_take_turns_and_it_loads(tmp_path,
                                                                          monkeypatch):
    # From a review: workers that each hold every expert (ddp, herring) saving their plain
    # models to one directory shared one temporary file name: a save that came in between
    # another's write and its rename took its file (FileNotFoundError, "free space" hinted),
    # and one that came in before another's meta.json left that meta.json listing another
    # save than the shard there, which load_sharded() refused. Here a second save (another
    # thread: the directory's lock is held per open descriptor) comes in at each of those
    # points, and waits for the first to end.
    import threading

    model, other = build(0), build(1)  # (copies that differ: BatchNorm's, say)
    real_save, real_replace = torch.save, os.replace
    state: dict = {"at": "", "armed": True, "into": tmp_path, "thread": None, "raised": []}

    def second() -> None:
        try:
            save_sharded(other, state["into"])
        except Exception as e:  # noqa: BLE001 - a thread's error is otherwise lost
            state["raised"].append(e)

    def another_save(here: str) -> None:
        if state["armed"] and here == state["at"]:
            state["armed"] = False
            state["thread"] = threading.Thread(target=second)
            state["thread"].start()
            state["thread"].join(0.3)
            assert state["thread"].is_alive()  # it waits its turn

    def save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        another_save("after its shard's write")

    def replace(src, dst):
        if Path(dst).name == "meta.json":
            another_save("before its meta.json")
        real_replace(src, dst)

    for at in ("after its shard's write", "before its meta.json"):
        state.update(at=at, armed=True, into=tmp_path / at)
        monkeypatch.setattr(torch, "save", save)
        monkeypatch.setattr(os, "replace", replace)
        save_sharded(model, tmp_path / at)
        state["thread"].join(30)
        monkeypatch.undo()
        assert not state["armed"] and not state["thread"].is_alive() and not state["raised"]
        assert sorted(p.name for p in (tmp_path / at).iterdir()) == ["meta.json", "shard-0.pt"]
        loaded = build(2)
        load_sharded(loaded, tmp_path / at)  # the second save's, whole
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_a_directory_that_cannot_be_made_is_refused_as_a_failed_save(tmp_path):
    # mkdir's bare FileExistsError / NotADirectoryError, raised before the exchange every
    # rank meets: a peer whose mkdir worked waited there until the timeout.
    afile = tmp_path / "afile"
    afile.write_text("")
    for where, error in ((afile, r"FileExistsError: \[Errno 17\] File exists"),
                         (afile / "sub", r"NotADirectoryError: \[Errno 20\] Not a directory")):
        at = re.escape(str(where))
        with pytest.raises(CheckpointError, match=rf"^could not save the sharded MoE checkpoint "
                                                  rf"in {at}: rank 0: {error}: .*\. HINT: pass "
                                                  rf"a directory this rank can write"):
            save_sharded(build(0), where)
    assert afile.read_text() == ""


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    # json's JSONDecodeError and torch's "PytorchStreamReader failed reading zip archive".
    save_sharded(build(0), tmp_path)
    meta = tmp_path / "meta.json"
    whole = meta.read_text()
    again = (r"\. HINT: save the model again, or copy back the whole directory "
             r"save_sharded\(\) wrote$")
    for text, what in (("{trunc", r"JSONDecodeError: Expecting property name.*"),
                       ("[1, 2]", r"not a JSON object")):
        meta.write_text(text)
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(meta))} is damaged: "
                                                  rf"{what}{again}"):
            load_sharded(build(1), tmp_path)
    # From a review: a meta.json edited into valid JSON of other kinds met KeyError,
    # ValueError, ZeroDivisionError or IndexError.
    fields = json.loads(whole)
    for edit, what in (({"ranks": None}, r"it has no ranks"),
                       ({"experts": None}, r"it has no experts"),
                       ({"ranks": "x"}, r"its ranks is 'x', not a count of shards"),
                       ({"ranks": 0}, r"its ranks is 0, not a count of shards"),
                       ({"ranks": True}, r"its ranks is True, not a count of shards"),
                       ({"experts": []}, r"its experts is \[\], not a mapping of MoE layers to "
                                         r"expert counts"),
                       ({"experts": {"h0.mlp.": "4"}}, r"its experts is \{'h0\.mlp\.': '4'\}, "
                                                      r"not a mapping of MoE layers to expert "
                                                      r"counts"),
                       ({"saves": []}, r"it lists 0 saves for its 1 shards"),
                       ({"saves": "ab"}, r"its saves is 'ab', not a list of saves"),
                       ({"ranks": 8, "saves": ["a"] * 8}, r"its 4 experts of MoE layer "
                                                          r"'h0\.mlp' cannot be split over its 8 "
                                                          r"shards")):
        meta.write_text(json.dumps({k: v for k, v in {**fields, **edit}.items()
                                    if v is not None}))
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(meta))} is damaged: "
                                                  rf"{what}{again}"):
            load_sharded(build(1), tmp_path)
    meta.write_text(whole)
    shard = tmp_path / "shard-0.pt"
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(shard))} is damaged: "
                                              rf"RuntimeError: PytorchStreamReader failed "
                                              rf".*{again}"):
        load_sharded(build(1), tmp_path)
