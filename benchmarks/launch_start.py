"""How long a local run takes to start: processes forked from the fork server against fresh
interpreters (``POLYTRAIN_FORKSERVER=0``), side by side.

Each measurement is a run of P processes that join (``polytrain.init``) and return:
nothing but starting, rendezvous and ending. Two cases:

- ``one run``: a new launching process (``python -c "...launch(...)"``), as
  ``polytrain train`` is: its own imports, then the run (with the fork server,
  the server's one import too);
- ``next runs``: another run in a process that has launched before (test suites,
  sweeps, restarts after a failure), where the fork server already runs.

With ``--bandwidth RATE`` every process is a machine of its own on the emulated
network (needs root and iproute2): forked children enter their machine's
namespace with ``setns``, fresh ones start through ``ip netns exec``.

Modes alternate within each round (who goes first rotates); medians over the
rounds and the ratio fresh / forked per round. Saves
``benchmarks/results/launch_start.json``; docs/architecture.md cites it.

    python benchmarks/launch_start.py              # P = 2, 4, 6; 5 rounds
    python benchmarks/launch_start.py --bandwidth 1gbit --processes 4 --rounds 3 \
        --out benchmarks/results/launch_start_netns.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"forked": "1", "fresh": "0"}
ENV = {"OMP_NUM_THREADS": "1"}


def joined() -> int:
    import polytrain

    return polytrain.init().rank


def one_run(processes: int, mode: str, bandwidth: str | None) -> float:
    code = ("import sys, polytrain; sys.path.insert(0, sys.argv[2]); from launch_start import "
            "joined; n = int(sys.argv[1]); bw = sys.argv[3] or None; "
            "polytrain.launch(joined, workers=n, nodes=n if bw else 1, bandwidth=bw, "
            "timeout_s=60, env={'OMP_NUM_THREADS': '1'})")
    env = dict(os.environ, POLYTRAIN_FORKSERVER=MODES[mode])
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(processes), str(Path(__file__).parent),
                    bandwidth or ""], env=env, check=True)
    return time.perf_counter() - started


def next_run(processes: int, mode: str, bandwidth: str | None) -> float:
    import polytrain

    os.environ["POLYTRAIN_FORKSERVER"] = MODES[mode]
    started = time.perf_counter()
    polytrain.launch(joined, workers=processes, nodes=processes if bandwidth else 1,
                     bandwidth=bandwidth, timeout_s=60, env=ENV)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--processes", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--bandwidth", default=None,
                   help="each process a machine of its own on the emulated network")
    p.add_argument("--out", type=Path, default=RESULTS / "launch_start.json")
    args = p.parse_args(argv)
    next_run(2, "forked", None)  # the fork server of this process, started before any timing
    cases = {"one run": one_run, "next runs": next_run}
    times: dict[str, dict[str, dict[str, list[float]]]] = {
        case: {str(n): {m: [] for m in MODES} for n in args.processes} for case in cases}
    for rnd in range(args.rounds):
        for case, fn in cases.items():
            for n in args.processes:
                order = list(MODES) if (rnd + n) % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    times[case][str(n)][mode].append(fn(n, mode, args.bandwidth))
                row = times[case][str(n)]
                print(f"round {rnd + 1} {case:9s} P={n}: forked {row['forked'][-1]:.2f} s, "
                      f"fresh {row['fresh'][-1]:.2f} s", flush=True)
    summary: dict[str, Any] = {}
    for case, by_n in times.items():
        summary[case] = {}
        for n, row in by_n.items():
            ratios = [f / k for f, k in zip(row["fresh"], row["forked"])]
            summary[case][n] = {
                "forked_median_s": round(statistics.median(row["forked"]), 3),
                "fresh_median_s": round(statistics.median(row["fresh"]), 3),
                "fresh_over_forked_median": round(statistics.median(ratios), 2),
                "rounds": {m: [round(t, 3) for t in ts] for m, ts in row.items()}}
    result = {"command": "python benchmarks/launch_start.py " + " ".join(argv or sys.argv[1:]),
              "cpus": os.cpu_count(), "bandwidth": args.bandwidth, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for case, by_n in summary.items():
        for n, s in by_n.items():
            print(f"{case:9s} P={n}: forked {s['forked_median_s']:.2f} s, fresh "
                  f"{s['fresh_median_s']:.2f} s, fresh/forked {s['fresh_over_forked_median']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
