"""What gloo alone achieves for a push/pull step on the emulated cluster: the service's ceiling.

No summation service, no engine: 2n emulated machines of one process, n
"workers" and n "servers". Every worker sends each server its share of a
model of M bytes (M/n each) in chunks of ``--chunk-bytes``, all posted at once
(gloo sends a connection's messages in order); a server sums chunk c once
every worker's has arrived and sends the sum back to every worker, on a
second group (a connection of its own per direction, as the service's
answers). Reported per step: when the pushes had all left ("push") and when
the last sum had arrived ("step"), against M at the link's rate (the
formula's time for a worker machine's bytes, each way). Needs root and
iproute2. Saves ``benchmarks/results/pushpull_ceiling.json``.

    sudo ./dev bench pushpull_ceiling                       # 200mbit, chunks of 4 MB and 1 MB
    sudo ./dev bench pushpull_ceiling --rate 1gbit --chunk-bytes 4096000 512000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import polytrain
from polytrain.launch.network import parse_rate

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"OMP_NUM_THREADS": "1"}


def step_times(model_bytes: int, chunk_bytes: int, steps: int) -> list[tuple[float, float]]:
    """(push s, step s) of each step on this rank."""
    polytrain.init()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pushes, answers = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    n = world // 2
    workers, servers = range(n), range(n, world)
    share = model_bytes // 4 // n                      # floats per server
    chunks = [(lo, min(share, lo + chunk_bytes // 4)) for lo in range(0, share, chunk_bytes // 4)]
    times = []
    for _ in range(steps):
        dist.barrier(group=pushes)
        t0 = time.perf_counter()
        if rank in workers:
            grad, out = torch.ones(share * n), torch.empty(share * n)
            sent, received = [], []
            for c, (lo, hi) in enumerate(chunks):
                for i, s in enumerate(servers):
                    at = slice(i * share + lo, i * share + hi)
                    sent.append(pushes.send([grad[at]], s, c))
                    received.append(answers.recv([out[at]], s, c))
            for h in sent:
                h.wait()
            push = time.perf_counter() - t0
            for h in received:
                h.wait()
        else:
            bufs = {(w, c): torch.empty(hi - lo) for w in workers
                    for c, (lo, hi) in enumerate(chunks)}
            arrived = {key: pushes.recv([buf], key[0], key[1]) for key, buf in bufs.items()}
            answered = []
            for c in range(len(chunks)):
                for w in workers:
                    arrived[(w, c)].wait()
                total = sum(bufs[(w, c)] for w in workers)
                answered += [answers.send([total], w, c) for w in workers]
            push = time.perf_counter() - t0
            for h in answered:
                h.wait()
        dist.barrier(group=pushes)
        times.append((push, time.perf_counter() - t0))
    return times


def measure(rate: str, machines: int, model_bytes: int, chunk_bytes: int,
            steps: int) -> dict[str, Any]:
    per_rank = polytrain.launch(step_times, args=(model_bytes, chunk_bytes, steps),
                                workers=2 * machines, nodes=2 * machines, bandwidth=rate,
                                env=ENV)
    steady = [t for rank_times in per_rank[:machines] for t in rank_times[1:]]  # workers
    link_s = model_bytes * 8 / parse_rate(rate)
    push = statistics.median(p for p, _ in steady)
    step = statistics.median(s for _, s in steady)
    return {"rate": rate, "chunk_bytes": chunk_bytes, "model_bytes": model_bytes,
            "machines": machines, "steps": steps, "link_s": link_s,
            "push_s_median": push, "step_s_median": step,
            "step_over_link": step / link_s, "push_over_link": push / link_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--machines", type=int, default=4, help="workers, and as many servers")
    p.add_argument("--model-bytes", type=int, default=27_300_000,
                   help="M (default 27.3 MB: the cluster benchmark's MLP)")
    p.add_argument("--chunk-bytes", type=int, nargs="+", default=[4_096_000, 1_024_000])
    p.add_argument("--steps", type=int, default=4, help="steps per size (the first is dropped)")
    p.add_argument("--out", type=Path, default=RESULTS / "pushpull_ceiling.json")
    args = p.parse_args()
    rows = [measure(args.rate, args.machines, args.model_bytes, c, args.steps)
            for c in args.chunk_bytes]
    for r in rows:
        print(f"{r['rate']:>8} chunks of {r['chunk_bytes']:>9,} B: push "
              f"{r['push_s_median']:.3f} s, step {r['step_s_median']:.3f} s; M at the link's "
              f"rate {r['link_s']:.3f} s (step {r['step_over_link']:.2f}x)")
    args.out.parent.mkdir(exist_ok=True)
    # Every flag as given: the command reproduces the run (machines, model bytes, steps too).
    args.out.write_text(json.dumps({"command": "sudo ./dev bench pushpull_ceiling "
                                    + " ".join(sys.argv[1:]), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
