import pytest
import torch

from polytrain import ConfigError
from polytrain.models import GPT, MLP, get_model


def test_gpt_is_a_sequence_of_named_layers_with_the_expected_shapes():
    torch.manual_seed(0)
    model = GPT(seq_len=16, d_model=32, layers=3, heads=4)
    assert [name for name, _ in model.named_children()] == ["embed", "h0", "h1", "h2", "head"]
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    assert len(model.blocks) == 3


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(seq_len=8, d_model=16, layers=1, heads=2)
    x = torch.randint(0, 256, (1, 8))
    y = x.clone()
    y[0, 5] = (y[0, 5] + 1) % 256
    a, b = model(x), model(y)
    assert torch.allclose(a[0, :5], b[0, :5]) and not torch.allclose(a[0, 5], b[0, 5])


def test_same_seed_same_weights():
    torch.manual_seed(3)
    a = GPT(seq_len=8, d_model=16, layers=1, heads=2).state_dict()
    torch.manual_seed(3)
    b = GPT(seq_len=8, d_model=16, layers=1, heads=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mlp_predicts_the_next_byte():
    spec = get_model("mlp")
    model = spec.make(seq_len=8, d_model=16)
    x, y = spec.split(torch.randint(0, 256, (4, 9)))
    assert isinstance(model, MLP) and model(x).shape == (4, 256) and y.shape == (4,)
    assert spec.loss(model(x), y).ndim == 0


def test_unknown_model_options_are_named():
    with pytest.raises(ConfigError, match="model 'gpt' takes no option --experts"):
        get_model("gpt").make(experts=4)


def test_a_sequence_past_seq_len_and_a_hidden_width_below_1_are_refused_by_name():
    # An IndexError from the position embedding (a device assert on CUDA); d_hidden=0 built
    # the default width silently, and a negative one failed inside torch.
    model = GPT(seq_len=8, d_model=16, layers=1, heads=2)
    with pytest.raises(ValueError, match=r"sequences of at most seq_len 8 tokens, and got 9"):
        model(torch.zeros(1, 9, dtype=torch.long))
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)
    # MLP and WordLM failed in torch ("mat1 and mat2 shapes cannot be multiplied").
    mlp = MLP(seq_len=8)
    with pytest.raises(ValueError, match=r"windows of exactly seq_len 8 bytes, and got 6"):
        mlp(torch.zeros(1, 6, dtype=torch.long))
    assert mlp(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 256)
    lm = get_model("wordlm").make(vocab=100, seq_len=8, d_model=16, layers=1, heads=2)
    with pytest.raises(ValueError, match=r"windows of at most seq_len \+ 1 = 9 words, and got "
                                         r"10"):
        lm(torch.zeros(1, 10, dtype=torch.long))
    assert lm(torch.zeros(1, 9, dtype=torch.long)).shape == (1, 8)
    for bad in (0, -5):
        with pytest.raises(ConfigError, match=rf"--d-hidden must be at least 1 \(got {bad}\)"):
            GPT(seq_len=8, d_model=16, layers=1, heads=2, d_hidden=bad)


@pytest.mark.parametrize("model, options, said", [
    ("gpt", {"layers": 2.0}, r"--layers must be a whole number \(got 2\.0\)\. HINT: pass a "
                             r"positive --layers"),  # a TypeError in range()
    ("gpt", {"seq_len": 16.0}, r"--seq-len must be a whole number \(got 16\.0\)"),
    ("gpt", {"heads": True}, r"--heads must be a whole number \(got True\)"),  # taken as 1
    ("mlp", {"d_model": 64.0}, r"--d-model must be a whole number \(got 64\.0\)"),
    ("wordlm", {"vocab": 100.0}, r"--vocab must be a whole number \(got 100\.0\)\. HINT: "
                                 r"pass --vocab 100"),
    ("wordlm", {"negatives": 8.5},  # taken, then torch.rand's TypeError at the first forward
     r"--negatives must be a whole number \(got 8\.5\)\. HINT: pass --negatives as a whole "
     r"number"),
])
def test_a_model_size_that_is_not_a_whole_number_is_refused_by_name(model, options, said):
    # A JSON config's or a script's 2.0 met torch's TypeError (or was taken) where the
    # CLI's flags, and gpt-moe's experts, were refused in one line.
    with torch.device("meta"):
        with pytest.raises(ConfigError, match=said):
            get_model(model).make(**options)
