"""The worker side of a server's optimizer: its spec, and each round's settings on the wire.

A server's optimizer store (:class:`~polytrain.ps.stores.OptimizerStore`) is
built from :func:`optimizer_spec`; every push carries the settings of its
round (:func:`pack_round`), so the servers follow a learning-rate schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["ELEMENTWISE", "optimizer_spec", "round_settings", "pack_round", "round_pieces",
           "is_numeric_setting", "setting_values", "plain_setting"]

#: ``torch.optim``'s optimizers whose step on a tensor is the same step on each of its
#: elements (checked against torch 2.13: a tensor stepped whole and cut in two pieces end
#: equal): a server steps a key, a flat run of elements that may join several tensors or
#: hold part of one, as the workers' optimizer would step the tensors. Not Adafactor (its
#: second moment is factored over a matrix's rows and columns), Muon (it orthogonalises a
#: matrix), LBFGS (a closure over the whole model) or SparseAdam (sparse gradients).
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop",
               "Adadelta", "ASGD", "Rprop")


def optimizer_spec(optimizer: torch.optim.Optimizer, group: int = 0, *,
                   per_round: bool = True) -> dict[str, Any]:
    """How to build ``optimizer`` again on a server for the tensors of parameter group
    ``group``: its class (from ``torch.optim``) and the group's settings, as JSON.

    With ``per_round`` every push carries, for each round, the group's numeric settings
    as they were for that round (``lr``, ``betas``, ``weight_decay``, ...; listed under
    ``"per_round"``, see :func:`pack_round`): the servers' optimizer follows a
    learning-rate schedule, or any change of them, round by round.
    Raises ConfigError for an optimizer of another module, or one not in
    :data:`ELEMENTWISE`.
    """
    kind = type(optimizer)
    if getattr(torch.optim, kind.__name__, None) is not kind:
        raise ConfigError(f"the servers can run only torch.optim's optimizers, not "
                          f"{kind.__module__}.{kind.__qualname__}",
                          "use a torch.optim optimizer, or keep the optimizer on the workers")
    if kind.__name__ not in ELEMENTWISE:
        raise ConfigError(f"the servers step each key as one flat run of elements (a layer's "
                          f"tensors fused), so they run only element-by-element optimizers "
                          f"({', '.join(ELEMENTWISE)}), not torch.optim.{kind.__name__}",
                          "use one of them")
    settings = {k: plain_setting(v) for k, v in sorted(optimizer.param_groups[group].items())
                if k in optimizer.defaults}  # not a scheduler's own keys (``initial_lr``)
    numeric = sorted(k for k, v in settings.items() if setting_values(v) is not None) \
        if per_round else []
    return {"class": kind.__name__, "settings": settings, "per_round": numeric}


def round_settings(spec: dict[str, Any], group: dict[str, Any]) -> list[float]:
    """The values of ``spec``'s per-round settings in a parameter group, flattened."""
    out: list[float] = []
    for name in spec.get("per_round", ()):
        values = setting_values(plain_setting(group[name]))
        if values is None or len(values) != len(setting_values(spec["settings"][name]) or ()):
            raise ConfigError(f"the optimizer's setting {name!r} changed its kind during "
                              f"training ({spec['settings'][name]!r} -> {group[name]!r})",
                              f"keep {name} a number of the same shape")
        out.extend(values)
    return out


def pack_round(grad: torch.Tensor, values: list[float] | torch.Tensor) -> torch.Tensor:
    """One round of a push to an optimizer store: the gradient, then the round's settings
    (:func:`round_settings`, or them as a float64 tensor) as float64 bits in ``grad``'s
    dtype, so they arrive exact."""
    return torch.cat(round_pieces(grad, values))


def round_pieces(grad: torch.Tensor, values: list[float] | torch.Tensor) -> list[torch.Tensor]:
    """:func:`pack_round`'s parts, to concatenate several rounds at once."""
    bits = values if isinstance(values, torch.Tensor) else torch.tensor(values,
                                                                         dtype=torch.float64)
    return [grad.reshape(-1), bits.view(grad.dtype)]


def is_numeric_setting(value: Any) -> bool:
    """Whether a parameter group's setting is a number or numbers (what a schedule changes,
    and what :func:`round_settings` carries), not a flag, None or text."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        return False
    return setting_values(plain_setting(value)) is not None


def setting_values(value: Any) -> list[float] | None:
    """A setting as a list of floats, or None when it is not numeric (bools, None, text)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    return None


def plain_setting(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return [plain_setting(v) for v in value]
    return value
