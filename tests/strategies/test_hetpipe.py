"""HetPipe end to end: transparency at D = 0 and N_m = 1, convergence, refusals, failures."""

import functools
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch

import polytrain
from polytrain import ConfigError, LaunchError, TrainConfig
from polytrain.emulation.profile import profile_model
from polytrain.models import GPT
from polytrain.models import cross_entropy as loss_fn
from tests.harness import Sleepy, adam_tolerance, max_abs_diff, run_config, single_of, spawn
from tests.strategies.hetpipe_reference import simulate

TINY = {"seq_len": 16, "d_model": 32, "layers": 2}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["np", "ed"])
def test_wsp_with_no_staleness_and_one_in_flight_is_synchronous_sgd(policy):
    # Two virtual workers of two stages: each stage pushes its update every minibatch and
    # waits for the other virtual worker's, so the weights follow single's SGD exactly.
    config = TrainConfig(strategy="hetpipe", workers=4, nodes=2, servers=1, steps=6,
                         batch_size=8, optimizer="sgd", lr=0.05, model_options=TINY,
                         strategy_options={"policy": policy, "inflight": 1, "staleness": 0})
    _, single = run_config(single_of(config))
    metrics, hetpipe = run_config(config)
    assert list(hetpipe) == list(single)
    assert max_abs_diff(single, hetpipe) < 1e-6
    _, untrained = run_config(single_of(config).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 1e-4
    single_metrics, _ = run_config(single_of(config))
    assert metrics["losses"] == pytest.approx(single_metrics["losses"], abs=1e-5)


@pytest.mark.long
@pytest.mark.timeout(180)
def test_the_servers_optimizer_makes_adam_synchronous_too():
    # With Adam, each virtual worker's own optimizer (the paper) is not synchronous training:
    # Adam of a sum is not the sum of Adams. The servers' optimizer steps on the sum of the
    # virtual workers' gradients, so D = 0 and N_m = 1 follow single's Adam.
    config = TrainConfig(strategy="hetpipe", workers=4, nodes=2, servers=2, steps=6,
                         batch_size=8, optimizer="adam", lr=3e-3, model_options=TINY,
                         strategy_options={"policy": "ed", "inflight": 1, "staleness": 0})
    _, single = run_config(single_of(config))
    _, hetpipe = run_config(config)
    # As ddp's test: Adam divides by the gradients' size, which turns float rounding in
    # gradients near zero into differences of ~1e-6 (about a thousandth of own optimizers').
    assert max_abs_diff(single, hetpipe) < adam_tolerance(3e-3, 6)
    paper = config.replace(strategy_options={**config.strategy_options,
                                             "server_optimizer": False})
    _, own = run_config(paper)
    assert max_abs_diff(single, own) > 1e-3


@pytest.mark.long  # (moved to the long tier to keep CI short)
@pytest.mark.timeout(240)
def test_a_learning_rate_schedule_reaches_every_stage_and_the_servers():
    # The schedule is a scheduler on the user's optimizer: each minibatch's update, on the
    # stages and on the servers (whose pushes carry each round's settings), uses the
    # learning rate of its step, so D = 0, N_m = 1 still equals single, with Adam on the
    # servers and with SGD on each virtual worker's own optimizer.
    for optimizer, lr, server_optimizer in (("adam", 3e-3, True), ("sgd", 0.05, False)):
        config = TrainConfig(strategy="hetpipe", workers=4, nodes=2, servers=1, steps=6,
                             batch_size=8, optimizer=optimizer, lr=lr, model_options=TINY,
                             lr_schedule="cosine", warmup_steps=2,
                             strategy_options={"policy": "ed", "inflight": 1, "staleness": 0,
                                               "server_optimizer": server_optimizer})
        _, single = run_config(single_of(config))
        _, hetpipe = run_config(config)
        assert max_abs_diff(single, hetpipe) < 1e-5, optimizer
        _, constant = run_config(single_of(config).replace(lr_schedule="constant",
                                                           warmup_steps=0))
        assert max_abs_diff(single, constant) > 1e-3, optimizer


@pytest.mark.timeout(180)
def test_bd_twins_with_no_staleness_are_synchronous_adam_on_the_global_batch():
    # Policy bd: each device runs a stage of two virtual workers going opposite ways, each
    # on its own copy of the weights with one minibatch in flight. Here the fast device
    # holds h1 and h2 in both of its stages, so one process pushes the same keys for two
    # virtual workers. With D = 0 the run is still synchronous Adam on the global batch.
    config = TrainConfig(strategy="hetpipe", devices="m0:fast,m1:slow", workers=2, nodes=2,
                         servers=1, steps=6, batch_size=8, optimizer="adam", lr=3e-3,
                         model_options={**TINY, "layers": 4},
                         strategy_options={"policy": "bd", "staleness": 0})
    plan = config.plan_summary()
    assert "virtual worker 0: m1/0 slow -> m0/0 fast" in plan
    assert "layers h1..head" in plan and "layers embed..h2" in plan  # both on m0/0
    _, single = run_config(single_of(config))
    metrics, hetpipe = run_config(config)
    assert max_abs_diff(single, hetpipe) < adam_tolerance(3e-3, 6)
    single_metrics, _ = run_config(single_of(config))
    assert metrics["losses"] == pytest.approx(single_metrics["losses"], abs=1e-5)


def grouped_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    # The usual GPT recipe: weight decay on matrices only, here also another lr for the rest.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0, "lr": 2e-3}], lr=3e-3)


def script_batches(steps: int):
    """A script's own batches (inputs, targets) of 8 random sequences."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        w = torch.randint(0, 256, (8, 17), generator=gen)
        yield w[:, :-1], w[:, 1:]


def hetpipe_final(trainer: polytrain.Trainer) -> dict:
    """A script's end: the gathered weights (``final.pt``'s), then the strategy closed."""
    state = trainer.state_dict()
    trainer.close()
    return state


def train_script(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
                 distributed: bool, schedule: bool = False,
                 last: Callable[[polytrain.Trainer], None] | None = None,
                 first: Callable[[], None] | None = None) -> dict:
    """A script's loop on ``script_batches``: through hetpipe's step API (policy ed, D = 0,
    N_m = 1) on the global batches, or in one process; with ``schedule``, a LambdaLR on the
    optimizer it steps (torch's warning that it stepped before the optimizer is an error:
    it was false under hetpipe, whose stages step optimizers of their own). ``first`` runs
    after distribute() and before the first step; ``last`` is given the trainer after the
    loop. Returns the final weights."""
    if distributed:  # the step API, on global batches
        trainer = polytrain.distribute(model, opt, strategy="hetpipe", loss_fn=loss_fn,
                                       policy="ed", inflight=1, staleness=0)
        opt = trainer.optimizer
    if first is not None:
        first()
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"Detected call of `lr_scheduler")
        for x, y in script_batches(steps):
            if distributed:
                trainer.step(x, y)
            else:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
            if lr is not None:
                lr.step()
    if distributed and last is not None:
        last(trainer)
    return hetpipe_final(trainer) if distributed else model.state_dict()


def readme_loop_left_open(steps: int) -> float | None:
    """README's step-API loop with Adam, but the trainer never closed: the script ends."""
    polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    trainer = polytrain.distribute(model, torch.optim.Adam(model.parameters(), lr=2e-3),
                                   strategy="hetpipe", loss_fn=loss_fn)
    loss = None
    for x, y in script_batches(steps):
        loss = trainer.step(x, y)
    return loss


