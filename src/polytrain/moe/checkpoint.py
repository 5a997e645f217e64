"""Checkpoints of expert-parallel models that load on any expert-parallel size.

The canonical form of a model's state is the one of the same model with every
expert local (what ``--strategy single`` saves): stacked expert tensors whole
along dim 0 (``h0.mlp.experts.w1`` is (E, d, h)), listed experts under their
global index (``h0.mlp.experts.5.fc.weight``). Each rank's state maps onto it
by its experts' global indices, so:

- :func:`full_state_dict` gathers a sharded model's state into the canonical form;
- :func:`local_state_dict` cuts this rank's part out of a canonical state;
- :func:`save_sharded` writes one file per expert-parallel rank (no gathering),
  and :func:`load_sharded` reads them into a model split over any other number
  of ranks, 1 included, opening only the files that hold its experts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .experts import ExpertList, ExpertMLP
from .layer import MoE

__all__ = ["moe_layers", "expert_slice", "full_state_dict", "local_state_dict",
           "save_sharded", "load_sharded", "FORMAT"]

FORMAT = "polytrain.moe.sharded/1"
_LISTED = re.compile(r"^(\d+)\.(.*)$")


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE layer of ``model`` with its state-dict prefix (``"h0.mlp."``)."""
    return [(f"{name}." if name else "", m) for name, m in model.named_modules()
            if isinstance(m, MoE)]


def _expert_key(key: str, layers: list[tuple[str, MoE]]) -> tuple[str, MoE, str] | None:
    """(layer prefix, layer, key inside ``experts.``) if ``key`` is an expert's, else None."""
    for prefix, layer in layers:
        head = prefix + "experts."
        if key.startswith(head):
            return prefix, layer, key[len(head):]
    return None


def expert_slice(layer: MoE) -> tuple[int, int]:
    """(first global expert, count) that this rank holds of ``layer``."""
    return layer.first_expert, layer.num_local


