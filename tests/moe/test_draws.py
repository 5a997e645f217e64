"""Random numbers by position: the same numbers for a token however the batch is split."""

import math

import torch

from polytrain.moe.draws import new_seed, normal, uniform


def test_a_slice_of_the_table_is_the_same_rows_drawn_on_their_own():
    whole = uniform(123, 0, 40, 6)
    for first, rows in [(0, 1), (5, 7), (39, 1), (17, 23)]:
        assert torch.equal(uniform(123, first, rows, 6), whole[first:first + rows])
    assert torch.equal(normal(9, 11, 5, 3), normal(9, 0, 16, 3)[11:])


def test_positions_past_32_bits_and_seeds_past_32_bits_give_new_numbers():
    low = uniform(2**40 + 5, 0, 4, 4)
    assert not torch.equal(low, uniform(5, 0, 4, 4))            # the seed's high word counts
    far = uniform(5, 2**33, 4, 4)                               # positions past 2**32
    assert not torch.equal(far, uniform(5, 0, 4, 4))
    assert far.unique().numel() == 16


def test_uniform_and_normal_have_their_moments_and_no_structure():
    u = uniform(42, 1000, 500, 200).flatten()
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 0.002
    # neighbours (the next column, the next row) are uncorrelated
    table = uniform(42, 0, 500, 200) - 0.5
    for a, b in [(table[:, 1:], table[:, :-1]), (table[1:], table[:-1])]:
        assert abs(float((a * b).mean() / (table.var()))) < 0.02
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert float(((counts - n / 10) ** 2 / (n / 10)).sum()) < 30  # chi-square, 9 dof
    z = normal(7, 0, 400, 250).flatten()
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float((z > 1.96).float().mean()) - 0.025) < 0.003


def test_the_seed_comes_from_torchs_generator():
    torch.manual_seed(3)
    a = new_seed()
    torch.manual_seed(3)
    assert new_seed() == a and 0 <= a < 2**62
