"""Benchmark: the MoE layer on CPU against its floor and two plain-PyTorch MoEs; expert parallelism.

Part 1, one process (d_model 512, d_hidden 2048, 4096 tokens, top-2, naive gate,
no drops, E in {8, 32, 64}), forward (inference, no grad) and forward+backward:

- ``floor``:     the experts' arithmetic alone: the layer's grouped expert MLP on
                 rows already sorted by expert (same routing, same load);
- ``layer``:     polytrain.moe.MoE: gate + dispatch + experts + combine;
- ``masked``:    the common plain-PyTorch MoE: gate, then per expert select its
                 tokens (mask), run it, index_add the weighted output;
- ``per_token``: gate, then per token and slot call the expert on that token
                 (measured on fewer tokens and normalised: it is that slow).

``masked`` and ``per_token`` call the layer's experts, plain modules of one
Linear-GELU-Linear each, one by one as plain users do.

Throughput: medians of runs taken side by side, alternating the methods.
Peak memory: each (method, E, mode) in a fresh process with glibc returning every
allocation over 128 KiB to the OS (MALLOC_MMAP_THRESHOLD_), after a warm-up run
and malloc_trim; the peak resident set during one run (VmHWM, reset through
/proc/self/clear_refs) minus the resident set before it: the memory the run adds
on top of weights and inputs (gradients of the weights included).

Part 2, expert parallelism: the layer (E 32, 4096 tokens in all) split over 1, 2
and 4 local processes of one thread each, forward+backward, with the share of
time spent inside the token all-to-alls (profiler ranges, forward and backward).

Part 3 (``--device cuda``, on a GPU): part 1's floor, layer and masked loop in fp32 and
bf16 on 16,384 tokens, timed to ``torch.cuda.synchronize``; peak GPU memory per run; and
inference four ways side by side (``inference_paths``: the layer, the layer on a
quarter of its chunk budget, the host-routed streaming of the CPU, the masked loop),
with the time until each call returns to the host and, at bf16 E=8, profiler tables.

Usage: ./dev bench moe [--quick]   -> benchmarks/results/moe.json and moe.png
       ./dev bench moe --device cuda [--chunk-mib N ...] -> benchmarks/results/moe_cuda.json
       (moe_cuda_chunks.json with --chunk-mib)
(the results, with the commands that made them, are in docs/moe.md)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import polytrain
from polytrain.moe import MoE
from polytrain.moe.dispatch import route
from polytrain.moe.exchange import A2A_RANGE, COUNTS_RANGE
from polytrain.moe.experts import GPU_CHUNK_BYTES, ExpertMLP

D, H, K = 512, 2048, 2
RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("floor", "layer", "masked", "per_token")


class Case:
    """One layer and its inputs, the same for every method."""

    def __init__(self, experts: int, tokens: int, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(seed)
        self.layer = MoE(D, experts, top_k=K, d_hidden=H).to(device, dtype)
        self.x = torch.randn(tokens, D).to(device, dtype)
        self.gy = torch.randn(tokens, D).to(device, dtype)
        with torch.no_grad():
            indices, _ = self.layer.gate(self.x)
        routing = route(indices, experts)
        self.sorted = self.x.index_select(0, routing.token_of_row)
        self.counts = routing.counts.tolist()
        self.gy_sorted = torch.randn(self.sorted.shape).to(device, dtype)
        self.plain = plain_experts(self.layer)

    def zero_grad(self) -> None:
        for p in self.layer.parameters():
            p.grad = None


def plain_experts(layer: MoE) -> nn.ModuleList:
    """The layer's experts as plain-PyTorch users hold them: one Linear-GELU-Linear each.

    The layer keeps its experts that way too, so these are the same modules.
    """
    assert isinstance(layer.experts, ExpertMLP)
    return layer.experts


def masked_loop(layer: MoE, experts: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """The usual plain-PyTorch MoE: one masked selection and expert call per expert."""
    indices, scores = layer.gate(x)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = (indices == e).nonzero(as_tuple=True)
        if token.numel():
            y = expert(x[token])
            out.index_add_(0, token, y * scores[token, slot].unsqueeze(1))
    return out


def per_token_loop(layer: MoE, experts: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """The per-sample MoE FastMoE set out to beat: every token and slot on its own."""
    indices, scores = layer.gate(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for s in range(indices.shape[1]):
            acc = acc + scores[t, s] * experts[int(indices[t, s])](x[t:t + 1])[0]
        rows.append(acc)
    return torch.stack(rows)


def runner(case: Case, method: str, train: bool, tokens: int) -> Callable[[], None]:
    """One run of ``method`` (forward, or forward and backward) on ``tokens`` tokens."""
    layer = case.layer
    x, gy = case.x[:tokens], case.gy[:tokens]

    def run() -> None:
        case.zero_grad()
        with torch.set_grad_enabled(train):
            if method == "floor":
                xs = case.sorted.requires_grad_(train)
                y = layer.experts(xs, case.counts)
                if train:
                    y.backward(case.gy_sorted)
                return
            xi = x.detach().requires_grad_(train)
            fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
                "layer": layer, "masked": lambda v: masked_loop(layer, case.plain, v),
                "per_token": lambda v: per_token_loop(layer, case.plain, v)}
            y = fns[method](xi)
            if train:
                y.backward(gy)
    return run


def time_methods(experts: int, tokens: int, few: dict[str, int], reps: int,
                 case: Case | None = None,
                 methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    """Median seconds per run of every method, forward and forward+backward, alternating."""
    case = case or Case(experts, tokens)
    sync = _synchronizer(case.x.device)
    out: dict[str, Any] = {}
    for train in (False, True):
        mode = "fwd_bwd" if train else "fwd"
        n = few[mode]
        runs = {m: runner(case, m, train, n if m == "per_token" else tokens) for m in methods}
        for run in runs.values():
            run()  # warm-up
        sync()
        times: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(reps):
            for m in methods if rep % 2 == 0 else reversed(methods):
                if m == "per_token" and rep >= 2:
                    continue  # the slow one: two timed runs
                t0 = time.perf_counter()
                runs[m]()
                sync()
                times[m].append(time.perf_counter() - t0)
        out[mode] = {m: {"median_s": statistics.median(v),
                         "tokens": n if m == "per_token" else tokens,
                         "tokens_per_s": (n if m == "per_token" else tokens)
                         / statistics.median(v), "runs": len(v)} for m, v in times.items()}
    return out


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """What makes a timer's stop wait for the device's work (nothing on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# -- on a GPU ----------------------------------------------------------------------------------

GPU_METHODS = ("floor", "layer", "masked")  # the per-token loop launches kernels per token


def on_gpu(experts: tuple[int, ...], tokens: int, reps: int,
           chunk_mib: int | None = None) -> dict[str, Any]:
    """Part 1 on the GPU, in fp32 and bf16: tokens/s and the peak memory one run adds
    (``torch.cuda.max_memory_allocated`` over what was allocated before it).
    ``chunk_mib``: the experts' chunk budget (default: the layer's own for a GPU)."""
    from polytrain.moe.experts import _grouped_mm_works
    device = torch.device("cuda")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for e in experts:
            case = Case(e, tokens, device="cuda", dtype=dtype)
            if chunk_mib is not None:
                case.layer.experts.chunk_bytes = chunk_mib << 20
            t = time_methods(e, tokens, {"fwd": tokens, "fwd_bwd": tokens}, reps, case,
                             GPU_METHODS)
            memory: dict[str, dict[str, float]] = {}
            for mode in ("fwd", "fwd_bwd"):
                memory[mode] = {}
                for m in GPU_METHODS:
                    run = runner(case, m, mode == "fwd_bwd", tokens)
                    run()
                    case.zero_grad()
                    torch.cuda.synchronize(device)
                    before = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    run()
                    torch.cuda.synchronize(device)
                    memory[mode][m] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            paths = inference_paths(case, tokens, reps, profile=(dtype, e) == (torch.bfloat16, 8))
            rows.append({"dtype": name, "experts": e, "time": t, "memory_mb": memory,
                         "grouped_mm": _grouped_mm_works("cuda", dtype),
                         "inference_paths": paths})
            for mode in ("fwd", "fwd_bwd"):
                tm, mm = t[mode], memory[mode]
                rate = {m: tm[m]["tokens_per_s"] for m in GPU_METHODS}
                print(f"{name:8s} E={e:3d} {mode:8s}" + "".join(
                    f" | {m} {rate[m]:10.0f} tok/s {mm[m]:8.1f} MiB" for m in GPU_METHODS)
                    + f" | layer / masked {rate['layer'] / rate['masked']:.2f}x"
                    f", floor / layer {rate['floor'] / rate['layer']:.2f}x", flush=True)
            med = {m: v["median_s"] * 1e3 for m, v in paths["time"].items()}
            print(f"{name:8s} E={e:3d} inference | " + " | ".join(
                f"{m} {med[m]:.2f} ms (host {paths['host_ms'][m]:.2f} ms, "
                f"{paths['memory_mb'][m]:.0f} MiB)" for m in med)
                + f" | device path / host-routed {med['host_routed'] / med['layer']:.2f}x"
                f", layer / masked {med['masked'] / med['layer']:.2f}x", flush=True)
            del case
            torch.cuda.empty_cache()
    return {"config": {"d_model": D, "d_hidden": H, "top_k": K, "tokens": tokens,
                       "gate": "naive", "reps": reps, "torch": torch.__version__,
                       "chunk_mib": chunk_mib,
                       "gpu": torch.cuda.get_device_name(device)},
            "layer": rows,
            "notes": ["medians of runs alternating the methods, each timed to "
                      "torch.cuda.synchronize", "memory: peak allocated by one run over "
                      "what was allocated before it (weights, inputs), after a warm-up"]}


def inference_paths(case: Case, tokens: int, reps: int, profile: bool) -> dict[str, Any]:
    """Inference on the GPU four ways, alternating: the layer (its routing stays on the
    device: ``dispatch._streamed_on_device``), the same on a quarter of the chunk budget
    (a quarter of the rows at once, and experts whose stacked weights pass 32 MiB in
    groups, their rows found by one host read), the host-routed streaming of the CPU
    (``dispatch._streamed``: counts read on the host first), the masked loop. Medians of
    the time to ``torch.cuda.synchronize`` and of the time until the call returns to the
    host (launch-bound when the two are close); with ``profile``, the profiler's top CUDA
    kernels and CPU ops of one run of each."""
    from polytrain.moe.dispatch import _streamed
    layer, x = case.layer, case.x[:tokens]

    def host_routed(v: torch.Tensor) -> torch.Tensor:
        indices, scores = layer.gate(v)
        routing = route(indices, layer.num_experts)
        assert isinstance(layer.experts, ExpertMLP)
        return _streamed(v, routing, scores, layer.experts)

    def quarter(v: torch.Tensor) -> torch.Tensor:  # the layer on a quarter of its chunk budget
        assert isinstance(layer.experts, ExpertMLP)
        own = layer.experts.chunk_bytes
        layer.experts.chunk_bytes = (own or GPU_CHUNK_BYTES) // 4
        try:
            return layer(v)
        finally:
            layer.experts.chunk_bytes = own

    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "layer": layer, "layer_quarter_budget": quarter, "host_routed": host_routed,
        "masked": lambda v: masked_loop(layer, case.plain, v)}
    with torch.no_grad():
        want = fns["masked"](x)
        for m, f in fns.items():  # warm-up, and the three agree
            got = f(x)
            scale = float(want.abs().max())
            assert float((got - want).abs().max()) <= 2e-2 * scale, (m, got, want)
        torch.cuda.synchronize()
        total: dict[str, list[float]] = {m: [] for m in fns}
        host: dict[str, list[float]] = {m: [] for m in fns}
        for rep in range(reps):
            for m in fns if rep % 2 == 0 else reversed(list(fns)):
                t0 = time.perf_counter()
                fns[m](x)
                host[m].append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                total[m].append(time.perf_counter() - t0)
        result: dict[str, Any] = {
            "time": {m: {"median_s": statistics.median(v), "tokens_per_s":
                         tokens / statistics.median(v)} for m, v in total.items()},
            "host_ms": {m: 1e3 * statistics.median(v) for m, v in host.items()},
            "memory_mb": {}}
        for m, f in fns.items():
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            f(x)
            torch.cuda.synchronize()
            result["memory_mb"][m] = (torch.cuda.max_memory_allocated() - before) / 2**20
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler
            result["profile"] = {}
            for m, f in fns.items():
                with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    f(x)
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
                result["profile"][m] = table
                print(f"-- profile of {m}\n{table}", flush=True)
    return result


