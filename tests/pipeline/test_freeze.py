"""AutoFreeze's rule alone: the paper's cap and the gradient-norm signal, as a pure function."""

import doctest

import pytest

from polytrain import ConfigError
from polytrain.pipeline import freeze
from polytrain.pipeline.freeze import (
    GradNormTracker,
    freezable_layers,
    freeze_cap,
    next_frozen,
    reference_length,
)
from polytrain.strategies.pipetransformer import PipeTransformerOptions


def test_the_doctests():
    result = doctest.testmod(freeze)
    assert result.failed == 0 and result.attempted > 0


def test_the_cap_alone_is_the_reference_codes_schedule():
    # The released code freezes ceil(L (1 - (1 - alpha)^e)) layers after epoch e: with
    # alpha 1/3 and 12 layers 4, 7, 9, 10, 11, 12 (the last step within rounding).
    frozen, seen = 0, []
    for _ in range(6):
        frozen = next_frozen(frozen, 12, [0.0] * (12 - frozen), alpha=1 / 3, threshold=0.5)
        seen.append(frozen)
    assert seen == [4, 7, 9, 10, 11, 12]


def test_the_last_layer_with_parameters_is_never_freezable():
    # Symptom: a model ending in a LogSoftmax froze every weight. Cause: L was every layer but
    # the last, and the last was the LogSoftmax, so its Linear counted as freezable.
    assert freezable_layers([True] * 6) == 5  # every layer but the last
    assert freezable_layers([True, False, True, False, True, False]) == 4
    assert freezable_layers([True, True, False, False]) == 1
    assert freezable_layers([False, False]) == 0  # nothing trains: nothing freezes


def test_the_gradient_norm_signal_freezes_less_than_the_cap():
    # Layer 0 has stopped (0.2 of its first norm), layer 1 still learns: the front freezes
    # through the stopped layer with the smallest ratio, here layer 0 alone, not the cap's 4.
    assert next_frozen(0, 12, [0.2] + [0.9] * 11, alpha=1 / 3, threshold=0.5) == 1
    # The smallest ratio may sit deeper: freeze through it (front layers converge first).
    assert next_frozen(0, 12, [0.4, 0.3, 0.1] + [0.9] * 9, alpha=1 / 3, threshold=0.5) == 3
    # ...but never past the cap.
    assert next_frozen(0, 12, [0.9] * 6 + [0.1] + [0.9] * 5, alpha=1 / 3, threshold=0.5) == 4
    # Nothing has stopped: nothing more freezes.
    assert next_frozen(3, 12, [0.6] * 9, alpha=1 / 3, threshold=0.5) == 3


def test_the_tracker_compares_each_layer_with_its_first_steps():
    t = GradNormTracker()
    for v in (2.0, 2.0, 2.0, 2.0, 2.0):
        t.record({"h0": v, "h1": 10 * v})
    t.new_interval()
    t.record({"h0": 0.5, "h1": 18.0})
    assert t.ratios(["h0", "h1"]) == pytest.approx([0.25, 0.9]) and t.ratios(["h2"]) == [None]
    other = GradNormTracker()
    other.record({"h2": 4.0})
    t.merge([other])
    assert t.reference["h2"] == [4.0] and t.interval["h2"] == [4.0]


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5])
def test_freeze_alpha_outside_zero_one_is_refused(alpha):
    with pytest.raises(ConfigError, match=r"--freeze-alpha must be in \(0, 1\)"):
        PipeTransformerOptions(freeze_alpha=alpha)
    with pytest.raises(ConfigError, match="freeze-alpha"):
        freeze_cap(0, 12, alpha)


def test_the_change_signal_reads_each_layers_trend_between_intervals():
    # h0's norm has settled (2.0, then 2.0 again); h1's still falls (10, then 8): only h0
    # changed by at most 10%, so only h0 counts as stopped.
    t = GradNormTracker()
    for _ in range(5):
        t.record({"h0": 2.0, "h1": 10.0})
    t.new_interval()
    assert t.previous == {"h0": 2.0, "h1": 10.0}
    for v in (1.9, 2.1):
        t.record({"h0": v, "h1": 8.0})
    assert t.changes(["h0", "h1"]) == pytest.approx([0.0, 0.2]) and t.changes(["h2"]) == [None]
    assert t.signal("change", ["h0", "h1"]) == t.changes(["h0", "h1"])
    assert t.signal("level", ["h0", "h1"]) == t.ratios(["h0", "h1"])
    assert next_frozen(0, 2, t.changes(["h0", "h1"]), alpha=0.5, threshold=0.1) == 1
    # A norm that rises counts as a change too (the layer still moves).
    t.new_interval()
    t.record({"h0": 3.0})
    assert t.changes(["h0"]) == pytest.approx([0.5])


def test_the_first_change_is_against_the_first_steps():
    # Before any interval closed, a layer's change is from its reference (first steps).
    t = GradNormTracker()
    for v in (4.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0):
        t.record({"h0": v})
    assert t.changes(["h0"]) == pytest.approx([(4.0 - 3.5) / 4.0])
    other = GradNormTracker(previous={"h1": 1.5})
    t.merge([other])
    assert t.previous["h1"] == 1.5


