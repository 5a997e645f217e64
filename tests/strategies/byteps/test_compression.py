"""Compressed BytePS end to end: bytes on the wire and training, sync and async (fp16)."""

from types import SimpleNamespace

import pytest
import torch

import polytrain
import polytrain.byteps as bps
from polytrain import ConfigError, TrainConfig
from polytrain.comm.partition import TensorSpec
from polytrain.ps.compression import CompressOptions, compressor
from polytrain.strategies.byteps.optimizer import FROZEN_VARIANCE, _OneBitAdam, tensor_compression
from tests.harness import max_abs_diff, run_cached, run_config, single_of, spawn

TINY = {"seq_len": 16, "d_model": 64, "layers": 2}


def config(**options):
    return TrainConfig(strategy="byteps", workers=2, nodes=2, servers=1, steps=5, batch_size=8,
                       optimizer="adam", lr=3e-3, model_options=TINY,
                       strategy_options=options)


def wire(metrics):
    return sum(m["sent_bytes_per_step"] for m in metrics["traffic"]["machines"])


@pytest.mark.long  # (moved to the long tier to keep CI short)
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


@pytest.mark.long  # (moved to the long tier to keep CI short)
@pytest.mark.timeout(180)
def test_fp16_halves_the_bytes_in_async_mode_too():
    sync, _ = run_config(config(compress="fp16", compress_min_bytes=0))  # every tensor
    assert wire(sync) == pytest.approx(wire(run_cached(config())[0]) / 2, rel=0.05)
    c = config(async_=True, compress="fp16", error_feedback=True).replace(optimizer="sgd",
                                                                          lr=0.05)
    metrics, final = run_config(c)
    _, single = run_config(single_of(c))
    assert max_abs_diff(single, final) < 1e-3  # half-precision updates, errors fed back
    _, untrained = run_config(single_of(c).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 1e-2  # ... of updates that moved the weights


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


@pytest.mark.timeout(180)
def test_a_compression_warmup_sends_plain_sums_first_and_one_bit_adam_then_trains():
    # Symptom: onebit with Adam ended 11-12% above uncompressed on the default GPT (Adam's
    # variance of signs is the block's scale, not the element's). 1-bit Adam's remedy: an
    # uncompressed warm-up, then the momentum compressed and the variance frozen.
    plain, _ = run_cached(config())
    metrics, _ = run_config(config(compress="onebit", error_feedback=True,
                                   compress_min_bytes=4096, compress_warmup=2,
                                   compress_adam=True).replace(steps=6))
    by_step = metrics["traffic"]["sent_bytes_by_step"]
    assert len(by_step) == 6
    assert by_step[1] == pytest.approx(wire(plain), rel=0.05)  # the warm-up: plain sums
    assert max(by_step[2:]) < wire(plain) / 16                 # then onebit's bytes
    assert metrics["final_loss"] < metrics["losses"][0]


@pytest.mark.long  # (moved to the long tier to keep CI short)
@pytest.mark.timeout(240)
def test_a_warmup_compressed_by_another_compressor_moves_that_compressors_bytes():
    # 1-bit Adam's uncompressed warm-up cost a fifth of the run's bytes on the default GPT;
    # --compress-warmup-with packs the warm-up's keys with a compressor of its own. Its
    # steps move what a run compressed by that compressor throughout moves (the same
    # tensors, sizes and messages), and the steps after it onebit's. (Not with 1-bit Adam:
    # after dithering's warm-up it diverges, docs/from-byteps.md.)
    packed = {"error_feedback": True, "compress_min_bytes": 4096}
    dithered, _ = run_config(config(compress="dithering:4", **packed))
    metrics, _ = run_config(config(compress="onebit", compress_warmup=3,
                                   compress_warmup_with="dithering:4",
                                   **packed).replace(steps=6))
    by_step = metrics["traffic"]["sent_bytes_by_step"]
    assert by_step[1:3] == pytest.approx([wire(dithered)] * 2, rel=1e-3)  # dithering:4's
    plain = wire(run_cached(config())[0])
    assert wire(dithered) < plain / 3
    assert max(by_step[3:]) < plain / 16                                  # then onebit's
    assert metrics["final_loss"] < metrics["losses"][0]


class _Sync:
    """What 1-bit Adam reads of a GradientSync: one compressed parameter, warmed up."""

    def __init__(self, p, warmup=1):
        self.warmup, self.params, self.compressing = warmup, [p], False
        self.buckets, self.packed = [SimpleNamespace(members=[0])], [0]  # bucket 0 packed
        self.compression = [CompressOptions(compressor("onebit"), error_feedback=True)]


@pytest.mark.timeout(30)
def test_one_bit_adam_pushes_the_momentum_and_steps_with_the_frozen_variance():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    adam = torch.optim.Adam([p], lr=0.1)
    sync = _Sync(p)
    onebit = _OneBitAdam(adam, sync)
    g0 = torch.randn(8)
    assert onebit.local_momentum(0, g0) is g0  # the warm-up pushes the gradient
    p.grad = g0.clone()
    adam.step()                                 # the warm-up's step is Adam's
    m, v = adam.state[p]["exp_avg"].clone(), adam.state[p]["exp_avg_sq"].clone()
    sync.compressing = True
    g1 = torch.randn(8)
    pushed = onebit.local_momentum(0, g1)
    assert torch.allclose(pushed, 0.9 * m + 0.1 * g1)
    before = p.detach().clone()
    p.grad = pushed.clone()                     # what the servers' average would be, exact
    onebit.step()
    frozen = (v / (1 - 0.999)).sqrt() + 1e-8    # the bias-corrected variance of step 1
    assert torch.allclose(p.detach(), before - 0.1 * pushed / frozen)
    assert torch.allclose(adam.state[p]["exp_avg"], pushed)
    assert torch.equal(adam.state[p]["exp_avg_sq"], v)  # frozen
    assert p.grad is not None


@pytest.mark.timeout(30)
def test_one_bit_adam_follows_the_groups_after_the_optimizer_state_is_loaded():
    # Symptom: after bps.broadcast_optimizer_state, a scheduler's lr of 0 still moved the
    # compressed weights (by 105, then 5363). Cause: 1-bit Adam kept the param-group dicts
    # of the wrap, and load_state_dict (which the broadcast calls) puts new ones in place.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    adam = torch.optim.Adam([p], lr=0.1)
    sync = _Sync(p)
    onebit = _OneBitAdam(adam, sync)
    p.grad = torch.randn(8)
    adam.step()                                 # the warm-up
    adam.load_state_dict(adam.state_dict())     # new group dicts, as the broadcast's
    adam.param_groups[0]["lr"] = 0.0            # a scheduler's
    adam.param_groups[0]["betas"] = (0.5, 0.999)
    sync.compressing = True
    m = adam.state[p]["exp_avg"].clone()
    g = torch.randn(8)
    pushed = onebit.local_momentum(0, g)
    assert torch.allclose(pushed, 0.5 * m + 0.5 * g)  # the group's beta1 now
    before = p.detach().clone()
    p.grad = pushed.clone()
    onebit.step()
    assert torch.equal(p.detach(), before)      # lr 0: no move
    assert torch.equal(adam.state[p]["exp_avg"], pushed)  # and it did step


class _Averaging(_Sync):
    """A compressed bucket of two parameters whose average() is the mean of this worker's
    values and another worker's (``other``), as the servers' exact sum would give."""

    def __init__(self, params, warmup, other):
        super().__init__(params[0], warmup)
        self.params, self.packed, self.synced, self.other = params, [0], 0, other
        self.buckets = [SimpleNamespace(members=[0, 1], offsets=[0, params[0].numel()],
                                        numel=sum(p.numel() for p in params))]

    def average(self, values):
        return [(v + o) / 2 for v, o in zip(values, self.other)]


@pytest.mark.timeout(30)
def test_one_bit_adam_renews_the_frozen_variance_from_the_workers_own_variances():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(5))]
    adam = torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.99))
    other = [torch.rand(8)]                      # the other worker's variance buffer
    sync = _Averaging(params, warmup=2, other=other)
    onebit = _OneBitAdam(adam, sync, refresh=4)
    refreshed = []
    for step in range(80):                       # W = 2, F = 4: frozen at 2, 6, 18, 66
        sync.synced = step + 1                    # as after synchronize()
        refreshed.append(onebit.refreshing())
    assert [s for s, r in enumerate(refreshed) if r] == [2, 6, 18, 66]
    mine = torch.zeros(8)
    other[0][7] = 0.0                            # (params[1][4] on the other worker too)
    for step in range(7):                        # steps 0, 1: the warm-up; 2, 6: frozen
        g0, g1 = torch.randn(3), torch.randn(5)
        if step < 6:                              # an element no gradient reaches before 6
            g1[4] = 0.0
        sync.compressing, sync.synced = step >= 2, step
        flat = torch.cat([g0, g1])
        mine.mul_(0.99).addcmul_(flat, flat, value=0.01)
        pushed = [onebit.local_momentum(i, g) for i, g in enumerate((g0, g1))]
        for p, x in zip(params, pushed):
            p.grad = x.clone()
        sync.synced = step + 1
        before = [p.detach().clone() for p in params]
        if sync.compressing:
            onebit.step()
        else:
            adam.step()
        if step == 2:                             # the first freeze: both workers' mean
            at_2 = ((mine + other[0]) / 2 / (1 - 0.99 ** 3)).sqrt() + 1e-8
            assert torch.allclose(adam.state[params[0]][FROZEN_VARIANCE], at_2[:3])
            assert adam.state[params[1]][FROZEN_VARIANCE][4] == float("inf")  # variance 0: no step
            assert params[1][4] == before[1][4]
            # Adam's state carries it, as of its step count (3 after this step).
            assert torch.allclose(adam.state[params[0]]["exp_avg_sq"],
                                  (at_2[:3] - 1e-8) ** 2 * (1 - 0.99 ** 3))
    assert torch.allclose(onebit.local_v[0], mine)   # the EMA of this worker's g^2
    want = ((mine + other[0]) / 2 / (1 - 0.99 ** 7)).sqrt() + 1e-8
    assert torch.allclose(adam.state[params[0]][FROZEN_VARIANCE], want[:3])
    assert torch.allclose(adam.state[params[1]][FROZEN_VARIANCE], want[3:])
    # Step 6's update already divides by the renewed variance.
    assert torch.allclose(params[1].detach(), before[1] - 0.01 * pushed[1] / want[3:])


