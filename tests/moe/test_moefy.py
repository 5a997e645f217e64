"""moefy: MoE feed-forward blocks in polytrain's GPT and torch's transformer layers."""

import copy
import pickle

import pytest
import torch
from torch import nn

from polytrain import ConfigError
from polytrain.models import GPT, get_model
from polytrain.moe import MoE, aux_loss, moefy
from polytrain.moe.moefy import MoEDecoderLayer, MoEEncoderLayer


def test_gpt_blocks_get_moe_feed_forwards():
    torch.manual_seed(0)
    model = moefy(GPT(seq_len=8, d_model=16, layers=4, heads=2), 4, every=2, gate="gshard")
    kinds = [type(b.mlp).__name__ for b in model.blocks]
    assert kinds == ["MoE", "FeedForward", "MoE", "FeedForward"]
    assert model.h0.mlp.experts[0].fc.out_features == 64  # the replaced block's width
    logits = model(torch.randint(0, 256, (2, 8)))
    (logits.mean() + aux_loss(model)).backward()
    assert model.h0.mlp.gate.wg.weight.grad is not None


@pytest.mark.parametrize("norm_first", [False, True])
def test_torch_encoder_layers(norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True, norm_first=norm_first)
    # nested tensors on: the fast path that reads linear1 is there to be turned off
    encoder = moefy(nn.TransformerEncoder(layer, 2, enable_nested_tensor=not norm_first), 4,
                    top_k=2)
    first = encoder.layers[0]
    assert isinstance(first.moe, MoE) and not hasattr(first, "linear1")
    assert "layers.0.moe.experts.0.fc.weight" in encoder.state_dict()
    x = torch.randn(2, 5, 16)
    y = encoder(x)
    # the layer by hand: attention block, then the MoE block
    sa = first.self_attn(*(3 * [first.norm1(x) if norm_first else x]), need_weights=False)[0]
    if norm_first:
        h = x + sa
        want = h + first.moe(first.norm2(h))
    else:
        h = first.norm1(x + sa)
        want = first.norm2(h + first.moe(h))
    assert torch.allclose(encoder.layers[0](x), want, atol=1e-6)
    with torch.no_grad():  # eval without grad: torch's fused path must stay off
        assert torch.allclose(encoder.eval()(x), y, atol=1e-6)


@pytest.mark.parametrize("activation", ["relu", "gelu", nn.GELU(approximate="tanh")],
                         ids=["relu", "gelu", "tanh-gelu"])
def test_a_one_expert_torch_layer_computes_the_block_it_replaced(activation):
    # Its experts were GELU's whatever the layer's activation (torch's default is ReLU).
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                       activation=activation)
    x = torch.randn(7, 16)
    want = layer.linear2(layer.activation(layer.linear1(x)))
    linear1, linear2 = layer.linear1, layer.linear2
    moe = moefy(layer, 1, top_k=1).moe
    expert = moe.experts[0]
    with torch.no_grad():
        expert.fc.weight.copy_(linear1.weight), expert.fc.bias.copy_(linear1.bias)
        expert.proj.weight.copy_(linear2.weight), expert.proj.bias.copy_(linear2.bias)
    assert torch.allclose(moe(x), want, atol=1e-6)
    assert "moe.experts.0.fc.weight" in layer.state_dict()


def test_an_activation_with_parameters_is_refused_not_shared_by_the_experts():
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, activation=nn.PReLU())
    with pytest.raises(ConfigError, match=r"moefy cannot give each expert the layer's "
                                          r"activation PReLU: it has parameters"):
        moefy(layer, 2)


def test_torch_decoder_layers():
    torch.manual_seed(0)
    decoder = moefy(nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, batch_first=True),
                                          2), 4)
    out = decoder(torch.randn(2, 5, 16), torch.randn(2, 7, 16))
    assert out.shape == (2, 5, 16) and isinstance(decoder.layers[1].moe, MoE)


def test_a_model_without_transformer_layers_is_refused():
    with pytest.raises(ConfigError, match="moefy found no transformer layer in Linear"):
        moefy(nn.Linear(4, 4), 2)


def test_gpt_moe_model_is_moefied_gpt_with_the_given_options():
    model = get_model("gpt-moe").make(seq_len=8, d_model=16, layers=2, heads=2, experts=4,
                                      gate="switch", capacity_factor=2.0)
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)
    gate = model.h1.mlp.gate
    assert (gate.num_experts, gate.top_k, gate.capacity_factor) == (4, 1, 2.0)


def small_expert(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, d))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_an_expert_factory_builds_the_experts(activation):
    # moefy put the replaced block's d_hidden in MoE's options before the user's expert=,
    # and MoE refused both ("d_hidden is the default expert's width"): expert= never worked.
    torch.manual_seed(0)
    gpt = moefy(GPT(seq_len=8, d_model=16, layers=2, heads=2), 4, expert=small_expert)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True,
                                       activation=activation)
    encoder = moefy(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), 4,
                    expert=small_expert)
    for moe in (gpt.h0.mlp, gpt.h1.mlp, encoder.layers[0].moe):
        assert [m.out_features for m in moe.experts[3] if isinstance(m, nn.Linear)] == [6, 16]
    assert gpt(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)
    assert encoder(torch.randn(2, 5, 16)).shape == (2, 5, 16)


