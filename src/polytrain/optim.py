"""Sparse row updates (SGD, Adagrad, lazy Adam), shared by workers and the servers' row stores.

A sparse parameter's update touches only the rows of its gradient. The same
three rules run in :class:`LazyAdam` (a worker's optimizer) and on the
servers (:mod:`polytrain.ps.sparse`), so a row updated on a server follows
exactly the rule the ``single`` run applies. ``rows`` are unique row indices,
``values`` the summed gradient of those rows, (rows, width).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable

import torch

from .errors import ConfigError, unknown

__all__ = ["OPTIMIZERS", "check_optimizer_name", "make_optimizer", "LazyAdam", "sparse_rule",
           "row_sgd", "row_adagrad", "row_adam", "RULE_STATES", "placed_state"]

#: What ``--optimizer`` takes.
OPTIMIZERS = ("sgd", "adam", "adagrad")

#: State tensors (each the parameter's shape) that each rule keeps per row.
RULE_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}


def row_sgd(param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, *,
            lr: float) -> None:
    """Plain SGD on ``rows``: ``param[rows] -= lr * values``."""
    param.index_add_(0, rows, values, alpha=-lr)


def row_adagrad(param: torch.Tensor, state_sum: torch.Tensor, rows: torch.Tensor,
                values: torch.Tensor, *, lr: float, step: int, lr_decay: float = 0.0,
                eps: float = 1e-10) -> None:
    """``torch.optim.Adagrad``'s sparse rule on ``rows`` (``step`` counted from 1)."""
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum.index_add_(0, rows, values.pow(2))
    std = state_sum[rows].sqrt_().add_(eps)
    param.index_add_(0, rows, values / std, alpha=-clr)


