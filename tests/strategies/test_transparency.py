"""Transparency: a synchronous strategy ends with the single-process run's weights."""

import pytest

from polytrain import TrainConfig
from tests.harness import max_abs_diff, run_config, single_of

STEPS = 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer, tol", [("sgd", 1e-6), ("adam", 1e-5)])
@pytest.mark.parametrize("workers, nodes", [(2, 1), (4, 2)])
def test_ddp_ends_where_single_ends(workers, nodes, optimizer, tol):
    config = TrainConfig(strategy="ddp", workers=workers, nodes=nodes, steps=STEPS, batch_size=8,
                         optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 3e-3,
                         model_options={"seq_len": 16, "d_model": 32, "layers": 2})
    _, single = run_config(single_of(config))
    metrics, distributed = run_config(config)
    assert max_abs_diff(single, distributed) < tol
    # The weights did move: the comparison is not between two untouched initialisations.
    _, untrained = run_config(single_of(config).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 100 * tol
    assert metrics["workers"] == workers and len(metrics["losses"]) == STEPS
