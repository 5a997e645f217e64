"""The drop-ins' shared module (strategies/synced.py): what its forward sends, metered."""

import pytest
import torch
from torch import nn

import polytrain
from polytrain.comm.meter import RECV, SENT
from tests.harness import spawn


def forwards_with_a_batchnorm(steps: int = 2) -> tuple[int, list[tuple[int, int]]]:
    """The buffers' bytes, and the cross-machine bytes (sent, received) each forward of
    Herring's drop-in metered, broadcasting worker 0's BatchNorm statistics."""
    from polytrain.herring import DistributedDataParallel as DDP
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    ddp = DDP(model, broadcast_buffers=True)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    seen = []
    for _ in range(steps):
        sent, recv = ctx.meter.total(SENT, inter=True), ctx.meter.total(RECV, inter=True)
        out = ddp(torch.randn(4, 4))
        seen.append((ctx.meter.total(SENT, inter=True) - sent,
                     ctx.meter.total(RECV, inter=True) - recv))
        out.sum().backward()
    return buffer_bytes, seen


@pytest.mark.timeout(120)
def test_the_buffers_broadcast_at_each_forward_cross_machines_on_the_meter():
    # Symptom: a model with BatchNorm under herring's drop-in (broadcast_buffers, as torch's
    # DDP) sent worker 0's buffers to every machine at each training forward, and the meter
    # (traffic.machines: every byte that crosses machines) counted none of them. Cause:
    # SyncedModule.forward's dist.broadcast recorded nothing on ctx.meter.
    (nbytes, first), (same, second) = spawn(forwards_with_a_batchnorm, workers=2, nodes=2,
                                            colocated=1)
    assert nbytes == same == 2 * 6 * 4 + 8  # running mean and var, num_batches_tracked
    assert first == [(nbytes, 0)] * 2  # worker 0 sends them to worker 1's machine...
    assert second == [(0, nbytes)] * 2  # ...which receives them, at each forward
