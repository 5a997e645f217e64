"""The servers' state machines driven directly, without processes; new store kinds; placements."""

import itertools

import pytest
import torch

from polytrain import CommError, ConfigError
from polytrain.comm import TensorSpec, partition
from polytrain.ps import (
    STORES,
    Declaration,
    Kind,
    Op,
    Placement,
    SumStore,
    optimizer_spec,
    pack_round,
    register_store,
    round_settings,
    store_name,
)
from polytrain.ps.protocol import DTYPES, Request
from polytrain.ps.stores import WHOLE_STATE, optimizer_state_numel


def request(op, src, round_=0, payload=None, lane=0, key=1):
    numel = 0 if payload is None else payload.numel()
    return Request(src, op, key, round_, numel, DTYPES[0], seq=1, lane=lane, payload=payload)


def store(kind, respond, numel=3, pushers=2, **options):
    decl = Declaration(key=1, kind=int(kind), name="w", numel=numel, dtype="torch.float32",
                       pushers=pushers, pullers=pushers, options=options)
    return STORES[kind](decl, lambda req, t: respond.append((req.src, req.round, t.clone())))


def test_a_sum_store_answers_early_pulls_once_every_pusher_is_in_and_frees_the_round():
    out = []
    s = store(Kind.SUM, out)
    s.handle(request(Op.PUSHPULL, 3, payload=torch.tensor([1.0, 2.0, 3.0])))
    assert out == []  # the second pusher is missing: the pull waits
    s.handle(request(Op.PUSHPULL, 2, payload=torch.tensor([10.0, 20.0, 30.0])))
    assert [(src, r) for src, r, _ in out] == [(3, 0), (2, 0)]
    assert all(torch.equal(t, torch.tensor([11.0, 22.0, 33.0])) for _, _, t in out)
    assert s.rounds == {}  # both pullers served
    s.handle(request(Op.PUSH, 2, round_=1, payload=torch.ones(3)))
    with pytest.raises(CommError, match="already pushed"):
        s.handle(request(Op.PUSH, 2, round_=1, payload=torch.ones(3)))


def test_a_sum_store_adds_in_the_pushers_rank_order_whatever_the_arrival_order():
    # float32: (1e8 + 1) - 1e8 = 0 in rank order, but (1e8 - 1e8) + 1 = 1 in arrival order
    # 0, 2, 1: only a sum in rank order gives 0 for every order.
    values = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    in_rank_order = (values[0] + values[1]) + values[2]
    assert torch.equal(in_rank_order, torch.tensor([0.0]))
    for order in itertools.permutations(range(3)):
        out = []
        s = store(Kind.SUM, out, numel=1, pushers=3)
        for src in order:
            s.handle(request(Op.PUSH, src, payload=values[src]))
        s.handle(request(Op.PULL, 0))
        assert torch.equal(out[0][2], in_rank_order), order


def test_a_parameter_store_holds_pulls_until_the_slowest_clock_allows():
    out = []
    s = store(Kind.PARAM, out, staleness=1)
    s.handle(request(Op.SET, 0, payload=torch.zeros(3)))
    s.handle(request(Op.PUSH, 0, round_=1, payload=torch.ones(3)))
    s.handle(request(Op.PUSH, 0, round_=2, payload=torch.ones(3)))
    s.handle(request(Op.PULL, 0, round_=2))
    assert out == []  # pusher 1 is at clock 0 < 2 - 1
    s.handle(request(Op.PUSH, 1, round_=1, payload=torch.ones(3)))
    assert len(out) == 1 and torch.equal(out[0][2], torch.full((3,), 3.0))


