"""The MoE layer against a per-token brute-force reference, forward and backward."""

import pytest
import torch
from torch import nn

from polytrain import ConfigError
from polytrain.moe import MoE, aux_loss

D, E, T = 8, 4, 24


def brute_force(layer: MoE, x: torch.Tensor, indices: torch.Tensor,
                scores: torch.Tensor) -> torch.Tensor:
    """Loop over tokens and slots, call experts[idx] on the one token, weight by score."""
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for s in range(indices.shape[1]):
            e = int(indices[t, s])
            if e >= 0:
                acc = acc + scores[t, s] * layer.experts[e](x[t:t + 1])[0]
        out.append(acc)
    return torch.stack(out)


def layer_of(gate: str, top_k: int, drops: bool, **kw) -> MoE:
    torch.manual_seed(0)
    # (naive and noisy drop only with a capacity factor: dropless is refused for them)
    options = {"capacity_factor": 0.5} if drops else \
        {} if gate in ("naive", "noisy") else {"dropless": True}
    return MoE(D, E, top_k=top_k, gate=gate, d_hidden=12, **options, **kw)


def grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    found = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, found)]


def compare_with_brute_force(layer: MoE, x: torch.Tensor, seed: int = 1) -> torch.Tensor:
    weights = torch.randn(x.shape[0], D)
    params = [p for p in layer.parameters()]
    torch.manual_seed(seed)
    y = layer(x)
    got = grads((y * weights).sum() + aux_loss(layer), [x, *params])
    torch.manual_seed(seed)  # the gate draws the same noise: the same decisions
    indices, scores = layer.gate(x)
    reference = brute_force(layer, x, indices, scores)
    want = grads((reference * weights).sum() + aux_loss(layer), [x, *params])
    assert torch.allclose(y, reference, atol=1e-5), (y - reference).abs().max()
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()
    return indices


