import time

import pytest
import torch
import torch.distributed as dist

import polytrain
from polytrain.ps import Declaration, Kind
from tests.harness import spawn


def clocked(staleness: int) -> dict:
    ctx = polytrain.init()
    server = ctx.topology.servers[0]
    client = ctx.ps_client
    decl = Declaration(key=7, kind=int(Kind.PARAM), name="w", numel=4, dtype="torch.float32",
                       pushers=2, pullers=2, options={"staleness": staleness})
    client.declare(decl, server)
    if ctx.worker_index == 0:
        client.set(server, key=7, tensor=torch.ones(4)).wait()
    dist.barrier(group=ctx.groups.workers)
    out = torch.empty(4)
    seen, waited = [], []
    me = ctx.worker_index
    for clock in range(1, 4):
        if me == 1:
            time.sleep(0.5)  # the slow worker
        client.push(server, key=7, round=clock, tensor=torch.full((4,), float(me + 1))).wait()
        start = time.monotonic()
        client.pull(server, key=7, round=clock, out=out).wait()
        waited.append(time.monotonic() - start)
        seen.append(float(out[0]))
    dist.barrier(group=ctx.groups.workers)
    client.get(server, key=7, out=out).wait()
    return {"seen": seen, "waited": waited, "final": out.tolist()}


@pytest.mark.timeout(60)
def test_staleness_zero_pulls_see_every_push_of_the_clock():
    fast, slow = spawn(clocked, workers=2, servers=1, args=(0,))
    # Clock c's pull sees the initial 1 plus c pushes of 1 (worker 0) and 2 (worker 1).
    assert fast["seen"] == slow["seen"] == [4.0, 7.0, 10.0]
    assert fast["final"] == [10.0] * 4
    assert min(fast["waited"]) > 0.3  # the fast worker waited for the slow one every clock


@pytest.mark.timeout(60)
def test_bounded_staleness_lets_a_worker_run_at_most_s_clocks_ahead():
    fast, slow = spawn(clocked, workers=2, servers=1, args=(1,))
    # Worker 0 may pull clock c once the slow worker has pushed c-1 times.
    assert fast["waited"][0] < 0.3  # clock 1 needs nothing from the slow worker
    assert fast["seen"][0] == 2.0   # only its own first push is in
    assert slow["seen"][-1] >= 10.0 - 1e-6 and fast["final"] == [10.0] * 4
    for i, value in enumerate(fast["seen"], start=1):
        # at least everything of clock c-1 from both, plus its own pushes up to c
        assert value >= 1 + 3 * (i - 1) + 1
