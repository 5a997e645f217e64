"""BytePS's gradient compressors on the default GPT task: final loss and bytes on the wire.

Runs synchronous BytePS uncompressed and with each compressor (error feedback
on), on 2 machines of one worker and one CPU server, and reads every machine's
metered bytes per step. Tensors under ``--compress-min-bytes`` (64 KiB: the
layer norms and biases) travel uncompressed in every run; their share of the
wire is the share of their bytes in the uncompressed run (Theorem 1's placement
moves every byte alike), so the compressed tensors' bytes are the run's total
minus that share. Saves ``benchmarks/results/byteps_compression.json``; the
table, with the command that made it, is in docs/from-byteps.md.

    python benchmarks/byteps_compression.py                 # the default GPT, 500 steps
    python benchmarks/byteps_compression.py --quick         # a smoke run
    python benchmarks/byteps_compression.py --compressors none onebit
    python benchmarks/byteps_compression.py --compressors topk:0.01 --keep   # add to those

``--keep`` keeps the runs already in ``--out`` that this one does not redo (so
the four runs can be made a few at a time); ``final_loss`` is the last step's
loss (one batch), ``last20_loss`` the mean of the last 20 steps' (less noisy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import polytrain
from polytrain.models import GPT
from polytrain.ps.compression import DEFAULT_MIN_BYTES
from polytrain.train import run_config

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"OMP_NUM_THREADS": "1"}
COMPRESSORS = ["none", "onebit", "topk:0.01", "dithering:4"]


def wire_bytes(metrics: dict[str, Any]) -> float:
    """Bytes per step sent by all machines together (each message once)."""
    return sum(m["sent_bytes_per_step"] for m in metrics["traffic"]["machines"])


def small_share(model_options: dict[str, Any]) -> float:
    """The share of the gradient's bytes in tensors under the compression threshold."""
    model = GPT(**model_options)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return sum(s for s in sizes if s < DEFAULT_MIN_BYTES) / sum(sizes)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--compressors", nargs="*", default=COMPRESSORS)
    parser.add_argument("--out", default=str(RESULTS / "byteps_compression.json"))
    parser.add_argument("--keep", action="store_true",
                        help="keep the runs in --out that this one does not redo")
    args = parser.parse_args(argv)
    model = {"seq_len": 16, "d_model": 64, "layers": 2} if args.quick else {}
    steps = args.steps or (30 if args.quick else 500)
    base = polytrain.TrainConfig(strategy="byteps", workers=2, nodes=2, servers=1, steps=steps,
                                 quiet=True, model_options=model, timeout_s=300)
    share = small_share(model)
    rows: dict[str, dict[str, Any]] = {}
    if args.keep and Path(args.out).exists():
        rows = dict(json.loads(Path(args.out).read_text())["runs"])
    for name in args.compressors:
        options = {} if name == "none" else {"compress": name, "error_feedback": True}
        started = time.perf_counter()
        metrics = run_config(base.replace(strategy_options=options), env=ENV)
        rows[name] = {"final_loss": metrics["final_loss"],
                      "last20_loss": sum(metrics["losses"][-20:]) / len(metrics["losses"][-20:]),
                      "wire_bytes_per_step":
                      wire_bytes(metrics), "wall_s": time.perf_counter() - started,
                      "model_bytes": metrics["model_bytes"]}
        print(name, rows[name], flush=True)
    plain = rows["none"]["wire_bytes_per_step"]
    for row in rows.values():
        compressed = row["wire_bytes_per_step"] - share * plain
        row["wire_vs_none"] = row["wire_bytes_per_step"] / plain
        row["compressed_tensors_vs_none"] = compressed / ((1 - share) * plain)
        row["loss_vs_none"] = row["final_loss"] / rows["none"]["final_loss"]
        if "last20_loss" in row and "last20_loss" in rows["none"]:
            row["last20_vs_none"] = row["last20_loss"] / rows["none"]["last20_loss"]
    result = {"command": "python benchmarks/byteps_compression.py" + (" --quick" if args.quick
                                                                       else "")
              + ("" if args.compressors == COMPRESSORS else " (a few compressors a run, "
                 "--compressors ... --keep)"),
              "config": {"workers": 2, "nodes": 2, "servers": 1, "steps": steps,
                         "model": model or "default GPT", "error_feedback": True,
                         "uncompressed_share_of_bytes": share},
              "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'compressor':<12} {'wire/none':>10} {'compressed/none':>16} {'loss':>8} "
          f"{'loss/none':>10} {'last20/none':>12}")
    for name, row in rows.items():
        print(f"{name:<12} {row['wire_vs_none']:>10.4f} {row['compressed_tensors_vs_none']:>16.4f}"
              f" {row['final_loss']:>8.4f} {row['loss_vs_none']:>10.4f}"
              f" {row.get('last20_vs_none', float('nan')):>12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
