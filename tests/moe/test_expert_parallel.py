"""Expert parallelism over 2 and 4 processes equals the same layer with every expert local."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polytrain
from polytrain.moe import MoE, aux_loss, moe_apply
from polytrain.moe.capacity import expert_capacity
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


def every_ranks_tokens(group, seed: int):
    """(rank, ranks, every rank's tokens, every rank's output weights, this rank's slice)."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens_of(r), D, generator=g) for r in range(ranks)]
    ws = [torch.randn(tokens_of(r), D, generator=g) for r in range(ranks)]
    start = sum(tokens_of(r) for r in range(rank))
    return rank, ranks, xs, ws, slice(start, start + tokens_of(rank))


def sharded_copy(layer: MoE, group) -> MoE:
    sharded = copy.deepcopy(layer)
    sharded.zero_grad()
    sharded.shard_experts(group)
    return sharded


def check_layer(layer: MoE, group, seed: int) -> dict[str, float]:
    """Run the all-local layer on every rank's tokens and the sharded one on this rank's."""
    rank, ranks, xs, ws, sl = every_ranks_tokens(group, seed)
    x_all = torch.cat(xs).requires_grad_()
    y_all = layer(x_all)
    (y_all * torch.cat(ws)).sum().backward()  # the losses: gate_over_global_batch
    capacity = layer.gate.last_capacity

    sharded = sharded_copy(layer, group)
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
    sharded = sharded_copy(layer, group)
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


def routed(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output and its gate's chosen experts (after capacity)."""
    seen = []
    hook = layer.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[0]))
    try:
        return layer(x), seen[0]
    finally:
        hook.remove()


def gate_over_global_batch(gate: str, options: dict, group) -> dict[str, float]:
    """A gate that draws and balances, training: each rank's part against the global batch.

    The ranks average their gradients (as DDP and --strategy moe do), so the
    task loss of one process is the mean of the ranks' summed outputs.
    """
    torch.manual_seed(0)
    layer = MoE(D, E, gate=gate, d_hidden=12, balance_weight=0.5, z_loss_weight=0.1, **options)
    rank, ranks, xs, ws, sl = every_ranks_tokens(group, 5)
    x_all = torch.cat(xs).requires_grad_()
    torch.manual_seed(6)
    y_all, indices_all = routed(layer, x_all)
    next_all = torch.rand(4)  # the generator after the forward
    aux_all = layer.gate.loss.detach().clone()
    ((y_all * torch.cat(ws)).sum() / ranks + aux_loss(layer)).backward()

    sharded = sharded_copy(layer, group)
    x = xs[rank].clone().requires_grad_()
    torch.manual_seed(6)  # every rank's generator where the one process's was
    y, indices = routed(sharded, x)
    next_mine = torch.rand(4)
    aux = sharded.gate.loss.detach().clone()
    ((y * ws[rank]).sum() + aux_loss(sharded)).backward()
    dense = {n: p.grad.clone() for n, p in sharded.gate.named_parameters()}
    for grad in dense.values():
        dist.all_reduce(grad, group=group)
        grad.div_(ranks)
    full = dict(layer.gate.named_parameters())
    diffs = {"indices": float((indices != indices_all[sl]).sum()),
             "out": (y - y_all[sl]).detach().abs().max(),
             "aux": (aux - aux_all).abs(),
             "x.grad": (x.grad / ranks - x_all.grad[sl]).abs().max(),
             "generator after": (next_mine - next_all).abs().max(),
             "dropped": -float((indices_all[:, 0] < 0).any())}  # capacity dropped a slot 0
    diffs.update({f"gate.{n}.grad": (g - full[n].grad).abs().max() for n, g in dense.items()})
    for p in sharded.experts.parameters():
        if p.grad is not None:
            p.grad.div_(ranks)
    diffs.update(expert_grad_diffs(sharded, layer))
    return {k: float(v) for k, v in diffs.items()}


def gate_cases() -> dict[str, dict[str, float]]:
    group = polytrain.init().groups.workers
    return {
        "noisy": gate_over_global_batch("noisy", {"top_k": 2}, group),
        "gshard": gate_over_global_batch("gshard", {"capacity_factor": 0.8}, group),
        "switch": gate_over_global_batch("switch", {"capacity_factor": 0.7,
                                                    "gate_options": {"jitter": 0.3}}, group),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 4])
def test_gates_that_draw_and_balance_route_as_one_process_with_the_global_batch(workers):
    for rank, cases in enumerate(spawn(gate_cases, workers=workers)):
        for case, diffs in cases.items():
            assert diffs.pop("dropped") == (0.0 if case == "noisy" else -1.0), (rank, case)
            for name, diff in diffs.items():
                assert diff < 1e-5, (rank, case, name, diff)


def alone_in_eval() -> list[bool]:
    """With every worker as the batch group, rank 0 evaluates and infers alone (all experts
    local: no expert group), and the gate pickles without the run's group."""
    group = polytrain.init().groups.workers
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    layer = MoE(D, E, gate="gshard", capacity_factor=0.5, z_loss_weight=0.1)
    layer.set_batch_group(group)
    done = []
    if rank == 0:
        x = torch.randn(6, D)
        layer.eval()(x)
        done.append(layer.gate.last_capacity == expert_capacity(6, E, 2, 2.4))  # gshard's
        with torch.no_grad():
            layer.train()(x)
        done.append(float(layer.gate.loss) > 0)
        done.append(pickle.loads(pickle.dumps(layer.gate)).batch_group is None)
    dist.barrier(group)
    return done


@pytest.mark.timeout(120)
def test_a_gate_with_a_batch_group_evaluates_on_one_rank_alone():
    first, second = spawn(alone_in_eval, workers=2)
    assert first == [True, True, True] and second == []


def float32_and_half_losses(layer: MoE, x: torch.Tensor) -> tuple[float, float]:
    """The gate's aux loss on ``x`` in float32, then in float16 (the same draws)."""
    losses = []
    for dtype in (torch.float32, torch.float16):
        gate = layer.gate.to(dtype)
        torch.manual_seed(1)
        gate(x.to(dtype))
        losses.append(float(gate.loss.detach()))
    return losses[0], losses[1]


@pytest.mark.parametrize("gate", ["noisy", "gshard", "switch"])
def test_half_precision_gates_count_past_65504_tokens(gate):
    torch.manual_seed(0)
    layer = MoE(D, E, gate=gate, d_hidden=4, dropless=gate != "noisy",  # (noisy: no capacity)
                z_loss_weight=0.1)
    want, got = float32_and_half_losses(layer, torch.randn(80_000, D))
    assert abs(got - want) < 1e-2 * want, (got, want)


@pytest.mark.parametrize("gate", ["noisy", "gshard", "switch"])
def test_half_precision_gates_count_past_65504_tokens_on_one_expert(gate):
    # A collapsed router (every token to one expert, when the balance loss matters most):
    # the per-expert sums were taken in float16 and were inf before the float32 cast.
    torch.manual_seed(0)
    layer = MoE(D, E, gate=gate, d_hidden=4, dropless=gate != "noisy")  # (noisy: no capacity)
    with torch.no_grad():
        layer.gate.wg.weight.zero_()
        layer.gate.wg.weight[0] = 3.0
    want, got = float32_and_half_losses(layer, torch.rand(70_000, D) + 0.5)
    assert abs(got - want) < 1e-2 * want, (got, want)


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
