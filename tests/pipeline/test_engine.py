"""The stage engine across processes: synchronous schedules and HetPipe's asynchronous one."""

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.func import functional_call

import polytrain
from polytrain.emulation.profile import layers_of, profile_model
from polytrain.errors import CommTimeout, PeerLost
from polytrain.models import GPT
from polytrain.models import cross_entropy as loss_fn
from polytrain.pipeline.assembly import make_stage as assembled_stage
from polytrain.pipeline.asyncpipe import AsyncPipeline
from polytrain.pipeline.schedule import asynchronous
from polytrain.pipeline.stage import Stage, StageSpec
from polytrain.pipeline.sync import SyncPipeline
from tests.harness import spawn
from tests.pipeline.test_schedule import run_to_completion

BOUNDS = (0, 2, 4)  # embed h0 | h1 head
LR = 0.1


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(seq_len=16, d_model=32, layers=2, heads=2)


def data(count: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        w = torch.randint(0, 256, (batch, 17), generator=gen)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def make_stage(ctx, model: nn.Module) -> Stage:
    j = ctx.worker_index
    layers = layers_of(model)
    profile = profile_model(model, torch.zeros(1, 16, dtype=torch.long))
    a, e = BOUNDS[j], BOUNDS[j + 1]
    spec = StageSpec(index=j, count=2, prev=None if j == 0 else 0, next=1 if j == 0 else None,
                     label=f"stage {j}", prev_label="stage 0", next_label="stage 1",
                     input_shape=profile.layers[a - 1].out_shape if j else (16,),
                     input_dtype=torch.float32 if j else torch.long)
    return Stage(spec, nn.Sequential(OrderedDict(layers[a:e])), ctx.transport, loss_fn=loss_fn)


def sync_step(schedule: str) -> dict:
    ctx = polytrain.init()
    model = tiny_model()
    stage = make_stage(ctx, model)
    pipe = SyncPipeline(stage, schedule=schedule, microbatches=4)
    (x, y), = data(1, 8)
    loss = pipe.step(x, y)
    stage.close()
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in stage.module.named_parameters()}}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synchronous_pipeline_gives_the_gradients_of_the_whole_model(schedule):
    first, last = spawn(sync_step, workers=2, args=(schedule,))
    model = tiny_model()
    (x, y), = data(1, 8)
    loss = loss_fn(model(x), y)
    loss.backward()
    assert first["loss"] is None and last["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    grads = {**first["grads"], **last["grads"]}
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-6), n


def async_run(inflight: int, count: int, lag_lr: float = 1.0) -> dict:
    ctx = polytrain.init()
    model = tiny_model()
    stage = make_stage(ctx, model)
    opt = torch.optim.SGD(stage.params, lr=LR)
    pipe = AsyncPipeline(stage, opt, inflight=inflight, lag_lr=lag_lr)
    losses = [pipe.feed(x, y) for x, y in data(count, 4)]
    pipe.drain()
    stage.close()
    return {"losses": losses,
            "state": {n: p.detach().clone() for n, p in stage.module.named_parameters()}}


def reference(inflight: int, count: int,
              lrs: tuple[float, float] = (LR, LR)) -> tuple[dict, list[float]]:
    """PipeDream semantics in one process, written out: stashed versions, SGD per minibatch
    (stage ``j`` at learning rate ``lrs[j]``)."""
    model = tiny_model()
    layers = layers_of(model)
    stages = [nn.Sequential(OrderedDict(layers[a:e])) for a, e in zip(BOUNDS, BOUNDS[1:])]
    live = [{n: p.detach().clone() for n, p in s.named_parameters()} for s in stages]
    batches = data(count, 4)
    saved: dict = {}
    grad_in: dict = {}
    losses = [0.0] * count
    for j, action in run_to_completion(asynchronous(2, inflight, count)):
        m = int(action[1:])
        if action[0] == "F":
            weights = {n: t.clone().requires_grad_() for n, t in live[j].items()}
            x = batches[m][0] if j == 0 else saved[(0, m)][2].detach().requires_grad_()
            out = functional_call(stages[j], weights, (x,))
            if j == 1:
                out = loss_fn(out, batches[m][1])
                losses[m] = float(out.detach())
            saved[(j, m)] = (weights, x, out)
        else:
            weights, x, out = saved.pop((j, m))
            names = list(weights)
            inputs = [weights[n] for n in names] + ([x] if j == 1 else [])
            grads = torch.autograd.grad([out], inputs, None if j == 1 else [grad_in.pop(m)])
            if j == 1:
                grad_in[m] = grads[-1]
            for n, g in zip(names, grads):
                live[j][n] = live[j][n] - lrs[j] * g
    return {**live[0], **live[1]}, losses


