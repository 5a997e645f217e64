"""The checks every strategy runs at its wrap, in one process."""

import types

import pytest
import torch

from polytrain.errors import CommTimeout
from polytrain.launch.child import _waited_s
from polytrain.strategies import checks

# gloo's text for a receive that ran out of time (torch raises it as a RuntimeError).
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                "waiting 10000ms for recv operation to complete")


def _context(emulated_network: bool) -> types.SimpleNamespace:
    topology = types.SimpleNamespace(workers=[0, 1, 2, 3], machine=lambda rank: f"node{rank}")
    return types.SimpleNamespace(rank=3, topology=topology, timeout_s=10.0, machine="node3",
                                 groups=types.SimpleNamespace(workers=None),
                                 emulated_network=emulated_network)


def test_a_first_copy_that_times_out_names_the_tensor_its_size_and_the_timeout(monkeypatch):
    # Symptom: `polytrain train --strategy ddp --workers 4 --nodes 4 --bandwidth 134kbit
    # --timeout 10` ended in torch's traceback and gloo's "Timed out waiting 10000ms for recv
    # operation to complete" on node3, 10 s into the start. Cause: broadcast_module let
    # gloo's error through; the copy of fc0.weight (65,536 bytes) down gloo's broadcast tree
    # took three copies' time over the link, 11.7 s.
    copied = []

    def broadcast(tensor, src, group):
        copied.append(tuple(tensor.shape))
        if len(copied) == 2:
            raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(checks.dist, "broadcast", broadcast)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4))
    with pytest.raises(CommTimeout) as e:
        checks.broadcast_module(_context(emulated_network=True), model)
    assert copied == [(3, 2), (3,)]
    assert str(e.value) == (
        "rank 3 (machine node3): worker 0's copy of 0.bias (12 bytes) to every worker at the "
        "start did not arrive within --timeout 10 s (gloo passes it down a tree of the "
        "workers: the last waits for several copies over the links). HINT: on a slow link "
        "(--bandwidth), raise --timeout (POLYTRAIN_TIMEOUT) or the bandwidth; otherwise look "
        "at the other workers' logs")
    # The launcher reads it as a wait that timed out (it looks for what it waited for).
    assert e.value.waited_s == 10.0 and _waited_s(e.value) == 10.0
    # Without an emulated link the hint does not speak of one.
    copied.clear()
    with pytest.raises(CommTimeout, match=r"HINT: if the other workers are alive but slow, "
                                          r"raise --timeout \(POLYTRAIN_TIMEOUT\); otherwise "
                                          r"look at their logs$"):
        checks.broadcast_module(_context(emulated_network=False), model)
    # Any other error is torch's own.
    monkeypatch.setattr(checks.dist, "broadcast", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("Connection closed by peer")))
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):
        checks.broadcast_module(_context(emulated_network=True), model)


def test_ddps_own_first_copy_that_times_out_is_named_as_broadcast_modules_is(monkeypatch):
    # torch's DDP copies worker 0's whole model in one message as it is built, the copy
    # config.check_link times for ddp: its gloo timeout came out as torch's traceback.
    from polytrain.strategies import ddp

    def build(*args, **kwargs):
        raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(ddp, "_DDP", build)
    ctx = _context(emulated_network=True)
    ctx.device = torch.device("cpu")
    strategy = ddp.DDP(ctx, ddp.DDPOptions())
    model = torch.nn.Linear(2, 3)
    with pytest.raises(CommTimeout, match=r"^rank 3 \(machine node3\): torch's DDP's copy of "
                                          r"worker 0's model \(36 bytes of parameters and "
                                          r"buffers\) to every worker at the start did not "
                                          r"arrive within --timeout 10 s"):
        strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_store_wait_that_timed_out_is_read_as_a_wait_for_a_peer():
    # A worker spinning at PipeTransformer's freeze point (new groups: their set-up waits
    # on the store) was not named: the waiting worker's DistStoreError ("wait timeout
    # after 10000ms") did not read as a timeout, so the launcher took it for that worker's
    # own failure and named it, not the spinning one (benchmarks/faults.py busy-hang).
    waited = torch.distributed.DistStoreError("wait timeout after 10000ms, keys: /group/2")
    assert _waited_s(waited) == 10.0
    assert _waited_s(RuntimeError("the model's weights differ")) is None
