"""Offline data sets (nothing is downloaded) and deterministic global batches."""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import ConfigError
from .batches import GlobalBatches, check_divisible, shard
from .text import stdlib_corpus

__all__ = ["GlobalBatches", "shard", "check_divisible", "stdlib_corpus", "get_dataset",
           "dataset_names"]

_DATASETS: dict[str, Callable[[], torch.Tensor]] = {"text": stdlib_corpus}


def dataset_names() -> list[str]:
    return sorted(_DATASETS)


def get_dataset(name: str) -> torch.Tensor:
    """The corpus called ``name`` as a 1-D tensor of token ids."""
    try:
        return _DATASETS[name]()
    except KeyError:
        raise ConfigError(f"unknown data set {name!r}; the data sets are: "
                          f"{', '.join(dataset_names())}", "pass --data text") from None
