"""The cost model: the papers' traffic formulas, the step-time sum, the recommendation; pure."""

import collections

import pytest
import torch

from polytrain.comm import TensorSpec
from polytrain.errors import ConfigError
from polytrain.plan.cost import (
    WIRE_EFFICIENCY,
    Candidate,
    Compute,
    Constants,
    Network,
    candidates,
    fanout_traffic,
    host_traffic,
    nic_traffic,
    predict,
    recommend,
    summation_servers,
)
from polytrain.strategies.byteps.plan import plan_placement

NO_COMPUTE = Compute(forward_s=0.0, backward_s=0.0, optimizer_s=0.0)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_ring_and_theorem_1_and_herring_closed_forms(n):
    assert nic_traffic("ddp", machines=n, local_workers=1, servers=0) == pytest.approx(
        2 * (n - 1) / n)
    for k in range(0, n + 1):
        t_opt = 2 * n * (n - 1) / (n * n + k * n - 2 * k)
        assert nic_traffic("byteps", machines=n, local_workers=1, servers=k) == pytest.approx(
            t_opt)
        worker = (2 * n + k - 2) / (n + k)
        assert nic_traffic("herring", machines=n, local_workers=1, servers=k) == pytest.approx(
            max(worker, n / (n + k)))


def test_end_points_and_papers_example():
    # k = 0: every strategy moves all-reduce's bytes; k = n: BytePS moves M (a PS's).
    for s in ("byteps", "herring"):
        assert nic_traffic(s, machines=4, local_workers=1, servers=0) == pytest.approx(1.5)
    assert nic_traffic("byteps", machines=4, local_workers=1, servers=4) == pytest.approx(1.0)
    # Theorem 1's example: n = 8, k = 4 gives 1.27 M against all-reduce's 1.75 M.
    assert nic_traffic("byteps", machines=8, local_workers=1, servers=4) == pytest.approx(
        1.2727, abs=1e-4)
    # ddp's ring runs over every worker: 8 workers on 4 machines is 2 * 7 / 8.
    assert nic_traffic("ddp", machines=4, local_workers=2, servers=0) == pytest.approx(1.75)
    assert nic_traffic("ddp", machines=1, local_workers=4, servers=0) == 0.0


def test_host_traffic_sums_every_nic():
    assert host_traffic("ddp", machines=4, local_workers=1, servers=0) == pytest.approx(6.0)
    # n = k = 4: every worker machine sends M, every CPU machine M.
    assert host_traffic("byteps", machines=4, local_workers=1, servers=4) == pytest.approx(8.0)
    # herring k = 2: 4 * (8/6) + 2 * (4/6).
    assert host_traffic("herring", machines=4, local_workers=1, servers=2) == pytest.approx(
        4 * 8 / 6 + 2 * 4 / 6)


def test_unknown_strategy_names_the_known_ones():
    with pytest.raises(ConfigError, match="it knows: ddp, byteps, herring"):
        nic_traffic("parallax", machines=2, local_workers=1, servers=0)


def test_link_bound_step_is_bytes_over_bandwidth():
    # An emulated cluster on a host with cores to spare: the constants apply, nothing is shared.
    net = Network(machines=4, servers=4, bandwidth_bit_s=1e9, shared_host_cores=64)
    c = Constants(efficiency={"ddp": 1.0, "byteps": 1.0})
    p = predict(Candidate(strategy="byteps", servers=4), network=net, compute=NO_COMPUTE,
                model_bytes=125e6, constants=c)
    assert p.step_time_s == pytest.approx(1.0)  # M = 1 Gbit through a 1 Gbit/s NIC
    d = predict(Candidate(strategy="ddp"), network=net, compute=NO_COMPUTE, model_bytes=125e6,
                constants=c)
    assert d.step_time_s == pytest.approx(1.5)


def test_overlap_hides_communication_behind_backward():
    net = Network(machines=2, bandwidth_bit_s=8e6, shared_host_cores=64)  # 1 MB/s
    compute = Compute(forward_s=0.1, backward_s=0.2, optimizer_s=0.0)
    c = Constants(efficiency={"ddp": 1.0}, overlap=0.5)
    p = predict(Candidate(strategy="ddp"), network=net, compute=compute, model_bytes=1e6,
                constants=c)  # ring over 2: 1 M = 1 s; 0.1 s of it hidden
    assert p.comm_s == pytest.approx(1.0)
    assert p.step_time_s == pytest.approx(0.3 + 1.0 - 0.1)