@pytest.mark.timeout(120)
def test_a_script_that_leaves_its_trainer_open_ends_well():
    # Symptom: README's step-API loop under hetpipe, which ended without trainer.close(),
    # failed a --timeout late: "shutdown at exit failed ... leaving the run" and "worker
    # rank 1 ... ended its script 120.4 s before server rank 4 lost a peer". Cause: only
    # polytrain train closed its trainer; the last minibatches in flight held the servers'
    # FINISH. (Closed from the exit hooks, it failed: the executors had stopped by then.)
    losses = spawn(readme_loop_left_open, workers=4, nodes=2, servers=1, args=(2,))
    assert sum(isinstance(loss, float) for loss in losses) == 2, losses  # the last stages'


def plan_costed(costs: str) -> tuple:
    """Virtual worker 0's cuts of the GPT with a sleepy layer after its embedding."""
    polytrain.init()
    torch.manual_seed(0)
    gpt = GPT(**TINY)
    model = torch.nn.Sequential(gpt.embed, Sleepy(32), gpt.h0, gpt.h1, gpt.head)
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                   strategy="hetpipe", loss_fn=loss_fn, policy="ed",
                                   inflight=1, staleness=0, layer_costs=costs)
    for x, y in script_batches(2):
        trainer.step(x, y)
    bounds = trainer.strategy.plan.pipelines[0].bounds
    trainer.close()
    return bounds


@pytest.mark.timeout(180)
def test_measured_layer_costs_cut_where_the_time_is():
    # Two stages per virtual worker: by FLOPs the sleepy layer is nearly free and shares a
    # stage with a block; timed, it is the slowest layer by far, and the cut isolates it
    # with the cheap embedding.
    by_flops = spawn(plan_costed, workers=4, nodes=2, servers=1, args=("flops",))[0]
    by_time = spawn(plan_costed, workers=4, nodes=2, servers=1, args=("measured",))[0]
    assert by_time == (0, 2, 5) != by_flops


@pytest.mark.timeout(150)
def test_polytrain_train_prints_and_records_the_plan_of_measured_layer_costs(capfd, tmp_path):
    # With --layer-costs measured the plan printed before training was the FLOPs one, not
    # the run's: the stages re-planned from the measured times at the first step and only
    # logged it at INFO (hidden at the default WARNING), and metrics.json kept no cuts, no
    # N_m and no measured costs.
    from polytrain.cli import main

    out = tmp_path / "run"
    assert main(["train", "--strategy", "hetpipe", "--devices", "m0:fast*2,m1:slow*2",
                 "--servers", "1", "--policy", "ed", "--steps", "2", "--batch-size", "8",
                 "--seq-len", "16", "--d-model", "32", "--layers", "2", "--heads", "2",
                 "--layer-costs", "measured", "--timeout", "60", "--out", str(out)]) == 0
    err = capfd.readouterr().err
    before, _, after = err.partition("hetpipe: the plan from the layers' measured times")
    assert after, err  # printed once the first step has measured them
    assert "the run re-plans the cuts and N_m from the layers' times measured at its first " \
           "step" in before, err
    m = json.loads((out / "metrics.json").read_text())
    plan = m["hetpipe_plan"]
    assert plan["policy"] == "ed" and plan["minibatch"] == 4
    assert f"N_m = {plan['inflight']} (local staleness" in after
    assert len(plan["virtual_workers"]) == 2
    for vw in plan["virtual_workers"]:
        assert vw["devices"] == [f"m1/{vw['index']} slow", f"m0/{vw['index']} fast"]
        assert vw["bounds"][0] == 0 and vw["bounds"][-1] == 4 and len(vw["bounds"]) == 3
        assert len(vw["layers"]) == len(vw["stage_times_ms"]) == 2
        for span, ms in zip(vw["layers"], vw["stage_times_ms"]):
            assert re.search(rf"layers {re.escape(span)} +{ms:.1f} ms", after), after
    assert list(m["layer_costs_ms"]) == ["embed", "h0", "h1", "head"]
    assert all(t["forward_ms"] > 0 and t["backward_ms"] > 0
               for t in m["layer_costs_ms"].values())


def train_grouped(steps: int, distributed: bool) -> dict | None:
    if distributed:
        polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    return train_script(model, grouped_adamw(model), steps, distributed, schedule=True)


@pytest.mark.timeout(120)
def test_the_servers_optimizer_keeps_each_parameter_groups_settings_and_schedule():
    # Each key's optimizer on the servers is built from the group that holds its tensor, and
    # every round carries that group's settings of the round: D = 0, N_m = 1 equals one
    # process running the same script.
    states = spawn(train_grouped, workers=4, nodes=2, servers=1, args=(5, True))
    single = train_grouped(5, False)
    assert max_abs_diff(single, states[0]) < 1e-5
    torch.manual_seed(0)
    untrained = GPT(**TINY).state_dict()
    assert max_abs_diff(single, untrained) > 1e-3


