"""A word-level corpus: the standard library's source split into words and identifiers.

Ids are frequency ranks with a fixed scatter: rank ``k`` (0 the most frequent
word) is id ``1 + (k * A) mod (vocab - 1)`` for a multiplier ``A`` coprime with
``vocab - 1``, and id 0 is the unknown token (every word past the ``vocab - 1``
most frequent). The scatter spreads frequent words over the whole table, so
contiguous row ranges (a parameter server's partitions) carry about equal shares
of the rows a step touches; without it the first range would hold nearly all.
"""

from __future__ import annotations

import collections
import functools
import math
import re

import torch

from ..errors import ConfigError
from .text import stdlib_corpus

__all__ = ["words_corpus", "rank_to_id", "id_to_rank", "WORD", "UNKNOWN"]

#: Words and identifiers (REFERENCE.md section 3 measured the corpus with this pattern).
WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
#: The id of every word outside the vocabulary.
UNKNOWN = 0
#: Bytes of source read at most (``stdlib_corpus`` reads the standard library's top level
#: and one level below, outside its tests: about 11 MB on Python 3.11, under this).
CORPUS_BYTES = 16 << 20


@functools.lru_cache(maxsize=None)
def _multiplier(span: int) -> int:
    """A multiplier coprime with ``span`` near the golden ratio of it (0 for an empty span)."""
    if span <= 1:
        return 1
    a = max(1, int(0.6180339887 * span)) | 1
    while math.gcd(a, span) != 1:
        a += 2
    return a


def rank_to_id(ranks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Word ids of frequency ranks ``ranks`` (0 the most frequent) in a ``vocab`` vocabulary."""
    span = vocab - 1
    return 1 + (ranks * _multiplier(span)) % span


def id_to_rank(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The inverse of :func:`rank_to_id`; the unknown token gets rank ``vocab - 1``."""
    span = vocab - 1
    inverse = pow(_multiplier(span), -1, span) if span > 1 else 0
    ranks = ((ids - 1) * inverse) % max(span, 1)
    return torch.where(ids == UNKNOWN, torch.full_like(ids, span), ranks)


@functools.lru_cache(maxsize=4)
def words_corpus(vocab: int, max_bytes: int = CORPUS_BYTES) -> torch.Tensor:
    """The words of the standard library's source (``stdlib_corpus``'s files, in its order)
    as int64 ids of a ``vocab`` vocabulary: the ``vocab - 1`` most frequent words (ties:
    first seen first) and the unknown token 0 for the rest.

    Example::

        ids = words_corpus(1000)       # (tokens,) int64 in [0, 1000)
    """
    if vocab < 2:
        raise ConfigError(f"a word vocabulary holds the unknown token and at least one word "
                          f"(got --vocab {vocab})", "pass --vocab 100000")
    raw = bytes(stdlib_corpus(max_bytes).numpy())
    words = WORD.findall(raw)
    counts = collections.Counter(words)
    # most_common keeps first-seen order among equal counts: the same ranks in every process.
    table = {w: UNKNOWN for w in counts}
    known = [w for w, _ in counts.most_common(vocab - 1)]
    ids = rank_to_id(torch.arange(len(known)), vocab).tolist()
    table.update(zip(known, ids))
    return torch.tensor(list(map(table.__getitem__, words)), dtype=torch.int64)
