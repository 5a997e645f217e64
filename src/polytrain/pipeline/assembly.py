"""Stage assembly: a stage's layers, messages and optimizer cut from a whole model.

A pipeline strategy decides where the cuts go and which ranks run which
stage; these functions build the pieces from that plan: the stage module and
its neighbours (:func:`make_stage`), the user's optimizer over the stage's
parameters (:func:`stage_optimizer`), and the servers' keys for a model held
in stages (:func:`fused_keys`). HetPipe uses them, and so can any pipeline.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Collection, Sequence

import torch
from torch import nn

from ..comm.p2p import Transport
from ..comm.partition import TensorSpec
from ..emulation.clock import DeviceClock
from ..emulation.profile import ModelProfile, layers_of
from ..errors import ConfigError
from .stage import LossFn, Stage, StageSpec

__all__ = ["make_stage", "stage_optimizer", "fused_keys", "layer_of"]


def make_stage(model: nn.Module, bounds: Sequence[int], index: int, *, ranks: Sequence[int],
               labels: Sequence[str], links: Sequence[float], profile: ModelProfile,
               transport: Transport, loss_fn: LossFn,
               clock: DeviceClock | None = None) -> Stage:
    """Stage ``index`` of a pipeline cut at ``bounds`` (layer indices, first 0, last L).

    Args:
        model: the whole model (its top-level children are the layers).
        ranks, labels: every stage's rank and its name in messages, in pipeline order.
        links: bytes/s between consecutive stages (0: not emulated), one fewer than ranks.
        profile: the model's layer profile (the shapes a stage receives).
        transport, loss_fn, clock: the stage's messages, the last stage's loss, its
            emulated device (None: the real one).
    """
    if profile.chain_break is not None:
        raise ConfigError(
            f"{type(model).__name__}'s forward is not its top-level children run one after "
            f"another ({profile.chain_break}): a pipeline cut between them would compute "
            f"another function",
            "give pipeline strategies a model whose forward only chains its children (an "
            "nn.Sequential); wrap a skip connection or other glue in one child module")
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
        link_next=0.0 if last else links[j])
    # The whole model's device: a stage of parameter-free layers computes there too.
    device = next((p.device for p in model.parameters()), None)
    return Stage(spec, module, transport, loss_fn=loss_fn, clock=clock, device=device)


def stage_optimizer(base: torch.optim.Optimizer, model: nn.Module,
                    stage: Stage) -> tuple[torch.optim.Optimizer, list[int], list[int]]:
    """The user's optimizer ``base`` (over ``model``) rebuilt over ``stage``'s parameters: its
    class, and one group for each of its groups that holds some (with their settings, which
    the stage follows every minibatch). Returns it, the user's group each of its groups
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
    # -1: a frozen parameter the optimizer does not hold.
    return kind(groups), sources, [group_of.get(i, -1) for i in range(len(stage.params))]


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