@pytest.mark.timeout(180)
def test_a_renewed_variance_costs_one_exact_sum_at_its_steps_and_trains():
    # 1-bit Adam froze the variance of the warm-up's exact sums, which took 75-100
    # uncompressed steps on the default GPT; --compress-adam-refresh F freezes it at steps
    # W, W + F^k from the workers' own variances, each time one exact sum of the
    # compressed tensors, and needs no warm-up (W = 0: Adam's state starts at the first).
    plain = wire(run_cached(config())[0])
    metrics, _ = run_config(config(compress="onebit", error_feedback=True,
                                   compress_min_bytes=4096, compress_adam=True,
                                   compress_adam_refresh=2).replace(steps=7))
    by_step = metrics["traffic"]["sent_bytes_by_step"]
    assert max(by_step[s] for s in (1, 3, 5, 6)) < plain / 16   # onebit's bytes only
    for s in (2, 4):                           # W + F and W + F^2: onebit's + an exact sum
        assert 0.85 * plain < by_step[s] < 1.1 * plain, (s, by_step[s], plain)
    assert by_step[0] > 0.85 * plain           # W = 0 (with the start-up's messages)
    assert metrics["final_loss"] < metrics["losses"][0]


def one_bit_adam(model=None, adam=None, **options):
    """The one-bit Adam tests' model (seed 0) and its optimizer: Adam, onebit with error
    feedback on tensors of 4 KB and more, 1-bit Adam with ``options`` (on ``model`` and its
    ``adam``, where given)."""
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 32))
    adam = adam or torch.optim.Adam(model.parameters(), lr=0.01)
    opt = bps.DistributedOptimizer(adam,
                                   named_parameters=model.named_parameters(),
                                   compression="onebit", error_feedback=True,
                                   compress_min_bytes=4096, compress_adam=True, **options)
    return model, opt


