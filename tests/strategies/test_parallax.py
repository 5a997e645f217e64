"""Parallax: the plan, the sparse row store, the row rules, the single run's weights, traffic."""

import re

import pytest
import torch
from torch import nn

from polytrain import CommError, ConfigError, TrainConfig
from polytrain.models import WordLM
from polytrain.optim import LazyAdam, row_adagrad, row_adam, row_sgd, sparse_rule
from polytrain.ps.protocol import Op, Request
from polytrain.ps.sparse import SparseRowStore, pack_rows, rule_settings, state_numel
from polytrain.ps.stores import Declaration, unpack_counts
from polytrain.strategies.parallax import (
    ParallaxOptions,
    PartitionSearch,
    SparseVar,
    classify,
    fit_cost,
    parallax_traffic,
    plan_parallax,
)
from polytrain.strategies.parallax.rows import _Var, check_declared
from polytrain.wrapper import unwrap
from tests.harness import max_abs_diff, run_cached, run_config, single_of

STEPS = 4
MODEL = {"vocab": 2000, "seq_len": 8, "d_model": 16, "layers": 1, "heads": 2, "negatives": 32}
TOLERANCE = {"sgd": 1e-6, "adagrad": 2e-5}
LR = {"sgd": 0.5, "adagrad": 0.05}


def config(nodes, workers, servers, optimizer="sgd", steps=STEPS, model=None, **options):
    options = {"partitions": 3, **options}
    return TrainConfig(strategy="parallax", model="wordlm", workers=workers, nodes=nodes,
                       servers=servers, steps=steps, batch_size=8, optimizer=optimizer,
                       lr=LR[optimizer], model_options=model or MODEL,
                       strategy_options={k: v for k, v in options.items() if v is not None})


# -- the plan, without processes ---------------------------------------------------------------

def test_the_plan_puts_the_embeddings_on_servers_and_the_body_on_all_reduce():
    model = WordLM(**MODEL)
    dense, sparse = classify(model)
    assert sparse == ["tok.weight", "out.weight"]
    assert "pos" in dense and any(n.startswith("blocks.") for n in dense)
    assert not set(dense) & set(sparse)
    # An ordinary embedding is sparse by default, dense with --no-sparse-embeddings.
    plain = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    assert classify(plain) == (["1.weight", "1.bias"], ["0.weight"])
    assert classify(plain, sparse_embeddings=False) == (["0.weight", "1.weight", "1.bias"], [])


def test_an_embedding_bag_of_mode_max_or_scaled_by_frequency_stays_dense_or_is_refused():
    # Made sparse, it met torch's "max mode does not support sparse weights" at its first
    # forward.
    model = nn.Sequential(nn.EmbeddingBag(10, 4, mode="max"), nn.EmbeddingBag(10, 4))
    assert classify(model) == (["0.weight"], ["1.weight"])
    with pytest.raises(ConfigError, match=r"0 is built with sparse=True, but parallax cannot "
                                          r"hold its rows on servers: mode='max' has no "
                                          r"sparse gradient"):
        classify(nn.Sequential(nn.EmbeddingBag(10, 4, mode="max", sparse=True)))
    # scale_grad_by_freq met torch's "not supported with sparse gradients" in backward (one
    # worker: more are refused by every strategy).
    model = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Embedding(10, 4))
    assert classify(model) == (["0.weight"], ["1.weight"])
    # An EmbeddingBag, which is no nn.Embedding, was made sparse and met it too.
    model = nn.Sequential(nn.EmbeddingBag(10, 4, scale_grad_by_freq=True), nn.EmbeddingBag(10, 4))
    assert classify(model) == (["0.weight"], ["1.weight"])
    with pytest.raises(ConfigError, match=r"0 is built with sparse=True, but parallax cannot "
                                          r"hold its rows on servers: scale_grad_by_freq has "
                                          r"no sparse gradient"):
        classify(nn.Sequential(nn.EmbeddingBag(10, 4, scale_grad_by_freq=True, sparse=True)))


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2.0


def test_an_embedding_of_a_parametrized_weight_stays_dense_or_is_refused():
    # Made sparse, its parametrization's original got the sparse gradient, which the dense
    # all-reduce refused at the first step with the hint to look it up through its
    # nn.Embedding module, as it was.
    from torch.nn.utils import parametrize
    model = nn.Sequential(nn.Embedding(10, 4), nn.Embedding(10, 4))
    parametrize.register_parametrization(model[0], "weight", _Doubled())
    assert classify(model) == (["0.parametrizations.weight.original"], ["1.weight"])
    built = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    parametrize.register_parametrization(built[0], "weight", _Doubled())
    with pytest.raises(ConfigError, match=r"0 is built with sparse=True, but parallax cannot "
                                          r"hold its rows on servers: its weight is "
                                          r"parametrized .*HINT: build it with sparse=False"):
        classify(built)
    # torch's older weight_norm computes .weight in a forward pre-hook: made sparse, every
    # worker's step failed inside torch ("unsupported memory format option Contiguous").
    normed = nn.Sequential(nn.Embedding(10, 4), nn.Embedding(10, 4))
    torch.nn.utils.weight_norm(normed[0])
    assert sorted(classify(normed)[0]) == ["0.weight_g", "0.weight_v"]
    from polytrain.strategies.parallax.plan import sparse_tables
    assert sparse_tables(normed) == [normed[1]]


def test_row_ranges_are_spread_greedily_by_bytes_over_the_servers():
    variables = [SparseVar("a", 1000, 8, torch.float32), SparseVar("b", 300, 8, torch.float32)]
    plan = plan_parallax(variables, ["w"], partitions=4, servers=[6, 7, 8])
    assert [(r.lo, r.hi) for r in plan.of(0)] == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert sum(r.hi - r.lo for r in plan.of(1)) == 300
    load = plan.bytes_by_server()
    assert sum(load.values()) == 1300 * 32
    # Largest first to the least loaded: a's 4 ranges of 8000 B, then b's of 2400 B.
    assert max(load.values()) - min(load.values()) <= 8000
    assert plan.as_json()["sparse"][0] == {"name": "a", "rows": 1000, "width": 8,
                                           "row_bytes": 32}
    assert "servers: a (1000 x 8), 4 partitions" in plan.describe()
    with pytest.raises(ConfigError, match="--partitions must be at least 1"):
        plan_parallax(variables, [], partitions=0, servers=[6])


def test_search_steps_beside_fixed_partitions_is_refused():
    # --partitions skips the search, and --search-steps was taken and did nothing.
    with pytest.raises(ConfigError, match=r"--search-steps 5 paces the search of the partition "
                                          r"count, and --partitions 2 skips it"):
        ParallaxOptions(partitions=2, search_steps=5)
    ParallaxOptions(partitions=2)
    ParallaxOptions(search_steps=5)