def test_a_parameter_store_pull_of_a_round_never_holds_a_later_rounds_push():
    # Staleness 0: pusher 0 pulls round 1 and pushes round 2 before pusher 1's pull of round 1
    # arrives; that pull still answers the value after round 1 (asynchronous BytePS with
    # staleness 0 is synchronous SGD only so).
    out = []
    s = store(Kind.PARAM, out)
    s.handle(request(Op.SET, 0, payload=torch.zeros(3)))
    s.handle(request(Op.PUSH, 0, round_=1, payload=torch.ones(3)))
    s.handle(request(Op.PUSH, 1, round_=1, payload=torch.full((3,), 2.0)))
    s.handle(request(Op.PULL, 0, round_=1))
    s.handle(request(Op.PUSH, 0, round_=2, payload=torch.full((3,), 10.0)))
    s.handle(request(Op.PULL, 1, round_=1))
    s.handle(request(Op.GET, 1))
    assert [t.tolist() for _, _, t in out] == [[3.0] * 3, [3.0] * 3, [13.0] * 3]
    s.handle(request(Op.PUSH, 1, round_=2, payload=torch.full((3,), 20.0)))
    s.handle(request(Op.PULL, 1, round_=2))
    assert out[-1][2].tolist() == [33.0] * 3


def test_a_parameter_store_refuses_a_push_whose_round_is_not_the_pushers_count():
    # A pull's answer is cut by round, so a caller numbering its pushes otherwise would read
    # answers without some of its pushes: refused instead, naming the numbering.
    s = store(Kind.PARAM, [])
    s.handle(request(Op.PUSH, 0, round_=1, payload=torch.ones(3)))
    with pytest.raises(CommError, match=r"PUSH of round 3 from rank 0: it is this pusher's "
                                        r"push number 2"):
        s.handle(request(Op.PUSH, 0, round_=3, payload=torch.ones(3)))


def test_a_parameter_store_keeps_no_push_it_was_handed():
    # A push's payload is a view of the server's pooled receive buffer: a store that kept it
    # would pin 4 MiB per push (and the buffer is reused once the request is dropped).
    out = []
    s = store(Kind.PARAM, out, staleness=2)
    pushed = [torch.full((3,), 1.0), torch.full((3,), 2.0), torch.full((3,), 4.0)]
    for rnd, payload in enumerate(pushed, start=1):
        s.handle(request(Op.PUSH, 0, round_=rnd, payload=payload))
    for payload in pushed:
        payload.fill_(100.0)  # the buffer reused for another request
    s.handle(request(Op.PULL, 0, round_=2))
    s.handle(request(Op.GET, 0))
    assert [t.tolist() for _, _, t in out] == [[3.0] * 3, [7.0] * 3]


def test_an_optimizer_store_steps_once_per_round_on_the_sum_under_the_rounds_settings():
    sgd = optimizer_spec(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5))
    out = []
    s = store(Kind.OPTIM, out, numel=2, optimizer=sgd, staleness=0)
    s.handle(request(Op.SET, 0, payload=torch.tensor([1.0, 1.0])))
    group = {"lr": 0.5, "momentum": 0, "dampening": 0, "weight_decay": 0}
    grad = pack_round(torch.tensor([1.0, 2.0]), round_settings(sgd, {**sgd["settings"],
                                                                    **group}))
    s.handle(request(Op.PUSH, 0, round_=1, payload=grad))
    s.handle(request(Op.PULL, 0, round_=1))
    assert out == [] and s.applied == 0
    s.handle(request(Op.PUSH, 1, round_=1, payload=grad))
    # The answer is the value, then how many rounds it holds.
    assert torch.allclose(out[0][2], torch.tensor([0.0, -1.0, 1.0]))


def test_an_optimizer_store_steps_as_the_users_optimizer_does_bit_for_bit():
    # The store chose torch's fused Adam where the user's is the plain one: other
    # arithmetic, 3e-8 off in 5 steps.
    torch.manual_seed(0)
    start, grads = torch.randn(64), [torch.randn(64) for _ in range(5)]
    param = start.clone().requires_grad_()
    adam = torch.optim.Adam([param], lr=0.01)
    spec = optimizer_spec(adam)
    out = []
    s = store(Kind.OPTIM, out, numel=64, pushers=1, optimizer=spec, staleness=0)
    s.handle(request(Op.SET, 0, payload=start.clone()))
    for i, g in enumerate(grads, 1):
        s.handle(request(Op.PUSH, 0, round_=i,
                         payload=pack_round(g, round_settings(spec, spec["settings"]))))
        param.grad = g.clone()
        adam.step()
    s.handle(request(Op.PULL, 0, round_=5))
    assert torch.equal(out[-1][2][:64], param.detach())


