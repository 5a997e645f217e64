"""Stage assembly: a stage's layers, messages and optimizer cut from a whole model.

A pipeline strategy decides where the cuts go and which ranks run which
stage; these functions build the pieces from that plan: the stage module and
its neighbours (:func:`make_stage`; :func:`check_cuts` refuses a cut after a
child that passes a tuple on), the user's optimizer over the stage's
parameters (:func:`stage_optimizer`), the servers' keys for a model held
in stages (:func:`fused_keys`), and what each layer costs where the cuts go
(:func:`layer_profile`, ``--layer-costs``). HetPipe and PipeTransformer use
them, and so can any pipeline.
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict
from dataclasses import field
from typing import Any, Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.p2p import Transport
from ..comm.partition import TensorSpec
from ..emulation.clock import DeviceClock
from ..emulation.profile import (
    ModelProfile,
    layers_of,
    measure_layers,
    profile_model,
    with_measured_costs,
)
from ..errors import ConfigError, unknown
from ..optim import placed_state
from .stage import LossFn, Stage, StageSpec

__all__ = ["make_stage", "check_cuts", "stage_optimizer", "fused_keys", "layer_of",
           "layer_profile", "layer_costs_field", "check_layer_costs", "costs_record",
           "LAYER_COSTS"]

log = logging.getLogger(__name__)

#: What a layer costs where a pipeline is cut: its FLOPs, or its times measured at the start.
LAYER_COSTS = ("flops", "measured")


def layer_costs_field() -> Any:
    """The ``--layer-costs`` field of a pipeline strategy's options (one flag, shared)."""
    return field(default="flops", metadata={
        "help": "what a layer costs where the pipeline is cut: flops (default; what emulated "
                "--devices charge) or measured (its forward and backward timed on every "
                "worker's device at the first step, the median over the workers)",
        "choices": LAYER_COSTS, "metavar": "COSTS"})


def check_layer_costs(costs: str) -> None:
    """Refuse a ``--layer-costs`` that is none of :data:`LAYER_COSTS`."""
    if costs not in LAYER_COSTS:
        raise unknown("layer cost", costs, LAYER_COSTS, "pass --layer-costs flops or measured")


def layer_profile(model: nn.Module, sample: torch.Tensor, *, costs: str, group: Any,
                  owner: str, seconds: Sequence[tuple[float, float]] | None = None
                  ) -> tuple[ModelProfile, list[tuple[float, float]] | None]:
    """The layer profile a pipeline strategy plans with (every worker of ``group`` calls it,
    and all get the same): the FLOPs profile, or with ``costs="measured"`` the same with
    each layer's forward and backward in proportion to their times on the workers' own
    devices (:func:`~polytrain.emulation.profile.measure_layers` on ``sample``; per layer,
    the median over the workers, so that every worker cuts alike). ``seconds``: times
    measured before (a checkpoint's), used as they are, so that a resumed run plans as
    the run it continues did. Returns it and, when measured, the seconds per sample of
    each layer (forward, backward), which the group's first rank logs, as strategy
    ``owner``'s."""
    profile = profile_model(model, sample[:1])
    if costs == "flops":
        return profile, None
    if seconds is None:
        mine = measure_layers(model, sample)
        everyone: list[Any] = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
        seconds = [(statistics.median(w[i][0] for w in everyone),
                    statistics.median(w[i][1] for w in everyone)) for i in range(len(mine))]
        if not dist.is_initialized() or dist.get_rank(group) == 0:
            log.info("%s: measured layer costs, ms per sample (forward/backward): %s", owner,
                     ", ".join(f"{n} {t['forward_ms']:.4g}/{t['backward_ms']:.4g}"
                               for n, t in costs_record(profile.names, seconds).items()))
    seconds = [(float(f), float(b)) for f, b in seconds]
    return with_measured_costs(profile, seconds), seconds


def costs_record(names: Sequence[str], seconds: Sequence[tuple[float, float]]
                 ) -> dict[str, dict[str, float]]:
    """Measured layer times for a run's record: per layer, milliseconds per sample."""
    return {name: {"forward_ms": round(f * 1e3, 6), "backward_ms": round(b * 1e3, 6)}
            for name, (f, b) in zip(names, seconds)}