def test_the_search_doubles_while_faster_then_looks_below_and_fits():
    s = PartitionSearch(4, high=32)
    for p, t in [(4, 1.0), (8, 0.7), (16, 0.6), (32, 0.8)]:
        assert s.next_count() == p
        s.record(p, t)
    assert s.next_count() == 2  # then below the start
    s.record(2, 1.6)
    assert s.next_count() is None
    a, b, c = fit_cost(s.samples)
    assert a > 0 and b > 0
    best = s.best()
    assert 8 <= best <= 32 and s.as_json()["chosen"] is None  # replan ends it, not a look
    assert s.choose() == best and s.as_json()["chosen"] == best
    # An exact cost model is recovered.
    exact = [(p, 8.0 / p + 0.05 * (p - 1) + 0.3) for p in (1, 2, 4, 8, 16)]
    assert fit_cost(exact) == pytest.approx((0.05, 8.0, 0.3), rel=1e-6)
    t = PartitionSearch(1)
    t.samples = exact
    assert t.best() == 13  # sqrt(8 / 0.05) = 12.6: 13 costs less than 12


def test_a_search_that_turned_below_its_start_is_not_over_while_that_sample_runs():
    # metrics.json said "chosen": 2 of a run whose plan had 1 partition: P = 4 was slower,
    # the search turned to P = 1, and the run ended during that sample. Cause: as_json asked
    # next_count(), which judged the last sample (P = 4) again and ended the search.
    s = PartitionSearch(2, high=16)
    s.record(2, 1.0)
    assert s.next_count() == 4
    s.record(4, 1.2)
    assert s.next_count() == 1  # slower: below the start, now being sampled
    before = (list(s.samples), s.going_up)
    report = s.as_json()
    assert report["chosen"] is None and [x["partitions"] for x in report["samples"]] == [2, 4]
    assert (s.samples, s.going_up) == before and s.as_json() == report  # a look, no change
    s.record(1, 1.5)
    assert s.next_count() is None and s.as_json()["chosen"] is None
    assert s.choose() == 2 and s.as_json()["chosen"] == 2


def test_the_search_times_a_step_without_what_the_loop_does_after_it(monkeypatch):
    # A checkpoint or a held-out evaluation between two steps (a gather of every table)
    # was timed as the step's: one of a sample's two timed steps, which the search compared.
    from polytrain.strategies.parallax import Parallax
    from polytrain.strategies.parallax import strategy as module
    clock = iter([0.0, 1.0, 10.0, 11.5, 12.0])
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    s = Parallax(None, ParallaxOptions(search_steps=5))
    s.search = PartitionSearch(1, low=1, high=8)
    s.replan(0)      # step 0 begins at 0.0
    s._step_done()   # its optimizer steps at 1.0; a checkpoint until 10.0
    s.replan(1)      # step 1 begins at 10.0
    s._step_done()   # 11.5
    s.replan(2)      # 12.0
    assert s._times == [1.0, 1.5]


def test_a_resumed_sample_leaves_its_first_step_out_of_its_time(monkeypatch):
    # The first step after a resume has no start to be timed from, and was still counted
    # one of the sample's: the sample's time then took in its first step's, from before the
    # checkpoint (a warm-up: the median of 5.0 and 1.0, where its other steps took 1.0).
    # Then the fresh process's first step (a warm-up too) was timed, and the step before the
    # save was not: the median of 5.0 and 1.0 again.
    from types import SimpleNamespace

    from polytrain.strategies.parallax import Parallax
    from polytrain.strategies.parallax import strategy as module
    # Before the save: the sample's first step 5.0, its second 1.0; after the resume the
    # first (the fresh process's warm-up) 5.0, the next 1.0.
    clock = iter([0.0, 5.0, 5.0, 6.0, 100.0, 105.0, 105.0, 106.0, 106.0, 106.0, 106.0])
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(module.dist, "all_reduce", lambda *args, **kwargs: None)
    ctx = SimpleNamespace(num_workers=1, num_nodes=1, worker_index=0,
                          groups=SimpleNamespace(workers=None))
    emb = [SparseVar("emb", 10, 4, torch.float32)]

    def strategy():
        s = Parallax(ctx, ParallaxOptions(search_steps=3))
        s.plan = plan_parallax(emb, [], partitions=2, servers=[1])
        s._count, s.search = 2, PartitionSearch(2, low=2, high=2)  # one sample
        s.rows = SimpleNamespace(vars=[], round=0, pull_states=lambda: [],
                                 restore=lambda *args: None, end_step=lambda: None)
        return s

    before = strategy()
    for step in range(2):  # the sample's first step takes 5.0, its second 1.0; then a save
        before.replan(step)
        before._step_done()
    saved = {**before.checkpoint_state(), "rows": {}}  # (no tables: no servers here)
    after = strategy()
    after.load_checkpoint_state(saved)
    for step in range(2, 5):  # the first is not timed
        after.replan(step)
        after._step_done()
    assert after.final_search.samples == [(2, 1.0)]


def test_a_table_left_out_of_the_optimizer_is_told_to_freeze_it_or_pass_it():
    # SGD(model.lin.parameters()) leaves a table untrained under single and ddp; parallax
    # said "pass every parameter of the model to the optimizer", which would train it.
    emb, lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    with pytest.raises(ConfigError) as e:
        sparse_rule(torch.optim.SGD(lin.parameters(), lr=1), emb.weight, "emb.weight")
    assert str(e.value) == (
        "emb.weight is in no group of the optimizer, which steps a sparse parameter's rows "
        "on the servers. HINT: to leave it untrained, freeze it before distribute() "
        "(requires_grad_(False)); to train it, pass it to the optimizer")
    emb.weight.requires_grad_(False)  # a frozen table is neither sparse nor dense: no rule
    assert classify(nn.Sequential(emb, lin)) == (["1.weight", "1.bias"], [])


def test_adamw_with_weight_decay_on_a_sparse_parameter_is_refused_with_what_to_pass():
    emb = nn.Embedding(10, 4, sparse=True)
    with pytest.raises(ConfigError, match="AdamW with weight decay 0.01 has no sparse form") as e:
        sparse_rule(torch.optim.AdamW(emb.parameters()), emb.weight, "emb.weight")
    assert "weight_decay=0" in e.value.hint and "SparseAdam" in e.value.hint
    with pytest.raises(ConfigError, match="SGD with momentum 0.9"):
        sparse_rule(torch.optim.SGD(emb.parameters(), lr=1, momentum=0.9), emb.weight)
    assert sparse_rule(torch.optim.AdamW(emb.parameters(), weight_decay=0), emb.weight)[
        "name"] == "adam"
    with pytest.raises(ConfigError, match="Adam with amsgrad=True has no sparse form"):
        sparse_rule(torch.optim.Adam(emb.parameters(), amsgrad=True), emb.weight)