def test_every_must_be_a_whole_number():
    # every=1.5 was accepted: found % 1.5 replaced blocks 0 and 3 of 4.
    with pytest.raises(ConfigError, match=r"every must be a whole number \(got 1\.5\)\. "
                                          r"HINT: pass every=1 or 2"):
        moefy(GPT(seq_len=8, d_model=16, layers=2, heads=2), 4, every=1.5)


def test_an_option_moe_lacks_is_named():
    # Python's TypeError "MoE.__init__() got an unexpected keyword argument 'topk'", from
    # the first layer's build (a wrong key in gate_options was named already).
    gpt = GPT(seq_len=8, d_model=16, layers=2, heads=2)
    with pytest.raises(ConfigError, match=r"^moefy: MoE takes no option topk, trunk \(its "
                                          r"options: top_k, gate, expert, d_hidden, "
                                          r"capacity_factor, .*gate_options\)\. HINT: pass top_k "
                                          r"for topk; a gate's own options go in gate_options$"):
        moefy(gpt, 4, topk=2, trunk=1)
    assert not any(isinstance(m, MoE) for m in gpt.modules())  # refused before any change


def test_a_model_moefied_twice_is_refused_naming_the_layer():
    # AttributeError: 'MoE' object has no attribute 'fc' (GPT), 'MoEEncoderLayer' object has
    # no attribute 'linear1' (torch's layers).
    gpt = moefy(GPT(seq_len=8, d_model=16, layers=2, heads=2), 4)
    with pytest.raises(ConfigError, match=r"moefy: the feed-forward block of 'h0' is an MoE "
                                          r"layer already \(4 experts\)\. HINT: moefy a model "
                                          r"once"):
        moefy(gpt, 8)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    encoder = moefy(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), 4)
    with pytest.raises(ConfigError, match=r"moefy: the feed-forward block of 'layers.0' is an "
                                          r"MoE layer already \(4 experts\)"):
        moefy(encoder, 4)


class Shifted(nn.TransformerEncoderLayer):
    """A user's layer: torch's, its output moved by 100 (module level: pickled by name)."""

    def forward(self, src: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return 100.0 + super().forward(src, *args, **kwargs)


class ShiftedDecoder(nn.TransformerDecoderLayer):
    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return 100.0 + super().forward(tgt, memory, *args, **kwargs)


def test_a_subclass_of_torchs_layers_keeps_its_own_methods():
    # moefy set the layer's class to MoEEncoderLayer: a subclass's forward was dropped
    # silently (100 + the layer's output gave a mean of 0.0, not 100.0).
    torch.manual_seed(0)
    encoder = moefy(nn.TransformerEncoder(Shifted(16, 2, 32, dropout=0.0, batch_first=True),
                                          2, enable_nested_tensor=False), 4, top_k=2)
    first, second = encoder.layers
    assert isinstance(first, Shifted) and isinstance(first, MoEEncoderLayer)
    assert type(first) is type(second) and type(first).__name__ == "MoEShifted"
    x = torch.randn(2, 3, 16)
    h = 100.0 + MoEEncoderLayer.forward(first, x)
    want = 100.0 + MoEEncoderLayer.forward(second, h)
    assert torch.equal(encoder(x), want)
    assert abs(float(want.detach().mean()) - 100.0) < 1e-3
    keys = list(encoder.state_dict())
    assert "layers.0.moe.experts.0.fc.weight" in keys and not any("linear1" in k for k in keys)
    # Copies and pickles rebuild the same class, weights and output.
    for again in (copy.deepcopy(encoder), pickle.loads(pickle.dumps(encoder))):
        assert type(again.layers[0]) is type(first)
        assert list(again.state_dict()) == keys
        assert torch.equal(again(x), want)
    decoder = moefy(nn.TransformerDecoder(ShiftedDecoder(16, 2, 32, dropout=0.0,
                                                         batch_first=True), 1), 4)
    layer = decoder.layers[0]
    assert isinstance(layer, ShiftedDecoder) and isinstance(layer, MoEDecoderLayer)
    memory = torch.randn(2, 5, 16)
    assert torch.equal(decoder(x, memory), 100.0 + MoEDecoderLayer.forward(layer, x, memory))


def test_a_subclass_with_its_own_feed_forward_block_is_refused():
    # Its _ff_block reads linear1 and linear2, which the MoE layer replaces.
    class Gated(nn.TransformerEncoderLayer):
        def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout2(self.linear2(torch.sigmoid(self.linear1(x)) * x.mean()))

    encoder = nn.TransformerEncoder(Gated(16, 2, 32, batch_first=True), 2,
                                    enable_nested_tensor=False)
    with pytest.raises(ConfigError, match=r"^moefy cannot replace the feed-forward block of "
                                          r"'layers.0': its class Gated overrides _ff_block, "
                                          r"which the MoE layer would replace\. HINT: "):
        moefy(encoder, 4)
    assert hasattr(encoder.layers[0], "linear1")  # refused before any layer was changed
