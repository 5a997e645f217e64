"""Failures: a summation server that dies stops the run, and the message names it."""

import os
import signal
import time

import pytest
import torch

import polytrain
from polytrain import LaunchError
from polytrain.models import GPT
from tests.harness import spawn


def train_until_a_server_is_killed(directory: str, victim: int) -> None:
    """BytePS training; after step 3 worker 0 kills server rank ``victim`` with SIGKILL."""
    with open(os.path.join(directory, f"pid-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    ctx = polytrain.init()  # servers serve in here until they are killed
    torch.manual_seed(0)
    model = GPT(seq_len=8, d_model=16, layers=1, heads=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = polytrain.distribute(model, opt, strategy="byteps")
    x = torch.randint(0, 256, (2, 8))
    for step in range(400):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if step == 3 and ctx.worker_index == 0:
            with open(os.path.join(directory, f"pid-{victim}")) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_colocated_server_killed_mid_run_stops_the_run_naming_it(tmp_path):
    # Ranks: workers 0 (node0) and 1 (node1), colocated servers 2 (node0) and 3 (node1),
    # then the CPU machine's server 4.
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"server rank 3 \(machine node1\) failed: killed by "
                                          r"SIGKILL"):
        spawn(train_until_a_server_is_killed, workers=2, nodes=2, servers=1, colocated=1,
              args=(str(tmp_path), 3))
    assert time.monotonic() - start < 30