def train_frozen(steps: int, distributed: bool, everything: bool) -> dict | tuple[dict, list[str]]:
    """AdamW with weight decay on a GPT whose embedding and first block are frozen; the
    optimizer gets the trained parameters only, frozen before it, or (``everything``)
    model.parameters(), frozen after distribute() and before the first step.
    Distributed, also the refusals of :func:`change_requires_grad` after the loop."""
    if distributed:
        polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    front = [p for name, p in model.named_parameters() if name.split(".")[0] in ("embed", "h0")]

    def freeze() -> None:
        for p in front:
            p.requires_grad_(False)

    if not everything:
        freeze()
    params = model.parameters() if everything else [p for p in model.parameters()
                                                     if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    refused: list[str] = []
    state = train_script(model, opt, steps, distributed, first=freeze if everything else None,
                         last=functools.partial(change_requires_grad, model, refused))
    return (state, refused) if distributed else state


def change_requires_grad(model: torch.nn.Module, refused: list[str],
                         trainer: polytrain.Trainer) -> None:
    """A step after freezing a trained parameter, then one after unfreezing a frozen one,
    each put back after it; the refusals go to ``refused``."""
    x, y = next(script_batches(1))
    for name in ("head.out.weight", "embed.tok.weight"):
        p = model.get_parameter(name)
        p.requires_grad_(not p.requires_grad)
        try:
            trainer.step(x, y)
        except ConfigError as e:
            refused.append(str(e))
        p.requires_grad_(not p.requires_grad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("everything", [False, True], ids=["trained", "all"])
def test_frozen_parameters_stay_as_they_are_and_the_rest_trains_as_in_one_process(everything):
    # Fine-tuning with a frozen front: an optimizer of the trained parameters only was
    # refused ("give the optimizer every parameter ..., or set requires_grad=False on the
    # others", which they were); one of every parameter had the servers step the frozen ones
    # with zero gradients, and AdamW's weight decay moved them. Frozen after distribute() and
    # before the first step (with every parameter), it was refused as a change after the
    # wrap, though the stages and servers are built at the first step and follow it.
    single = train_frozen(4, False, everything)
    results = spawn(train_frozen, workers=4, nodes=2, servers=1, args=(4, True, everything))
    hetpipe = results[0][0]
    assert max_abs_diff(single, hetpipe) < 1e-5
    # A parameter frozen or unfrozen after the first step was not followed: the stages and the
    # servers fix what trains at the first step (unfrozen, it never trained on the servers,
    # 0.0218 off one process; frozen, Adam's momentum moved it on). Every stage refuses the
    # step, naming it; the refused steps trained nothing (the weights above are single's).
    hint = ("HINT: set requires_grad before the first trainer.step(); to change it later, save "
            "trainer.state_dict() and distribute a new model that loads it")
    assert all(r[1] == [
        f"parameter 'head.out.weight' was frozen (requires_grad=False) after the first step: "
        f"hetpipe's stages and servers train the parameters that were trained then, and would "
        f"go on training it. {hint}",
        f"parameter 'embed.tok.weight' was unfrozen (requires_grad=True) after the first step: "
        f"hetpipe's stages and servers train the parameters that were trained then, and would "
        f"not train it. {hint}"] for r in results)
    torch.manual_seed(0)
    untrained = GPT(**TINY).state_dict()
    frozen = [k for k in untrained if k.split(".")[0] in ("embed", "h0")]
    assert frozen and all(torch.equal(hetpipe[k], untrained[k]) for k in frozen)
    assert not torch.equal(hetpipe["head.out.weight"], untrained["head.out.weight"])


def train_with_a_stage_of_no_parameters(steps: int, distributed: bool,
                                        options: dict | None = None,
                                        before: int = 0) -> dict | None:
    """Three devices for three layers, the middle one a ReLU: a stage with no parameter
    (hetpipe ``options`` beside the synchronous defaults). With ``before``, Adam (not SGD)
    takes that many of the ``steps`` in the script's own process before ``distribute``."""
    if distributed:
        polytrain.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = (torch.optim.Adam(model.parameters(), lr=0.05) if before
           else torch.optim.SGD(model.parameters(), lr=0.1))
    mse = torch.nn.functional.mse_loss
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen))
               for _ in range(steps)]
    for i, (x, y) in enumerate(batches):
        if distributed and i == before:
            trainer = polytrain.distribute(model, opt, strategy="hetpipe", loss_fn=mse,
                                           **{"policy": "np", "inflight": 1, "staleness": 0,
                                              **(options or {})})
        if distributed and i >= before:
            trainer.step(x, y)
        else:
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
    if distributed:
        assert tuple(trainer.strategy.plan.pipelines[0].bounds) == (0, 1, 2, 3)  # ReLU alone
    return hetpipe_final(trainer) if distributed else model.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [{}, {"server_optimizer": False}, {"staleness": 1}])
def test_a_stage_of_parameter_free_layers_passes_its_activations_on(options):
    # A ReLU alone on a device: torch's "optimizer got an empty parameter list" at the first
    # step; where the stage makes updates of its own (all but the servers' optimizer with
    # D = 0, N_m = 1), "Tensor list must have at least one tensor" at its first update.
    # One virtual worker, one in flight: every setting trains as one process.
    single = train_with_a_stage_of_no_parameters(3, False)
    hetpipe = spawn(train_with_a_stage_of_no_parameters, workers=3, servers=1,
                    args=(3, True, options))[0]
    assert max_abs_diff(single, hetpipe) < 1e-6


@pytest.mark.timeout(120)
def test_the_servers_optimizer_goes_on_from_the_state_the_script_gave_distribute():
    # Adam's moments and step count of the script's own steps before distribute reach the
    # servers' optimizer (it started afresh: 0.029 off the one process running on).
    single = train_with_a_stage_of_no_parameters(4, False, before=2)
    hetpipe = spawn(train_with_a_stage_of_no_parameters, workers=3, servers=1,
                    args=(4, True, None, 2))[0]
    assert max_abs_diff(single, hetpipe) < 1e-6
    torch.manual_seed(0)
    untrained = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2)).state_dict()
    assert max_abs_diff(single, untrained) > 1e-2


@pytest.mark.timeout(120)
def test_many_in_flight_with_no_staleness_follows_the_written_out_semantics():
    # N_m = 2, D = 0, two VWs of two stages: stashed weights, an update per minibatch,
    # a barrier and the global weights every wave; compared with a one-process rendering
    # of the paper's semantics (no weight prediction).
    steps, lr, batch = 12, 0.5, 8
    config = TrainConfig(strategy="hetpipe", workers=4, nodes=2, servers=1, steps=steps,
                         batch_size=batch, optimizer="sgd", lr=lr, model_options=TINY,
                         strategy_options={"policy": "np", "inflight": 2, "staleness": 0,
                                           "predict": False, "server_optimizer": False,
                                           "lag_lr": 1.0})
    metrics, state = run_config(config)
    expected, losses = simulate(model_options=TINY, bounds=(0, 2, 4), vws=2, inflight=2,
                                steps=steps, lr=lr, batch=batch)
    assert list(state) == list(expected)
    assert max_abs_diff(state, expected) < 1e-5
    assert metrics["losses"] == pytest.approx(losses, abs=1e-5)
    _, synchronous = run_config(single_of(config))
    assert max_abs_diff(state, synchronous) > 1e-4  # N_m = 2 is not synchronous SGD