def backward_on_a_batch(model, opt, g):
    """Gradients of a batch drawn from ``g`` (learning x -> x reversed), for ``opt``'s step."""
    opt.zero_grad()
    x = torch.randn(8, 32, generator=g)
    torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()


def train_with_a_renewed_variance():
    ctx = polytrain.init()
    model, opt = one_bit_adam(compress_adam_refresh=2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(100 + ctx.rank)  # each worker its own data
    for _ in range(6):                                # frozen at steps 0, 2 and 4
        backward_on_a_batch(model, opt, g)
        opt.step()
    return initial, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
def test_every_worker_freezes_the_same_variance_and_ends_with_the_same_weights():
    # Each worker's own variance differs (its own data); what it freezes is the workers'
    # mean, so the replicas stay equal to the last bit.
    out = spawn(train_with_a_renewed_variance, workers=3, nodes=3, colocated=1)
    (initial, first), *others = out
    for _, final in others:
        for k, v in final.items():
            assert torch.equal(v, first[k]), k
    assert max_abs_diff(initial, first) > 1e-3       # and they did train


@pytest.mark.timeout(30)
def test_one_bit_adam_refuses_other_optimizers_and_no_warmup():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ConfigError, match=r"runs on torch.optim.Adam, not SGD.*HINT: use "
                                          r"--optimizer adam"):
        _OneBitAdam(torch.optim.SGD([p], lr=0.1), _Sync(p))
    with pytest.raises(ConfigError, match=r"supports plain Adam only .*weight_decay"):
        _OneBitAdam(torch.optim.Adam([p], weight_decay=0.1), _Sync(p))
    with pytest.raises(ConfigError, match=r"compress_warmup is 0.*HINT: pass --compress-warmup"):
        _OneBitAdam(torch.optim.Adam([p]), _Sync(p, warmup=0))