@pytest.mark.timeout(90)
def test_asynchronous_pipeline_stashes_weights_and_updates_per_minibatch():
    inflight, count = 3, 7
    first, last = spawn(async_run, workers=2, args=(inflight, count))
    expected, losses = reference(inflight, count)
    got = {**first["state"], **last["state"]}
    assert sorted(got) == sorted(expected)
    for n in expected:
        assert torch.allclose(got[n], expected[n], atol=1e-6), n
    assert last["losses"] == pytest.approx(losses, abs=1e-5)
    assert first["losses"] == [None] * count
    # Staleness matters: the same minibatches one at a time end elsewhere.
    sequential, _ = reference(1, count)
    assert max(float((got[n] - sequential[n]).abs().max()) for n in got) > 1e-4


def adam_run(lag_beta2: float | None, first_beta2: float = 0.999) -> dict:
    ctx = polytrain.init()
    stage = make_stage(ctx, tiny_model())
    beta2 = first_beta2 if ctx.worker_index == 0 else 0.999
    opt = torch.optim.Adam(stage.params, lr=1e-2, betas=(0.9, beta2))
    pipe = AsyncPipeline(stage, opt, inflight=2, lag_beta2=lag_beta2)
    for x, y in data(6, 4):
        pipe.feed(x, y)
    pipe.drain()
    stage.close()
    return {n: p.detach().clone() for n, p in stage.module.named_parameters()}


@pytest.mark.timeout(120)
def test_a_late_stage_keeps_adams_second_moment_with_the_lag_beta2():
    # N_m = 2: the first stage's gradients arrive late, so its Adam runs with beta2 =
    # lag_beta2, as if built so; the last stage's arrive at once and keep the optimizer's.
    lagged = spawn(adam_run, workers=2, args=(0.9,))
    built = spawn(adam_run, workers=2, args=(None, 0.9))
    for got, want in zip(lagged, built):
        for n in want:
            assert torch.allclose(got[n], want[n], atol=1e-6), n
    plain = spawn(adam_run, workers=2, args=(None,))
    assert max(float((lagged[0][n] - plain[0][n]).abs().max()) for n in plain[0]) > 1e-4


@pytest.mark.timeout(90)
def test_a_late_stage_steps_with_the_lag_learning_rate():
    # N_m = 2 on two stages: the first stage's gradients arrive one update late, so it steps
    # with lag_lr x the learning rate; the last stage's arrive at once and keep it.
    first, last = spawn(async_run, workers=2, args=(2, 6, 0.5))
    expected, _ = reference(2, 6, lrs=(LR * 0.5, LR))
    got = {**first["state"], **last["state"]}
    for n in expected:
        assert torch.allclose(got[n], expected[n], atol=1e-6), n
    full, _ = reference(2, 6)
    assert max(float((got[n] - full[n]).abs().max()) for n in got) > 1e-4


def two_stage_pipeline(ctx, model: nn.Module, sample: torch.Tensor, bounds=(0, 2, 4)) -> Stage:
    """This process's stage of ``model`` cut at ``bounds``, built as the strategies build it
    (:func:`polytrain.pipeline.assembly.make_stage`, from the profile of ``sample``)."""
    profile = profile_model(model, sample)
    return assembled_stage(model, bounds, ctx.worker_index, ranks=[0, 1],
                           labels=["stage 0", "stage 1"], links=[0.0], profile=profile,
                           transport=ctx.transport, loss_fn=loss_fn)


