"""The emulated cluster's links: what a shaped NIC carries, and how the meter and the NIC agree.

For each rate, two machines of one worker: the payload rate of a gloo
all-reduce and of one send, and the NIC's bytes per payload byte; then
``ddp`` and ``byteps`` (one server) on an MLP of 1.6 MB of gradients, each
machine's NIC bytes per metered byte; and per rate, a message of 16 KB, 120 KB
and 1 MiB sent after the link was idle (0.5 s): its time against its bytes'
time at the rate (a real NIC saves no credit while idle). Needs root and
iproute2. Saves ``benchmarks/results/links.json``.

    sudo ./dev bench links                   # 10mbit, 200mbit, 1gbit, 5gbit
    sudo ./dev bench links --rates 100mbit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.launch.scripts import sends_after_idle_s  # noqa: E402

import polytrain  # noqa: E402
from polytrain.launch.network import nic_bytes, parse_rate  # noqa: E402
from polytrain.train import run_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ENV = {"OMP_NUM_THREADS": "1"}
MIB = 1 << 20
IDLE_SIZES = [16_384, 120_000, MIB]


def _nic() -> tuple[int, int]:
    return nic_bytes(os.getpid(), os.environ["POLYTRAIN_NIC"])


def all_reduce(nbytes: int, rounds: int) -> dict[str, float]:
    """Seconds for ``rounds`` all-reduces of ``nbytes`` and the NIC bytes sent meanwhile."""
    ctx = polytrain.init()
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x, group=ctx.groups.workers)  # connections up, buffers warm
    dist.barrier(group=ctx.groups.workers)
    sent0, _ = _nic()
    t0 = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(x, group=ctx.groups.workers)
    seconds = time.perf_counter() - t0
    dist.barrier(group=ctx.groups.workers)  # the last bytes have left
    return {"seconds": seconds, "nic_sent": _nic()[0] - sent0}


def send(nbytes: int) -> float:
    """The receiver's seconds for one ``nbytes`` message from worker 0."""
    ctx = polytrain.init()
    x = torch.ones(nbytes // 4)
    dist.barrier(group=ctx.groups.workers)
    t0 = time.perf_counter()
    if ctx.rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    return time.perf_counter() - t0


def links(rate: str, nbytes: int, rounds: int) -> dict[str, Any]:
    shaped = {"workers": 2, "nodes": 2, "bandwidth": rate, "env": ENV}
    ring = polytrain.launch(all_reduce, args=(nbytes, rounds), **shaped)[0]
    # Two ranks: each sends (and receives) the whole buffer once per all-reduce.
    payload = nbytes * rounds
    one = polytrain.launch(send, args=(nbytes,), **shaped)[1]
    idle = polytrain.launch(sends_after_idle_s, args=(IDLE_SIZES, 0.5, 5), **shaped)[1]
    # The line time counts the headers htb counts: 66 bytes per 1448-byte segment.
    line_s = {n: n * (1 + 66 / 1448) * 8 / parse_rate(rate) for n in IDLE_SIZES}
    return {"rate": rate, "rate_mbit_s": parse_rate(rate) / 1e6,
            "all_reduce_mbit_s": payload * 8 / ring["seconds"] / 1e6,
            "send_mbit_s": nbytes * 8 / one / 1e6,
            "nic_bytes_per_payload_byte": ring["nic_sent"] / payload,
            "after_idle": [{"bytes": n, "ms": [1e3 * t for t in idle[n]],
                            "median_ms": 1e3 * statistics.median(idle[n]),
                            "line_ms": 1e3 * line_s[n]} for n in IDLE_SIZES]}


def agreement(strategy: str, servers: int, rate: str) -> list[dict[str, Any]]:
    config = polytrain.TrainConfig(strategy=strategy, model="mlp", workers=2, nodes=2,
                                   servers=servers, steps=20, batch_size=8, optimizer="sgd",
                                   lr=0.05, bandwidth=rate, quiet=True,
                                   model_options={"d_model": 256})
    with tempfile.TemporaryDirectory() as out:
        metrics = run_config(config.replace(out=out), env=ENV)
    return [{"strategy": strategy, "machine": m["name"],
             "metered_sent": m["sent_bytes_per_step"],
             "nic_sent_per_metered": m["nic_sent_bytes_per_step"] / m["sent_bytes_per_step"],
             "nic_recv_per_metered": m["nic_recv_bytes_per_step"] / m["recv_bytes_per_step"]}
            for m in metrics["traffic"]["machines"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["10mbit", "200mbit", "1gbit", "5gbit"])
    parser.add_argument("--mib", type=int, default=8, help="all-reduce and send size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "links.json")
    args = parser.parse_args()
    rows = [links(r, args.mib * MIB, args.rounds) for r in args.rates]
    for r in rows:
        print(f"{r['rate']:>8}: all-reduce {r['all_reduce_mbit_s']:7.1f} Mbit/s, send "
              f"{r['send_mbit_s']:7.1f} Mbit/s of payload; NIC "
              f"{r['nic_bytes_per_payload_byte']:.4f} bytes per payload byte")
        for m in r["after_idle"]:
            print(f"{'':>8}  {m['bytes']:>9,} B after idle: {m['median_ms']:8.2f} ms "
                  f"(its bytes at the rate: {m['line_ms']:8.2f} ms)")
    meter = agreement("ddp", 0, "1gbit") + agreement("byteps", 1, "1gbit")
    for m in meter:
        print(f"{m['strategy']:>6} {m['machine']:>7}: NIC/meter sent "
              f"{m['nic_sent_per_metered']:.4f}, received {m['nic_recv_per_metered']:.4f} "
              f"({m['metered_sent'] / 1e6:.2f} MB metered per step)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"links": rows, "meter": meter}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