def test_wordlms_declared_reads_are_the_rows_its_lookups_read():
    model = WordLM(**MODEL)
    window = torch.randint(0, MODEL["vocab"], (3, MODEL["seq_len"] + 1))
    read = {"tok": [], "out": []}
    for name in read:
        getattr(model, name).register_forward_pre_hook(
            lambda m, args, name=name: read[name].append(args[0].reshape(-1)))
    declared = model.sparse_reads(window)
    model(window)
    assert set(declared) == {"tok.weight", "out.weight"}
    for name, rows in read.items():
        assert torch.equal(torch.unique(declared[f"{name}.weight"]),
                           torch.unique(torch.cat(rows)))


def test_a_lookup_of_a_row_sparse_reads_did_not_name_is_refused():
    var = _Var(0, "tok.weight", nn.Parameter(torch.zeros(10, 2)), {"name": "sgd"})
    var.fresh[:] = False
    var.fresh[[1, 2]] = True
    check_declared(var, torch.tensor([[1, 2], [2, 1]]))
    with pytest.raises(ConfigError, match=r"reads 2 rows the model's sparse_reads did not "
                                          r"name \(e.g. \[3, 7\]\)"):
        check_declared(var, torch.tensor([1, 7, 3, 7]))


# -- the row rules, against torch's sparse optimizers -----------------------------------------

@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_the_row_rules_are_torchs_sparse_optimizers(kind):
    torch.manual_seed(0)
    ref = nn.Embedding(50, 6, sparse=True)
    mine = ref.weight.detach().clone()
    state = [torch.zeros_like(mine) for _ in range(2)]
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.3),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3, lr_decay=0.01),
            "adam": lambda p: torch.optim.SparseAdam(p, lr=0.03)}[kind]
    opt = make(ref.parameters())
    for step in range(1, 5):
        idx = torch.randint(0, 50, (20,))
        opt.zero_grad()
        (ref(idx) ** 2).sum().backward()
        g = ref.weight.grad.coalesce()
        rows, values = g.indices()[0], g.values()
        opt.step()
        if kind == "sgd":
            row_sgd(mine, rows, values, lr=0.3)
        elif kind == "adagrad":
            row_adagrad(mine, state[0], rows, values, lr=0.3, step=step, lr_decay=0.01)
        else:
            row_adam(mine, state[0], state[1], rows, values, lr=0.03, step=step)
    assert torch.allclose(mine, ref.weight.detach(), atol=1e-6)


def test_lazy_adam_trains_dense_and_sparse_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1))
    opt = LazyAdam(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    emb, lin = [(p.detach() - b) for p, b in zip(model.parameters(), before)][:2]
    assert emb[[1, 2]].abs().min() > 0 and emb[0].abs().max() == 0  # lazy: rows 1, 2 only
    assert lin.abs().min() > 0


# -- the sparse row store, without processes ---------------------------------------------------

def store(rule, rows=6, width=2, pushers=2, dtype="torch.float32"):
    out = []
    decl = Declaration(key=0, kind=5, name="emb[0]", numel=rows * width, dtype=dtype,
                       pushers=pushers, pullers=pushers,
                       options={"width": width, "rule": rule})
    return SparseRowStore(decl, lambda req, t: out.append((req.seq, t.clone()))), out


def request(op, src, round_, payload=None, seq=0):
    numel = 0 if payload is None else payload.numel()
    dtype = torch.uint8 if payload is None else payload.dtype
    return Request(src, op, 0, round_, numel, dtype, seq, 0, payload)


def test_the_store_sums_pushes_in_rank_order_applies_the_rule_and_answers_rows():
    s, out = store({"name": "sgd", "lr": 1.0})
    s.handle(request(Op.SET, 0, 0, torch.cat([torch.arange(12.0), torch.tensor([0.0, 0.0])])))
    # A pull of round 1 waits for the round; an empty push (no row touched) must just work.
    s.handle(request(Op.PULL, 1, 1, torch.tensor([4, 0]), seq=7))
    s.handle(request(Op.PUSH, 1, 1, pack_rows(0.5, torch.empty(0, dtype=torch.int64),
                                              torch.empty(0, 2))))
    assert out == []
    s.handle(request(Op.PUSH, 0, 1, pack_rows(0.5, torch.tensor([0, 4]),
                                              torch.tensor([[2.0, 2.0], [4.0, 4.0]]))))
    [(seq, rows)] = out
    assert seq == 7 and torch.equal(rows, torch.tensor([[6.0, 7.0], [-1.0, 0.0]]))
    # Round 2: two pushers touch row 1; round 3 reads the parameter nowhere (no step of its
    # rule). The whole state answers values, rounds applied and the rule's steps.
    for src in (1, 0):
        s.handle(request(Op.PUSH, src, 2, pack_rows(1.0, torch.tensor([1]),
                                                    torch.tensor([[1.0, 1.0]]))))
        s.handle(request(Op.PUSH, src, 3, pack_rows(1.0, torch.empty(0, dtype=torch.int64),
                                                    torch.empty(0, 2))))
    s.handle(request(Op.PULL, 0, 3, seq=8))
    state = out[-1][1]
    assert state.numel() == state_numel(12, "sgd") and unpack_counts(state[-2:]) == [3, 2]
    assert state[2:4].tolist() == [0.0, 1.0]
    with pytest.raises(CommError, match="round 1 is already applied"):
        s.handle(request(Op.PUSH, 0, 1, pack_rows(1.0, torch.tensor([1]), torch.ones(1, 2))))


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_a_16_bit_table_is_refused_as_its_rounds_would_not_survive_a_move(dtype):
    # A whole state carries its rounds applied in one element of the table's dtype: 16 bits
    # count only to 32,767 (as values, bfloat16 stored 257 as 256, so a resumed or
    # repartitioned store waited for a round nobody pushes).
    assert torch.tensor(257.0, dtype=torch.bfloat16).item() == 256
    with pytest.raises(CommError, match=r"a sparse row store holds float32 or float64 values"
                                        r".*HINT: keep 16-bit parameters' master copy in"):
        store({"name": "sgd", "lr": 1.0}, dtype=dtype)


def test_the_stores_whole_state_moves_to_another_store_with_the_rules_state():
    rule = {"name": "adagrad", "lr": 0.1, "eps": 1e-10, "lr_decay": 0.0,
            "initial_accumulator_value": 0.0}
    a, out = store(rule, pushers=1)
    a.handle(request(Op.SET, 0, 0, torch.cat([torch.ones(12), torch.zeros(12),
                                              torch.tensor([0.0, 0.0])])))
    settings = rule_settings(rule)  # every push carries them: a scheduler may move them
    a.handle(request(Op.PUSH, 0, 1, pack_rows(0.1, torch.tensor([2]), torch.ones(1, 2),
                                              settings=settings)))
    a.handle(request(Op.GET, 0, 0))
    b, out_b = store(rule, pushers=1)
    b.handle(request(Op.SET, 0, 0, out[-1][1]))
    for s in (a, b):
        s.handle(request(Op.PUSH, 0, 2, pack_rows(0.1, torch.tensor([2]), torch.ones(1, 2),
                                                  settings=settings)))
        s.handle(request(Op.GET, 0, 0))
    assert torch.equal(out[-1][1], out_b[-1][1]) and unpack_counts(out_b[-1][1][-2:]) == [2, 2]


# -- transparency ------------------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("nodes, workers, servers, optimizer", [
    (1, 2, 0, "sgd"), (2, 4, 0, "adagrad"), (2, 4, 2, "adagrad"),
    *(pytest.param(*c, marks=pytest.mark.long) for c in [
        (1, 2, 0, "adagrad"), (2, 4, 0, "sgd"), (2, 4, 2, "sgd")])])