def inputs_that_change(kind: str) -> list[str]:
    ctx = polytrain.init()
    model = tiny_model()
    (x, y), = data(1, 4)
    stage = two_stage_pipeline(ctx, model, x)
    if kind == "sync":
        sync = SyncPipeline(stage, schedule="1f1b", microbatches=2)
        run = sync.step
    else:
        run = AsyncPipeline(stage, torch.optim.SGD(stage.params, lr=LR), inflight=1).feed
    run(x, y)
    refusals = []
    for other in (x[:, :12], x.to(torch.int32)):  # a shorter sequence, another dtype
        try:
            run(other, y[:, :other.shape[1]])
        except polytrain.ConfigError as e:
            refusals.append(str(e))
    run(x, y)  # refused before any message: the pipeline goes on
    stage.close()
    return refusals


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_inputs_of_another_shape_or_dtype_than_the_first_steps_are_refused_on_every_stage(kind):
    # A shorter sequence at step 2 gave a cross_entropy batch mismatch on the last stage (or
    # trained on an uninitialised buffer), a longer one crashed gloo (SIGABRT): the stages
    # after the first receive into buffers of the shapes profiled at the first step.
    for rank, refusals in enumerate(spawn(inputs_that_change, workers=2, args=(kind,))):
        assert len(refusals) == 2, (rank, refusals)
        assert f"stage {rank}: pipeline stages take inputs of the first step's shape " \
               f"(batch, 16) and dtype torch.int64" in refusals[0]
        assert "not (batch, 12) torch.int64" in refusals[0]
        assert "not (batch, 16) torch.int32" in refusals[1]
        assert "HINT: pad to a fixed length" in refusals[0]


class Bucket(nn.Module):
    """Float features to token ids: an integer activation at a cut."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs() * 100).long() % 64


def bucketed_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(lin=nn.Linear(4, 4), bucket=Bucket(),
                                     embed=nn.Embedding(64, 8), head=nn.Flatten()))


def squared_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.sum(1) - y) ** 2).mean()


def integer_cut() -> dict:
    ctx = polytrain.init()
    model = bucketed_model()
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.randn(4)
    profile = profile_model(model, x)
    stage = assembled_stage(model, (0, 2, 4), ctx.worker_index, ranks=[0, 1],
                            labels=["stage 0", "stage 1"], links=[0.0], profile=profile,
                            transport=ctx.transport, loss_fn=squared_error)
    SyncPipeline(stage, schedule="1f1b", microbatches=2).step(x, y)
    stage.close()
    return {n: None if p.grad is None else p.grad.clone()
            for n, p in stage.module.named_parameters()}


@pytest.mark.timeout(60)
def test_a_cut_at_an_integer_activation_sends_and_waits_for_no_gradient():
    # Stage 0 waited out the timeout for a gradient and blamed a healthy stage 1: the
    # receiving stage marks only floating-point inputs as requiring grad and sends none
    # back for token ids, but the sending stage's backward always posted the receive.
    first, last = spawn(integer_cut, workers=2)
    model = bucketed_model()
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.randn(4)
    squared_error(model(x), y).backward()
    assert model.lin.weight.grad is None  # no gradient flows through the ids
    # ... and none is made up: a zero gradient was stepped where one process skips the
    # weight (weight decay and momentum moved it).
    assert first == {"lin.weight": None, "lin.bias": None}
    assert torch.allclose(last["embed.weight"], model.embed.weight.grad, atol=1e-6)
    assert last["embed.weight"].any()


class _Failing:
    """A transport whose every message fails with ``error``."""

    timeout_s = 1.0

    def __init__(self, error: Exception) -> None:
        self.error = error

    def irecv(self, *args, **kwargs):
        raise self.error

    def isend(self, *args, **kwargs):
        raise self.error


@pytest.mark.timeout(20)
def test_a_stages_errors_keep_the_wait_and_the_lost_peer():
    # A stage's error named the stage but dropped CommTimeout.waited_s and PeerLost.peer
    # (rebuilt as type(e)(what, hint)): the launcher words and dates a failure from them.
    def spec(index: int) -> StageSpec:
        return StageSpec(index=index, count=2, prev=0 if index else None,
                         next=None if index else 1, label=f"stage {index}",
                         prev_label="stage 0", next_label="stage 1", input_shape=(4,))

    receiving = Stage(spec(1), nn.Linear(4, 4), _Failing(CommTimeout("no answer", "wait longer",
                                                                     waited_s=12.5)),
                      loss_fn=squared_error)
    with pytest.raises(CommTimeout) as timeout:
        receiving.forward(0, batch=2, targets=torch.zeros(2))
    assert timeout.value.waited_s == 12.5 and timeout.value.hint == "wait longer"
    assert timeout.value.what == ("stage 1: receiving the activations of minibatch 0 from/to "
                                  "stage 0: no answer")
    receiving.close()
    sending = Stage(spec(0), nn.Linear(4, 4), _Failing(PeerLost("gone", peer=3)),
                    loss_fn=squared_error)
    sending.forward(0, batch=2, inputs=torch.zeros(2, 4))
    with pytest.raises(PeerLost) as lost:
        sending.close()
    assert lost.value.peer == 3 and lost.value.what.startswith("stage 0: sending")
