"""``--strategy moe``: expert parallelism ends where ``--strategy single --model gpt-moe`` ends."""

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import polytrain
from polytrain import TrainConfig
from polytrain.cli import main
from polytrain.moe import MoE
from polytrain.strategies.moe import place_experts
from tests.harness import adam_tolerance, max_abs_diff, run_config, single_of, spawn

STEPS = 5
MODEL = {"seq_len": 16, "d_model": 32, "layers": 2, "experts": 4}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers, nodes, expert_parallel, optimizer, gate, tol", [
    (2, 1, None, "sgd", {}, 1e-6),
    (4, 2, None, "adam", {}, adam_tolerance(3e-3, STEPS)),
    (4, 2, 2, "sgd", {}, 1e-6),        # two expert groups holding replicas of the experts
    # gates that draw random numbers, drop for capacity and add balance and z-losses
    (2, 1, None, "sgd", {"gate": "gshard", "capacity_factor": 0.9, "z_loss": 0.01}, 1e-5),
    (4, 2, 2, "sgd", {"gate": "switch", "capacity_factor": 0.8, "balance_loss": 0.1}, 1e-5),
    (4, 1, None, "sgd", {"gate": "noisy", "top_k": 1, "balance_loss": 0.1}, 1e-5),
])
def test_moe_ends_where_single_ends(workers, nodes, expert_parallel, optimizer, gate, tol):
    options = {} if expert_parallel is None else {"expert_parallel": expert_parallel}
    config = TrainConfig(strategy="moe", model="gpt-moe", workers=workers, nodes=nodes,
                         steps=STEPS, batch_size=8, optimizer=optimizer,
                         lr=0.05 if optimizer == "sgd" else 3e-3,
                         model_options={**MODEL, **gate}, strategy_options=options)
    _, single = run_config(single_of(config))
    metrics, distributed = run_config(config)
    assert list(single) == list(distributed)  # same keys, experts gathered
    assert max_abs_diff(single, distributed) < tol
    _, untrained = run_config(single_of(config).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 50 * tol
    machines = metrics["traffic"]["machines"]
    if nodes > 1:
        # tokens cross machines through the all-to-all, gradients through the all-reduce
        assert len(machines) == nodes
        assert all(m["sent_bytes_per_step"] > 0 and m["recv_bytes_per_step"] > 0
                   for m in machines)


@pytest.mark.parametrize("value", [2.0, True])
def test_expert_parallel_must_be_a_whole_number(value):
    # distribute(..., "moe", expert_parallel=2.0) met a TypeError deep inside; True was 1.
    from polytrain.strategies.moe import MoEOptions

    with pytest.raises(polytrain.ConfigError, match=rf"--expert-parallel must be a whole number "
                                                    rf"\(got {value}\)\. HINT: pass "
                                                    rf"--expert-parallel 2"):
        MoEOptions(expert_parallel=value)


def test_placement_groups_consecutive_workers():
    p = place_experts((0, 1, 2, 3, 4, 5), 3)
    assert p.expert_groups == ((0, 1, 2), (3, 4, 5))
    assert p.replica_groups == ((0, 3), (1, 4), (2, 5))
    assert p.of(4) == ((3, 4, 5), (1, 4))


@pytest.mark.parametrize("args, message", [
    (["--strategy", "moe"], r"strategy 'moe' needs a model with MoE layers \(GPT has none\).*"
                            r"HINT: pass --model gpt-moe"),
    (["--strategy", "moe", "--model", "gpt-moe", "--workers", "4", "--experts", "6"],
     r"MoE layer 'h0.mlp' has 6 experts, which do not split evenly over an expert-parallel "
     r"group of 4 workers.*HINT: pass --experts a multiple of 4, or --expert-parallel one of "
     r"\[1, 2\]"),
    (["--strategy", "moe", "--model", "gpt-moe", "--workers", "4", "--expert-parallel", "3"],
     r"--expert-parallel 3 does not divide --workers 4.*HINT: pass --expert-parallel one of "
     r"\[1, 2, 4\]"),
    (["--experts", "4"], r"--experts is an option of gpt-moe, not of model 'gpt'.*HINT: leave "
                         r"it out, or pick --model gpt-moe"),
    (["--model", "gpt-moe", "--top-k", "9"],
     r"top_k \(--top-k\) must be between 1 and the number of experts 8 \(got 9\)"),
    (["--model", "gpt-moe", "--gate", "hash"], r"invalid choice: 'hash'"),
    (["--model", "gpt-moe", "--capacity-factor", "inf"],  # was OverflowError at step 1
     r"capacity_factor \(--capacity-factor\) must be positive and finite \(got inf\)"),
])
def test_bad_moe_input_gets_one_clear_line(args, message, capsys):
    import re

    with pytest.raises(SystemExit) if "hash" in args else _nothing():
        code = main(["train", "--quiet", *args])
        assert code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("strategy, servers", [("ddp", 0), ("moe", 0), ("hetpipe", 1)])
def test_gpt_moe_runs_on_emulated_devices_and_is_planned(strategy, servers, capsys):
    # Refused with "GPT cannot be timed layer by layer ... (the meta device)": the layer
    # profile's forward met nonzero() in the MoE layer's routing, for every strategy.
    config = TrainConfig(strategy=strategy, model="gpt-moe", devices="m0:fast*2", workers=2,
                         servers=servers, model_options=MODEL)
    summary = config.plan_summary()
    assert summary is None if strategy != "hetpipe" else "stage 1 on fast" in summary
    if strategy == "ddp":
        assert main(["plan", "--model", "gpt-moe", "--devices", "m0:fast*2,m1:slow*2",
                     "--d-model", "32", "--layers", "2", "--experts", "4", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert all(p["compute_s"] > 0 for p in out["predictions"].values())


def test_model_flags_become_model_options():
    from polytrain.cli import build_parser
    from polytrain.cli.train import config_from_args

    ns = build_parser().parse_args(
        ["train", "--strategy", "moe", "--model", "gpt-moe", "--workers", "4", "--experts", "8",
         "--top-k", "1", "--gate", "gshard", "--capacity-factor", "1.5", "--z-loss", "0.001",
         "--expert-parallel", "2", "--d-model", "32"])
    config = config_from_args(ns)
    assert dict(config.model_options) == {"d_model": 32, "experts": 8, "top_k": 1,
                                          "gate": "gshard", "capacity_factor": 1.5,
                                          "z_loss": 0.001}
    assert dict(config.strategy_options) == {"expert_parallel": 2}


def test_the_training_loss_includes_the_gates_balance_losses():
    config = TrainConfig(strategy="single", model="gpt-moe", steps=1, batch_size=4,
                         model_options={**MODEL, "gate": "gshard", "balance_loss": 0.0})
    plain, _ = run_config(config)
    weighted, _ = run_config(config.replace(
        model_options={**MODEL, "gate": "gshard", "balance_loss": 1.0}))
    # E * sum_e f_e P_e is about 1 per layer when routing is near uniform: 2 layers
    assert 1.5 < weighted["losses"][0] - plain["losses"][0] < 3.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "herring"])
def test_data_parallel_strategies_route_moe_gates_over_the_global_batch(strategy):
    # Every expert on every worker; the gates draw, drop for capacity and balance over the
    # global batch, so the run ends where single's does.
    config = TrainConfig(strategy=strategy, model="gpt-moe", workers=2, steps=STEPS,
                         batch_size=8, optimizer="sgd", lr=0.05,
                         model_options={**MODEL, "gate": "gshard", "capacity_factor": 0.9,
                                        "balance_loss": 0.1})
    _, single = run_config(single_of(config))
    _, distributed = run_config(config)
    assert max_abs_diff(single, distributed) < 1e-5


class _Tiny(nn.Module):
    """A linear layer and an MoE layer; ``pair``: the output is ``(y, None)``."""

    def __init__(self, pair: bool = False) -> None:
        super().__init__()
        from polytrain.moe import MoE
        self.pair = pair
        self.inp = nn.Linear(8, 8)
        self.moe = MoE(8, 4, top_k=2, gate="naive", d_hidden=16)

    def forward(self, x: torch.Tensor) -> object:
        y = self.moe(self.inp(x))
        return (y, None) if self.pair else y


def accumulation_script(expert_parallel: int | None) -> dict[str, bool]:
    """Gradients of ways to call backward that one process treats alike, compared."""
    ctx = polytrain.init()
    options = {} if expert_parallel is None else {"expert_parallel": expert_parallel}

    def made(pair: bool = False) -> nn.Module:
        torch.manual_seed(0)
        inner = _Tiny(pair)
        model, _ = polytrain.distribute(inner, torch.optim.SGD(inner.parameters(), lr=0.1),
                                        strategy="moe", **options)
        return model

    gen = torch.Generator().manual_seed(1)
    x1, x2 = (polytrain.shard(torch.randn(16, 8, generator=gen), ctx.worker_index,
                              ctx.num_workers) for _ in range(2))

    def grads(model: nn.Module, *steps: tuple) -> dict[str, torch.Tensor]:
        model.zero_grad()
        for step in steps:
            step(model)
        return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return (out[0] if isinstance(out, tuple) else out).pow(2).mean()

    model = made()
    one = grads(model, lambda m: loss(m, x1).backward())
    twice = grads(model, lambda m: loss(m, x1).backward(), lambda m: loss(m, x1).backward())
    apart = grads(model, lambda m: loss(m, x1).backward(), lambda m: loss(m, x2).backward())

    def interleaved(m: nn.Module) -> None:  # forward, forward, backward, backward
        a, b = loss(m, x1), loss(m, x2)
        a.backward()
        b.backward()
    together = grads(model, interleaved)
    paired = grads(made(pair=True), lambda m: loss(m, x1).backward())

    def bomb(grad: torch.Tensor) -> torch.Tensor:  # the first layer: reached last
        raise RuntimeError("a backward that fails")
    handle = model.module.inp.weight.register_hook(bomb)
    try:
        loss(model, x1).backward()
    except RuntimeError:
        pass
    handle.remove()
    after = grads(model, lambda m: loss(m, x1).backward())  # synchronised again
    return {"names": sorted(one) == sorted(twice) == sorted(together) == sorted(paired),
            "twice": all(torch.equal(twice[n], 2 * one[n]) for n in one),
            "interleaved": all(torch.equal(together[n], apart[n]) for n in apart),
            "pair": all(torch.equal(paired[n], one[n]) for n in one),
            "after a failure": all(torch.equal(after[n], one[n]) for n in one)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers, nodes, expert_parallel", [
    (2, 1, None),
    pytest.param(4, 2, 2, marks=pytest.mark.long),  # expert replicas summed over a group
])
def test_gradients_accumulate_over_backwards_whatever_the_model_returns(workers, nodes,
                                                                        expert_parallel):
    # Each backward divided every expert gradient held so far by W again (two backwards
    # gave 1.5x one's, not 2x); a second forward before the first backward, or a model
    # returning a tuple, left the backward unsynchronised (a review found both). A backward
    # that raises must not leave the next one unsynchronised.
    results = spawn(accumulation_script, workers=workers, nodes=nodes, args=(expert_parallel,))
    want = {"names": True, "twice": True, "interleaved": True, "pair": True,
            "after a failure": True}
    assert results == [want] * workers