def make_stage(model: nn.Module, bounds: Sequence[int], index: int, *, ranks: Sequence[int],
               labels: Sequence[str], links: Sequence[float], profile: ModelProfile,
               transport: Transport, loss_fn: LossFn,
               clock: DeviceClock | None = None, cuts_move: bool = True) -> Stage:
    """Stage ``index`` of a pipeline cut at ``bounds`` (layer indices, first 0, last L).

    Args:
        model: the whole model (its top-level children are the layers).
        ranks, labels: every stage's rank and its name in messages, in pipeline order.
        links: bytes/s between consecutive stages (0: not emulated), one fewer than ranks.
        profile: the model's layer profile (the shapes a stage receives).
        transport, loss_fn, clock: the stage's messages, the last stage's loss, its
            emulated device (None: the real one).
        cuts_move: whether a later plan may cut the model elsewhere (PipeTransformer's
            AutoPipe; HetPipe plans its cuts once, False): a child that passes a tuple on
            is then refused with more than one stage, wherever the cuts are now
            (:func:`check_cuts`).
    """
    if profile.chain_break is not None:
        raise ConfigError(
            f"{type(model).__name__}'s forward is not its top-level children run one after "
            f"another ({profile.chain_break}): a pipeline cut between them would compute "
            f"another function",
            "give pipeline strategies a model whose forward only chains its children (an "
            "nn.Sequential); wrap a skip connection or other glue in one child module")
    check_cuts(model, profile, bounds, moving=cuts_move and len(ranks) > 1)
    j, count = index, len(ranks)
    a, e = bounds[j], bounds[j + 1]
    module = nn.Sequential(OrderedDict(layers_of(model)[a:e]))
    first, last = j == 0, j == count - 1
    spec = StageSpec(
        index=j, count=count,
        prev=None if first else ranks[j - 1],
        next=None if last else ranks[j + 1],
        label=labels[j],
        prev_label="" if first else labels[j - 1],
        next_label="" if last else labels[j + 1],
        input_shape=profile.input_shape if first else profile.layers[a - 1].out_shape,
        input_dtype=profile.input_dtype if first else profile.layers[a - 1].out_dtype,
        link_prev=0.0 if first else links[j - 1],
        link_next=0.0 if last else links[j],
        sample_shape=profile.input_shape, sample_dtype=profile.input_dtype)
    # The whole model's device: a stage of parameter-free layers computes there too.
    device = next((p.device for p in model.parameters()), None)
    return Stage(spec, module, transport, loss_fn=loss_fn, clock=clock, device=device)


def check_cuts(model: nn.Module, profile: ModelProfile, bounds: Sequence[int], *,
               label: str = "the pipeline", moving: bool = False) -> None:
    """Refuse a pipeline (``label`` in the message) cut at ``bounds`` right after a child but
    the last that returns a tuple or a list (:attr:`ModelProfile.not_one_tensor`): a stage
    sends one tensor to the next. Inside a stage such a child passes it on as in one process.
    ``bounds[0]`` counts too (PipeTransformer's frozen front ends there). With ``moving`` (a
    later plan may cut elsewhere), such a child is refused wherever the cuts are now."""
    after = {i + 1: (i, kind) for i, kind in profile.not_one_tensor}
    cut = next((b for b in bounds[:-1] if b in after), None)
    if cut is None and not (moving and after):
        return
    i, kind = after[cut] if cut is not None else profile.not_one_tensor[0]
    where = (f"{label} is cut right after it (stage bounds {tuple(int(b) for b in bounds)})"
             if cut is not None else
             f"{label} has {len(bounds) - 1} stages whose cuts move as it trains (one may "
             f"fall right after it)")
    raise ConfigError(
        f"{type(model).__name__}'s child {profile.layers[i].name!r} returns a {kind} to the "
        f"next child, but {where}, and pipeline stages send one tensor between layers",
        "return one tensor from every child but the last (pack several into one), or wrap "
        "the children that pass several in one child module")


