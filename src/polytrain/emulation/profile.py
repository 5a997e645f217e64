"""Per-layer profiles: FLOPs, parameter and activation memory, measured on the meta device."""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..errors import ConfigError

__all__ = ["LayerProfile", "ModelProfile", "profile_model", "layers_of", "measure_layers",
           "with_measured_costs", "optimizer_state_factor", "whole_model_bytes",
           "hookless_copy"]


@dataclass(frozen=True)
class LayerProfile:
    """One layer's cost for ONE sample (multiply by the batch size).

    Attributes:
        name: the child's name in the model (``h0``).
        fwd_flops, bwd_flops: forward and backward FLOPs (backward = 2 x forward).
        param_bytes: bytes of the layer's parameters.
        act_bytes: bytes the forward saves for the backward (activations).
        out_bytes: bytes of the layer's output (what crosses a stage boundary).
        out_shape, out_dtype: the output's shape without the batch dimension, and dtype.
    """

    name: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: int
    act_bytes: float
    out_bytes: float
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype

    @property
    def flops(self) -> float:
        return self.fwd_flops + self.bwd_flops


@dataclass(frozen=True)
class ModelProfile:
    """The layers of a model, in order, with their per-sample costs.

    Example::

        profile = profile_model(GPT(), torch.zeros(1, 64, dtype=torch.long))
        print(profile.describe())
    """

    layers: tuple[LayerProfile, ...]
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    #: Why the model's forward is not its layers run one after another (None: it is), at the
    #: first place it is not. A pipeline cut between layers would compute another function.
    chain_break: str | None = None
    #: Every child but the last whose output is not one tensor, as (its index, what it
    #: returns: "tuple" or "list"). Emulation and a stage run it as it is, but a stage sends
    #: one tensor to the next, so a pipeline is not cut right after one (``check_cuts``).
    not_one_tensor: tuple[tuple[int, str], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(x.name for x in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(x.param_bytes for x in self.layers)

    @property
    def flops(self) -> float:
        return sum(x.flops for x in self.layers)

    @property
    def act_bytes(self) -> float:
        return sum(x.act_bytes for x in self.layers)

    def describe(self) -> str:
        """A table: per layer and per sample, MFLOP forward+backward, KiB of params, acts, out."""
        rows = [f"{'layer':<10} {'MFLOP':>9} {'params KiB':>11} {'acts KiB':>9} {'out KiB':>8}"]
        for x in self.layers:
            rows.append(f"{x.name:<10} {x.flops / 1e6:9.2f} {x.param_bytes / 1024:11.1f} "
                        f"{x.act_bytes / 1024:9.1f} {x.out_bytes / 1024:8.1f}")
        return "\n".join(rows)


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers a pipeline cuts and emulation times: the model's children, in order."""
    children = list(model.named_children())
    return children if children else [("", model)]


def profile_model(model: nn.Module, sample: torch.Tensor) -> ModelProfile:
    """Measure every layer of ``model`` per sample, on a meta copy (nothing is allocated).

    ``sample`` is one input batch (any batch size; only its shape and dtype
    matter). FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode`
    (a layer costs at least one FLOP per output element); activation bytes are
    the tensors the forward saves for backward. Both are measured at batch 2
    and 3 and differenced, which leaves out what does not grow with the batch
    (weights saved for backward).
    """
    meta = hookless_copy(model).to("meta")
    # Batch 2 and 3, not 1 and 2: a batch norm in training refuses a batch of one sample.
    one, chain_break = _measure(meta, sample.shape[1:], sample.dtype, 2)
    two, _ = _measure(meta, sample.shape[1:], sample.dtype, 3)
    layers = []
    not_one_tensor = []
    children = layers_of(meta)
    for i, (name, module) in enumerate(children):
        a, b = one.get(name), two.get(name)
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        if a is None or b is None:
            raise ConfigError(f"layer {name!r} of {type(model).__name__} did not run in its "
                              f"forward", "give the pipeline a model whose children all run, "
                              "in order (an nn.Sequential)")
        if a["not_tensor"] and i < len(children) - 1:
            not_one_tensor.append((i, a["not_tensor"]))
        out_numel = b["out_numel"] - a["out_numel"]
        fwd = max(b["flops"] - a["flops"], float(out_numel))
        layers.append(LayerProfile(
            name=name, fwd_flops=fwd, bwd_flops=2.0 * fwd, param_bytes=params,
            act_bytes=max(0.0, b["saved"] - a["saved"]),
            out_bytes=float(out_numel * b["itemsize"]), out_shape=b["out_shape"],
            out_dtype=b["out_dtype"]))
    return ModelProfile(tuple(layers), tuple(sample.shape[1:]), sample.dtype,
                        chain_break=chain_break, not_one_tensor=tuple(not_one_tensor))


def hookless_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to measure or evaluate: polytrain's own attachments (the
    strategy, the emulated clock) stay shared, not copied, and the copy drives none of the
    original's forward hooks (an emulated clock would charge its time)."""
    memo = {id(v): v for m in model.modules() for k, v in vars(m).items()
            if k.startswith("_polytrain")}
    twin = copy.deepcopy(model, memo)
    for m in twin.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    return twin


def _leaf(x: Any) -> Any:
    """``x`` detached, its floating-point tensors requiring a gradient (in a tuple or list
    too: a layer may hand the next a tuple inside a stage)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.requires_grad_(True) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        items = [_leaf(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)  # a namedtuple
    return x


def _flowing(out: Any) -> list[torch.Tensor]:
    """The tensors of a layer's output (one, or in a tuple or list) a backward flows from."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _flowing(v)]
    return []


def measure_layers(model: nn.Module, sample: torch.Tensor, *, repeats: int = 5,
                   budget_s: float = 5.0) -> list[tuple[float, float]]:
    """Each layer's forward and backward, in seconds per sample, timed on this device.

    The layers of a copy of ``model`` (on its device; the model itself, its buffers,
    gradients and the random streams are left as they were) run one by one on
    ``sample`` (a real batch: small batches cost more per sample) and what the layers
    before them made of it. Each time is the median of ``repeats`` after one warm-up,
    or of as many as the warm-up says fit in ``budget_s`` (one at least). A layer whose
    output is not floating point (nothing flows back) has a backward of 0; one that hands
    the next a tuple has its tensors' backward timed.
    """
    twin = hookless_copy(model)
    device = sample.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    layers = [m for _, m in layers_of(twin)]
    fwd: list[list[float]] = [[] for _ in layers]
    bwd: list[list[float]] = [[] for _ in layers]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with torch.no_grad():  # each layer's input: what the layers before it make
            inputs = [sample]
            for layer in layers[:-1]:
                inputs.append(layer(inputs[-1]))
        done = 0
        while done <= repeats:
            start = time.perf_counter()
            for i, layer in enumerate(layers):
                x = _leaf(inputs[i])
                sync()
                t0 = time.perf_counter()
                out = layer(x)
                sync()
                t1 = time.perf_counter()
                outs = _flowing(out)
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                    sync()
                t2 = time.perf_counter()
                for p in layer.parameters():
                    p.grad = None
                if done:
                    fwd[i].append(t1 - t0)
                    bwd[i].append(t2 - t1)
            if not done:  # the warm-up allocates; it also says how many repeats fit
                repeats = max(1, min(repeats, int(budget_s / max(time.perf_counter() - start,
                                                                 1e-9))))
            done += 1
    batch = sample.shape[0]
    return [(statistics.median(f) / batch, statistics.median(b) / batch)
            for f, b in zip(fwd, bwd)]


def with_measured_costs(profile: ModelProfile,
                        seconds: Sequence[tuple[float, float]]) -> ModelProfile:
    """``profile`` with each layer's forward and backward cost in proportion to its measured
    ``seconds`` (per layer: forward, backward) instead of its FLOPs: the model's total stays
    its FLOPs, so a device's rate still converts costs to time."""
    total = sum(f + b for f, b in seconds)
    if len(seconds) != len(profile.layers) or total <= 0:
        raise ValueError(f"{len(seconds)} measured layers (total {total} s) for a profile of "
                         f"{len(profile.layers)}")
    scale = profile.flops / total
    return dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(x, fwd_flops=f * scale, bwd_flops=b * scale)
        for x, (f, b) in zip(profile.layers, seconds)))


