"""Schedules as plain data: their orders, deadlock freedom, and torch's own 1F1B and GPipe."""

from types import SimpleNamespace

import pytest

from polytrain import ConfigError
from polytrain.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    asynchronous,
    describe,
    gpipe,
    one_f_one_b,
)


def run_to_completion(orders):
    """Execute the per-stage orders with the pipeline's dependencies; the global order, or None.

    F(m) on stage j needs F(m) on j-1; B(m) on j needs F(m) on j and B(m) on j+1.
    """
    done = set()
    pos = [0] * len(orders)
    trace = []
    progress = True
    while progress:
        progress = False
        for j, order in enumerate(orders):
            if pos[j] == len(order):
                continue
            a = order[pos[j]]
            if a.kind == FORWARD:
                ready = j == 0 or (j - 1, FORWARD, a.minibatch) in done
            else:
                ready = (j, FORWARD, a.minibatch) in done and (
                    j == len(orders) - 1 or (j + 1, BACKWARD, a.minibatch) in done)
            if ready:
                done.add((j, a.kind, a.minibatch))
                trace.append((j, str(a)))
                pos[j] += 1
                progress = True
    return trace if all(p == len(o) for p, o in zip(pos, orders)) else None


def test_orders_read_as_documented():
    assert describe(gpipe(2, 3)) == "stage 0: F0 F1 F2 B0 B1 B2\nstage 1: F0 F1 F2 B0 B1 B2"
    assert describe(one_f_one_b(2, 3)) == "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2"
    assert describe(asynchronous(2, 3, 5)).splitlines() == [
        "stage 0: F0 F1 F2 B0 F3 B1 F4 B2 B3 B4", "stage 1: F0 F1 B0 F2 B1 F3 B2 F4 B3 B4"]


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [1, 2, 7])
def test_every_schedule_runs_to_completion(stages, count):
    for orders in [gpipe(stages, count), one_f_one_b(stages, count)] + \
            [asynchronous(stages, nm, count) for nm in (1, 2, stages, stages + 2)]:
        assert run_to_completion(orders) is not None, describe(orders)
        for order in orders:  # every minibatch once forward, once backward, F before B
            fwd = [a.minibatch for a in order if a.kind == FORWARD]
            bwd = [a.minibatch for a in order if a.kind == BACKWARD]
            assert fwd == bwd == list(range(count))


@pytest.mark.parametrize("inflight", [1, 2, 3, 4])
def test_asynchronous_keeps_n_m_in_flight_on_the_first_stage(inflight):
    order = asynchronous(3, inflight, 12)[0]
    for i, a in enumerate(order):
        if a.kind == FORWARD and a.minibatch >= inflight:
            # minibatch p starts after p - N_m has finished: local staleness N_m - 1
            assert order.index(next(b for b in order if b.kind == BACKWARD
                                    and b.minibatch == a.minibatch - inflight)) < i
        started = sum(1 for b in order[:i + 1] if b.kind == FORWARD)
        finished = sum(1 for b in order[:i + 1] if b.kind == BACKWARD)
        assert started - finished <= inflight


def test_inflight_must_be_positive():
    with pytest.raises(ConfigError, match="N_m .* at least 1"):
        asynchronous(2, 0, 4)


def _torch_order(cls, stages, microbatches):
    """torch.distributed.pipelining's own order for a schedule, without idles and reductions."""
    fake = SimpleNamespace(_num_stages=stages, _n_microbatches=microbatches)
    table = cls._get_pipeline_order(fake)
    return [[f"{a.computation_type.value}{a.microbatch_index}" for a in table[r]
             if a is not None and a.computation_type.value in ("F", "B")]
            for r in range(stages)]


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_one_f_one_b_and_gpipe_are_torch_pipelinings_orders(stages, microbatches):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules.Schedule1F1B, "_get_pipeline_order"):
        pytest.skip("this torch has no schedule tables")
    ours = [[str(a) for a in o] for o in one_f_one_b(stages, microbatches)]
    # All but the last stage: torch's private table numbers the last stage's forwards from 1
    # (its warm-up counter starts at 0 when there is no warm-up), unlike its execution.
    assert ours[:-1] == _torch_order(schedules.Schedule1F1B, stages, microbatches)[:-1]
    ours = [[str(a) for a in o] for o in gpipe(stages, microbatches)]
    assert ours == _torch_order(schedules.ScheduleGPipe, stages, microbatches)