def test_real_machines_get_the_papers_model_not_this_hosts_constants():
    fitted = Constants(efficiency={"ddp": 0.5}, host_s_per_byte={"ddp": 1e-6},
                       overhead_s={"ddp": 1.0})
    real = Network(machines=2, bandwidth_bit_s=8e6)
    p = predict(Candidate(strategy="ddp"), network=real, compute=NO_COMPUTE, model_bytes=1e6,
                constants=fitted)
    assert p.host_s == 0.0
    assert p.step_time_s == pytest.approx(1.0 / WIRE_EFFICIENCY)
    emulated = Network(machines=2, bandwidth_bit_s=8e6, shared_host_cores=2)
    q = predict(Candidate(strategy="ddp"), network=emulated, compute=NO_COMPUTE,
                model_bytes=1e6, constants=fitted)
    # Link 1 M at half of 1 MB/s: 2 s; host 2 M * 1e-6 s/B over 2 cores: 1 s; overhead 1 s.
    assert (q.link_s, q.host_s) == (pytest.approx(2.0), pytest.approx(1.0))
    assert q.step_time_s == pytest.approx(3.0)


def test_host_bound_on_a_shared_host_and_latency():
    net = Network(machines=4, servers=4, bandwidth_bit_s=1e12, shared_host_cores=2,
                  latency_s=1e-3)
    c = Constants(efficiency={"byteps": 1.0}, host_s_per_byte={"byteps": 1e-9})
    p = predict(Candidate(strategy="byteps", servers=4), network=net, compute=NO_COMPUTE,
                model_bytes=1e8, constants=c)
    assert p.host_s == pytest.approx(8 * 1e8 * 1e-9 / 2)
    # 25 partitions over the 4 CPU servers (k >= n: the colocated ones hold none): 7 rounds.
    assert p.latency_s == pytest.approx(2 * 7 * 1e-3)
    assert p.step_time_s == pytest.approx(p.host_s + p.latency_s)


def test_candidates_and_recommendation():
    net = Network(machines=4, servers=2, bandwidth_bit_s=1e9)
    keys = [c.key for c in candidates(net)]
    assert keys == ["ddp", "byteps k=0", "byteps k=1", "byteps k=2", "herring k=0",
                    "herring k=1", "herring k=2"]
    preds = [predict(c, network=net, compute=NO_COMPUTE, model_bytes=1e7)
             for c in candidates(net)]
    assert recommend(preds).candidate.key == "byteps k=2"
    # Ties (k = 0 moves ring's bytes whatever the strategy): torch's own ddp is chosen.
    tied = [p for p in preds if p.candidate.servers == 0]
    assert recommend(tied).candidate.key == "ddp"
    with pytest.raises(ConfigError, match="no strategy can run this job"):
        recommend([])
    # One worker sums nothing: servers would only add their cost (byteps k=0 was recommended).
    assert [c.key for c in candidates(Network(machines=1, servers=2))] == ["ddp"]


def test_byteps_on_one_worker_machine_is_a_candidate_without_servers_only():
    # Symptom: `polytrain plan --model mlp --d-model 64 --workers 2 --servers 1 --bandwidth
    # 1gbit` refused byteps k=0 ("no link would be shaped") and recommended byteps k=1, "0.000
    # M on the busiest NIC". Cause: Theorem 1 gives one machine's servers nothing, so byteps
    # k >= 1 there runs k=0's sums, over no link; only k=0 was refused.
    net = Network(machines=1, local_workers=2, servers=2, bandwidth_bit_s=1e9)
    assert [c.key for c in candidates(net)] == ["ddp", "byteps k=0", "herring k=0",
                                                "herring k=1", "herring k=2"]
    # Herring gives its servers shares: they cross a link.
    assert nic_traffic("herring", machines=1, local_workers=2, servers=2) > 0


