"""Whether a run may resume a checkpoint: the same model, data and optimizer; a layout its
strategy can carry its state to. Checked before any process starts."""

from __future__ import annotations

import inspect
import logging
import platform
import sysconfig
from pathlib import Path
from typing import Any, Mapping

import torch

from ..data import corpus_digest
from ..errors import first_line
from ..models import get_model
from ..moe.gates import has_default_capacity
from ..strategies.base import get_strategy, make_options
from .manifest import CheckpointError

__all__ = ["run_record", "check_compatible"]

log = logging.getLogger(__name__)

# Fields that must match: they decide the weights' shapes, the batches seen, or the steps
# taken (a checkpoint restores its optimizer's settings and schedule, so another --lr would
# be recorded and not used).
_SAME = ("model", "data", "sampling", "optimizer", "seed", "batch_size", "lr", "lr_schedule",
         "warmup_steps")


def run_record(config: Any, corpus: str | None = None) -> dict[str, Any]:
    """What a checkpoint records of the run that wrote it (a ``TrainConfig``), with its
    corpus's digest (:func:`~polytrain.data.corpus_digest`) and Python when given."""
    where = {} if corpus is None else {"corpus_sha256": corpus,
                                       "python": platform.python_version()}
    return {**where, "strategy": config.strategy, "model": config.model, "data": config.data,
            "model_options": dict(config.model_options),
            "strategy_options": dict(config.strategy_options),
            "optimizer": config.optimizer, "seed": config.seed, "lr": config.lr,
            "lr_schedule": config.lr_schedule, "warmup_steps": config.warmup_steps,
            "steps": config.steps, "batch_size": config.batch_size, "nodes": config.nodes,
            "servers": config.servers, "sampling": config.sampling,
            "held_out": config.eval_every is not None}


def check_compatible(manifest: Mapping[str, Any], config: Any, where: Any) -> None:
    """Refuse a checkpoint of another model, strategy or data, or a layout the strategy refuses."""
    saved = manifest
    if saved.get("strategy") != config.strategy:
        raise CheckpointError(
            f"checkpoint {where} was written by strategy {saved.get('strategy')!r}, and this "
            f"run is {config.strategy!r}",
            f"resume with --strategy {saved.get('strategy')}, or start without --resume")
    for name in _SAME:
        if name in saved and saved[name] != getattr(config, name):
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"checkpoint {where} was written with {flag} {saved[name]}, and this run has "
                f"{getattr(config, name)}", f"resume with {flag} {saved[name]}")
    if (config.lr_schedule == "cosine" and "steps" in saved
            and saved["steps"] != config.steps):
        # The cosine falls to its floor at the last step: another --steps is another curve.
        raise CheckpointError(
            f"checkpoint {where} was written by a run of --steps {saved['steps']}, and this run "
            f"has {config.steps}: its cosine learning-rate schedule, fixed by --steps, would "
            f"jump to another curve at the step it resumes",
            f"resume with --steps {saved['steps']}, or start a run of {config.steps} steps "
            f"from its weights (--init {Path(str(where)) / 'model.pt'})")
    if "held_out" in saved and saved["held_out"] != (config.eval_every is not None):
        # --eval-every holds the corpus's last tenth out of training: other batches.
        raise CheckpointError(
            f"checkpoint {where} was written {'with' if saved['held_out'] else 'without'} "
            f"--eval-every, which trains on the data less its held-out tenth, and this run "
            f"has {'it' if config.eval_every is not None else 'none'}",
            "resume with --eval-every N" if saved["held_out"] else "resume without --eval-every")
    spec = get_model(config.model)
    if "corpus_sha256" in saved:
        with torch.device("meta"):
            model = spec.make(**config.model_options)
        if corpus_digest(spec.tokens(model, config.data)) != saved["corpus_sha256"]:
            here, there = platform.python_version(), saved.get("python")
            why = (f"it ran on Python {there}, this on {here}" if there != here else
                   f"the files under {sysconfig.get_paths()['stdlib']} differ from those it "
                   f"read (a patched or partly installed standard library)")
            raise CheckpointError(
                f"checkpoint {where} trained on another corpus than this run's --data "
                f"{config.data}: the data sets are the standard library of the Python that "
                f"runs, and {why}",
                f"resume with {'Python ' + str(there) if there != here else 'that Python'}, "
                f"or start without --resume (--init CHECKPOINT/model.pt starts from its "
                f"weights)")
    theirs, ours = _full_options(spec, saved, where), spec.full_options(config.model_options)
    if theirs is not None and theirs != ours:
        differ = {k: (theirs.get(k), ours.get(k)) for k in sorted({*theirs, *ours})
                  if theirs.get(k) != ours.get(k)}
        raise CheckpointError(
            f"checkpoint {where} is of another model: its options differ from this run's in "
            + ", ".join(f"{k} ({a} there, {b} here)" for k, (a, b) in differ.items()),
            "resume with the checkpoint's model options, or start without --resume")
    step = int(saved["step"])
    if step > config.steps:
        raise CheckpointError(f"checkpoint {where} is at step {step}, past --steps "
                              f"{config.steps}", f"pass --steps N above {step} to train on")
    cls = get_strategy(config.strategy)
    cls.check_resume(saved, config.layout(), make_options(cls, dict(config.strategy_options)))


def _full_options(spec: Any, saved: Mapping[str, Any], where: Any) -> dict[str, Any] | None:
    """The checkpoint's model options as ``spec.full_options`` fills them in (None: not
    recorded), which resolves gpt-moe's gate defaults by building its gate: a record
    whose values build none was edited."""
    if "model_options" not in saved:
        return None
    options = dict(saved["model_options"])
    build = inspect.signature(spec.build).parameters
    gate = options.get("gate", build["gate"].default if "gate" in build else None)
    if options.get("dropless") and isinstance(gate, str) and not has_default_capacity(gate):
        # Taken, and doing nothing, before it was refused: such a run's checkpoint resumes.
        log.warning("checkpoint %s was saved with --dropless on the %s gate, which did nothing "
                    "there (it drops slots only with a capacity factor): resuming it without",
                    where, gate)
        options["dropless"] = False
    try:
        return spec.full_options(options)
    except Exception as e:  # noqa: BLE001 - an edited value fails wherever torch meets it
        raise CheckpointError(f"checkpoint {where} is damaged: its model_options "
                              f"{saved['model_options']} make no {spec.name} model "
                              f"({first_line(e)})",
                              "resume from another checkpoint (an older step-S)") from None
