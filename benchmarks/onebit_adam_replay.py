"""1-bit Adam's warm-up, replayed: 2 machines' BytePS arithmetic on the default GPT in one process.

Synchronous BytePS with 2 machines of one worker each does, per step and per
tensor: each worker's gradient of its half of the global batch (16 of 32);
for a compressed tensor, each machine's codec packs it (its own error
feedback), the server decodes both pushes, sums them in rank order and packs
the sum again (its own error feedback), and both workers divide the decoded
sum by 2; an uncompressed tensor's sum is exact. This program does the same
with the library's own codecs (:class:`~polytrain.ps.compression.Codec`),
option builders (``tensor_compression``, ``warmup_compression``) and 1-bit
Adam (the optimizer's ``_OneBitAdam``), in one process and without messages,
so a candidate costs one process's compute instead of five processes'.

The bytes are the formats' (:meth:`Compressor.nbytes`), pushes and pulls
alike, for the compressed tensors only, against their uncompressed bytes;
"whole run" counts the warm-up's steps. The measured figures, with the
command that made them, are in docs/from-byteps.md.

    python benchmarks/onebit_adam_replay.py --runs none                 # uncompressed
    python benchmarks/onebit_adam_replay.py --runs onebit/dithering:4/30 onebit/none/100
    python benchmarks/onebit_adam_replay.py --runs onebit:1024/dithering:4/40 --steps 300

A run is ``COMPRESS/WARMUP_WITH/W[/VARIANCE]`` (1-bit Adam after a warm-up of W
steps travelled as WARMUP_WITH; ``none``: uncompressed; VARIANCE what 1-bit Adam
freezes: ``sums``, the default, ``local``, ``local-bf16`` or ``refreshF``, see
:func:`replay`) or
``none``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from polytrain.comm.partition import TensorSpec
from polytrain.config import TrainConfig
from polytrain.data import GlobalBatches, get_dataset, shard
from polytrain.models import get_model
from polytrain.ps.compression import Codec, CompressOptions
from polytrain.strategies.byteps.optimizer import (
    _OneBitAdam,
    tensor_compression,
    warmup_compression,
)

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = TrainConfig(strategy="byteps")
WORKERS = 2


class _Wire:
    """One compressed tensor's codecs: each machine's and the server's (the same seed, as
    the engine seeds them all with the key)."""

    def __init__(self, options: CompressOptions, numel: int, seed: int) -> None:
        self.machines = [Codec(options, numel, seed=seed) for _ in range(WORKERS)]
        self.server = Codec(options, numel, seed=seed)
        self.nbytes = self.server.nbytes

    def sum(self, pushes: list[torch.Tensor]) -> torch.Tensor:
        total = None
        for codec, x in zip(self.machines, pushes):  # rank order, as the server's store
            decoded = self.server.decode(codec.encode(x))
            total = decoded if total is None else total.add_(decoded)
        assert total is not None
        return self.server.decode(self.server.encode(total))


def replay(compress: str, warmup_with: str, warmup: int, steps: int,
           variance: str = "sums") -> dict[str, Any]:
    """One run; ``compress`` 'none': uncompressed BytePS (Adam on exact sums).

    ``variance``: what 1-bit Adam freezes. 'sums': Adam's variance of the pulled sums
    (the warm-up's). 'local' or 'local-bf16': each worker's variance of its own
    gradients during the warm-up (no messages), averaged over the workers once at the
    end of the warm-up (one push and pull of float32 or bfloat16 values, counted).
    'refreshF': 1-bit Adam's ``refresh`` (``--compress-adam-refresh F``): each worker's
    variance of its own gradients, averaged (float32, counted) and frozen at steps
    W, W + F, W + F^2, ... (W may be 0)."""
    config = DEFAULTS.replace(steps=steps)
    spec = get_model(config.model)
    torch.manual_seed(config.seed)
    model = spec.make()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    adam = torch.optim.Adam(model.parameters(), lr=config.lr)
    specs = [TensorSpec.of(n, p) for n, p in named]
    main = tensor_compression(specs, None if compress == "none" else compress,
                              error_feedback=True)
    warming = warmup_compression(main, warmup_with) or [None] * len(main)
    # Keys: the warm-up's come after the main ones, as the engine declares them.
    wires = [None if c is None else _Wire(c, p.numel(), i) for i, (c, p) in
             enumerate(zip(main, params))]
    warm_wires = [None if c is None else _Wire(c, p.numel(), len(params) + i) for i, (c, p)
                  in enumerate(zip(warming, params))]
    local_v = [[torch.zeros_like(p) for p in params] for _ in range(WORKERS)]
    beta2 = adam.param_groups[0]["betas"][1]
    refresh = int(variance[len("refresh"):]) if variance.startswith("refresh") else 0
    onebit = None
    if compress != "none":
        packed = [i for i, c in enumerate(main) if c is not None]
        sync = SimpleNamespace(warmup=warmup, params=params, compressing=False, synced=0,
                               buckets=[SimpleNamespace(members=[i], offsets=[0],
                                                        numel=p.numel())
                                        for i, p in enumerate(params)],
                               compression=main, packed=packed,
                               # The servers' exact sum of both machines' own variances.
                               average=lambda _: [(sum(v[i] for v in local_v) / WORKERS)
                                                  .reshape(-1) for i in packed])
        # With refresh, 1-bit Adam's own buffer of local variances sees both machines'
        # gradients (one object here); average() above reads each machine's instead.
        onebit = _OneBitAdam(adam, sync, refresh)  # type: ignore[arg-type]
    seq_len = int(model.seq_len)
    batches = GlobalBatches(get_dataset(config.data), batch_size=config.batch_size,
                            window=seq_len + 1, seed=config.seed)
    losses: list[float] = []
    sent = plain = 0  # the compressed tensors' bytes, packed and as floats
    for step, batch in zip(range(steps), batches):
        inputs, targets = spec.split(batch)
        grads, step_losses = [], []
        for w in range(WORKERS):
            adam.zero_grad(set_to_none=True)
            loss = spec.loss(model(shard(inputs, w, WORKERS)), shard(targets, w, WORKERS))
            loss.backward()
            step_losses.append(loss.item())
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for p in params])
        losses.append(sum(step_losses) / WORKERS)
        compressing = step >= warmup
        if onebit is not None and variance != "sums" and (refresh or not compressing):
            for w in range(WORKERS):
                for v, g in zip(local_v[w], grads[w]):
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if onebit is not None:
            onebit.sync.synced = step + 1  # as after synchronize()
            if onebit.refreshing():  # one exact push and pull of the compressed tensors
                sent += sum(2 * 4 * params[i].numel() for i in onebit.sync.packed)
        if onebit is not None and variance.startswith("local") and step == warmup:
            for i, p in enumerate(params):
                if wires[i] is None:
                    continue
                mean = sum(v[i] for v in local_v) / WORKERS
                if variance == "local-bf16":
                    mean = mean.bfloat16().float()
                adam.state[p]["exp_avg_sq"].copy_(mean)
                sent += 2 * (2 if variance == "local-bf16" else 4) * p.numel()
        if onebit is not None:
            onebit.sync.compressing = compressing
        for i, p in enumerate(params):
            pushes = [g[i] for g in grads]
            if onebit is not None:
                pushes = [onebit.local_momentum(i, x) for x in pushes]
            wire = wires[i] if compressing else warm_wires[i]
            if wire is None:
                total = pushes[0] + pushes[1]
                if wires[i] is not None:
                    sent += 2 * 4 * p.numel()
            else:
                total = wire.sum([x.reshape(-1) for x in pushes]).view(p.shape)
                sent += 2 * wire.nbytes
            if wires[i] is not None:
                plain += 2 * 4 * p.numel()
            p.grad = total.div_(WORKERS)
        if onebit is not None and compressing:
            onebit.step()
        else:
            adam.step()
    after = losses[-20:]
    return {"compress": compress, "warmup_with": warmup_with, "warmup": warmup,
            "variance": variance,
            "steps": steps, "final_loss": losses[-1], "last20_loss": sum(after) / len(after),
            "whole_run_compressed_bytes_vs_none": sent / plain if plain else 1.0}


def parse_run(run: str) -> tuple[str, str, str, str]:
    """``C[/WITH[/W[/VARIANCE]]]`` -> (compress, warm-up compressor, warm-up steps, variance);
    what is left out takes its default by position ("none", "0", "sums")."""
    parts = run.split("/")
    if len(parts) > 4:
        raise SystemExit(f"--runs {run}: at most C/WITH/W/VARIANCE")
    return tuple(parts + ["none", "0", "sums"][len(parts) - 1:])  # type: ignore[return-value]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["none"], metavar="C/WITH/W")
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps)
    parser.add_argument("--out", default=str(RESULTS / "onebit_adam_replay.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    rows: dict[str, Any] = json.loads(out.read_text())["runs"] if out.exists() else {}
    for run in args.runs:
        compress, warmup_with, warmup, variance = parse_run(run)
        started = time.perf_counter()
        row = replay(compress, warmup_with, int(warmup), args.steps, variance)
        row["wall_s"] = time.perf_counter() - started
        key = f"{run} ({args.steps} steps)"
        rows[key] = row
        base = rows.get(f"none ({args.steps} steps)")
        if base is not None:
            row["loss_vs_none"] = row["final_loss"] / base["final_loss"]
            row["last20_vs_none"] = row["last20_loss"] / base["last20_loss"]
        print(f"{key:<40} final {row['final_loss']:.4f} ({row.get('loss_vs_none', 0):.3f}) "
              f"last20 {row['last20_loss']:.4f} ({row.get('last20_vs_none', 0):.3f}) "
              f"whole-run bytes {row['whole_run_compressed_bytes_vs_none']:.4f} "
              f"(1/{1 / row['whole_run_compressed_bytes_vs_none']:.1f}) "
              f"{row['wall_s']:.0f} s", flush=True)
        out.write_text(json.dumps({"command": "python benchmarks/onebit_adam_replay.py "
                                   "--runs ... (rows added run by run)", "runs": rows},
                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
