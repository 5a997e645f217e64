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


def test_answers_a_server_holds_while_stuck_in_a_store_name_the_server_not_the_workers(
        tmp_path):
    # Symptom: a server whose sum of round 3 never returned, after every push had arrived,
    # was named with "round 3 has 2 of its 2 pushes" and the hint to look for a push_pull
    # only some workers run: its own stuck thread was blamed on the workers. Cause: the
    # report said why a store waits, never that its engine thread had not come back from it.
    import json
    import threading
    from types import SimpleNamespace

    from polytrain.ps.protocol import Op, Request
    from polytrain.ps.server import Server, _Held
    from polytrain.ps.stores import Declaration, SumStore

    release = threading.Event()

    class StuckSum(SumStore):
        def _sum(self, pushes):
            release.wait(30)
            return super()._sum(pushes)

    transport = SimpleNamespace(rank=4, timeout_s=0.2, isend=lambda *args: None)
    topology = SimpleNamespace(name=lambda r: f"worker rank {r} (machine node{r})")
    server = Server(transport, topology, threads=1, idle_timeout_s=10.0)
    server._held_path = str(tmp_path / "held.json")
    decl = Declaration(key=2, kind=int(Kind.SUM), name="w[2]", numel=4, dtype="torch.float32",
                       pushers=2, pullers=2)
    [engine] = server.engines
    server.stores[2], server.declarations[2], server.pinned[2] = (
        StuckSum(decl, server.respond), (0, decl), engine)
    for src in (0, 1):
        server._held[(src, 9)] = _Held(Op.PUSHPULL, 2, 3, time.monotonic())
        engine.queue.put((Request(src=src, op=Op.PUSHPULL, key=2, round=3, numel=4,
                                  dtype=torch.float32, seq=9, lane=0, payload=torch.ones(4)),
                          None))
    engine.start()
    try:
        time.sleep(0.3)  # past half the timeout: held long, and the engine inside the store
        server._report_held()
        held = json.loads((tmp_path / "held.json").read_text())
    finally:
        release.set()
        engine.queue.put(None)
        engine.join(5)
    assert held["held"].startswith(
        "PUSHPULL of 'w[2]' (key 2) round 3 for worker rank 0 (machine node0), held 0 s: "
        "round 3 has 2 of its 2 pushes (from rank 0, rank 1), and the server's engine thread "
        "polytrain-engine-0 has been in the store of 'w[2]' (key 2), handling PUSHPULL round 3 "
        "from worker rank 1 (machine node1), for 0 s: busy or stuck there"), held
    assert held["hint"].startswith("the server is stuck or slow, not the workers"), held


def test_a_sum_that_times_out_names_the_server_whose_answer_it_waits_for():
    # Symptom: a worker waiting on a stuck server said only "rank 0: the sum of
    # '0.weight..1.bias' did not arrive within 10 s", naming no server. Cause: the wait knew
    # how many of its partitions were missing, not which, nor whose.
    import threading
    from types import SimpleNamespace

    from polytrain.errors import CommTimeout
    from polytrain.ps.engine import Engine, SumTensor, _Part

    stuck = threading.Event()  # server rank 4 never answers (until the test ends)

    class Answer:
        def __init__(self, owner: int) -> None:
            self.owner = owner

        def wait(self, timeout_s: float | None = None) -> None:
            if self.owner == 4:
                stuck.wait(30)

    class Context:  # what the engine reads of a run (weakly referenced: not a namespace)
        ps_client = SimpleNamespace(request=lambda owner, op, **kw: [Answer(owner), Answer(5)])
        local_workers, rank, timeout_s, transport, closed = (0,), 0, 0.2, None, False
        topology = SimpleNamespace(name=lambda r: f"server rank {r} (machine server{r - 4})")

    engine = Engine(Context())  # type: ignore[arg-type]
    spec = TensorSpec("w", (40,), torch.float32)
    t = SumTensor("w", spec, result=torch.empty(40))
    # Five partitions of 8 elements, keys 0..4, the even ones on server rank 4: the answer
    # for key 0 holds the completer, and with it every answer after it.
    t.parts = [_Part(p, 4 + p.index % 2, 0, t, ()) for p in partition([spec], 32)]
    engine.tensors.append(t)
    engine._start()
    try:
        engine.submit(t, torch.ones(40))
        with pytest.raises(CommTimeout) as info:
            engine.wait(t)
    finally:
        stuck.set()
        engine.close()
    assert str(info.value).startswith(
        "rank 0: the sum of 'w' did not arrive within 0.2 s, waiting for server rank 4 "
        "(machine server0): its answer for key 0 ('w[0]') has not come back, and 4 more of "
        "this sum's partitions wait behind it. HINT: "), info.value


def test_a_pull_held_for_a_pusher_behind_the_others_names_that_pusher(tmp_path):
    # Symptom: a HetPipe run whose slow virtual worker had not pushed yet ended "server rank 4
    # failed: held answers ... round 1 has 1 of its 2 pushes (from rank 1)", with the hint
    # to look for a push_pull only some workers run: the server was blamed, and the slow
    # process was not named. Cause: a store knows who pushed, not who has yet to.
    import json
    from types import SimpleNamespace

    from polytrain.ps.protocol import Op, Request, encode
    from polytrain.ps.server import Server
    from polytrain.ps.stores import Declaration

    transport = SimpleNamespace(rank=4, timeout_s=0.2, isend=lambda *args: None)
    topology = SimpleNamespace(name=lambda r: f"worker rank {r} (machine node{r})")
    server = Server(transport, topology, threads=1, idle_timeout_s=10.0)
    server._held_path = str(tmp_path / "held.json")
    decl = Declaration(key=0, kind=int(Kind.PARAM), name="w[0]", numel=4,
                       dtype="torch.float32", pushers=2, pullers=2)

    def request(src: int, op: Op, round_: int, payload: torch.Tensor | None) -> Request:
        return Request(src=src, op=op, key=0, round=round_,
                       numel=0 if payload is None else payload.numel(),
                       dtype=torch.float32 if payload is None else payload.dtype, seq=src,
                       lane=0, payload=payload)
    for src in (0, 2):  # both declare it; rank 0 pushes round 1 and pulls it
        server._declare(request(src, Op.DECLARE, 0, encode(decl.as_json())))
    [engine] = server.engines
    engine.start()
    try:
        server._dispatch(request(0, Op.PUSH, 1, torch.ones(4)))
        server._dispatch(request(0, Op.PULL, 1, None))
        time.sleep(0.3)  # past half the timeout
        server._report_held()
        held = json.loads((tmp_path / "held.json").read_text())
    finally:
        engine.queue.put(None)
        engine.join(5)
    assert held["held"] == (
        "PULL of 'w[0]' (key 0) round 1 for worker rank 0 (machine node0), held 0 s: it needs "
        "every one of its 2 pushers at clock 1 or more; pushers' clocks: rank 0 at 1; pushes "
        "behind: worker rank 2 (machine node2) has pushed none yet"), held
    assert held["behind"] == [2]
    assert held["hint"].startswith("the answers wait for the pushes of processes behind the "
                                   "others"), held
