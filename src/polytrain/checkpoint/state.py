"""Saving and loading a run's whole state, collectively over its workers.

What a checkpoint holds, and who writes it:

| file | writer | contents |
| --- | --- | --- |
| ``model.pt`` | worker 0 | the whole model (``Strategy.state_dict``: shards, stages gathered) |
| ``run.pt`` | worker 0 | the step, the scheduler, the caller's ``extra`` (losses, times) |
| ``worker-I.pt`` | worker I | optimizer state by name, every RNG, the strategy's own state |

Optimizer state is keyed by the plain model's parameter names
(``Strategy.parameter_names``), not by position, so a worker of another layout
(MoE with another expert-parallel size, ddp with more workers) finds the state
of each parameter it holds in whichever worker's file holds it (the manifest
indexes them). Where the strategy's workers hold alike copies of it
(``Strategy.resumes_on_other_layouts``: ddp's replicas), each name's state is
written once, by the first worker that holds it: eight ddp workers of a model
with Adam wrote eight copies of its moments. Files are written on a filesystem
every worker sees (the local launcher's, or a cluster's shared storage).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import random
import shutil
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Literal, Mapping, Sequence, overload

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CommError, CommTimeout, ConfigError, PeerLost, at_least, first_line, is_timeout
from ..kinds import check_kinds, plain
from ..moe.checkpoint import full_keys
from ..optim import placed_state
from ..strategies.base import Strategy, Trainer, layout_of, strategy_of
from ..tensors import host_state
from ..wrapper import unwrap
from .manifest import (
    CheckpointError,
    checkpoint_dir,
    commit,
    prune,
    read_manifest,
    require,
    resolve,
    temporary_dir,
    tidy,
    write_manifest,
)

__all__ = ["save", "load", "Resumed", "rng_state", "set_rng_state", "cuda_rng_states"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """What :func:`load` restored: the step to continue from, the checkpoint, the caller's extra."""

    step: int
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # damaged checkpoints passed over on the way to this one


def rng_state() -> dict[str, Any]:
    """Every random generator this process draws from: torch (CPU, CUDA), Python, numpy;
    with CUDA, which device this process computes on (``cuda_device``)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Set the generators :func:`rng_state` saved (CUDA's: see :func:`cuda_rng_states`)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        here = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        for device, saved in cuda_rng_states(state["cuda"], state.get("cuda_device"), here,
                                             torch.cuda.device_count()).items():
            torch.cuda.set_rng_state(saved, device)


def cuda_rng_states(saved: Sequence[torch.Tensor], saved_device: int | None, device: int,
                    count: int) -> dict[int, torch.Tensor]:
    """The CUDA generator states to set, by device index, from a checkpoint's ``saved`` (one
    per device the saving process saw): this process's ``device`` (of the ``count`` it
    sees) takes the state of the one the saving process computed on (``saved_device``).
    A checkpoint from before that was recorded (None) sets each device both saw: every saved
    one was set, and a resume that saw fewer GPUs failed after loading the weights
    (IndexError), or set another device's generator than its own.

    >>> states = [torch.tensor([i], dtype=torch.uint8) for i in range(4)]
    >>> cuda_rng_states(states, 2, 0, 1)  # saved on cuda:2 of 4, resumed on cuda:0 of 1
    {0: tensor([2], dtype=torch.uint8)}
    >>> list(cuda_rng_states(states, None, 0, 2))
    [0, 1]
    """
    if saved_device is not None and saved_device < len(saved):
        return {device: saved[saved_device]}
    return dict(enumerate(saved[:count]))


def _unpack(model: nn.Module | Trainer,
            optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, torch.optim.Optimizer,
                                                               Strategy[Any]]:
    if isinstance(model, Trainer):
        return model.model, optimizer or model.optimizer, model.strategy
    if optimizer is None:
        raise CheckpointError("a checkpoint of a model needs its optimizer",
                              "pass the optimizer distribute() returned, or a Trainer")
    return model, optimizer, strategy_of(model)


def _workers(strategy: Strategy[Any]) -> tuple[int, int, Any]:
    ctx = strategy.ctx
    if ctx is None:
        return 0, 1, None
    return ctx.worker_index, ctx.num_workers, ctx.groups.workers if ctx.num_workers > 1 else None


def _gather(group: Any, count: int, value: Any) -> list[Any]:
    """Every worker's ``value`` (a collective over the workers; one process: just its own)."""
    if group is None:
        return [value]
    out: list[Any] = [None] * count
    dist.all_gather_object(out, value, group=group)
    return out