@pytest.mark.timeout(180)
def test_virtual_workers_cut_differently_push_each_layer_with_the_same_settings():
    # Symptom: on the paper's kind of cluster (machines of different types, policy hd) the
    # servers stopped the run at the first wave: "the pushers disagree on the optimizer's
    # settings". h1 is on a late stage (lr x --lag-lr, Adam's beta2 --lag-beta2) in virtual
    # worker 2 only, and each pushed its own stage's settings for it. A layer late in any
    # virtual worker is now pushed with the late settings by all.
    config = TrainConfig(strategy="hetpipe", devices="m0:fast*2,m1:slow*2,m2:fast*2",
                         servers=1, steps=4, batch_size=12, optimizer="adam", lr=3e-3,
                         model_options={**TINY, "layers": 3},
                         strategy_options={"policy": "hd", "inflight": 2})
    firsts = [line.split("layers")[1].split()[0] for line in config.plan_summary().splitlines()
              if "stage 0 on" in line]
    assert firsts == ["embed..h0", "embed..h0", "embed..h1"]
    metrics, state = run_config(config)
    assert len(metrics["losses"]) == 4
    assert all(bool(torch.isfinite(t).all()) for t in state.values())


def late_settings_per_layer() -> list[tuple[int, int, float, dict[str, int]]]:
    """Per stage of this process: its virtual worker, index, own learning-rate factor, and
    per layer it pushes whether the servers step it with the late settings."""
    from polytrain.emulation.devices import parse_cluster

    ctx = polytrain.init()
    ctx.cluster = parse_cluster("m0:fast*2,m1:slow*2,m2:fast*2")
    torch.manual_seed(0)
    model = GPT(**{**TINY, "layers": 3})
    trainer = polytrain.distribute(model, torch.optim.Adam(model.parameters(), lr=3e-3),
                                   strategy="hetpipe", loss_fn=loss_fn, policy="hd", inflight=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # 12 sequences: 4 for each of the 3 virtual workers
        w = torch.randint(0, 256, (12, 17), generator=gen)
        trainer.step(w[:, :-1], w[:, 1:])
    found = []
    for role in trainer.strategy.roles:
        late = {p.name.split(".")[0].split("[")[0]: flag
                for (_, p), flag in zip(role.wsp.mine, role.wsp._late)}
        found.append((role.vw, role.index, role.pipe.lr_factor, late))
    trainer.close()
    return found


@pytest.mark.timeout(120)
def test_a_layer_late_in_one_virtual_worker_is_pushed_late_by_all():
    # The decisions behind the run above: h1 is on a late stage (stage 0, N_m = 2) in virtual
    # worker 2 only; every virtual worker pushes it with the late settings, while each
    # stage's own update keeps its own stage's learning rate.
    stages = [s for per in spawn(late_settings_per_layer, workers=6, nodes=3, servers=1)
              for s in per]
    by = {(vw, j): (factor, late) for vw, j, factor, late in stages}
    assert sorted(by) == [(v, j) for v in range(3) for j in range(2)]
    assert {v: by[(v, 0)][0] for v in range(3)} == {0: 0.25, 1: 0.25, 2: 0.25}
    assert {v: by[(v, 1)][0] for v in range(3)} == {0: 1.0, 1: 1.0, 2: 1.0}
    pushes_h1 = {v: by[(v, j)][1]["h1"] for v in range(3) for j in range(2)
                 if "h1" in by[(v, j)][1]}
    assert pushes_h1 == {0: 1, 1: 1, 2: 1}  # on stage 1 of VWs 0 and 1, stage 0 of VW 2
    assert all(by[(v, 1)][1]["h2"] == 0 and by[(v, 1)][1]["head"] == 0 for v in range(3))
    assert all(by[(v, 0)][1]["embed"] == 1 for v in range(3))


def train_lagged(steps: int, lag_beta2: float | None, grouped: bool) -> dict:
    # N_m = 2, D = 0 with Adam on the servers; grouped: the user's optimizer gives the first
    # stage (embed, h0 on both virtual workers) beta2 0.9 itself.
    polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    first = {n for n, _ in model.named_parameters() if n.split(".")[0] in ("embed", "h0")}
    groups = [{"params": [p for n, p in model.named_parameters() if n in first],
               "betas": (0.9, 0.9)},
              {"params": [p for n, p in model.named_parameters() if n not in first]}]
    opt = torch.optim.Adam(groups if grouped else model.parameters(), lr=3e-3)
    trainer = polytrain.distribute(model, opt, strategy="hetpipe", loss_fn=loss_fn, policy="ed",
                                   inflight=2, staleness=0, lag_lr=1.0, lag_beta2=lag_beta2)
    for x, y in script_batches(steps):
        trainer.step(x, y)
    return hetpipe_final(trainer)


@pytest.mark.long  # (moved to the long tier to keep CI short)
@pytest.mark.timeout(240)
def test_the_lag_beta2_reaches_the_late_stages_and_the_servers():
    # --lag-beta2 0.9 with N_m = 2 ends where a user's optimizer that gives the late stage
    # (embed..h0 here) beta2 0.9 ends: on the stages (their predictions) and on the servers
    # (whose Adam steps with each round's settings).
    plan = TrainConfig(strategy="hetpipe", workers=4, nodes=2, servers=1, batch_size=8,
                       model_options=TINY,
                       strategy_options={"policy": "ed", "inflight": 2}).plan_summary()
    assert plan.count("stage 0 on nominal  layers embed..h0") == 2

    def run(lag_beta2: float | None, grouped: bool) -> dict:
        return spawn(train_lagged, workers=4, nodes=2, servers=1,
                     args=(6, lag_beta2, grouped))[0]

    option = run(0.9, False)
    assert max_abs_diff(option, run(None, True)) < 1e-6
    assert max_abs_diff(option, run(None, False)) > 1e-4


@pytest.mark.long
@pytest.mark.timeout(420)
def test_many_in_flight_and_staleness_train_the_default_gpt():
    # N_m = 2 and D = 1 on the default GPT and task (d_model 128, 4 blocks, 500 steps, Adam
    # 2e-3), against single, mean loss of the last 20 steps. With the paper's semantics stale
    # gradients cost this model 29%; the servers' optimizer and weight prediction brought it
    # to +2.4% on this seed (+5.1% on average over seeds 0-3), and the late stage's lower
    # learning rate with Adam's beta2 0.9 (--lag-lr 0.25 --lag-beta2 0.9, the defaults) to
    # -2.8% here, -3.2% on average over seeds 0-7 (-13.1% to +5.9%; what a pull holds
    # depends on the pipelines' timing, so the machine's load can move it). The issue
    # asks for 5%.
    config = TrainConfig(strategy="hetpipe", workers=4, nodes=2, servers=1,
                         strategy_options={"policy": "ed", "inflight": 2, "staleness": 1})
    metrics, _ = run_config(config)
    single, _ = run_config(single_of(config))
    mean = lambda xs: sum(xs[-20:]) / 20  # noqa: E731 - the same last batches in both runs
    assert len(metrics["losses"]) == 500
    assert mean(metrics["losses"]) <= 1.05 * mean(single["losses"])


def test_refusals_before_any_process_starts():
    with pytest.raises(ConfigError, match=r"keeps the global weights on parameter servers.*"
                                          r"HINT: pass --servers 1"):
        TrainConfig(strategy="hetpipe", workers=4, nodes=2)
    # Not "2 workers on 2 machines": --nodes was not given (the devices' 2 machines were used).
    with pytest.raises(ConfigError, match=r"--devices describes 4 devices on 2 machines but the "
                                          r"run has 2 workers\. HINT"):
        TrainConfig(strategy="ddp", workers=2, devices="m0:fast*2,m1:slow*2")
    with pytest.raises(ConfigError, match=r"strategy 'ddp' keeps the whole model on every "
                                          r"worker: .* device m0/0 tiny has 2 MiB"):
        TrainConfig(strategy="ddp", devices="tiny=4/2,m0:tiny*2,m1:tiny*2")
    # Split over a virtual worker's two devices, HetPipe still does not fit: it says where.
    with pytest.raises(ConfigError, match=r"does not fit virtual worker 0 .* N_m = 1 .* of "
                                          r"device type tiny with 2 MiB"):
        TrainConfig(strategy="hetpipe", servers=1, devices="tiny=4/2,m0:tiny*2,m1:tiny*2")
    with pytest.raises(ConfigError, match=r"global batch 30 is not divisible by 4"):
        TrainConfig(strategy="hetpipe", servers=1, batch_size=30, devices="m0:fast*4",
                    strategy_options={"policy": "ed"})
    with pytest.raises(ConfigError, match=r"--inflight \(N_m\) must be at least 1"):
        TrainConfig(strategy="hetpipe", servers=1, strategy_options={"inflight": 0})
    with pytest.raises(ConfigError, match=r"--lag-lr must be in \(0, 1\].*HINT: pass --lag-lr"):
        TrainConfig(strategy="hetpipe", servers=1, strategy_options={"lag_lr": 0.0})
    with pytest.raises(ConfigError, match=r"--lag-beta2 must be in \(0, 1\) \(got 1.0\).*"
                                          r"HINT: pass --lag-beta2 0.9"):
        TrainConfig(strategy="hetpipe", servers=1, strategy_options={"lag_beta2": 1.0})


def bd_batches(sizes: tuple[int, ...]) -> tuple[list[str], list[bool], dict]:
    """Policy bd on 2 machines x 2 devices (4 virtual workers) with the stages' optimizers
    (each steps what its copy of the weights trains), the first layer frozen after
    distribute() and before the first step, a global batch of each size in turn. Returns the
    refusals, whether each of this process's copies of the weights (its twin's too) kept the
    first layer as it was, and the final weights."""
    polytrain.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="hetpipe", loss_fn=torch.nn.functional.mse_loss,
                                   policy="bd", staleness=0, server_optimizer=False)
    untrained = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].requires_grad_(False)
    refusals = []
    for size in sizes:
        try:
            trainer.step(torch.randn(size, 4), torch.randn(size, 2))
        except ConfigError as e:
            refusals.append(str(e))
    kept = [torch.equal(role.model[0].weight, untrained["0.weight"])
            for role in trainer.strategy.roles]
    return refusals, kept, hetpipe_final(trainer)


