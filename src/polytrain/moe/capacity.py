"""Expert capacity: how many slots each expert takes, decided the same way on every rank.

A capacity is per expert and per *group* (the gate's batch group while
training, else its expert-parallel group: :mod:`polytrain.moe.gates`): expert
``e`` processes at most ``C = ceil(factor * top_k * tokens / E)`` rows, where
``tokens`` counts the tokens of every rank in the group. Every rank all-gathers the group's slot
counts and applies one rule, so all ranks agree on which slots are kept without
another exchange:

    priority: slot 0 of every token before slot 1 (GShard's rule), then rank
    order, then token order. Within (slot, rank, expert) the first tokens win.

With the ranks' tokens concatenated in rank order (the global batch, as
data-parallel replicas slice it), this keeps exactly the slots a single process
holding every expert and every token keeps: expert parallelism does not change
which tokens are dropped.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ..errors import ConfigError
from ..kinds import plain

__all__ = ["expert_capacity", "allowance", "keep_mask", "check_factor", "check_number"]


def check_number(name: str, value: Any, hint: str) -> float:
    """``value`` as a Python number, refused unless it is a real one (``"0.01"`` and None
    met a comparison's TypeError; True was taken as 1). A numpy scalar and a 0-dim tensor
    of a real dtype count as their number."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and \
            not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    value = plain(value)  # (numpy's True becomes True, and is refused)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number (got {value!r})", hint)
    # (a Real: an int, a float, a Fraction; all that is asked of a float here)
    return value  # type: ignore[return-value]


def check_factor(factor: Any, name: str = "capacity_factor", *,
                 no_limit: str = "--dropless") -> float | None:
    """``factor`` as a Python number (None: none given), refused unless it is positive and
    finite. ``no_limit``: the hint's way to no capacity limit (a gate with no capacity of
    its own has none without a factor: "leave --capacity-factor out")."""
    if factor is None:
        return None
    flag = " (--capacity-factor)" if name == "capacity_factor" else ""
    factor = check_number(f"{name}{flag}", factor, f"pass {name}=1.25, or leave it out for "
                                                   f"the gate's")
    if not 0 < factor < math.inf:
        if name == "capacity_factor":  # a flag too
            raise ConfigError(f"{name} (--capacity-factor) must be positive and finite (got "
                              f"{factor})", f"pass --capacity-factor 1.25 (capacity_factor=1.25 "
                              f"in a script), or {no_limit} for no capacity limit")
        raise ConfigError(f"{name} must be positive and finite (got {factor})",
                          f"pass {name}=1.25, or None for the gate's eval factor (gshard "
                          f"2.4, switch 2.0; else the training one)")
    return factor


def expert_capacity(tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    """Rows one expert may process: ``ceil(factor * top_k * tokens / num_experts)``.

    >>> expert_capacity(tokens=64, num_experts=8, top_k=2, factor=1.0)
    16
    """
    check_factor(factor)
    return math.ceil(factor * top_k * tokens / num_experts)


def allowance(counts: torch.Tensor, capacity: int, rank: int) -> torch.Tensor:
    """How many of ``rank``'s slots each (slot, expert) keeps under the group's priority rule.

    Args:
        counts: (ranks, top_k, experts) slots that want each expert, every rank's.
        capacity: rows per expert (:func:`expert_capacity`).
        rank: this rank's position in the group.

    Returns:
        (top_k, experts) int64: keep the first ``allowance[s, e]`` of this rank's
        tokens whose slot ``s`` chose expert ``e``.

    >>> c = torch.tensor([[[3, 0]], [[2, 1]]])   # 2 ranks, top-1, 2 experts
    >>> allowance(c, capacity=4, rank=1).tolist()  # rank 0 took 3 rows of expert 0
    [[1, 1]]
    """
    ranks, top_k, experts = counts.shape
    counts = counts.to(torch.int64)
    # Rows taken before (slot s, rank r): every rank's earlier slots, then earlier ranks' slot s.
    per_slot = counts.sum(0)                                         # (top_k, experts)
    earlier_slots = per_slot.cumsum(0) - per_slot                    # exclusive over slots
    earlier_ranks = counts[:rank].sum(0)                             # (top_k, experts)
    before = earlier_slots + earlier_ranks
    return (capacity - before).clamp(min=0).minimum(counts[rank])


def keep_mask(indices: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Which slots survive: a slot is kept if its rank among equal (slot, expert) is allowed.

    Args:
        indices: (tokens, top_k) expert per slot; -1 (already dropped) is never kept.
        allowed: (top_k, experts) from :func:`allowance`.

    Returns:
        (tokens, top_k) bool.
    """
    tokens, top_k = indices.shape
    experts = allowed.shape[1]
    valid = indices >= 0
    safe = indices.clamp(min=0)
    onehot = torch.nn.functional.one_hot(safe, experts) * valid.unsqueeze(-1)  # (T, k, E)
    # Position of each slot among this rank's slots with the same (slot, expert), in token order.
    position = (onehot.cumsum(0) - onehot).gather(2, safe.unsqueeze(-1)).squeeze(-1)
    limit = allowed.gather(1, safe.t()).t()                          # (T, k)
    return valid & (position < limit)