def _measure(model: nn.Module, shape: Sequence[int], dtype: torch.dtype,
             batch: int) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Per child: FLOPs, saved bytes, output numel/shape of one forward at ``batch``; and
    :attr:`ModelProfile.chain_break`."""
    found: dict[str, dict[str, Any]] = {}
    handles = []
    x = torch.zeros((batch, *shape), dtype=dtype, device="meta")
    names = [name for name, _ in layers_of(model)]
    # The chain so far: calls seen, what the next layer should get, the first break.
    chain: dict[str, Any] = {"calls": 0, "last": x, "version": x._version, "break": None}
    for name, module in layers_of(model):
        state: dict[str, Any] = {}

        def pre(_m: nn.Module, args: Any, name: str = name, state: dict[str, Any] = state
                ) -> None:
            expected = names[chain["calls"]] if chain["calls"] < len(names) else None
            if chain["break"] is None:
                chain["break"] = _chain_break(name, expected, args, chain)
            chain["calls"] += 1
            state["saved"] = 0

            def pack(t: torch.Tensor) -> torch.Tensor:
                state["saved"] += t.numel() * t.element_size()
                return t

            state["hooks"] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            state["counter"] = FlopCounterMode(display=False)
            state["hooks"].__enter__()
            state["counter"].__enter__()

        def post(_m: nn.Module, _args: Any, out: Any, name: str = name,
                 state: dict[str, Any] = state) -> None:
            state["counter"].__exit__(None, None, None)
            state["hooks"].__exit__(None, None, None)
            chain["last"], chain["version"] = out, getattr(out, "_version", None)
            t = out[0] if isinstance(out, (tuple, list)) else out
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"layer {name!r} returns {type(t).__name__}, not a tensor",
                                  "pipelines and device emulation need layers that return "
                                  "tensors")
            found[name] = {"flops": float(state["counter"].get_total_flops()),
                           "saved": float(state["saved"]), "out_numel": t.numel(),
                           "out_shape": tuple(t.shape[1:]), "out_dtype": t.dtype,
                           "itemsize": t.element_size(),
                           # (a tuple or a list: its first tensor measured)
                           "not_tensor": None if isinstance(out, torch.Tensor)
                           else type(out).__name__}

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.enable_grad():
            out = model(x)
    except ConfigError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        text = str(e).strip()
        first = text.splitlines()[0].split(". ")[0] if text else type(e).__name__
        raise ConfigError(f"{type(model).__name__} cannot be timed layer by layer: its forward "
                          f"does not run on shapes alone (the meta device): {first}",
                          "pipelines and emulated devices (--devices) need a forward without "
                          ".item() or data-dependent shapes: pick another --model, or a "
                          "strategy that is not a pipeline, without --devices") from None
    finally:
        for h in handles:
            h.remove()
    if chain["break"] is None and not _unchanged((out,), chain):
        chain["break"] = "the model does not return its last child's output as it was"
    return found, chain["break"]


def _chain_break(name: str, expected: str | None, args: Any,
                 chain: dict[str, Any]) -> str | None:
    """Why child ``name``'s call breaks the chain of children (None: it does not)."""
    if expected is None:
        return f"child {name!r} runs a second time"
    if name != expected:
        return f"child {name!r} runs where {expected!r} should"
    if not args or args[0] is not chain["last"]:
        return f"child {name!r} does not get the previous child's output"
    if not _unchanged(args, chain):
        return f"the previous child's output is changed in place before child {name!r}"
    return None


def _unchanged(args: Any, chain: dict[str, Any]) -> bool:
    """Whether ``args[0]`` is the last layer's output, not changed since (an in-place op
    between layers bumps its version)."""
    return (bool(args) and args[0] is chain["last"]
            and getattr(args[0], "_version", None) == chain["version"])


def optimizer_state_factor(optimizer: str | torch.optim.Optimizer) -> int:
    """Optimizer state per parameter byte: Adam keeps two moments, Adagrad a sum of squares,
    SGD none (one with momentum)."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
        return 2 if name.startswith("adam") else 1 if name == "adagrad" else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if optimizer.defaults.get("momentum", 0) else 0
    return 2  # unknown optimizers: assume Adam-like state, to stay on the safe side


def whole_model_bytes(profile: ModelProfile, batch: int, state_factor: int) -> float:
    """Memory of one data-parallel worker: weights, gradients, optimizer state, activations."""
    return profile.param_bytes * (2 + state_factor) + batch * profile.act_bytes