def test_the_first_freeze_point_never_compares_its_interval_with_itself():
    # Symptom: with --freeze-every 2 every layer's change at step 2 was 0.0 (its level 1.0),
    # so every layer counted as stopped and the cap decided, whatever the gradients did.
    # Cause: the reference was a layer's first 5 steps, which were the whole first interval
    # up to 5 steps (and most of it up to 9). It is now at most half the first interval.
    t = GradNormTracker(reference_steps=reference_length(2))
    for v in (4.0, 2.0):
        t.record({"h0": v, "h1": 1.0})
    assert t.reference == {"h0": [4.0], "h1": [1.0]}
    assert t.changes(["h0", "h1"]) == pytest.approx([0.25, 0.0])  # (3 - 4) / 4; settled
    assert t.ratios(["h0", "h1"]) == pytest.approx([0.75, 1.0])
    assert next_frozen(0, 2, t.changes(["h0", "h1"]), alpha=0.5, threshold=0.1) == 1  # the cap
    # Freeze points every 10 steps or more read the first 5, as before.
    assert reference_length(40) == reference_length(10) == GradNormTracker().reference_steps == 5
    with pytest.raises(ConfigError) as caught:
        PipeTransformerOptions(freeze_every=1)
    assert str(caught.value) == (
        "--freeze-every must be at least 2 steps (got 1): a freeze point compares each "
        "layer's gradient norms over the interval with its first steps'. HINT: pass "
        "--freeze-every 100, or leave it out for one epoch of the data")


def test_the_relative_signal_divides_out_the_freeze_points_common_level():
    # Symptom (benchmark, a freeze point every 20 steps): every layer's change sat below the
    # change signal's 0.1 at every freeze point, so the cap alone paced the freezing and the
    # loss was lost. Cause: the changes of all layers rise and fall together between freeze
    # points; the relative signal divides each by their median.
    def tracker(changes):
        t = GradNormTracker()
        for name in changes:
            t.record({name: 1.0})
        t.new_interval()
        t.record({name: 1.0 + c for name, c in changes.items()})
        return t

    # The every-20 run's step-20 changes: the embedding stands out (0.16 of the median,
    # 0.0546), so it is the only stopped layer under 0.5, and it alone freezes.
    step20 = dict(zip(["embed", "h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7"],
                      [0.0087, 0.0496, 0.0445, 0.0546, 0.0359, 0.0716, 0.076, 0.0692, 0.0679]))
    t = tracker(step20)
    layers = list(step20)
    ratios = t.signal("relative", layers)
    assert ratios == pytest.approx([c / 0.0546 for c in step20.values()])
    assert next_frozen(0, 9, ratios, alpha=1 / 3, threshold=0.5) == 1
    # The step-60 changes (4 frozen): all small (0.002-0.012, under 0.1, so `change` froze
    # up to the cap), none under half their median (0.0034): nothing freezes.
    step60 = dict(zip(["h3", "h4", "h5", "h6", "h7"], [0.0119, 0.003, 0.0022, 0.0103, 0.0034]))
    ratios = tracker(step60).signal("relative", list(step60))
    assert min(ratios) == pytest.approx(0.0022 / 0.0034)
    assert next_frozen(4, 9, ratios, alpha=1 / 3, threshold=0.5) == 4
    assert next_frozen(4, 9, tracker(step60).signal("change", list(step60)), alpha=1 / 3,
                       threshold=0.1) == 6
    # One layer left: it is its own median, 1.0; no change at all: nothing stands out.
    assert tracker({"h7": 0.0045}).signal("relative", ["h7"]) == [1.0]
    assert tracker({"h6": 0.0, "h7": 0.0}).signal("relative", ["h6", "h7"]) == [1.0, 1.0]
    assert GradNormTracker().relative_changes([]) == []


def test_an_unknown_signal_is_refused_with_the_names():
    with pytest.raises(ValueError, match="the signals are: change, level, relative"):
        GradNormTracker().signal("trend", ["h0"])
    with pytest.raises(ConfigError, match="the signals are: change, level, relative"):
        PipeTransformerOptions(freeze_signal="trend")
    assert PipeTransformerOptions().threshold == 0.1
    assert PipeTransformerOptions(freeze_signal="level").threshold == 1.0
    assert PipeTransformerOptions(freeze_signal="relative").threshold == 0.5
    assert PipeTransformerOptions(freeze_threshold=0.3).threshold == 0.3


@pytest.mark.parametrize("kind, threshold", [("level", 1.0), ("relative", 0.5)])
def test_a_layer_without_parameters_has_no_signal_and_never_counts_as_stopped(kind, threshold):
    # An activation between linear layers has no gradient norm: its 1.0 counted as stopped
    # under level's threshold of 1.0, and under relative it entered the median, so linear
    # layers whose norms grew by half froze (a review: 2 of 3 at alpha 1/3).
    t = GradNormTracker()
    linears = ["lin0", "lin1", "lin2"]
    for _ in range(5):
        t.record({n: 2.0 for n in linears})
    t.new_interval()
    t.record({"lin0": 3.0, "lin1": 3.2, "lin2": 2.8})  # every linear still learning
    layers = ["lin0", "relu0", "lin1", "relu1", "lin2", "relu2"]
    signal = t.signal(kind, layers)
    assert [s is None for s in signal] == [False, True] * 3
    assert next_frozen(0, 6, signal, alpha=1 / 3, threshold=threshold) == 0
