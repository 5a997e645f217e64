"""What a forward sends before it runs, metered: the drop-ins' shared module (strategies/synced.py)
and ddp (torch's DDP) broadcast worker 0's buffers."""

import pytest
import torch
from torch import nn

import polytrain
from polytrain.comm.meter import RECV, SENT
from tests.harness import spawn


def estimated(meter, direction: str) -> int:
    """The cross-machine bytes recorded as estimated (collectives torch moved) so far:
    Herring's own messages, whose last replies may be recorded just after a backward
    returns (in the next forward's window), are not."""
    return sum(n for (peer, d, est), n in meter._totals.items()
               if est and d == direction and meter.topology.is_inter(meter.rank, peer))


def forwards_with_a_batchnorm(strategy: str, steps: int = 2) -> tuple[int, list[tuple[int, int]]]:
    """The buffers' bytes, and the estimated cross-machine bytes (sent, received) each
    training forward metered, broadcasting worker 0's BatchNorm statistics: under
    Herring's drop-in, or ddp (torch's DDP, which records its all-reduce at the forward)."""
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    if strategy == "herring":
        from polytrain.herring import DistributedDataParallel as DDP
        ddp = DDP(model, broadcast_buffers=True)
    else:
        ddp, _ = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      strategy="ddp")
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    seen = []
    for _ in range(steps):
        sent, recv = estimated(ctx.meter, SENT), estimated(ctx.meter, RECV)
        out = ddp(torch.randn(4, 4))
        seen.append((estimated(ctx.meter, SENT) - sent, estimated(ctx.meter, RECV) - recv))
        out.sum().backward()
    return buffer_bytes, seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["herring", "ddp"])
def test_the_buffers_broadcast_at_each_forward_cross_machines_on_the_meter(strategy):
    # Symptom: a model with BatchNorm under herring's drop-in (broadcast_buffers, as torch's
    # DDP) or ddp sent worker 0's buffers to every machine at each training forward, and
    # the meter (traffic.machines: every byte that crosses machines) counted none of them.
    # Cause: SyncedModule.forward's dist.broadcast, and torch's DDP's, recorded nothing.
    (nbytes, first), (same, second) = spawn(forwards_with_a_batchnorm, workers=2, nodes=2,
                                            colocated=1, args=(strategy,))
    assert nbytes == same == 2 * 6 * 4 + 8  # running mean and var, num_batches_tracked
    # ddp's ring all-reduce of 2 ranks: each sends and receives the whole gradient.
    ring = 0 if strategy == "herring" else (4 * 6 + 6 + 6 + 6) * 4
    assert first == [(nbytes + ring, ring)] * 2  # worker 0 sends them to worker 1's...
    assert second == [(ring, nbytes + ring)] * 2  # ...machine, at each forward
