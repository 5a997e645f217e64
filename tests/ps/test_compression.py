"""Compressors against plain NumPy references, error feedback, momentum, the compressed store."""

import numpy as np
import pytest
import torch

from polytrain import CommError, ConfigError
from polytrain.ps import STORES, Declaration, Kind, Op
from polytrain.ps.compression import (
    Codec,
    CompressOptions,
    Dithering,
    compressor,
    pack_bits,
    unpack_bits,
)
from polytrain.ps.protocol import DTYPES, Request
from polytrain.ps.stores import WHOLE_STATE

N = 1001  # not a multiple of 8: the last byte of packed bits is padded


def data(seed=0, n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_bits_pack_as_numpy_packs_them():
    codes = torch.randint(0, 8, (N,), generator=torch.Generator().manual_seed(1))
    want = np.packbits(((codes.numpy()[:, None] >> np.arange(2, -1, -1)) & 1).reshape(-1))
    assert np.array_equal(pack_bits(codes, 3).numpy(), want)
    assert torch.equal(unpack_bits(pack_bits(codes, 3), 3, N), codes)


def test_fp16_is_numpys_half_precision():
    x = data()
    payload = compressor("fp16").encode(x)
    assert np.array_equal(payload.numpy(), x.numpy().astype(np.float16).view(np.uint8))
    assert np.array_equal(compressor("fp16").decode(payload, N).numpy(),
                          x.numpy().astype(np.float16).astype(np.float32))


# The scale per tensor (one per segment, onebit:0) and unscaled keep the reference's
# format; before the scale per block, plain "onebit" was this format too.
@pytest.mark.parametrize("name, scaled", [("onebit:0", True), ("onebit:unscaled", False)])
def test_onebit_sends_one_bit_per_sign_and_a_scale(name, scaled):
    x = data().numpy()
    c = compressor(name)
    payload = c.encode(torch.from_numpy(x)).numpy()
    scale = np.float32(np.abs(x).sum(dtype=np.float32) / x.size) if scaled else np.float32(1)
    assert payload.size == 4 + (N + 7) // 8  # 1/32 of the floats, plus the scale
    assert np.array_equal(payload[4:], np.packbits(x < 0))
    assert payload[:4].view(np.float32)[0] == pytest.approx(scale, rel=1e-6)
    s = payload[:4].view(np.float32)[0]
    want = np.where(np.unpackbits(payload[4:])[:N] == 1, -s, s).astype(np.float32)
    assert np.array_equal(c.decode(torch.from_numpy(payload), N).numpy(), want)


def onebit_reference(x, segments, block):
    """Blocks of ``block`` elements (0: whole segments) that never cross a segment; each
    block's mean |x| (summed in float64) as float32; then the sign bits, in NumPy."""
    lengths = []
    for n in segments:
        b = block or n
        lengths += [b] * (n // b) + ([n % b] if n % b else [])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    scales = np.array([np.abs(x[a:a + n]).astype(np.float64).sum() / n
                       for a, n in zip(starts, lengths)]).astype(np.float32)
    payload = np.concatenate([scales.view(np.uint8), np.packbits(x < 0)])
    decoded = np.where(x < 0, np.float32(-1), np.float32(1)) * np.repeat(scales, lengths)
    return payload, decoded


@pytest.mark.parametrize("name, block, segments", [
    ("onebit", 128, None), ("onebit", 128, (300, 1, 700)), ("onebit:64", 64, (500, 501)),
    ("onebit:0", 0, (300, 701)), ("onebit:0", 0, None)])
def test_onebit_keeps_a_scale_per_block_of_each_segment_as_numpy_does(name, block, segments):
    # Symptom: onebit with error feedback ended 58% above uncompressed on the default GPT.
    # Cause: one mean |x| for a whole partition flattens rows and tensors whose gradient
    # scales differ by orders of magnitude (rare tokens' embedding rows, fused layers).
    x = data().numpy()
    x[300:301] *= 1000.0  # a one-element tensor of a far larger scale than its neighbours
    c = compressor(name)
    payload, decoded = onebit_reference(x, segments or (N,), block)
    got = c.encode(torch.from_numpy(x), None, segments)
    assert got.numel() == c.nbytes(N, segments) == payload.size
    assert np.array_equal(got.numpy(), payload)  # bit-exact: scales, then packed signs
    assert np.array_equal(c.decode(got, N, segments).numpy(), decoded)


def test_onebits_default_payload_stays_under_a_25th_of_the_floats():
    c = compressor("onebit")
    assert c.spec() == "onebit" and c.block == 128
    for numel in (16384, 65536, 1_024_000):
        assert c.nbytes(numel) * 25 < 4 * numel
    assert c.nbytes(1000, (500, 500)) == 4 * 8 + 125  # 4 blocks each side, not 8 over both