# -- peak memory, one fresh process per measurement ------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def measure_memory_here(method: str, experts: int, tokens: int, train: bool) -> int:
    """In this (fresh) process: bytes one run adds at its peak over what was resident before."""
    case = Case(experts, tokens)
    run = runner(case, method, train, tokens)
    run()
    case.zero_grad()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set to the current one
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


def measure_memory(method: str, experts: int, tokens: int, train: bool) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    out = subprocess.run([sys.executable, __file__, "--memory-of", method, str(experts),
                          str(tokens), str(int(train))], env=env, capture_output=True,
                         text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"])


# -- expert parallelism ----------------------------------------------------------------------------

def ep_worker(experts: int, tokens: int, reps: int) -> dict[str, float]:
    ctx = polytrain.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = MoE(D, experts, top_k=K, d_hidden=H)
    if ctx.num_workers > 1:
        layer.shard_experts(ctx.groups.workers)
    mine = tokens // ctx.num_workers
    g = torch.Generator().manual_seed(1 + ctx.rank)
    x, gy = torch.randn(mine, D, generator=g), torch.randn(mine, D, generator=g)

    def step() -> None:
        for p in layer.parameters():
            p.grad = None
        layer(x.requires_grad_()).backward(gy)

    group = ctx.groups.workers
    step()
    times = []
    for _ in range(reps):
        torch.distributed.barrier(group=group)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.distributed.barrier(group=group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        profiled = time.perf_counter() - t0
    events = prof.key_averages()
    a2a = sum(e.cpu_time_total for e in events if e.key == A2A_RANGE) / 1e6
    counts = sum(e.cpu_time_total for e in events if e.key == COUNTS_RANGE) / 1e6
    return {"step_s": statistics.median(times), "a2a_s_profiled": a2a,
            "counts_s_profiled": counts, "step_s_profiled": profiled}


def expert_parallel(experts: int, tokens: int, reps: int, sizes: tuple[int, ...]) -> list[Any]:
    rows = []
    for p in sizes:
        per_rank = polytrain.launch(ep_worker, workers=p, args=(experts, tokens, reps),
                                    env={"OMP_NUM_THREADS": "1"}, timeout_s=600)
        step = max(r["step_s"] for r in per_rank)
        share = statistics.fmean(r["a2a_s_profiled"] / r["step_s_profiled"] for r in per_rank)
        rows.append({"processes": p, "step_s": step, "tokens_per_s": tokens / step,
                     "a2a_share": share, "per_rank": per_rank})
        print(f"  EP over {p}: step {step * 1e3:7.1f} ms  {tokens / step:8.0f} tokens/s  "
              f"all-to-all {100 * share:4.1f}% of the time", flush=True)
    return rows


# -- the report ------------------------------------------------------------------------------------

def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    es = [r["experts"] for r in result["layer"]]
    width = 0.2
    for ax, mode, title in ((axes[0], "fwd", "forward (inference)"),
                            (axes[1], "fwd_bwd", "forward + backward")):
        for i, m in enumerate(METHODS):
            ax.bar([j + (i - 1.5) * width for j in range(len(es))],
                   [r["time"][mode][m]["tokens_per_s"] for r in result["layer"]], width,
                   label=m)
        ax.set_xticks(range(len(es)), [f"E={e}" for e in es])
        ax.set_yscale("log")
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    ax = axes[2]
    for i, (m, mode) in enumerate([(m, mode) for mode in ("fwd", "fwd_bwd")
                                   for m in ("layer", "masked")]):
        ax.bar([j + (i - 1.5) * width for j in range(len(es))],
               [r["memory_mb"][mode][m] for r in result["layer"]], width,
               label=f"{m} {mode}")
    ax.set_xticks(range(len(es)), [f"E={e}" for e in es])
    ax.set_ylabel("peak memory added by one run (MiB)")
    ax.set_title("peak memory")
    ax.legend(fontsize=8)
    ax = axes[3]
    ep = result["expert_parallel"]
    procs = [str(r["processes"]) for r in ep]
    a2a = [r["step_s"] * r["a2a_share"] * 1e3 for r in ep]
    rest = [r["step_s"] * (1 - r["a2a_share"]) * 1e3 for r in ep]
    ax.bar(procs, rest, label="compute and the rest")
    ax.bar(procs, a2a, bottom=rest, label="token all-to-all")
    ax.set_xlabel("processes (1 thread each)")
    ax.set_ylabel("ms per forward+backward")
    ax.set_title(f"expert parallel, E={result['config']['ep_experts']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small and short")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the one-process part (default 1: on a shared "
                             "machine one thread is the least disturbed)")
    parser.add_argument("--memory-of", nargs=4, metavar=("METHOD", "E", "TOKENS", "TRAIN"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: part 1 on the GPU in fp32 and bf16 (results moe_cuda.json)")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default in results/)")
    parser.add_argument("--chunk-mib", type=int, nargs="+",
                        help="with --device cuda: the experts' chunk budgets to compare "
                             "(default: the layer's own)")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
        shape = ((8,) if args.quick else (8, 32, 64), 2048 if args.quick else 16384,
                 3 if args.quick else 9)
        if args.chunk_mib:
            result = {"by_chunk_mib": {}}
            for mib in args.chunk_mib:
                print(f"-- chunks of {mib} MiB", flush=True)
                result["by_chunk_mib"][str(mib)] = on_gpu(*shape, chunk_mib=mib)
        else:
            result = on_gpu(*shape)
        name = "moe_cuda_chunks" if args.chunk_mib else "moe_cuda"
        out = args.out or RESULTS / (f"{name}-quick.json" if args.quick else f"{name}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        return
    if args.memory_of:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        method, e, tokens, train = args.memory_of
        print(json.dumps({"peak_bytes": measure_memory_here(method, int(e), int(tokens),
                                                            bool(int(train)))}))
        return
    torch.set_num_threads(args.threads)
    experts = (8,) if args.quick else (8, 32, 64)
    tokens = 512 if args.quick else 4096
    # The per-token loop runs on fewer tokens (its backward writes a whole weight gradient
    # per token and slot); its tokens/s is normalised, its memory is for that many tokens.
    few = {"fwd": 32, "fwd_bwd": 8} if args.quick else {"fwd": 128, "fwd_bwd": 32}
    reps = 2 if args.quick else 9
    ep_experts = 8 if args.quick else 32
    config = {"d_model": D, "d_hidden": H, "top_k": K, "tokens": tokens, "gate": "naive",
              "per_token_tokens": few, "reps": reps, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "ep_experts": ep_experts,
              "grouped_mm": hasattr(torch, "_grouped_mm")}
    print(f"MoE layer on CPU: d_model {D}, d_hidden {H}, {tokens} tokens, top-{K}, "
          f"{torch.get_num_threads()} threads", flush=True)
    rows = []
    for e in experts:
        t = time_methods(e, tokens, few, reps)
        memory = {mode: {m: measure_memory(m, e, few[mode] if m == "per_token" else tokens,
                                           mode == "fwd_bwd") / 2**20 for m in METHODS}
                  for mode in ("fwd", "fwd_bwd")}
        rows.append({"experts": e, "time": t, "memory_mb": memory})
        for mode in ("fwd", "fwd_bwd"):
            tm, mm = t[mode], memory[mode]
            overhead = tm["floor"]["tokens_per_s"] / tm["layer"]["tokens_per_s"] - 1
            print(f"E={e:3d} {mode:8s}" + "".join(
                f" | {m} {tm[m]['tokens_per_s']:8.0f} tok/s {mm[m]:7.1f} MiB" for m in METHODS)
                + f" | overhead over floor {100 * overhead:+.1f}%, memory / masked "
                f"{mm['layer'] / max(mm['masked'], 1e-9):.2f}", flush=True)
    ep = expert_parallel(ep_experts, tokens, 2 if args.quick else 5, (1, 2, 4))
    result = {"config": config, "layer": rows, "expert_parallel": ep,
              "notes": ["per_token runs on per_token_tokens tokens; tokens/s normalises it; "
                        "its memory is for that many tokens",
                        "memory: peak resident set added by one run, fresh process, "
                        "MALLOC_MMAP_THRESHOLD_=131072, after warm-up and malloc_trim",
                        "overhead = floor tokens/s / layer tokens/s - 1"]}
    out = args.out or RESULTS / ("moe-quick.json" if args.quick else "moe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and its .png")


if __name__ == "__main__":
    main()