def test_one_bit_adam_on_another_optimizer_is_refused_before_any_process_starts():
    from polytrain import TrainConfig

    with pytest.raises(ConfigError, match=r"runs on torch.optim.Adam, not SGD"):
        TrainConfig(strategy="byteps", optimizer="sgd", workers=2,
                    strategy_options={"compress": "onebit", "compress_adam": True,
                                      "compress_warmup": 2})
    TrainConfig(strategy="byteps", optimizer="adam", workers=2,
                strategy_options={"compress": "onebit", "compress_adam": True,
                                  "compress_warmup": 2})


def freeze_during_one_bit_adam():
    """1-bit Adam past its warm-up; the first layer's weight frozen after the wrap."""
    polytrain.init()
    model, opt = one_bit_adam(compress_warmup=1)
    g = torch.Generator().manual_seed(1)
    at_freeze = None
    for step in range(4):
        if step == 2:
            model[0].weight.requires_grad_(False)
            at_freeze = model[0].weight.detach().clone()
        backward_on_a_batch(model, opt, g)
        opt.step()
    return at_freeze, model[0].weight.detach().clone()


@pytest.mark.timeout(120)
def test_a_weight_frozen_during_one_bit_adam_stays_where_it_froze():
    # Its gradient came back as zeros and 1-bit Adam moved it; once .grad stayed None (as
    # in one process), 1-bit Adam's step stopped the run on a bare assert.
    for at_freeze, end in spawn(freeze_during_one_bit_adam, workers=2, nodes=2, colocated=1):
        assert torch.equal(at_freeze, end)