def sparse_reference(x, index):
    payload = np.concatenate([index.astype(np.int32).view(np.uint8),
                              x[index].astype(np.float32).view(np.uint8)])
    dense = np.zeros_like(x)
    dense[index] = x[index]
    return payload, dense


@pytest.mark.parametrize("name, k", [("topk:0.01", 10), ("topk:25", 25)])
def test_topk_is_numpys_largest_magnitudes(name, k):
    x = data().numpy()
    x[:5] = 3.0  # ties: the lower index first
    payload, dense = sparse_reference(x, np.argsort(-np.abs(x), kind="stable")[:k])
    c = compressor(name)
    got = c.encode(torch.from_numpy(x))
    assert np.array_equal(got.numpy(), payload)
    assert np.array_equal(c.decode(got, N).numpy(), dense)


def test_topk_chooses_k_of_each_segment():
    # Symptom: topk over a fused partition sends the K largest of its largest-scale tensor.
    # Cause: one selection across tensors; now K (a fraction: of each tensor) per segment.
    x = data().numpy()
    x[:400] *= 100.0
    segments = (400, 601)
    index = np.concatenate([np.argsort(-np.abs(x[:400]), kind="stable")[:4],
                            400 + np.argsort(-np.abs(x[400:]), kind="stable")[:6]])
    payload, dense = sparse_reference(x, index)
    c = compressor("topk:0.01")
    got = c.encode(torch.from_numpy(x), None, segments)
    assert got.numel() == c.nbytes(N, segments) == 80
    assert np.array_equal(got.numpy(), payload)
    assert np.array_equal(c.decode(got, N, segments).numpy(), dense)


def test_randomk_draws_k_of_each_segment_in_turn():
    x = data().numpy()
    g = torch.Generator().manual_seed(7)
    index = np.concatenate([torch.randperm(400, generator=g)[:4].numpy(),
                            400 + torch.randperm(601, generator=g)[:6].numpy()])
    payload, dense = sparse_reference(x, index)
    c = compressor("randomk:0.01")
    got = c.encode(torch.from_numpy(x), torch.Generator().manual_seed(7), (400, 601))
    assert np.array_equal(got.numpy(), payload)
    assert np.array_equal(c.decode(got, N, (400, 601)).numpy(), dense)


def test_randomk_with_a_seeded_generator_is_numpys_gather_of_the_same_draw():
    x = data().numpy()
    index = torch.randperm(N, generator=torch.Generator().manual_seed(7))[:100].numpy()
    payload, dense = sparse_reference(x, index)
    c = compressor("randomk:100")
    got = c.encode(torch.from_numpy(x), torch.Generator().manual_seed(7))
    assert np.array_equal(got.numpy(), payload)
    assert np.array_equal(c.decode(got, N).numpy(), dense)


def dithering_reference(x, u, levels, natural):
    """QSGD-style stochastic rounding of |x| / max|x| between adjacent levels, in NumPy."""
    table = (np.array([0.0] + [2.0 ** (j - levels) for j in range(1, levels + 1)], np.float32)
             if natural else (np.arange(levels + 1, dtype=np.float32) / np.float32(levels)))
    norm = np.abs(x).max()
    r = np.abs(x) / norm
    low = np.clip(np.searchsorted(table, r, side="right") - 1, 0, levels - 1)
    code = low + (u < (r - table[low]) / (table[low + 1] - table[low]))
    return norm, code, np.where(x < 0, -1, 1).astype(np.float32) * (table[code] * norm)


@pytest.mark.parametrize("levels, natural", [(4, False), (2, False), (5, True)])
def test_dithering_with_a_seeded_generator_is_numpys_stochastic_rounding(levels, natural):
    x = data().numpy()
    u = torch.rand(N, generator=torch.Generator().manual_seed(3)).numpy()
    norm, code, want = dithering_reference(x, u, levels, natural)
    c = Dithering(levels=levels, natural=natural)
    got = c.encode(torch.from_numpy(x), torch.Generator().manual_seed(3))
    width = c.width
    assert got.numel() == 4 + (N * width + 7) // 8
    assert got[:4].view(torch.float32).item() == norm
    codes = ((x < 0).astype(np.int64) << (width - 1)) | code
    bits = ((codes[:, None] >> np.arange(width - 1, -1, -1)) & 1).reshape(-1)
    assert np.array_equal(got[4:].numpy(), np.packbits(bits))
    assert np.array_equal(c.decode(got, N).numpy(), want)


