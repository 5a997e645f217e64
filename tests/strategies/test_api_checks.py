"""What the library's optimizers and entry points take from a user's script as torch's do."""

import torch

from polytrain.optim import LazyAdam


def test_lazy_adam_steps_with_a_closure_as_torchs_adam_does():
    # LazyAdam.step(closure) always failed ("element 0 of tensors does not require grad"):
    # step runs under no_grad, and so did the closure, whose backward had no graph.
    def closure_of(model, opt):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        return closure

    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    lazy = torch.nn.Linear(3, 1)
    by_hand = torch.nn.Linear(3, 1)
    by_hand.load_state_dict(lazy.state_dict())
    opt, hand_opt = LazyAdam(lazy.parameters(), lr=0.1), LazyAdam(by_hand.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        losses.append(float(opt.step(closure_of(lazy, opt)).detach()))
        hand_loss = closure_of(by_hand, hand_opt)()
        hand_opt.step()
        assert losses[-1] == float(hand_loss.detach())
    assert torch.equal(lazy.weight, by_hand.weight)
    assert not torch.equal(lazy.weight, torch.nn.Linear(3, 1).weight) and losses[2] < losses[0]
