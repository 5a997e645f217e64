"""Weight prediction: run a stale stage's forward on the weights its update will meet.

In HetPipe's pipeline the first stages keep several minibatches in flight: the
gradient of a minibatch is applied ``lag`` updates after the forward that
computed it (stage ``j`` of ``N_m`` in flight: ``lag = N_m - 1 - j``). With
momentum that delay costs far more than it seems: on a quadratic, Adam
(beta1 = 0.9) is stable for preconditioned curvatures up to 38 / lr, but with
a gradient one update old only up to about 1 / lr, so training is confined to
much flatter regions and the default GPT stalls on its plateau (see the
README). Predicting the weights helps: the forward (and, stashed, its
backward) runs on the live weights advanced by ``lag`` more steps of the
stage's own optimizer, with the latest gradient standing in for the ones
still in flight. For Adam that widens the stable range to about 5 / lr and
closes most of the gap to synchronous training (the momentum alone, the usual
prediction, reaches 2.7 / lr).

The prediction reads the optimizer's state and changes nothing in it.
Optimizers it knows: SGD (momentum, dampening, Nesterov, weight decay), Adam
and AdamW (weight decay, AMSGrad). Any other one: the last applied update is
repeated ``lag`` times.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["predict_weights"]


def _value(x: object) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)  # type: ignore[arg-type]


def _sgd(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, lag: int,
         scale: float, extra: int) -> torch.Tensor:
    w = p.detach().clone()
    before = w.clone()
    buf = state.get("momentum_buffer")
    buf = None if buf is None else buf.clone()
    mu, damp = group.get("momentum", 0.0), group.get("dampening", 0.0)
    for _ in range(lag):
        d = g + group["weight_decay"] * w if group.get("weight_decay") else g
        if mu:
            buf = d.clone() if buf is None else buf.mul_(mu).add_(d, alpha=1 - damp)
            d = d + mu * buf if group.get("nesterov") else buf
        before.copy_(w)
        w.add_(d, alpha=-group["lr"] * scale)
    return w.add_(w - before, alpha=extra) if extra else w


def _adam(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, lag: int, scale: float,
          extra: int, decoupled: bool) -> torch.Tensor:
    w = p.detach().clone()
    before = w.clone()
    b1, b2 = group["betas"]
    lr, eps, wd = _value(group["lr"]), group["eps"], group.get("weight_decay", 0.0)
    m, v = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    vmax = state.get("max_exp_avg_sq")
    vmax = vmax.clone() if group.get("amsgrad") and vmax is not None else None
    step = _value(state["step"])
    for _ in range(lag):
        step += 1
        before.copy_(w)
        d = g
        if wd and decoupled:
            w.mul_(1 - lr * wd * scale)
        elif wd:
            d = g + wd * w
        m.mul_(b1).add_(d, alpha=1 - b1)
        v.mul_(b2).addcmul_(d, d, value=1 - b2)
        if vmax is not None:
            torch.maximum(vmax, v, out=vmax)
        denom = ((vmax if vmax is not None else v) / (1 - b2 ** step)).sqrt_().add_(eps)
        w.addcdiv_(m, denom, value=-lr * scale / (1 - b1 ** step))
    return w.add_(w - before, alpha=extra) if extra else w


@torch.no_grad()
def predict_weights(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor | None], deltas: Sequence[torch.Tensor | None],
                    *, lag: int, scale: float = 1.0, extra: int = 0) -> list[torch.Tensor]:
    """The weights ``params`` will have after ``lag`` more updates of ``optimizer``.

    ``lag`` steps of the optimizer's own rule, then ``extra`` more updates like the
    last of them (HetPipe: other virtual workers' updates this stage has not seen).

    Args:
        optimizer: the stage's optimizer (its state is read, not changed).
        params: the live parameters.
        grads: the last gradient applied to each (None: not updated yet; kept as is).
        deltas: the last update applied to each (used for optimizers not known here).
        lag: updates between now and the one this forward's gradient makes.
        scale: the factor each update is applied with (HetPipe: 1 / virtual workers).
        extra: updates to add, each equal to the last predicted one (needs ``lag`` >= 1).

    Returns detached copies; with ``lag`` 0 the weights themselves.
    """
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    out: list[torch.Tensor] = []
    kind = type(optimizer)
    for p, g, delta in zip(params, grads, deltas):
        state = optimizer.state.get(p, {})
        group = group_of.get(id(p))
        if lag == 0 or g is None or group is None or group.get("maximize"):
            out.append(p.detach().clone())
        elif kind is torch.optim.SGD:
            out.append(_sgd(p, g, state, group, lag, scale, extra))
        elif kind in (torch.optim.Adam, torch.optim.AdamW) and "exp_avg" in state:
            decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
            out.append(_adam(p, g, state, group, lag, scale, extra, decoupled))
        elif delta is not None:
            out.append(p.detach() + (lag + extra) * delta)
        else:
            out.append(p.detach().clone())
    return out