@pytest.mark.timeout(60)
def test_bd_refuses_every_global_batch_its_virtual_workers_do_not_divide():
    # A DataLoader's last batch of 6 after batches of 8, on 4 virtual workers: each twin
    # trained on 1 of its device's 3 samples, 2 of 6 dropped silently. The split into
    # twins took shape[0] // 2, and only the first step's plan checked the divisibility.
    # Also: a layer frozen after distribute() and before the first step stays as it was on
    # every copy of the weights, the twin's (made at distribute()) too, and the rest trains.
    # It was refused as a change after distribute(), though the stages are built at the
    # first step; the twin's copy kept requires_grad=True, and its stage's optimizer moved it.
    results = spawn(bd_batches, workers=4, nodes=2, servers=1, args=((8, 6, 8),))
    for refusals, kept, _ in results:
        assert kept == [True, True]
        assert refusals == ["global batch 6 is not divisible by the 4 virtual workers of "
                            "policy 'bd': each trains an equal slice. HINT: pass --batch-size "
                            "a multiple of 4 (a DataLoader: drop_last=True)"]
    torch.manual_seed(0)
    untrained = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2)).state_dict()
    final = results[0][2]
    assert torch.equal(final["0.weight"], untrained["0.weight"])
    assert float((final["2.weight"] - untrained["2.weight"]).abs().max()) > 1e-3


def test_a_model_too_big_for_one_device_fits_split_into_stages():
    # 7 MiB devices: ddp's whole model (7.7 MiB with SGD) does not fit, two stages do.
    devices = "small=4/7,m0:small*2,m1:small*2"
    options = {"seq_len": 16, "d_model": 128, "layers": 4}
    with pytest.raises(ConfigError, match=r"keeps the whole model on every worker: 7\.7 MiB"):
        TrainConfig(strategy="ddp", devices=devices, optimizer="sgd", batch_size=8,
                    model_options=options)
    config = TrainConfig(strategy="hetpipe", servers=1, devices=devices, optimizer="sgd",
                         batch_size=8, model_options=options, strategy_options={"policy": "np"})
    summary = config.plan_summary()
    assert summary is not None and "stage 1 on small" in summary and "/ 7 MiB" in summary


def kill_one_stage(victim: int, policy: str = "np", inflight: int | None = 2) -> None:
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy="hetpipe", loss_fn=loss_fn, policy=policy,
                                   inflight=inflight)
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        w = torch.randint(0, 256, (8, 17), generator=gen)
        if step == 3 and ctx.worker_index == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(w[:, :-1], w[:, 1:])
    trainer.state_dict()
    trainer.close()


@pytest.mark.timeout(90)
def test_a_dead_stage_stops_the_run_naming_its_virtual_worker_and_stage():
    with pytest.raises(LaunchError, match=r"worker rank 3 \(machine node1, virtual worker 1 "
                                          r"stage 1\) failed: killed by SIGKILL"):
        spawn(kill_one_stage, workers=4, nodes=2, servers=1, args=(3,))


@pytest.mark.timeout(90)
def test_a_dead_process_of_twin_virtual_workers_is_named_by_both_its_stages():
    # Policy bd: worker 3 runs stage 1 of virtual worker 2 and stage 0 of its twin, 3.
    with pytest.raises(LaunchError, match=r"worker rank 3 \(machine node1, virtual worker 2 "
                                          r"stage 1 and virtual worker 3 stage 0\) failed: "
                                          r"killed by SIGKILL"):
        spawn(kill_one_stage, workers=4, nodes=2, servers=1, args=(3, "bd", None))


def ddp_on(devices: str) -> TrainConfig:
    return TrainConfig(strategy="ddp", devices=devices, steps=4, batch_size=8, optimizer="sgd",
                       lr=0.05, model_options=TINY)


