"""``metrics.json`` as written: JSON that any reader takes."""

import json

from polytrain import TrainConfig
from polytrain.train.metrics import build_metrics, write_metrics


def test_a_loss_that_is_not_finite_is_written_as_null(tmp_path):
    # A diverged run wrote NaN and Infinity, which JSON has not: strict readers refused it.
    write_metrics(tmp_path, {"losses": [2.5, float("nan"), float("inf")],
                             "final_loss": float("-inf"), "eval": [{"loss": float("nan")}],
                             "steps": 3})
    text = (tmp_path / "metrics.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"losses": [2.5, None, None], "final_loss": None,
                                "eval": [{"loss": None}], "steps": 3}


def test_metrics_record_the_sampling_and_the_evaluations_interval():
    # --sampling epoch changes every batch, and metrics.json did not say which a run drew
    # (a checkpoint's record did); nor how often it evaluated.
    config = TrainConfig(strategy="single", model="mlp", steps=4, sampling="epoch",
                         eval_every=2)
    metrics = build_metrics(config=config, losses=[1.0] * 4, times=[0.1] * 4, model_bytes=8,
                            topology=None, reports=[], wall_s=1.0)
    assert (metrics["sampling"], metrics["eval_every"]) == ("epoch", 2)
    plain = build_metrics(config=TrainConfig(strategy="single", model="mlp", steps=4),
                          losses=[1.0] * 4, times=[0.1] * 4, model_bytes=8, topology=None,
                          reports=[], wall_s=1.0)
    assert (plain["sampling"], plain["eval_every"]) == ("random", None)
