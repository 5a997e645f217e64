"""Random numbers by position: a token of the global batch gets the same numbers on any rank.

A gate's noise, random routing and jitter must not depend on how the global
batch is split over data-parallel ranks, or expert parallelism would change
what the model learns. Drawing every token's numbers on every rank and
keeping one's slice would cost each rank the whole batch's draws (the
Switch gate's jitter is as large as the batch's activations). Instead each
number is a hash of (seed, position), so a rank computes only its own
tokens' numbers, and they are the ones one process with the whole batch
computes:

- position: the token's index in the global batch (the ranks' tokens
  concatenated in rank order) and the column;
- hash: Wellons' 32-bit ``lowbias32`` applied twice (low and high words of
  the position), its multiplications made exact in int64 on any device;
- seed: one draw from torch's global generator per forward, taken from the
  batch group's rank 0, so ``torch.manual_seed`` still repeats a gate's
  decisions and the generator advances by one draw whatever the ranks.
"""

from __future__ import annotations

import math

import torch

__all__ = ["new_seed", "uniform", "normal"]

_MASK = 0xFFFFFFFF


def new_seed() -> int:
    """One draw from torch's global generator: the seed of one forward's numbers."""
    return int(torch.randint(0, 2**62, (1,)))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x * c mod 2**32 for x < 2**32, with no product past 2**48 (int64 never overflows).
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _key(seed: int, stream: int) -> tuple[int, int]:
    mixed = _hash32(torch.tensor([(seed ^ stream * 0x9E3779B9) & _MASK,
                                  ((seed >> 32) ^ stream) & _MASK], dtype=torch.int64))
    return int(mixed[0]), int(mixed[1])


def uniform(seed: int, first: int, rows: int, cols: int, device: torch.device | str = "cpu",
            *, stream: int = 0) -> torch.Tensor:
    """(rows, cols) float32 in [0, 1): rows ``first .. first + rows - 1`` of the seed's table.

    >>> torch.equal(uniform(7, 2, 3, 4), uniform(7, 0, 5, 4)[2:])
    True
    """
    index = ((torch.arange(rows, device=device, dtype=torch.int64) + first).unsqueeze(1) * cols
             + torch.arange(cols, device=device, dtype=torch.int64))
    k0, k1 = _key(seed, stream)
    h = _hash32(_hash32((index & _MASK) ^ k0) ^ (index >> 32) ^ k1)
    return (h >> 8).to(torch.float32) * 2.0**-24


def normal(seed: int, first: int, rows: int, cols: int,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, cols) float32 standard normal numbers by position (Box-Muller)."""
    u1 = uniform(seed, first, rows, cols, device, stream=1)
    u2 = uniform(seed, first, rows, cols, device, stream=2)
    return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)