def test_fanout_and_summation_servers():
    # BytePS n = 4, k = 0: each colocated server holds 25 MB, cut into 4,096,000-byte partitions.
    c = Constants()
    assert fanout_traffic("byteps", machines=4, servers=0, model_bytes=1e8, constants=c) == \
        4 * 4_096_000
    # k >= n: the CPU servers hold everything; a small model is one partition per server.
    assert fanout_traffic("byteps", machines=4, servers=4, model_bytes=4e6, constants=c) == \
        pytest.approx(4 * 1e6)
    assert fanout_traffic("herring", machines=4, servers=2, model_bytes=6e6, constants=c) == \
        pytest.approx(4 * 1e6)  # a shard of the one bucket per server, from 4 machines
    assert fanout_traffic("ddp", machines=4, servers=0, model_bytes=1e8, constants=c) == 0.0
    assert [summation_servers("byteps", machines=4, servers=k) for k in (0, 2, 4)] == [4, 6, 4]
    # On one machine BytePS's dedicated servers hold nothing (Theorem 1's end point): idle.
    assert [summation_servers("byteps", machines=1, servers=k) for k in (0, 2)] == [1, 1]
    assert summation_servers("herring", machines=4, servers=2) == 6
    assert summation_servers("ddp", machines=4, servers=0) == 0


def test_tail_servers_and_combine_on_an_emulated_host_only():
    c = Constants(efficiency={"herring": 1.0}, tail={"herring": 0.5},
                  server_s={"herring": 0.1}, combine={"herring": 0.5})
    emulated = Network(machines=4, bandwidth_bit_s=8e6, shared_host_cores=64)  # 1 MB/s
    p = predict(Candidate(strategy="herring"), network=emulated, compute=NO_COMPUTE,
                model_bytes=4e6, constants=c)
    # Link: 1.5 M + 0.5 * (4 machines x a 1 MB shard) = 8 MB at 1 MB/s; host: 4 servers x 0.1 s.
    assert (p.link_s, p.host_s) == (pytest.approx(8.0), pytest.approx(0.4))
    assert p.step_time_s == pytest.approx(8.0 + 0.5 * 0.4)
    real = Network(machines=4, bandwidth_bit_s=8e6)
    q = predict(Candidate(strategy="herring"), network=real, compute=NO_COMPUTE,
                model_bytes=4e6, constants=c)
    assert q.step_time_s == pytest.approx(6.0 / WIRE_EFFICIENCY)


def test_workers_sharing_the_hosts_cores_stretch_measured_compute_not_an_emulated_devices():
    # polytrain plan --devices doubled the compute of 4 workers on 2 cores (2.7 s predicted,
    # 1.39 s run): an emulated device's time is waited out, whatever else runs on the host.
    net = Network(machines=2, local_workers=2, shared_host_cores=2)
    measured = Compute(forward_s=0.1, backward_s=0.2, optimizer_s=0.0)
    device = Compute(forward_s=0.1, backward_s=0.2, optimizer_s=0.0, emulated=True)
    p, q = (predict(Candidate(strategy="ddp"), network=net, compute=c, model_bytes=1e6,
                    constants=Constants()) for c in (measured, device))
    assert p.compute_s == pytest.approx(0.6) and q.compute_s == pytest.approx(0.3)


@pytest.mark.parametrize("budget_s,steps", [(60.0, 1 + 5), (0.0, 1 + 1)])
def test_compute_is_timed_with_as_many_steps_as_the_budget_holds(monkeypatch, budget_s, steps):
    # A large batch took minutes with nothing printed: six steps of 18 s at
    # `polytrain plan --batch-size 4096`. The warm-up step says how many more fit.
    import dataclasses

    from polytrain.models import get_model
    from polytrain.plan import compute

    spec = get_model("gpt")
    taken = []

    def loss(out, targets):
        taken.append(1)
        return spec.loss(out, targets)

    monkeypatch.setattr(compute, "get_model", lambda _: dataclasses.replace(spec, loss=loss))
    measured = compute.measure_compute("gpt", {"d_model": 16, "seq_len": 8, "layers": 1},
                                       batch=2, budget_s=budget_s)
    assert len(taken) == steps
    assert measured.forward_s > 0 and measured.backward_s > 0