@pytest.mark.parametrize("kind", [Kind.SUM, Kind.PARAM])
def test_a_push_of_another_size_than_declared_is_refused_naming_the_key(kind):
    # One of another size was broadcast into the sum ([2, 2, 2] from ones(3) and ones(1)),
    # or failed in torch naming no key.
    for wrong, said in ((torch.ones(1), "1 elements"), (torch.ones(4), "4 elements")):
        s = store(kind, [], numel=3)
        if kind == Kind.SUM:
            s.handle(request(Op.PUSH, 0, payload=torch.ones(3)))
        with pytest.raises(CommError, match=rf"server: .*w.*: request PUSH of round "
                                            rf"{int(kind == Kind.PARAM)} from rank 1: it pushed "
                                            rf"{said}, and the key is declared 3 x "
                                            rf"torch.float32"):
            s.handle(request(Op.PUSH, 1, round_=int(kind == Kind.PARAM), payload=wrong))


def test_a_store_says_why_a_held_answer_waits():
    # A server's report of answers held long (the launcher names it when a worker times out).
    out = []
    sums = store(Kind.SUM, out)
    assert sums.waiting_for(0) == "round 0 has 0 of its 2 pushes"
    sums.handle(request(Op.PUSHPULL, 3, payload=torch.ones(3), lane=1))
    assert sums.waiting_for(0) == "round 0 has 1 of its 2 pushes (from rank 3 lane 1)"
    params = store(Kind.PARAM, out, staleness=1)
    params.handle(request(Op.PUSH, 0, round_=1, payload=torch.ones(3)))
    params.handle(request(Op.PUSH, 0, round_=2, payload=torch.ones(3)))
    assert params.waiting_for(3) == ("it needs every one of its 2 pushers at clock 2 or more; "
                                     "pushers' clocks: rank 0 at 2")
    sgd = optimizer_spec(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5))
    optim = store(Kind.OPTIM, out, numel=2, optimizer=sgd, staleness=0)
    group = {"lr": 0.5, "momentum": 0, "dampening": 0, "weight_decay": 0}
    grad = pack_round(torch.tensor([1.0, 2.0]), round_settings(sgd, {**sgd["settings"],
                                                                    **group}))
    optim.handle(request(Op.PUSH, 1, round_=1, payload=grad))
    assert optim.waiting_for(1) == "0 rounds applied; round 1 has 1 of its 2 pushes (from rank 1)"
    assert out == []


def test_an_optimizer_stores_whole_state_comes_back_with_a_set_of_its_size():
    adam = optimizer_spec(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1),
                          per_round=False)
    out, again = [], []
    a = store(Kind.OPTIM, out, numel=2, optimizer=adam, staleness=0)
    b = store(Kind.OPTIM, again, numel=2, optimizer=adam, staleness=0)
    a.handle(request(Op.SET, 0, payload=torch.tensor([1.0, 1.0])))
    for rnd in (1, 2):
        for src in (0, 1):
            a.handle(request(Op.PUSH, src, round_=rnd, payload=torch.tensor([1.0, -2.0])))
    a.handle(request(Op.GET, 0, round_=WHOLE_STATE))
    whole = out[-1][2]
    # value, exp_avg, exp_avg_sq (2 each), step, rounds applied
    assert whole.numel() == optimizer_state_numel(adam, 2) == 8 and whole[-2:].tolist() == [2, 2]
    b.handle(request(Op.SET, 0, payload=whole))
    assert b.applied == 2
    for s in (a, b):
        for src in (0, 1):
            s.handle(request(Op.PUSH, src, round_=3, payload=torch.tensor([0.5, 3.0])))
        s.handle(request(Op.GET, 0, round_=WHOLE_STATE))
    assert torch.equal(out[-1][2], again[-1][2])


