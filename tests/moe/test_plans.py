"""Pure parts of the MoE layer: capacity rule, routing, expert-major order, grouped experts."""

import pytest
import torch

from polytrain.moe.capacity import allowance, expert_capacity, keep_mask
from polytrain.moe.dispatch import expert_major, route
from polytrain.moe.experts import ExpertMLP, chunk_plan, grouped_mm


def kept_by_simulation(indices_by_rank: list[torch.Tensor], capacity: int,
                       experts: int) -> list[torch.Tensor]:
    """The priority rule spelled out: slot-major, then rank, then token; first come first kept."""
    used = [0] * experts
    kept = [torch.zeros_like(i, dtype=torch.bool) for i in indices_by_rank]
    for s in range(indices_by_rank[0].shape[1]):
        for r, idx in enumerate(indices_by_rank):
            for t in range(idx.shape[0]):
                e = int(idx[t, s])
                if e >= 0 and used[e] < capacity:
                    used[e] += 1
                    kept[r][t, s] = True
    return kept


@pytest.mark.parametrize("seed", range(5))
def test_capacity_rule_keeps_what_the_priority_order_keeps(seed):
    g = torch.Generator().manual_seed(seed)
    ranks, k, experts = 3, 2, 4
    indices = [torch.randint(-1, experts, (int(torch.randint(0, 9, (1,), generator=g)), k),
                             generator=g) for _ in range(ranks)]
    capacity = 3
    counts = torch.stack([torch.nn.functional.one_hot(i.clamp(min=0), experts).mul(
        (i >= 0).unsqueeze(-1)).sum(0) for i in indices])          # (ranks, k, E)
    want = kept_by_simulation(indices, capacity, experts)
    total = torch.zeros(experts, dtype=torch.long)
    for r in range(ranks):
        got = keep_mask(indices[r], allowance(counts, capacity, r))
        assert torch.equal(got, want[r])
        total += torch.bincount(indices[r][got], minlength=experts)
    assert (total <= capacity).all()


def test_capacity_with_all_ranks_concatenated_is_the_single_process_rule():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 4, (5, 2), generator=g) for _ in range(2)]
    whole = torch.cat(parts)

    def counts(i):
        return torch.nn.functional.one_hot(i, 4).sum(0)

    both = torch.stack([counts(p) for p in parts])
    one = keep_mask(whole, allowance(counts(whole).unsqueeze(0), 3, 0))
    split = torch.cat([keep_mask(p, allowance(both, 3, r)) for r, p in enumerate(parts)])
    assert torch.equal(one, split)


def test_expert_capacity_formula():
    assert expert_capacity(4096, 32, 2, 1.25) == 320
    assert expert_capacity(10, 4, 1, 1.0) == 3


def test_route_sorts_kept_slots_by_expert_in_token_order():
    r = route(torch.tensor([[2, 0], [0, -1], [2, 2]]), num_experts=3)
    assert r.slots.tolist() == [1, 2, 0, 4, 5]
    assert r.counts.tolist() == [2, 0, 3]
    assert r.token_of_row.tolist() == [0, 1, 0, 2, 2]


def test_expert_major_order():
    counts = torch.tensor([[2, 0, 1], [0, 3, 1]])  # rows by (source rank, local expert)
    # received: r0e0 r0e0 r0e2 r1e1 r1e1 r1e1 r1e2 -> e0: 0 1, e1: 3 4 5, e2: 2 6
    assert expert_major(counts).tolist() == [0, 1, 3, 4, 5, 2, 6]
    assert expert_major(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def test_chunk_plan_covers_every_row_once():
    counts = [3, 0, 7, 2, 2, 0, 9]
    plan = chunk_plan(counts, max_rows=5)
    assert plan[0][0] == 0 and plan[-1][1] == len(counts) and plan[-1][3] == sum(counts)
    for (a, b, r0, r1), (c, _, r2, _) in zip(plan, plan[1:]):
        assert b == c and r1 == r2 and sum(counts[a:b]) == r1 - r0
    assert all(r1 - r0 <= 5 or b - a == 1 for a, b, r0, r1 in plan)


@pytest.mark.parametrize("grouped", [None, True])
@pytest.mark.parametrize("width", [4, 3])  # 3: unaligned for _grouped_mm, the fallback runs
def test_grouped_mm_equals_per_expert_matmuls(width, grouped):
    x, w, b = torch.randn(9, width), torch.randn(3, width, 8), torch.randn(3, 8)
    counts = [4, 0, 5]
    want = torch.cat([x[:4] @ w[0] + b[0], x[4:] @ w[2] + b[2]])
    assert torch.allclose(grouped_mm(x, w, counts, bias=b, grouped=grouped), want, atol=1e-6)
    out = torch.empty(9, 8)
    assert grouped_mm(x, w, counts, bias=b, out=out, grouped=grouped) is out
    assert torch.allclose(out, want, atol=1e-6)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 8 * 6 * 8])  # one chunk; many chunks
def test_grouped_experts_gradients(chunk_bytes):
    torch.manual_seed(0)
    bank = ExpertMLP(3, d_model=4, d_hidden=6, chunk_bytes=chunk_bytes).double()
    x = torch.randn(11, 4, dtype=torch.double, requires_grad=True)
    counts = [4, 0, 7]
    torch.autograd.gradcheck(lambda x, *p: bank(x, counts), (x, *bank.parameters()))
    ref = torch.cat([bank[0](x[:4]), bank[2](x[4:])])
    assert torch.allclose(bank(x, counts), ref)


def test_chunks_are_sized_by_the_device_unless_given():
    from polytrain.moe.experts import CHUNK_BYTES, GPU_CHUNK_BYTES
    bank = ExpertMLP(3, d_model=8, d_hidden=16)
    assert bank.chunk_rows(torch.device("cpu")) == CHUNK_BYTES // (16 * 4)
    assert bank.chunk_rows(torch.device("cuda")) == GPU_CHUNK_BYTES // (16 * 4)
    assert bank.stream_rows(torch.device("cpu")) == CHUNK_BYTES // (16 * 4) // 4
    bank.chunk_bytes = 16 * 4 * 6
    assert bank.chunk_rows(torch.device("cuda")) == bank.chunk_rows(torch.device("cpu")) == 6


def test_grouped_kernel_and_per_expert_path_agree(monkeypatch):
    from polytrain.moe import experts

    torch.manual_seed(0)
    bank = ExpertMLP(3, d_model=8, d_hidden=16, chunk_bytes=16 * 4 * 6)  # chunks of 6 rows
    x = torch.randn(13, 8, requires_grad=True)
    counts, gy = [5, 0, 8], torch.randn(13, 8)

    def run():
        bank.zero_grad()
        x.grad = None
        bank(x, counts).backward(gy)
        return [x.grad.clone()] + [p.grad for p in bank.parameters()]

    per_expert = run()
    assert experts._grouped_mm_works("cpu", torch.float32)  # torch 2.13 has it on the CPU
    monkeypatch.setattr(experts, "_use_grouped", lambda grouped, *t: experts._aligned(*t))
    for a, b in zip(per_expert, run()):
        if a is None:  # expert 1 had no rows: no gradient either way
            assert b is None
        else:
            assert torch.allclose(a, b, atol=1e-5)
    assert all(p.grad is None for p in bank[1].parameters())
