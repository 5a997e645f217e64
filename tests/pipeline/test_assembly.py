"""Stage assembly alone: the stage optimizer cut from the user's."""

import copy
from collections import OrderedDict

import torch
from torch import nn

from polytrain.pipeline.assembly import stage_optimizer
from polytrain.pipeline.stage import Stage, StageSpec


def test_the_stage_optimizer_starts_from_the_state_of_the_users_optimizer():
    # Symptom: two Adam steps in the script, then distribute(..., "pipetransformer") and two
    # more ended 0.029 off four steps in one process (ddp: 1.5e-8). Cause: stage_optimizer
    # built the user's class over the stage's parameters with no state (HetPipe's too).
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(4, 4), r=nn.ReLU(), c=nn.Linear(4, 2)))
    base = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        base.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        base.step()
    # The last stage, built from a copy of the model (as HetPipe's twins are): by name.
    twin = copy.deepcopy(model)
    spec = StageSpec(index=1, count=2, prev=0, next=None, label="stage 1", input_shape=(4,))
    stage = Stage(spec, nn.Sequential(OrderedDict(list(twin.named_children())[1:])), None,
                  loss_fn=nn.functional.mse_loss)
    stage.close(wait=False)
    opt, _, _ = stage_optimizer(base, model, stage)
    assert stage.names == ["c.weight", "c.bias"]
    for p, q in zip(stage.params, model.c.parameters()):
        mine, theirs = opt.state[p], base.state[q]
        assert sorted(mine) == sorted(theirs) == ["exp_avg", "exp_avg_sq", "step"]
        for key in theirs:
            assert torch.equal(mine[key], theirs[key]) and mine[key] is not theirs[key], key
    # So the stage's next step is the user's optimizer's.
    for p, q in zip(stage.params, model.c.parameters()):
        p.grad = q.grad = torch.full_like(q, 0.1)
    opt.step()
    base.step()
    for p, q in zip(stage.params, model.c.parameters()):
        assert torch.equal(p.detach(), q.detach())
