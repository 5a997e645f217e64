"""PipeTransformer end to end: transparency, AutoFreeze, AutoDP's hand-over, epochs, refusals."""

import functools
import logging
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import polytrain
from polytrain import ConfigError, TrainConfig
from polytrain.data import EpochBatches
from polytrain.models import GPT
from polytrain.models import cross_entropy as loss_fn
from polytrain.strategies.pipetransformer.options import PipeTransformerOptions
from tests.harness import (
    Sleepy,
    adam_tolerance,
    max_abs_diff,
    run_config,
    single_of,
    spawn,
    torchrun,
)

TINY = {"seq_len": 16, "d_model": 32, "layers": 4}  # embed h0 h1 h2 h3 head: 6 layers


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adam", 3e-3)])
def test_without_freezing_two_stages_by_two_replicas_is_single(optimizer, lr):
    # K = 2 stages per machine, R = 2 machines: micro-batched 1F1B pipelines whose stages
    # all-reduce their gradients, one flush per step: synchronous training on the batch.
    config = TrainConfig(strategy="pipetransformer", workers=4, nodes=2, steps=5, batch_size=8,
                         optimizer=optimizer, lr=lr, model_options=TINY,
                         strategy_options={"freeze": False})
    metrics, pipe = run_config(config)
    single_metrics, single = run_config(single_of(config))
    assert list(pipe) == list(single)
    assert max_abs_diff(single, pipe) < (adam_tolerance(lr, 5) if optimizer == "adam" else 1e-5)
    _, untrained = run_config(single_of(config).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 1e-3  # the weights moved
    assert metrics["losses"] == pytest.approx(single_metrics["losses"], abs=1e-5)
    [plan] = metrics["freeze_timeline"]
    assert (plan["stages"], plan["replicas"], plan["micro_batches"]) == (2, 2, 4)


def _batches(steps, batch=8, seed=0, distinct=3, kind="gpt"):
    """Batches that come back every ``distinct`` steps (epochs of a tiny data set), so the
    cache meets samples again: token windows (gpt), or 4 patches of 12 features and one of 5
    classes (a user's model)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "gpt":
        windows = [torch.randint(0, 256, (batch, 17), generator=gen) for _ in range(distinct)]
        pool = [(w[:, :-1], w[:, 1:]) for w in windows]
    else:
        pool = [(torch.randn(batch, 4, 12, generator=gen),
                 torch.randint(0, 5, (batch,), generator=gen)) for _ in range(distinct)]
    for step in range(steps):
        yield pool[step % distinct]


class Block(torch.nn.Module):
    """A pre-norm residual MLP block, as a user's ViT-like model has them."""

    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                       torch.nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _model(kind):
    """The GPT, or a user's nn.Sequential: patches -> 4 blocks -> a classifier (6 layers)."""
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(**TINY), loss_fn
    head = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 16, 5))
    return torch.nn.Sequential(OrderedDict(
        patch=torch.nn.Linear(12, 16), **{f"b{i}": Block(16) for i in range(4)},
        head=head)), torch.nn.functional.cross_entropy


# Every layer counts as stopped, so the smallest change decides, up to the cap (half the
# layers left): at step 2 the GPT's embed (1 layer), the user's model's b1 (3 layers).
FREEZING = dict(freeze_every=2, freeze_threshold=100.0, freeze_alpha=0.5)


def train_freezing(steps, options, kind="gpt"):
    polytrain.init()
    model, loss = _model(kind)
    trainer = polytrain.distribute(model, torch.optim.Adam(model.parameters(), lr=3e-3),
                                   strategy="pipetransformer", loss_fn=loss, **options)
    states = []
    for x, y in _batches(steps, kind=kind):
        trainer.step(x, y)
        states.append(trainer.state_dict())
    records = trainer.strategy.metrics()
    trainer.close()
    return states, records["freeze_timeline"], records["cache"]


