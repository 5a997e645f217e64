"""``metrics.json`` as written: JSON that any reader takes."""

import json

from polytrain.train.metrics import write_metrics


def test_a_loss_that_is_not_finite_is_written_as_null(tmp_path):
    # A diverged run wrote NaN and Infinity, which JSON has not: strict readers refused it.
    write_metrics(tmp_path, {"losses": [2.5, float("nan"), float("inf")],
                             "final_loss": float("-inf"), "eval": [{"loss": float("nan")}],
                             "steps": 3})
    text = (tmp_path / "metrics.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"losses": [2.5, None, None], "final_loss": None,
                                "eval": [{"loss": None}], "steps": 3}
