"""Compressed BytePS end to end: bytes on the wire and training, sync and async (fp16)."""

import pytest

from polytrain import TrainConfig
from tests.harness import max_abs_diff, run_cached, run_config, single_of

TINY = {"seq_len": 16, "d_model": 64, "layers": 2}


def config(**options):
    return TrainConfig(strategy="byteps", workers=2, nodes=2, servers=1, steps=5, batch_size=8,
                       optimizer="adam", lr=3e-3, model_options=TINY,
                       strategy_options=options)


def wire(metrics):
    return sum(m["sent_bytes_per_step"] for m in metrics["traffic"]["machines"])


@pytest.mark.timeout(180)
def test_onebit_with_error_feedback_sends_a_32nd_and_still_trains():
    plain, _ = run_cached(config())
    # Every tensor of at least 4 KiB compressed (a tiny model: the default is 64 KiB).
    # onebit:0, a scale per tensor: 1/32 of the floats, headers and small tensors.
    metrics, _ = run_config(config(compress="onebit:0", error_feedback=True,
                                   compress_min_bytes=4096))
    assert wire(metrics) < wire(plain) / 20
    assert metrics["final_loss"] < metrics["losses"][0]
    # The default, a scale per 128 elements: 1/32 of the floats again for the scales
    # (1/25.6 in all), so 1/16 with the headers and the small tensors of this tiny model.
    metrics, _ = run_config(config(compress="onebit", error_feedback=True,
                                   compress_min_bytes=4096))
    assert wire(metrics) < wire(plain) / 16
    assert metrics["final_loss"] < metrics["losses"][0]


@pytest.mark.timeout(180)
def test_fp16_halves_the_bytes_in_async_mode_too():
    sync, _ = run_config(config(compress="fp16", compress_min_bytes=0))  # every tensor
    assert wire(sync) == pytest.approx(wire(run_cached(config())[0]) / 2, rel=0.05)
    c = config(async_=True, compress="fp16", error_feedback=True).replace(optimizer="sgd",
                                                                          lr=0.05)
    metrics, final = run_config(c)
    _, single = run_config(single_of(c))
    assert max_abs_diff(single, final) < 1e-3  # half-precision updates, errors fed back


@pytest.mark.timeout(180)
def test_fused_compressed_tensors_keep_their_own_scales_on_the_wire():
    # Symptom: one scale (or max, or top-K) over a fused partition flattened its tensors'
    # different gradient scales. Cause: the codec did not know the tensors' bounds; now the
    # handler's and the server's codecs get them (segments in the declaration) and agree.
    plain, _ = run_cached(config())
    metrics, _ = run_config(config(compress="onebit", error_feedback=True,
                                   compress_min_bytes=0))  # every tensor: fused, in segments
    assert wire(metrics) < wire(plain) / 20
    assert metrics["final_loss"] < metrics["losses"][0]