@pytest.mark.timeout(120)
def test_every_strategy_runs_at_its_devices_speed_and_computes_the_same():
    config = ddp_on("crawl=0.25/1024,m0:crawl*2")
    metrics, state = run_config(config)
    _, single = run_config(single_of(config))
    assert max_abs_diff(state, single) < 1e-6  # emulation only waits
    profile = profile_model(GPT(**TINY), torch.zeros(1, 16, dtype=torch.long))
    emulated = 4 * profile.flops / 0.25e9  # 4 samples per worker per step
    # A lower bound only: the emulated device sleeps at least this long every step.
    assert metrics["step_time_s"]["median"] >= 0.95 * emulated
    assert metrics["workers"] == 2 and metrics["devices"] == "crawl=0.25/1024,m0:crawl*2"


@pytest.mark.timeout(150)
def test_cli_trains_hetpipe_on_emulated_devices_and_writes_the_contract(tmp_path):
    out = tmp_path / "hetpipe"
    exe = Path(sys.executable).with_name("polytrain")
    args = ["train", "--strategy", "hetpipe", "--devices", "m0:fast*2,m1:slow*2", "--servers",
            "1", "--policy", "ed", "--inflight", "2", "--staleness", "1", "--steps", "6",
            "--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--timeout", "30",
            "--out", str(out)]
    run = subprocess.run([str(exe), *args], env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=140)
    assert run.returncode == 0, run.stderr
    assert "HetPipe plan: policy ed, 2 virtual workers, N_m = 2" in run.stderr
    assert "m1/0 slow -> m0/0 fast" in run.stderr
    # The progress bar is drawn where a loss is: the last stage of virtual worker 0.
    assert re.search(r"train 6/6 loss +\d+\.\d{3} ", run.stderr), run.stderr
    m = json.loads((out / "metrics.json").read_text())
    assert (m["strategy"], m["workers"], m["nodes"], m["servers"]) == ("hetpipe", 4, 2, 1)
    assert m["strategy_options"]["inflight"] == 2 and m["strategy_options"]["staleness"] == 1
    assert len(m["losses"]) == 6 and m["losses"][-1] < m["losses"][0]
    traffic = {x["name"]: x for x in m["traffic"]["machines"]}
    # ED: every stage boundary crosses machines, and every stage talks to the server.
    assert traffic["node0"]["sent_bytes_per_step"] > 0
    assert traffic["server0"]["recv_bytes_per_step"] > 0
    state = torch.load(out / "final.pt")
    assert list(state) == list(GPT(seq_len=16, d_model=32).state_dict())


@pytest.mark.parametrize("strategy", ["hetpipe", "pipetransformer"])
def test_weights_tied_across_layers_are_refused_before_any_process_starts(strategy):
    # The stage naming the tensor second found it missing from the optimizer ('give the
    # optimizer every parameter that trains'), on that worker only; the others waited.
    from torch import nn

    from polytrain.launch.layout import Layout
    from polytrain.strategies.base import get_strategy, make_options
    embed, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    cls = get_strategy(strategy)
    layout, options = Layout(workers=2, servers=1), make_options(cls, {})
    with pytest.raises(ConfigError, match=rf"'0.weight' and '2.weight' are one tensor \(tied "
                                          rf"weights\) in two layers, and strategy "
                                          rf"'{strategy}' gives each pipeline stage its own"):
        cls.check_model(nn.Sequential(embed, nn.Linear(8, 8), head), layout, options)
    shared = nn.Linear(8, 8)  # one layer used twice inside a block is fine
    cls.check_model(nn.Sequential(embed, nn.Sequential(shared, nn.Tanh(), shared),
                                  nn.Linear(8, 16)), layout, options)
    # So is a pipeline of one stage (machines of one worker): it holds the tensor once
    # (pipetransformer without freezing: test_pipetransformer.py refuses it with freezing).
    one = make_options(cls, {"policy": "np"} if strategy == "hetpipe" else {"freeze": False})
    cls.check_model(nn.Sequential(embed, nn.Linear(8, 8), head),
                    Layout(workers=2, nodes=2, servers=1), one)


def test_a_refused_resume_names_the_stage_each_side_held():
    # Symptom: resuming a checkpoint of --devices "m0:fast*2,m1:slow*2" on "m0:fast*2,m1:fast*2"
    # said "the checkpoint's stage 0 of virtual worker 0 (worker rank 0) held h1.ln1.weight ..
    # head.out.weight", where worker 0 had been stage 1. Cause: the checkpoint kept its stages'
    # names but not their places, and the message named this run's place for both.
    from types import SimpleNamespace

    from polytrain.strategies.hetpipe import HetPipe, HetPipeOptions, _Role, _stage_moved
    model = torch.nn.Linear(2, 2)
    strategy = HetPipe(None, HetPipeOptions())
    stage = SimpleNamespace(names=["h1.ln1.weight", "head.out.weight"])
    pipe = SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    strategy.roles, strategy.started = [_Role(0, 1, model, stage=stage, pipe=pipe)], True
    [saved] = strategy.checkpoint_state()["stages"]
    assert (saved["vw"], saved["index"]) == (0, 1)
    now = _Role(0, 0, model)
    names = ["embed.tok.weight", "h1.mlp.proj.bias"]
    assert _stage_moved(saved, now, names, rank=0) == (
        "the checkpoint's stage 1 of virtual worker 0 (worker rank 0) held h1.ln1.weight .. "
        "head.out.weight (2 tensors), this run's stage 0 of virtual worker 0 holds "
        "embed.tok.weight .. h1.mlp.proj.bias (2 tensors): the stages differ")
    assert _stage_moved(saved, now, stage.names, rank=0) is None
    # A checkpoint from before its stages kept their places: this run's alone is named.
    older = {k: v for k, v in saved.items() if k not in ("vw", "index")}
    assert _stage_moved(older, now, names, rank=0) == (
        "the checkpoint's stage of worker rank 0 held h1.ln1.weight .. head.out.weight "
        "(2 tensors), this run's stage 0 of virtual worker 0 holds embed.tok.weight .. "
        "h1.mlp.proj.bias (2 tensors): the stages differ")


