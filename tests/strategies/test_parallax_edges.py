"""Parallax at its edges: 16-bit gradients, max_norm, tied tables, gradients changed before the
step, optimizer settings a scheduler moves."""

import re

import pytest
import torch
from torch import nn

from polytrain import CommError, ConfigError, LaunchError
from polytrain.optim import LazyAdam
from polytrain.strategies.parallax import classify
from tests.harness import max_abs_diff, spawn

# -- 16-bit dense gradients --------------------------------------------------------------------


class _Half(nn.Module):
    """One float16 parameter whose gradient is 40,000 on every slice of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum(1).mean()


def _weights(model, ctx) -> dict:
    """The whole model's weights: gathered from the servers in a run, a copy alone."""
    import polytrain
    return polytrain.full_state_dict(model) if ctx is not None else {
        k: v.detach().clone() for k, v in model.state_dict().items()}


def half_script(distributed: bool) -> torch.Tensor:
    import polytrain
    ctx = polytrain.init() if distributed else None
    model: nn.Module = _Half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    if ctx is not None:
        model, opt = polytrain.distribute(model, opt, strategy="parallax")
    x = torch.full((4, 4), 40000.0, dtype=torch.float16)
    if ctx is not None:
        x = polytrain.shard(x, ctx.worker_index, ctx.num_workers)
    opt.zero_grad()
    model(x).backward()
    opt.step()
    return model.w.detach().clone()


@pytest.mark.timeout(120)
def test_16_bit_dense_gradients_are_divided_before_they_are_summed():
    # Two workers' float16 gradients of 40,000 were summed (80,000: inf in float16) and only
    # then divided: the weights became -inf, where single moves them to -0.4.
    # (No servers: a model without sparse parameters is pure all-reduce. It was refused:
    # "parallax needs summation servers, but this run has none".)
    alone = half_script(False)
    workers = spawn(half_script, workers=2, args=(True,))
    assert alone.tolist() == pytest.approx([-0.4] * 4, abs=1e-3)
    for w in workers:
        assert torch.equal(w, alone), (w, alone)


def test_a_16_bit_table_is_refused_before_any_process_starts_in_one_line():
    # nn.Embedding(...).to(torch.bfloat16) reached the server, which refused its key with its
    # prefix said twice and two HINTs, the second to fix "the declaration's options": no
    # check before the servers knew that their row stores hold float32 or float64 only.
    for dtype in (torch.bfloat16, torch.float16):
        model = nn.Sequential(nn.Embedding(10, 4).to(dtype), nn.Linear(4, 1))
        with pytest.raises(ConfigError) as e:
            classify(model)
        assert str(e.value) == (
            f"sparse parameter 0.weight is {dtype}: parallax's servers hold the rows of a "
            f"sparse parameter in float32 or float64. HINT: keep the table in float32, or "
            f"keep it on the workers (sparse_embeddings=False, --no-sparse-embeddings, and "
            f"sparse=False)")
        assert classify(model, sparse_embeddings=False) == (["0.weight", "1.weight", "1.bias"],
                                                            [])
    for dtype in (torch.float32, torch.float64):
        assert classify(nn.Sequential(nn.Embedding(10, 4).to(dtype))) == ([], ["0.weight"])


# -- max_norm ----------------------------------------------------------------------------------

def max_norm_script() -> None:
    import polytrain
    polytrain.init()
    model = nn.Sequential(nn.Embedding(20, 4, max_norm=1.0), nn.Linear(4, 1))
    polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.5),
                         strategy="parallax", partitions=1)


@pytest.mark.timeout(120)
def test_an_embedding_with_max_norm_is_refused_even_with_one_worker():
    # With one worker nothing refused it, and its forward's in-place renormalisation of the
    # rows it read was overwritten by the servers' rows at the next fetch: 2.52 off single.
    with pytest.raises(LaunchError, match=r"ConfigError: 0 renormalizes the rows it reads in "
                                          r"place during the forward \(max_norm=1\): .*parallax "
                                          r"holds on servers.*with one worker too.*HINT: leave "
                                          r"max_norm out"):
        spawn(max_norm_script, workers=1, colocated=1)


def test_max_norm_is_refused_only_where_the_rows_go_to_servers():
    model = nn.Sequential(nn.Embedding(20, 4, max_norm=1.0), nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"0 renormalizes the rows .* \(max_norm=1\)"):
        classify(model)
    # Kept on the workers, it is an ordinary dense parameter (one worker: as single).
    assert classify(model, sparse_embeddings=False) == (["0.weight", "1.weight", "1.bias"], [])