def reference(steps, timeline, kind="gpt"):
    """One process, freezing the timeline's layers at its steps (no gradient, no update)."""
    model, loss = _model(kind)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    at = {e["step"]: e["frozen_layers"] for e in timeline}
    for step, (x, y) in enumerate(_batches(steps, kind=kind)):
        for name in at.get(step, []):
            for p in getattr(model, name).parameters():
                p.requires_grad_(False)
                p.grad = None
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["gpt", "user"])
def test_frozen_layers_never_change_and_the_run_equals_a_reference_freezing_the_same(kind):
    # "user": any nn.Sequential of blocks, with its own loss and inputs, not only the GPT.
    steps = 9
    states, timeline, cache = spawn(train_freezing, workers=4, nodes=2,
                                    args=(steps, FREEZING, kind))[0]
    frozen_at = [(e["step"], e["frozen"]) for e in timeline]
    assert [s for s, _ in frozen_at] == [0, 2, 4, 6, 8]
    assert frozen_at[1] == (2, {"gpt": 1, "user": 3}[kind])
    # Regression: with a freeze point every 2 steps (up to 5) every change at the first was
    # 0.0, and the cap froze 3 layers whatever the gradients did. Cause: the reference steps
    # were the whole interval; they are now at most half of it.
    assert min(timeline[1]["grad_norm_signal"].values()) > 0.01
    assert all(a[1] <= b[1] for a, b in zip(frozen_at, frozen_at[1:]))
    # The pipeline shortened and widened on the way: 2 x 2, then 1 x 4 (no memory limit).
    assert [(e["stages"], e["replicas"]) for e in timeline][:2] == [(2, 2), (1, 4)]
    assert cache["hits"] > 0 and cache["misses"] > 0
    layers = [n for n, _ in _model(kind)[0].named_children()]
    for step, frozen in frozen_at:
        if not frozen:
            continue
        names = [k for k in states[0] if k.split(".")[0] in layers[:frozen]]
        at_freeze = states[step - 1]  # the weights after the last update before freezing
        for later in states[step:]:
            for k in names:
                assert torch.equal(later[k], at_freeze[k]), (step, k)
    ref = reference(steps, timeline, kind)
    assert max_abs_diff(ref, states[-1]) < adam_tolerance(3e-3, steps)
    assert max_abs_diff(ref, reference(steps, timeline[:1], kind)) > 1e-3  # freezing mattered


def train_trailing_activation(steps):
    """An nn.Sequential whose last layer has no parameters (a LogSoftmax), freezing every
    2 steps; each step's largest change of the last Linear's weights."""
    polytrain.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.LogSoftmax(-1))
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="pipetransformer",
                                   loss_fn=torch.nn.functional.nll_loss, cache=False,
                                   freeze_every=2, freeze_threshold=100.0, freeze_alpha=0.5)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    moved = []
    for _ in range(steps):
        before = model[4].weight.detach().clone()
        trainer.step(x, y)
        moved.append(float((model[4].weight.detach() - before).abs().max()))
    timeline = trainer.strategy.metrics()["freeze_timeline"]
    trainer.close()
    return moved, [e["frozen"] for e in timeline]


@pytest.mark.timeout(120)
def test_the_last_layer_with_parameters_trains_when_parameter_free_layers_follow_it():
    # Symptom: with a LogSoftmax last, every layer froze (0, 3, 4, 5 of 6) and from the 4th
    # step no weight changed, silently. Cause: "the last layer always trains" counted the
    # LogSoftmax; the last Linear froze in its place.
    moved, frozen = spawn(train_trailing_activation, workers=1, args=(8,))[0]
    # At step 2 the first Linear (the smallest change), at 4 up to the cap (3 of 4); then the
    # ReLU before the last Linear, with no gradient norm, never counts as stopped, and the
    # Linear and LogSoftmax never freeze.
    assert frozen == [0, 1, 3, 3]
    assert min(moved) > 1e-4, moved


class Counting(torch.nn.Module):
    """A layer whose buffer changes as it trains (as a batch norm's statistics do)."""

    def __init__(self, d, out):
        super().__init__()
        self.lin = torch.nn.Linear(d, out)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.lin(x)


def train_counting(steps):
    polytrain.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(embed=torch.nn.Embedding(256, 16),
                                            a=Counting(16, 16), head=Counting(16, 256)))
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="pipetransformer", loss_fn=loss_fn, freeze=False)
    for x, y in _batches(steps):
        trainer.step(x, y)
    state = trainer.state_dict()
    trainer.close()
    return state


@pytest.mark.timeout(300)
def test_the_gathered_model_carries_every_stages_buffers():
    # K = 2 on one machine: the head runs on stage 1 only (the last layer always does).
    # final.pt took worker 0's own copy of its buffer, never run: its initial value.
    state = spawn(train_counting, workers=2, args=(3,))[0]
    micro_batches = 4  # per step: the smallest divisor of the batch, 8, at least 2 K
    assert state["a.calls"].item() == state["head.calls"].item() == 3 * micro_batches


