"""CUDA tensors through every strategy: each ends where ``single`` on the GPU ends.

Skipped without a CUDA device. On a machine with fewer GPUs than workers the workers
share GPUs, and their CUDA tensors go over gloo (NCCL takes one GPU per process:
``polytrain.runtime.cuda_backend``); with a GPU per worker they go over NCCL. Servers
stay on the CPU: workers stage what they push through host memory.
"""

import pytest
import torch

import polytrain
from polytrain import TrainConfig
from polytrain.models import GPT as GPTModel
from polytrain.models import cross_entropy as loss_fn
from tests.harness import adam_tolerance, max_abs_diff, run_config, single_of, spawn
from tests.strategies.test_pipetransformer import FREEZING, TINY, _batches

pytestmark = pytest.mark.gpu

GPT = {"seq_len": 16, "d_model": 32, "layers": 4}
WORDLM = {"vocab": 2000, "seq_len": 8, "d_model": 16, "layers": 1, "heads": 2, "negatives": 32}
MOE = {"seq_len": 16, "d_model": 32, "layers": 2, "experts": 4}
# Summation order differs between the GPU's kernels and between layouts; a wrong gradient
# moves a weight by about lr (0.05) in a step.
TOLERANCE = 1e-4

CASES = {
    "ddp": dict(workers=2),
    "byteps": dict(workers=2, nodes=2, servers=1),
    "herring": dict(workers=4, nodes=2, servers=2, strategy_options={"bucket_cap_mb": 0.05}),
    "parallax": dict(model="wordlm", workers=4, nodes=2, servers=2, model_options=WORDLM,
                     lr=0.5, strategy_options={"partitions": 3}),
    "moe": dict(model="gpt-moe", workers=2, model_options=MOE,
                strategy_options={"expert_parallel": 2}),
    "hetpipe": dict(workers=4, nodes=2, servers=1,
                    strategy_options={"policy": "np", "inflight": 1, "staleness": 0}),
    "pipetransformer": dict(workers=4, nodes=2, strategy_options={"freeze": False}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(CASES))
def test_a_strategy_on_cuda_ends_where_single_on_cuda_ends(strategy):
    case = {"model_options": GPT, "lr": 0.05, **CASES[strategy]}
    config = TrainConfig(strategy=strategy, steps=4, batch_size=8, optimizer="sgd",
                         device="cuda", **case)
    single_metrics, single = run_config(single_of(config))
    metrics, distributed = run_config(config)
    assert list(single) == list(distributed)
    assert max_abs_diff(single, distributed) < TOLERANCE
    assert metrics["losses"] == pytest.approx(single_metrics["losses"], abs=1e-4)
    _, untrained = run_config(single_of(config).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 50 * TOLERANCE  # the weights moved


def backend_and_sum() -> tuple[str, float, str]:
    ctx = polytrain.init(device="cuda")
    t = torch.full((4,), float(ctx.worker_index + 1), device=ctx.device)
    torch.distributed.all_reduce(t, group=ctx.groups.workers)
    return ctx.backend, float(t[0]), str(t.device)


@pytest.mark.timeout(120)
def test_workers_sharing_a_gpu_all_reduce_cuda_tensors_over_gloo():
    results = spawn(backend_and_sum, workers=2)
    shared = torch.cuda.device_count() < 2
    assert [r[0] for r in results] == ["gloo" if shared else "cpu:gloo,cuda:nccl"] * 2
    assert [r[1] for r in results] == [3.0, 3.0]
    assert all(r[2].startswith("cuda") for r in results)


@pytest.mark.timeout(120)
def test_one_worker_on_its_own_gpu_uses_nccl():
    [(backend, total, device)] = spawn(backend_and_sum, workers=1)
    assert (backend, total) == ("cpu:gloo,cuda:nccl", 1.0) and device.startswith("cuda")


def freezing_on(device: str, steps: int) -> tuple[dict, list, dict]:
    polytrain.init(device=device)
    torch.manual_seed(0)
    model = GPTModel(**TINY).to(device)
    trainer = polytrain.distribute(model, torch.optim.Adam(model.parameters(), lr=3e-3),
                                   strategy="pipetransformer", loss_fn=loss_fn, **FREEZING)
    for x, y in _batches(steps):
        trainer.step(x.to(device), y.to(device))
    state = {k: v.cpu() for k, v in trainer.state_dict().items()}
    records = trainer.strategy.metrics()
    trainer.close()
    return state, records["freeze_timeline"], records["cache"]


@pytest.mark.timeout(300)
def test_pipetransformer_freezing_on_cuda_ends_where_it_ends_on_the_cpu():
    # Freezing, AutoPipe, AutoDP (2 x 2, then 1 x 4: weights and Adam's state handed over)
    # and AutoCache (activations kept in host memory) on the GPU.
    steps = 9
    cpu, cpu_timeline, _ = spawn(freezing_on, workers=4, nodes=2, args=("cpu", steps))[0]
    gpu, gpu_timeline, cache = spawn(freezing_on, workers=4, nodes=2, args=("cuda", steps))[0]
    def plans(timeline):  # the signals' values differ in their last digits
        return [{k: v for k, v in e.items() if k != "grad_norm_signal"} for e in timeline]

    assert plans(gpu_timeline) == plans(cpu_timeline)
    assert [(e["stages"], e["replicas"]) for e in gpu_timeline][:2] == [(2, 2), (1, 4)]
    assert cache["hits"] > 0
    assert max_abs_diff(cpu, gpu) < adam_tolerance(3e-3, steps)
