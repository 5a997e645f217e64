import time

import pytest
import torch

import polytrain
from polytrain import LaunchError
from polytrain.comm import TensorSpec, partition
from polytrain.ps import Kind, balanced, engine_for
from polytrain.ps.protocol import HEADER_BYTES
from tests.harness import spawn

SPECS = [TensorSpec("a", (1000,), torch.float32), TensorSpec("b", (37, 11), torch.float32)]


def contribution(worker: int, round_: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * worker + round_)
    return [torch.randn(s.shape, generator=g) for s in SPECS]


def push_sums(partition_bytes: int, rounds: int) -> dict:
    ctx = polytrain.init()
    parts = partition(SPECS, partition_bytes)
    placement = balanced(parts, ctx.topology.servers)
    engine = engine_for(ctx)
    sums = engine.sums(SPECS, placement, local_reduce=False)
    before = ctx.meter.report()
    results = []
    for r in range(rounds):
        tensors = contribution(ctx.worker_index, r)
        for t, s in zip(tensors, sums):
            engine.submit(s, t)
        outs = [engine.wait(s).view(t.shape).clone() for t, s in zip(tensors, sums)]
        results.append(outs)
    # Close first: a push's receipt is counted when the engine's drain thread has waited
    # for it, which may be just after the last sum is back.
    engine.close()
    after = ctx.meter.report()
    sent = {s: after.bytes("sent", [s]) - before.bytes("sent", [s]) for s in ctx.topology.servers}
    recv = {s: after.bytes("recv", [s]) - before.bytes("recv", [s]) for s in ctx.topology.servers}
    reports = ctx.shutdown()
    return {"results": results, "sent": sent, "recv": recv, "owned": placement.bytes_by_owner(),
            "requests": {s: placement.owners.count(s) * rounds for s in ctx.topology.servers},
            "server_reports": {r.rank: r for r in reports if r.rank in ctx.topology.servers},
            "worker_reports": [r for r in reports if r.rank in ctx.topology.workers]}


@pytest.mark.timeout(90)
def test_four_workers_push_to_two_servers_and_pull_exact_sums():
    rounds = 2
    out = spawn(push_sums, workers=4, nodes=2, servers=2, args=(1024, rounds))
    for r in range(rounds):
        expected = [sum(contribution(w, r)[i] for w in range(4)) for i in range(len(SPECS))]
        for worker in out:
            for got, want in zip(worker["results"][r], expected):
                # The service sums in rank order: the same bits everywhere, equal to a local sum.
                assert torch.allclose(got, want, atol=1e-6)
        assert all(torch.equal(a, b) for w in out for a, b in
                   zip(w["results"][r], out[0]["results"][r]))
    w0 = out[0]
    assert sorted(w0["owned"]) == [4, 5]  # ranks 4 and 5 are the servers
    total = sum(s.nbytes for s in SPECS)
    assert sum(w0["owned"].values()) == total
    assert max(w0["owned"].values()) / min(w0["owned"].values()) <= 1.05
    for worker in out:
        for server, owned in worker["owned"].items():
            n = worker["requests"][server]
            # Every round pushes the owned bytes with one header per partition (in one message
            # since stop 25: the bytes are the same), and pulls them back with the server's
            # receipt for each push (one int64).
            assert worker["sent"][server] == rounds * owned + n * HEADER_BYTES
            assert worker["recv"][server] == rounds * owned + n * 8
    # The servers' own meters saw what the workers say they sent and received, byte for byte.
    for server, report in w0["server_reports"].items():
        workers_sent = sum(r.bytes("sent", [server]) for r in w0["worker_reports"])
        workers_recv = sum(r.bytes("recv", [server]) for r in w0["worker_reports"])
        assert report.bytes("recv") == workers_sent
        assert report.bytes("sent") == workers_recv


def declare_mismatch() -> None:
    ctx = polytrain.init()
    shape = (1000,) if ctx.worker_index == 0 else (999,)
    parts = partition([TensorSpec("a", shape, torch.float32)], 1 << 20)
    engine_for(ctx).declare(balanced(parts, ctx.topology.servers), kind=Kind.SUM, pushers=2,
                            pullers=2)
    time.sleep(30)  # worker 0 would wait for sums that never come


@pytest.mark.timeout(60)
def test_workers_that_declare_different_tensors_get_a_clear_error():
    with pytest.raises(LaunchError) as info:
        spawn(declare_mismatch, workers=2, servers=1)
    msg = str(info.value)
    # Failed about 1 run in 6 on a busy machine: the test assumed worker 0's declaration
    # reaches the server first. Either may; the later one gets the error naming both.
    late, early = (1, 0) if "failed: ConfigError: worker rank 1 " in msg else (0, 1)
    numel = {0: 1000, 1: 999}
    assert f"worker rank {late} (machine node0) failed: ConfigError: worker rank {late} " \
           f"(machine node0) declared key 0 = 'a[0]', {numel[late]} x float32" in msg
    assert f"but worker rank {early} (machine node0) declared key 0 = 'a[0]', " \
           f"{numel[early]} x float32" in msg
    assert "differ in numel" in msg and "HINT: build the same model" in msg


