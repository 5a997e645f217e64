"""The stage engine across processes: synchronous schedules and HetPipe's asynchronous one."""

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.func import functional_call

import polytrain
from polytrain.emulation.profile import layers_of, profile_model
from polytrain.models import GPT
from polytrain.models import cross_entropy as loss_fn
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