@pytest.mark.parametrize("drops", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("gate", ["naive", "noisy", "gshard", "switch"])
def test_layer_equals_per_token_brute_force(gate, top_k, drops):
    layer = layer_of(gate, top_k, drops)
    x = torch.randn(T, D, requires_grad=True)
    indices = compare_with_brute_force(layer, x)
    load = torch.bincount(indices[indices >= 0], minlength=E)
    if drops:
        # capacity 0.5 * k * T / E: some slots must have been dropped, none over capacity
        capacity = layer.gate.last_capacity
        assert capacity == -(-top_k * T // (2 * E))
        assert (load <= capacity).all() and (indices < 0).any()
    else:
        assert layer.gate.last_capacity is None
        if gate != "gshard":  # gshard's random routing drops second choices by design
            assert (indices >= 0).all()
    assert torch.equal(layer.last_load, load)


@pytest.mark.parametrize("gate", ["naive", "gshard", "switch"])
def test_eval_mode_is_deterministic_and_equals_brute_force(gate):
    layer = layer_of(gate, 2, drops=False).eval()
    x = torch.randn(T, D, requires_grad=True)
    compare_with_brute_force(layer, x)
    assert torch.equal(layer(x), layer(x))


def test_any_expert_module_and_any_leading_shape():
    torch.manual_seed(0)
    layer = MoE(D, E, top_k=2, expert=lambda d: nn.Sequential(nn.Linear(d, 5), nn.Tanh(),
                                                              nn.Linear(5, d)))
    x = torch.randn(3, 8, D, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    compare_with_brute_force(layer, x.detach().reshape(-1, D).requires_grad_())


def test_gshard_and_switch_default_capacities_and_z_loss():
    torch.manual_seed(0)
    layer = MoE(D, E, gate="gshard", z_loss_weight=1e-3)
    assert (layer.gate.capacity_factor, layer.gate.eval_capacity_factor, layer.top_k) == \
        (1.2, 2.4, 2)
    layer(torch.randn(T, D))
    assert layer.gate.last_capacity == -(-12 * 2 * T // (10 * E))  # ceil(1.2 * 2 * 24 / 4)
    switch = MoE(D, E, gate="switch")
    assert (switch.gate.capacity_factor, switch.gate.eval_capacity_factor, switch.top_k) == \
        (1.25, 2.0, 1)
    switch(torch.randn(T, D))
    # A training factor given leaves the gate's eval factor (it replaced it: 1.0, 1.5);
    # a gate without one (naive) evaluates at the training factor.
    assert MoE(D, E, gate="gshard", capacity_factor=1.0).gate.eval_capacity_factor == 2.4
    assert MoE(D, E, gate="switch", capacity_factor=1.5).gate.eval_capacity_factor == 2.0
    assert MoE(D, E, gate="naive", capacity_factor=1.5).gate.eval_capacity_factor == 1.5
    assert MoE(D, E, gate="switch", capacity_factor=1.5,
               eval_capacity_factor=1.1).gate.eval_capacity_factor == 1.1
    # both losses present, weighted: z-loss of gshard plus both balance losses
    assert float(aux_loss(nn.Sequential(layer, switch)).detach()) > 0
    assert float(aux_loss(MoE(D, E))) == 0.0


def test_a_balance_loss_weight_for_the_naive_gate_is_refused():
    # It has no balance loss: the weight was dropped without a word.
    with pytest.raises(ConfigError, match=r"the naive gate has no balance loss, so "
                                          r"balance_weight \(--balance-loss\) 0.5 would do "
                                          r"nothing\. HINT: use gate gshard"):
        MoE(D, E, gate="naive", balance_weight=0.5)
    assert MoE(D, E, gate="naive", balance_weight=0.0).gate.balance_weight == 0.0


def test_balance_loss_is_one_when_perfectly_balanced():
    from polytrain.moe.gates import balance_loss
    probs = torch.full((8, 4), 0.25)
    assert float(balance_loss(probs, torch.arange(8) % 4)) == pytest.approx(1.0)
    skewed = torch.tensor([[0.97, 0.01, 0.01, 0.01]] * 8)
    assert float(balance_loss(skewed, torch.zeros(8, dtype=torch.long))) == pytest.approx(3.88)


def test_no_tokens_at_all():
    layer = layer_of("gshard", 2, drops=True)
    x = torch.zeros(0, D, requires_grad=True)
    y = layer(x)
    (y.sum() + aux_loss(layer)).backward()
    assert y.shape == (0, D) and x.grad is not None


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": 5}, r"top_k \(--top-k\) must be between 1 and the number of experts 4 \(got 5\)"),
    ({"gate": "hash"}, r"unknown gate 'hash'; the gates are: gshard, naive, noisy, switch"),
    ({"capacity_factor": 0.0},
     r"capacity_factor \(--capacity-factor\) must be positive and finite \(got 0.0\)"),
    # From a review: the naive gate's hint offered --dropless, which naive then refuses.
    ({"capacity_factor": 0}, r"HINT: pass --capacity-factor 1\.25 \(capacity_factor=1\.25 in a "
                             r"script\), or leave --capacity-factor out for no capacity limit$"),
    ({"gate": "gshard", "capacity_factor": -1.0},
     r"HINT: pass --capacity-factor 1\.25 \(capacity_factor=1\.25 in a script\), or --dropless "
     r"for no capacity limit$"),
    ({"capacity_factor": 1.0, "dropless": True},
     r"a dropless gate \(--dropless\) has no capacity"),
    # TypeError: __init__() got an unexpected keyword argument 'jitter'
    ({"gate_options": {"jitter": 0.1}},
     r"gate 'naive' takes no option jitter \(jitter is an option of switch\)\. HINT: leave "
     r"jitter out of gate_options"),
    ({"gate": "switch", "gate_options": {"jiter": 0.1}}, r"no gate takes jiter"),
    # From a review: Python's "got multiple values for keyword argument 'top_k'", torch's
    # "negative dimension" and topk()'s "argument 'k' must be int" at the first forward,
    # and a d_hidden beside expert= ignored.
    ({"gate_options": {"top_k": 1}}, r"gate_options 'top_k': MoE takes it as its own "
                                     r"argument\. HINT: pass top_k=\.\.\. to MoE"),
    ({"d_hidden": -1}, r"d_hidden must be at least 1 \(got -1\)"),
    ({"top_k": 2.5}, r"top_k \(--top-k\) must be between 1 and the number of experts 4 "
                     r"\(got 2.5\)"),
    ({"expert": lambda d: torch.nn.Linear(d, d), "d_hidden": 9},
     r"d_hidden is the default expert's width, and expert= builds the experts instead"),
    # torch's TypeError at the experts' build, and "'<' not supported" in the gate's check.
    ({"d_hidden": 2.5}, r"d_hidden must be a whole number \(got 2\.5\)"),
    ({"capacity_factor": "1.2"},
     r"capacity_factor \(--capacity-factor\) must be a number \(got '1\.2'\)"),
    ({"eval_capacity_factor": "2"}, r"eval_capacity_factor must be a number \(got '2'\)"),
    # From a review: "'<=' not supported between instances of 'int' and 'str'" (and of
    # 'NoneType') from the weights' and the jitter's checks; True taken as a weight of 1.
    ({"gate": "gshard", "balance_weight": "0.01"},
     r"balance_weight \(--balance-loss\) must be a number \(got '0\.01'\)\. HINT: pass a "
     r"small weight, e\.g\. --balance-loss 0\.01"),
    ({"gate": "gshard", "balance_weight": True},
     r"balance_weight \(--balance-loss\) must be a number \(got True\)"),
    ({"z_loss_weight": None}, r"z_loss_weight \(--z-loss\) must be a number \(got None\)"),
    ({"gate": "switch", "gate_options": {"jitter": "0.1"}},
     r"jitter must be a number \(got '0\.1'\)\. HINT: pass jitter=0\.01"),
    # dropless="no" was taken as true; with naive or noisy, which drop only with a capacity
    # factor (which dropless refuses), it did nothing (as a balance loss for naive would,
    # which is refused).
    ({"gate": "gshard", "dropless": "no"},
     r"dropless \(--dropless\) must be True or False \(got 'no'\)"),
    ({"gate": "gshard", "dropless": 2}, r"dropless \(--dropless\) must be True or False "
                                        r"\(got 2\)"),
    ({"dropless": True}, r"^the naive gate drops slots only with a capacity factor, which "
                         r"dropless \(--dropless\) refuses, so dropless would do nothing\. "
                         r"HINT: leave dropless out \(without --capacity-factor the naive gate "
                         r"never drops\), or use gate gshard or switch, whose default capacity "
                         r"dropless lifts$"),
    ({"gate": "noisy", "dropless": True}, r"^the noisy gate drops slots only with a capacity "
                                          r"factor"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MoE(D, E, **kwargs)


def test_numbers_of_numpy_and_torch_and_flags_as_0_or_1_are_taken():
    # From a review: the type checks added for "0.01" and "no" refused what had worked:
    # numpy's True and 0/1 for dropless, a 0-dim tensor or numpy float for a weight.
    import numpy as np
    for dropless in (np.True_, 1, np.int64(1), True):
        gate = MoE(D, E, gate="gshard", dropless=dropless).gate
        assert gate.dropless is True and gate.capacity_factor is None
    for dropless in (np.False_, 0, False):
        gate = MoE(D, E, gate="gshard", dropless=dropless).gate
        assert gate.dropless is False and gate.capacity_factor == 1.2
    gate = MoE(D, E, gate="switch", balance_weight=torch.tensor(0.5), z_loss_weight=np.float32(
        0.25), capacity_factor=np.float64(1.5), gate_options={"jitter": torch.tensor(0.125)}).gate
    assert (gate.balance_weight, gate.z_loss_weight, gate.capacity_factor, gate.jitter) == \
        (0.5, 0.25, 1.5, 0.125)
    assert all(type(v) is float for v in (gate.balance_weight, gate.z_loss_weight,
                                          gate.capacity_factor, gate.jitter))
    for bad, said in ((torch.tensor([0.5]), r"tensor\(\[0\.5000\]\)"),
                      (torch.tensor(True), r"tensor\(True\)"), (np.True_, r"True")):
        with pytest.raises(ConfigError, match=rf"^balance_weight \(--balance-loss\) must be a "
                                              rf"number \(got {said}\)"):
            MoE(D, E, gate="gshard", balance_weight=bad)


def test_a_fractional_expert_count_is_named():
    # torch's TypeError ("empty() received an invalid combination of arguments").
    with pytest.raises(ConfigError, match=r"num_experts \(--experts\) must be a whole number "
                                          r"\(got 4\.0\)\. HINT: pass num_experts=8"):
        MoE(D, 4.0)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 12 * 4 * 5])  # one chunk; a few rows each
def test_inference_streams_chunks_and_computes_the_same(chunk_bytes):
    layer = layer_of("gshard", 2, drops=True).eval()
    layer.experts.chunk_bytes = chunk_bytes
    x = torch.randn(T, D)
    with torch.no_grad():
        streamed = layer(x)
    assert torch.allclose(streamed, layer(x), atol=1e-6)  # the training path: gather, combine


@pytest.mark.parametrize("top_k", [1, 2, 3])
# chunks of 21845 rows with every expert's weights stacked; of 20 rows and of 1 row, with
# one expert's weights stacked at a time
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 12 * 4 * 20, 12 * 4])
def test_inference_on_device_offsets_computes_what_the_training_path_does(top_k, chunk_bytes):
    # The GPU inference path (no host wait), run on the CPU's grouped matmul: chunks of a
    # fixed number of rows cut through experts' groups; dropped slots add nothing.
    from polytrain.moe.dispatch import _streamed_on_device, moe_apply
    layer = layer_of("naive", top_k, drops=False)
    layer.experts.chunk_bytes = chunk_bytes
    size = layer.experts.group_size(torch.empty(0, D))
    assert size >= E if chunk_bytes > 1000 else size == 1
    x = torch.randn(T, D)
    indices = torch.randint(0, E, (T, top_k))
    indices[torch.rand(T, top_k) < 0.3] = -1                 # dropped slots
    indices[0] = -1                                          # a token with none kept
    indices[1:4] = E - 1                                     # the last expert, with drops after it
    scores = torch.rand(T, top_k)
    with torch.no_grad():
        got, load = _streamed_on_device(x, indices, scores, layer.experts)
    want, want_load = moe_apply(x, indices, scores, layer.experts, E)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    assert torch.equal(got[0], torch.zeros(D))
    assert torch.equal(load, want_load) and int(load.sum()) == int((indices >= 0).sum())


@pytest.mark.parametrize("gate", ["naive", "noisy", "gshard", "switch"])
def test_a_profile_on_the_meta_device_counts_top_k_experts_per_token(gate):
    # --model gpt-moe with --devices (any strategy) and `polytrain plan`: the profile's
    # forward on the meta device met nonzero() in route() (and the gates' draws), and every
    # such run was refused. On the meta device the layer costs top_k experts per token.
    from polytrain.emulation.profile import profile_model
    from polytrain.models import GPT
    from polytrain.moe import moefy

    def profile(model: nn.Module) -> dict[str, float]:
        sample = torch.zeros(2, 8, dtype=torch.long)
        return {x.name: x.fwd_flops for x in profile_model(model, sample).layers}

    top_k = 1 if gate == "switch" else 2
    dense = profile(GPT(seq_len=8, d_model=16, layers=2, heads=2))
    moe = profile(moefy(GPT(seq_len=8, d_model=16, layers=2, heads=2), 4, gate=gate,
                        top_k=top_k))
    mlp, router = 2 * 8 * (16 * 64 + 64 * 16), 2 * 8 * 16 * 4  # per sample of 8 tokens
    assert moe["h0"] - dense["h0"] == (top_k - 1) * mlp + router
    assert moe["embed"] == dense["embed"] and moe["head"] == dense["head"]


def test_an_expert_of_another_width_is_named_with_its_factory():
    # A bare RuntimeError from reshape: "shape '[3, 8]' is invalid for input of size 48".
    def wide(d: int) -> nn.Module:
        return nn.Linear(d, 2 * d)

    layer = MoE(D, E, expert=wide)
    with pytest.raises(ConfigError, match=r"an expert that expert=.*wide builds maps tokens of "
                                          r"shape \(\d+, 8\) to \(\d+, 16\): an expert must "
                                          r"give back \(tokens, d_model\)\. HINT: make "
                                          r"expert=f\(d_model\) return"):
        layer(torch.randn(3, D))


def test_d_model_and_top_k_are_checked_as_whole_numbers():
    # MoE(0, 4) was accepted; numpy's int64 top_k was refused as "must be between 1 and
    # the number of experts 4 (got 2)".
    import numpy as np

    with pytest.raises(ConfigError, match=r"d_model must be at least 1 \(got 0\)"):
        MoE(0, E)
    with pytest.raises(ConfigError, match=r"d_model must be a whole number \(got 8\.0\)"):
        MoE(8.0, E)
    layer = MoE(D, E, top_k=np.int64(2))
    assert layer.top_k == 2 and type(layer.top_k) is int
    with pytest.raises(ConfigError, match=r"top_k \(--top-k\) must be between 1 and the number "
                                          r"of experts 4 \(got True\)"):
        MoE(D, E, top_k=True)


def test_a_layer_applied_twice_in_a_forward_counts_its_last_calls_aux_loss():
    # As documented (aux_loss, docs/moe.md): each call replaces the gate's loss, so a shared
    # block adds its second call's balance loss alone. (A review's warning for it fired on
    # every pipeline stage whose gates no loss reads, and was dropped.)
    torch.manual_seed(0)
    layer = MoE(D, E, gate="gshard", d_hidden=12)
    x = torch.randn(T, D)
    second_input = layer(x)
    layer(second_input)
    twice = aux_loss(layer)
    layer(second_input)
    assert torch.equal(twice, aux_loss(layer))
    layer(x)
    assert not torch.equal(twice, aux_loss(layer))


def test_an_expert_factory_that_gives_back_what_it_built_before_is_refused():
    # expert=lambda d: shared gave 4 experts that were one module: under --strategy moe each
    # worker's copy took gradient from its own local experts only, and the copies drifted
    # apart silently. A tensor shared by two experts does the same.
    shared = nn.Linear(D, D)
    with pytest.raises(ConfigError, match=r"^expert=.*<lambda> gave expert 1 the parameter "
                                          r"'weight' of expert 0 \('weight'\): the experts "
                                          r"would share it\. HINT: make expert=f\(d_model\) "
                                          r"build a new module at each call"):
        MoE(D, E, expert=lambda d: shared)

    def tied(d: int) -> nn.Module:
        return nn.Sequential(nn.Linear(d, d), nn.Tanh(), shared)

    with pytest.raises(ConfigError, match=r"^expert=.*tied gave expert 1 the parameter "
                                          r"'2.weight' of expert 0 \('2.weight'\): the experts "
                                          r"would share it\. HINT: "):
        MoE(D, E, expert=tied)
    # A module without parameters may be shared (moefy's experts share the layer's
    # activation), buffers and all: an activation's constant is not trained (a torch layer
    # whose activation held one was refused, naming moefy's own factory).
    quick = nn.Module()
    quick.register_buffer("k", torch.tensor(1.702))
    quick.forward = lambda x: x * torch.sigmoid(quick.k * x)
    layer = MoE(D, E, expert=lambda d: nn.Sequential(nn.Linear(d, d), quick))
    assert len(list(layer.experts.parameters())) == 2 * E


@pytest.mark.parametrize("front", ["linear", "layernorm"])
@pytest.mark.parametrize("gate", ["naive", "noisy", "gshard", "switch"])
def test_default_experts_under_autocast_compute_in_its_dtype_as_a_linear_ffn_does(gate, front):
    # Under torch.autocast a Linear -> MoE model failed: "mat1 and mat2 must have the same
    # dtype, but got BFloat16 and Float"; a float32 input (a LayerNorm's) ran the experts in
    # float32. The default experts' matmuls (addmm(out=), torch._grouped_mm) are none that
    # autocast casts: the experts now cast tokens, weights and biases to its dtype themselves.
    torch.manual_seed(0)
    layer = layer_of(gate, 2, drops=False)
    model = nn.Sequential(nn.Linear(D, D) if front == "linear" else nn.LayerNorm(D), layer)
    ffn = nn.Sequential(model[0], nn.Linear(D, 12), nn.GELU(), nn.Linear(12, D))
    x = torch.randn(T, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        y = model(x)
        want_dtype = ffn(x).dtype
        torch.manual_seed(1)  # the gate draws the same noise: the same decisions
        h = model[0](x)
        indices, scores = layer.gate(h)
        with torch.no_grad():
            torch.manual_seed(1)
            streamed = model(x)  # inference streams the experts a chunk at a time
    assert y.dtype == streamed.dtype == want_dtype == torch.bfloat16
    (y.float().square().sum() + aux_loss(layer)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith("1.experts.") for n in grads) and "0.weight" in grads
    assert all(g.dtype == torch.float32 for g in grads.values())
    # The float32 layer on the same routing: bf16 rounding apart, the same.
    reference = brute_force(layer, h.detach().float(), indices, scores.detach().float())
    assert torch.allclose(y.float(), reference, atol=0.01, rtol=0.02), \
        (y.float() - reference).abs().max()
    assert torch.allclose(streamed.float(), y.float(), atol=0.01, rtol=0.01)


def test_inference_on_device_offsets_under_autocast_computes_in_its_dtype():
    # The GPU inference path (run here on the CPU's grouped matmul) under autocast: the
    # float32 experts' weights are stacked in autocast's dtype, as the training path casts
    # them; before, the grouped matmul met bf16 tokens and float32 weights.
    from polytrain.moe.dispatch import _streamed_on_device, moe_apply
    torch.manual_seed(0)
    layer = MoE(D, E, d_hidden=16)  # widths of 16-byte bf16 rows, as the grouped matmul wants
    x = torch.randn(T, D)
    indices, scores = torch.randint(0, E, (T, 2)), torch.rand(T, 2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = _streamed_on_device(x.bfloat16(), indices, scores, layer.experts)
        want, _ = moe_apply(x, indices, scores, layer.experts, E)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), atol=0.01, rtol=0.01)
