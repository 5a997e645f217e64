import time

import pytest
import torch
import torch.distributed as dist

import polytrain
from polytrain import ConfigError, LaunchError
from polytrain.ps import Declaration, Kind, optimizer_spec, pack_round, round_settings
from polytrain.ps.stores import unpack_counts
from tests.harness import spawn

# The slow worker's pause before each push: the fast worker's push and pull must fit in it
# (a few ms), with room for a stall of this loaded 2-core machine (0.3 s was tight).
SLOW_S = 1.0


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
            time.sleep(SLOW_S)  # the slow worker
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
    # Clock c's pull sees the initial 1 plus c pushes of 1 (worker 0) and 2 (worker 1), and
    # never the fast worker's next push, even when it arrived before the slow worker's pull.
    assert fast["seen"] == [4.0, 7.0, 10.0]
    assert slow["seen"] == [4.0, 7.0, 10.0]
    assert fast["final"] == [10.0] * 4
    # The fast worker waited for the slow one every clock.
    assert min(fast["waited"]) > SLOW_S / 2


@pytest.mark.timeout(60)
def test_bounded_staleness_lets_a_worker_run_at_most_s_clocks_ahead():
    fast, slow = spawn(clocked, workers=2, servers=1, args=(1,))
    # Worker 0 may pull clock c once the slow worker has pushed c-1 times.
    assert fast["waited"][0] < SLOW_S / 2  # clock 1 needs nothing from the slow worker
    assert fast["seen"][0] == 2.0   # only its own first push is in
    assert slow["seen"][-1] >= 10.0 - 1e-6 and fast["final"] == [10.0] * 4
    for i, value in enumerate(fast["seen"], start=1):
        # at least everything of clock c-1 from both, plus its own pushes up to c
        assert value >= 1 + 3 * (i - 1) + 1


def adam_key(spec: dict, staleness: int = 0) -> tuple:
    """Join the run and declare key 3 (4 floats, 2 pushers) in an optimizer store of
    ``spec``, set to 0 1 2 3. Returns the context and the server."""
    ctx = polytrain.init()
    server = ctx.topology.servers[0]
    decl = Declaration(key=3, kind=int(Kind.OPTIM), name="w", numel=4, dtype="torch.float32",
                       pushers=2, pullers=2, options={"staleness": staleness, "optimizer": spec})
    ctx.ps_client.declare(decl, server)
    if ctx.worker_index == 0:
        ctx.ps_client.set(server, key=3, tensor=torch.arange(4.0)).wait()
    dist.barrier(group=ctx.groups.workers)
    return ctx, server


def optimized(staleness: int) -> dict:
    # Two workers push gradients for rounds 1..3 to an Adam on the server; worker 1 is slow.
    adam = optimizer_spec(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1),
                          per_round=False)
    ctx, server = adam_key(adam, staleness)
    client = ctx.ps_client
    out = torch.empty(5)  # the value, then the rounds applied
    seen = []
    me = ctx.worker_index
    for rnd in range(1, 4):
        if me == 1:
            time.sleep(SLOW_S)
        grad = torch.tensor([1.0, -2.0, 3.0, 0.5]) * (me + 1) * rnd
        client.push(server, key=3, round=rnd, tensor=grad).wait()
        client.pull(server, key=3, round=rnd, out=out).wait()
        seen.append(value_and_count(out))
    dist.barrier(group=ctx.groups.workers)
    client.get(server, key=3, out=out).wait()
    return {"seen": seen, "final": value_and_count(out)}


def value_and_count(answer: torch.Tensor) -> list[float]:
    """An optimizer store's answer as a list: the value, then the rounds applied."""
    return answer[:-1].tolist() + unpack_counts(answer[-1:])


def adam_on_sums(rounds: int) -> list[list[float]]:
    w = torch.arange(4.0).requires_grad_()
    opt = torch.optim.Adam([w], lr=0.1)
    values = []
    for rnd in range(1, rounds + 1):
        w.grad = torch.tensor([1.0, -2.0, 3.0, 0.5]) * 3 * rnd  # worker 0's + worker 1's
        opt.step()
        values.append(w.detach().tolist())
    return values


