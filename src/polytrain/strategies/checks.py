"""Start-up agreement among workers: the same model everywhere, the same initial weights."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..runtime import Context

__all__ = ["check_same_model", "check_same_tensors", "broadcast_module", "model_signature",
           "tensor_signature"]


Signature = list[tuple[str, tuple[int, ...], str]]


def tensor_signature(named: Iterable[tuple[str, torch.Tensor]]) -> Signature:
    """(name, shape, dtype) of every tensor, in order."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in named]


def model_signature(model: nn.Module) -> Signature:
    """(name, shape, dtype) of every parameter and buffer, in registration order."""
    return tensor_signature([*model.named_parameters(), *model.named_buffers()])


def _first_difference(a: list[Any], b: list[Any]) -> str:
    names_a = {n: (s, d) for n, s, d in a}
    names_b = {n: (s, d) for n, s, d in b}
    for n, s, d in a:
        if n not in names_b:
            return f"has {n!r} {list(s)} that the other lacks"
        if names_b[n] != (s, d):
            s2, d2 = names_b[n]
            return f"{n!r} is {list(s)} {d} there but {list(s2)} {d2} here"
    for n, s, _ in b:
        if n not in names_a:
            return f"lacks {n!r} {list(s)}"
    return "declares the same tensors in another order"


def check_same_model(ctx: Context, model: nn.Module) -> None:
    """Raise ConfigError on every worker if any worker built a different model."""
    check_same_tensors(ctx, model_signature(model), "model",
                       "build the same model with the same options on every worker")


def check_same_tensors(ctx: Context, signature: Signature,
                       what: str, fix: str, root: int = 0) -> None:
    """Raise ConfigError on every worker if any worker's ``signature`` ((name, shape, dtype)
    of each tensor, in order) differs from worker index ``root``'s; ``what`` names the
    tensors in the message ("model"), ``fix`` is the hint."""
    everyone: list[Any] = [None] * ctx.num_workers
    dist.all_gather_object(everyone, signature, group=ctx.groups.workers)
    reference = everyone[root]
    ref_rank = ctx.topology.workers[root]
    for i, other in enumerate(everyone):
        if other != reference:
            rank = ctx.topology.workers[i]
            raise ConfigError(
                f"worker rank {rank}'s {what} differs from worker rank {ref_rank}'s:"
                f" compared with worker {ref_rank}, worker {rank} "
                f"{_first_difference(reference, other)}", fix)


@torch.no_grad()
def broadcast_module(ctx: Context, model: nn.Module) -> None:
    """Copy worker 0's parameters and buffers to every worker."""
    src = ctx.topology.workers[0]
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src, group=ctx.groups.workers)
