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

    python benchmarks/byteps_compression.py --compressors onebit --compress-adam \
        --compress-warmup 100 --keep      # 1-bit Adam: 100 uncompressed steps first
    python benchmarks/byteps_compression.py --compressors onebit --compress-adam \
        --compress-warmup 30 --compress-warmup-with dithering:4 --keep   # a packed warm-up
    python benchmarks/byteps_compression.py --compressors none onebit:1024 --compress-adam \
        --compress-adam-refresh 8   # no warm-up: the variance frozen at 0, 8, 64

``--keep`` keeps the runs already in ``--out`` that this one does not redo (so
the four runs can be made a few at a time); ``final_loss`` is the last step's
loss (one batch), ``last20_loss`` the mean of the last 20 steps' (less noisy).
With ``--compress-warmup N`` the first N steps travel uncompressed (or as
``--compress-warmup-with`` says): the bytes
are given for the steps after the warm-up (``wire_bytes_per_step``, the
format's) and for the whole run (``whole_run_wire_bytes_per_step``, the warm-up
counted), both from every step's metered bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

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
    parser.add_argument("--out", default=None, help="default: results/byteps_compression.json "
                                                    "(--quick: byteps_compression_quick.json)")
    parser.add_argument("--compress-warmup", type=int, default=0, metavar="N",
                        help="compressed runs: the first N steps uncompressed")
    parser.add_argument("--compress-warmup-with", default="none", metavar="NAME[:ARG]",
                        help="compressed runs: what the warm-up travels as (default none)")
    parser.add_argument("--compress-adam", action="store_true",
                        help="compressed runs: 1-bit Adam (needs --compress-warmup or "
                             "--compress-adam-refresh)")
    parser.add_argument("--compress-adam-refresh", type=int, default=0, metavar="F",
                        help="with --compress-adam: freeze the variance anew at steps W, W + F^k")
    parser.add_argument("--keep", action="store_true",
                        help="keep the runs in --out that this one does not redo")
    args = parser.parse_args(argv)
    args.out = args.out or str(RESULTS / ("byteps_compression_quick.json" if args.quick
                                          else "byteps_compression.json"))
    model = {"seq_len": 16, "d_model": 64, "layers": 2} if args.quick else {}
    steps = args.steps or (30 if args.quick else 500)
    base = polytrain.TrainConfig(strategy="byteps", workers=2, nodes=2, servers=1, steps=steps,
                                 quiet=True, model_options=model, timeout_s=300)
    share = small_share(model)
    rows: dict[str, dict[str, Any]] = {}
    # The losses depend on torch and on the CPU kernels it picks (the float sums): a kept
    # run of another is no baseline (a dithering run was compared with an older torch's
    # uncompressed one).
    task = {"steps": steps, "model": model or "default GPT", "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if args.keep and Path(args.out).exists():
        kept = json.loads(Path(args.out).read_text())
        there = {k: kept.get("config", {}).get(k) for k in task}
        if there != task:  # ratios to another task's uncompressed run would mean nothing
            raise SystemExit(f"--keep: the runs in {args.out} are of another task or "
                             f"environment ({there}; now {task}): pass the same --steps and "
                             f"--quick, or leave out --keep (run them all again)")
        rows = dict(kept["runs"])
    for name in args.compressors:
        options: dict[str, Any] = {} if name == "none" else {"compress": name,
                                                             "error_feedback": True}
        key, warmup = name, 0
        if name != "none" and (args.compress_warmup or args.compress_adam):
            warmup = args.compress_warmup
            options.update(compress_warmup=warmup, compress_adam=args.compress_adam,
                           compress_warmup_with=args.compress_warmup_with)
            if args.compress_adam_refresh:
                options.update(compress_adam_refresh=args.compress_adam_refresh)
            key = f"{name} ({'1-bit Adam, ' if args.compress_adam else ''}warm-up {warmup}" + (
                "" if args.compress_warmup_with == "none" else
                f" as {args.compress_warmup_with}") + (
                f", variance frozen at W + {args.compress_adam_refresh}^k"
                if args.compress_adam_refresh else "") + ")"
        started = time.perf_counter()
        metrics = run_config(base.replace(strategy_options=options), env=ENV)
        by_step = metrics["traffic"]["sent_bytes_by_step"]
        after = by_step[max(1, warmup):]  # step 0 also carries the start-up's messages
        rows[key] = {"final_loss": metrics["final_loss"],
                     "last20_loss": sum(metrics["losses"][-20:]) / len(metrics["losses"][-20:]),
                     "compress_warmup": warmup,
                     "compress_warmup_with": options.get("compress_warmup_with", "none"),
                     "compress_adam": bool(options.get("compress_adam")),
                     "compress_adam_refresh": options.get("compress_adam_refresh", 0),
                     "wire_bytes_per_step": sum(after) / len(after),
                     "whole_run_wire_bytes_per_step": sum(by_step) / len(by_step),
                     # The warm-up's steps after the first, alone (None: fewer than 2).
                     "warmup_wire_bytes_per_step": sum(by_step[1:warmup]) / (warmup - 1)
                     if warmup > 1 else None,
                     "meter_wire_bytes_per_step": wire_bytes(metrics),
                     "wall_s": time.perf_counter() - started,
                     "model_bytes": metrics["model_bytes"]}
        print(key, rows[key], flush=True)
    if "none" not in rows:  # the runs are kept, without ratios to a run never made
        print(f"no uncompressed run in {args.out}: ratios left out (add --compressors none)",
              flush=True)
    plain = rows["none"]["wire_bytes_per_step"] if "none" in rows else None
    for row in rows.values() if plain is not None else ():
        compressed = row["wire_bytes_per_step"] - share * plain
        row["wire_vs_none"] = row["wire_bytes_per_step"] / plain
        row["compressed_tensors_vs_none"] = compressed / ((1 - share) * plain)
        if "whole_run_wire_bytes_per_step" in row:
            whole = row["whole_run_wire_bytes_per_step"]
            row["whole_run_wire_vs_none"] = whole / plain
            row["whole_run_compressed_tensors_vs_none"] = (whole - share * plain) / (
                (1 - share) * plain)
        if row.get("warmup_wire_bytes_per_step") is not None:
            row["warmup_compressed_tensors_vs_none"] = (
                row["warmup_wire_bytes_per_step"] - share * plain) / ((1 - share) * plain)
        row["loss_vs_none"] = row["final_loss"] / rows["none"]["final_loss"]
        if "last20_loss" in row and "last20_loss" in rows["none"]:
            row["last20_vs_none"] = row["last20_loss"] / rows["none"]["last20_loss"]
    result = {"command": "python benchmarks/byteps_compression.py" + (" --quick" if args.quick
                                                                       else "")
              + ("" if args.compressors == COMPRESSORS else " (a few compressors a run, "
                 "--compressors ... --keep)")
              + (f" --compress-warmup {args.compress_warmup}" if args.compress_warmup else "")
              + (f" --compress-warmup-with {args.compress_warmup_with}"
                 if args.compress_warmup_with != "none" else "")
              + (" --compress-adam" if args.compress_adam else "")
              + (f" --compress-adam-refresh {args.compress_adam_refresh}"
                 if args.compress_adam_refresh else ""),
              "config": {"workers": 2, "nodes": 2, "servers": 1, **task, "error_feedback": True,
                         "uncompressed_share_of_bytes": share},
              "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'compressor':<36} {'wire/none':>10} {'compressed/none':>16} {'whole run':>10} "
          f"{'loss':>8} {'loss/none':>10} {'last20/none':>12}")
    for name, row in rows.items() if plain is not None else ():
        print(f"{name:<36} {row['wire_vs_none']:>10.4f} "
              f"{row['compressed_tensors_vs_none']:>16.4f} "
              f"{row.get('whole_run_compressed_tensors_vs_none', float('nan')):>10.4f}"
              f" {row['final_loss']:>8.4f} {row['loss_vs_none']:>10.4f}"
              f" {row.get('last20_vs_none', float('nan')):>12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
