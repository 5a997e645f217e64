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


def plan_buckets(specs: Sequence[TensorSpec], cap_bytes: int | None = None, *,
                 fill_bytes: int | None = None, reverse: bool = True) -> tuple[Bucket, ...]:
    """Group consecutive tensors into buckets, by one of two size rules.

    - ``cap_bytes``: a bucket holds at most this many bytes (a larger tensor gets
      its own): DDP's and Herring's buckets, and MoE's.
    - ``fill_bytes``: a bucket closes once it holds at least this many bytes
      (0: every tensor alone): BytePS's fusion of small tensors, which are then
      cut into partitions like any tensor.

    With ``reverse`` (the default) the last tensors come first, as their
    gradients are ready first in the backward pass. Tensors of different dtypes
    never share a bucket.

    Example::

        >>> import torch
        >>> s = [TensorSpec(n, (k,), torch.float32) for n, k in [("w", 100), ("b", 4), ("v", 9)]]
        >>> [b.members for b in plan_buckets(s, fill_bytes=400, reverse=False)]
        [(0,), (1, 2)]
        >>> [b.members for b in plan_buckets(s, cap_bytes=400)]
        [(2, 1), (0,)]
    """
    if (cap_bytes is None) == (fill_bytes is None):
        raise ValueError("plan_buckets takes one of cap_bytes and fill_bytes")
    if cap_bytes is not None and cap_bytes < 1:
        raise ConfigError(f"bucket cap must be positive (got {cap_bytes} bytes)",
                          "pass a cap such as 25 MB (25 * 2**20 bytes)")
    if fill_bytes is not None and fill_bytes < 0:
        raise ConfigError(f"fusion size must be 0 (no fusion) or more (got {fill_bytes} "
                          f"bytes)", "pass 262144, or 0")
    order = list(range(len(specs)))
    if reverse:
        order.reverse()
    groups: list[list[int]] = []
    members: list[int] = []
    size = 0
    for i in order:
        spec = specs[i]
        if members and (spec.dtype != specs[members[0]].dtype or (
                cap_bytes is not None and size + spec.nbytes > cap_bytes)):
            groups.append(members)
            members, size = [], 0
        members.append(i)
        size += spec.nbytes
        if fill_bytes is not None and size >= fill_bytes:
            groups.append(members)
            members, size = [], 0
    if members:
        groups.append(members)
    return buckets_of(specs, groups)


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
