"""Random numbers by position: the same numbers for a token however the batch is split."""

import pytest
import torch

from polytrain.moe.draws import CHUNK, chunk_rows, new_seed, normal, uniform


@pytest.mark.parametrize("total", [5, 40, 1000, 5000])
def test_every_split_of_the_batch_gets_the_rows_of_the_whole_table(total):
    whole = uniform(123, 0, total, 6, total)
    cuts = sorted({0, total, total // 3, total // 2, total - 1, 1})
    for first, end in zip(cuts, cuts[1:]):
        assert torch.equal(uniform(123, first, end - first, 6, total), whole[first:end])
    assert torch.equal(normal(9, total // 2, total - total // 2, 3, total),
                       normal(9, 0, total, 3, total)[total // 2:])
    assert uniform(1, 3, 0, 6, total).shape == (0, 6)


def test_chunks_are_a_sixteenth_of_the_batch_up_to_a_bound():
    assert chunk_rows(1) == 1 and chunk_rows(160) == 10 and chunk_rows(10**7) == CHUNK


def test_seeds_and_chunks_give_new_numbers():
    a = uniform(5, 0, 512, 4, 4096)
    assert not torch.equal(a, uniform(6, 0, 512, 4, 4096))
    assert not torch.equal(a[:256], a[256:])  # chunk 0 and chunk 1
    assert a.unique().numel() == a.numel()


def test_uniform_and_normal_have_their_moments():
    u = uniform(42, 1000, 4000, 100, 10**6).flatten()
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.002 and abs(float(u.var()) - 1 / 12) < 0.001
    table = uniform(42, 0, 4000, 100, 10**6) - 0.5
    for a, b in [(table[:, 1:], table[:, :-1]), (table[1:], table[:-1])]:  # neighbours
        assert abs(float((a * b).mean() / table.var())) < 0.02
    z = normal(7, 0, 4000, 100, 10**6).flatten()
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01


def test_the_seed_comes_from_torchs_generator():
    torch.manual_seed(3)
    a = new_seed()
    torch.manual_seed(3)
    assert new_seed() == a and 0 <= a < 2**62
