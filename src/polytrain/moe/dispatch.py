"""Dispatch and combine: tokens sorted to their experts, across ranks and back, weighted.

The path of one MoE forward (FastMoE's, arXiv 2103.13262)::

    x (T, d), indices/scores (T, k)
      -> route:     kept slots sorted by global expert (stable: token order kept)
      -> gather:    rows = x[token of each slot]                 (R, d)
      -> counts:    all-to-all of rows per expert                (ranks, local)
      -> exchange:  all-to-all of rows, split by owner rank      source-major
      -> permute:   expert-major, each local expert's rows contiguous
      -> experts:   all local experts at once
      -> back:      permute back, all-to-all back                (R, d)
      -> combine:   out[t] = sum_s scores[t, s] * y[t, s]         dropped slots: 0

Every step is differentiable: the gather's adjoint sums the top-k copies'
gradients, the exchanges' adjoints are the reverse exchanges. Inference with
every expert local streams instead: gather, compute and add back a chunk at a
time, planned on the host on the CPU, on the device on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.autograd.function import FunctionCtx

from .exchange import ExpertGroup, all_to_all, exchange_counts
from .experts import ExpertMLP, autocast_dtype, chunk_plan

__all__ = ["Routing", "route", "expert_major", "combine", "moe_apply", "ExpertsFn"]

#: Local experts on rows sorted by local expert: (rows, d), counts -> (rows, d).
ExpertsFn = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]


@dataclass(frozen=True)
class Routing:
    """Where every kept slot goes (plain data from the gate's indices).

    Attributes:
        slots: (rows,) kept slot ids ``token * top_k + s``, sorted by expert, in token order
            within an expert.
        counts: (num_experts,) rows per global expert, on the CPU.
        tokens, top_k: the shape of the indices.
    """

    slots: torch.Tensor
    counts: torch.Tensor
    tokens: int
    top_k: int

    @property
    def token_of_row(self) -> torch.Tensor:
        return torch.div(self.slots, self.top_k, rounding_mode="floor")


def route(indices: torch.Tensor, num_experts: int) -> Routing:
    """Sort the kept slots of ``indices`` (tokens, top_k) by expert (the counting sort's order).

    >>> r = route(torch.tensor([[1, 0], [1, -1]]), num_experts=2)
    >>> r.slots.tolist(), r.counts.tolist()
    ([1, 0, 2], [1, 2])
    """
    tokens, top_k = indices.shape
    flat = indices.reshape(-1)
    kept = (flat >= 0).nonzero().squeeze(1)
    experts = flat[kept]
    order = torch.sort(experts, stable=True).indices
    counts = torch.bincount(experts, minlength=num_experts).cpu()
    return Routing(kept[order], counts, tokens, top_k)


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The order that makes received rows expert-major.

    Rows arrive grouped by source rank, then by local expert (``counts`` is
    (ranks, local)); the result lists them grouped by local expert, then rank.

    >>> expert_major(torch.tensor([[1, 2], [1, 0]])).tolist()   # rows: r0e0 r0e1 r0e1 r1e0
    [0, 3, 1, 2]
    """
    ranks, local = counts.shape
    sizes = counts.reshape(-1)
    start = (sizes.cumsum(0) - sizes).reshape(ranks, local).t().reshape(-1)  # blocks, (e, r)
    sizes_er = counts.t().reshape(-1)
    out_start = sizes_er.cumsum(0) - sizes_er
    block = torch.repeat_interleave(torch.arange(ranks * local), sizes_er)
    return start[block] + torch.arange(int(sizes.sum())) - out_start[block]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class _Combine(torch.autograd.Function):
    """``out[token[r]] += weight[r] * y[r]`` over every row r, with its backward written out.

    Cheaper than scattering rows into (tokens, top_k, d) slots and a batched
    matmul: one pass each way, no zero-filled slot buffer.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, y: torch.Tensor, weight: torch.Tensor, token: torch.Tensor,
                tokens: int) -> torch.Tensor:
        out = y.new_zeros(tokens, y.shape[1])
        out.index_add_(0, token, y * weight.unsqueeze(1))
        ctx.save_for_backward(y, weight, token)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, weight, token = ctx.saved_tensors
        rows = grad.index_select(0, token)                                   # (rows, d)
        grad_weight = torch.linalg.vecdot(rows, y) if ctx.needs_input_grad[1] else None
        grad_y = rows.mul_(weight.unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return grad_y, grad_weight, None, None


def combine(y: torch.Tensor, routing: Routing, scores: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_s scores[t, s] * y[row of slot (t, s)]``; dropped slots add nothing.

    Args:
        y: (rows, d) expert outputs in ``routing.slots`` order.
        scores: (tokens, top_k).
    """
    weight = scores.reshape(-1).index_select(0, routing.slots).to(y.dtype)  # (rows,)
    out: torch.Tensor = _Combine.apply(y, weight, routing.token_of_row, routing.tokens)
    return out                                                               # (tokens, d)


def _streamed(x: torch.Tensor, routing: Routing, scores: torch.Tensor,
              experts: ExpertMLP) -> torch.Tensor:
    """Inference with every expert local: gather, compute and add back a chunk at a time.

    Nothing is kept for a backward pass, so no (rows, d) buffer of every slot is
    needed: memory stays that of one chunk, like a per-expert loop's.
    """
    out = torch.zeros_like(x)
    token = routing.token_of_row
    weight = scores.reshape(-1).index_select(0, routing.slots).to(x.dtype)
    counts = routing.counts.tolist()
    for e0, e1, r0, r1 in chunk_plan(counts, experts.stream_rows(x.device)):
        y = experts(x.index_select(0, token[r0:r1]), counts[e0:e1], first=e0)
        out.index_add_(0, token[r0:r1], y.mul_(weight[r0:r1].unsqueeze(1)))
    return out


def _streamed_on_device(x: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor,
                        experts: ExpertMLP) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference with every expert local where the grouped matmul runs (GPUs): no host wait.

    :func:`_streamed` reads the routing on the host to plan its chunks, and spends
    host time per expert; the GPU idles meanwhile. Here the slots are sorted by expert
    on the device and go through the experts a fixed number of rows at a time, each
    chunk's group ends computed on the device. A dropped slot joins the last expert's
    group (every group must end inside the chunk) and adds into a spare row.

    The experts' weights are stacked (copied) for the grouped matmul, at most the
    chunk budget's worth at once: past it, experts go in groups, and the host reads
    the counts once to find each group's rows.

    Returns (tokens, d) and the (experts,) rows per expert, on x's device.
    """
    tokens, top_k = indices.shape
    num, slots = len(experts), indices.numel()
    flat = indices.reshape(-1)
    kept = flat >= 0
    # Rows per expert, dropped slots counted in a last bin (torch.bincount reads its max).
    bins = torch.zeros(num + 1, dtype=flat.dtype, device=flat.device).scatter_add_(
        0, torch.where(kept, flat, num), torch.ones_like(flat))
    expert, order = torch.sort(torch.where(kept, flat, num - 1), stable=True)
    ends = bins[:num].cumsum(0)
    ends[-1] += bins[num]
    token = torch.where(kept, torch.div(torch.arange(slots, device=flat.device), top_k,
                                        rounding_mode="floor"), tokens).index_select(0, order)
    source = token.clamp(max=max(tokens - 1, 0))            # a dropped slot computes a row too
    weight = scores.reshape(-1).index_select(0, order).to(x.dtype)
    biases = experts.proj_biases(x)
    xs = experts.with_ones(x)
    out = x.new_zeros(tokens + 1, x.shape[1])               # row ``tokens``: dropped slots
    step, size = experts.chunk_rows(x.device), experts.group_size(x)
    host_ends = None if size >= num else [0, *ends.tolist()]    # the one host read
    for e0 in range(0, num, size):
        e1 = min(num, e0 + size)
        first, end = (0, slots) if host_ends is None else (host_ends[e0], host_ends[e1])
        if first == end:
            continue
        stacked = experts.stacked(e0, e1, x)
        for r0 in range(first, end, step):
            r1 = min(end, r0 + step)
            offs = (ends[e0:e1] - r0).clamp_(0, r1 - r0).to(torch.int32)
            y = experts.on_offsets(xs.index_select(0, source[r0:r1]), stacked, offs,
                                   biases.index_select(0, expert[r0:r1]))
            out.index_add_(0, token[r0:r1], y.mul_(weight[r0:r1].unsqueeze(1)))
    return out[:tokens], bins[:num]


def moe_apply(x: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor,
              experts: ExpertsFn, num_experts: int,
              group: ExpertGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``experts`` on the tokens the gate sent them; combine by score.

    Every rank of ``group`` must call it together (also with no tokens to send).

    Args:
        x: (tokens, d) this rank's tokens.
        indices, scores: (tokens, top_k) from a gate; index -1 is a dropped slot.
        experts: this rank's experts, called on rows sorted by local expert.
        num_experts: experts over the whole group; global expert e lives on rank
            ``e // (num_experts / group size)``.
        group: the expert-parallel group (None: every expert is local).

    Returns:
        (tokens, d) output (with the default experts under autocast, in its dtype, as an
        ``nn.Linear``'s), and (local experts,) rows each local expert processed: int64
        on the CPU, except in inference on a GPU, where they stay on x's device (reading
        them there would wait for the GPU).
    """
    group = group or ExpertGroup(None)
    dtype = autocast_dtype(x) if isinstance(experts, ExpertMLP) else None
    if dtype is not None:  # the tokens travel and are combined in the dtype they compute in
        x = x.to(dtype)
    streams = not group.distributed and not torch.is_grad_enabled()
    if streams and isinstance(experts, ExpertMLP) and experts.grouped_here(x):
        return _streamed_on_device(x, indices, scores, experts)
    routing = route(indices, num_experts)
    if streams and isinstance(experts, ExpertMLP):
        return _streamed(x, routing, scores, experts), routing.counts
    rows = x.index_select(0, routing.token_of_row)                          # (R, d)
    if not group.distributed:
        y = experts(rows, routing.counts.tolist())
        return combine(y, routing, scores), routing.counts
    ranks, local = group.size, num_experts // group.size
    send = routing.counts.reshape(ranks, local).sum(1).tolist()
    incoming = exchange_counts(routing.counts, group, x.device)              # (ranks, local)
    recv = incoming.sum(1).tolist()
    received = all_to_all(rows, send, recv, group)                           # source-major
    load = incoming.sum(0)
    if ranks > 1 and local > 1:
        perm = expert_major(incoming).to(x.device)
        out = experts(received.index_select(0, perm), load.tolist())
        out = out.index_select(0, _inverse(perm))
    else:
        out = experts(received, load.tolist())
    y = all_to_all(out, recv, send, group)
    return combine(y, routing, scores), load
