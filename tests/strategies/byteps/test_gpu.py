"""CUDA workers: gradients staged through CPU to the servers (which stay on CPU)."""

import pytest

from polytrain import TrainConfig
from tests.harness import max_abs_diff, run_config, single_of


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_byteps_on_cuda_ends_where_single_on_cuda_ends():
    c = TrainConfig(strategy="byteps", workers=2, nodes=2, servers=1, steps=4, batch_size=8,
                    optimizer="sgd", lr=0.05, device="cuda",
                    model_options={"seq_len": 16, "d_model": 32, "layers": 2})
    _, single = run_config(single_of(c))
    _, distributed = run_config(c)
    assert max_abs_diff(single, distributed) < 1e-5