def sums_with_gaps(idle_s: float, gap_s: float, rounds: int) -> list[float]:
    ctx = polytrain.init(server_idle_s=idle_s)
    parts = partition(SPECS, 1 << 20)
    engine = engine_for(ctx)
    sums = engine.sums(SPECS, balanced(parts, ctx.topology.servers), local_reduce=False)
    out = []
    for r in range(rounds):
        time.sleep(gap_s)
        for t, s in zip(contribution(ctx.worker_index, r), sums):
            engine.submit(s, t)
        out.append(float(sum(engine.wait(s).sum() for s in sums)))
    engine.close()
    return out


@pytest.mark.timeout(60)
def test_a_run_longer_than_the_servers_idle_timeout_ends_well():
    # The servers' watch of each worker waited at most the idle timeout (an hour by default)
    # for the worker's end, so every run with servers that trained longer than that failed.
    idle, gap, rounds = 3.0, 0.5, 8
    out = spawn(sums_with_gaps, workers=2, servers=1, args=(idle, gap, rounds))
    want = [float(sum((contribution(0, r)[i] + contribution(1, r)[i]).sum()
                      for i in range(len(SPECS)))) for r in range(rounds)]
    assert out[0] == pytest.approx(want, rel=1e-5) and out[1] == out[0]


@pytest.mark.timeout(60)
def test_a_gap_between_requests_longer_than_the_servers_idle_timeout_is_named():
    with pytest.raises(LaunchError) as info:
        spawn(sums_with_gaps, workers=2, servers=1, args=(2.0, 4.0, 1))
    msg = str(info.value)
    assert "server rank 2 (machine" in msg and \
        "no request from the workers [0, 1] for 2 s" in msg, msg
    assert "server_idle_s" in msg


def quiet_longer_than_the_idle_timeout(idle_s: float, quiet_s: float) -> bool:
    ctx = polytrain.init(server_idle_s=idle_s)
    time.sleep(quiet_s)  # no store declared: the servers have nothing to serve
    ctx.shutdown()
    return True


@pytest.mark.timeout(60)
def test_servers_that_hold_no_store_wait_for_the_end_however_long():
    # Parallax with no sparse parameter starts servers that get no request until the end:
    # they stopped a healthy run after the idle timeout (an hour by default).
    assert spawn(quiet_longer_than_the_idle_timeout, workers=2, servers=1,
                 args=(2.0, 5.0)) == [True, True]


def free_then_push() -> None:
    import torch.distributed as dist

    ctx = polytrain.init()
    engine = engine_for(ctx)
    spec = [TensorSpec("a", (8,), torch.float32)]
    placed = engine.keyed(spec, balanced(partition(spec, 1 << 20), ctx.topology.servers))
    engine.declare(placed, kind=Kind.SUM, pushers=2, pullers=2)
    out = torch.empty(8)
    engine.push(placed, 0, round=0, tensor=torch.ones(8)).wait()
    engine.pull(placed, 0, round=0, out=out).wait()
    assert torch.equal(out, torch.full((8,), 2.0))
    dist.barrier(group=ctx.groups.workers)
    if ctx.worker_index == 0:
        engine.free(placed)
    dist.barrier(group=ctx.groups.workers)
    if ctx.worker_index == 1:
        engine.push(placed, 0, round=1, tensor=torch.ones(8)).wait()
    ctx.shutdown()


@pytest.mark.timeout(60)
def test_a_freed_key_is_gone_from_its_server():
    # Parallax's repartitions left every old range's store (values and the rule's state) on
    # the servers: each partition count the search tried kept a copy of the tables (with
    # Adam, 3 x 51.6 MB for wordlm's), never read again. (Until stop 47 a FREE had no
    # receipt, and the other worker's PUSH could reach the key first: 1 run in many passed
    # it without an error.)
    with pytest.raises(LaunchError) as info:
        spawn(free_then_push, workers=2, servers=1)
    msg = str(info.value)
    assert "server rank 2 (machine server0) failed: CommError: server rank 2: rank 1 sent " \
           "PUSH for key" in msg and "which nobody declared here" in msg, msg


def test_a_request_queued_behind_its_keys_free_is_refused_as_undeclared():
    # The FREE and a later PUSH of its key were both dispatched before the engine thread
    # freed it (the main loop finds the key still pinned): the PUSH met KeyError: 0 in the
    # engine thread, and the run failed naming no key (1 CI run in many).
    from types import SimpleNamespace

    from polytrain.errors import CommError
    from polytrain.ps.protocol import Op, Request
    from polytrain.ps.server import Server, _Engine

    failed: list[BaseException] = []
    acknowledged: list[Op] = []  # a FREE is acknowledged: later requests find the key gone
    server = SimpleNamespace(stores={0: None}, forget=lambda key: server.stores.pop(key),
                             fail=failed.append, handling=lambda req: None, rank=2,
                             acknowledge=lambda req: acknowledged.append(req.op))
    server.undeclared = lambda req: Server.undeclared(server, req)
    engine = _Engine(server, 0)
    for op in (Op.FREE, Op.PUSH):
        engine.queue.put((Request(src=1, op=op, key=0, round=1, numel=0, dtype=torch.float32,
                                  seq=7, lane=0), None))
    engine.queue.put(None)
    engine.run()
    assert len(failed) == 1 and isinstance(failed[0], CommError), failed
    assert str(failed[0]).startswith("server rank 2: rank 1 sent PUSH for key 0, which nobody "
                                     "declared here")
    assert acknowledged == [Op.FREE]