# -- tied tables -------------------------------------------------------------------------------

class _TiedTables(nn.Module):
    """An encoder's and a decoder's table sharing one weight: both uses are lookups."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Embedding(8, 4), nn.Embedding(8, 4)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(4, 2)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(src).mean(1) * self.dec(tgt).mean(1))


def tied_tables_script(distributed: bool, optimizer: str) -> dict:
    import polytrain
    ctx = polytrain.init() if distributed else None
    torch.manual_seed(0)
    model: nn.Module = _TiedTables()
    opt = (torch.optim.SGD(model.parameters(), lr=0.5) if optimizer == "sgd"
           else torch.optim.Adagrad(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        if ctx is not None and step == 1:  # after a step of the script's own (Adagrad's sums)
            model, opt = polytrain.distribute(model, opt, strategy="parallax", partitions=2)
        # Rows 0-3 for the source, 2-7 for the target: some rows are read by both.
        src, tgt = torch.randint(0, 4, (4, 3), generator=gen), torch.randint(2, 8, (4, 3),
                                                                             generator=gen)
        y = torch.randn(4, 2, generator=gen)
        if ctx is not None and step >= 1:
            src, tgt, y = (polytrain.shard(t, ctx.worker_index, ctx.num_workers)
                           for t in (src, tgt, y))
        opt.zero_grad()
        nn.functional.mse_loss(model(src, tgt), y).backward()
        opt.step()
    return _weights(model, ctx)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_two_embeddings_sharing_a_weight_are_served_as_single_trains_them(optimizer):
    # They were refused as "its gradient is partly dense": both uses are lookups.
    # And the servers started the rows' Adagrad sums afresh, dropping those of the script's
    # step before distribute() (0.13 off one process).
    model = _TiedTables()
    assert classify(model) == (["out.weight", "out.bias"], ["enc.weight"])
    alone = tied_tables_script(False, optimizer)
    workers = spawn(tied_tables_script, workers=2, nodes=2, colocated=1,
                    args=(True, optimizer))
    untrained = {k: v.detach() for k, v in _seeded_tied().state_dict().items()}
    assert max_abs_diff(alone, untrained) > 1e-2  # the weights moved
    assert max_abs_diff(alone, workers[0]) < 1e-6


def stalled_leader_script() -> None:
    """Two machines' leaders; at the second step worker 1 sleeps instead of joining the
    dense gradients' all-reduce."""
    import time

    import polytrain
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = _TiedTables()
    model, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      strategy="parallax")
    for step in range(2):
        if step == 1 and ctx.worker_index == 1:
            time.sleep(60)
        opt.zero_grad()
        src = torch.randint(0, 4, (2, 3))
        nn.functional.mse_loss(model(src, src + 2), torch.zeros(2, 2)).backward()
        opt.step()


@pytest.mark.timeout(90)
def test_a_leader_that_never_joins_the_dense_all_reduce_is_named_not_the_one_waiting():
    # "worker rank 0 (machine node0) failed: CommError: ... the dense gradients' all-reduce
    # among the machines' leaders [0, 1] failed: Operation timed out!": the leader that
    # waited. Cause: its timeout became a plain CommError, which the launcher takes for the
    # cause; as a CommTimeout, it looks for the process that stalled.
    import polytrain
    with pytest.raises(LaunchError) as info:
        polytrain.launch(stalled_leader_script, workers=2, nodes=2, colocated=1, timeout_s=6,
                         env={"OMP_NUM_THREADS": "1"})
    assert info.value.rank == 1, str(info.value)
    assert re.search(r"worker rank 1 \(machine node1\) failed: stopped making progress",
                     str(info.value)), str(info.value)


def _seeded_tied() -> nn.Module:
    torch.manual_seed(0)
    return _TiedTables()


def test_an_embedding_tied_to_a_linear_layer_is_refused_naming_it():
    model = nn.ModuleDict({"tok": nn.Embedding(8, 4), "head": nn.Linear(4, 8)})
    model["head"].weight = model["tok"].weight
    with pytest.raises(ConfigError, match=r"tok.weight is an embedding's weight that head "
                                          r"\(Linear\) also uses \(tied weights\): its "
                                          r"gradient there is dense"):
        classify(model)


# -- gradients changed between backward() and step() -------------------------------------------