def test_a_resume_that_renumbers_the_virtual_workers_is_refused():
    # Symptom: a resume on --devices that kept every cut but swapped two machines' types (the
    # virtual workers renumbered) ended 0.0102 from the uninterrupted run. Cause: only the
    # stages of virtual worker 0 save the servers' state, and only those of virtual worker 0
    # load it, each from its own saved lane: the new virtual worker 0 had saved none, and the
    # servers' Adam state started afresh.
    from types import SimpleNamespace

    from polytrain.strategies.hetpipe import _Role, _stage_moved
    model = torch.nn.Linear(2, 2)
    names = ["h1.ln1.weight", "head.out.weight"]
    saved = {"names": names, "optimizer": {}, "vw": 1, "index": 1}
    now = _Role(0, 1, model, stage=SimpleNamespace(names=names))
    assert _stage_moved(saved, now, names, rank=3, servers=True) == (
        "the checkpoint's stage 1 of virtual worker 1 (worker rank 3) is this run's stage 1 "
        "of virtual worker 0: the servers' optimizer state is saved and loaded by virtual "
        "worker 0's stages, and would start afresh")
    # The stages' own optimizers (--no-server-optimizer) stay with their workers.
    assert _stage_moved(saved, now, names, rank=3, servers=False) is None
    assert _stage_moved({**saved, "vw": 0}, now, names, rank=3, servers=True) is None
    # Virtual workers 1 and 2 swapped: neither saves nor loads the servers' state.
    other = _Role(2, 1, model, stage=SimpleNamespace(names=names))
    assert _stage_moved(saved, other, names, rank=3, servers=True) is None


def test_a_tensor_of_the_model_outside_its_layers_is_refused_before_any_process_starts():
    # Symptom: a buffer registered on the model itself (not on one of its children) trained
    # the whole run, then state_dict() failed with KeyError 'step_count' and final.pt was
    # lost. Cause: the stages take the model's children (its layers) only, and the gathered
    # weights were looked up by the model's own keys.
    from torch import nn

    from polytrain.launch.layout import Layout
    from polytrain.strategies.base import get_strategy, make_options

    class Scaled(nn.Sequential):
        def __init__(self) -> None:
            super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            self.register_buffer("step_count", torch.zeros(()))
            self.scale = nn.Parameter(torch.ones(()))

    cls = get_strategy("hetpipe")
    layout, options = Layout(workers=4, nodes=2, servers=1), make_options(cls, {})
    with pytest.raises(ConfigError, match=r"^'scale' is a parameter of the model itself, not of "
                                          r"one of its layers \(children\), and strategy "
                                          r"'hetpipe' cuts the model into stages of its "
                                          r"layers: no stage would hold it\. HINT: move it "
                                          r"into a layer \(a child module\); for a built-in "
                                          r"--model, pick another --model, or a strategy "
                                          r"that is not a pipeline$"):
        cls.check_model(Scaled(), layout, options)
    model = Scaled()
    del model.scale
    with pytest.raises(ConfigError, match=r"^'step_count' is a buffer of the model itself"):
        cls.check_model(model, layout, options)
    # A model without children is one layer: it holds every tensor.
    cls.check_model(nn.Linear(4, 2), layout, options)


@pytest.mark.parametrize("kind", ["Adafactor", "Muon"])
def test_an_optimizer_not_element_by_element_is_refused_on_the_servers(kind):
    # Symptom: torch.optim.Adafactor ran on the servers and ended 0.036 from single. Cause:
    # the servers step each key, a layer's tensors fused into one flat run (cut at partition
    # bounds), so an optimizer over a tensor's rows and columns saw another shape.
    from polytrain.strategies.hetpipe import HetPipe, HetPipeOptions
    model = torch.nn.Linear(4, 4)
    optimizer = getattr(torch.optim, kind)([model.weight], lr=0.01)
    with pytest.raises(ConfigError, match=rf"^the servers step each key as one flat run of "
                                          rf"elements \(a layer's tensors fused\), so they "
                                          rf"run only element-by-element optimizers \(SGD, "
                                          rf"Adam, .*\), not torch\.optim\.{kind}\. HINT: use "
                                          rf"one of them; or keep the optimizer on the "
                                          rf"stages: --no-server-optimizer"):
        HetPipe.check_optimizer(optimizer, HetPipeOptions())
    HetPipe.check_optimizer(optimizer, HetPipeOptions(server_optimizer=False))
    for fine in (torch.optim.SGD([model.weight], lr=0.1, momentum=0.9, nesterov=True),
                 torch.optim.Adam([model.weight], amsgrad=True), torch.optim.Rprop([model.weight])):
        HetPipe.check_optimizer(fine, HetPipeOptions())


def test_policy_bd_names_the_half_of_a_devices_memory_a_stage_gets():
    # Symptom: "device type tiny with 1.5 MiB" for devices of 3 MiB. Cause: policy bd plans
    # each stage in half of its device's memory, and the refusal printed the half.
    with pytest.raises(ConfigError, match=r"of device type tiny with half of its 3 MiB \(policy "
                                          r"bd runs two stages per device\)\. HINT"):
        TrainConfig(strategy="hetpipe", servers=1, devices="tiny=4/3,m0:tiny*2,m1:tiny*2",
                    strategy_options={"policy": "bd"})


class WithSpare(torch.nn.Module):
    """A linear layer with a trained parameter its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.spare = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Gated(torch.nn.Module):
    """A linear layer whose trained ``spare`` only samples with x[:, 0] > 2 reach."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.spare = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reach = x[:, 0] > 2
        if x.device.type == "meta" or bool(reach.any()):
            return self.lin(x) + reach.float()[:, None] * self.spare.sum()
        return self.lin(x)


def train_spare(steps: int, distributed: bool, gated: bool = False) -> dict:
    """SGD with momentum and weight decay on a model with a parameter no step reaches
    (``gated``: one that only some samples reach), with each virtual worker's own optimizer
    (policy ed, D = 0, N_m = 1); then, distributed and not gated, two steps with the servers'
    optimizer. Returns the weights and the warnings logged."""
    import logging

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = (torch.nn.Sequential(Gated(), torch.nn.Tanh(), torch.nn.Linear(8, 2)) if gated
                 else torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), WithSpare()))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                      weight_decay=0.1)

    mse = torch.nn.functional.mse_loss
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen))
               for _ in range(steps)]
    if gated:  # step 0: every sample reaches the spare; step 1: only sample 0 (one half)
        batches[0][0][:, 0] = 3.0
        batches[1][0][:, 0] = -1.0
        batches[1][0][0, 0] = 3.0
    model, opt = make()
    if not distributed:
        for x, y in batches:
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
        return {"state": model.state_dict()}
    polytrain.init()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("polytrain").addHandler(handler)
    out = {}
    for server_optimizer in (False,) if gated else (False, True):
        trainer = polytrain.distribute(model, opt, strategy="hetpipe", loss_fn=mse, policy="ed",
                                       inflight=1, staleness=0,
                                       server_optimizer=server_optimizer)
        for x, y in batches if not server_optimizer else batches[:2]:
            trainer.step(x, y)
        out[server_optimizer] = hetpipe_final(trainer)
        out[f"warnings {server_optimizer}"] = list(warnings)
        model, opt = make()
    return out