def hand_over(steps, options):
    """Perturb every replica differently before each freeze point, then check each new
    replica's weights and optimizer state equal those of the replica it came from."""
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    trainer = polytrain.distribute(model, torch.optim.Adam(model.parameters(), lr=3e-3),
                                   strategy="pipetransformer", loss_fn=loss_fn, **options)
    strategy = trainer.strategy
    checks, shapes = [], []
    for step, (x, y) in enumerate(_batches(steps)):
        if step and step % options["freeze_every"] == 0:
            mine = strategy.stage_state()
            with torch.no_grad():  # replica r's copy differs from every other replica's
                r = mine["where"][0] if mine["where"] else 0
                for p in model.parameters():
                    p.add_(1e-3 * (r + 1))
                for state in strategy.stage_opt.state.values():
                    state["exp_avg"].add_(1e-3 * (r + 1))
            before = [None] * ctx.num_workers
            torch.distributed.all_gather_object(before, strategy.stage_state(),
                                                group=ctx.groups.workers)
            strategy.replan(step)
            after = strategy.stage_state()
            shapes.append((strategy.plan.stages, strategy.plan.replicas))
            if after["where"] is not None:
                source = after["source"] if after["source"] is not None else after["where"][0]
                old = {}
                for b in before:
                    if b["where"] is not None and b["where"][0] == source:
                        old.update({"w": {**old.get("w", {}), **b["weights"]},
                                    "s": {**old.get("s", {}), **b["state"]}})
                same_w = all(torch.equal(t, old["w"][n]) for n, t in after["weights"].items())
                same_s = all(torch.equal(v, old["s"][n][k]) for n, st in after["state"].items()
                             for k, v in st.items() if isinstance(v, torch.Tensor))
                # Adam's state came along for every weight the new stage trains, all of
                # them trained (so with state) in the source pipeline before the freeze
                # point. (Checking only the state a replica has passed with half of it
                # missing: a hand-over that kept each worker's old stage's state.)
                trained = {n for n, p in zip(strategy.stage.names, strategy.stage.params)
                           if p.requires_grad}
                has_state = bool(trained) and set(after["state"]) == trained <= set(old["s"])
                checks.append((step, after["where"], source, same_w, same_s, has_state))
        trainer.step(x, y)
    trainer.close()
    return checks, shapes


@pytest.mark.timeout(300)
def test_new_replicas_get_the_weights_and_optimizer_state_of_their_source():
    options = {**FREEZING, "cache": False}
    results = spawn(hand_over, workers=4, nodes=2, args=(5, options))
    shapes = results[0][1]
    assert shapes[0] == (1, 4)  # at step 2 the pipeline halved: 2 x 2 -> 1 x 4
    sources = {}
    for checks, _ in results:
        for step, where, source, same_w, same_s, has_state in checks:
            assert same_w and same_s and has_state, (step, where, source)
            sources.setdefault(step, []).append((where[0], source))
    # Replicas 0, 1 come from pipeline 0 (its two devices), replicas 2, 3 from pipeline 1.
    assert sorted(sources[2]) == [(0, 0), (1, 0), (2, 1), (3, 1)]


def seen_samples(samples, batch, steps, options):
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    seen = []

    def record(_m, args):
        x = args[0]
        if x.dtype == torch.long:
            seen.extend((x[:, 0] * 256 + x[:, 1]).tolist())

    model.embed.register_forward_pre_hook(record)
    trainer = polytrain.distribute(model, torch.optim.Adam(model.parameters(), lr=3e-3),
                                   strategy="pipetransformer", loss_fn=loss_fn, **options)
    batches = iter(EpochBatches(samples, batch_size=batch, window=17, seed=0))
    per_step = []
    for _ in range(steps):
        w = next(batches)
        before = len(seen)
        trainer.step(w[:, :-1], w[:, 1:])
        per_step.append(seen[before:])
    trainer.close()
    return per_step, ctx.worker_index


@pytest.mark.timeout(300)
def test_every_sample_is_seen_once_per_epoch_while_the_replicas_change():
    # 48 samples whose first two tokens are their number; 6 steps of 8 per epoch, and the
    # pipeline widens from 2 x 2 to 1 x 4 at step 2, in the middle of the first epoch.
    n, batch = 48, 8
    rows = torch.randint(0, 256, (n, 17), generator=torch.Generator().manual_seed(1))
    rows[:, 0], rows[:, 1] = torch.arange(n) // 256, torch.arange(n) % 256
    corpus = rows.reshape(-1).to(torch.uint8)
    options = {**FREEZING, "cache": False}
    results = spawn(seen_samples, workers=4, nodes=2, args=(corpus, batch, 12, options))
    for epoch in range(2):
        got = sorted(i for per_step, _ in results for s in per_step[6 * epoch:6 * epoch + 6]
                     for i in s)
        assert got == list(range(n)), epoch


def train_costed(steps, costs):
    polytrain.init()
    user, loss = _model("user")
    model = torch.nn.Sequential(OrderedDict(sleepy=Sleepy(12), **dict(user.named_children())))
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="pipetransformer", loss_fn=loss, freeze=False,
                                   layer_costs=costs)
    for x, y in _batches(steps, kind="user"):
        trainer.step(x, y)
    records = trainer.strategy.metrics()
    state = trainer.state_dict()
    trainer.close()
    return records, state


