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
from polytrain.ps.sparse import SparseRowStore
from polytrain.ps.stores import (
    WHOLE_STATE,
    optimizer_state_numel,
    pack_counts,
    unpack_counts,
)


def request(op, src, round_=0, payload=None, lane=0, key=1):
    numel = 0 if payload is None else payload.numel()
    return Request(src, op, key, round_, numel, DTYPES[0], seq=1, lane=lane, payload=payload)


def store(kind, respond, numel=3, pushers=2, dtype="torch.float32", **options):
    decl = Declaration(key=1, kind=int(kind), name="w", numel=numel, dtype=dtype,
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
    assert torch.allclose(out[0][2][:2], torch.tensor([0.0, -1.0]))
    assert unpack_counts(out[0][2][-1:]) == [1]


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


def test_a_push_of_another_dtype_than_declared_is_refused_naming_the_key():
    # Symptom: an int64 or float64 push to a float32 sum key was summed without a word, and
    # a float64 push of 1e6 to a float16 parameter key made it inf. Cause: the stores
    # checked a push's size, not its dtype.
    for kind, dtype, wrong in ((Kind.SUM, "torch.float32", torch.tensor([1, 2, 3])),
                               (Kind.SUM, "torch.float32", torch.ones(3, dtype=torch.float64)),
                               (Kind.PARAM, "torch.float16", torch.full((3,), 1e6,
                                                                        dtype=torch.float64)),
                               (Kind.PARAM, "torch.float32", torch.ones(3, dtype=torch.bfloat16))):
        s = store(kind, [], dtype=dtype)
        rnd = int(kind == Kind.PARAM)
        with pytest.raises(CommError, match=rf"server: key 1 = 'w', 3 x {dtype[6:]}.*: request "
                                            rf"PUSH of round {rnd} from rank 0: it pushed "
                                            rf"{wrong.dtype} values, and the key is declared "
                                            rf"{dtype}. HINT: push the key's dtype"):
            s.handle(request(Op.PUSH, 0, round_=rnd, payload=wrong))
    # What asynchronous BytePS pushes with --compress fp16: float16 updates, to a float32 key.
    out = []
    s = store(Kind.PARAM, out, pushers=1)
    s.handle(request(Op.PUSH, 0, round_=1, payload=torch.full((3,), 0.5, dtype=torch.float16)))
    s.handle(request(Op.GET, 0))
    assert out[-1][2].tolist() == [0.5] * 3 and out[-1][2].dtype == torch.float32


def test_a_third_pusher_of_a_two_pusher_key_is_told_so_not_that_it_pushed_twice():
    # Symptom: a rank beyond the declared pushers heard "this rank already pushed this round".
    # Cause: the sum store checked the finished round before the pusher count.
    s = store(Kind.SUM, [], numel=1)
    for src in (0, 1):
        s.handle(request(Op.PUSH, src, payload=torch.ones(1)))
    with pytest.raises(CommError, match=r"from rank 2: more pushers than the 2 declared: round 0 "
                                        r"had 2 of its 2 pushes \(from rank 0, rank 1\)"):
        s.handle(request(Op.PUSH, 2, payload=torch.ones(1)))
    with pytest.raises(CommError, match="from rank 1: this rank already pushed this round"):
        s.handle(request(Op.PUSH, 1, payload=torch.ones(1)))


def test_an_optimizer_store_of_no_elements_takes_its_set_push_and_pull():
    # Symptom: a zero-element key (a model's 0-size parameter) died on its SET with a bare
    # AssertionError. Cause: an empty tensor's request carries no payload, and the optimizer
    # store asserted one (the sum and parameter stores take it as an empty tensor).
    adam = optimizer_spec(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1),
                          per_round=False)
    sgd = optimizer_spec(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5))
    for spec, settings in ((adam, []), (sgd, round_settings(sgd, sgd["settings"]))):
        out = []
        s = store(Kind.OPTIM, out, numel=0, pushers=1, optimizer=spec, staleness=0)
        s.handle(request(Op.SET, 0))
        s.handle(request(Op.PUSH, 0, round_=1,
                         payload=pack_round(torch.empty(0), settings) if settings else None))
        s.handle(request(Op.PULL, 0, round_=1))
        assert s.applied == 1 and out[-1][2].numel() == 1


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
    assert whole.numel() == optimizer_state_numel(adam, 2) == 8 and whole[-2] == 2
    assert unpack_counts(whole[-1:]) == [2]
    b.handle(request(Op.SET, 0, payload=whole))
    assert b.applied == 2
    for s in (a, b):
        for src in (0, 1):
            s.handle(request(Op.PUSH, src, round_=3, payload=torch.tensor([0.5, 3.0])))
        s.handle(request(Op.GET, 0, round_=WHOLE_STATE))
    assert torch.equal(out[-1][2], again[-1][2])


def test_rounds_past_2_24_come_back_exact_in_an_answer_and_a_whole_state():
    # Symptom: an optimizer store 16,777,217 rounds in answered 16,777,216 (HetPipe's workers
    # re-added an update the value held), and a sparse row store's whole state SET back came
    # out a round short (a re-keyed Parallax range waited for a round nobody pushes). Cause:
    # the counts travelled as float32 values, whole numbers only up to 2**24.
    many = 2 ** 24 + 1
    adam = optimizer_spec(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1),
                          per_round=False)
    out, again = [], []
    a = store(Kind.OPTIM, out, numel=2, optimizer=adam, staleness=0)
    b = store(Kind.OPTIM, again, numel=2, optimizer=adam, staleness=0)
    a.applied = many
    a.handle(request(Op.GET, 0))
    assert unpack_counts(out[-1][2][-1:]) == [many]  # what a worker reads of a PULL's answer
    a.handle(request(Op.GET, 0, round_=WHOLE_STATE))
    b.handle(request(Op.SET, 0, payload=out[-1][2]))
    assert b.applied == many
    rows = {"width": 2, "rule": {"name": "sgd", "lr": 1.0}}
    c, d = (SparseRowStore(Declaration(key=1, kind=int(Kind.SPARSE), name="e", numel=4,
                                       dtype="torch.float32", pushers=1, pullers=1,
                                       options=rows), lambda req, t: out.append(t.clone()))
            for _ in range(2))
    c.applied, c.steps = many, many + 2
    c.handle(request(Op.GET, 0))
    assert unpack_counts(out[-1][-2:]) == [many, many + 2]
    d.handle(request(Op.SET, 0, payload=out[-1]))
    assert (d.applied, d.steps) == (many, many + 2)
    # float64 keys count as far as int64 does; a float32 key's count stops at 2**31 - 1.
    assert unpack_counts(pack_counts([2 ** 53 + 1], torch.float64)) == [2 ** 53 + 1]
    with pytest.raises(CommError, match=r"counts \[2147483648\] do not fit a torch.float32 "
                                        r"key's count \(0 .. 2147483647\). HINT: keep the key "
                                        r"in float64"):
        pack_counts([2 ** 31], torch.float32)


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