class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def clipped_script() -> None:
    import polytrain
    ctx = polytrain.init()
    torch.manual_seed(0)
    model: nn.Module = _Mlp()
    model, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                      strategy="parallax")
    gen = torch.Generator().manual_seed(ctx.worker_index)
    # Two backward passes before a step accumulate, as in one process: not a change.
    opt.zero_grad()
    model(torch.randn(4, 4, generator=gen)).backward()
    model(torch.randn(4, 4, generator=gen)).backward()
    opt.step()
    # A closure's backward would run after the step's averaging: refused before any
    # collective, on every worker alike, so the run goes on.
    x = torch.randn(4, 4, generator=gen)
    with pytest.raises(ConfigError, match=r"optimizer.step\(closure\) under parallax"):
        opt.step(lambda: model(x).backward())
    opt.zero_grad()
    model(torch.randn(4, 4, generator=gen)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    opt.step()


@pytest.mark.timeout(120)
def test_a_gradient_changed_between_backward_and_the_step_or_a_closure_is_refused():
    # parallax averages the gradients in optimizer.step(): clip_grad_norm_ before it clipped
    # each worker's own gradient by its own norm, and the run ended 0.031 off single, silently.
    with pytest.raises(LaunchError, match=r"ConfigError: the gradient of 'a.weight' was "
                                          r"changed in place between backward\(\) and "
                                          r"optimizer.step\(\).*HINT: "):
        spawn(clipped_script, workers=2, colocated=1)


# -- optimizer settings a scheduler moves ------------------------------------------------------

class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(x)).pow(2).mean()


