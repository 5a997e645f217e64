"""Weight prediction: run a stale stage's forward on the weights its update will meet.

In HetPipe's pipeline the first stages keep several minibatches in flight: the
gradient of a minibatch is applied ``lag`` updates after the forward that
computed it (stage ``j`` of ``N_m`` in flight: ``lag = N_m - 1 - j``). With
momentum that delay costs far more than it seems: on a quadratic, Adam
(beta1 = 0.9) is stable for preconditioned curvatures up to 38 / lr, but with
a gradient one update old only up to about 1 / lr, so training is confined to
much flatter regions and the default GPT stalls on its plateau (see
docs/hetpipe.md). Predicting the weights helps: the forward (and, stashed, its
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


def _adam(ps: list[torch.Tensor], gs: list[torch.Tensor], states: list[dict], group: dict,
          lag: int, scale: float, extra: int, decoupled: bool) -> list[torch.Tensor]:
    """Adam's prediction for tensors of one group at one step count, all at once (foreach)."""
    w = list(torch._foreach_mul([p.detach() for p in ps], 1.0))  # copies
    before: list[torch.Tensor] = []
    b1, b2 = group["betas"]
    lr, eps, wd = _value(group["lr"]), group["eps"], group.get("weight_decay", 0.0)
    m = torch._foreach_mul([st["exp_avg"] for st in states], 1.0)
    v = torch._foreach_mul([st["exp_avg_sq"] for st in states], 1.0)
    vmax = None
    if group.get("amsgrad") and all(st.get("max_exp_avg_sq") is not None for st in states):
        vmax = torch._foreach_mul([st["max_exp_avg_sq"] for st in states], 1.0)
    step = _value(states[0]["step"])
    for i in range(lag):
        step += 1
        if extra and i == lag - 1:  # the last update, repeated ``extra`` times below
            before = list(torch._foreach_mul(w, 1.0))
        d = gs
        if wd and decoupled:
            torch._foreach_mul_(w, 1 - lr * wd * scale)
        elif wd:
            d = list(torch._foreach_add(gs, w, alpha=wd))
        torch._foreach_mul_(m, b1)
        torch._foreach_add_(m, d, alpha=1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, d, d, value=1 - b2)
        if vmax is not None:
            torch._foreach_maximum_(vmax, v)
        denom = torch._foreach_div(vmax if vmax is not None else v, 1 - b2 ** step)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(w, m, denom, value=-lr * scale / (1 - b1 ** step))
    if extra:
        torch._foreach_add_(w, torch._foreach_sub(w, before), alpha=extra)
    return list(w)


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
    group_of = {id(p): (k, group) for k, group in enumerate(optimizer.param_groups)
                for p in group["params"]}
    out: list[torch.Tensor | None] = [None] * len(params)
    kind = type(optimizer)
    adam: dict[tuple[int, float], list[int]] = {}  # (group, step) -> tensors, predicted at once
    for i, (p, g, delta) in enumerate(zip(params, grads, deltas)):
        state = optimizer.state.get(p, {})
        k, group = group_of.get(id(p), (-1, None))
        if lag == 0 or g is None or group is None or group.get("maximize"):
            out[i] = p.detach().clone()
        elif kind is torch.optim.SGD:
            out[i] = _sgd(p, g, state, group, lag, scale, extra)
        elif kind in (torch.optim.Adam, torch.optim.AdamW) and "exp_avg" in state:
            adam.setdefault((k, _value(state["step"])), []).append(i)
        elif delta is not None:
            out[i] = p.detach() + (lag + extra) * delta
        else:
            out[i] = p.detach().clone()
    for (k, _), members in adam.items():
        group = optimizer.param_groups[k]
        decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
        predicted = _adam([params[i] for i in members],
                          [grads[i] for i in members],  # type: ignore[misc]
                          [optimizer.state[params[i]] for i in members], group, lag, scale,
                          extra, decoupled)
        for i, w in zip(members, predicted):
            out[i] = w
    return out  # type: ignore[return-value]
