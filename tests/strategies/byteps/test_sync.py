"""Synchronous BytePS: the single run's weights, and the paper's bytes per machine.

Transparency and traffic read the same runs (cached per configuration), so the
layouts of the issue are each started once.
"""

import pytest

from polytrain import TrainConfig
from tests.harness import adam_tolerance, max_abs_diff, run_cached, run_config, single_of

STEPS = 4
MODEL = {"seq_len": 16, "d_model": 64, "layers": 2}  # ~0.5 MB: headers stay under 0.5%
# SGD stays at the float32 rounding of the weights; Adam magnifies it (adam_tolerance).
TOLERANCE = {"sgd": 1e-6, "adam": adam_tolerance(3e-3, STEPS)}

def config(nodes, workers, servers, optimizer="sgd", **options):
    return TrainConfig(strategy="byteps", workers=workers, nodes=nodes, servers=servers,
                       steps=STEPS, batch_size=12, optimizer=optimizer,
                       lr=0.05 if optimizer == "sgd" else 3e-3, model_options=MODEL,
                       strategy_options=options)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes, workers, servers, optimizer", [
    (1, 2, 1, "sgd"), (2, 4, 0, "adam"), (2, 4, 2, "sgd"), (3, 3, 2, "adam"),
    *(pytest.param(*c, marks=pytest.mark.long) for c in [
        (1, 2, 1, "adam"), (2, 4, 0, "sgd"), (2, 4, 2, "adam"), (3, 3, 2, "sgd")])])
def test_byteps_ends_where_single_ends(nodes, workers, servers, optimizer):
    c = config(nodes, workers, servers, optimizer)
    _, single = run_config(single_of(c))
    metrics, distributed = run_cached(c)
    assert max_abs_diff(single, distributed) < TOLERANCE[optimizer]
    assert metrics["strategy"] == "byteps" and len(metrics["losses"]) == STEPS
    # The weights did move: the comparison is not between two untouched initialisations.
    _, untrained = run_config(single_of(c).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 50 * TOLERANCE[optimizer]


@pytest.mark.timeout(120)
def test_the_classic_parameter_server_with_tiny_partitions_ends_where_single_ends():
    # --no-colocate sends every partition to the CPU server; no fusion and 4000-byte
    # partitions cut each weight into several keys, a credit of two partitions holds the rest.
    c = config(1, 2, 1, colocate=False, partition_bytes=4000, fuse_bytes=0, credit_bytes=8000)
    _, single = run_config(single_of(c))
    metrics, distributed = run_cached(c)
    assert max_abs_diff(single, distributed) < TOLERANCE["sgd"]
    # A parameter server's cost: each worker machine sends and receives the model, the
    # server machine n times the model over its k servers (headers: 56 bytes per 4000).
    m = metrics["model_bytes"]
    assert [x["kind"] for x in metrics["traffic"]["machines"]] == ["worker", "server"]
    for machine in metrics["traffic"]["machines"]:
        assert machine["sent_bytes_per_step"] == pytest.approx(m, rel=0.03)
        assert machine["recv_bytes_per_step"] == pytest.approx(m, rel=0.03)


def t_opt(n, k):
    """Theorem 1's bytes per machine per step, in units of the model (the paper's formula)."""
    return 2 * n * (n - 1) / (n * n + k * n - 2 * k)


def machines(metrics, kind):
    return [m for m in metrics["traffic"]["machines"] if m["kind"] == kind]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes, workers, servers", [
    (2, 2, 1), (2, 4, 2), (3, 3, 2), pytest.param(3, 3, 1, marks=pytest.mark.long)])
def test_every_machine_moves_t_opt_bytes_per_step(nodes, workers, servers):
    # (2, 4, 2) and (3, 3, 2) are the transparency runs above; (2, 4, 2) also reduces inside
    # each machine first, which must add no bytes between machines.
    metrics, _ = run_cached(config(nodes, workers, servers))
    expected = t_opt(nodes, servers) * metrics["model_bytes"]
    assert len(machines(metrics, "worker")) == nodes
    assert len(machines(metrics, "server")) == servers
    for m in metrics["traffic"]["machines"]:
        assert not m["estimated"]
        assert m["sent_bytes_per_step"] == pytest.approx(expected, rel=0.02), m
        assert m["recv_bytes_per_step"] == pytest.approx(expected, rel=0.02), m


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes, workers", [(2, 4), (3, 3)])
def test_without_cpu_servers_each_machine_moves_ring_all_reduce_bytes(nodes, workers):
    metrics, _ = run_cached(config(nodes, workers, 0))
    expected = 2 * (nodes - 1) / nodes * metrics["model_bytes"]
    assert len(machines(metrics, "worker")) == nodes and not machines(metrics, "server")
    for m in machines(metrics, "worker"):
        assert m["sent_bytes_per_step"] == pytest.approx(expected, rel=0.02), m
        assert m["recv_bytes_per_step"] == pytest.approx(expected, rel=0.02), m


@pytest.mark.timeout(120)
def test_without_colocated_servers_traffic_is_the_parameter_servers():
    nodes, servers = 3, 2
    metrics, _ = run_cached(config(nodes, 3, servers, colocate=False))
    m = metrics["model_bytes"]
    assert len(machines(metrics, "worker")) == nodes
    assert len(machines(metrics, "server")) == servers
    for w in machines(metrics, "worker"):  # push the model, pull it back
        assert w["sent_bytes_per_step"] == pytest.approx(m, rel=0.02), w
        assert w["recv_bytes_per_step"] == pytest.approx(m, rel=0.02), w
    for s in machines(metrics, "server"):  # n pushes of its 1/k of the model
        assert s["recv_bytes_per_step"] == pytest.approx(nodes * m / servers, rel=0.02), s
        assert s["sent_bytes_per_step"] == pytest.approx(nodes * m / servers, rel=0.02), s