@pytest.mark.timeout(120)
def test_a_parameter_no_step_reaches_is_left_alone_by_a_lone_virtual_workers_optimizer():
    # Symptom: a trained parameter that the forward never uses ended at 0.9752 where one
    # process keeps it at 1. Cause: the stage turned its missing gradient into zeros, which
    # the optimizer stepped (weight decay, momentum). A lone virtual worker's own optimizer
    # now gets None and skips it, as one process does; the servers' optimizer steps a
    # layer's tensors as one flat key, so there the stage warns once.
    single = train_spare(4, False)["state"]
    results = spawn(train_spare, workers=2, nodes=2, servers=1, args=(4, True))
    own = results[0][False]
    assert max_abs_diff(single, own) < 1e-6
    assert torch.equal(own["2.spare"], torch.ones(3))
    assert not torch.equal(own["2.lin.weight"], make_spare_untrained()["2.lin.weight"])
    assert all(r["warnings False"] == [] for r in results)
    # Worker 1 (machine node1) holds the last stage (the spare): it warns once, naming it.
    said = [r["warnings True"] for r in results]
    assert said[0] == []
    assert said[1] == [
        "virtual worker 0 stage 1 (rank 1, machine node1): trained parameter '2.spare' got no "
        "gradient in a step: it is stepped on a zero gradient (its share of the virtual "
        "workers' sum, where another reaches it), so in a step that no virtual worker "
        "reaches it, weight decay and momentum move it where one process would leave it "
        "alone. HINT: freeze a parameter that is not to train (requires_grad_(False)) before "
        "the first trainer.step(); with one virtual worker, keep the optimizer on the "
        "stages: --no-server-optimizer (Python: server_optimizer=False) leaves it alone"]
    assert not torch.equal(results[0][True]["2.spare"], torch.ones(3))


@pytest.mark.timeout(120)
def test_a_parameter_one_virtual_workers_minibatch_reaches_is_stepped_as_in_one_process():
    # With several virtual workers, one whose minibatch does not reach a parameter steps it
    # on zeros, its share of the summed update (weight decay, momentum): skipping it, as a
    # lone virtual worker does, ended 0.0138 from single (found by a review of stop 51's
    # first fix, which skipped it on every virtual worker).
    single = train_spare(2, False, True)["state"]
    results = spawn(train_spare, workers=4, nodes=2, servers=1, args=(2, True, True))
    assert max_abs_diff(single, results[0][False]) < 1e-6
    assert not torch.equal(results[0][False]["0.spare"], torch.ones(2))


def make_spare_untrained() -> dict:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), WithSpare()).state_dict()


def test_the_training_loop_finishes_the_strategys_work_before_summing_the_losses(monkeypatch,
                                                                               tmp_path):
    # Symptom: HetPipe, D = 1, virtual worker 1 on slow devices: "server rank 4 failed:
    # PeerLost: rank 4: lost worker rank 1 ... the process stopped", 3 runs in 3, while rank 1
    # was alive. Cause: the loop summed the losses (a gloo collective of the workers) before
    # trainer.state_dict() drained the pipelines: virtual worker 0's first stage waited there
    # for the slow one, its last stage's send of the last gradients timed out meanwhile, and
    # gloo closed rank 1's connections, the server's among them.
    from polytrain.strategies.trainer import Trainer
    from polytrain.train import loop

    calls: list[str] = []
    losses, state_dict = loop._global_losses, Trainer.state_dict
    monkeypatch.setattr(loop, "_global_losses",
                        lambda ctx, values: calls.append("losses") or losses(ctx, values))
    monkeypatch.setattr(Trainer, "state_dict",
                        lambda self: calls.append("state_dict") or state_dict(self))
    loop.train(TrainConfig(strategy="single", steps=2, batch_size=4, optimizer="sgd",
                           model_options=TINY, quiet=True))
    assert calls == ["state_dict", "losses"]
    # And at a checkpoint: its save finishes the work (the strategy's state_dict) first.
    from polytrain.strategies.base import Strategy

    strategy_state = Strategy.state_dict
    monkeypatch.setattr(Strategy, "state_dict", lambda self, model: calls.append(
        "strategy state_dict") or strategy_state(self, model))
    calls.clear()
    loop.train(TrainConfig(strategy="single", steps=2, batch_size=4, optimizer="sgd",
                           model_options=TINY, quiet=True, out=str(tmp_path),
                           checkpoint_every=1))
    assert calls[:4] == ["strategy state_dict", "losses"] * 2, calls


@pytest.mark.timeout(90)
def test_a_virtual_worker_slower_than_the_timeout_allows_is_named_not_the_others():
    # Symptom: HetPipe, D = 1, virtual worker 1 on a device far slower than --timeout allows:
    # the run named an innocent process (server rank 4, "lost worker rank 1", or "held
    # answers" with the hint to look for a push_pull only some workers run). Causes: the
    # losses' collective before the pipelines drained (see above); the server's report named
    # nobody whose pushes its answers waited for.
    from polytrain.train import run_config as run_job

    config = TrainConfig(strategy="hetpipe", devices="f=4/1024,crawl=0.0015/1024,m0:f*2,"
                         "m1:crawl*2", servers=1, steps=2, batch_size=8, optimizer="sgd",
                         model_options=TINY, quiet=True, timeout_s=4,
                         strategy_options={"policy": "np", "inflight": 2, "staleness": 1})
    with pytest.raises(LaunchError) as info:
        run_job(config, env={"OMP_NUM_THREADS": "1"})
    assert re.match(r"worker rank [23] \(machine node1, virtual worker 1 stage [01]\) failed: ",
                    str(info.value)), info.value
    assert "raise --timeout" in info.value.hint, info.value.hint


def test_a_save_before_the_first_step_keeps_what_load_gave_and_a_load_after_it_is_refused():
    # Symptoms: a save between polytrain.load() and the first step wrote none of the
    # stages' optimizer state or the servers' (the stages are built at the first step);
    # a load after steps was taken and only its weights reached the model, not the stages.
    from polytrain.strategies.hetpipe import HetPipe, HetPipeOptions

    strategy = HetPipe(None, HetPipeOptions())
    assert strategy.checkpoint_state() == {}
    saved = {"stages": [{"names": ["0.weight"], "optimizer": {"state": {}}, "vw": 0,
                         "index": 0}], "layer_seconds": None, "servers": [None]}
    strategy.check_load()
    strategy.load_checkpoint_state(saved)
    assert strategy.checkpoint_state() == saved
    strategy.started = True
    with pytest.raises(ConfigError, match=r"^hetpipe loads a checkpoint only before the "
                       r"trainer's first step, and this trainer has trained: its stages' "
                       r"weights and optimizers would stay as they are\. HINT: load before "
                       r"the first trainer\.step\(\)"):
        strategy.check_load()
