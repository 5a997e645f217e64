"""The planner's job: what it refuses, and what planning leaves of the caller's state."""

import pytest
import torch

from polytrain.errors import ConfigError
from polytrain.optim import make_optimizer
from polytrain.plan import Job, plan_job
from polytrain.plan.cost import Compute

SMALL = {"d_model": 16, "layers": 1}


@pytest.mark.timeout(20)
def test_planning_leaves_the_callers_random_numbers_alone():
    # plan_job reseeded the global generator (torch.manual_seed(0) in the compute timing):
    # a seed set before planning gave other weights after it.
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    plan_job(Job(model="mlp", model_options=SMALL, batch_size=4))
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.timeout(20)
def test_an_unknown_optimizer_is_refused_naming_the_optimizers():
    # Job(optimizer="rmsprop") was planned as Adam: make_optimizer fell back to Adam for any
    # name it did not know, and Job did not check the name as TrainConfig does.
    with pytest.raises(ConfigError, match="unknown optimizer 'rmsprop'; the optimizers are: "
                                          "sgd, adam, adagrad"):
        Job(model="mlp", optimizer="rmsprop")
    with pytest.raises(ConfigError, match="unknown optimizer 'rmsprop'"):
        make_optimizer("rmsprop", torch.nn.Linear(2, 2), 1e-3)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("field,flag", [("batch_size", "--batch-size"), ("workers", "--workers"),
                                        ("nodes", "--nodes"), ("servers", "--servers"),
                                        ("cores", "--cores")])
def test_a_count_that_is_not_a_whole_number_is_refused_naming_the_flag(field, flag):
    # Job(batch_size=32.0) or Job(workers=2.0) ended in a TypeError from inside torch:
    # Job did not check its counts as TrainConfig does.
    with pytest.raises(ConfigError, match=f"^{flag} must be a whole number \\(got 2.0\\)"):
        Job(model="mlp", **{field: 2.0})


@pytest.mark.timeout(20)
def test_compute_is_timed_on_the_threads_the_launched_workers_get(monkeypatch):
    # The planner timed compute on one thread, while the launcher gives each process
    # cpu_count // world_size: on 2 cores `polytrain plan --workers 1` predicted 181 ms
    # (compute 174) for a run of 126 ms.
    from polytrain.plan import planner

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # conftest sets it; a user may not
    timed = []

    budgets = []

    def measure(model, options, *, batch, optimizer, threads, budget_s):
        timed.append(threads)
        budgets.append(budget_s)
        return Compute(forward_s=0.1 / threads, backward_s=0.2 / threads, optimizer_s=0.0)

    monkeypatch.setattr(planner, "measure_compute", measure)
    monkeypatch.setattr(planner, "host_cores", lambda: 8)  # planned on a host of 8
    plan = plan_job(Job(model="mlp", workers=2, servers=1, cores=8))
    # ddp: 2 processes on 8 cores, 4 threads each; byteps and herring put a server beside
    # the workers (3 or 4 processes: 2 threads each). Each count is timed once.
    assert plan.get("ddp").compute_s == pytest.approx(0.3 / 4)
    assert sorted(timed) == sorted(set(timed)) and 4 in timed and 2 in timed
    # ... within one timing's budget, shared (a large batch's plan took that much again
    # for each thread count).
    assert sum(budgets) == pytest.approx(10.0)
    assert plan.as_dict()["compute"]["threads"] == plan.threads
    assert plan_job(Job(model="mlp", workers=1, cores=8)).get("ddp").compute_s == \
        pytest.approx(0.3 / 8)
    # --cores describes the host planned for; the timing runs here, on no more threads
    # than this machine has (64 cores: ddp was timed on 32 threads of 2, 5x too slow).
    monkeypatch.setattr(planner, "host_cores", lambda: 2)
    assert plan_job(Job(model="mlp", workers=2, cores=64)).get("ddp").compute_s == \
        pytest.approx(0.3 / 2)
    monkeypatch.setattr(planner, "host_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the launcher passes the user's own on
    assert plan_job(Job(model="mlp", workers=1, cores=8)).get("ddp").compute_s == \
        pytest.approx(0.3 / 3)
