"""BytePS's optimizer when the loop touches gradients between backward and step (clipping,
unscaling), steps with a closure, sums 16-bit gradients, or mixes its own push_pull calls
with the optimizer's."""

import pytest
import torch
from torch import nn

import polytrain
import polytrain.byteps as bps
from tests.harness import refused, spawn

CLIP = 0.05


def batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def loss_of(model, w, workers):
    x, y = batch()
    rows = slice(w * 8 // workers, (w + 1) * 8 // workers)
    return nn.functional.mse_loss(model(x[rows]), y[rows])


def loops():
    ctx = polytrain.init()
    w, n = bps.rank(), bps.size()
    out = {}

    def wrapped(**kw):
        model = make_model()
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), **kw)
        return model, opt

    # Clipping between backward and step: the sums left before it, so it is refused.
    model, opt = wrapped()
    loss_of(model, w, n).backward()
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    out["clip_then_step"] = refused(opt.step)
    opt.close()

    # Horovod's recipe: synchronize, clip, step (which does not sum again).
    model, opt = wrapped()
    loss_of(model, w, n).backward()
    opt.synchronize()
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    out["synchronize_clip_step"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["steps_synchronised"] = opt.sync.synced
    opt.close()

    # The same with skip_synchronize(); a step in it before synchronize() is refused.
    model, opt = wrapped()
    loss_of(model, w, n).backward()
    with opt.skip_synchronize():
        out["skip_without_synchronize"] = refused(opt.step)
    opt.synchronize()
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    with opt.skip_synchronize():
        opt.step()
    out["skip_synchronize"] = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()

    # A closure runs once, before the sums are waited for: its gradients are summed.
    model, opt = wrapped()

    def closure():
        opt.zero_grad()
        loss = loss_of(model, w, n)
        loss.backward()
        return loss
    out["closure_loss"] = float(opt.step(closure).detach())
    out["closure"] = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    out["lbfgs"] = refused(lambda: bps.DistributedOptimizer(
        torch.optim.LBFGS(make_model().parameters())))
    # BytePS's momentum wrapper takes the place of SGD's: with both, two momenta.
    out["two_momenta"] = refused(lambda: bps.DistributedOptimizer(
        torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9),
        compression="onebit", error_feedback=True, compress_momentum=0.9))
    out["both_compressions"] = refused(lambda: bps.DistributedOptimizer(
        torch.optim.SGD(make_model().parameters(), lr=0.1), compression="fp16",
        compress="onebit"))
    # Adam's betas[0] is a momentum of its own, as SGD's momentum is.
    out["adam_momenta"] = refused(lambda: bps.DistributedOptimizer(
        torch.optim.Adam(make_model().parameters()), compression="onebit",
        error_feedback=True, compress_momentum=0.9))

    # A parameter frozen at the wrap has no sum: unfreezing it later is refused.
    model = make_model()
    model[0].weight.requires_grad_(False)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    loss_of(model, w, n).backward()
    opt.step()
    model[0].weight.requires_grad_(True)
    opt.zero_grad()
    loss_of(model, w, n).backward()
    out["unfrozen"] = refused(opt.step)
    opt.close()

    # BytePS's set_backward_passes_per_step: two passes of half the loss make one step.
    model, opt = wrapped()
    opt.set_backward_passes_per_step(2)
    for _ in range(2):
        (loss_of(model, w, n) / 2).backward()
    opt.step()
    out["two_passes"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["bad_passes"] = [refused(lambda p=p: opt.set_backward_passes_per_step(p))
                         for p in (1.5, 0)]
    loss_of(model, w, n).backward()  # one pass of two: a change now would lose it
    out["passes_mid_step"] = refused(lambda: opt.set_backward_passes_per_step(1))
    loss_of(model, w, n).backward()
    opt.step()
    opt.close()

    # 16-bit gradients whose sum passes float16's largest value (65504) still average.
    w16 = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = bps.DistributedOptimizer(torch.optim.SGD([w16], lr=0.0), named_parameters=[("w", w16)])
    (w16.float() * 40000.0).sum().backward()
    opt.synchronize()
    out["half"] = w16.grad.clone()
    opt.close()

    # A dtype the service does not carry is refused, and the engine goes on working.
    out["complex"] = refused(lambda: bps.push_pull(torch.ones(2, dtype=torch.complex64),
                                                   name="c"))
    # A name used again after an optimizer with another credit bound made its own engine.
    first = bps.push_pull(torch.full((3,), float(w)), name="m", average=False)
    model, opt = wrapped(credit_bytes=2_000_000)
    loss_of(model, w, n).backward()
    opt.step()
    again = bps.push_pull(torch.full((3,), float(w + 1)), name="m", average=False)
    out["named_sums"] = (first.tolist(), again.tolist())
    ctx.shutdown()
    return out


def reference(clip):
    """One process: the mean loss over the whole batch, clipped or not, one SGD step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return model.state_dict()


@pytest.mark.timeout(120)
def test_clipping_closures_and_own_calls_beside_the_optimizer():
    out = spawn(loops, workers=2, colocated=1)
    clipped, plain = reference(clip=True), reference(clip=False)
    assert any(not torch.allclose(clipped[k], plain[k]) for k in plain)  # the clip bites
    for o in out:
        said = o["clip_then_step"]
        assert said.startswith("the gradient of '0.weight' was changed in place between "
                               "backward() and the step's synchronisation"), said
        assert "call optimizer.synchronize() first" in said
        for key in ("synchronize_clip_step", "skip_synchronize"):
            for k, v in o[key].items():
                assert torch.allclose(v, clipped[k], atol=1e-6), (key, k)
        assert o["steps_synchronised"] == 1  # step() did not sum a second time
        assert o["skip_without_synchronize"].startswith(
            "step() inside skip_synchronize() with gradients not yet synchronised")
        for k, v in o["closure"].items():
            assert torch.allclose(v, plain[k], atol=1e-6), k
        assert o["lbfgs"].startswith("LBFGS evaluates its closure several times")
        assert o["both_compressions"].startswith("DistributedOptimizer got both compression=")
        assert o["two_momenta"].startswith("compress_momentum 0.9 puts a momentum on the "
                                           "gradients before compression, and SGD has "
                                           "momentum 0.9 of its own")
        # Symptom: Adam with compress_momentum=0.9 was accepted, an update with two momenta.
        # Cause: only an optimizer's 'momentum' key was read, not Adam's betas[0].
        assert o["adam_momenta"] == (
            "compress_momentum 0.9 puts a momentum on the gradients before compression, and "
            "Adam has momentum 0.9 of its own (betas[0]): the update would have two. HINT: "
            "give the optimizer betas=(0.0, 0.999) (compress_momentum takes the place of "
            "betas[0]), or leave compress_momentum out")
        # Symptom: a parameter frozen at the wrap and unfrozen later was never summed, and
        # the workers' copies drifted apart silently. Cause: only the parameters requiring a
        # gradient at the wrap got hooks, and nothing looked again.
        assert o["unfrozen"] == (
            "parameter '0.weight' requires a gradient, but did not when the model was wrapped: "
            "its gradients would not be summed, and each worker's copy would drift apart. "
            "HINT: unfreeze it before the optimizer is wrapped (bps.DistributedOptimizer, "
            "distribute()): a parameter may be frozen after the wrap, not unfrozen")
        # Symptom: opt.set_backward_passes_per_step(2), BytePS's, raised AttributeError.
        for k, v in o["two_passes"].items():
            assert torch.allclose(v, plain[k], atol=1e-6), k
        assert o["bad_passes"] == [
            "backward_passes_per_step must be a whole number (got 1.5). HINT: pass 1, or the "
            "passes per step",
            "backward_passes_per_step must be at least 1 (got 0). HINT: pass 1, or the passes "
            "per step"]
        assert o["passes_mid_step"] == (
            "set_backward_passes_per_step(1) in the middle of a step (after 1 of its 2 "
            "backward passes): a step's passes are counted as it began. HINT: call it between "
            "steps (after optimizer.step(), before the next backward)")
        assert o["complex"].startswith("'c' is torch.complex64, which the summation service")
        assert o["named_sums"] == ([1.0] * 3, [3.0] * 3)
        assert o["half"].dtype == torch.float16 and o["half"].tolist() == [40000.0] * 4
    assert out[0]["closure_loss"] != out[1]["closure_loss"]  # each worker's own shard
