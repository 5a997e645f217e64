"""GradientSync's pieces that need no processes: the flags of keep_missing."""

import pytest
import torch

from polytrain.ps.grads import flags_dtype, presence_flags, read_presence
from polytrain.tensors import sum_dtype


def summed(flags: list[torch.Tensor], per_machine: int) -> torch.Tensor:
    """The servers' sum of every worker's flags: each machine's first (in its dtype for the
    sum), then the machines' in rank order, as the engine and a sum store take it."""
    machines = []
    for m in range(0, len(flags), per_machine):
        total = flags[m].to(sum_dtype(flags[m].dtype), copy=True)
        for f in flags[m + 1:m + per_machine]:
            total.add_(f)
        machines.append(total.to(flags[m].dtype))
    total = machines[0].to(sum_dtype(machines[0].dtype), copy=True)
    for t in machines[1:]:
        total.add_(t)
    return total.to(machines[0].dtype)


@pytest.mark.parametrize("workers, per_machine", [(2, 1), (4095, 1), (5000, 1), (5000, 8),
                                                  (50000, 8)])
def test_the_flags_count_frozen_and_present_exactly_for_any_number_of_workers(workers,
                                                                              per_machine):
    # Symptom: 5000 workers that all froze a parameter were refused as "frozen on 4999 of
    # the 5000 workers". Cause: the flags (1 per gradient + W + 1 per frozen copy) were
    # summed in float32, exact only while W (W + 2) < 2**24 (4,095 workers).
    # Parameters: frozen everywhere; trained everywhere; used by no worker; frozen on
    # worker 0 alone and trained (with a gradient) on the others.
    flags = [presence_flags([False, True, False, w > 0], [True, False, False, w == 0], workers)
             for w in range(workers)]
    assert read_presence(summed(flags, per_machine), workers) == [
        (workers, 0), (0, workers), (0, 0), (1, workers - 1)]


def test_the_flags_stay_four_bytes_while_their_sums_fit_in_32_bits():
    assert flags_dtype(46339) == torch.int32  # 46339 x 46341 < 2**31
    assert flags_dtype(46340) == torch.int64
    assert presence_flags([True], [False], 2).dtype == torch.int32
