"""Context.new_group: members-only groups among any workers."""

import pytest
import torch
import torch.distributed as dist

import polytrain
from tests.harness import spawn


def pairs_then_cross_pairs() -> float:
    ctx = polytrain.init()
    r = ctx.worker_index
    pair = ctx.new_group([0, 1] if r < 2 else [2, 3])
    cross = ctx.new_group([0, 2] if r % 2 == 0 else [1, 3])
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=pair)
    dist.all_reduce(t, group=cross)
    return float(t)


@pytest.mark.timeout(60)
def test_members_only_groups_between_leaders_and_others():
    # Regression: rank 0 (a leader) and rank 1 hung creating a group of [0, 1]. torch
    # names a members-only group by its ranks and the count of groups the process
    # holds; rank 0 held one more (the leaders' group) than rank 1.
    assert spawn(pairs_then_cross_pairs, workers=4, nodes=2) == [6.0] * 4
