"""Fusion buckets: consecutive tensors grouped up to a size cap and moved as one flat buffer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ConfigError
from .partition import TensorSpec

__all__ = ["Bucket", "plan_buckets", "buckets_of", "flatten", "unflatten_into"]


@dataclass(frozen=True)
class Bucket:
    """Tensors ``members`` (indices into the specs) laid out back to back in one buffer."""

    index: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]  # element offset of each member in the flat buffer
    numel: int
    dtype: torch.dtype
    nbytes: int


def plan_buckets(specs: Sequence[TensorSpec], cap_bytes: int, *,
                 reverse: bool = True) -> tuple[Bucket, ...]:
    """Group tensors into buckets of at most ``cap_bytes`` (a larger tensor gets its own).

    With ``reverse`` (the default) the last tensors come first, as their
    gradients are ready first in the backward pass (DDP's and Herring's order).
    Tensors of different dtypes never share a bucket.
    """
    if cap_bytes < 1:
        raise ConfigError(f"bucket cap must be positive (got {cap_bytes} bytes)",
                          "pass a cap such as 25 MB (25 * 2**20 bytes)")
    order = list(range(len(specs)))
    if reverse:
        order.reverse()
    buckets: list[Bucket] = []
    members: list[int] = []
    size = 0

    def close() -> None:
        nonlocal members, size
        if not members:
            return
        offsets, numel = [], 0
        for m in members:
            offsets.append(numel)
            numel += specs[m].numel
        dtype = specs[members[0]].dtype
        buckets.append(Bucket(len(buckets), tuple(members), tuple(offsets), numel, dtype, size))
        members, size = [], 0

    for i in order:
        spec = specs[i]
        if members and (size + spec.nbytes > cap_bytes or spec.dtype != specs[members[0]].dtype):
            close()
        members.append(i)
        size += spec.nbytes
    close()
    return tuple(buckets)


def buckets_of(specs: Sequence[TensorSpec],
               groups: Sequence[Sequence[int]]) -> tuple[Bucket, ...]:
    """Buckets of the given members (indices into ``specs``, one dtype per group), in order."""
    out = []
    for k, members in enumerate(groups):
        offsets = [sum(specs[m].numel for m in members[:j]) for j in range(len(members))]
        dtypes = {specs[m].dtype for m in members}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {k} mixes dtypes {sorted(map(str, dtypes))}")
        out.append(Bucket(k, tuple(members), tuple(offsets),
                          sum(specs[m].numel for m in members), specs[members[0]].dtype,
                          sum(specs[m].nbytes for m in members)))
    return tuple(out)


def flatten(bucket: Bucket, tensors: Sequence[torch.Tensor],
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the bucket's member tensors into one flat buffer (``out`` if given)."""
    if out is None:
        device = tensors[bucket.members[0]].device
        out = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    for m, off in zip(bucket.members, bucket.offsets):
        t = tensors[m]
        out[off:off + t.numel()].copy_(t.reshape(-1))
    return out


def unflatten_into(bucket: Bucket, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a flat buffer back into the bucket's member tensors."""
    for m, off in zip(bucket.members, bucket.offsets):
        t = tensors[m]
        t.copy_(flat[off:off + t.numel()].view_as(t))