#: This process's count of its save() and load() calls in each run (by its context): the n
#: of "save #n", alike on every worker that makes every call.
_calls: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _collective(call: str, strategy: Strategy[Any], where: str) -> Iterator[None]:
    """Around the collective work of ``call`` (``"save"``, ``"load"``; ``where``: ``"at step
    40, into DIR"``): this worker records in the run's store, without waiting, that it
    reached its call #n; where a wait inside fails (a timeout, a peer gone) and some
    workers never reached call #n, it raises that rule broken, naming them. Before, one
    called on worker 0 alone failed as gloo's timeout, naming whichever worker's wait ran
    out first. (A check-in that waited for every worker before each call refused good
    saves: workers reach them at other times, worker 0 evaluating first.)"""
    ctx = strategy.ctx
    if ctx is None or ctx.num_workers == 1:
        yield
        return
    calls = _calls.setdefault(ctx, {})
    n = calls[call] = calls.get(call, 0) + 1
    try:
        ctx.store.set(_reached_key(call, n, ctx.worker_index), where)
    except (RuntimeError, ValueError) as e:  # it only explains a failure: never one itself
        log.debug("could not record %s #%d in the run's store: %s", call, n, first_line(e))
    try:
        yield
    except RuntimeError as e:
        if not isinstance(e, (CommError, dist.DistError)) and not is_timeout(e) \
                and "gloo" not in str(e):
            raise  # not a wait on peers
        reached = _reached(ctx.store, call, n, ctx.num_workers)
        if reached is None or len(reached) == ctx.num_workers:
            raise  # every worker made the call (or the store is gone): not this rule
        never = [i for i in range(ctx.num_workers) if i not in reached]
        did = "; ".join(f"{_named(ws)} did, {w}" for w, ws in _by_value(reached).items())
        # Not the peer's error's text: the launcher takes "Connection closed by peer" for a
        # failure caused by another's, and would name a worker that ended its script instead.
        within = (f"within --timeout {ctx.timeout_s:g} s" if is_timeout(e)
                  else f"before its wait for them failed ({type(e).__name__})")
        what = (f"{call}() is collective: every worker must call it; {_named(never)} of "
                f"{ctx.num_workers} never called {call} #{n} ({did}) {within}")
        hint = (f"call polytrain.{call}() on every worker ("
                + ("worker 0 alone writes the model" if call == "save" else
                   "each loads its own state") + "), not under `if ctx.worker_index == 0`; if "
                "one reaches it later than the others by more than --timeout, raise --timeout")
        # A CommError, not a CheckpointError: --on-save-error continue must not train on
        # with peers that disagree, and a worker hung before the call may be restarted. A
        # timeout still: the launcher names a worker that is still working before the call
        # in this one's stead (with its stacks), as for any wait that timed out.
        if is_timeout(e):
            raise CommTimeout(what, hint, waited_s=getattr(e, "waited_s", None) or
                              ctx.timeout_s, names_waited_for=True) from None
        # A peer gone: maybe one that failed (os._exit(3) mid-run), whose own cause the
        # launcher reports first; this one's only if none is found.
        lost = PeerLost(what, hint)
        lost.names_waited_for = True
        raise lost from None