@pytest.mark.timeout(60)
def test_optimizer_store_steps_once_per_round_on_the_sum_of_the_pushes():
    fast, slow = spawn(optimized, workers=2, servers=1, args=(0,))
    expected = adam_on_sums(3)
    for worker in (fast, slow):
        for rnd, (value, want) in enumerate(zip(worker["seen"], expected), start=1):
            assert value[:4] == pytest.approx(want, abs=1e-6)
            assert value[4] == rnd
    assert fast["final"][:4] == pytest.approx(expected[-1], abs=1e-6) and fast["final"][4] == 3


@pytest.mark.timeout(60)
def test_optimizer_store_answers_how_many_rounds_a_stale_pull_holds():
    fast, slow = spawn(optimized, workers=2, servers=1, args=(1,))
    expected = [[0.0, 1.0, 2.0, 3.0]] + adam_on_sums(3)
    # With staleness 1 the fast worker's pull of round r needs r - 1 rounds applied; the
    # count it gets says which value it holds.
    assert fast["seen"][0][4] == 0 and fast["seen"][0][:4] == expected[0]
    for worker in (fast, slow):
        for rnd, value in enumerate(worker["seen"], start=1):
            applied = int(value[4])
            assert rnd - 1 <= applied <= 3
            assert value[:4] == pytest.approx(expected[applied], abs=1e-6)
    assert slow["seen"][-1][4] == 3


def test_optimizer_spec_refuses_what_a_server_cannot_build():
    class Mine(torch.optim.SGD):
        pass
    w = torch.zeros(2, requires_grad=True)
    # The service names no strategy's flags (it once said hetpipe's --no-server-optimizer);
    # a strategy adds its own way out (tests/strategies/test_hetpipe.py).
    with pytest.raises(ConfigError, match=r"only torch.optim's optimizers") as info:
        optimizer_spec(Mine([w], lr=0.1))
    assert "--" not in str(info.value)
    spec = optimizer_spec(torch.optim.AdamW([w], lr=0.1, betas=(0.8, 0.9)))
    assert spec["class"] == "AdamW" and spec["settings"]["betas"] == [0.8, 0.9]
    # What a schedule may change travels with every round; flags do not.
    assert spec["per_round"] == ["betas", "eps", "lr", "weight_decay"]


def test_optimizer_spec_describes_each_parameter_group():
    w, v = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    adam = torch.optim.Adam([{"params": [w], "lr": 0.1},
                             {"params": [v], "lr": 0.2, "weight_decay": 0.0}])
    first, second = optimizer_spec(adam, 0), optimizer_spec(adam, 1)
    assert first["settings"]["lr"] == 0.1 and second["settings"]["lr"] == 0.2
    adam.param_groups[1]["lr"] = 0.05  # a scheduler's change
    assert round_settings(second, adam.param_groups[1]) == [0.9, 0.999, 1e-8, 0.05, 0.0]


def scheduled(disagree: bool) -> list[float]:
    # Rounds 1..3 with a learning rate that changes every round, in one push per worker.
    opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1)
    spec = optimizer_spec(opt)
    ctx, server = adam_key(spec)
    rounds = []
    for rnd in range(1, 4):
        opt.param_groups[0]["lr"] = 0.1 / rnd + (0.01 if disagree and ctx.worker_index else 0)
        grad = torch.tensor([1.0, -2.0, 3.0, 0.5]) * (ctx.worker_index + 1) * rnd
        rounds.append(pack_round(grad, round_settings(spec, opt.param_groups[0])))
    ctx.ps_client.push(server, key=3, round=1, tensor=torch.cat(rounds)).wait()
    out = torch.empty(5)
    ctx.ps_client.pull(server, key=3, round=3, out=out).wait()
    return value_and_count(out)