def one_bit_adam_synchronized_first(first: bool, warmup: int) -> dict[str, torch.Tensor]:
    """1-bit Adam past a warm-up of ``warmup`` steps; each step's gradients synchronised
    before its step() where ``first`` (Horovod's recipe for clipping), else by the step."""
    ctx = polytrain.init()
    model, opt = one_bit_adam(compress_warmup=warmup)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(4):
        backward_on_a_batch(model, opt, g)
        if first:
            opt.synchronize()
        opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    refused = ""
    if first:  # past the warm-up, .grad holds the averaged momentum: unscaling it is refused
        backward_on_a_batch(model, opt, g)
        opt.synchronize()
        model[0].weight.grad.div_(1024.0)  # what a GradScaler's unscale_ does
        try:
            opt.step()
        except ConfigError as e:
            refused = str(e)
    return weights, refused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("warmup", [1, 2])
def test_one_bit_adam_steps_alike_whether_synchronize_came_before_the_step(warmup):
    # The phase was read in step(), after synchronize() had counted the step: the warm-up's
    # last step (pushed exact) was taken for a compressed one, its Adam update skipped and
    # its momentum overwritten (and with a warm-up of 1, a KeyError).
    # Past the warm-up, .grad after synchronize() is Adam's averaged momentum, which the step
    # copied into exp_avg: unscaling or clipping it there gave other weights (1.455 apart at
    # a scale of 1024), so a change to it is refused.
    by_step, _ = spawn(one_bit_adam_synchronized_first, workers=2, nodes=2, colocated=1,
                       args=(False, warmup))[0]
    first, refused = spawn(one_bit_adam_synchronized_first, workers=2, nodes=2, colocated=1,
                           args=(True, warmup))[0]
    for k, v in by_step.items():
        assert torch.equal(first[k], v), (k, max_abs_diff(first, by_step))
    assert refused == (
        "the gradient of '0.weight' was changed in place between synchronize() and step() "
        "past compress_adam's warm-up: there .grad holds 1-bit Adam's averaged momentum "
        "(it becomes Adam's exp_avg), not a gradient, so unscaling or clipping it would "
        "change the momentum. HINT: leave .grad as synchronize() left it once the warm-up "
        "is over (clip or unscale during the warm-up only), or leave compress_adam out to "
        "clip or use a GradScaler")


def renew_after_a_resume_without_the_codecs():
    """1-bit Adam with a renewal every 2: three steps, then a resume whose codecs do not fit
    (another layout's), two more: the renewal at step 4 has seen those two only."""
    ctx = polytrain.init()
    model, opt = one_bit_adam(compress_adam_refresh=2)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(3):                             # renewed at steps 0 and 2
        backward_on_a_batch(model, opt, g)
        opt.step()
    carried = opt.carried()
    state = {**carried, "codecs": {}}
    opt.close()
    # A save after close() (a script's last checkpoint) keeps the codecs: close() had
    # dropped them from the engine, and such a save held none.
    kept = [len(carried["codecs"]), len(opt.carried()["codecs"])]
    model, opt = one_bit_adam(model, opt.optimizer, compress_adam_refresh=2)
    restored = opt.carry_on(state)
    for _ in range(2):                             # steps 3 and 4, renewed at 4
        backward_on_a_batch(model, opt, g)
        opt.step()
    onebit = opt.compress_adam
    frozen = {i: opt.optimizer.state[p][FROZEN_VARIANCE].clone()
              for i, p in enumerate(onebit.packed) if p is not None}
    return restored, [v.clone() for v in onebit.local_v], dict(onebit.slot), frozen, kept


