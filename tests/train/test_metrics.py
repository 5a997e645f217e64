"""``metrics.json`` as written: JSON that any reader takes."""

import json

import pytest

from polytrain import TrainConfig
from polytrain.comm import Topology
from polytrain.comm.meter import SENT, MeterReport
from polytrain.train.metrics import build_metrics, write_metrics

pytestmark = pytest.mark.timeout(10)


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


def test_a_step_that_re_planned_is_left_out_of_the_steady_traffic_and_times():
    # Parallax's search re-partitions its tables inside the step that changes the count
    # (worker 0 pulls every range's state and sets it again): that step's bytes and time
    # went into the steady averages, 3.8x a step's traffic on a 6-step run. Such a step is
    # cold, as a resumed run's first: out of the averages, still in the per-step lists.
    topology = Topology.from_roles([("worker", "a"), ("worker", "b")])
    sent = [500, 100, 100, 9000, 100, 100]  # step 3 re-planned
    nics = [{"a": (0, 0), "b": (0, 0)}]
    for n in sent:  # the NICs' counters after each step: 10% of headers on top
        before = nics[-1]["a"][0]
        nics.append({"a": (before + n * 11 // 10, 0), "b": (0, before + n * 11 // 10)})
    reports = [MeterReport(0, {}, [{(1, SENT, False): n} for n in sent], nics),
               MeterReport(1, {}, [{} for _ in sent])]
    times = [0.5, 0.1, 0.1, 0.9, 0.1, 0.1]
    config = TrainConfig(strategy="parallax", model="wordlm", workers=2, nodes=2, steps=6)
    metrics = build_metrics(config=config, losses=[1.0] * 6, times=times, model_bytes=8,
                            topology=topology, reports=reports, wall_s=1.0, cold=[3])
    a = next(m for m in metrics["traffic"]["machines"] if m["name"] == "a")
    assert a["sent_bytes_per_step"] == 100  # was 1880: (100 + 100 + 9000 + 100 + 100) / 5
    assert a["nic_sent_bytes_per_step"] == 110
    assert metrics["step_time_s"]["p90"] == pytest.approx(0.1)
    assert metrics["traffic"]["sent_bytes_by_step"] == sent and metrics["step_times"] == times
    assert "re-planned" in metrics["traffic"]["note"]
    # Where every step after the warm-up re-planned, no step is steady: the traffic is 0,
    # as the step times are, not the cold first step's (the window's fallback: 100).
    short = build_metrics(config=config.replace(steps=2), losses=[1.0] * 2, times=times[2:4],
                          model_bytes=8, topology=topology, cold=[1], wall_s=1.0,
                          reports=[MeterReport(0, {}, [{(1, SENT, False): n} for n in sent[2:4]],
                                               nics[2:5]),
                                   MeterReport(1, {}, [{}, {}])])
    b = next(m for m in short["traffic"]["machines"] if m["name"] == "b")
    assert b["recv_bytes_per_step"] == 0 and b.get("nic_recv_bytes_per_step") is None
    assert short["step_time_s"]["median"] == short["samples_per_s"] == 0


def test_a_resumed_runs_traffic_counts_the_steps_its_step_times_count():
    # The traffic and the step times each had a rule for a resumed run's steady steps: the
    # times left out the whole run's warm-up and the resumed run's first step, the traffic
    # the first warm-up-many steps of the resumed run's own (6 of a 60-step run: steps 51
    # to 55 here, steady ones, were left out of the traffic only). One rule now.
    topology = Topology.from_roles([("worker", "a"), ("worker", "b")])
    own = [9000, 200, 200, 200, 200, 200, 100, 100, 100, 100]  # resumed at step 50 of 60
    times = [0.1] * 50 + [0.9, 0.2, 0.2, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1]
    config = TrainConfig(strategy="ddp", workers=2, nodes=2, steps=60)
    metrics = build_metrics(config=config, losses=[1.0] * 60, times=times, model_bytes=8,
                            topology=topology, wall_s=1.0, cold=[50],
                            reports=[MeterReport(0, {}, [{(1, SENT, False): n} for n in own]),
                                     MeterReport(1, {}, [{} for _ in own])])
    a = next(m for m in metrics["traffic"]["machines"] if m["name"] == "a")
    assert a["sent_bytes_per_step"] == pytest.approx((5 * 200 + 4 * 100) / 9)  # was 100
    assert metrics["step_time_s"]["mean"] == pytest.approx((44 * 0.1 + 5 * 0.2 + 4 * 0.1) / 53)
