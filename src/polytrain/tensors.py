"""Host copies of tensors and state dicts, and the dtype sums are taken in; shared by every
layer (imports torch only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["host_copy", "host_state", "sum_dtype"]


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of ``dtype`` values is taken in: float32 for 16-bit floats (a float16
    sum is inf past 65504, a bfloat16 one keeps 8 bits), else ``dtype`` itself (integers
    stay exact)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``tensor`` in host memory: one copy, from any device."""
    return tensor.detach().to("cpu", copy=True)


def host_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor replaced by its host copy (other values as they are)."""
    return {k: host_copy(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
