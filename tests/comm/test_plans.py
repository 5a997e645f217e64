"""Pure plans: partitions, buckets and placements, without communication."""

import pytest
import torch

from polytrain import ConfigError
from polytrain.comm import TensorSpec, flatten, partition, plan_buckets, unflatten_into
from polytrain.comm.topology import Topology
from polytrain.models import GPT
from polytrain.ps import balanced
from polytrain.strategies.byteps.plan import plan_for, plan_placement

F32 = torch.float32


def test_partitions_are_near_equal_bounded_and_cover_every_element():
    specs = [TensorSpec("w", (1000, 3), F32), TensorSpec("b", (7,), F32)]
    parts = partition(specs, partition_bytes=4000)
    assert [p.key for p in parts] == list(range(len(parts)))
    assert all(p.nbytes <= 4000 for p in parts)
    w = [p for p in parts if p.name == "w"]
    assert len(w) == 3 and {p.numel for p in w} == {1000}
    assert sum(p.numel for p in parts) == 3007
    assert [p.offset for p in w] == [0, 1000, 2000]
    assert parts[-1].label == "b[0]" and parts[-1].numel == 7


def test_partition_size_must_be_positive():
    with pytest.raises(ConfigError, match="partition_bytes must be positive"):
        partition([TensorSpec("w", (4,), F32)], 0)


def test_buckets_go_in_reverse_order_up_to_the_cap_and_round_trip():
    specs = [TensorSpec(f"t{i}", (n,), F32) for i, n in enumerate([10, 10, 30, 5])]
    buckets = plan_buckets(specs, cap_bytes=80)
    assert [b.members for b in buckets] == [(3,), (2,), (1, 0)]
    tensors = [torch.randn(s.shape) for s in specs]
    flat = flatten(buckets[2], tensors)
    assert torch.equal(flat, torch.cat([tensors[1], tensors[0]]))
    copies = [torch.zeros_like(t) for t in tensors]
    unflatten_into(buckets[2], flat * 2, copies)
    assert torch.equal(copies[0], tensors[0] * 2) and torch.equal(copies[1], tensors[1] * 2)


def test_balanced_placement_evens_bytes_and_is_the_same_everywhere():
    specs = [TensorSpec(f"t{i}", (n,), F32) for i, n in enumerate([1000, 300, 300, 200, 200])]
    parts = partition(specs, partition_bytes=1 << 20)
    a = balanced(parts, [4, 5])
    b = balanced(parts, [4, 5])
    assert a == b
    assert a.bytes_by_owner() == {4: 4000, 5: 4000}
    assert "server rank 4: 1 partitions, 4000 bytes" in a.describe()


def test_a_placement_needs_a_server():
    with pytest.raises(ConfigError, match="needs at least one server"):
        balanced(partition([TensorSpec("w", (4,), F32)], 64), [])


def test_byteps_counts_cpu_machines_not_server_processes():
    # Two server processes on one CPU machine (POLYTRAIN_ROLE=server,server) were k = 2 of
    # Theorem 1: 0.3 of the model each, so that machine's NIC moved 2.4 M a step against
    # all-reduce's 1.5 M (the plan said 1.2). k counts machines: 1.333 M, split over the two.
    roles = ([("worker", f"g{i}") for i in range(4)] + [("server", f"g{i}") for i in range(4)]
             + [("server", "cpu0"), ("server", "cpu0")])
    topology = Topology.from_roles(roles)
    assert topology.cpu_machines == ("cpu0",)
    plan = plan_for(topology, [TensorSpec("w", (1_000_000,), F32)], partition_bytes=4_096_000)
    assert plan.shares.cpu_servers == 1
    load = plan.bytes_by_owner()
    total = 4_000_000
    # A CPU machine receives n = 4 pushes of its share; a worker machine 1 - g + 3g.
    assert 4 * (load[8] + load[9]) / total == pytest.approx(4 / 3, abs=1e-3)
    assert abs(load[8] - load[9]) <= 1024
    assert all(1 + 2 * load[r] / total == pytest.approx(4 / 3, abs=1e-3) for r in range(4, 8))
    with pytest.raises(ConfigError, match=r"^cpu_machines \[\[8\]\] must hold every dedicated "
                                          r"server \[8, 9\] once, in the group of its machine"):
        plan_placement([TensorSpec("w", (1000,), F32)], partition_bytes=4096, machines=4,
                       colocated=[4, 5, 6, 7], dedicated=[8, 9], cpu_machines=[[8]])


def test_herring_gives_a_cpu_machine_one_shard_whatever_its_server_processes():
    # Each server process got a shard: three on one CPU machine made it move 3 of n + 3
    # shards (n = 4: 12/7 = 1.71 M a step, above ring all-reduce's 1.5 M). The machine's
    # shard is cut over its processes: herring_traffic(4, 1)'s 4/5 M, as one process there.
    from types import SimpleNamespace

    from polytrain.herring import herring_traffic, plan_herring
    from polytrain.strategies.herring.ddp import herring_servers

    roles = ([("worker", f"g{i}") for i in range(4)] + [("server", f"g{i}") for i in range(4)]
             + [("server", "cpu0")] * 3)
    servers = herring_servers(SimpleNamespace(topology=Topology.from_roles(roles)),
                              colocate=True)
    assert servers == [(4,), (5,), (6,), (7,), (8, 9, 10)]
    plan = plan_herring([TensorSpec("w", (1_000_000,), F32)], bucket_cap_bytes=1 << 30,
                        servers=servers, local_workers=1)
    load = plan.bytes_by_server()
    total = 4_000_000
    assert [load[r] for r in range(4, 8)] == [total // 5] * 4
    assert sorted(load[r] for r in (8, 9, 10)) == [266_664, 266_668, 266_668]
    # What the CPU machine receives: n pushes of its shard, the formula's.
    assert 4 * sum(load[r] for r in (8, 9, 10)) / total == \
        pytest.approx(herring_traffic(4, 1)["server"])


# BytePS's fusion of small tensors (moved here with the planner from strategies/byteps).
def gpt_specs(**options):
    return [TensorSpec.of(n, p) for n, p in GPT(**options).named_parameters()]


def test_fusion_groups_neighbours_until_the_threshold_and_keeps_the_order():
    specs = gpt_specs()
    groups = plan_buckets(specs, fill_bytes=262_144, reverse=False)
    assert [m for g in groups for m in g.members] == list(range(len(specs)))
    assert all(g.nbytes >= 262_144 for g in groups[:-1])
    assert len(groups) < len(specs) / 3  # norms and biases ride with their neighbours
    for g in groups:
        assert g.offsets == tuple(sum(specs[m].numel for m in g.members[:i])
                                  for i in range(len(g.members)))
    assert [g.members for g in plan_buckets(specs, fill_bytes=0, reverse=False)] == [
        (i,) for i in range(len(specs))]


def test_fusion_never_mixes_dtypes():
    specs = [TensorSpec("a", (4,), F32), TensorSpec("b", (4,), torch.float16),
             TensorSpec("c", (4,), torch.float16)]
    assert [g.members for g in plan_buckets(specs, fill_bytes=1 << 20,
                                            reverse=False)] == [(0,), (1, 2)]