@pytest.mark.timeout(120)
def test_a_renewal_after_a_resume_that_lost_the_variances_corrects_for_the_steps_since():
    # The workers' own variances start at zero again where a resume cannot restore them;
    # the renewal corrected their bias for every step of the run (5), not the 2 they saw:
    # a variance sqrt(5/2) too small, every update that much too large.
    out = spawn(renew_after_a_resume_without_the_codecs, workers=2, nodes=2, colocated=1)
    (restored, local_v, slot, frozen, kept), (_, other_v, _, _, _) = out
    assert restored is False
    assert kept[0] == kept[1] > 0, kept
    for i, got in frozen.items():
        j, off = slot[i]
        mean = (local_v[j] + other_v[j])[off:off + got.numel()].view(got.shape) / 2
        want = (mean / (1 - 0.999 ** 2)).sqrt() + 1e-8
        want = want.masked_fill(mean == 0, float("inf"))
        assert torch.allclose(got, want, rtol=1e-5), i


def test_compression_of_tensors_that_are_not_float32_is_refused_or_told(caplog):
    # A bfloat16 model with --compress onebit moved every byte uncompressed, saying nothing.
    def spec(name, dtype):
        return TensorSpec(name, (64, 64), dtype)

    with pytest.raises(ConfigError, match=r"compression applies to float32 tensors, and the "
                                          r"tensors it would compress here are bfloat16 "
                                          r"\('a', 'b'\): none would be\. HINT: train"):
        tensor_compression([spec("a", torch.bfloat16), spec("b", torch.bfloat16)], "onebit",
                           min_bytes=0)
    with caplog.at_level("WARNING"):
        out = tensor_compression([spec("a", torch.float32), spec("b", torch.float16)],
                                 "onebit", min_bytes=0)
    assert out[0] is not None and out[1] is None
    assert "compression applies to float32 tensors: 1 of float16 ('b') travel uncompressed" \
        in caplog.text
    assert tensor_compression([spec("b", torch.float16)], "none") == [None]  # nothing asked


def test_compression_of_tensors_all_under_the_minimum_size_is_refused():
    # Symptom: --compress onebit on a model whose every tensor is under --compress-min-bytes
    # compressed nothing and moved every byte, without a word. Cause: only the tensors of
    # another dtype than float32 were counted as asked for and not compressed.
    specs = [TensorSpec("a", (16, 16), torch.float32), TensorSpec("b", (64, 16), torch.float32)]
    for choice in ("onebit", {"b": "topk:0.01"}):
        with pytest.raises(ConfigError) as e:
            tensor_compression(specs, choice, min_bytes=65536)
        assert str(e.value) == (
            "compression applies to tensors of --compress-min-bytes (compress_min_bytes) "
            "65,536 bytes or more, and the largest it would compress here is 'b' of 4,096 "
            "bytes: none would be. HINT: pass --compress-min-bytes 4096 (or less), or leave "
            "compression out")
    out = tensor_compression(specs, "onebit", min_bytes=4096)  # one is: the rest travel as is
    assert out[0] is None and out[1] is not None
    assert tensor_compression(specs, {"a": "onebit"}, min_bytes=1024)[0] is not None


def test_compression_that_would_compress_nothing_is_refused_before_any_process_starts():
    # The refusal above came only at each worker's wrap: the run's banner, one "refused"
    # line per worker and the launcher's report, 26 s in. The model is known before the
    # launch (on the meta device): the configuration refuses it there.
    with pytest.raises(ConfigError, match=r"none would be\. HINT: pass --compress-min-bytes"):
        TrainConfig(strategy="byteps", workers=2, nodes=2, model="gpt",
                    model_options={"d_model": 16, "seq_len": 8, "layers": 1},
                    strategy_options={"compress": "onebit"})
    TrainConfig(strategy="byteps", workers=2, nodes=2, model="gpt",  # one tensor is compressed
                model_options={"d_model": 16, "seq_len": 8, "layers": 1},
                strategy_options={"compress": "onebit", "compress_min_bytes": 4096})
