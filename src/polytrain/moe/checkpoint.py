"""Checkpoints of expert-parallel models that load on any expert-parallel size.

The canonical form of a model's state is the one of the same model with every
expert local (what ``--strategy single`` saves): each expert under its global
index (``h0.mlp.experts.5.fc.weight``). A rank's local expert ``i`` of a layer
is global expert ``first + i``, so:

- :func:`full_state_dict` gathers a sharded model's state into the canonical form;
- :func:`local_state_dict` cuts this rank's part out of a canonical state;
- :func:`save_sharded` writes one file per expert-parallel rank (no gathering),
  and :func:`load_sharded` reads them into a model split over any other number
  of ranks, 1 included, opening only the files that hold its experts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import runtime
from ..errors import ConfigError, first_line
from ..tensors import host_copy
from ..wrapper import unwrap
from .exchange import ExpertGroup
from .layer import MoE

__all__ = ["moe_layers", "canonical_names", "full_keys", "full_state_dict", "local_state_dict",
           "save_sharded", "load_sharded", "FORMAT"]

FORMAT = "polytrain.moe.sharded/1"
_EXPERT = re.compile(r"^(\d+)\.(.*)$")


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE layer of ``model`` with its state-dict prefix (``"h0.mlp."``).

    A layer shared under several names (a block applied twice) is listed under each, as
    ``state_dict()`` lists its tensors under each (named_modules() alone gave its first:
    its experts under the other names were taken for dense tensors).
    """
    return [(f"{name}." if name else "", m)
            for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, MoE)]


def _split(key: str, layers: list[tuple[str, MoE]]) -> tuple[str, MoE, int, str] | None:
    """(layer prefix, layer, local expert, tensor name) if ``key`` is an expert's, else None."""
    for prefix, layer in layers:
        head = prefix + "experts."
        if key.startswith(head):
            m = _EXPERT.match(key[len(head):])
            if m is None:
                raise ConfigError(f"unexpected expert key {key!r}",
                                  "experts must be a list of modules")
            return prefix, layer, int(m.group(1)), m.group(2)
    return None