def with_a_server() -> list[str]:
    """A script's defaults (AutoFreeze on, no freeze_every) for a step; the warnings."""
    polytrain.init()
    warnings = _Warnings()
    logging.getLogger("polytrain.strategies.pipetransformer.strategy").addHandler(warnings)
    model, loss = _model("user")
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="pipetransformer", loss_fn=loss)
    for x, y in _batches(1, kind="user"):
        trainer.step(x, y)
    trainer.close()
    return warnings.lines


class _Warnings(logging.Handler):
    """The warnings a logger gave, as text."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.timeout(120)
def test_a_script_with_servers_of_its_own_may_run_a_pipeline():
    # distribute() ran the CLI's whole layout check, which refuses servers pipetransformer
    # does not use; a script may have them for its own push_pull.
    # Its warning that no layer will freeze named only CLI flags, and said the data had no
    # epochs, which the strategy cannot know of a script's data.
    assert spawn(with_a_server, workers=2, servers=1) == [
        ["pipetransformer: no freeze points (freeze_every is not set, and no training loop "
         "gave an epoch length), so no layer will freeze; pass --freeze-every N "
         "(freeze_every=N to distribute()) or --sampling epoch"], []]


class Sometimes(torch.nn.Module):
    """A linear layer that adds ``rare`` to the samples flagged in their last feature only
    (autograd reaches it only in a batch with one; the layer profile, on the meta device,
    has no values and takes it), and holds ``spare``, which its forward never uses."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.rare = torch.nn.Parameter(torch.full((d,), 0.5))
        self.spare = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        out = self.lin(x)
        flagged = x[:, -1] > 0
        if x.is_meta or flagged.any():
            out = out + flagged[:, None] * self.rare
        return out


def _sometimes_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(a=Sometimes(8), r=torch.nn.ReLU(),
                                           c=torch.nn.Linear(8, 4)))


