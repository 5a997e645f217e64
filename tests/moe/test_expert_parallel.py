"""Expert parallelism over 2 and 4 processes equals the same layer with every expert local."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polytrain
from polytrain.moe import MoE, moe_apply
from tests.harness import spawn

D, E = 8, 8


def tokens_of(rank: int) -> int:
    return 5 + 3 * rank  # unequal slices: capacity must still be decided over the group


def expert_grad_diffs(sharded: MoE, layer: MoE) -> dict[str, float]:
    """Local expert i's gradients against global expert first + i's (None only if both are)."""
    full = dict(layer.experts.named_parameters())
    out = {}
    for name, p in sharded.experts.named_parameters():
        i, rest = name.split(".", 1)
        want = full[f"{sharded.first_expert + int(i)}.{rest}"].grad
        if p.grad is None or want is None:
            out[f"experts.{name}"] = 0.0 if p.grad is None and want is None else float("inf")
        else:
            out[f"experts.{name}"] = float((p.grad - want).abs().max())
    return out


def check_layer(layer: MoE, group, seed: int) -> dict[str, float]:
    """Run the all-local layer on every rank's tokens and the sharded one on this rank's."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens_of(r), D, generator=g) for r in range(ranks)]
    ws = [torch.randn(tokens_of(r), D, generator=g) for r in range(ranks)]
    x_all = torch.cat(xs).requires_grad_()
    y_all = layer(x_all)
    (y_all * torch.cat(ws)).sum().backward()  # balance losses are per rank by design: left out
    capacity = layer.gate.last_capacity
    start = sum(tokens_of(r) for r in range(rank))
    sl = slice(start, start + tokens_of(rank))

    sharded = copy.deepcopy(layer)
    sharded.zero_grad()
    sharded.shard_experts(group)
    x = xs[rank].clone().requires_grad_()
    y = sharded(x)
    (y * ws[rank]).sum().backward()
    diffs = {"out": (y - y_all[sl]).detach().abs().max(),
             "x.grad": (x.grad - x_all.grad[sl]).abs().max()}
    dense = sharded.gate.wg.weight.grad.clone()
    dist.all_reduce(dense, group=group)
    diffs["gate.grad"] = (dense - layer.gate.wg.weight.grad).abs().max()
    diffs.update(expert_grad_diffs(sharded, layer))
    if capacity is not None:
        assert sharded.gate.last_capacity == capacity
        assert int(sharded.last_load.max()) <= capacity, (sharded.last_load, capacity)
    return {k: float(v) for k, v in diffs.items()}


def skewed_routing(group) -> dict[str, float]:
    """Only experts of rank 0 get tokens (other ranks receive none); expert 1 gets none;
    the last rank drops every slot (sends none)."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    local = E // ranks
    torch.manual_seed(3)
    layer = MoE(D, E, top_k=2)
    owned = [e for e in range(local) if e != 1] or [0]
    g = torch.Generator().manual_seed(4)
    xs, idx, sc = [], [], []
    for r in range(ranks):
        t = tokens_of(r)
        xs.append(torch.randn(t, D, generator=g))
        i = torch.tensor(owned)[torch.randint(0, len(owned), (t, 2), generator=g)]
        idx.append(torch.full_like(i, -1) if r == ranks - 1 else i)
        sc.append(torch.rand(t, 2, generator=g))
    x_all = torch.cat(xs).requires_grad_()
    s_all = torch.cat(sc).requires_grad_()
    y_all, _ = moe_apply(x_all, torch.cat(idx), s_all, layer.experts, E)
    y_all.sum().backward()
    sharded = copy.deepcopy(layer)
    sharded.zero_grad()
    sharded.shard_experts(group)
    x, s = xs[rank].clone().requires_grad_(), sc[rank].clone().requires_grad_()
    y, load = moe_apply(x, idx[rank], s, sharded.experts, E, sharded.group)
    y.sum().backward()
    start = sum(tokens_of(r) for r in range(rank))
    sl = slice(start, start + tokens_of(rank))
    if rank > 0:
        assert int(load.sum()) == 0  # this rank received no tokens
    return {"out": float((y - y_all[sl]).abs().max()),
            "x.grad": float((x.grad - x_all.grad[sl]).abs().max()),
            "scores.grad": float((s.grad - s_all.grad[sl]).abs().max()),
            "expert1.chosen": float(layer.experts[1].fc.weight.grad is not None),
            **expert_grad_diffs(sharded, layer)}


def all_cases() -> dict[str, dict[str, float]]:
    ctx = polytrain.init()
    group = ctx.groups.workers
    out = {}
    torch.manual_seed(0)
    out["naive"] = check_layer(MoE(D, E, top_k=2, d_hidden=12), group, 1)
    torch.manual_seed(0)
    out["naive-k3-listed"] = check_layer(
        MoE(D, E, top_k=3, expert=lambda d: nn.Sequential(nn.Linear(d, 6), nn.GELU(),
                                                          nn.Linear(6, d))), group, 2)
    torch.manual_seed(0)
    out["gshard-eval-drops"] = check_layer(
        MoE(D, E, gate="gshard", eval_capacity_factor=0.5, capacity_factor=0.5).eval(), group, 3)
    torch.manual_seed(0)
    out["switch-drops"] = check_layer(
        MoE(D, E, gate="switch", capacity_factor=0.6, gate_options={"jitter": 0.0}), group, 4)
    out["skewed"] = skewed_routing(group)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 4])
def test_expert_parallel_equals_all_local(workers):
    results = spawn(all_cases, workers=workers)
    for rank, cases in enumerate(results):
        assert any(k.startswith("experts.") for k in cases["naive"])
        for case, diffs in cases.items():
            for name, diff in diffs.items():
                if name == "expert1.chosen":
                    assert diff == 0.0  # the expert nobody chose has no gradient
                else:
                    assert diff < 1e-5, (rank, case, name, diff)
