"""Random numbers by position: a token of the global batch gets the same numbers on any rank.

A gate's noise, random routing and jitter must not depend on how the global
batch is split over data-parallel ranks, or expert parallelism would change
what the model learns. Drawing every token's numbers on every rank and
keeping one's slice would cost each rank the whole batch's draws (the
Switch gate's jitter is as large as the batch's activations). Instead the
global batch's positions are cut into chunks (:func:`chunk_rows`: about a
sixteenth of the global batch, at most :data:`CHUNK` tokens; the same for
any split, since it depends only on the global batch), and chunk c's
numbers come from a torch generator seeded with a hash (splitmix64) of
(seed, c). A rank draws only the chunks its tokens fall in (at most two
partial ones more than its share), and its tokens get the numbers one
process with the whole batch gets.

The seed is one draw from torch's global generator per forward, taken from
the batch group's rank 0, so ``torch.manual_seed`` still repeats a gate's
decisions and the generator advances by one draw whatever the ranks.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "chunk_rows", "new_seed", "uniform", "normal"]

#: The most tokens in one chunk of the global batch (a chunk has a generator of its own).
CHUNK = 256

_MASK64 = (1 << 64) - 1


def chunk_rows(total: int) -> int:
    """Tokens per chunk for a global batch of ``total`` tokens.

    >>> chunk_rows(40), chunk_rows(4096), chunk_rows(10**6)
    (2, 256, 256)
    """
    return max(1, min(CHUNK, total // 16))


def new_seed() -> int:
    """One draw from torch's global generator: the seed of one forward's numbers."""
    return int(torch.randint(0, 2**62, (1,)))


def _chunk_seed(seed: int, chunk: int) -> int:
    # splitmix64's finaliser of (seed, chunk): distinct, well-mixed seeds for the generators.
    z = (seed + (chunk + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # a generator takes 63 bits


def _table(seed: int, first: int, rows: int, cols: int, total: int,
           device: torch.device | str, normal: bool) -> torch.Tensor:
    out = torch.empty((rows, cols), dtype=torch.float32, device=device)
    size = chunk_rows(total)
    generator = torch.Generator(device=device)
    draw = torch.randn if normal else torch.rand
    for chunk in range(first // size, (first + rows - 1) // size + 1 if rows else 0):
        generator.manual_seed(_chunk_seed(seed, chunk))
        block = draw((size, cols), generator=generator, device=device)
        lo, hi = max(first, chunk * size), min(first + rows, (chunk + 1) * size)
        out[lo - first:hi - first] = block[lo - chunk * size:hi - chunk * size]
    return out


def uniform(seed: int, first: int, rows: int, cols: int, total: int,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, cols) float32 in [0, 1): rows ``first .. first + rows - 1`` of the table of
    a global batch of ``total`` tokens.

    >>> torch.equal(uniform(7, 300, 3, 4, 600), uniform(7, 0, 600, 4, 600)[300:303])
    True
    """
    return _table(seed, first, rows, cols, total, device, normal=False)


def normal(seed: int, first: int, rows: int, cols: int, total: int,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, cols) float32 standard normal numbers by position, as :func:`uniform`."""
    return _table(seed, first, rows, cols, total, device, normal=True)