def moe_edges(root: str) -> dict[str, object]:
    """What the review of the moe strategy found, on 2 workers: a parameter unfrozen after
    the wrap, float16 gradients near their range, sharded checkpoints of a step API trainer."""
    from polytrain.moe import load_sharded, save_sharded
    from polytrain.strategies.base import strategy_of
    ctx = polytrain.init()
    out: dict[str, object] = {}
    torch.manual_seed(0)
    inner = _Tiny()
    inner.inp.requires_grad_(False)
    model, _ = polytrain.distribute(inner, torch.optim.SGD(inner.parameters(), lr=0.1),
                                    strategy="moe")
    inner.inp.requires_grad_(True)  # gradual unfreezing, after the wrap
    try:
        model(torch.randn(4, 8))
        out["unfrozen"] = "accepted"
    except polytrain.ConfigError as e:
        out["unfrozen"] = e.what
    # Two workers' float16 gradients of 40,000 average to 40,000 (summed first: inf).
    half = [nn.Parameter(torch.zeros(3, dtype=torch.float16))]
    half[0].grad = torch.full((3,), 40000.0, dtype=torch.float16)
    strategy = strategy_of(model)
    strategy._reduce(half, ctx.groups.workers, ctx.topology.workers, 2)
    out["float16"] = half[0].grad.float().tolist()
    # The step API's trainer, as docs/moe.md recommends, saves and loads its experts.
    torch.manual_seed(1)
    inner = _Tiny()
    trainer = polytrain.distribute(inner, torch.optim.SGD(inner.parameters(), lr=0.1),
                                   strategy="moe", loss_fn=lambda y, t: (y - t).pow(2).mean())
    before = {k: v.clone() for k, v in inner.state_dict().items()}
    if ctx.rank == 1:
        time.sleep(1.0)  # rank 0 wrote meta.json before this rank's shard was there
    save_sharded(trainer, root)
    out["files when saved"] = sorted(p.name for p in Path(root).iterdir())
    with torch.no_grad():
        for p in inner.parameters():
            p.zero_()
    load_sharded(trainer, root)
    out["sharded"] = all(torch.equal(v, inner.state_dict()[k]) for k, v in before.items())
    trainer.close()
    # A layer already split over the workers, given to ddp: worker 0's experts were
    # broadcast over worker 1's, and gradients of different experts averaged.
    split = nn.Sequential(nn.Linear(8, 8), MoE(8, 4, top_k=1, group=ctx.groups.workers))
    try:
        polytrain.distribute(split, torch.optim.SGD(split.parameters(), lr=0.1), "ddp")
        out["split"] = "accepted"
    except polytrain.ConfigError as e:
        out["split"] = str(e)
    # A group this rank is not in: torch's "Invalid process group specified".
    only_0 = torch.distributed.new_group([0])
    try:
        MoE(8, 4, group=only_0)
        out["not in group"] = "accepted"
    except polytrain.ConfigError as e:
        out["not in group"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_unfreezing_after_the_wrap_16_bit_sums_and_a_trainers_shards(tmp_path):
    # An unfrozen parameter had no hook: never averaged, each worker stepped on its own
    # gradient. float16 gradients were summed, then divided: 2 x 40,000 was inf. save_sharded
    # of the trainer distribute(..., loss_fn=...) returns: AttributeError (no .module).
    # save_sharded returned on rank 0 (meta.json written) before rank 1's shard was there.
    # ddp took a layer built with group= (already split over the workers) without a word;
    # a group the rank is not in met torch's "Invalid process group specified".
    for rank, out in enumerate(spawn(moe_edges, workers=2, args=(str(tmp_path / "shards"),))):
        assert out["unfrozen"].startswith("parameter 'inp.weight' requires a gradient, but did "
                                          "not when the model was wrapped"), out["unfrozen"]
        assert out["float16"] == [40000.0] * 3
        assert out["files when saved"] == ["meta.json", "shard-0.pt", "shard-1.pt"]
        assert out["sharded"] is True
        assert out["split"] == (
            "MoE layer '1' is already split over 2 ranks (built with group=): strategy 'ddp' "
            "would copy worker 0's experts over the others'. HINT: build the layer without "
            "group= (strategy 'moe' splits the experts over the workers itself)")
        assert out["not in group"] == (
            "rank 1 is not in the process group given to the MoE layer. HINT: pass a group "
            "that holds this rank, or group=None (every expert here)" if rank else "accepted")