def test_dithering_normalises_each_segment_by_its_own_max():
    # Symptom: a small-scale tensor fused after a large one dithers to zeros nearly always.
    # Cause: one max |x| for the partition; now one per segment (4 bytes each).
    x = data().numpy()
    x[:400] *= 100.0
    u = torch.rand(N, generator=torch.Generator().manual_seed(3)).numpy()
    parts = [dithering_reference(x[:400], u[:400], 4, False),
             dithering_reference(x[400:], u[400:], 4, False)]
    c = Dithering(levels=4)
    got = c.encode(torch.from_numpy(x), torch.Generator().manual_seed(3), (400, 601))
    width = c.width
    assert got.numel() == c.nbytes(N, (400, 601)) == 8 + (N * width + 7) // 8
    assert np.array_equal(got[:8].view(torch.float32).numpy(),
                          np.array([parts[0][0], parts[1][0]], np.float32))
    code = np.concatenate([parts[0][1], parts[1][1]])
    codes = ((x < 0).astype(np.int64) << (width - 1)) | code
    bits = ((codes[:, None] >> np.arange(width - 1, -1, -1)) & 1).reshape(-1)
    assert np.array_equal(got[8:].numpy(), np.packbits(bits))
    assert np.array_equal(c.decode(got, N, (400, 601)).numpy(),
                          np.concatenate([parts[0][2], parts[1][2]]))


def test_dithering_is_unbiased():
    x = data(n=64)
    c = Dithering(levels=2)
    g = torch.Generator().manual_seed(0)
    mean = sum(c.decode(c.encode(x, g), 64) for _ in range(4000)) / 4000
    assert torch.allclose(mean, x, atol=0.05 * float(x.abs().max()))


def test_each_machine_dithers_with_draws_of_its_own_and_randomk_draws_the_servers():
    # Eight machines push the same gradient. Dithered with the same draws (before stop 48:
    # every codec of a key was seeded with the key alone), every machine rounds alike and
    # their mean is as far off as one machine's; with draws of their own the errors
    # average out (1/sqrt(8) of one's, in expectation).
    x, machines = data(n=4096), range(8)
    dithering = CompressOptions(compressor("dithering:2"))
    codecs = [Codec(dithering, x.numel(), seed=5, stream=rank) for rank in machines]
    payloads = [c.encode(x) for c in codecs]
    sent = [c.decode(p) for c, p in zip(codecs, payloads)]
    one = float((sent[0] - x).pow(2).mean())
    mean = float((sum(sent) / len(sent) - x).pow(2).mean())
    assert mean < 0.25 * one, (mean, one)
    # Still the same draws run to run.
    again = Codec(dithering, x.numel(), seed=5, stream=3)
    assert torch.equal(again.encode(x), payloads[3])
    # randomk keeps drawing the server's elements on every machine, so their sum has K.
    randomk = CompressOptions(compressor("randomk:16"))
    server = Codec(randomk, x.numel(), seed=5)
    chosen = {tuple(torch.nonzero(c.decode(c.encode(x))).flatten().tolist())
              for c in [server] + [Codec(randomk, x.numel(), seed=5, stream=r) for r in machines]}
    assert len(chosen) == 1


def test_error_feedback_carries_what_compression_dropped_to_the_next_step():
    c = compressor("topk:1")
    codec = Codec(CompressOptions(c, error_feedback=True), 4)
    first = codec.decode(codec.encode(torch.tensor([1.0, 0.5, 0.25, 0.0])))
    assert first.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert codec.residual is not None and codec.residual.tolist() == [0.0, 0.5, 0.25, 0.0]
    second = codec.decode(codec.encode(torch.tensor([0.0, 0.625, 0.0, 0.0])))
    assert second.tolist() == [0.0, 1.125, 0.0, 0.0]  # 0.625 + the 0.5 kept from step one
    # Over many steps, nothing is lost: the sum of what was sent trails the input's by the
    # residual only.
    codec = Codec(CompressOptions(compressor("onebit"), error_feedback=True), N)
    sent, given = torch.zeros(N), torch.zeros(N)
    for step in range(50):
        g = data(step)
        given += g
        sent += codec.decode(codec.encode(g))
    assert torch.allclose(given - sent, codec.residual, atol=1e-4)