def test_byteps_on_one_machine_costs_the_same_with_cpu_servers_it_gives_nothing():
    # Theorem 1 gives one machine's servers no bytes, yet k = 1 was charged a partition's
    # fan-out and the latency of its messages (4 ms at 1 ms a packet, here).
    net = Network(machines=1, local_workers=2, servers=1, bandwidth_bit_s=1e9, latency_s=1e-3,
                  shared_host_cores=64)
    compute = Compute(forward_s=0.01, backward_s=0.02, optimizer_s=0.0)
    k0, k1 = (predict(Candidate(strategy="byteps", servers=k), network=net, compute=compute,
                      model_bytes=4e6) for k in (0, 1))
    assert k1.step_time_s == k0.step_time_s and k1.latency_s == 0 == k1.link_s
    assert fanout_traffic("byteps", machines=1, servers=1, model_bytes=4e6,
                          constants=Constants()) == 0


def test_on_one_machine_the_fixed_costs_fitted_across_machines_are_not_charged():
    # ddp's 7 ms overhead and each summation server's cost were fitted on runs that sum
    # across machines; on one machine of 2 workers they put byteps k=0 first (mlp: 4.6 ms
    # against ddp's 8.0), and ddp ran faster (2.3-3.2 ms against 3.8-4.9).
    from polytrain.plan.planner import CONSTANTS
    compute = Compute(forward_s=0.0005, backward_s=0.0005, optimizer_s=0.0)
    one = Network(machines=1, local_workers=2, servers=0, shared_host_cores=2)
    rows = [predict(c, network=one, compute=compute, model_bytes=1e5, constants=CONSTANTS)
            for c in candidates(one)]
    assert all(r.step_time_s == pytest.approx(compute.step_s) for r in rows)
    assert recommend(rows).candidate.strategy == "ddp"
    # Across machines they are charged, as fitted.
    two = Network(machines=2, local_workers=1, servers=0, shared_host_cores=2)
    ddp = predict(Candidate(strategy="ddp"), network=two, compute=compute, model_bytes=1e5,
                  constants=CONSTANTS)
    assert ddp.step_time_s >= compute.step_s + CONSTANTS.overhead_s["ddp"]


def test_latency_counts_herring_buckets_and_byteps_rounds_over_the_servers_with_bytes():
    # Herring cuts every bucket into n+k shards (fanout_traffic's bucket / (n+k)), yet the
    # latency term divided the buckets by n+k again: 1.21 GB (47 buckets of 25 MiB) on n = 8
    # waited out 12 messages at k = 0 and 6 at k = 8, for 94. BytePS with k >= n divided its
    # partitions by n+k servers, n of which hold nothing; with 0 < k < n it spread them
    # evenly, yet a CPU server holds x/k of the model, more than a colocated one: the engine
    # sends each server one partition at a time, so a step waits out the busiest's rounds
    # (k = 1: 33 predicted, the busiest server holds 60; k = 4: 25 predicted, 48).
    net = Network(machines=8, local_workers=8, servers=8, bandwidth_bit_s=100e9, latency_s=1e-3)
    compute = Compute(forward_s=0.02, backward_s=0.04, optimizer_s=0.0)

    def latency(strategy, k):
        return predict(Candidate(strategy=strategy, servers=k), network=net, compute=compute,
                       model_bytes=1.21e9).latency_s

    assert latency("herring", 0) == pytest.approx(94e-3)
    assert latency("herring", 8) == pytest.approx(94e-3)
    # 296 partitions of 4,096,000 bytes; the busiest server holds 1/8 of them at k = 0 and
    # k = 8 (37 rounds), x/k = 0.2 at k = 1 (60) and 0.159 at k = 4 (48).
    assert latency("byteps", 0) == pytest.approx(74e-3)
    assert latency("byteps", 8) == pytest.approx(74e-3)
    assert latency("byteps", 1) == pytest.approx(120e-3)
    assert latency("byteps", 4) == pytest.approx(96e-3)
    # ... as many as the engine's placement gives the busiest server of a 1.21 GB tensor here
    # (an estimate: on other layouts its pieces, not contiguous, add a few; docs/cluster.md).
    for k in (1, 4, 8):
        plan = plan_placement([TensorSpec("w", (302_500_000,), torch.float32)],
                              partition_bytes=4_096_000, machines=8,
                              colocated=range(8, 16), dedicated=range(16, 16 + k))
        busiest = max(collections.Counter(plan.placement.owners).values())
        assert latency("byteps", k) == pytest.approx(2 * busiest * 1e-3)