def test_parallax_ends_where_single_ends(nodes, workers, servers, optimizer):
    c = config(nodes, workers, servers, optimizer)
    _, single = run_config(single_of(c))
    metrics, distributed = run_cached(c)
    assert max_abs_diff(single, distributed) < TOLERANCE[optimizer]
    _, untrained = run_config(single_of(c).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 100 * TOLERANCE[optimizer]
    plan = metrics["plan"]
    assert [v["name"] for v in plan["sparse"]] == ["tok.weight", "out.weight"]
    assert "pos" in plan["dense"] and len(plan["servers"]) == nodes + servers
    assert set(metrics["sparse"]) == {"tok.weight", "out.weight"}
    for v in metrics["sparse"].values():
        assert v["rows"] == MODEL["vocab"] and 0 < v["alpha"] < 0.5


@pytest.mark.timeout(240)
def test_held_out_evaluations_read_the_servers_rows_and_leave_training_as_single_has_it():
    # --eval-every evaluated worker 0's model, whose lookups fetched rows with a collective
    # of its machine's workers, which were training: a hang, or mismatched collectives.
    c = config(2, 4, 0, "adagrad").replace(eval_every=2)
    single_metrics, single = run_config(single_of(c))
    metrics, distributed = run_config(c)
    assert max_abs_diff(single, distributed) < TOLERANCE["adagrad"]
    got, want = metrics["eval"], single_metrics["eval"]
    assert [e["step"] for e in got] == [e["step"] for e in want] == [2, 4]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)


@pytest.mark.timeout(240)
def test_adam_on_gpts_embeddings_is_lazy_as_single_with_sparse_embeddings():
    # Parallax makes gpt's embeddings sparse, and Adam on their rows is lazy (SparseAdam's
    # rule): the single run it equals is the one whose token table is sparse too (LazyAdam).
    # Compared on the tables: elsewhere Adam turns the all-reduce's rounding of gradients
    # near zero into differences of up to lr (0.012 on the attention's qkv here).
    c = TrainConfig(strategy="parallax", model="gpt", workers=2, nodes=2, steps=STEPS,
                    batch_size=8, optimizer="adam", lr=1e-2,
                    model_options={"seq_len": 8, "d_model": 16, "layers": 1, "heads": 2},
                    strategy_options={"partitions": 2})
    _, lazy = run_config(single_of(c).replace(
        model_options={**c.model_options, "sparse_embedding": True}))
    _, dense = run_config(single_of(c))
    _, distributed = run_config(c)
    tables = ("embed.tok.weight", "embed.pos.weight")
    assert max(float((lazy[k] - distributed[k]).abs().max()) for k in tables) < 1e-4
    tok = "embed.tok.weight"
    assert float((dense[tok] - distributed[tok]).abs().max()) > 1e-3


@pytest.mark.timeout(240)
def test_a_lookup_that_reads_no_row_of_a_range_pulls_nothing_from_it():
    # Symptom: at --partitions 32 on wordlm, gloo aborted a worker ("Received data size
    # doesn't match expected size. 800004 vs 0"). Cause: a lookup sent a PULL with no rows
    # for a range it did not read, which the store answers with the range's whole state.
    c = config(1, 2, 0, partitions=64)
    _, single = run_config(single_of(c))
    _, distributed = run_config(c)
    assert max_abs_diff(single, distributed) < TOLERANCE["sgd"]


@pytest.mark.timeout(240)
def test_ordinary_embeddings_become_sparse_rows_and_still_end_where_single_ends():
    # gpt's embeddings are built with sparse=False: --sparse-embeddings (the default) makes
    # their gradients sparse and puts them on the servers; SGD's update is the same.
    c = TrainConfig(strategy="parallax", model="gpt", workers=4, nodes=2, steps=STEPS,
                    batch_size=8, optimizer="sgd", lr=0.5,
                    model_options={"seq_len": 8, "d_model": 16, "layers": 1, "heads": 2},
                    strategy_options={"partitions": 2})
    _, single = run_config(single_of(c))
    metrics, distributed = run_config(c)
    assert [v["name"] for v in metrics["plan"]["sparse"]] == ["embed.tok.weight",
                                                              "embed.pos.weight"]
    assert max_abs_diff(single, distributed) < TOLERANCE["sgd"]


@pytest.mark.timeout(240)
def test_the_partition_search_repartitions_live_rows_without_losing_an_update():
    c = config(2, 4, 0, "adagrad", steps=12, partitions=None, search_steps=2)
    _, single = run_config(single_of(c))
    metrics, distributed = run_config(c)
    search = metrics["partition_search"]
    counts = [s["partitions"] for s in search["samples"]]
    assert counts[:2] == [2, 4] and len(counts) >= 3  # start at the servers, double, ...
    assert search["chosen"] == metrics["plan"]["partitions"]
    assert max_abs_diff(single, distributed) < TOLERANCE["adagrad"]



@pytest.mark.timeout(120)
def test_a_run_that_ends_before_its_partition_search_does_finishes_and_says_so():
    # A run of --search-steps steps or fewer trained every step, then failed in metrics()
    # (min() of no samples) and wrote neither final.pt nor metrics.json; one that ended
    # mid-search reported as chosen a count it never used.
    for steps, samples in ((2, 0), (3, 1)):  # after one sample, the search always goes on
        metrics, _ = run_config(config(1, 2, 0, steps=steps, partitions=None, search_steps=2))
        search = metrics["partition_search"]
        assert len(search["samples"]) == samples and search["chosen"] is None, search
        assert metrics["plan"]["partitions"] in (1, 2, 4)


# -- traffic -----------------------------------------------------------------------------------