def row_adam(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             rows: torch.Tensor, values: torch.Tensor, *, lr: float, step: int,
             betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
    """Lazy Adam (``torch.optim.SparseAdam``'s rule): moments and weights of ``rows`` only."""
    beta1, beta2 = betas
    m_old, v_old = exp_avg[rows], exp_avg_sq[rows]
    m_delta = values.sub(m_old).mul_(1 - beta1)
    v_delta = values.pow(2).sub_(v_old).mul_(1 - beta2)
    exp_avg.index_add_(0, rows, m_delta)
    exp_avg_sq.index_add_(0, rows, v_delta)
    m, v = m_delta.add_(m_old), v_delta.add_(v_old)
    step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    param.index_add_(0, rows, m.div_(v.sqrt_().add_(eps)), alpha=-step_size)


def coalesced(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, summed values) of a sparse COO gradient of a 2-D parameter."""
    g = grad.coalesce()
    return g.indices()[0], g.values()


def sparse_rule(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                name: str = "the parameter") -> dict[str, Any]:
    """The sparse rule (``name`` and settings) that ``optimizer`` applies to ``param``.

    SGD without momentum, Adagrad without weight decay, Adam-family optimizers
    without weight decay (applied lazily, as ``SparseAdam``) and ``SparseAdam``
    itself have one; anything else is refused with what to pass instead.
    """
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])),
                 None)
    if group is None:
        # Left out is how single and ddp leave a table untrained: passing it would train it.
        raise ConfigError(f"{name} is in no group of the optimizer, which steps a sparse "
                          f"parameter's rows on the servers",
                          "to leave it untrained, freeze it before distribute() "
                          "(requires_grad_(False)); to train it, pass it to the optimizer")
    kind = type(optimizer).__name__
    decay = float(group.get("weight_decay", 0.0) or 0.0)
    hint = ("put the sparse parameters in a group with weight_decay=0, or pass "
            "torch.optim.SparseAdam, Adagrad or SGD for them (--optimizer sgd, adagrad or adam)")
    if group.get("maximize"):
        raise ConfigError(f"{kind} with maximize=True has no sparse form ({name})",
                          "minimise the loss instead")
    if kind == "SGD":
        if group.get("momentum") or decay:
            raise ConfigError(f"SGD with momentum {group.get('momentum')} and weight decay "
                              f"{decay} has no sparse form ({name}: its gradient is sparse)",
                              "pass momentum=0 and weight_decay=0 for the sparse parameters")
        return {"name": "sgd", "lr": float(group["lr"])}
    if kind == "Adagrad":
        if decay:
            raise ConfigError(f"Adagrad with weight decay {decay} has no sparse form ({name})",
                              hint)
        return {"name": "adagrad", "lr": float(group["lr"]), "eps": float(group["eps"]),
                "lr_decay": float(group["lr_decay"]),
                "initial_accumulator_value": float(group["initial_accumulator_value"])}
    if kind in ("Adam", "AdamW", "LazyAdam", "SparseAdam"):
        if group.get("amsgrad"):
            raise ConfigError(f"{kind} with amsgrad=True has no sparse form here ({name}: the "
                              f"rows' rule is SparseAdam's, which keeps no maximum)",
                              "pass amsgrad=False, or Adagrad or SGD for the sparse parameters")
        if decay:
            raise ConfigError(f"{kind} with weight decay {decay} has no sparse form ({name}: "
                              f"decaying every row would touch the whole table each step)",
                              hint)
        return {"name": "adam", "lr": float(group["lr"]), "eps": float(group["eps"]),
                "betas": [float(b) for b in group["betas"]]}
    raise ConfigError(f"{kind} has no sparse form that polytrain knows ({name} has a sparse "
                      f"gradient)", "use SGD, Adagrad, Adam or SparseAdam for it")


def apply_rule(rule: dict[str, Any], param: torch.Tensor, state: list[torch.Tensor],
               rows: torch.Tensor, values: torch.Tensor, *, step: int, lr: float) -> None:
    """One step of ``rule`` (from :func:`sparse_rule`) on ``rows`` of ``param``."""
    name = rule["name"]
    if name == "sgd":
        row_sgd(param, rows, values, lr=lr)
    elif name == "adagrad":
        row_adagrad(param, state[0], rows, values, lr=lr, step=step,
                    lr_decay=rule["lr_decay"], eps=rule["eps"])
    else:
        row_adam(param, state[0], state[1], rows, values, lr=lr, step=step,
                 betas=(rule["betas"][0], rule["betas"][1]), eps=rule["eps"])


class LazyAdam(torch.optim.Optimizer):
    """Adam for dense gradients and lazy Adam (``SparseAdam``'s rule) for sparse ones.

    ``torch.optim.Adam`` refuses sparse gradients and ``SparseAdam`` dense ones;
    a model with both (an ``nn.Embedding(sparse=True)`` and a dense body) takes
    this one. ``--optimizer adam`` builds it for such models. Both take the Adam
    paper's efficient form, as ``SparseAdam`` does: ``lr * sqrt(1 - beta2^t) / (1 -
    beta1^t) * m / (sqrt(v) + eps)``. ``torch.optim.Adam`` adds ``eps`` after the bias
    correction, ``sqrt(v / (1 - beta2^t)) + eps``: the two differ where ``sqrt(v)``
    is near ``eps`` (gradients of about 1e-6 and below), not otherwise.

    Example::

        opt = LazyAdam(model.parameters(), lr=1e-3)
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        # torch.optim.Adam's checks: a negative lr steps uphill; a beta of 1 divides by zero
        # in the bias correction, one past it takes the root of a negative number.
        for name, value, usual in (("lr", lr, 1e-3), ("eps", eps, 1e-8),
                                   ("weight_decay", weight_decay, 0.0)):
            if not 0.0 <= value:  # (NaN too)
                raise ConfigError(f"LazyAdam {name} must be 0 or more (got {value})",
                                  f"pass, say, {name}={usual}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"LazyAdam betas must each be at least 0 and under 1 (got "
                              f"{tuple(betas)}): the bias correction divides by 1 - beta1^t "
                              f"and takes the root of 1 - beta2^t", "pass, say, betas=(0.9, 0.999)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None  # type: ignore[override]
             ) -> float | None:
        loss = None
        if closure is not None:  # its backward needs the graph that no_grad would not build
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"]
                if p.grad.is_sparse:
                    if group["weight_decay"]:
                        raise ConfigError("LazyAdam with weight decay has no sparse form",
                                          "pass weight_decay=0 for the sparse parameters")
                    rows, values = coalesced(p.grad)
                    row_adam(p, state["exp_avg"], state["exp_avg_sq"], rows, values,
                             lr=group["lr"], step=step, betas=(beta1, beta2), eps=group["eps"])
                    continue
                g = p.grad
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step_size = group["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-step_size)
        return loss


def placed_state(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                 state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``param``'s optimizer state (saved or handed over on the CPU), placed as
    torch's own ``load_state_dict`` places it: ``step`` stays where it is unless the
    optimizer is fused or capturable (then on the parameter's device), every other tensor
    goes to the parameter's device and, if floating, dtype."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    # torch's rule reads only the group's flags, finding the group by the parameter's id.
    flags = [{"params": [id(param)], "fused": group.get("fused") or False,
              "capturable": group.get("capturable") or False}]
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            out[key] = copy.deepcopy(value)
            continue
        placed = torch.optim.Optimizer._process_value_according_to_param_policy(
            param, value, id(param), flags, key)
        out[key] = placed.clone() if placed is value else placed
    return out


def check_optimizer_name(name: str) -> None:
    """Refuse an ``--optimizer`` that is none of :data:`OPTIMIZERS` (any other name ran
    Adam, silently), listing them."""
    if name not in OPTIMIZERS:
        raise unknown("optimizer", name, OPTIMIZERS, "pass --optimizer sgd, adam or adagrad")


def make_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """``--optimizer`` over ``model``'s parameters: sgd, adagrad or adam (lazy where the model
    has sparse embeddings: ``torch.optim.Adam`` refuses their gradients)."""
    check_optimizer_name(name)
    params = model.parameters()
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    sparse = any(getattr(m, "sparse", False) for m in model.modules()
                 if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)))
    return LazyAdam(params, lr=lr) if sparse else torch.optim.Adam(params, lr=lr)
