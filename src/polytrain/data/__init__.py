"""Offline data sets (nothing is downloaded) and deterministic global batches."""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from ..errors import ConfigError, unknown
from .batches import EpochBatches, GlobalBatches, check_divisible, shard, windows
from .text import stdlib_corpus

__all__ = ["DEFAULT_DATASET", "corpus_digest", "GlobalBatches", "EpochBatches", "windows", "shard",
           "check_divisible", "check_dataset",
           "stdlib_corpus", "get_dataset", "dataset_names", "held_out_split", "HELD_OUT",
           "EVAL_SAMPLES", "training_data"]

#: The fraction of a data set's end that ``--eval-every`` holds out (never trained on).
HELD_OUT = 0.1
#: Held-out samples an evaluation runs on (non-overlapping windows of the held-out part).
EVAL_SAMPLES = 256


def _part(start: float, end: float) -> Callable[[], torch.Tensor]:
    def part() -> torch.Tensor:
        corpus = stdlib_corpus()
        return corpus[int(start * corpus.numel()):int(end * corpus.numel())]
    return part


def corpus_digest(tokens: torch.Tensor) -> str:
    """The sha256 of a corpus's token ids: the data sets are this Python's standard library,
    so another Python (another machine's, or after an upgrade) is another corpus."""
    return hashlib.sha256(tokens.contiguous().cpu().numpy().tobytes()).hexdigest()


#: The data set a run trains on unless told (``--data``).
DEFAULT_DATASET = "text"

# A fine-tuning task: pre-train on the first three quarters of the corpus (modules whose
# paths sort first), fine-tune on the last 64th (other modules, other code; small enough
# that a short fine-tuning run sees it for a few epochs).
_DATASETS: dict[str, Callable[[], torch.Tensor]] = {
    "text": stdlib_corpus, "text-pretrain": _part(0.0, 0.75),
    "text-finetune": _part(63 / 64, 1.0)}


def held_out_split(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(training part, held-out part): the last :data:`HELD_OUT` of the corpus is held out."""
    cut = int(corpus.numel() * (1 - HELD_OUT))
    return corpus[:cut], corpus[cut:]


def dataset_names() -> list[str]:
    return sorted(_DATASETS)


def check_dataset(name: str) -> None:
    """Refuse a data set name that is not registered, listing those that are."""
    if name not in _DATASETS:
        raise unknown("data set", name, dataset_names(), "pass --data text")


def get_dataset(name: str) -> torch.Tensor:
    """The corpus called ``name`` as a 1-D tensor of token ids."""
    check_dataset(name)
    return _DATASETS[name]()


def training_data(corpus: torch.Tensor, *, window: int, batch_size: int, seed: int,
                  sampling: str = "random", hold_out: bool = False
                  ) -> tuple[GlobalBatches | EpochBatches, torch.Tensor | None]:
    """A run's batches of ``window`` tokens over ``corpus`` (``sampling`` random or epoch)
    and, with ``hold_out``, the held-out windows (at most :data:`EVAL_SAMPLES` of the last
    :data:`HELD_OUT`, never trained on; else None). A corpus too short for them is refused
    (ConfigError). On a ``meta`` corpus of the right length it checks without the data:
    ``polytrain train`` refuses such a run before any process starts.
    """
    held_out = None
    if hold_out:
        corpus, rest = held_out_split(corpus)
        if rest.numel() < window:
            raise ConfigError(f"--eval-every holds out the last tenth of the data, "
                              f"{rest.numel()} tokens, fewer than one window of --seq-len "
                              f"{window - 1} + 1", "pass a smaller --seq-len, larger --data, "
                              "or leave out --eval-every")
        held_out = windows(rest, window, limit=EVAL_SAMPLES)
    if sampling == "epoch":
        return EpochBatches(corpus, batch_size=batch_size, window=window, seed=seed), held_out
    return GlobalBatches(corpus, batch_size=batch_size, window=window, seed=seed), held_out