def stage_optimizer(base: torch.optim.Optimizer, model: nn.Module,
                    stage: Stage) -> tuple[torch.optim.Optimizer, list[int], list[int]]:
    """The user's optimizer ``base`` (over ``model``) rebuilt over ``stage``'s parameters: its
    class, and one group for each of its groups that holds some (with their settings, which
    the stage follows every minibatch), with a copy of the state it holds for them (a
    script's steps before ``distribute``: Adam's moments and step count, which one process
    goes on from). Returns it, the user's group each of its groups
    follows, and each stage parameter's group (-1: frozen, ``requires_grad=False``, and not
    in ``base``). A stage with no parameter ``base`` holds (frozen or parameter-free layers)
    gets an optimizer of one empty group. Parameters are matched by name, so a stage built
    from a copy of ``model`` (a twin's) works too."""
    # By name: a twin's stage holds a copy of the model's parameters.
    name_of = {id(p): n for n, p in model.named_parameters()}
    mine = {n: i for i, n in enumerate(stage.names)}
    groups: list[dict[str, Any]] = []
    sources: list[int] = []
    group_of: dict[int, int] = {}
    for i, group in enumerate(base.param_groups):
        held = [mine[name_of[id(p)]] for p in group["params"]
                if name_of.get(id(p)) in mine]
        if not held:
            continue
        params = [stage.params[k] for k in held]
        for k in held:
            group_of[k] = len(groups)
        settings = {k: v for k, v in group.items() if k != "params"}
        if "foreach" in settings:  # one call per step for all tensors: it runs every minibatch
            settings["foreach"] = settings["foreach"] is not False and not settings.get("fused")
        groups.append({**settings, "params": params})
        sources.append(i)
    missing = [n for i, n in enumerate(stage.names)
               if i not in group_of and stage.params[i].requires_grad]
    if missing:
        raise ConfigError(f"the optimizer does not hold the parameters "
                          f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                          f"of {stage.spec.label}",
                          "give the optimizer every parameter that trains (model."
                          "parameters()), or set requires_grad=False on the others")
    if not groups:  # only frozen or parameter-free layers: an optimizer that steps nothing
        settings = {k: v for k, v in base.param_groups[0].items() if k != "params"}
        groups, sources = [{**settings, "params": []}], [0]
    kind: Any = type(base)  # the user's class, built on this stage's share of its groups
    optimizer = kind(groups)
    by_name = {name_of[id(p)]: p for group in base.param_groups for p in group["params"]
               if id(p) in name_of}
    for name, p in zip(stage.names, stage.params):
        state = base.state.get(by_name[name]) if name in by_name else None
        if state:
            optimizer.state[p] = placed_state(optimizer, p, state)
    # -1: a frozen parameter the optimizer does not hold.
    return optimizer, sources, [group_of.get(i, -1) for i in range(len(stage.params))]


def check_untied(model: nn.Module, owner: str, stages: int, *,
                 freezing: str | None = None) -> None:
    """Refuse a tensor that two layers share (tied weights, as an embedding and its output
    head) where the pipeline has more than one stage: each stage holds its own layers'
    weights, so the two would train apart, and the stage that names it second found it
    missing from the optimizer. (A cut may change: any two layers may part.)

    ``freezing``: where the strategy freezes front layers, the option that turns that off;
    then a pipeline of one stage is refused too: freezing the first layer froze the tensor
    the second still trained."""
    if stages <= 1 and freezing is None:  # one stage holds every layer: the tensor once
        return
    layers = [n for n, _ in layers_of(model)]
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen = first.setdefault(id(p), name)
        if layer_of(seen, layers) == layer_of(name, layers):
            continue
        tied = f"{seen!r} and {name!r} are one tensor (tied weights) in two layers"
        if stages <= 1:
            raise ConfigError(f"{tied}, and strategy {owner!r} freezes front layers while "
                              f"the later ones train: freezing the first would stop the "
                              f"second training",
                              f"untie them (give the second layer a weight of its own), or "
                              f"pass {freezing}")
        raise ConfigError(f"{tied}, and strategy {owner!r} gives each pipeline stage its own "
                          f"layers' weights: they would train apart",
                          "untie them (give the second layer a weight of its own), or "
                          "train with a data-parallel strategy")


def layer_of(name: str, layers: Collection[str]) -> str:
    """The layer (of ``layers``: :func:`layers_of`'s names) parameter ``name`` belongs to;
    "" for a model without children (one layer, the model)."""
    first = name.split(".", 1)[0]
    return first if first in layers else ""


def fused_keys(model: nn.Module,
               optimizer: torch.optim.Optimizer) -> list[tuple[TensorSpec, list[str]]]:
    """The servers' keys: per layer, its trained parameters of one optimizer group and dtype
    as one flat tensor (a stage holds whole layers, so every virtual worker agrees on them);
    frozen parameters (``requires_grad=False``) have none.
    Returns each key's spec and the names of its parameters, in model order.

    One request per layer instead of one per tensor: a GPT block has 12 tensors, and the
    servers' per-request cost, not their bytes, bounded HetPipe's speed.
    """
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                for p in group["params"]}
    children = {n for n, _ in layers_of(model)}
    keys: dict[tuple[str, int, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen: never pushed, every virtual worker's copy stays
            continue
        layer = layer_of(name, children)
        keys.setdefault((layer, group_of.get(id(p), -1), p.dtype), []).append((name, p))
    out = []
    for (layer, group, dtype), members in keys.items():
        numel = sum(p.numel() for _, p in members)
        label = f"{layer or 'model'}[group {group}]" if len(members) > 1 else members[0][0]
        out.append((TensorSpec(label, (numel,), dtype), [n for n, _ in members]))
    return out