def _global_name(prefix: str, layer: MoE, rest: str) -> tuple[str, int | None]:
    """Canonical key of a local expert tensor, and its dim-0 offset if stacked."""
    if isinstance(layer.experts, ExpertList):
        m = _LISTED.match(rest)
        assert m is not None, rest
        return f"{prefix}experts.{layer.first_expert + int(m.group(1))}.{m.group(2)}", None
    return f"{prefix}experts.{rest}", layer.first_expert


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU in the canonical (all experts local) form.

    Every rank of every expert-parallel group calls it (it all-gathers within each
    layer's group); every rank gets the whole state.
    """
    layers = moe_layers(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        found = _expert_key(key, layers)
        if found is None or not found[1].group.distributed:
            out[key] = value.detach().cpu().clone()
            continue
        prefix, layer, rest = found
        group = layer.group
        wire = group.wire_device(value.device)
        parts = [torch.empty_like(value, device=wire) for _ in range(group.size)]
        dist.all_gather(parts, value.detach().to(wire).contiguous(), group=group.group)
        if isinstance(layer.experts, ExpertMLP):
            out[key] = torch.cat(parts).cpu()
        else:
            m = _LISTED.match(rest)
            assert m is not None
            for r, part in enumerate(parts):
                out[f"{prefix}experts.{r * layer.num_local + int(m.group(1))}.{m.group(2)}"] = \
                    part.cpu()
    return {k: out[k] for k in full_keys(model)}


def _fetch(key: str, fetch: Callable[[str], torch.Tensor], layers: list[tuple[str, MoE]],
           like: torch.Tensor) -> torch.Tensor:
    found = _expert_key(key, layers)
    if found is None:
        return fetch(key)
    prefix, layer, rest = found
    name, offset = _global_name(prefix, layer, rest)
    whole = fetch(name)
    if offset is None:
        return whole
    if whole.shape[0] != layer.num_experts:
        raise ConfigError(f"{name} holds {whole.shape[0]} experts but the model has "
                          f"{layer.num_experts}", "load a checkpoint of the same model")
    return whole[offset:offset + like.shape[0]]


def local_state_dict(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of a canonical state (``full_state_dict``, a single run's final.pt).

    Example::

        model.load_state_dict(local_state_dict(torch.load("final.pt"), model))
    """
    def fetch(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"the state has no {name!r}", "load a state of the same model")
        return state[name]
    layers = moe_layers(model)
    return {k: _fetch(k, fetch, layers, v) for k, v in model.state_dict().items()}


def save_sharded(model: nn.Module, directory: str | Path, *, write: bool = True) -> None:
    """Write this rank's experts (and, on expert-parallel rank 0, the rest) to ``directory``.

    Every rank of the expert-parallel groups calls it; ranks that hold the same
    experts as another (data-parallel replicas) pass ``write=False``. Files:
    ``meta.json`` and ``shard-R.pt`` per rank R of the expert-parallel group,
    keys in the canonical form, stacked experts as their rows.
    """
    layers = moe_layers(model)
    sizes = {layer.group.size for _, layer in layers} or {1}
    if len(sizes) > 1:
        raise ConfigError(f"the MoE layers use expert-parallel groups of sizes {sorted(sizes)}",
                          "save models whose layers share one group size")
    size = sizes.pop()
    rank = layers[0][1].group.rank if layers else 0
    if not write:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    for key, value in model.state_dict().items():
        found = _expert_key(key, layers)
        if found is None:
            if rank == 0:
                shard[key] = value.detach().cpu().clone()
            continue
        name, offset = _global_name(*found)
        shard[name] = value.detach().cpu().clone()
        if offset is not None:
            offsets[name] = offset
    torch.save({"format": FORMAT, "rank": rank, "ranks": size, "state": shard,
                "offsets": offsets}, path / f"shard-{rank}.pt")
    if rank == 0:
        meta = {"format": FORMAT, "ranks": size, "keys": list(full_keys(model)),
                "experts": {p: layer.num_experts for p, layer in layers}}
        (path / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def full_keys(model: nn.Module) -> list[str]:
    """The canonical keys of ``model``, in the all-local model's order, without gathering."""
    layers = moe_layers(model)
    keys: list[str] = []
    done: set[str] = set()
    local = list(model.state_dict())
    for key in local:
        found = _expert_key(key, layers)
        if found is None or not isinstance(found[1].experts, ExpertList):
            keys.append(key)
            continue
        prefix, layer, _ = found
        if prefix in done:
            continue
        done.add(prefix)
        # Expert 0's tensor names, repeated for every global expert in order.
        head = f"{prefix}experts.0."
        names = [k[len(head):] for k in local if k.startswith(head)]
        keys += [f"{prefix}experts.{e}.{n}" for e in range(layer.num_experts) for n in names]
    return keys


def load_sharded(model: nn.Module, directory: str | Path) -> None:
    """Load what :func:`save_sharded` wrote into ``model``, whatever its expert-parallel size.

    Each rank opens only the shard files that hold its experts (and shard 0
    for the rest).
    """
    path = Path(directory)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise ConfigError(f"{path} holds no sharded MoE checkpoint (no meta.json)",
                          "pass the directory save_sharded() wrote")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{meta_file} is format {meta.get('format')!r}, not {FORMAT!r}",
                          "save it again with this version of polytrain")
    saved_ranks = int(meta["ranks"])
    layers = moe_layers(model)
    for prefix, layer in layers:
        saved = meta["experts"].get(prefix)
        if saved != layer.num_experts:
            raise ConfigError(f"MoE layer {prefix.rstrip('.')!r} has {layer.num_experts} "
                              f"experts but the checkpoint has {saved}",
                              "build the model with the checkpoint's expert count")
    cache: dict[int, dict[str, Any]] = {}

    def shard(r: int) -> dict[str, Any]:
        if r not in cache:
            cache[r] = torch.load(path / f"shard-{r}.pt", map_location="cpu")
        return cache[r]

    def rows(name: str, first: int, count: int, total: int) -> torch.Tensor:
        per = total // saved_ranks
        pieces = []
        for e in range(first, first + count):
            s = shard(e // per)
            pieces.append(s["state"][name][e - s["offsets"][name]:e - s["offsets"][name] + 1])
        return torch.cat(pieces)

    state: dict[str, torch.Tensor] = {}
    for key, like in model.state_dict().items():
        found = _expert_key(key, layers)
        if found is None:
            state[key] = shard(0)["state"][key]
            continue
        name, offset = _global_name(*found)
        layer = found[1]
        if offset is not None:
            state[key] = rows(name, offset, like.shape[0], layer.num_experts)
        else:
            e = int(name[len(found[0] + "experts."):].split(".", 1)[0])
            state[key] = shard(e // (layer.num_experts // saved_ranks))["state"][name]
    model.load_state_dict(state)
