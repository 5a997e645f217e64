"""Functions the launcher tests run in child processes."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import polytrain


def identity() -> dict:
    ctx = polytrain.init()
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total, group=ctx.groups.workers)
    return {"rank": ctx.rank, "role": ctx.role, "machine": ctx.machine,
            "workers": ctx.topology.workers, "servers": ctx.topology.servers,
            "leaders": ctx.topology.leaders, "local": ctx.local_workers,
            "sum_of_worker_ranks": float(total), "threads": os.environ["OMP_NUM_THREADS"]}


def worker_raises(bad_rank: int) -> None:
    ctx = polytrain.init()
    if ctx.rank == bad_rank:
        raise RuntimeError(f"boom on purpose from rank {ctx.rank}")
    x = torch.zeros(1)
    dist.all_reduce(x, group=ctx.groups.workers)  # blocks: the bad rank never joins


def killed_by_signal(victim: int) -> None:
    ctx = polytrain.init()
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def write_pid_and_hang(directory: str) -> None:
    with open(os.path.join(directory, f"pid-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    polytrain.init()
    time.sleep(60)


def server_dies_mid_run(directory: str) -> None:
    """Workers push to a server; after the first round worker 0 kills the server (kill -9)."""
    from polytrain.comm import TensorSpec, partition
    from polytrain.ps import balanced, engine_for

    with open(os.path.join(directory, f"pid-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    ctx = polytrain.init()  # the server serves in here until it is killed
    parts = partition([TensorSpec("g", (256,), torch.float32)], 1 << 20)
    engine = engine_for(ctx)
    [sums] = engine.sums([TensorSpec("g", (256,), torch.float32)],
                         balanced(parts, ctx.topology.servers), local_reduce=False)
    g = torch.ones(256)
    engine.submit(sums, g)
    engine.wait(sums)
    if ctx.worker_index == 0:
        server = ctx.topology.servers[0]
        with open(os.path.join(directory, f"pid-{server}")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    for _ in range(200):
        engine.submit(sums, g)
        engine.wait(sums)
        time.sleep(0.05)