def _flagged_batches():
    """Global batches of 8 whose flagged samples are: the first (replica 0's slice of two),
    none, the last (replica 1's)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for flagged in ([0], [], [7]):
        x = torch.randn(8, 8, generator=gen)
        x[:, -1] = -1.0
        x[flagged, -1] = 1.0
        out.append((x, torch.randint(0, 4, (8,), generator=gen)))
    return out


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_sometimes(root):
    """K = 1, R = 2, two micro-batches: the refusal of micro-batches that do not divide a
    replica's slice, then a run of :func:`_sometimes_model`, saved at step 1 (to ``root``)
    and loaded again at its end."""
    polytrain.init()
    model = _sometimes_model()
    trainer = polytrain.distribute(model, _adamw(model), strategy="pipetransformer",
                                   loss_fn=torch.nn.functional.cross_entropy, freeze=False,
                                   pipeline_stages=1, micro_batches=3)
    try:
        trainer.step(*_flagged_batches()[0])
        refusal = "accepted"
    except ConfigError as e:
        refusal = str(e)
    model = _sometimes_model()
    trainer = polytrain.distribute(model, _adamw(model), strategy="pipetransformer",
                                   loss_fn=torch.nn.functional.cross_entropy, freeze=False,
                                   pipeline_stages=1, micro_batches=2)
    for step, (x, y) in enumerate(_flagged_batches()):
        if step == 1:
            polytrain.save(root, trainer, step=1)
        trainer.step(x, y)
    state = trainer.state_dict()
    try:  # a roll back to step 1
        polytrain.load(root, trainer)
        loaded = "accepted"
    except ConfigError as e:
        loaded = str(e)
    kept = max_abs_diff(state, trainer.state_dict())
    trainer.close()
    return refusal, state, loaded, kept


@functools.cache
def _sometimes_run():
    root = tempfile.mkdtemp()
    try:
        return spawn(train_sometimes, workers=2, args=(root,))[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_parameter_no_replica_reaches_is_skipped_as_in_single():
    # Symptom: a registered parameter the forward never uses moved (1.0 -> 0.997 in 3 AdamW
    # steps; single leaves it alone). Cause: every stage stepped a trained parameter that got
    # no gradient on zeros. Now the replicas agree on which got one somewhere: zeros where
    # only another replica's slice reached it (step 0, step 2), None where none did (step 1).
    _, state, _, _ = _sometimes_run()
    model = _sometimes_model()
    opt = _adamw(model)
    for x, y in _flagged_batches():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert torch.equal(state["a.spare"], torch.ones(3))
    assert max_abs_diff(model.state_dict(), state) < adam_tolerance(1e-2, 3)
    assert float((model.a.rare.detach() - 0.5).abs().min()) > 1e-3  # it trained


@pytest.mark.timeout(120)
def test_micro_batches_that_do_not_divide_a_replicas_slice_are_refused_in_the_step_api():
    # Symptom: distribute(..., micro_batches=5) on a global batch of 12 over 2 replicas ran
    # 3 micro-batches, without a word (polytrain train refuses it). Cause: the first plan
    # took the largest divisor below it; only a later plan, after a halving, may.
    refusal, _, _, _ = _sometimes_run()
    assert refusal == ("micro_batches=3 does not divide a replica's 4 samples (a global batch "
                       "of 8 over 2 replicas). HINT: pass micro_batches one of [1, 2, 4]")


@pytest.mark.timeout(120)
def test_a_load_after_the_first_step_is_refused_and_loads_nothing():
    # Symptom: polytrain.load() to roll a trained trainer back was accepted and half applied:
    # the weights came back, but the frozen layers, the stage optimizers' state and the
    # freeze points stayed the trained run's (0.0071 off a run that never went past the
    # checkpoint). Cause: the loaded state waits for the first step to install its plan,
    # and a trainer that has trained has its plan.
    _, _, loaded, kept = _sometimes_run()
    assert loaded == ("pipetransformer loads a checkpoint only before the trainer's first "
                      "step, and this trainer has trained: its plan (0 layers frozen, 1 "
                      "stages x 2 replicas), frozen layers and stage optimizers would stay "
                      "as they are. HINT: load before the first trainer.step(), into a "
                      "model distributed afresh")
    assert kept == 0


@pytest.mark.timeout(300)
def test_measured_layer_costs_cut_where_the_time_is():
    # K = 2: by FLOPs the sleepy first layer is nearly free and shares stage 0 with others;
    # timed, it is the slowest layer by far, and stands alone.
    flops, by_flops = spawn(train_costed, workers=2, args=(3, "flops"))[0]
    measured, by_time = spawn(train_costed, workers=2, args=(3, "measured"))[0]
    [flops_plan], [measured_plan] = flops["freeze_timeline"], measured["freeze_timeline"]
    assert measured_plan["bounds"] == [0, 1, 7] != flops_plan["bounds"]
    assert "layer_costs_ms" not in flops
    times = measured["layer_costs_ms"]
    assert list(times) == ["sleepy", "patch", "b0", "b1", "b2", "b3", "head"]
    assert times["sleepy"]["forward_ms"] > 10 * max(t["forward_ms"] for n, t in times.items()
                                                     if n != "sleepy")
    # The cuts change where layers run, not what the run computes.
    assert max_abs_diff(by_flops, by_time) == 0


def test_only_autopipe_moves_the_cuts_which_a_tuple_between_layers_must_not_fall_after():
    # A child that hands the next a tuple is refused wherever the cuts are only where they
    # move: --no-freeze and --no-autopipe keep the first plan's (both were refused).
    assert PipeTransformerOptions().cuts_move
    assert not PipeTransformerOptions(freeze=False).cuts_move
    assert not PipeTransformerOptions(autopipe=False).cuts_move


def test_refusals():
    # It was silently lowered to the largest divisor of the replica's batch (7 ran as 4).
    with pytest.raises(ConfigError, match=r"--micro-batches 7 does not divide a replica's 16 "
                                          r"samples.*HINT: pass --micro-batches one of "
                                          r"\[1, 2, 4, 8, 16\]"):
        TrainConfig(strategy="pipetransformer", workers=4, batch_size=32, model_options=TINY,
                    strategy_options={"pipeline_stages": 2, "micro_batches": 7})
    with pytest.raises(ConfigError, match=r"--pipeline-stages 3 does not divide a machine's 4.*"
                                          r"HINT: pass --pipeline-stages one of \[1, 2, 4\]"):
        TrainConfig(strategy="pipetransformer", workers=4, model_options=TINY,
                    strategy_options={"pipeline_stages": 3})
    with pytest.raises(ConfigError, match="has 3 layers .* but the pipeline has 4 stages"):
        TrainConfig(strategy="pipetransformer", workers=4,
                    model_options={**TINY, "layers": 1})
    with pytest.raises(ConfigError, match=r"--freeze-alpha must be in \(0, 1\) \(got 1.0\)"):
        TrainConfig(strategy="pipetransformer", workers=4, model_options=TINY,
                    strategy_options={"freeze_alpha": 1.0})


@pytest.mark.parametrize("args, message", [
    (["--no-freeze", "--freeze-every", "5"],
     r"--no-freeze turns AutoFreeze off, so --freeze-every would do nothing\. HINT: leave out "
     r"--no-freeze, or --freeze-every"),
    (["--no-freeze", "--no-autodp", "--freeze-alpha", "0.5"],
     r"so --freeze-alpha, --no-autodp would do nothing"),
    (["--no-freeze", "--cache-mb", "64"], r"so --cache-mb would do nothing"),
    # AutoCache caches frozen layers only: --no-cache said nothing more (a review).
    (["--no-freeze", "--no-cache"],
     r"--no-freeze turns AutoFreeze off, so --no-cache would do nothing\. HINT: leave out "
     r"--no-freeze, or --no-cache"),
    (["--no-cache", "--cache-mb", "64"],
     r"--no-cache turns AutoCache off, so --cache-mb would do nothing\. HINT: leave out "
     r"--no-cache, or --cache-mb"),
    # AutoCache caches the front AutoPipe moves out, AutoDP takes the devices its halving
    # frees: without AutoPipe they did nothing, silently (a review).
    (["--no-autopipe", "--cache-mb", "64"],
     r"--no-autopipe turns AutoPipe off, so --cache-mb would do nothing"),
    (["--no-autopipe", "--no-autodp"], r"--no-autopipe turns AutoPipe off, so --no-autodp "
                                       r"would do nothing"),
    # Its first freeze point past the run: it trained to the end, freezing nothing.
    (["--steps", "20", "--freeze-every", "20"],
     r"--freeze-every 20 puts the first freeze point past the run's 20 steps: no layer "
     r"would freeze"),
])
def test_options_that_a_switched_off_part_would_ignore_are_refused(args, message, capsys):
    from polytrain.cli import main

    assert main(["train", "--quiet", "--strategy", "pipetransformer", "--workers", "2",
                 *args]) == 2
    assert re.search(message, capsys.readouterr().err)
    # each switch alone, and the options alone, are fine
    PipeTransformerOptions(freeze=False)
    PipeTransformerOptions(cache=False, freeze_every=3)


def test_weights_tied_across_layers_are_refused_with_freezing_even_in_one_stage():
    # Symptom: one worker (K = 1), an embedding tied to the output head, freezing: once the
    # embedding froze, the head's weight changed by 0.0 a step while its bias trained.
    # Cause: the tie check let a pipeline of one stage through (it holds the tensor once),
    # and freezing the embedding set requires_grad False on the tensor the head trains.
    from polytrain.launch.layout import Layout
    from polytrain.strategies.pipetransformer.strategy import PipeTransformer

    class Mean(torch.nn.Module):
        def forward(self, x):
            return x.mean(1)

    model = torch.nn.Sequential(OrderedDict(embed=torch.nn.Embedding(32, 8),
                                            mix=torch.nn.Linear(8, 8), pool=Mean(),
                                            head=torch.nn.Linear(8, 32)))
    model.head.weight = model.embed.weight
    with pytest.raises(ConfigError) as caught:
        PipeTransformer.check_model(model, Layout(workers=1), PipeTransformerOptions())
    assert str(caught.value) == (
        "'embed.weight' and 'head.weight' are one tensor (tied weights) in two layers, and "
        "strategy 'pipetransformer' freezes front layers while the later ones train: "
        "freezing the first would stop the second training. HINT: untie them (give the "
        "second layer a weight of its own), or pass --no-freeze (Python: freeze=False)")
    PipeTransformer.check_model(model, Layout(workers=1), PipeTransformerOptions(freeze=False))


def test_a_cache_from_past_the_layers_that_may_freeze_is_refused():
    # Symptom: --cache-from 6 on a GPT of 4 blocks (5 layers that may freeze: embed, h0-h3)
    # was accepted, and AutoCache never cached, without a word. Cause: the options checked
    # at least 1 only; the model's layers are known at check_model.
    from polytrain.launch.layout import Layout
    from polytrain.strategies.pipetransformer.strategy import PipeTransformer

    model = GPT(**TINY)
    with pytest.raises(ConfigError) as caught:
        PipeTransformer.check_model(model, Layout(workers=1), PipeTransformerOptions(cache_from=6))
    assert str(caught.value) == (
        "--cache-from 6 is more layers than the model's 5 that may freeze (those before its "
        "last layer with parameters): AutoCache would never cache. HINT: pass --cache-from 5 "
        "or less, or --no-cache")
    PipeTransformer.check_model(model, Layout(workers=1), PipeTransformerOptions(cache_from=5))
    # An odd K halves to no fewer stages, each keeping a trained layer: 3 of 6 layers freeze.
    three = Layout(workers=3)
    with pytest.raises(ConfigError, match=r"^--cache-from 4 is more layers than the 3 of the "
                                          r"model's 5 that may freeze on 3 stages \(AutoPipe "
                                          r"keeps a trained layer on each of the 3 stages the "
                                          r"pipeline halves to\): AutoCache would never cache\. "
                                          r"HINT: pass --cache-from 3 or less, or --no-cache$"):
        PipeTransformer.check_model(model, three, PipeTransformerOptions(cache_from=4))
    PipeTransformer.check_model(model, three, PipeTransformerOptions(cache_from=3))
    # The default --cache-from 2 is not asked about: a model of one layer that may freeze
    # trains as before.
    two = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))  # 1 may freeze
    PipeTransformer.check_model(two, Layout(workers=1), PipeTransformerOptions())
    with pytest.raises(ConfigError, match=r"--cache-from 3 is more layers than the model's 1 "):
        PipeTransformer.check_model(two, Layout(workers=1), PipeTransformerOptions(cache_from=3))


def test_handed_optimizer_state_is_placed_as_torchs_load_state_dict_places_it():
    from polytrain.optim import placed_state
    p = torch.nn.Parameter(torch.zeros(3))
    step, moment = torch.tensor(4.0, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    saved = {"step": step, "exp_avg": moment, "other": {"a": 1}}
    plain = placed_state(torch.optim.Adam([p]), p, saved)
    assert plain["step"].dtype == torch.float64  # as saved: torch keeps it
    assert plain["step"] is not step  # a copy, never shared
    assert plain["exp_avg"].dtype == torch.float32  # the parameter's
    assert plain["other"] == {"a": 1}
    # Fused or capturable: step on the parameter's device, in float32.
    capturable = placed_state(torch.optim.Adam([p], capturable=True), p, saved)
    assert capturable["step"].dtype == torch.float32


def test_a_cache_a_worker_closes_still_counts_what_it_served():
    # A first stage that stopped being one (idle with --no-autodp, or another stage after
    # a halving) closed its cache, and metrics.json lost its hits and misses.
    from types import SimpleNamespace

    from polytrain.pipeline.cache import CacheStats
    from polytrain.strategies.pipetransformer.strategy import PipeTransformer
    strategy = PipeTransformer(None, PipeTransformerOptions())
    closed = []
    for hits in (3, 4):
        strategy.cache = SimpleNamespace(stats=CacheStats(hits=hits, misses=1, shared_hits=1),
                                         close=lambda: closed.append(True))
        strategy._drop_cache()
    assert strategy.cache is None and closed == [True, True]
    assert strategy._served == {"hits": 7, "shared_hits": 2, "misses": 2, "advanced": 0}


def test_the_progress_bar_is_drawn_by_the_last_stage_of_pipeline_0_of_the_plan_in_force():
    # Symptom: with --no-autodp the bar showed "loss -" and absurd samples/s once the
    # pipeline halved. Cause: worker K0 - 1 drew it, idle after the halving.
    from types import SimpleNamespace

    from polytrain.pipeline.autopipe import PipePlan
    from polytrain.strategies.pipetransformer.strategy import PipeTransformer

    def drawing(plan):
        out = []
        for w in range(4):
            strategy = PipeTransformer(SimpleNamespace(worker_index=w, num_workers=4,
                                                       num_nodes=1),
                                       PipeTransformerOptions(autodp=False))
            strategy.plan = plan
            out.append(strategy.shows_progress)
        return out

    halved = PipePlan(step=2, frozen=3, frozen_layers=("embed", "h0", "h1"), bounds=(3, 5, 6),
                      stages=2, replicas=1, micro_batches=4, stage_cost=(1.0, 1.0))
    assert drawing(None) == [False, False, False, True]  # K0 = 4: worker 3
    assert drawing(halved) == [False, True, False, False]  # workers 2, 3 idle


@pytest.mark.timeout(120)
def test_polytrain_train_prints_each_new_plan_and_its_bar_follows_the_plan(capfd):
    # The plan at every freeze point was logged at INFO on worker 0, which the default
    # level (WARNING) hides: polytrain train printed only the first. And with --no-autodp
    # the bar showed "loss -" and absurd samples/s once the pipeline halved: worker K0 - 1
    # drew it, idle after the halving.
    from polytrain.cli import main

    assert main(["train", "--strategy", "pipetransformer", "--workers", "4", "--steps", "5",
                 "--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--layers", "4",
                 "--freeze-every", "2", "--freeze-threshold", "100", "--freeze-alpha",
                 "0.5", "--no-autodp"]) == 0
    err = capfd.readouterr().err
    # Two new plans: 2 layers frozen at step 2, then 3 at step 4, where K halves (4 -> 2).
    assert re.search(r"pipetransformer: a new plan at step 2: 2 layers frozen, 4 stages x 1 "
                     r"replicas", err), err
    assert re.search(r"pipetransformer: a new plan at step 4: 3 layers frozen, 2 stages x 1 "
                     r"replicas", err), err
    bar = re.findall(r"^train (\d)/5 loss +(\S+) +(\S+) samples/s$", err, re.M)
    assert [step for step, _, _ in bar] == ["1", "2", "3", "4", "5"], err
    assert all(loss != "-" for _, loss, _ in bar), err


@pytest.mark.timeout(120)
def test_the_cache_directories_go_when_a_script_ends_without_close(tmp_path):
    # Outside polytrain launch (a script torchrun starts, as the README's step API) the
    # machine's /dev/shm directory was removed by close() alone: a script that ends without
    # it left the cached activations in host memory. So did the disk tier's directory in
    # /tmp (--cache-mb 0 spills every entry there), until a review.
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, polytrain\n"
        "from polytrain.models import GPT, cross_entropy\n"
        "polytrain.init()\n"
        "torch.manual_seed(0)\n"
        "model = GPT(seq_len=16, d_model=32, layers=4)\n"
        "trainer = polytrain.distribute(model, torch.optim.Adam(model.parameters()),\n"
        "    strategy='pipetransformer', loss_fn=cross_entropy, freeze_every=2,\n"
        "    freeze_threshold=100.0, freeze_alpha=0.5, cache_mb=0)\n"
        "x = torch.randint(0, 256, (8, 17))\n"
        "for _ in range(4):\n"
        "    trainer.step(x[:, :-1], x[:, 1:])\n"
        "print(trainer.strategy.cache.stats.disk_entries, trainer.strategy.cache._dir)\n"
        "print(trainer.strategy.shared_cache)\n")
    done = torchrun(script, "worker")
    assert done.returncode == 0, done.stderr[-3000:]
    entries, disk = done.stdout.strip().splitlines()[-2].split()
    shared = Path(done.stdout.strip().splitlines()[-1])
    try:
        assert int(entries) > 0 and Path(disk).name.startswith("polytrain-cache-")
        assert not Path(disk).exists()
        assert shared.name.startswith("polytrain-autocache-") and not shared.exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def test_the_shared_cache_directory_stays_while_another_of_its_users_runs(tmp_path,
                                                                          monkeypatch):
    # A worker that ended first (an idle one, without AutoDP) removed the machine's shared
    # directory while the first stages still published to it: they turned it off.
    import json as json_

    from polytrain.launch.network import owner_record, start_time
    from polytrain.strategies.pipetransformer import strategy as module
    shared = tmp_path / "polytrain-autocache-x-node0"
    shared.mkdir()
    (shared / "entry.pt").write_bytes(b"x")
    (shared / f"{module._USER}{os.getpid()}").write_text(json_.dumps(owner_record()))
    other = shared / f"{module._USER}{os.getppid()}"  # a live process: this one's parent
    other.write_text(json_.dumps({**owner_record(), "pid": os.getppid(),
                                  "start": start_time(os.getppid())}))
    module._leave_shared(shared)
    assert (shared / "entry.pt").exists()
    other.unlink()  # the other user left too: the last one out removes it
    module._leave_shared(shared)
    assert not shared.exists()
    # Two users leaving at once: one removed the directory while the other listed it; that
    # one's glob raised FileNotFoundError (a long-tier run failed at close()). It leaves.
    shared.mkdir()

    def removed_meanwhile(self, pattern):
        raise FileNotFoundError(2, "No such file or directory", str(self))
    monkeypatch.setattr(type(shared), "glob", removed_meanwhile)
    module._leave_shared(shared)


def test_a_resume_that_trains_no_step_keeps_the_runs_timeline_and_cache_counts():
    # A restart from a checkpoint at the run's last step (--max-restarts, a worker lost in
    # the final gather) trains no step, and the records came back only with the first step's
    # plan: its metrics.json had no freeze timeline and no cache counts.
    import types

    from polytrain.strategies.pipetransformer.strategy import PipeTransformer
    ctx = types.SimpleNamespace(num_workers=1, worker_index=0)
    strategy = PipeTransformer(ctx, PipeTransformerOptions(freeze_every=2))
    served = {"hits": 3, "shared_hits": 1, "misses": 48, "advanced": 2}
    timeline = [{"step": 0, "frozen": 0}, {"step": 2, "frozen": 1}]
    strategy.load_checkpoint_state({"served": served, "timeline": timeline, "plan": None})
    assert (strategy.timeline, strategy._served) == (timeline, served)


def test_a_save_before_the_first_step_keeps_the_state_load_gave():
    # Symptom: a save made after polytrain.load() but before the first step kept no plan,
    # timeline, tracker, stage optimizer state or cache counts: a run resumed from it ended
    # 0.0155 off the uninterrupted run (0.0 from the checkpoint loaded). Cause:
    # checkpoint_state() gave {} until the first step installed the plan, and passed over
    # the loaded state waiting for that step.
    import types

    from polytrain.strategies.pipetransformer.strategy import PipeTransformer
    ctx = types.SimpleNamespace(num_workers=1, worker_index=0)
    strategy = PipeTransformer(ctx, PipeTransformerOptions(freeze_every=2))
    saved = {"plan": "the plan", "timeline": [{"step": 0, "frozen": 0}, {"step": 2, "frozen": 1}],
             "tracker": "the tracker", "planned": 2, "next_mb": 12,
             "stage_optimizer": {"h1.weight": {"step": 3.0}}, "source": None,
             "layer_seconds": [(1e-3, 2e-3)] * 6,
             "served": {"hits": 3, "shared_hits": 1, "misses": 48, "advanced": 2}}
    strategy.load_checkpoint_state(saved)
    assert strategy.checkpoint_state() == saved