TRAFFIC_MODEL = {**MODEL, "vocab": 20000, "d_model": 64, "negatives": 256}


@pytest.mark.timeout(240)
def test_every_machine_moves_parallaxs_bytes_with_the_measured_alpha():
    c = config(2, 4, 0, steps=10, model=TRAFFIC_MODEL, partitions=4).replace(batch_size=32)
    metrics, _ = run_config(c)
    sparse = metrics["sparse"]
    w = sum(v["rows"] * v["row_bytes"] for v in sparse.values())
    alpha = sum(v["alpha"] * v["rows"] * v["row_bytes"] for v in sparse.values()) / w
    dense = metrics["model_bytes"] - w
    want = parallax_traffic(machines=2, sparse_bytes=w, alpha=alpha, dense_bytes=dense)
    # REFERENCE.md, per direction with N = 2: rows 2 alpha W (N-1)/N, ring 2 D (N-1)/N.
    assert want["sparse"] == pytest.approx(2 * alpha * w * 1 / 2)
    assert want["dense"] == pytest.approx(2 * dense * 1 / 2)
    assert 0 < alpha < 0.5  # a step touches a small part of the tables
    machines = [m for m in metrics["traffic"]["machines"] if m["kind"] == "worker"]
    assert len(machines) == 2
    for direction in ("sent_bytes_per_step", "recv_bytes_per_step"):
        total = sum(m[direction] for m in machines) / len(machines)
        assert total - want["dense"] == pytest.approx(want["sparse"], rel=0.05)
        assert total == pytest.approx(want["total"], rel=0.05)


@pytest.mark.timeout(120)
def test_the_step_that_re_partitions_is_left_out_of_the_steady_traffic_and_step_times():
    # The search's step that changes the partition count re-partitions the tables inside
    # the step (worker 0 pulls every range's state and sets it again), and the steady
    # averages took it in: 6 steps, P 3 -> 6 at step 3 (1,174,042 bytes against ~78,000),
    # traffic.machines 3.8x a step's, the step times' p90 raised.
    c = TrainConfig(strategy="parallax", model="wordlm", workers=4, nodes=2, servers=1,
                    steps=6, batch_size=16, model_options={"vocab": 2000, "d_model": 16,
                                                           "negatives": 64, "seq_len": 8})
    metrics, _ = run_config(c)
    assert metrics["plan"]["partitions"] != 3  # the search moved from its start, 3
    by_step = metrics["traffic"]["sent_bytes_by_step"]
    moved = max(range(len(by_step)), key=by_step.__getitem__)
    assert moved > 0 and by_step[moved] > 5 * by_step[-1]  # recorded where it happened
    steady = [b for i, b in enumerate(by_step) if i not in (0, moved)]
    total = sum(m["sent_bytes_per_step"] for m in metrics["traffic"]["machines"])
    assert total == pytest.approx(sum(steady) / len(steady))  # was 3.8x it
    assert metrics["step_time_s"]["p90"] <= max(t for i, t in enumerate(metrics["step_times"])
                                                if i not in (0, moved))


# -- a dense parameter no worker used ----------------------------------------------------------

class _Branchy(nn.Module):
    """An embedding (sparse rows, on the servers) and two dense branches; b is used once."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(4, 6)
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = self.tok(ids).mean(1)
        return self.a(x) + self.b(x) if use_b else self.a(x)


def branchy_script(distributed: bool) -> dict:
    """AdamW (weight decay on the dense branches only) on a model whose branch b only the
    first step uses; the global batch of 4 is sharded over the workers."""
    import polytrain
    ctx = polytrain.init() if distributed else None
    torch.manual_seed(0)
    model: nn.Module = _Branchy()
    opt = torch.optim.AdamW([{"params": model.tok.parameters(), "weight_decay": 0.0},
                             {"params": [*model.a.parameters(), *model.b.parameters()]}],
                            lr=1e-2, weight_decay=0.1)
    if ctx is not None:
        model, opt = polytrain.distribute(model, opt, strategy="parallax")
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        # Every sample reads every row: lazy Adam on the servers is then Adam.
        ids = torch.stack([torch.randperm(4, generator=gen) for _ in range(4)])
        y = torch.randn(4, 3, generator=gen)
        if ctx is not None:
            ids = polytrain.shard(ids, ctx.worker_index, ctx.num_workers)
            y = polytrain.shard(y, ctx.worker_index, ctx.num_workers)
        opt.zero_grad()
        nn.functional.mse_loss(model(ids, step == 0), y).backward()
        opt.step()
    # The dense branches (the table's rows live on the servers).
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if not k.startswith("tok")}


@pytest.mark.timeout(120)
def test_a_dense_parameter_no_worker_used_keeps_no_gradient_as_in_one_process():
    # It was all-reduced as zeros: AdamW decayed it and went on moving it with its momentum,
    # where one process leaves a parameter without a gradient alone.
    from tests.harness import spawn
    alone = branchy_script(False)
    workers = spawn(branchy_script, workers=2, colocated=1, args=(True,))
    assert max_abs_diff(alone, workers[0]) < 1e-6


class _TwoTables(nn.Module):
    """Two sparse tables; the second is looked up only at some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.side = nn.Embedding(4, 6), nn.Embedding(4, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, use_side: bool) -> torch.Tensor:
        x = self.tok(ids).mean(1)
        return self.out(x + self.side(ids).mean(1) if use_side else x)