class MaxStore(SumStore):
    """The largest push per element: a kind of our own."""

    def _sum(self, pushes):
        return torch.stack(list(pushes.values())).amax(0)


def test_a_new_store_kind_is_registered_described_and_served():
    register_store(100, MaxStore, "max")
    try:
        decl = Declaration(key=9, kind=100, name="m", numel=2, dtype="torch.float32",
                           pushers=2, pullers=2)
        assert "max store" in decl.describe() and store_name(100) == "max"
        out = []
        s = STORES[100](decl, lambda req, t: out.append(t))
        s.handle(request(Op.PUSH, 0, payload=torch.tensor([1.0, 5.0])))
        s.handle(request(Op.PUSHPULL, 1, payload=torch.tensor([3.0, 2.0])))
        assert torch.equal(out[0], torch.tensor([3.0, 5.0]))
        with pytest.raises(ConfigError, match="store kind 100 is taken by MaxStore"):
            register_store(100, SumStore)
        assert "unknown kind 101" in Declaration(key=1, kind=101, name="x", numel=1,
                                                 dtype="torch.float32", pushers=1,
                                                 pullers=1).describe()
    finally:
        del STORES[100]


SPECS = [TensorSpec("a", (10,), torch.float32), TensorSpec("b", (6,), torch.float32)]


def test_a_placement_that_does_not_fit_the_tensors_or_the_run_is_refused_with_the_values():
    parts = partition(SPECS, 1 << 20)
    Placement(parts, (4, 5)).check(SPECS, [4, 5])  # fits
    with pytest.raises(ConfigError, match=r"rank 1, which is not a server \(the servers are "
                                          r"\[4, 5\]\)"):
        Placement(parts, (4, 1)).check(SPECS, [4, 5])
    past = (parts[0], parts[1].__class__(1, 1, "b", 0, 4, 6, 24, torch.float32))
    with pytest.raises(ConfigError, match=r"covers elements \[4, 10\) of 'b', which has 6"):
        Placement(past, (4, 5)).check(SPECS, [4, 5])
    with pytest.raises(ConfigError, match=r"handlers \[2\] are not workers of a machine of 2"):
        Placement(parts, (4, 5), (0, 2)).check(SPECS, [4, 5], local_workers=2)
    # A sum left elements no partition held as the memory that was there.
    cut = partition(SPECS, 16)  # a: [0, 4) [4, 7) [7, 10); b: [0, 3) [3, 6)
    gap = tuple(p for p in cut if (p.name, p.index) != ("a", 1))
    with pytest.raises(ConfigError, match=r"elements \[4, 7\) of 'a' are in no partition.*"
                                          r"HINT: cut every tensor into partitions that cover"):
        Placement(gap, (4,) * len(gap)).check(SPECS, [4, 5])
    twice = (*cut, cut[-1])
    with pytest.raises(ConfigError, match=r"elements \[3, 6\) of 'b' are in two partitions"):
        Placement(twice, (4,) * len(twice)).check(SPECS, [4, 5])
    unplaced = tuple(p for p in cut if p.name == "a")
    with pytest.raises(ConfigError, match=r"elements \[0, 6\) of 'b' are in no partition"):
        Placement(unplaced, (4,) * len(unplaced)).check(SPECS, [4, 5])


def test_a_declaration_mismatch_names_the_size_before_the_name_that_carries_it():
    def decl(name, numel, dtype="torch.float32"):
        return Declaration(key=1, kind=int(Kind.SUM), name=name, numel=numel, dtype=dtype,
                           pushers=2, pullers=2)
    assert decl("g[0] of 10", 10).mismatch(decl("g[0] of 12", 12)) == "numel"
    assert decl("g", 10).mismatch(decl("g", 10, "torch.float16")) == "dtype"
    assert decl("grad.a[0] of 10", 10).mismatch(decl("grad.b[0] of 10", 10)) == "name"
    assert decl("g", 10).mismatch(decl("g", 10)) is None
