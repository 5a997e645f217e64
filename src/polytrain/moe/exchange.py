"""The collectives of expert parallelism: count exchange and token all-to-all, with autograd.

``all_to_all_single`` with split sizes runs on gloo (CPU tensors) and NCCL (CUDA
tensors); a CUDA tensor over a gloo group travels through the CPU. The token
exchange is an autograd function whose backward is the same exchange with the
split sizes swapped (scatter and gather are each other's adjoint). Bytes are
recorded in polytrain's traffic meter when a run is initialised, per peer and
marked ``estimated`` like every collective whose bytes move inside torch.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from .. import runtime
from ..comm.meter import RECV, SENT
from ..errors import ConfigError

__all__ = ["ExpertGroup", "all_to_all", "exchange_counts", "all_gather_counts", "A2A_RANGE",
           "COUNTS_RANGE"]

#: Name of the profiler range around every token all-to-all (forward and backward).
A2A_RANGE = "polytrain.moe.all_to_all"
#: Name of the profiler range around the count exchange.
COUNTS_RANGE = "polytrain.moe.count_exchange"


# torch 2.13 renamed all_gather_into_tensor (older versions have only the old name).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ExpertGroup:
    """An expert-parallel process group and this rank's place in it.

    ``None`` stands for no expert parallelism (one rank holds every expert).

    Example::

        group = ExpertGroup(dist.new_group([0, 1]))
        group.size, group.rank, group.global_ranks   # 2, 0 or 1, (0, 1)
    """

    def __init__(self, group: Any | None) -> None:
        self.group = group
        self.size: int
        self.rank: int
        self.global_ranks: tuple[int, ...]
        if group is None or not dist.is_initialized():
            self.size, self.rank, self.global_ranks = 1, 0, (0,)
            self.group = None
            return
        self.rank = dist.get_rank(group)
        if self.rank < 0:  # (torch: "Invalid process group specified", a call later)
            raise ConfigError(f"rank {dist.get_rank()} is not in the process group given to the "
                              f"MoE layer", "pass a group that holds this rank, or group=None "
                              "(every expert here)")
        self.size = dist.get_world_size(group)
        self.global_ranks = tuple(dist.get_process_group_ranks(group))
        self._backend = str(dist.get_backend(group)).lower()

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertGroup:
        return self  # a handle on a process group: copies of a layer share it

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def wire_device(self, device: torch.device) -> torch.device:
        """Where tensors travel: the GPU under NCCL, else the CPU (gloo)."""
        if device.type == "cuda" and "nccl" in self._backend:
            return device
        return torch.device("cpu")

    def record(self, sent: Sequence[int], received: Sequence[int], row_bytes: int) -> None:
        """Put one exchange's bytes (rows per peer) in the run's traffic meter, if there is one."""
        if not runtime.is_initialized():
            return
        meter = runtime.current().meter
        for i, peer in enumerate(self.global_ranks):
            if i == self.rank:
                continue
            if sent[i]:
                meter.record(peer, sent[i] * row_bytes, SENT, estimated=True)
            if received[i]:
                meter.record(peer, received[i] * row_bytes, RECV, estimated=True)


def _exchange(x: torch.Tensor, send: Sequence[int], recv: Sequence[int],
              group: ExpertGroup) -> torch.Tensor:
    """Rows ``send[i]`` of ``x`` go to rank i; ``recv[i]`` rows come from rank i."""
    wire = group.wire_device(x.device)
    src = x.to(wire).contiguous()
    out = src.new_empty((sum(recv),) + tuple(x.shape[1:]))
    with torch.profiler.record_function(A2A_RANGE):
        dist.all_to_all_single(out, src, output_split_sizes=list(recv),
                               input_split_sizes=list(send), group=group.group)
    row_bytes = x.element_size() * math.prod(x.shape[1:])
    group.record(send, recv, row_bytes)
    return out.to(x.device)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, send: list[int], recv: list[int],
                group: ExpertGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group  # type: ignore[attr-defined]
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The adjoint of sending rows is receiving their gradients: the same exchange, reversed.
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: Sequence[int], recv: Sequence[int],
               group: ExpertGroup) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: ``send[i]`` rows to rank i, ``recv[i]`` from it.

    Every rank of the group must call it, also ranks that send or receive
    nothing: under autograd its backward is a collective too, so the input is
    made to require grad whenever grad mode is on, keeping the backward graph
    the same on every rank.
    """
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    out: torch.Tensor = _AllToAll.apply(x, list(send), list(recv), group)
    return out


def exchange_counts(counts: torch.Tensor, group: ExpertGroup,
                    device: torch.device | None = None) -> torch.Tensor:
    """All-to-all of per-expert counts: (ranks, local experts) -> what each rank sends me.

    Args:
        counts: (num_experts,) rows this rank sends to every global expert; expert
            ``e`` lives on rank ``e // local`` (local experts per rank).
        device: where the tokens are (default: the counts'): a GPU's counts travel by NCCL.

    Returns:
        (ranks, local) int64 on the CPU: rows rank r sends to each of my local experts.
    """
    local = counts.numel() // group.size
    wire = group.wire_device(device or counts.device)
    src = counts.to(device=wire, dtype=torch.int64).reshape(group.size, local).contiguous()
    out = torch.empty_like(src)
    with torch.profiler.record_function(COUNTS_RANGE):
        dist.all_to_all_single(out, src, group=group.group)
    return out.cpu()


def all_gather_counts(counts: torch.Tensor, group: ExpertGroup) -> torch.Tensor:
    """Every rank's ``counts`` stacked by rank: (ranks, *counts.shape), on the CPU."""
    if not group.distributed:
        return counts.cpu().unsqueeze(0)
    wire = group.wire_device(counts.device)
    src = counts.to(device=wire, dtype=torch.int64).reshape(-1).contiguous()
    out = src.new_empty(group.size * src.numel())  # gloo wants the ranks along dim 0, flat
    _all_gather_flat(out, src, group=group.group)
    return out.cpu().reshape((group.size,) + tuple(counts.shape))