def two_tables_script(distributed: bool) -> dict:
    """Adam; table ``side`` is read at steps 1 and 3 only, by every sample."""
    import polytrain
    ctx = polytrain.init() if distributed else None
    torch.manual_seed(0)
    model: nn.Module = _TwoTables()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if ctx is not None:
        model, opt = polytrain.distribute(model, opt, strategy="parallax")
    gen = torch.Generator().manual_seed(1)
    every = torch.arange(4).repeat(4, 1)  # every sample reads every row: lazy Adam is Adam
    for step in range(4):
        y = torch.randn(4, 3, generator=gen)
        ids = every
        if ctx is not None:
            ids = polytrain.shard(ids, ctx.worker_index, ctx.num_workers)
            y = polytrain.shard(y, ctx.worker_index, ctx.num_workers)
        opt.zero_grad()
        nn.functional.mse_loss(model(ids, step in (1, 3)), y).backward()
        opt.step()
    with torch.no_grad():  # reads every row of both tables: the servers' current rows
        model(every, True)
    inner = unwrap(model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


@pytest.mark.timeout(120)
def test_a_table_a_step_does_not_read_keeps_its_adam_step_count_as_in_one_process():
    # The servers counted every round as a step of every table: the side table's first
    # update was bias-corrected as Adam's second step (0.75 of one process's).
    from tests.harness import spawn
    alone = two_tables_script(False)
    workers = spawn(two_tables_script, workers=2, colocated=1, args=(True,))
    # Summation order only (it was 4e-3 off).
    assert max_abs_diff(alone, workers[0]) < 2e-5


class _TiedByUse(nn.Module):
    """An embedding whose weight the output layer reads directly: ``h @ tok.weight.t()``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(self.tok(ids)) @ self.tok.weight.t()


def tied_by_use_script() -> None:
    import polytrain
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = _TiedByUse()
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="parallax", loss_fn=nn.functional.cross_entropy)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        ids = torch.randint(0, 4, (4,), generator=gen)  # looks up rows 0-3 only
        trainer.step(ids, torch.randint(0, 16, (4,), generator=gen))


@pytest.mark.timeout(120)
def test_an_embedding_read_outside_its_lookups_is_refused():
    # Its rows were fetched only where looked up, so the output layer read the others
    # stale, and the run differed from single's, silently.
    from polytrain import LaunchError
    from tests.harness import spawn
    with pytest.raises(LaunchError, match=r"ConfigError: tok.weight is read outside its "
                                          r"embedding lookups: its gradient has \d+ rows no "
                                          r"lookup of this step read.*HINT: "):
        spawn(tied_by_use_script, workers=2, nodes=2, colocated=1)


def test_the_rows_touched_per_step_are_kept_as_counts_and_old_lists_load():
    # Every step appended a number to a list, kept in memory and in every checkpoint.
    from polytrain.strategies.parallax.rows import Touched
    touched = Touched()
    assert touched.mean() == 0.0
    touched.add(50)  # the first step: left out of the mean once there are others
    assert touched.mean() == 50.0
    for rows in range(1000):
        touched.add(rows)
    assert touched.mean() == pytest.approx(sum(range(1000)) / 1000)
    assert touched.state() == {"first": 50, "total": sum(range(1000)), "steps": 1000}
    assert Touched.from_state(touched.state()).mean() == touched.mean()
    old = Touched.from_state([50, 10, 20, 30])  # an older checkpoint's list
    assert (old.first, old.total, old.steps) == (50, 60, 3) and old.mean() == 20.0
    assert Touched.from_state([]).mean() == 0.0


def out_of_range_script() -> None:
    import polytrain
    polytrain.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(8, 3))
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="parallax", loss_fn=nn.functional.cross_entropy)
    trainer.step(torch.tensor([[1, 2], [3, 16]]), torch.tensor([0, 1]))  # row 16 of 0..15


@pytest.mark.timeout(120)
def test_a_resume_with_other_sparse_embeddings_is_refused_before_any_process_starts():
    # The tables' optimizer state lives only on the servers: without them Adam's moments
    # restarted silently; the other way a worker raised advice that did not apply.
    from polytrain.strategies.parallax import Parallax, ParallaxOptions
    layout = TrainConfig(strategy="parallax", workers=2).layout()
    saved = {"workers": 2, "strategy_options": {"sparse_embeddings": True}}
    with pytest.raises(ConfigError, match=r"strategy 'parallax' resumes the servers' rows and "
                                          r"their optimizer state only with the options that "
                                          r"made them \(--sparse-embeddings True there, False "
                                          r"here\)"):
        Parallax.check_resume(saved, layout, ParallaxOptions(sparse_embeddings=False))
    Parallax.check_resume(saved, layout, ParallaxOptions(partitions=4))  # others may change


def test_a_lookup_past_the_table_is_refused_naming_the_row():
    # An IndexError inside a forward hook (a negative id read another variable's rows).
    from polytrain import LaunchError
    from tests.harness import spawn
    with pytest.raises(LaunchError, match=r"ConfigError: a lookup of 0.weight reads row 16, and "
                                          r"it has rows 0\.\.15.*HINT: pass token ids below"):
        spawn(out_of_range_script, workers=1, colocated=1)


def closed_then_local_script() -> tuple[bool, bool, bool]:
    """An embedding of dense gradients and torch's Adam (which takes no sparse ones) through
    parallax, then the model the user's again after close(): a local step. Before it, a
    distribute() refused (AdamW's weight decay on the table) leaves the table as it was;
    and a parameter frozen at distribute() and unfrozen later is refused at the step."""
    import polytrain
    polytrain.init()
    torch.manual_seed(0)
    refused = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
    adamw = torch.optim.AdamW(refused.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"AdamW with weight decay 0.01 has no sparse form"):
        polytrain.distribute(refused, adamw, strategy="parallax", partitions=1)
    untouched = not refused[0].sparse
    refused(torch.tensor([[1, 2, 3]])).sum().backward()
    adamw.step()  # "Adam does not support sparse gradients" while the refusal left it sparse
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
    model[2].bias.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = polytrain.distribute(model, opt, strategy="parallax", partitions=1)
    ids = torch.tensor([[1, 2, 3]])
    for closed in (False, True):
        opt.zero_grad()
        model(ids).sum().backward()
        opt.step()  # the second: "Adam does not support sparse gradients" (the diff's review)
        if not closed:
            wrapped = model[0].sparse
            model[2].bias.requires_grad_(True)  # neither all-reduced nor on the servers
            opt.zero_grad()
            model(ids).sum().backward()
            with pytest.raises(ConfigError, match=r"parameter '2.bias' requires a gradient, "
                                                  r"but did not when the model was wrapped.*"
                                                  r"HINT: set requires_grad before "
                                                  r"distribute\(\)"):
                opt.step()
            model[2].bias.requires_grad_(False)
            polytrain.strategy_of(model).close()
    return untouched, wrapped, model[0].sparse


def test_close_gives_the_tables_their_own_gradients_back():
    # And a distribute() that parallax refused left the table's gradients sparse (set before
    # the optimizer's rule was checked): torch's AdamW then failed the plain step ("Adam does
    # not support sparse gradients"). A parameter frozen at distribute() and unfrozen later
    # was stepped on each worker's own gradient, never averaged (copies 0.21 apart).
    from tests.harness import spawn
    assert spawn(closed_then_local_script, workers=1, colocated=1) == [(True, True, False)]


@pytest.mark.timeout(240)
def test_held_out_evaluations_and_checkpoints_leave_the_steps_traffic_alone(tmp_path):
    # Each evaluation and checkpoint gathers the sparse tables from the servers; their
    # bytes went into the next step's window: --eval-every 2 made every other step of
    # sent_bytes_by_step 5x the plain run's (213,492 bytes against 41,320).
    c = config(2, 2, 1, steps=8).replace(eval_every=8)  # held-out data; one evaluation,
    plain, _ = run_config(c)                             # after the last step's window
    busy, _ = run_config(c.replace(eval_every=2, checkpoint_every=3, out=str(tmp_path)))
    assert len(busy["eval"]) == 4 and busy["final_eval_loss"] is not None
    # (The step after a gather may move less: worker 0's rows are current then.)
    steps = zip(busy["traffic"]["sent_bytes_by_step"], plain["traffic"]["sent_bytes_by_step"])
    assert all(b <= p for b, p in steps), (busy["traffic"], plain["traffic"])  # was 5x at 2
    for b, p in zip(busy["traffic"]["machines"], plain["traffic"]["machines"]):
        assert b["sent_bytes_per_step"] <= p["sent_bytes_per_step"]


def test_a_gradient_with_rows_no_lookup_fetched_is_refused_sparse_or_dense():
    # F.embedding(ids, weight, sparse=True) read rows the step never fetched (stale) and
    # pushed their gradient, silently (0.065 off single): only a dense gradient was checked.
    from polytrain.strategies.parallax.rows import check_gradient
    var = _Var(0, "tok.weight", nn.Parameter(torch.zeros(10, 2)), {"name": "sgd"})
    var.fresh[:] = False
    var.fresh[[1, 2]] = True
    fetched = torch.sparse_coo_tensor(torch.tensor([[1, 2, 1]]), torch.ones(3, 2), (10, 2))
    check_gradient(var, fetched)
    dense = torch.zeros(10, 2)
    dense[2] = 1.0
    check_gradient(var, dense)
    stale = torch.sparse_coo_tensor(torch.tensor([[1, 7, 3, 7]]), torch.ones(4, 2), (10, 2))
    for grad in (stale, stale.to_dense()):
        with pytest.raises(ConfigError, match=r"tok.weight is read outside its embedding "
                                              r"lookups: its gradient has 2 rows no lookup of "
                                              r"this step read \(e.g. \[3, 7\]\)"):
            check_gradient(var, grad)


def test_a_declared_lookup_past_the_table_is_refused_naming_the_row():
    # sparse_reads that clamped the ids let the lookup of row 9 of 8 reach var.fresh[rows]:
    # an IndexError from inside the forward hook.
    var = _Var(0, "tok.weight", nn.Parameter(torch.zeros(8, 2)), {"name": "sgd"})
    with pytest.raises(ConfigError, match=r"a lookup of tok.weight reads row 9, and it has "
                                          r"rows 0\.\.7.*HINT: pass token ids below"):
        check_declared(var, torch.tensor([1, 2, 9]))


# -- options and models the servers leave idle, without processes ----------------------------

def test_options_that_a_model_without_sparse_parameters_leaves_idle_are_refused():
    # A model with no embedding is pure all-reduce: --partitions, --search-steps and
    # --no-colocate were taken and did nothing, silently.
    from polytrain.launch.layout import Layout
    from polytrain.strategies.parallax import Parallax
    layout = Layout(workers=2, colocated=1)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    for options, said in [({"partitions": 8}, r"partitions=8 cuts the sparse parameters"),
                          ({"search_steps": 5}, r"search_steps=5 paces the search"),
                          ({"colocate": False}, r"colocate=False picks the sparse parameters' "
                                                r"servers")]:
        with pytest.raises(ConfigError, match=rf"parallax option {said}.*, and this model has "
                                              rf"no sparse parameter.*HINT: leave out"):
            Parallax.check_model(mlp, layout, ParallaxOptions(**options))
    Parallax.check_model(mlp, layout, ParallaxOptions())  # the CLI's defaults
    # --servers 1 was taken too, and its machine sat idle through the run.
    for servers, said in [(1, "1 dedicated server (--servers 1)"),
                          (2, "2 dedicated servers (--servers 2)")]:
        with pytest.raises(ConfigError, match=rf"parallax's {re.escape(said)} would hold the "
                                              rf"sparse parameters' rows, and this model has "
                                              rf"no sparse parameter.*every parameter is "
                                              rf"all-reduced\. HINT: leave out --servers"):
            Parallax.check_run_model(mlp, Layout(workers=2, nodes=2, servers=servers),
                                     ParallaxOptions())
        # distribute() takes them: a script's own bps.push_pull may use them.
        Parallax.check_model(mlp, Layout(workers=2, nodes=2, servers=servers),
                             ParallaxOptions())
    # Embeddings kept on the workers (--no-sparse-embeddings on gpt) are no sparse parameter.
    table = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"partitions=2 cuts the sparse parameters"):
        Parallax.check_model(table, layout, ParallaxOptions(partitions=2,
                                                            sparse_embeddings=False))
    Parallax.check_model(table, layout, ParallaxOptions(partitions=2))


def test_a_model_without_sparse_parameters_is_evaluated_as_it_is():
    # --eval-every did nothing under parallax on a model without sparse parameters
    # (--no-sparse-embeddings on mlp): no model to evaluate was given without the tables'
    # rows, and metrics.json had no evaluation and a null final_eval_loss.
    from polytrain.strategies.parallax import Parallax
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    assert Parallax(None, ParallaxOptions()).evaluation_model(mlp) is mlp


def test_search_steps_in_the_plain_loop_which_does_not_search_is_refused():
    # distribute(..., search_steps=5) without loss_fn: the plain loop never calls replan(), so
    # the search never ran and the option did nothing, silently.
    from polytrain.strategies.parallax import Parallax
    s = Parallax(None, ParallaxOptions(search_steps=5))
    s.search, s._count = PartitionSearch(2), 2
    with pytest.raises(ConfigError, match=r"parallax option search_steps=5 paces the partition "
                                          r"search, which only the step API runs.*partitions "
                                          r"stays at 2.*HINT: leave out search_steps, or pass "
                                          r"loss_fn"):
        s._before_step(None)


def test_an_embedding_with_max_norm_on_two_workers_gets_parallaxs_own_refusal():
    # The generic refusal's hint ("clip the rows' norms after the optimizer step") told
    # parallax's users to write to a table whose rows the servers overwrite.
    from polytrain.launch.layout import Layout
    from polytrain.strategies.parallax import Parallax
    model = nn.Sequential(nn.Embedding(20, 4, max_norm=1.0), nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"0 renormalizes the rows it reads in place during "
                                          r"the forward \(max_norm=1\): each worker would "
                                          r"change only its own batch's rows.*servers.*HINT: "
                                          r"leave max_norm out; to cap the rows' norms, keep "
                                          r"the table on the workers") as e:
        Parallax.check_model(model, Layout(workers=2, colocated=1), ParallaxOptions())
    assert "clip" not in e.value.hint
    # Kept on the workers (all-reduced), a renorm after each step is the same everywhere.
    Parallax.check_model(model, Layout(workers=2, colocated=1),
                         ParallaxOptions(sparse_embeddings=False))


def test_a_parameter_with_a_sparse_gradient_that_no_embedding_holds_is_refused_naming_it():
    # F.embedding(ids, self.table, sparse=True) on a plain nn.Parameter: its sparse gradient
    # reached the dense all-reduce, and torch failed inside optimizer.step() ("reshape is
    # not implemented for sparse tensors").
    from types import SimpleNamespace

    from polytrain.strategies.parallax.dense import DenseSync
    table, lin = nn.Parameter(torch.randn(12, 4)), nn.Linear(4, 1)
    ctx = SimpleNamespace(topology=SimpleNamespace(leaders=(0,)))
    sync = DenseSync(ctx, [("table", table), ("lin.weight", lin.weight)])
    lin(nn.functional.embedding(torch.tensor([[1, 2]]), table, sparse=True)).sum().backward()
    with pytest.raises(ConfigError, match=r"parameter 'table' has a sparse gradient.*not one "
                                          r"of the sparse tables parallax holds.*HINT: look "
                                          r"its rows up through its nn.Embedding module"):
        sync.start()


def test_the_servers_refusal_names_colocate_false_where_colocated_servers_exist():
    # Launched with --colocated 1 and distribute(..., colocate=False): the refusal said the
    # run had no servers and told the user to launch with --colocated 1, as they had.
    from polytrain.comm.topology import Topology
    from polytrain.ps.placement import server_ranks
    colocated = Topology.from_roles([("worker", "a"), ("worker", "a"), ("server", "a")])
    with pytest.raises(ConfigError, match=r"parallax needs summation servers, and "
                                          r"colocate=False leaves out the run's colocated ones "
                                          r"\(rank 2\), with no dedicated one.*HINT: leave out "
                                          r"colocate=False"):
        server_ranks(colocated, colocate=False, strategy="parallax")
    assert server_ranks(colocated, colocate=True) == ([2], [])
    alone = Topology.from_roles([("worker", "a"), ("worker", "a")])
    with pytest.raises(ConfigError, match=r"needs summation servers, but this run has none"):
        server_ranks(alone, colocate=True, strategy="parallax")


def test_a_resume_on_another_layout_of_as_many_workers_starts_the_search_afresh():
    # 4 workers on 2 machines resumed as 4 on 1 kept the old layout's samples, step times
    # and touched rows: only the worker count was compared.
    from types import SimpleNamespace

    from polytrain.strategies.parallax import Parallax

    def strategy(nodes, servers):
        s = Parallax(SimpleNamespace(num_workers=4, num_nodes=nodes, worker_index=0),
                     ParallaxOptions(search_steps=2))
        s.plan = plan_parallax([SparseVar("emb", 10, 4, torch.float32)], [], partitions=2,
                               servers=servers)
        s._count, s.search = 2, PartitionSearch(2)
        return s

    before = strategy(2, [4, 5])
    before.search.record(2, 0.5)
    before._since, before._times = 2, [0.5, 0.4]
    saved = before.checkpoint_state()
    for nodes, servers in [(1, [4]), (2, [4, 5, 6])]:  # one machine; another --servers
        after = strategy(nodes, servers)
        after.load_checkpoint_state(saved)
        assert after.search.samples == [] and after._times == [] and after._since == 0
    same = strategy(2, [4, 5])
    same.load_checkpoint_state(saved)
    assert same.search.samples == [(2, 0.5)] and same._times == [0.5, 0.4]


def test_a_fixed_partition_count_resumed_without_partitions_starts_the_search_at_its_start():
    # A --partitions 4 run resumed without --partitions took its count, 4, as the new
    # search's first sample (then 8, then 1): the docs' start, max(servers, machines) = 2,
    # was never sampled.
    from types import SimpleNamespace

    from polytrain.strategies.parallax import Parallax

    ctx = SimpleNamespace(num_workers=4, num_nodes=2, worker_index=0)
    emb = [SparseVar("emb", 10, 4, torch.float32)]
    fixed = Parallax(ctx, ParallaxOptions(partitions=4))
    fixed.plan = plan_parallax(emb, [], partitions=4, servers=[4, 5])
    fixed._count, fixed._since, fixed._times = 4, 3, [9.0, 9.0, 9.0]  # an earlier search's
    saved = {**fixed.checkpoint_state(), "rows": {}, "rounds": 0}  # rows: no servers here
    assert "search" not in saved and saved["partitions"] == 4
    cuts = []
    rows = SimpleNamespace(vars=[], repartition=lambda plan: cuts.append(plan.partitions),
                           restore=lambda *args: None)
    searching = Parallax(ctx, ParallaxOptions(search_steps=2))
    searching.plan = plan_parallax(emb, [], partitions=2, servers=[4, 5])
    searching._count, searching.search, searching.rows = 2, PartitionSearch(2), rows
    searching.load_checkpoint_state(saved)
    assert searching._count == 2 and cuts == [] and searching.search.samples == []
    assert searching._since == 0 and searching._times == []  # its own steps' times only


def test_sparse_reads_that_give_no_integer_tensor_are_refused_naming_the_table():
    # A list met AttributeError ("'list' object has no attribute 'detach'"), a float tensor
    # an IndexError, both from inside the forward hook.
    from types import SimpleNamespace

    from polytrain.strategies.parallax.rows import SparseRows
    var = _Var(0, "emb.weight", nn.Parameter(torch.zeros(12, 4)), {"name": "sgd"})
    rows = SimpleNamespace(vars=[var], paused=False)
    rows.fetch = lambda reads, exchange=0: SparseRows.fetch(rows, reads, exchange)
    for value, kind in [([1, 2], "a list"), (torch.tensor([1.0, 2.0]), "a torch.float32 tensor")]:
        hook = SparseRows._reads_hook(rows, lambda ids, value=value: {"emb.weight": value})
        with pytest.raises(ConfigError, match=rf"the model's sparse_reads gives emb.weight "
                                              rf"{kind}, not a tensor of row ids.*HINT: return "
                                              rf"an integer tensor"):
            hook(nn.Module(), (torch.tensor([[1, 2]]),), {})
    # One that returned nothing met "TypeError: 'NoneType' object is not iterable"; one
    # that takes fewer inputs than the forward was given them all (a TypeError).
    hook = SparseRows._reads_hook(rows, lambda ids: None)
    with pytest.raises(ConfigError, match=r"the model's sparse_reads returned a NoneType, not "
                                          r"a dict of each sparse parameter's rows by name.*"
                                          r"HINT: return \{'emb.weight': ids\}"):
        hook(nn.Module(), (torch.tensor([[1, 2]]),), {})
    fetched = []
    rows.fetch = lambda reads, training: fetched.append(reads)
    ids = torch.tensor([[1, 2]])
    hook = SparseRows._reads_hook(rows, lambda ids: {"emb.weight": ids})
    hook(nn.Module(), (ids, torch.ones(1, 2)), {})  # forward(ids, mask)
    assert fetched == [{var: ids}] and var.declared