def _reached_key(call: str, n: int, worker: int) -> str:
    return f"polytrain/checkpoint/{call}/{n}/worker-{worker}"


def _reached(store: Any, call: str, n: int, count: int) -> dict[int, str] | None:
    """What each worker that reached ``call`` #n recorded (by worker); None where the store
    cannot be read (its host, rank 0, gone)."""
    reached = {}
    try:
        for i in range(count):
            key = _reached_key(call, n, i)
            if store.check([key]):  # at once; get() would wait for the key
                reached[i] = store.get(key).decode()
    except (RuntimeError, ValueError):
        return None
    return reached


def _by_value(records: Mapping[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, value in sorted(records.items()):
        out.setdefault(value, []).append(i)
    return out


def _named(workers: Sequence[int]) -> str:
    """``worker 1``, ``workers 1, 2``."""
    return f"worker{'s' if len(workers) > 1 else ''} {', '.join(map(str, workers))}"


def _first_failure(strategy: Strategy[Any], errors: list[str | None]) -> str | None:
    """The first of every worker's errors (None: none failed), naming its worker where
    there are several: ``worker rank 1 (machine node0) failed: OSError: ...``."""
    i, error = next(((i, e) for i, e in enumerate(errors) if e), (0, None))
    if error is None or strategy.ctx is None or len(errors) == 1:
        return error
    topology = strategy.ctx.topology
    return f"{topology.name(topology.workers[i])} failed: {error}"


def _run_record(run: Mapping[str, Any] | None) -> dict[str, Any]:
    """The caller's ``run`` record as the manifest keeps it, numpy's numbers made Python's (in
    its tables and lists too), refused before anything is written if JSON cannot keep it:
    before, json failed after the whole checkpoint was written, and the save said to free
    space."""
    def made(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: made(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [made(v) for v in value]
        return plain(value)

    record = made(dict(run or {}))
    try:
        json.dumps(record)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"save()'s run record cannot be written in the manifest, which is "
                          f"JSON ({first_line(e)})", "pass save() a run record of numbers, "
                          "strings, True, False, None, and lists and dicts of them") from None
    return record


def _optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[str, nn.Parameter],
                     others: Collection[str] = ()) -> dict[str, Any]:
    """The optimizer's groups (their settings, the names they hold) and its state by
    name, but for the names in ``others`` (another worker's file holds theirs)."""
    by_id = {id(p): n for n, p in names.items()}
    groups, state = [], {}
    for g in optimizer.param_groups:
        held = [by_id[id(p)] for p in g["params"] if id(p) in by_id]
        groups.append({"settings": {k: v for k, v in g.items() if k != "params"},
                       "params": held})
        for p in g["params"]:
            if id(p) in by_id and p in optimizer.state and by_id[id(p)] not in others:
                state[by_id[id(p)]] = host_state(optimizer.state[p])
    return {"class": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            "groups": groups, "state": state}


def save(root: str | Path, model: nn.Module | Trainer,
         optimizer: torch.optim.Optimizer | None = None, *, step: int,
         scheduler: Any = None,
         extra: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
         run: Mapping[str, Any] | None = None, keep: int | None = None) -> Path:
    """Write ``root/step-S``: the model, optimizer, scheduler, RNG and strategy state.

    Collective: every worker calls it with the same ``step``. Written under a
    temporary name and renamed when whole; with ``keep`` only the newest
    ``keep`` whole checkpoints stay. A failure (a full or read-only disk) on any
    worker raises :class:`CheckpointError` on every worker, and no whole
    checkpoint is replaced by the broken one. Called by some workers only, it raises
    :class:`~polytrain.CommError` on those (a timeout or a peer lost), naming the workers that
    never called it.

    Example::

        trainer = polytrain.distribute(model, opt, strategy="ddp", loss_fn=loss_fn)
        for step, (x, y) in enumerate(batches, 1):
            trainer.step(x, y)
            if step % 100 == 0:
                polytrain.save("out/checkpoints", trainer, step=step)

    Args:
        keep: how many of the newest whole checkpoints stay, a whole number from 1 (None:
            every one); older ones are removed after this one is whole.
        run: what describes the run (strategy, model, layout) for the checks on load.
        extra: the caller's own records (the CLI's loop: the losses so far), or a function
            every worker calls for them once the strategy's work in flight is finished (the
            loop's sum of the losses over the workers, which a pipeline's last sends and
            pulls must not wait behind).
    """
    # save(3, ...) was pathlib's TypeError, and extra=3 or run=3 "not iterable".
    check_kinds(save, {"root": root, "extra": extra, "run": run}, paths=("root",),
                what="save() ")
    _check_path("save() root", root, "pass save() the folder to write its step-S to")
    # step--1 or step-2.5 were written, which no load finds; "7", one every load refused.
    at_least("step", step, "pass save() the step count, a whole number from 0", 0, whole=True)
    step = int(step)  # numpy's int64 went on, and failed the manifest's json after the writes
    if keep is not None:  # -2 and 0 pruned silently; 1.5 failed the prune after the commit
        at_least("keep", keep, "pass save() keep=2 (how many of the newest whole checkpoints "
                 "stay), or None to keep every one", whole=True)
        keep = int(keep)
    run = _run_record(run)
    model, optimizer, strategy = _unpack(model, optimizer)
    strategy.check_checkpoints()
    with _collective("save", strategy, f"at step {step}, into {root}"):
        index, count, group = _workers(strategy)
        full = strategy.state_dict(model)  # collective: shards and stages gathered on worker 0
        records = dict((extra() if callable(extra) else extra) or {})
        names = strategy.parameter_names(model)
        tmp, final = temporary_dir(root, step), checkpoint_dir(root, step)
        error: str | None = None  # this worker's
        if index == 0:
            try:
                for line in tidy(root):  # a crash's leftovers (this step's .tmp among them)
                    log.warning("checkpoints in %s: %s", root, line)
                tmp.mkdir(parents=True)
            except Exception as e:  # noqa: BLE001 - every worker must reach the gather: each
                error = f"{type(e).__name__}: {e}"  # raises it
        held = _gather(group, count, (error, sorted(names)))
        failed = _first_failure(strategy, [e for e, _ in held])  # alike on every worker
        index_of: dict[str, int] = {}  # each name's optimizer state: the first file holding it
        for i, (_, ns) in enumerate(held):
            for n in ns:
                index_of.setdefault(n, i)
        if failed is None:
            others = ({n for n, i in index_of.items() if i != index}
                      if strategy.resumes_on_other_layouts else ())
            mine = {"optimizer": _optimizer_state(optimizer, names, others), "rng": rng_state(),
                    "strategy": strategy.checkpoint_state()}
            try:
                torch.save(mine, tmp / f"worker-{index}.pt")
                if index == 0:
                    torch.save(full, tmp / "model.pt")
                    torch.save({"step": step, "extra": records,
                                "scheduler": scheduler.state_dict() if scheduler is not None
                                else None, "scheduler_class": _class_name(scheduler)},
                               tmp / "run.pt")
            except Exception as e:  # noqa: BLE001 - a full disk (RuntimeError), an unpicklable
                error = f"{type(e).__name__}: {e}"  # state: every worker raises it, none waits
            failed = _first_failure(strategy, _gather(group, count, error))
        if failed is None and index == 0:
            layout = layout_of(strategy.ctx) if strategy.ctx is not None else None
            meta = {"strategy": strategy.name, **({"nodes": layout.nodes} if layout else {}),
                    "strategy_options": _options_record(strategy.options),
                    **run, "step": step, "workers": count,
                    "time": time.time(),
                    "keys": {k: list(v.shape) for k, v in full.items()},
                    "optimizer_index": index_of}
            try:
                write_manifest(tmp, meta)
                commit(tmp, final)
            except Exception as e:  # noqa: BLE001 - every worker must reach the gather
                error = f"{type(e).__name__}: {e}"
            else:  # this one is whole: a failed prune leaves older ones, it does not fail the save
                try:
                    prune(root, keep, protect=[final])
                except Exception as e:  # noqa: BLE001 - any failure to remove them alike
                    log.warning("saved %s, and could not remove the checkpoints older than the "
                                "newest %d: %s", final, keep, first_line(e))
        if failed is None:
            failed = _first_failure(strategy, _gather(group, count, error))
        if failed is not None:
            if index == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not save checkpoint step-{step} in {root}: {failed}",
                                  "free space or make the directory writable; older whole "
                                  "checkpoints are untouched (--on-save-error continue trains on)")
        log.info("saved checkpoint %s", final)
        return final


@overload
def load(path: str | Path, model: nn.Module | Trainer,
         optimizer: torch.optim.Optimizer | None = ..., *, scheduler: Any = ...,
         missing_ok: Literal[False] = ...) -> Resumed: ...


@overload
def load(path: str | Path, model: nn.Module | Trainer,
         optimizer: torch.optim.Optimizer | None = ..., *, scheduler: Any = ...,
         missing_ok: bool) -> Resumed | None: ...


def load(path: str | Path, model: nn.Module | Trainer,
         optimizer: torch.optim.Optimizer | None = None, *, scheduler: Any = None,
         missing_ok: bool = False) -> Resumed | None:
    """Load the newest whole checkpoint at ``path`` into a distributed model and optimizer.

    Collective: every worker calls it, after :func:`polytrain.distribute` and
    before the first step, and all load the same checkpoint or all refuse.
    ``path`` is a checkpoint (``.../step-S``), a checkpoints folder or a run's
    ``--out``. Sizes and checksums are checked first; a checkpoint of another
    model is refused naming the first tensor that differs. With ``missing_ok``,
    None where no worker finds a checkpoint there (a script's first run). Called by
    some workers only, it raises :class:`~polytrain.CommError` on those after the
    timeout, naming the workers that never called it.

    Example::

        trainer = polytrain.distribute(model, opt, strategy="ddp", loss_fn=loss_fn)
        resumed = polytrain.load("out/checkpoints", trainer, missing_ok=True)
        start = resumed.step if resumed else 0
    """
    # load(3, ...) was pathlib's TypeError, and missing_ok="no" was taken for True.
    check_kinds(load, {"path": path, "missing_ok": missing_ok}, paths=("path",),
                what="load() ")
    _check_path("load() path", path, "pass load() the folder polytrain.save() wrote to, or a "
                "run's --out")
    trainer = model if isinstance(model, Trainer) else None
    model, optimizer, strategy = _unpack(model, optimizer)
    strategy.check_checkpoints()
    strategy.check_load()  # (every worker has taken as many steps: all refuse alike)
    with _collective("load", strategy, f"from {path}"):
        found = _resolve_alike(path, strategy, missing_ok)
        if found is None:
            return None
        where, skipped = found
        manifest = read_manifest(where)  # resolve() has checked its files
        require(manifest, ("keys", "workers", "optimizer_index"), where)
        if manifest.get("strategy", strategy.name) != strategy.name:
            # Its optimizer and strategy state are that strategy's (Parallax's tables' state
            # is on its servers): loaded into another they were dropped or misread.
            raise CheckpointError(f"checkpoint {where} was written by strategy "
                                  f"{manifest['strategy']!r}, and this trainer's is "
                                  f"{strategy.name!r}", f"load it with strategy "
                                  f"{manifest['strategy']!r}, or start from its weights alone "
                                  f"({where / 'model.pt'}; --init takes them)")
        _check_layout(manifest, strategy, where)
        index, _, _ = _workers(strategy)
        names = strategy.parameter_names(model)
        keys = manifest["keys"]
        for n, p in names.items():
            if n not in keys:
                raise CheckpointError(f"checkpoint {where} is of another model: it has no {n!r}",
                                      "resume with the checkpoint's --model and model options, "
                                      "or start without --resume")
            if list(p.shape) != keys[n]:
                raise CheckpointError(f"checkpoint {where} is of another model: {n!r} has shape "
                                      f"{keys[n]} there and {list(p.shape)} here",
                                      "resume with the checkpoint's --model and model options, "
                                      "or start without --resume")
        # Every worker holds the whole model's keys (a pipeline's stages are cut from it, an
        # expert-parallel model lists its experts'): torch's strict load named another key only
        # after loading the matching ones, and a larger model's checkpoint loaded silently under
        # moe (its experts split) and with a torch traceback under the pipelines.
        bare = unwrap(model)
        mine = set(full_keys(bare))
        other = sorted(set(keys) - mine) or sorted(mine - set(keys))
        if other:
            said = ("it has {!r}, which this model lacks" if other[0] in keys
                    else "it has no {!r}").format(other[0])
            raise CheckpointError(f"checkpoint {where} is of another model: {said}",
                                  "resume with the checkpoint's --model and model options, or "
                                  "start without --resume")
        # The buffers too (a parameter's shape is compared above): one of another shape failed
        # in torch's load_state_dict, after it had copied the parameters. (An expert-parallel
        # worker's local expert e has expert e's key, and every expert's shapes.)
        for n, t in bare.state_dict().items():
            if n in keys and isinstance(t, torch.Tensor) and list(t.shape) != keys[n]:
                raise CheckpointError(f"checkpoint {where} is of another model: {n!r} has shape "
                                      f"{keys[n]} there and {list(t.shape)} here",
                                      "resume with the checkpoint's --model and model options, "
                                      "or start without --resume")
        saved_workers = int(manifest["workers"])
        files: dict[int, dict[str, Any]] = {}

        def worker_file(i: int) -> dict[str, Any]:
            if i not in files:
                # Our own files (RNG states are not tensors): trusted as the run's own output.
                # Mapped, not read: on another layout every worker opens worker 0's file, which
                # holds Parallax's whole sparse tables (read where the file system cannot map).
                load = functools.partial(torch.load, where / f"worker-{i}.pt", map_location="cpu",
                                         weights_only=False)
                try:
                    files[i] = load(mmap=True)
                except (OSError, RuntimeError):
                    files[i] = load()
            return files[i]

        own = worker_file(index % saved_workers)
        _check_optimizer(optimizer, names, own["optimizer"],  # before anything is loaded
                         manifest["optimizer_index"], worker_file)
        run = torch.load(where / "run.pt", map_location="cpu", weights_only=False)
        _check_scheduler(scheduler, run, where)
        if scheduler is not None:  # first: the one load here that may fail on what it is given
            try:
                scheduler.load_state_dict(run["scheduler"])
            except Exception as e:  # noqa: BLE001 - each scheduler class fails its own way
                raise CheckpointError(f"checkpoint {where}: its learning-rate scheduler's state "
                                      f"does not load into this {_class_name(scheduler)} "
                                      f"({first_line(e)})",
                                      "pass load() the scheduler save() was given") from None
        state = torch.load(where / "model.pt", map_location="cpu", weights_only=True)
        strategy.load_model_state(model, state)
        _load_optimizer(optimizer, names, own["optimizer"], manifest["optimizer_index"],
                        worker_file)
        set_rng_state(own["rng"])
        if saved_workers == _workers(strategy)[1]:
            strategy.load_checkpoint_state(own["strategy"])
        else:  # another layout: only a whole state carries over
            strategy.load_checkpoint_state(worker_file(0)["strategy"]
                                           if strategy.whole_state_on_worker_0 else {})
        if trainer is not None:  # its step count: what replan() and freeze points count from
            trainer.steps = int(run["step"])
        return Resumed(step=int(run["step"]), path=where, extra=dict(run.get("extra") or {}),
                       skipped=tuple(skipped))


def _check_path(what: str, value: Any, hint: str) -> None:
    """Refuse a blank folder for save() or load(): ``Path("")`` is the working directory,
    which they wrote to and read from without a word."""
    if not str(value).strip():
        raise ConfigError(f"{what} is empty (got {value!r})", hint)


def _resolve_alike(path: str | Path, strategy: Strategy[Any],
                   missing_ok: bool) -> tuple[Path, list[str]] | None:
    """:func:`resolve` on every worker, refused on all unless all found the same checkpoint
    (a file system that shows workers other directories, as NFS's caches may, or a script
    that gives them other paths: ddp's replicas went on from other weights, silently), or
    (``missing_ok``) none found one."""
    _, count, group = _workers(strategy)
    found: tuple[Path, list[str]] | None | CheckpointError
    try:
        found = resolve(path, missing_ok=missing_ok, caller="load()")
    except CheckpointError as e:  # raised on every worker: the others must not wait for it
        found = e
    said = _gather(group, count, str(found) if isinstance(found, CheckpointError)
                   else None if found is None else (str(found[0]),))
    if isinstance(found, CheckpointError):
        raise found
    failed = next((i for i, s in enumerate(said) if isinstance(s, str)), None)
    if failed is not None:
        raise CheckpointError(f"worker {failed} could not load a checkpoint at {path}: "
                              f"{said[failed]}")
    if len(set(said)) > 1:
        raise CheckpointError(
            "the workers found other checkpoints: " + ", ".join(
                f"worker {i} " + (w[0] if w else "none") for i, w in enumerate(said)),
            "give every worker the same step-S directory, on a file system they all see "
            "alike")
    return found


def _options_record(options: Any) -> dict[str, Any]:
    """The strategy's options as a checkpoint records them (a script's save has no run
    record): every field whose value JSON keeps as it is."""
    return {f.name: v for f in dataclasses.fields(options)
            if isinstance(v := getattr(options, f.name), (bool, int, float, str, type(None)))}


def _check_layout(manifest: Mapping[str, Any], strategy: Strategy[Any], where: Path) -> None:
    """Refuse, as the CLI's resume does, a checkpoint whose layout or options this strategy
    cannot carry its state to (another worker count where each worker's state is its own,
    other options that made its state). An option the record leaves out was its default
    (the CLI records the options it was given); a checkpoint without a record (a script's,
    before polytrain recorded them) is taken to have this run's."""
    layout = layout_of(strategy.ctx) if strategy.ctx is not None else None
    if layout is None:
        return
    options = strategy.options
    saved = {**manifest,
             "strategy_options": manifest.get("strategy_options", _options_record(options))}
    try:
        type(strategy).check_resume(saved, layout, options)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {where}: {e.what}", e.hint) from None


def _class_name(scheduler: Any) -> str | None:
    return None if scheduler is None else type(scheduler).__name__


def _check_scheduler(scheduler: Any, run: Mapping[str, Any], where: Path) -> None:
    """Refuse a scheduler where the checkpoint has none, none where it has one, or one of
    another class than the saved one's (a checkpoint from before the class was recorded:
    its state's own load decides)."""
    saved = run.get("scheduler_class")
    if (scheduler is None) != (run.get("scheduler") is None):
        raise CheckpointError(
            f"checkpoint {where} was saved " + (
                "with a learning-rate scheduler, and this load() is given none: the saved "
                "schedule would be dropped" if scheduler is None else
                "without a learning-rate scheduler, and this load() is given one: it would "
                "start at its first step"),
            "pass load() the scheduler save() was given, or none if it was given none")
    if saved is not None and saved != _class_name(scheduler):
        # A StepLR's state in a LambdaLR: KeyError 'lr_lambdas'; a LambdaLR's in a StepLR
        # was taken, and stepped on with the other's fields.
        raise CheckpointError(f"checkpoint {where} was saved with a learning-rate scheduler "
                              f"{saved}, and this load() is given a {_class_name(scheduler)}: "
                              f"its state would not fit", f"pass load() a {saved}, as save() "
                              f"was given")


def _check_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[str, nn.Parameter],
                     own: Mapping[str, Any], index_of: Mapping[str, int],
                     worker_file: Callable[[int], Mapping[str, Any]]) -> None:
    """Refuse an optimizer state that would not fit: another class, other groups, a
    parameter in another group than the one that held it."""
    by_id = {id(p): n for n, p in names.items()}
    saved_groups = own["groups"]
    mine = type(getattr(optimizer, "optimizer", optimizer)).__name__
    if own.get("class") not in (None, mine):  # another class's state breaks its step()
        raise CheckpointError(f"the checkpoint's optimizer is {own['class']} and this one "
                              f"{mine}: its state would not fit",
                              f"resume with the checkpoint's optimizer, {own['class']} "
                              f"(its --optimizer)")
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} parameter "
                              f"groups and this one {len(optimizer.param_groups)}",
                              "resume with the checkpoint's --optimizer")
    # Groups are matched by position: a group that holds what another saved group held
    # (the groups built in another order) would take that one's settings, silently. (A
    # group holding only some of its saved group's parameters is a worker's share.)
    saved_names = [set(g.get("params", ())) for g in saved_groups]
    for i, g in enumerate(optimizer.param_groups):
        held = {by_id[id(p)] for p in g["params"] if id(p) in by_id}
        if held and held != saved_names[i] and held in saved_names:
            raise CheckpointError(
                f"this optimizer's parameter group {i} holds the parameters of the "
                f"checkpoint's group {saved_names.index(held)} (the groups are in another "
                f"order): its settings would go to other parameters",
                "build the optimizer's parameter groups in the order of the run that saved "
                "the checkpoint")
    # A parameter moved to another group took that group's settings (a bias moved to the
    # weights' group, its weight decay). Each name's saved group is in the file whose state
    # load takes for it: this worker's own, else (another layout: MoE's experts resharded)
    # the first worker's that held it.
    saved_group = _group_of(saved_groups)
    others: dict[int, dict[str, int]] = {}
    for i, g in enumerate(optimizer.param_groups):
        for n in (by_id[id(p)] for p in g["params"] if id(p) in by_id):
            where = saved_group
            if n not in where and n in index_of:
                f = index_of[n]
                if f not in others:
                    others[f] = _group_of(worker_file(f)["optimizer"]["groups"])
                where = others[f]
            was = where.get(n, i)  # not in the checkpoint's groups: nothing to compare
            if was != i:
                raise CheckpointError(
                    f"this optimizer's parameter group {i} holds {n!r}, which the "
                    f"checkpoint's group {was} held: that group's settings would go to it",
                    "build the optimizer's parameter groups with the parameters of the run "
                    "that saved the checkpoint, in its order")


def _group_of(groups: list[Mapping[str, Any]]) -> dict[str, int]:
    """The index of the saved group that held each name."""
    return {n: j for j, g in enumerate(groups) for n in g.get("params", ())}


def _load_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[str, nn.Parameter],
                    own: Mapping[str, Any], index_of: Mapping[str, int],
                    worker_file: Any) -> None:
    by_id = {id(p): n for n, p in names.items()}
    saved_groups = own["groups"]
    for g, saved in zip(optimizer.param_groups, saved_groups):
        g.update({k: v for k, v in saved["settings"].items() if k in g})
        for p in g["params"]:
            n = by_id.get(id(p))
            if n is None:
                continue
            source = own["state"]
            if n not in source and n in index_of:
                source = worker_file(index_of[n])["optimizer"]["state"]
            if n in source:
                optimizer.state[p] = placed_state(optimizer, p, source[n])
