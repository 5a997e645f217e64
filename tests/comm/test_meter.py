import pytest

from polytrain import ConfigError
from polytrain.comm import Topology, TrafficMeter, machine_traffic, server_traffic

TOPO = Topology.from_roles([("worker", "node0"), ("worker", "node0"), ("worker", "node1"),
                            ("worker", "node1"), ("server", "server0")])


def test_topology_derives_roles_machines_and_leaders():
    assert TOPO.workers == (0, 1, 2, 3) and TOPO.servers == (4,)
    assert TOPO.worker_machines == ("node0", "node1") and TOPO.leaders == (0, 2)
    assert TOPO.dedicated_servers == (4,) and TOPO.colocated_servers == ()
    assert TOPO.is_inter(1, 2) and not TOPO.is_inter(2, 3)
    assert TOPO.name(4) == "server rank 4 (machine server0)"


def test_topology_refuses_bad_roles_and_runs_without_workers():
    with pytest.raises(ConfigError, match="rank 1 has role 'boss'"):
        Topology.from_roles([("worker", "a"), ("boss", "a")])
    with pytest.raises(ConfigError, match="a run needs a worker"):
        Topology.from_roles([("server", "a")])
    # A comma list shorter than the machine's processes: it said "role 'invalid: ...'".
    from polytrain import _env
    role = _env.read({"POLYTRAIN_ROLE": "worker,server", "LOCAL_RANK": "2"}).role
    with pytest.raises(ConfigError, match=r"rank 2 has no role: POLYTRAIN_ROLE='worker,server' "
                                          r"lists 2 roles, one per local rank, and this is "
                                          r"local rank 2. HINT: list a role for every process"):
        Topology.from_roles([("worker", "a"), ("server", "a"), (role, "a")])


def test_each_message_is_counted_once_per_machine_and_per_step():
    meters = [TrafficMeter(r, TOPO) for r in range(4)]
    for _ in range(3):
        for m in meters:
            m.record(4, 100, "sent")        # push to the server
            m.record(4, 100, "recv")        # pull from it
        meters[1].record(2, 10, "sent")     # worker to worker across machines:
        meters[2].record(1, 10, "recv")     # both ends record it, counted once
        meters[0].record(1, 999, "sent")    # inside node0: never counted
        meters[1].record(0, 999, "recv")
        for m in meters:
            m.mark_step()
    # The server's own report (what ctx.shutdown() returns beside the workers') counts no
    # step: with it, every machine's traffic read 0.
    server = TrafficMeter(4, TOPO)
    server.record(0, 100, "recv")
    for reports in ([m.report() for m in meters], [m.report() for m in meters] + [server.report()]):
        traffic = {t.name: t for t in machine_traffic(reports, TOPO, warmup=1)}
        per_step = {n: (t.sent_bytes_per_step, t.recv_bytes_per_step) for n, t in traffic.items()}
        assert per_step["node0"] == (210, 200) and per_step["node1"] == (200, 210)
        assert traffic["server0"].kind == "server"
        assert traffic["server0"].recv_bytes_per_step == 400 == \
            traffic["server0"].sent_bytes_per_step
        assert not any(t.estimated for t in traffic.values())


def test_ring_allreduce_estimate_marks_estimated():
    meters = [TrafficMeter(r, TOPO) for r in range(4)]
    for m in meters:
        m.record_ring_allreduce([0, 1, 2, 3], 1000)
        m.mark_step()
    traffic = machine_traffic([m.report() for m in meters], TOPO, warmup=0)
    node0 = next(t for t in traffic if t.name == "node0")
    assert node0.sent_bytes_per_step == 1500 and node0.recv_bytes_per_step == 1500
    assert node0.estimated


