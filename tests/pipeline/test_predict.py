"""Weight prediction: the weights after ``lag`` more steps with the last gradient, exactly."""

import copy

import pytest
import torch

from polytrain.pipeline.predict import predict_weights

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1,
                                               weight_decay=0.01),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-l2-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def trained(name: str) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[torch.Tensor]]:
    """Parameters and an optimizer after three steps; the last gradients."""
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    opt = OPTIMIZERS[name](params)
    grads: list[torch.Tensor] = []
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return params, opt, grads


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("lag", [1, 3])
def test_prediction_equals_running_the_optimizer_on_the_last_gradient(name, lag):
    params, opt, grads = trained(name)
    state_before = copy.deepcopy(opt.state_dict())
    predicted = predict_weights(opt, params, grads, [None, None], lag=lag)
    assert opt.state_dict()["state"].keys() == state_before["state"].keys()
    for k, st in opt.state_dict()["state"].items():  # the prediction changed nothing
        before = state_before["state"][k]
        for field, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(before[field]))
    for _ in range(lag):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for want, got in zip(params, predicted):
        assert not got.requires_grad
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_scale_shrinks_each_predicted_update():
    params, opt, grads = trained("adam")
    live = [p.detach().clone() for p in params]
    full = predict_weights(opt, params, grads, [None, None], lag=1)
    half = predict_weights(opt, params, grads, [None, None], lag=1, scale=0.5)
    for w, f, h in zip(live, full, half):
        assert (f - w).abs().max() > 1e-4
        torch.testing.assert_close(h - w, 0.5 * (f - w), rtol=1e-4, atol=1e-7)


def test_an_unknown_optimizer_repeats_the_last_update_and_lag_zero_changes_nothing():
    torch.manual_seed(1)
    params = [torch.randn(3, requires_grad=True)]
    opt = torch.optim.RMSprop(params, lr=0.01)
    params[0].grad = torch.randn(3)
    opt.step()
    delta = torch.randn(3)
    (predicted,) = predict_weights(opt, params, [params[0].grad], [delta], lag=2)
    torch.testing.assert_close(predicted, params[0].detach() + 2 * delta)
    (same,) = predict_weights(opt, params, [params[0].grad], [delta], lag=0)
    assert torch.equal(same, params[0].detach())
    # A parameter never updated yet (no gradient) is kept as it is.
    (kept,) = predict_weights(opt, params, [None], [None], lag=2)
    assert torch.equal(kept, params[0].detach())


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw"])
def test_extra_updates_repeat_the_last_predicted_one(name):
    params, opt, grads = trained(name)
    live = [p.detach().clone() for p in params]
    one = predict_weights(opt, params, grads, [None, None], lag=1)
    three = predict_weights(opt, params, grads, [None, None], lag=1, extra=2)
    for w, a, b in zip(live, one, three):
        torch.testing.assert_close(b - w, 3 * (a - w), rtol=1e-4, atol=1e-6)