@pytest.mark.parametrize("name, bad, momentum", [
    *((n, b, 0.5) for n in ("fp16", "onebit", "dithering:4", "topk:0.5", "randomk:4")
      for b in (float("inf"), float("nan"))),
    ("fp16", 7e4, 0.0),  # finite, past float16's range: sent as inf
])
def test_a_step_with_an_inf_or_nan_is_sent_as_it_is_and_spoils_no_later_step(name, bad,
                                                                              momentum):
    # AMP's gradient scaler makes such steps on purpose and skips them: one of them stayed
    # in error feedback's residual (and the momentum's velocity), and every later step
    # came back inf or nan, so the scaler skipped every step from there on.
    options = CompressOptions(compressor(name), error_feedback=True, momentum=momentum)
    codec, clean = Codec(options, 8), Codec(options, 8)
    first = torch.linspace(-1, 1, 8)
    for c in (codec, clean):
        c.decode(c.encode(first))
    spoiled = first.clone()
    spoiled[0] = bad
    sent = codec.decode(codec.encode(spoiled))
    assert not torch.isfinite(sent).all() or name.startswith("randomk")  # the scaler sees it
    clean.generator.set_state(codec.generator.get_state())  # the same draws from here on
    for step in range(3):
        g = torch.full((8,), 0.25 * (step + 1))
        assert torch.equal(codec.decode(codec.encode(g)), clean.decode(clean.encode(g))), step


def test_nesterov_momentum_on_the_worker_is_the_reference_wrappers():
    codec = Codec(CompressOptions(compressor("fp16"), momentum=0.5), 2)
    m = torch.zeros(2)
    for g in (torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])):
        m = 0.5 * m + g
        assert torch.equal(codec.decode(codec.encode(g)), (g + 0.5 * m).half().float())


@pytest.mark.parametrize("name", ["randomk:50", "dithering:4", "onebit"])
def test_a_codecs_state_carries_its_residual_velocity_and_draws_to_another_codec(name):
    # What a checkpoint holds of a codec: a codec loaded with it encodes the next steps as
    # the first one does, bit for bit (randomk and dithering draw from the generator).
    options = CompressOptions(compressor(name), error_feedback=True, momentum=0.9)
    codec = Codec(options, N, seed=7)
    fresh = Codec(options, N, seed=7)
    assert fresh.state().numel() == Codec.state_bytes(N)
    for step in range(3):
        codec.encode(data(step))
    copy = Codec(options, N, seed=7)
    copy.load_state(codec.state())
    for step in range(3, 6):
        assert torch.equal(copy.encode(data(step)), codec.encode(data(step)))
    # Without the state, the next payload differs (this test could fail).
    assert not torch.equal(fresh.encode(data(6)), codec.encode(data(6)))
    with pytest.raises(ConfigError, match=f"takes {Codec.state_bytes(N + 1)} bytes, not "
                                          f"{Codec.state_bytes(N)} "):
        Codec(options, N + 1).load_state(codec.state())


def test_a_codec_with_no_residual_yet_keeps_none_through_its_state():
    codec = Codec(CompressOptions(compressor("onebit"), error_feedback=True), N)
    copy = Codec(CompressOptions(compressor("onebit"), error_feedback=True), N)
    copy.load_state(codec.state())
    assert copy.residual is None and copy.velocity is None


@pytest.mark.parametrize("text, message", [
    ("topk:0", r"topk:0: K must be a count"), ("topk:inf", r"topk:inf: K must be a count"),
    ("dithering:1", r"dithering:1: dithering takes S levels, 2 or more"),
    ("zip", r"unknown compressor 'zip'; the compressors are: none, onebit, topk, randomk, "
            r"dithering, fp16. HINT"), ("randomk:-3", "randomk:-3: K must be"),
    ("fp16:2", "fp16 takes no argument"),
    ("onebit:x", r"onebit:x: onebit takes B, the elements per scale \(default 128"),
    ("onebit:scaled:2", "onebit:scaled:2: onebit takes B")])
def test_bad_compressors_are_refused_with_the_rule(text, message):
    with pytest.raises(ConfigError, match=message):
        compressor(text)


def push(src, payload, key=1):
    return Request(src, Op.PUSHPULL, key, 0, payload.numel(), DTYPES[6], seq=1, lane=0,
                   payload=payload)


