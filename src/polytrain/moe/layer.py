"""``MoE``: a mixture-of-experts layer, with its experts optionally spread over a process group."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigError, at_least, divisors
from .dispatch import moe_apply
from .exchange import ExpertGroup
from .experts import ExpertList, ExpertMLP
from .gates import Gate, make_gate

__all__ = ["MoE"]


#: MoE's own arguments that it hands its gate: not to be given again in ``gate_options``.
_OWN = {"top_k", "capacity_factor", "eval_capacity_factor", "dropless", "balance_weight",
        "z_loss_weight", "group", "batch_group"}


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: gate, dispatch, experts, combine.

    FastMoE (He et al., arXiv 2103.13262) with expert parallelism on gloo and
    NCCL. ``num_experts`` is the TOTAL number of experts, split evenly over
    ``group``: rank r of the group holds global experts ``r*L .. r*L+L-1``
    (``L = num_experts / group size``). Without a group every expert is local.

    Example::

        layer = MoE(512, num_experts=32, top_k=2, gate="gshard")
        y = layer(x)                            # (..., 512) -> (..., 512)
        loss = task_loss + polytrain.moe.aux_loss(model)

        group = dist.new_group([0, 1, 2, 3])    # expert parallelism over 4 ranks
        layer = MoE(512, 32, group=group)       # 8 experts on each rank

    Args:
        d_model: token width.
        num_experts: experts in all (divisible by the group's size).
        top_k: experts per token (default: the gate's, 2; switch 1).
        gate: ``naive``, ``noisy``, ``gshard`` or ``switch`` (default naive).
        expert: a factory ``f(d_model) -> nn.Module`` for each expert (default: a
            two-layer GELU MLP of width ``d_hidden``, all local experts computed at once).
        d_hidden: the default expert's hidden width (default 4 * d_model).
        capacity_factor: capacity factor while training (default None: the gate's own,
            gshard 1.2 and switch 1.25, which ``dropless`` lifts; naive and noisy have none).
        group: the expert-parallel process group (default None).
        batch_group: the data-parallel group whose ranks' tokens make the global batch
            (default: ``group``): the gate draws, counts capacity and computes its
            losses over it, so the layer routes as one process with the global batch would.
        eval_capacity_factor, dropless, balance_weight, z_loss_weight: see
            :class:`~polytrain.moe.gates.Gate`; gate_options: more options of the gate
            (``jitter`` for switch).
    """

    def __init__(self, d_model: int, num_experts: int, *, top_k: int | None = None,
                 gate: str = "naive", expert: Callable[[int], nn.Module] | None = None,
                 d_hidden: int | None = None, capacity_factor: float | None = None,
                 group: Any | None = None, batch_group: Any | None = None,
                 eval_capacity_factor: float | None = None,
                 dropless: bool = False, balance_weight: float | None = None,
                 z_loss_weight: float = 0.0, gate_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        at_least("d_model", d_model, "pass the tokens' width, e.g. MoE(512, 8)", whole=True)
        at_least("num_experts (--experts)", num_experts, "pass num_experts=8 (--experts 8)",
                 whole=True)
        clash = sorted(set(gate_options or {}) & _OWN)  # (Python's "multiple values" before)
        if clash:
            raise ConfigError(f"gate_options {', '.join(map(repr, clash))}: MoE takes "
                              f"{'it' if len(clash) == 1 else 'them'} as its own argument",
                              f"pass {clash[0]}=... to MoE, not in gate_options")
        if d_hidden is not None and expert is not None:
            raise ConfigError("d_hidden is the default expert's width, and expert= builds "
                              "the experts instead", "leave out d_hidden, or expert")
        if d_hidden is not None:
            at_least("d_hidden", d_hidden, "pass d_hidden=4 * d_model, or leave it out",
                     whole=True)
        self.d_model = d_model
        self.num_experts = num_experts
        self._group = ExpertGroup(group)
        self._check_divisible(self._group)
        self.gate: Gate = make_gate(
            gate, d_model, num_experts, top_k=top_k, capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor, dropless=dropless,
            balance_weight=balance_weight, z_loss_weight=z_loss_weight, group=group,
            batch_group=batch_group, **(gate_options or {}))
        local = num_experts // self._group.size
        self.experts: ExpertMLP | ExpertList
        if expert is None:
            self.experts = ExpertMLP(local, d_model, d_hidden or 4 * d_model)
        else:
            self.experts = ExpertList(local, d_model, expert)
        self.last_load: torch.Tensor | None = None

    def _check_divisible(self, group: ExpertGroup) -> None:
        if self.num_experts % group.size:
            raise ConfigError(
                f"{self.num_experts} experts cannot be split evenly over an expert-parallel "
                f"group of {group.size} ranks",
                f"use a group size among {divisors(self.num_experts)}, or a multiple of "
                f"{group.size} experts")

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    @property
    def group(self) -> ExpertGroup:
        """The expert-parallel group (size 1 when every expert is local)."""
        return self._group

    @property
    def num_local(self) -> int:
        return self.num_experts // self._group.size

    @property
    def first_expert(self) -> int:
        """Global index of this rank's first expert."""
        return self._group.rank * self.num_local

    def shard_experts(self, group: Any | None) -> None:
        """Keep only this rank's experts of ``group`` (the layer must hold all of them now).

        Every rank of the group keeps its slice of the same weights, so a model
        built identically everywhere computes what the all-local model computes.
        """
        new = ExpertGroup(group)
        if self._group.size != 1:
            raise ConfigError(f"this layer's experts are already split over {self._group.size} "
                              f"ranks", "shard a layer that holds all its experts")
        self._check_divisible(new)
        local = self.num_experts // new.size
        self.experts.keep(new.rank * local, local)
        self._group = new
        self.gate.group = new

    def set_batch_group(self, group: Any | None) -> None:
        """Route over the global batch of ``group``'s ranks (see ``batch_group``)."""
        self.gate.set_batch_group(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., d_model)."""
        if x.shape[-1] != self.d_model:
            raise ConfigError(f"MoE layer of width {self.d_model} got input of shape "
                              f"{list(x.shape)}", f"pass (..., {self.d_model}) tokens")
        tokens = x.reshape(-1, self.d_model)
        if tokens.device.type == "meta":
            return self._as_if_balanced(tokens).reshape(x.shape)
        indices, scores = self.gate(tokens)
        y, load = moe_apply(tokens, indices, scores, self.experts, self.num_experts,
                            self._group)
        self.last_load = load
        return y.reshape(x.shape)

    def _as_if_balanced(self, tokens: torch.Tensor) -> torch.Tensor:
        """The forward on the meta device (polytrain's profiles: ``--devices``, ``plan``):
        routing reads the gate's values, which the meta device lacks, so every local expert
        gets an even share of ``top_k`` rows per token, the cost of a balanced layer."""
        k = self.top_k
        scores = self.gate.wg(tokens)[:, :k].softmax(-1)                      # (tokens, k)
        rows = tokens.repeat_interleave(k, dim=0)                               # (tokens * k, d)
        share, extra = divmod(rows.shape[0], self.num_local)
        y = self.experts(rows, [share + (i < extra) for i in range(self.num_local)])
        return (y.reshape(-1, k, self.d_model) * scores.unsqueeze(-1)).sum(1)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, "
                f"local={self.num_local}, group_size={self._group.size}")
