"""Transparency: a synchronous strategy ends with the single-process run's weights."""

import pytest

from polytrain import TrainConfig
from tests.harness import adam_tolerance, max_abs_diff, run_config, single_of

STEPS = 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer, tol", [("sgd", 1e-6), ("adam", adam_tolerance(3e-3, STEPS))])
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
    assert max_abs_diff(single, untrained) > 50 * tol
    assert metrics["workers"] == workers and len(metrics["losses"]) == STEPS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy, servers", [("ddp", 0), ("byteps", 1)])
def test_a_learning_rate_schedule_keeps_a_strategy_transparent(strategy, servers):
    # Warm-up and cosine decay are a scheduler on the optimizer the strategy returns.
    config = TrainConfig(strategy=strategy, workers=2, nodes=2, servers=servers, steps=STEPS,
                         batch_size=8, optimizer="adam", lr=3e-3, lr_schedule="cosine",
                         warmup_steps=2, model_options={"seq_len": 16, "d_model": 32, "layers": 2})
    _, single = run_config(single_of(config))
    metrics, distributed = run_config(config)
    assert max_abs_diff(single, distributed) < adam_tolerance(3e-3, STEPS)
    _, constant = run_config(single_of(config).replace(lr_schedule="constant", warmup_steps=0))
    assert max_abs_diff(single, constant) > 1e-3
    assert (metrics["lr_schedule"], metrics["warmup_steps"]) == ("cosine", 2)


def test_the_schedules_learning_rates():
    from polytrain.train.loop import lr_factor

    warm = [lr_factor(s, steps=10, schedule="cosine", warmup=4) for s in range(10)]
    assert warm[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert warm[4] == pytest.approx(1.0) and warm[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(warm[4:], warm[5:]))  # decays every step after warm-up
    assert [lr_factor(s, steps=5, schedule="constant", warmup=2) for s in range(5)] == \
        pytest.approx([0.5, 1, 1, 1, 1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "herring", "byteps"])
def test_an_moe_expert_no_token_chose_is_left_alone_as_in_one_process(strategy):
    # 16 experts, top-1, 128 tokens a step: at step 2, layer h1's expert 7 gets no token in
    # the global batch. One process leaves its gradient None, so Adam does not touch it;
    # ddp, herring and byteps wrote zeros there and Adam moved it by about lr (1.3e-3 here).
    config = TrainConfig(strategy=strategy, workers=4, nodes=2, steps=3, batch_size=8,
                         optimizer="adam", lr=2e-3, model="gpt-moe",
                         model_options={"seq_len": 16, "d_model": 32, "layers": 2,
                                        "experts": 16, "top_k": 1})
    _, single = run_config(single_of(config))
    _, distributed = run_config(config)
    assert max_abs_diff(single, distributed) < adam_tolerance(2e-3, 3)