def _canonical(key: str, layers: list[tuple[str, MoE]]) -> tuple[str, int | None]:
    """The all-local key of a local key, and the global expert it belongs to (None: dense)."""
    found = _split(key, layers)
    if found is None:
        return key, None
    prefix, layer, i, rest = found
    e = layer.first_expert + i
    return f"{prefix}experts.{e}.{rest}", e


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every local state key of ``model`` -> its canonical (all experts local) key."""
    layers = moe_layers(model)
    return {key: _canonical(key, layers)[0] for key in model.state_dict(keep_vars=True)}


def full_keys(model: nn.Module) -> list[str]:
    """The canonical keys of ``model``, in the all-local model's order, without gathering."""
    layers = moe_layers(model)
    local = list(model.state_dict())
    keys: list[str] = []
    done: set[str] = set()
    for key in local:
        found = _split(key, layers)
        if found is None:
            keys.append(key)
            continue
        prefix, layer, _, _ = found
        if prefix in done:
            continue
        done.add(prefix)
        # Local expert 0's tensor names, for every global expert in order.
        head = f"{prefix}experts.0."
        names = [k[len(head):] for k in local if k.startswith(head)]
        keys += [f"{prefix}experts.{e}.{n}" for e in range(layer.num_experts) for n in names]
    return keys


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU in the canonical (all experts local) form.

    Every rank of every expert-parallel group calls it (it all-gathers within each
    layer's group); every rank gets the whole state. ``model`` may be what ``distribute``
    returned, as in :func:`save_sharded`.
    """
    model = _bare(model)
    layers = moe_layers(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        found = _split(key, layers)
        if found is None or not found[1].group.distributed:
            out[_canonical(key, layers)[0]] = host_copy(value)
            continue
        prefix, layer, i, rest = found
        group = layer.group
        wire = group.wire_device(value.device)
        parts = [torch.empty_like(value, device=wire) for _ in range(group.size)]
        dist.all_gather(parts, value.detach().to(wire).contiguous(), group=group.group)
        for r, part in enumerate(parts):
            out[f"{prefix}experts.{r * layer.num_local + i}.{rest}"] = part.cpu()
    return {k: out[k] for k in full_keys(model)}


def local_state_dict(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of a canonical state (``full_state_dict``, a single run's final.pt).

    Example::

        model.load_state_dict(local_state_dict(torch.load("final.pt"), model))

    The keys are the plain model's: ``model`` may be what ``distribute`` returned, as in
    :func:`save_sharded`, and the result loads into its model (``model.module``).
    """
    model = _bare(model)
    layers = moe_layers(model)
    out = {}
    for key in model.state_dict():
        name, _ = _canonical(key, layers)
        if name not in state:
            raise ConfigError(f"the state has no {name!r}", "load a state of the same model")
        out[key] = state[name]
    return out


def _one_group_size(layers: list[tuple[str, MoE]]) -> int:
    sizes = {layer.group.size for _, layer in layers} or {1}
    if len(sizes) > 1:
        raise ConfigError(f"the MoE layers use expert-parallel groups of sizes {sorted(sizes)}",
                          "use one group size for every layer")
    return sizes.pop()


def _bare(model: Any) -> nn.Module:
    """The model inside what ``distribute`` returned: a wrapper's (or a DDP's) ``.module``
    (:func:`~polytrain.wrapper.unwrap`), a step API trainer's ``.model``'s (not a module:
    its ``.model`` is what it trains)."""
    return unwrap(model if isinstance(model, nn.Module) else model.model)


def _gather(group: ExpertGroup, value: Any, what: str = "the expert-parallel group") -> list[Any]:
    """Every rank's ``value`` over ``group`` (``what``, for errors), by rank. gloo's failure
    (a peer gone, a wait timed out) names no one: in a run it is said as the run's other
    collectives say it."""
    if not group.distributed:
        return [value]
    out: list[Any] = [None] * group.size
    try:
        dist.all_gather_object(out, value, group=group.group)
    except RuntimeError as e:
        if not runtime.is_initialized():
            raise
        ctx = runtime.current()
        ranks = ", ".join(map(str, group.global_ranks))
        raise ctx.transport.error(e, None, f"save_sharded's exchange with {what} (ranks "
                                           f"{ranks})", ctx.timeout_s) from None
    return out


def _refuse_failures(errors: list[str | None], group: ExpertGroup, path: Path,
                     left: str) -> None:
    """Raise, on every rank alike, the first rank's error of a save, if any rank had one
    (``left``: what the directory holds then)."""
    failed = next(((r, e) for r, e in enumerate(errors) if e), None)
    if failed is not None:
        # Here: polytrain.checkpoint imports the strategies, which import this module.
        from ..checkpoint.manifest import CheckpointError

        rank = group.global_ranks[failed[0]] if group.distributed else \
            dist.get_rank() if dist.is_initialized() else 0
        raise CheckpointError(f"could not save the sharded MoE checkpoint in {path}: rank "
                              f"{rank}: {failed[1]}", f"pass a directory this rank can write, "
                              f"with free space; {left}")


def _damaged(file: Path, why: str) -> ConfigError:
    """The refusal of a file of a sharded checkpoint that cannot be read (truncated, edited)."""
    from ..checkpoint.manifest import CheckpointError  # (see _refuse_failures)

    return CheckpointError(f"{file} is damaged: {why}", "save the model again, or copy back "
                           "the whole directory save_sharded() wrote")


_ONE_GROUP = ("leave write unset (the first expert group writes), or pass write=True on the "
              "ranks of one expert group and write=False on the others")


def _expert_groups(model: Any) -> tuple[tuple[int, ...], ...] | None:
    """The expert groups of what ``distribute(..., strategy="moe")`` returned, else None."""
    strategy = getattr(model, "_polytrain_strategy", None) if isinstance(model, nn.Module) \
        else getattr(model, "strategy", None)
    # The moe strategy's ExpertPlacement, read as plain data (the strategies import this module).
    groups: tuple[tuple[int, ...], ...] | None = getattr(
        getattr(strategy, "placement", None), "expert_groups", None)
    return groups


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class _Told(NamedTuple):
    """What each worker tells the others before a save (:func:`_writes`)."""

    writes: bool  # this rank's choice
    write: bool | None  # write as given
    plain: bool  # whether the model is plain (not what distribute() returned)
    group: tuple[int, ...]  # its layers' expert group
    given: str  # the directory as given
    where: str  # and resolved


def _writes(model: Any, wrapped: bool, write: bool | None, group: ExpertGroup,
            path: Path) -> bool:
    """Whether this rank writes its shard in ``path``: ``write``, else (what distribute()
    returned) whether it is in the first expert group, else (a plain model) True.

    A model whose MoE layers are all local (a plain model under ddp or herring, or any of
    ``expert_parallel=1``) needs no other rank: its workers hold replicas, which save one
    directory in turn (save_sharded's lock), so ``if rank == 0: save_sharded(model, ...)``
    works as with torch.save (an exchange left it waiting until the timeout). Of what a
    strategy returned, worker 0 writes unless ``write`` says; of a plain model, each
    worker.

    Else, in a run of several workers, every worker tells the others its choice, its
    layers' expert group and the directory, and all refuse alike, naming the ranks, unless
    the writers of each directory make up one whole expert group (every group wrote the
    same files at once: saves failed, or mixed two groups' shards; write=True on part of a
    group left it waiting for the rest until the timeout)."""
    workers = runtime.current().num_workers if runtime.is_initialized() else 1
    if workers == 1:
        return write is not False
    ctx = runtime.current()
    groups = _expert_groups(model)
    if not group.distributed and (groups is None or all(len(g) == 1 for g in groups)):
        return ctx.worker_index == 0 if write is None and wrapped else write is not False
    everyone = ExpertGroup(ctx.groups.workers)
    me = everyone.global_ranks[everyone.rank]
    mine = write if write is not None else (groups is None or me in groups[0])
    own = group.global_ranks if group.distributed else (me,)
    # (realpath: it fails on no rank, and sees a link)
    told = _gather(everyone, _Told(mine, write, groups is None, own, str(path),
                                   os.path.realpath(path)), "the workers")
    every_group = sorted({t.group for t in told})
    by_dir: dict[str, list[int]] = {}
    for r, t in zip(everyone.global_ranks, told):
        if t.writes:  # none: nothing is written, as asked
            by_dir.setdefault(t.where, []).append(r)
    of = dict(zip(everyone.global_ranks, told))
    for where, writers in by_dir.items():
        if tuple(writers) in every_group:
            continue
        listed = ", ".join(f"({', '.join(map(str, g))})" for g in every_group)
        split = next((of[w].group for w in writers if any(
            r in of and of[r].writes and of[r].where != where for r in of[w].group)), None)
        if split is not None:  # (one group's shards in two places: no directory whole)
            given: dict[str, list[int]] = {}
            for r in split:
                if r in of and of[r].writes:
                    given.setdefault(of[r].given, []).append(r)
            raise ConfigError(f"save_sharded: the ranks of expert group "
                              f"({', '.join(map(str, split))}) gave different directories: "
                              + ", ".join(f"{d} ({_ranks(rs)})" for d, rs in given.items()),
                              "pass every rank of an expert group the same directory (it "
                              "writes its shards side by side)")
        unset = [r for r in writers if of[r].write is None and of[r].plain]
        if len({of[r].group for r in unset}) > 1:
            raise ConfigError(f"save_sharded: the MoE layers' experts are split over "
                              f"{group.size} of the {workers} workers (other expert groups "
                              f"hold copies), and write is unset",
                              "pass what distribute() returned (its first expert group then "
                              "writes), or write=True on the ranks of one expert group and "
                              "write=False on the others")
        passed = [r for r in writers if of[r].write]
        chose = [r for r in writers if of[r].write is None]
        who = " and ".join(
            ([f"{_ranks(passed)} pass{'es' if len(passed) == 1 else ''} write=True"]
             if passed else []) +
            ([f"{_ranks(chose)} write{'s' if len(chose) == 1 else ''} with write unset"]
             if chose else []))
        at = f" for {of[writers[0]].given}" if len(by_dir) > 1 else ""
        what = (f"save_sharded writes each shard once, from one expert group, but {who}{at} "
                f"(expert groups {listed})")
        for j in range(group.size):  # the first shard two ranks would write
            both = [g[j] for g in every_group if len(g) > j and g[j] in writers]
            if len(both) > 1:
                what += (f": ranks {both[0]} and {both[1]} hold the same experts and would "
                         f"both write shard-{j}.pt")
                break
        raise ConfigError(what, _ONE_GROUP)
    return mine


def save_sharded(model: nn.Module, directory: str | Path, *, write: bool | None = None) -> None:
    """Write this rank's experts (and, on expert-parallel rank 0, the rest) to ``directory``.

    Every worker calls it (but for a model whose MoE layers are all local: below); one
    expert group writes each directory. ``model`` may be what ``distribute`` returned (a
    wrapper, a DDP or a step API's trainer): its model is saved, under the model's own
    names, and with ``write`` unset the first expert group writes (the others hold copies
    of the same experts: data-parallel replicas). Given the plain model of several expert
    groups, pass ``write=True`` on one group's ranks and ``write=False`` on the others'
    (or a directory of its own to each group). The workers agree first, in one exchange:
    writers of one directory (compared by real path) that are not one whole expert group
    are refused on every rank, naming them. A model whose MoE layers are all local
    skips the exchange, so ``if rank == 0:`` works: what a strategy returned (worker 0
    writes), or a plain model (each worker writes; replicas that save one directory take
    turns, under a lock of it). Files: ``meta.json`` and ``shard-R.pt`` per
    rank R of the expert-parallel group, each with canonical keys.

    Each rank writes its shard under a temporary name; only once every rank of the group
    has (an exchange over the group, which times out after the run's ``--timeout`` like
    every collective) are the shards renamed over the old ones and ``meta.json`` written,
    listing each shard's save. A write that fails on any rank (a full disk) raises
    :class:`~polytrain.checkpoint.CheckpointError` on every rank, naming it (a directory
    that cannot be made too), and leaves the last save whole; a process killed between
    the renames leaves shards of two saves, which :func:`load_sharded` refuses. On return
    the directory is complete on every writing rank.
    """
    given = model
    model = _bare(model)
    layers = moe_layers(model)
    size = _one_group_size(layers)
    group = layers[0][1].group if layers else ExpertGroup(None)
    rank = group.rank
    path = Path(directory)
    if not _writes(given, given is not model, write, group, path):
        return
    shard: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        name, expert = _canonical(key, layers)
        if expert is not None or rank == 0:
            shard[name] = host_copy(value)
    # Here: polytrain.checkpoint imports the strategies, which import this module.
    from ..checkpoint.manifest import write_atomically

    save = uuid.uuid4().hex  # this rank's shard of this save, as meta.json will list it
    final, pending = path / f"shard-{rank}.pt", path / f".shard-{rank}.pt.pending"
    error: str | None = None
    with contextlib.ExitStack() as held:
        try:  # (mkdir here too: a path below a file on one rank left the others waiting)
            path.mkdir(parents=True, exist_ok=True)
            if not group.distributed:  # replicas may save one directory at once: in turn
                held.enter_context(_directory_lock(path))
            write_atomically(pending, lambda tmp: torch.save(
                {"format": FORMAT, "rank": rank, "ranks": size, "save": save, "state": shard},
                tmp))
        except _Busy as e:  # (no exchange here: the group is this rank alone)
            from ..checkpoint.manifest import CheckpointError  # (see _refuse_failures)
            raise CheckpointError(f"could not save the sharded MoE checkpoint in {path}: {e}",
                                  "wait for that save, or save to another directory (on a "
                                  "shared file system, one per machine: the lock is of "
                                  "this machine's processes)") from None
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange: each raises
            error = first_line(e)
        done = _gather(group, (error, save))
        if any(e for e, _ in done):
            with contextlib.suppress(OSError):  # (no directory there: nothing to remove)
                pending.unlink(missing_ok=True)
            _refuse_failures([e for e, _ in done], group, path,
                             "the last whole checkpoint there is untouched")
        try:
            os.replace(pending, final)
        except OSError as e:
            error = first_line(e)
        half = "then save again (the directory mixes two saves, which load_sharded() refuses)"
        _refuse_failures(_gather(group, error), group, path, half)  # all renamed before meta
        if rank == 0:
            meta = {"format": FORMAT, "ranks": size, "saves": [s for _, s in done],
                    "experts": {p: layer.num_experts for p, layer in layers}}
            try:
                write_atomically(path / "meta.json",
                                 lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n"))
            except Exception as e:  # noqa: BLE001 - the other ranks wait in the exchange below
                error = first_line(e)
        _refuse_failures(_gather(group, error), group, path, half)  # a load after this finds it


class _Busy(Exception):
    """Another save held the directory's lock past the timeout."""


@contextlib.contextmanager
def _directory_lock(path: Path) -> Iterator[None]:
    """Hold a lock of the directory ``path`` itself (flock of its descriptor: no file left
    in it): replicas of a model whose MoE layers are all local save the same directory with
    no exchange, one after the other, each whole (at once, their temporary files and renames
    mixed: a FileNotFoundError, or a meta.json of another save than the shard). The lock
    is of this machine's processes (a shared file system's other clients do not see it),
    and none where the directory cannot be opened (no read permission). A save that holds
    it past the run's timeout (120 s outside a run) fails this one (:class:`_Busy`)."""
    import fcntl

    timeout = runtime.current().timeout_s if runtime.is_initialized() else 120.0
    try:
        fd: int | None = os.open(path, os.O_RDONLY)
    except OSError:  # (a directory of write and search permission only: saved as before)
        fd = None
    if fd is None:  # (here, not in the handler: a later error would chain to this one)
        yield
        return
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise _Busy(f"another save there has held the directory for "
                                f"{timeout:g} s") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _check_meta(meta: dict[str, Any], file: Path) -> None:
    """Refuse a ``meta.json`` edited into other kinds of values (KeyError, ValueError,
    ZeroDivisionError or IndexError met them), naming ``file``."""
    for key in ("ranks", "experts"):
        if key not in meta:
            raise _damaged(file, f"it has no {key}")
    ranks, experts, saves = meta["ranks"], meta["experts"], meta.get("saves")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise _damaged(file, f"its ranks is {ranks!r}, not a count of shards")
    if not isinstance(experts, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in experts.values()):
        raise _damaged(file, f"its experts is {experts!r}, not a mapping of MoE layers to "
                             f"expert counts")
    for prefix, n in experts.items():
        if n % ranks:
            raise _damaged(file, f"its {n} experts of MoE layer {prefix.rstrip('.')!r} cannot "
                                 f"be split over its {ranks} shards")
    if saves is not None and not isinstance(saves, list):  # (none before saves were listed)
        raise _damaged(file, f"its saves is {saves!r}, not a list of saves")
    if saves is not None and len(saves) != ranks:
        raise _damaged(file, f"it lists {len(saves)} saves for its {ranks} shards")


def load_sharded(model: nn.Module, directory: str | Path) -> None:
    """Load what :func:`save_sharded` wrote into ``model``, whatever its expert-parallel size.

    Each rank opens only the shard files that hold its experts (and shard 0
    for the rest). ``model`` may be what ``distribute`` returned, as in :func:`save_sharded`.
    A file that cannot be read (truncated, edited) raises
    :class:`~polytrain.checkpoint.CheckpointError` naming it.
    """
    model = _bare(model)
    path = Path(directory)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise ConfigError(f"{path} holds no sharded MoE checkpoint (no meta.json)",
                          "pass the directory save_sharded() wrote")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:  # (a truncated file: JSONDecodeError)
        raise _damaged(meta_file, first_line(e)) from None
    if not isinstance(meta, dict):
        raise _damaged(meta_file, "not a JSON object")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{meta_file} is format {meta.get('format')!r}, not {FORMAT!r}",
                          "save it again with this version of polytrain")
    _check_meta(meta, meta_file)
    saved_ranks = meta["ranks"]
    layers = moe_layers(model)
    for prefix, layer in layers:
        if prefix not in meta["experts"]:
            raise ConfigError(f"MoE layer {prefix.rstrip('.')!r} is not in the checkpoint "
                              f"(its MoE layers: {sorted(p.rstrip('.') for p in meta['experts'])})",
                              "load it into the model that save_sharded() was given")
        saved = meta["experts"][prefix]
        if saved != layer.num_experts:
            raise ConfigError(f"MoE layer {prefix.rstrip('.')!r} has {layer.num_experts} "
                              f"experts but the checkpoint has {saved}",
                              "build the model with the checkpoint's expert count")
    here = dict(layers)
    for prefix in meta["experts"]:  # (a larger model's checkpoint loaded silently)
        if prefix not in here:
            raise ConfigError(f"the checkpoint's MoE layer {prefix.rstrip('.')!r} is not in "
                              f"this model (its MoE layers: "
                              f"{sorted(p.rstrip('.') for p in here)})",
                              "load it into the model that save_sharded() was given")
    cache: dict[int, dict[str, Any]] = {}

    def shard(r: int) -> dict[str, torch.Tensor]:
        if r not in cache:
            file = path / f"shard-{r}.pt"
            if not file.exists():
                raise ConfigError(f"{path} lacks {file.name}, one of the {saved_ranks} shards "
                                  f"its meta.json lists", "copy the whole directory that "
                                  "save_sharded() wrote")
            try:
                cache[r] = torch.load(file, map_location="cpu")
            except Exception as e:  # noqa: BLE001 - torch's many (zip, pickle, EOF): one line
                raise _damaged(file, first_line(e)) from None
            if not isinstance(cache[r], dict) or not isinstance(cache[r].get("state"), dict):
                raise _damaged(file, "not a shard save_sharded() wrote")
            saves = meta.get("saves")  # (none before the saves were listed)
            if saves is not None and cache[r].get("save") != saves[r]:
                raise ConfigError(f"{file} is of another save than meta.json lists: a "
                                  f"save_sharded() was cut short there", "save the model "
                                  "again, or copy back the whole directory of an earlier save")
        return cache[r]["state"]

    wanted = set(full_keys(model))
    extra = next((k for k in shard(0) if k not in wanted), None)  # shard 0 holds the dense
    if extra is not None:
        raise ConfigError(f"the checkpoint has {extra}, which this model lacks: {path} is "
                          f"another model's", "load it into the model that save_sharded() "
                          "was given")
    state: dict[str, torch.Tensor] = {}
    for key, mine in model.state_dict().items():
        name, expert = _canonical(key, layers)
        found = _split(key, layers)
        owner = 0 if expert is None or found is None else \
            expert // (found[1].num_experts // saved_ranks)
        saved_value = shard(owner).get(name)
        if saved_value is None or saved_value.shape != mine.shape:
            what = ("not in the checkpoint" if saved_value is None else
                    f"{tuple(saved_value.shape)} in the checkpoint, {tuple(mine.shape)} here")
            raise ConfigError(f"{key} is {what}: {path} is another model's",
                              "load it into the model that save_sharded() was given")
        state[key] = saved_value
    model.load_state_dict(state)
