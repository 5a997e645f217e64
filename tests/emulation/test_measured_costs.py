"""Measured layer costs (``--layer-costs measured``): each layer's times on this device."""

import collections

import pytest
import torch

from polytrain import ConfigError
from polytrain.emulation.profile import measure_layers, profile_model, with_measured_costs
from polytrain.pipeline.assembly import check_layer_costs, layer_profile
from tests.harness import Sleepy


def _model():
    torch.manual_seed(0)
    # The sleepy layer's dropout draws from the random stream; the batch norm has statistics.
    # By FLOPs the sleepy layer is the second cheapest; in time, the most expensive.
    return torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.BatchNorm1d(128),
                               torch.nn.Linear(128, 16), Sleepy(16, 0.01, p=0.5),
                               torch.nn.Linear(16, 8))


@pytest.mark.timeout(60)
def test_a_slow_layer_is_measured_slow_and_the_model_is_left_as_it_was():
    model = _model()
    sample = torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    seconds = measure_layers(model, sample, repeats=3)
    assert len(seconds) == 5
    # 10 ms a call over 4 samples: at least 2.5 ms a sample, far above the other layers.
    assert seconds[3][0] >= 0.01 / 4
    assert seconds[3][0] > 10 * max(seconds[i][0] for i in (0, 1, 2, 4))
    assert all(f > 0 and b > 0 for f, b in seconds)  # every output here carries a gradient
    # The model's weights, buffers and gradients, and the random stream, are untouched.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_model_with_a_batch_norm_is_profiled_per_sample():
    # It was refused: the profile ran a batch of one, which a batch norm in training rejects.
    profile = profile_model(_model(), torch.randn(1, 8))
    assert profile.names == ("0", "1", "2", "3", "4")
    assert profile.layers[0].fwd_flops == 2 * 8 * 128  # a Linear's multiply-adds per sample
    assert profile.layers[2].fwd_flops == 2 * 128 * 16
    assert profile.layers[1].out_shape == (128,) and profile.layers[1].out_bytes == 128 * 4


def test_measured_costs_keep_the_total_and_follow_the_times():
    profile = profile_model(_model(), torch.randn(1, 8))
    seconds = [(1.0, 2.0), (1.0, 1.0), (5.0, 0.5), (0.25, 0.25), (0.5, 0.5)]
    measured = with_measured_costs(profile, seconds)
    assert sum(x.flops for x in measured.layers) == pytest.approx(profile.flops)
    scale = profile.flops / 12.0
    assert [c for x in measured.layers for c in (x.fwd_flops, x.bwd_flops)] == pytest.approx(
        [c * scale for f, b in seconds for c in (f, b)])
    # What a stage receives is the FLOPs profile's: only the costs change.
    assert [x.out_shape for x in measured.layers] == [x.out_shape for x in profile.layers]
    with pytest.raises(ValueError):
        with_measured_costs(profile, seconds[:4])


@pytest.mark.timeout(60)
def test_layer_profile_in_one_process_and_its_refusal():
    model = _model()
    flops, none = layer_profile(model, torch.randn(4, 8), costs="flops", group=None, owner="x")
    assert none is None and flops == profile_model(model, torch.randn(1, 8))
    measured, seconds = layer_profile(model, torch.randn(4, 8), costs="measured", group=None,
                                      owner="x")
    assert len(seconds) == 5 and all(f > 0 and b > 0 for f, b in seconds)
    # Times given (a checkpoint's) are used as they are: nothing is measured.
    given = [(1.0, 1.0)] * 4 + [(6.0, 0.0)]
    again, kept = layer_profile(model, torch.randn(4, 8), costs="measured", group=None,
                                owner="x", seconds=given)
    assert kept == given and again == with_measured_costs(flops, given)
    slowest = max(range(5), key=lambda i: measured.layers[i].fwd_flops)
    assert slowest == 3 and max(range(5), key=lambda i: flops.layers[i].fwd_flops) != 3
    with pytest.raises(ConfigError, match="unknown layer cost 'timed'.*flops, measured"):
        check_layer_costs("timed")


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h):
        h = h[0] if isinstance(h, tuple) else h
        return self.lin(h), h.sum()


_Out = collections.namedtuple("_Out", "h s")


class _NamedPair(_Pair):
    def forward(self, h):
        h = h[0] if isinstance(h, tuple) else h
        return _Out(self.lin(h), h.sum())


class _First(torch.nn.Module):
    def forward(self, h):
        return h[0]


def test_layers_that_hand_the_next_a_tuple_are_measured():
    # A pipeline keeps such a pair inside one stage (only a cut after it is refused), but
    # --layer-costs measured failed on it: "'tuple' object has no attribute 'detach'".
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Pair(), _Pair(), _First(),
                                torch.nn.Linear(4, 2))
    times = measure_layers(model, torch.randn(8, 4), repeats=1)
    assert len(times) == 5 and all(f > 0 for f, _ in times)
    assert times[1][1] > 0 and times[2][1] > 0  # the pairs' backward, from both outputs
    # A namedtuple is rebuilt field by field (its type takes no single iterable).
    named = torch.nn.Sequential(torch.nn.Linear(4, 4), _NamedPair(), _NamedPair(), _First(),
                                torch.nn.Linear(4, 2))
    assert all(f > 0 for f, _ in measure_layers(named, torch.randn(8, 4), repeats=1))