@pytest.mark.parametrize("name", ["onebit", "topk:0.05", "dithering:4", "fp16", "randomk:50"])
def test_the_compressed_store_decodes_sums_in_rank_order_and_compresses_again(name):
    c = compressor(name)
    decl = Declaration(key=1, kind=int(Kind.COMPRESSED), name="w", numel=c.nbytes(N),
                       dtype="torch.uint8", pushers=3, pullers=3,
                       options=CompressOptions(c, error_feedback=True).declaration(N))
    out = []
    store = STORES[Kind.COMPRESSED](decl, lambda req, t: out.append(t.clone()))
    # The same shape at scales 1, 1000, 1 (so sparse codecs keep the same elements, and
    # a random one draws the same ones): float32 sums in another order round differently.
    pushes = [c.encode((data(0) + 1e-3 * data(s + 1)) * scale, torch.Generator().manual_seed(1))
              for s, scale in enumerate((1.0, 1000.0, 1.0))]
    decoded = [c.decode(p, N) for p in pushes]
    total = (decoded[0] + decoded[1]) + decoded[2]  # ranks 2, 3, 4
    if name.split(":")[0] in ("onebit", "topk", "randomk"):  # fp16's and dithering's few
        # mantissa bits add exactly in any order; these would show an arrival-order sum.
        assert not torch.equal(total, (decoded[2] + decoded[0]) + decoded[1])
    for src in (4, 2, 3):
        store.handle(push(src, pushes[src - 2]))
    server = Codec(CompressOptions(c, error_feedback=True), N, seed=1)  # the store's own
    want = server.encode(total)
    assert len(out) == 3 and all(torch.equal(o, want) for o in out)
    assert store.codec.residual is not None
    assert torch.equal(store.codec.residual, server.residual)


@pytest.mark.timeout(30)
def test_the_compressed_store_keeps_the_declared_segments():
    c = compressor("onebit")
    segments = (300, 701)
    decl = Declaration(key=1, kind=int(Kind.COMPRESSED), name="w..v",
                       numel=c.nbytes(N, segments), dtype="torch.uint8", pushers=1, pullers=1,
                       options=CompressOptions(c, error_feedback=True).declaration(N, segments))
    assert decl.options["segments"] == [300, 701]
    out = []
    store = STORES[Kind.COMPRESSED](decl, lambda req, t: out.append(t.clone()))
    push_ = c.encode(data(0), None, segments)
    store.handle(push(2, push_))
    want = Codec(CompressOptions(c, error_feedback=True), N, seed=1, segments=segments)
    assert out and torch.equal(out[0], want.encode(c.decode(push_, N, segments)))


def test_fused_tensors_bounds_cut_a_partition_into_segments():
    opts = CompressOptions(compressor("onebit"), bounds=(0, 300, 700))
    assert opts.segments(0, N) == (300, 400, 301)
    assert opts.segments(100, 150) is None  # inside one tensor
    assert opts.segments(250, 500) == (50, 400, 50)
    with pytest.raises(ConfigError, match=r"segments \[3, 3\] must be positive lengths that "
                                          r"add up to the payload's 7 elements"):
        Codec(CompressOptions(compressor("onebit")), 7, segments=(3, 3))


def test_the_compressed_stores_codec_state_comes_back_with_a_set_of_its_size():
    # A checkpoint reads the server's codec (its error feedback's residual and draws) with a
    # GET of WHOLE_STATE and a resumed run's fresh server takes it back with a SET.
    c = compressor("randomk:50")
    decl = Declaration(key=1, kind=int(Kind.COMPRESSED), name="w", numel=c.nbytes(N),
                       dtype="torch.uint8", pushers=1, pullers=1,
                       options=CompressOptions(c, error_feedback=True).declaration(N))
    out: list[torch.Tensor] = []
    first = STORES[Kind.COMPRESSED](decl, lambda req, t: out.append(t.clone()))
    for step in range(2):
        first.handle(push(2, c.encode(data(step), torch.Generator().manual_seed(step))))
    first.handle(Request(2, Op.GET, 1, WHOLE_STATE, 0, DTYPES[6], seq=9, lane=0))
    state = out[-1]
    assert state.numel() == Codec.state_bytes(N)
    second = STORES[Kind.COMPRESSED](decl, lambda req, t: out.append(t.clone()))
    second.handle(Request(2, Op.SET, 1, 0, state.numel(), DTYPES[6], seq=10, lane=0,
                          payload=state))
    nxt = c.encode(data(5), torch.Generator().manual_seed(5))
    first.handle(push(2, nxt))
    second.handle(push(2, nxt))
    assert torch.equal(out[-1], out[-2])
    with pytest.raises(CommError, match="a SET restores the codec's state"):
        second.handle(Request(2, Op.SET, 1, 0, 3, DTYPES[6], seq=11, lane=0,
                              payload=torch.zeros(3, dtype=torch.uint8)))


@pytest.mark.parametrize("name", ["topk:1234567", "topk:0.0123456789", "randomk:0.01",
                                  "topk:25", "randomk:1e-05"])
def test_a_compressors_spec_keeps_every_digit(name):
    # ":g" kept six digits: topk:1234567 reached the servers as topk:1.23457e+06, K 1234570,
    # and their byte count differed from the worker's.
    c = compressor(name)
    assert compressor(c.spec()) == c and c.spec() == name