def one_cycle_script(distributed: bool) -> dict:
    """LazyAdam under OneCycleLR, which cycles beta1 as well as the learning rate."""
    import polytrain
    ctx = polytrain.init() if distributed else None
    torch.manual_seed(0)
    model: nn.Module = _Table()
    opt = LazyAdam(model.parameters(), lr=0.05)
    if ctx is not None:
        model, opt = polytrain.distribute(model, opt, strategy="parallax", partitions=2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randint(0, 20, (4, 3), generator=gen)
        if ctx is not None:
            x = polytrain.shard(x, ctx.worker_index, ctx.num_workers)
        opt.zero_grad()
        model(x).backward()
        opt.step()
        sched.step()
    return _weights(model, ctx)


@pytest.mark.timeout(120)
def test_a_schedulers_betas_reach_the_servers_rows():
    # The rule's settings were read once at distribute() and each push carried only the
    # learning rate: OneCycleLR's beta1 never reached the servers (0.017 off single).
    alone = one_cycle_script(False)
    workers = spawn(one_cycle_script, workers=2, colocated=1, args=(True,))
    assert max_abs_diff(alone, workers[0]) < 1e-6


def momentum_cycle_script() -> None:
    import polytrain
    polytrain.init()
    model = _Table()
    model, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      strategy="parallax", partitions=1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    for _ in range(2):
        opt.zero_grad()
        model(torch.tensor([[1, 2]])).backward()
        opt.step()
        sched.step()


@pytest.mark.timeout(120)
def test_momentum_a_scheduler_gives_the_sparse_rows_sgd_is_refused():
    # OneCycleLR gave SGD momentum 0.85-0.95 after distribute(); the servers' rows went on
    # without it, silently.
    with pytest.raises(LaunchError, match=r"ConfigError: SGD with momentum 0.9\d* .*has no "
                                          r"sparse form \(emb.weight.*after distribute\(\).*"
                                          r"HINT: .*cycle_momentum=False"):
        spawn(momentum_cycle_script, workers=1, colocated=1)


def test_the_store_steps_each_round_with_the_settings_it_carries():
    # The store applied the betas declared at distribute() to every round.
    from polytrain.optim import row_adam
    from polytrain.ps.protocol import Op
    from polytrain.ps.sparse import pack_rows, rule_settings
    from tests.strategies.test_parallax import request, store
    rule = {"name": "adam", "lr": 0.1, "eps": 1e-8, "betas": [0.9, 0.999]}
    s, out = store(rule, pushers=1)
    s.handle(request(Op.SET, 0, 0, torch.cat([torch.ones(12), torch.zeros(24),
                                              torch.tensor([0.0, 0.0])])))
    expected, m, v = torch.ones(6, 2), torch.zeros(6, 2), torch.zeros(6, 2)
    # Round 2's betas are a scheduler's, moved since the declaration.
    for round_, grad, betas in ((1, 1.0, (0.9, 0.999)), (2, 3.0, (0.5, 0.9))):
        s.handle(request(Op.PUSH, 0, round_, pack_rows(
            0.1, torch.tensor([2]), torch.full((1, 2), grad),
            settings=rule_settings({**rule, "betas": list(betas)}))))
        row_adam(expected, m, v, torch.tensor([2]), torch.full((1, 2), grad), lr=0.1,
                 step=round_, betas=betas, eps=1e-8)
    s.handle(request(Op.GET, 0, 0))
    assert torch.allclose(out[-1][1][:12].view(6, 2), expected, rtol=0, atol=1e-7)
    assert not torch.allclose(expected[2], torch.tensor(0.8), atol=1e-3)  # not Adam's sign step

    # Pushers that disagree on a setting are refused, as on the learning rate.
    s, _ = store(rule, pushers=2)

    def push(src, beta1):
        settings = rule_settings({**rule, "betas": [beta1, 0.9]})
        s.handle(request(Op.PUSH, src, 1, pack_rows(0.1, torch.tensor([2]), torch.ones(1, 2),
                                                    settings=settings)))
    push(0, 0.5)
    with pytest.raises(CommError, match="disagree on the learning rate or the rule's settings"):
        push(1, 0.6)


# -- lookups: padding, keywords, branches, gradients kept over steps ---------------------------

class _Padded(nn.Module):
    """A padded table looked up by keyword, and a table only some workers' samples read."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(8, 4, padding_idx=0, sparse=True)
        self.side = nn.Embedding(8, 4, sparse=True)  # (lazy Adam in single too)
        self.out = nn.Linear(4, 3)

    def sparse_reads(self, ids: torch.Tensor, use_side: bool) -> dict:
        return {"tok.weight": ids, **({"side.weight": ids} if use_side else {})}

    def forward(self, ids: torch.Tensor, use_side: bool, scale: float = 1.0) -> torch.Tensor:
        x = self.tok(input=ids).mean(1)
        return self.out(x + self.side(ids).mean(1) if use_side else x) * scale


def padded_script(distributed: bool) -> dict:
    """LazyAdam, 5 steps, distribute() after the first: steps 1 and 2 read only the padding
    row (an empty sparse gradient, still a step of torch's optimizers); the first half of
    each batch reads ``side`` too (in two workers: worker 0's half); no zero_grad() before
    step 4 (its gradients add to step 3's)."""
    import polytrain
    ctx = polytrain.init() if distributed else None
    torch.manual_seed(0)
    model: nn.Module = _Padded()
    opt = LazyAdam(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        if ctx is not None and step == 1:  # after a step of the script's own (its moments)
            model, opt = polytrain.distribute(model, opt, strategy="parallax", partitions=1)
        ids = torch.randint(1, 8, (4, 3), generator=gen)
        if step in (1, 2):
            ids = torch.zeros(4, 3, dtype=torch.int64)
        y = torch.randn(4, 3, generator=gen)
        if step != 4:
            opt.zero_grad()
        if ctx is None or step == 0:
            loss = (nn.functional.mse_loss(model(ids[:2], True, scale=0.5), y[:2])
                    + nn.functional.mse_loss(model(ids[2:], False, scale=0.5), y[2:])) / 2
        else:
            ids, y = (polytrain.shard(t, ctx.worker_index, ctx.num_workers) for t in (ids, y))
            # A keyword sparse_reads does not take is not passed to it (a TypeError).
            loss = nn.functional.mse_loss(model(ids, ctx.worker_index == 0, scale=0.5), y)
        loss.backward()
        opt.step()
    weights = _weights(model, ctx)
    if ctx is not None:  # (the run's weights are taken: what follows leaves them behind)
        written_and_closed(model, opt, ids)
    return weights


def written_and_closed(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """A write to a sparse table is refused at the next fetch; close() takes the hooks off."""
    import polytrain
    with torch.no_grad():  # a renorm of the rows after the step, or a load_state_dict
        model.tok.weight.mul_(0.5)
    with pytest.raises(ConfigError, match=r"tok.weight was written outside parallax since its "
                                          r"last fetch.*the next fetch would write the "
                                          r"servers' rows over the change.*HINT: "):
        model(ids, True)
    strategy = polytrain.strategy_of(model)
    pushed = strategy.rows.round
    strategy.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    opt.step()  # the closed model is the user's own: a step stays local
    assert strategy.rows.round == pushed


@pytest.mark.timeout(120)
def test_padding_steps_keyword_lookups_branches_and_kept_gradients_train_as_single():
    # Four ways the tables left single's path: a step whose sparse gradient had no rows
    # (only padding ids) was not counted as a step of LazyAdam (the count came from the
    # rows); self.tok(input=ids) raised IndexError in the lookup hook (it read args[0]);
    # workers of a machine whose sparse_reads named different tables hung in gloo (the
    # fetch looped over this worker's own tables only); and a loop without zero_grad()
    # summed the dense gradients over steps, while the tables' were cleared every step.
    # (And the forward's keyword scale=, which sparse_reads does not take, was passed to it
    # by the first fix of the keyword lookups: a TypeError.)
    # Then (written_and_closed): a write to a table on the workers (a renorm after the step,
    # a load_state_dict) was reverted by the next fetch, silently; and close() left the
    # optimizer's step hooks, so a step after it still pushed to the servers.
    # And the servers started the rows' moments and step count afresh, dropping those of
    # the script's step before distribute() (0.22 off one process).
    alone = padded_script(False)
    workers = spawn(padded_script, workers=2, colocated=1, args=(True,))
    torch.manual_seed(0)
    untrained = _Padded().state_dict()
    assert max_abs_diff(alone, untrained) > 1e-2  # the weights moved
    assert max_abs_diff(alone, workers[0]) < 1e-6  # (worker 0 gathers the tables)


def branch_script() -> list[str]:
    """Three refusals, each on every worker: an evaluation on worker 0 alone between training
    steps (the model declares sparse_reads); then, without sparse_reads, a lookup that only
    worker 0's data reaches, in training and in an evaluation on every worker."""
    import polytrain
    ctx = polytrain.init()
    said = []
    torch.manual_seed(0)
    model = _Padded()
    model, opt = polytrain.distribute(model, LazyAdam(model.parameters(), lr=0.1),
                                      strategy="parallax", partitions=1)
    try:
        for _ in range(2):
            opt.zero_grad()
            model(torch.tensor([[1, 2]]), True).sum().backward()
            opt.step()
            if ctx.worker_index == 0:
                model.eval()
                with torch.no_grad():
                    model(torch.tensor([[3, 4]]), True)
                model.train()
    except ConfigError as e:
        said.append(str(e))
    torch.manual_seed(0)
    model = _Padded()
    model.sparse_reads = None  # each lookup fetches its own rows, with the machine's others
    model, opt = polytrain.distribute(model, LazyAdam(model.parameters(), lr=0.1),
                                      strategy="parallax", partitions=1)
    try:
        opt.zero_grad()
        model(torch.tensor([[1, 2]]), ctx.worker_index == 0).sum().backward()
        opt.step()
    except ConfigError as e:
        said.append(str(e))
    model.eval()  # every worker evaluates; only worker 0's data reach side
    try:
        with torch.no_grad():
            for _ in range(2):
                model(torch.tensor([[1, 2]]), ctx.worker_index == 0)
    except ConfigError as e:
        said.append(str(e))
    return said


@pytest.mark.timeout(120)
def test_a_lookup_or_an_evaluation_only_some_workers_of_a_machine_reach_is_refused_naming_it():
    # A lookup fetches its rows together with the machine's other workers: one that only
    # worker 0's data reached met worker 1's step in gloo and hung to the timeout.
    # An evaluation on worker 0 alone (model.eval(), no_grad) was refused a step later as
    # a lookup only some workers reach, with the hint to give the model the sparse_reads it
    # had: its fetch had met worker 1's next training fetch, and worker 0's next one met
    # worker 1's step.
    # An evaluation on every worker whose lookups differ got the evaluation's message.
    for evaluated, branched, both in spawn(branch_script, workers=2, colocated=1):
        assert re.fullmatch(
            r"the workers of a machine reached different sparse-row exchanges \(local worker 0 "
            r"fetched the rows of the model's sparse_reads to evaluate \(under no_grad or in "
            r"eval mode\), local worker 1 fetched the rows of the model's sparse_reads\): an "
            r"evaluation fetches its rows together with the machine's other workers, so it "
            r"must run on every worker of the machine\. HINT: evaluate on every worker .*"
            r"\(--eval-every\), whose model fetches nothing", evaluated), evaluated
        assert re.fullmatch(
            r"the workers of a machine reached different sparse-row exchanges \(local worker 0 "
            r"looked up side.weight, local worker 1 began optimizer.step\(\)\): every worker "
            r"of a machine must look up the same tables in the same order each step.*HINT: "
            r"give the model sparse_reads.*", branched), branched
        assert re.fullmatch(
            r"the workers of a machine reached different sparse-row exchanges \(local worker 0 "
            r"looked up side.weight to evaluate \(under no_grad or in eval mode\), local "
            r"worker 1 looked up tok.weight to evaluate \(under no_grad or in eval mode\)\): "
            r"every worker of a machine must look up the same tables.*HINT: give the model "
            r"sparse_reads.*", both), both