@pytest.mark.timeout(60)
def test_optimizer_store_steps_each_round_with_the_settings_it_carries():
    w = torch.arange(4.0).requires_grad_()
    opt = torch.optim.Adam([w], lr=0.1)
    for rnd in range(1, 4):
        opt.param_groups[0]["lr"] = 0.1 / rnd
        w.grad = torch.tensor([1.0, -2.0, 3.0, 0.5]) * 3 * rnd
        opt.step()
    for value in spawn(scheduled, workers=2, servers=1, args=(False,)):
        assert value[:4] == pytest.approx(w.detach().tolist(), abs=1e-6) and value[4] == 3
    # The constant learning rate would end elsewhere: the test sees the schedule.
    assert adam_on_sums(3)[-1] != pytest.approx(w.detach().tolist(), abs=1e-3)


@pytest.mark.timeout(60)
def test_optimizer_store_refuses_pushers_that_disagree_on_the_settings():
    with pytest.raises(LaunchError, match=r"server rank 2 .*disagree on the optimizer's "
                                        r"settings of round 1") as e:
        spawn(scheduled, workers=2, servers=1, args=(True,))
    assert "lr=0.11," in str(e.value) and "lr=0.1," in str(e.value)


def batched() -> list[float]:
    # Rounds 1..3 of gradients in one message per worker; one Adam step per round.
    ctx, server = adam_key(optimizer_spec(
        torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1), per_round=False))
    grads = torch.cat([torch.tensor([1.0, -2.0, 3.0, 0.5]) * (ctx.worker_index + 1) * rnd
                       for rnd in range(1, 4)])
    ctx.ps_client.push(server, key=3, round=1, tensor=grads).wait()
    out = torch.empty(5)
    ctx.ps_client.pull(server, key=3, round=3, out=out).wait()
    return value_and_count(out)


@pytest.mark.timeout(60)
def test_optimizer_store_takes_several_rounds_in_one_push():
    for value in spawn(batched, workers=2, servers=1):
        assert value[:4] == pytest.approx(adam_on_sums(3)[-1], abs=1e-6) and value[4] == 3


def declare_bad_optimizer() -> str:
    ctx = polytrain.init()
    bad = {"class": "Adam", "settings": {"lr": 0.1, "bogus": 1}}
    decl = Declaration(key=5, kind=int(Kind.OPTIM), name="w", numel=4, dtype="torch.float32",
                       pushers=1, pullers=1, options={"optimizer": bad})
    try:
        ctx.ps_client.declare(decl, ctx.topology.servers[0])
    except ConfigError as e:
        return str(e)
    return "declared"


@pytest.mark.timeout(60)
def test_a_store_the_server_cannot_build_is_refused_with_the_reason():
    (message,) = spawn(declare_bad_optimizer, workers=1, servers=1)
    assert "bogus" in message and "--no-server-optimizer" not in message


def two_lanes() -> list[float]:
    # One process pushes for two pushers (lanes 0 and 1, as HetPipe's policy bd does for its
    # two virtual workers): the store counts them apart and steps once on their sum.
    ctx = polytrain.init()
    server = ctx.topology.servers[0]
    adam = optimizer_spec(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1),
                          per_round=False)
    decl = Declaration(key=3, kind=int(Kind.OPTIM), name="w", numel=4, dtype="torch.float32",
                       pushers=2, pullers=2, options={"staleness": 0, "optimizer": adam})
    ctx.ps_client.declare(decl, server)
    ctx.ps_client.set(server, key=3, tensor=torch.arange(4.0)).wait()
    grad = torch.tensor([1.0, -2.0, 3.0, 0.5])
    ctx.ps_client.push(server, key=3, round=1, tensor=grad, lane=0).wait()
    ctx.ps_client.push(server, key=3, round=1, tensor=2 * grad, lane=1).wait()
    out = torch.empty(5)
    ctx.ps_client.pull(server, key=3, round=1, out=out).wait()
    return value_and_count(out)


@pytest.mark.timeout(60)
def test_one_process_pushes_for_two_pushers_on_two_lanes():
    (value,) = spawn(two_lanes, workers=1, servers=1)
    assert value[:4] == pytest.approx(adam_on_sums(1)[0], abs=1e-6) and value[4] == 1
