"""Pure plans: Theorem 1's shares and the placement that realises them, without communication."""

import pytest
import torch

from polytrain import ConfigError
from polytrain.comm import TensorSpec
from polytrain.comm.topology import Topology
from polytrain.models import GPT
from polytrain.strategies.byteps.plan import (
    MIN_SPLIT_BYTES,
    optimal_shares,
    plan_for,
    plan_placement,
)

F32 = torch.float32


def gpt_specs(**options):
    return [TensorSpec.of(n, p) for n, p in GPT(**options).named_parameters()]


def t_opt(n, k):
    """The paper's optimum, in units of M/B (written out again here, not taken from the plan)."""
    return 2 * n * (n - 1) / (n * n + k * n - 2 * k)


@pytest.mark.parametrize("n", range(2, 9))
def test_shares_equalise_worker_and_cpu_machine_traffic_at_t_opt(n):
    for k in range(1, n + 1):
        s = optimal_shares(n, k)
        assert s.worker_machine_traffic() == pytest.approx(t_opt(n, k))
        assert s.cpu_machine_traffic() == pytest.approx(t_opt(n, k))
        assert s.cpu == pytest.approx(2 * k * (n - 1) / (n * n + k * n - 2 * k))


def test_special_cases_are_all_reduce_and_the_parameter_server():
    assert optimal_shares(8, 4).traffic_per_machine() == pytest.approx(1.27, abs=0.005)
    ring = optimal_shares(8, 0)
    assert ring.cpu == 0 and ring.traffic_per_machine() == pytest.approx(2 * 7 / 8)
    ps = optimal_shares(8, 8)
    assert ps.cpu == 1 and ps.traffic_per_machine() == pytest.approx(1.0)
    classic = optimal_shares(3, 2, colocate=False)
    assert classic.worker_machine_traffic() == 1.0 and classic.cpu_machine_traffic() == 1.5
    assert optimal_shares(4, 9).cpu == 1.0  # more CPU servers than machines: they hold all
    assert optimal_shares(1, 2).traffic_per_machine() == 0.0  # one machine: nothing crosses
    assert "BytePS placement" in optimal_shares(3, 1).describe()


def test_a_classic_parameter_server_needs_cpu_servers():
    with pytest.raises(ConfigError, match="needs CPU servers.*HINT"):
        optimal_shares(2, 0, colocate=False)


@pytest.mark.parametrize("n, k", [(2, 1), (2, 2), (3, 1), (3, 2), (8, 4), (2, 0), (3, 0)])
def test_the_placement_meets_the_shares_and_balances_each_kind(n, k):
    specs = gpt_specs()
    total = sum(s.nbytes for s in specs)
    colocated, dedicated = list(range(100, 100 + n)), list(range(200, 200 + k))
    plan = plan_placement(specs, partition_bytes=4_096_000, machines=n, colocated=colocated,
                          dedicated=dedicated, local_workers=2)
    owned = plan.bytes_by_owner()
    assert sum(owned.values()) == total
    x = plan.shares.cpu
    for s in dedicated:
        assert owned[s] == pytest.approx(x * total / k, abs=2 * MIN_SPLIT_BYTES)
    for s in colocated:
        assert owned.get(s, 0) == pytest.approx((1 - x) * total / n, abs=2 * MIN_SPLIT_BYTES)
    for kind in (colocated, dedicated):
        loads = [owned.get(s, 0) for s in kind]
        if kind and min(loads) > 0:
            assert max(loads) / min(loads) <= 1.05


def test_partitions_are_bounded_cover_every_element_once_and_are_numbered_in_order():
    specs = gpt_specs(d_model=64, layers=2) + [TensorSpec("empty", (0,), F32)]
    plan = plan_placement(specs, partition_bytes=20_000, machines=3, colocated=[5, 6, 7],
                          dedicated=[8], first_key=40)
    parts = plan.placement.partitions
    assert [p.key for p in parts] == list(range(40, 40 + len(parts)))
    assert all(p.nbytes <= 20_000 and p.numel > 0 for p in parts)
    for t, spec in enumerate(specs):
        mine = [p for p in parts if p.tensor == t]
        assert [p.index for p in mine] == list(range(len(mine)))
        offset = 0
        for p in mine:
            assert p.offset == offset and p.name == spec.name
            offset += p.numel
        assert offset == spec.numel
    # Tensors are cut at owners' boundaries only into pieces worth their header.
    small = {t for t, s in enumerate(specs) if s.nbytes < MIN_SPLIT_BYTES}
    assert all(p.nbytes >= MIN_SPLIT_BYTES for p in parts if p.tensor not in small)


def test_layers_are_interleaved_over_servers_not_placed_in_runs():
    plan = plan_placement(gpt_specs(), partition_bytes=4_096_000, machines=2,
                          colocated=[2, 3], dedicated=[4])
    first_ten = plan.placement.owners[:10]
    assert len(set(first_ten)) == 3


def test_the_special_placements():
    specs = gpt_specs(d_model=32, layers=2)
    ring = plan_placement(specs, partition_bytes=4096, machines=2, colocated=[2, 3],
                          dedicated=[])
    assert set(ring.bytes_by_owner()) == {2, 3}
    ps = plan_placement(specs, partition_bytes=4096, machines=2, colocated=[2, 3],
                        dedicated=[4, 5], colocate=False)
    assert set(ps.bytes_by_owner()) == {4, 5} and ps.shares.cpu == 1.0
    alone = plan_placement(specs, partition_bytes=4096, machines=1, colocated=[1],
                           dedicated=[2])
    assert set(alone.bytes_by_owner()) == {1}


def test_the_plan_is_the_same_on_every_worker_and_printable():
    kwargs = dict(partition_bytes=50_000, machines=2, colocated=[4, 5], dedicated=[6],
                  local_workers=2)
    a = plan_placement(gpt_specs(), **kwargs)
    b = plan_placement(gpt_specs(), **kwargs)
    assert a == b
    text = a.describe()
    assert "x=0.5000" in text and "server rank 6" in text


def test_local_handlers_share_a_machine_evenly():
    plan = plan_placement(gpt_specs(), partition_bytes=100_000, machines=2, colocated=[4, 5],
                          dedicated=[], local_workers=2)
    load = [0, 0]
    for p, h in zip(plan.placement.partitions, plan.handlers):
        load[h] += p.nbytes
    assert max(load) / min(load) <= 1.05


def test_colocated_servers_must_cover_every_machine():
    with pytest.raises(ConfigError, match="one colocated server.*HINT"):
        plan_placement(gpt_specs(), partition_bytes=4096, machines=3, colocated=[4, 5],
                       dedicated=[])


def test_machines_of_other_worker_counts_are_refused_naming_the_counts():
    # torchrun may start 2 workers on one machine and 1 on another: the handlers came from
    # the first machine, and the lone worker was refused with a hint it could not act on
    # ('use handler indices 0 .. 0') while the others waited out the timeout.
    topology = Topology.from_roles([("worker", "a"), ("worker", "a"), ("worker", "b"),
                                    ("server", "a"), ("server", "b")])
    with pytest.raises(ConfigError, match=r"strategy 'byteps' reduces each machine's gradients "
                                          r"among its workers first \(a piece each\) and needs "
                                          r"as many workers on each, but this run has 2 on a, "
                                          r"1 on b"):
        plan_for(topology, [TensorSpec("w", (1000,), F32)], partition_bytes=4096)