def test_server_traffic_counts_every_byte_of_each_server_per_steady_step():
    topo = Topology.from_roles([("worker", "node0"), ("worker", "node1"), ("server", "node0"),
                                ("server", "server0")])
    meters = [TrafficMeter(r, topo) for r in range(2)]
    for step in range(3):
        for m in meters:
            m.record(2, 50 if step else 5000, "sent")  # the colocated server: local bytes count
            m.record(2, 40, "recv")
            m.record(3, 70, "sent")
            m.mark_step()
    rows = {r["rank"]: r for r in server_traffic([m.report() for m in meters], topo, warmup=1)}
    assert rows[2] == {"rank": 2, "machine": "node0", "recv_bytes_per_step": 100.0,
                       "sent_bytes_per_step": 80.0}
    assert rows[3]["recv_bytes_per_step"] == 140.0 and rows[3]["sent_bytes_per_step"] == 0.0


def test_nic_counters_are_averaged_over_the_meters_steady_window():
    # Counters that grow 1000 sent / 2000 received a step, plus a warm-up burst in step 0.
    counters = iter([0, 50_000] + [50_000 + 1000 * k for k in range(1, 4)])

    def sampler():
        n = next(counters)
        return {"node0": (n, 2 * n), "node1": (2 * n, n), "server0": (0, 0)}

    meters = [TrafficMeter(r, TOPO) for r in range(4)]
    meters[0].sample_nics(sampler)
    for _ in range(4):
        for m in meters:
            m.mark_step()
    reports = [m.report() for m in meters]
    assert len(reports[0].nics) == 5 and not reports[1].nics
    traffic = {t.name: t for t in machine_traffic(reports, TOPO, warmup=1)}
    assert (traffic["node0"].nic_sent_bytes_per_step,
            traffic["node0"].nic_recv_bytes_per_step) == (1000, 2000)
    assert traffic["node1"].as_dict()["nic_sent_bytes_per_step"] == 2000
    # Without an emulated network nobody samples, and metrics.json has no nic_* keys.
    plain = machine_traffic([TrafficMeter(r, TOPO).report() for r in range(4)], TOPO)
    assert "nic_sent_bytes_per_step" not in plain[0].as_dict()


def test_what_is_discarded_after_a_step_stays_out_of_the_nic_figures_too():
    # discard() rewrote the last NIC sample, which the window's difference never reads:
    # an evaluation after the last step (which every --eval-every run has) was counted in
    # nic_*, 401,000 bytes a step against the meter's 1,000.
    topo = Topology.from_roles([("worker", "node0"), ("worker", "node1")])
    wire = [0]
    meters = [TrafficMeter(r, topo) for r in range(2)]
    meters[0].sample_nics(lambda: {"node0": (wire[0], wire[0]), "node1": (wire[0], wire[0])})
    for step in range(6):
        wire[0] += 1000  # the step's bytes
        meters[0].record(1, 1000, "sent")
        for m in meters:
            m.mark_step()
        if step in (2, 5):  # an evaluation after steps 3 and 6
            wire[0] += 1_000_000
            meters[0].record(1, 1_000_000, "sent")
            for m in meters:
                m.discard()
    node0 = {t.name: t for t in machine_traffic([m.report() for m in meters], topo,
                                                warmup=1)}["node0"]
    assert node0.sent_bytes_per_step == node0.nic_sent_bytes_per_step == 1000


def test_a_run_shorter_than_its_warmup_still_leaves_out_its_cold_first_step():
    # A run resumed near its end has fewer steps of its own than the warm-up its whole
    # length asks for: the window fell back to every step, the first (cold: the start-up's
    # messages) among them.
    meters = [TrafficMeter(r, TOPO) for r in range(4)]
    for step in range(5):
        meters[0].record(2, 40_000_000 if step == 0 else 1000, "sent")
        for m in meters:
            m.mark_step()
    traffic = {t.name: t for t in machine_traffic([m.report() for m in meters], TOPO,
                                                  warmup=10)}
    assert traffic["node0"].sent_bytes_per_step == 1000
