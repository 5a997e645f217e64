"""Run a whole training job from this process, as ``polytrain train`` does."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import _env
from ..checkpoint import check_compatible, newest, resolve
from ..checkpoint.manifest import (
    CheckpointError,
    read_manifest,
    run_out,
    step_dirs,
    whole_past,
)
from ..config import TrainConfig
from ..errors import ConfigError, LaunchError, PolytrainError, first_line
from ..launch.launcher import (
    Launcher,
    interrupted_error,
    refuse_at_import,
    take_interrupts,
)
from ..strategies.base import get_strategy
from .loop import train
from .metrics import write_metrics

__all__ = ["run_config", "resume_point", "results_in", "steps_gone_on"]

log = logging.getLogger(__name__)


def resume_point(config: TrainConfig) -> TrainConfig:
    """``config`` with ``resume`` pointing at the one checkpoint it continues from, checked:
    whole (sizes, checksums), and of this run's model, data and strategy on a layout the
    strategy can resume on. Damaged newer checkpoints passed over are logged."""
    if config.resume is None:
        return config
    where, skipped = resolve(config.resume)
    for s in skipped:
        log.warning("skipped a damaged checkpoint: %s", s)
    check_compatible(read_manifest(where), config, where)
    return config.replace(resume=str(where))


def start_step(config: TrainConfig) -> int:
    """The step a run whose ``resume`` is one checkpoint (or None) starts from."""
    return int(read_manifest(config.resume)["step"]) if config.resume is not None else 0


def check_checkpoint_folder(config: TrainConfig) -> None:
    """Refuse to write checkpoints beside another run's newer ones in ``OUT/checkpoints/``:
    a restart, and a later ``--resume OUT``, take the newest there, which would be theirs.
    Nor may a run write its final.pt and metrics.json over another run's, or over those of
    a run that went on past the checkpoint it resumes (a longer one, or one with newer
    checkpoints)."""
    if config.out is None:
        return
    root = Path(config.out) / "checkpoints"
    start = start_step(config)
    foreign = _foreign_history(config, root, start)
    if foreign:
        what = f"{len(foreign)} checkpoint{'s' * (len(foreign) > 1)} up to {foreign[0]}"
        raise CheckpointError(
            f"--out {config.out} holds checkpoints that the run this one resumes "
            f"({config.resume}) did not write ({what}): it would write its final.pt and "
            f"metrics.json over their run's, and its checkpoints beside (with --keep, "
            f"instead of) them", f"pass another --out (or remove {root}), or --resume "
            f"{config.out} to continue their run")
    # Damaged ones are passed over: nothing resumes them, and this run replaces them.
    past = [path.name for path in whole_past(root, start)]
    # Whether --out is the folder of the run this one resumes.
    own = config.resume is not None and run_out(config.resume) == Path(config.out).resolve()
    if not past:
        _check_results(config, root, own)
        return
    what = f"{len(past)} checkpoint{'s' * (len(past) > 1)} up to {past[0]}"
    if config.checkpoint_every is None:
        if config.resume is None:
            raise CheckpointError(
                f"--out {config.out} holds another run's checkpoints ({what}): this run would "
                f"write its final.pt and metrics.json over that run's, and a later --resume "
                f"{config.out} would go on with that run", "pass another --out (or remove "
                f"{root}), or continue that run with --resume {config.out}")
    if config.checkpoint_every is None and own:
        raise CheckpointError(
            f"--out {config.out} holds checkpoints past step {start}, the one this run resumes "
            f"({what}): their run went on past it, and this run would write its final.pt and "
            f"metrics.json over that run's", f"pass another --out, or --resume {config.out} to "
            f"go on from its newest")
    if config.resume is None:
        raise CheckpointError(
            f"--out {config.out} already holds an earlier run's checkpoints ({what}), and "
            f"this run would write its own beside them",
            f"continue that run with --resume {config.out}, or pass another --out (or "
            f"remove {root})")
    raise CheckpointError(
        f"--out {config.out} holds checkpoints past step {start}, the one this run resumes "
        f"({what}): they are not this run's, and a restart or a later --resume would take "
        f"them", f"remove them from {root} to go on from step {start}, or pass another "
        f"--out")


def _check_results(config: TrainConfig, root: Path, own: bool) -> None:
    """Refuse an ``--out`` (``root``: its checkpoints, none past this run's start) that holds
    another run's final.pt or metrics.json: a finished run's without checkpoints, which a
    fresh run, or a resume of another run, would replace. A run that resumes the run whose
    results are there (in its --out, or a copy holding its checkpoints) may not end before
    it did. ``own``: ``--out`` is the folder of the run this one resumes."""
    assert config.out is not None
    out = Path(config.out)
    results = results_in(out)
    if results and not own and newest(root) is None:
        raise CheckpointError(
            f"--out {config.out} holds another run's {' and '.join(results)}: this run would "
            f"write its own over them", f"pass another --out, or remove them from {config.out}")
    if config.resume is None or not results:  # an interrupted run's folder: nothing to lose
        return
    longest = steps_gone_on(config.resume, out)
    if longest > config.steps:
        raise CheckpointError(
            f"--resume {config.resume} is of a run of --steps {longest}, this one has --steps "
            f"{config.steps}, and --out {config.out} is that run's: ending there would write "
            f"over its final.pt and metrics.json", f"pass another --out, or --steps {longest}")


def results_in(out: str | Path) -> list[str]:
    """The results a finished run left in ``out`` (its final.pt, metrics.json)."""
    return [name for name in ("final.pt", "metrics.json") if (Path(out) / name).is_file()]


def steps_gone_on(checkpoint: str | Path, out: str | Path) -> int:
    """The steps of the longest run through ``checkpoint``: the one that wrote it, or one that
    went on from it in ``out`` (its metrics.json)."""
    try:
        written = int(json.loads((Path(out) / "metrics.json").read_text()).get("steps", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        written = 0  # none to read
    return max(int(read_manifest(checkpoint).get("steps", 0)), written)


def _foreign_history(config: TrainConfig, root: Path, start: int) -> list[str]:
    """The checkpoints in ``root`` up to ``start`` that the run ``config.resume`` continues
    did not write (newest first), for a resume into another ``--out``: those the resumed
    checkpoint's own folder holds with the same files (copied along) are its history."""
    if config.resume is None or run_out(config.resume) == Path(config.out or "").resolve():
        return []
    origin = Path(config.resume).parent  # the resumed run's checkpoints folder
    foreign = []
    for step, path in step_dirs(root):
        if step > start:
            continue  # newer ones: check_checkpoint_folder's own refusal names them
        try:
            files = read_manifest(path)["files"]
        except (CheckpointError, KeyError):
            continue  # damaged: nothing resumes it, and this run replaces it
        try:
            same = read_manifest(origin / path.name).get("files") == files
        except CheckpointError:
            same = False
        if not same:
            foreign.append(path.name)
    return foreign


def _train_here(config: TrainConfig) -> dict[str, Any]:
    """Train ``config`` in this process (``single``), stopped and reported as the launcher
    stops and reports a run of several: SIGINT, SIGTERM and SIGHUP raise
    ``LaunchError(interrupted=True)`` (SIGTERM ended the process without a word), unless
    this process started with them ignored (``nohup`` ignores SIGHUP, a shell's background
    job SIGINT): those stay ignored, as in any program. An error that is not
    polytrain's becomes a LaunchError naming it, with it as the cause. Either way, as for a
    launched run, the checkpoints written stay, and metrics.json and final.pt are not
    written."""
    caught: list[int] = []  # the signals that interrupted the run

    def interrupt(signum: int, frame: Any) -> None:
        caught.append(signum)
        # KeyboardInterrupt is no Exception: no `except Exception` on the way (a checkpoint
        # save's) takes it for a failure of its own and trains on.
        raise KeyboardInterrupt
    previous = take_interrupts(interrupt)
    try:
        metrics = train(config)
    except KeyboardInterrupt:
        raise interrupted_error(caught, "stopped training in this process") from None
    except PolytrainError:
        raise  # it says what to do already (a ConfigError: bad input, as from a worker)
    except Exception as e:
        raise LaunchError(f"training failed: {first_line(e)}",
                          "its traceback (printed above by polytrain train; the error's "
                          "__cause__ in Python) shows where; fix that and rerun") from e
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert metrics is not None
    return metrics


def run_config(config: TrainConfig, *, env: Mapping[str, str] | None = None,
               report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train ``config``; return worker 0's metrics.

    A strategy that is not distributed (``single``) trains in this process (an error
    there, SIGINT, SIGTERM or SIGHUP raise LaunchError, as from a launched run); any
    other starts its layout's processes on this machine (``config.port``, or a
    free one; ``env`` added to their environment; in network namespaces with shaped
    links when ``config.bandwidth`` is set) and waits for them. With
    ``config.max_restarts``, a run whose process dies is stopped and started again
    from the newest whole checkpoint, up to that many times; ``report`` (default: the
    log) hears what died and from which step the run resumes.

    Example::

        metrics = run_config(TrainConfig(strategy="ddp", workers=2, steps=50))
    """
    refuse_at_import("polytrain.train.run_config()")  # before a single run trains in-process
    by = _env.started_by()
    if by is not None:  # each process would start a whole run, all writing one --out
        raise ConfigError(
            f"run_config() (polytrain train) starts the run's processes itself, and {by} "
            f"started this process as one of {_env.world_size()}: each would train a whole "
            f"run of its own", f"run it from a plain shell or script, not under {by}; under "
            f"{by}, train with polytrain.init() and polytrain.distribute() in the script")
    say = report or log.warning
    config = resume_point(config)
    check_checkpoint_folder(config)
    origin, start = config.resume, start_step(config)
    if origin is not None and start == config.steps:  # a restart may get there: it finishes
        raise CheckpointError(
            f"checkpoint {origin} is at step {start}, the run's last (--steps "
            f"{config.steps}): nothing is left to train, and resuming would only write the "
            f"run's final.pt and metrics.json again (with none of its traffic)",
            f"pass --steps N above {start} to train on; its weights are in "
            f"{Path(origin) / 'model.pt'} (--init takes them)")
    if not get_strategy(config.strategy).distributed:
        return _train_here(config)
    restarts, restarted_from = 0, list[str | None]()
    init = config.init  # as the user asked: what metrics.json says the run started from
    while True:
        # What polytrain train prints names its process already (worker 0's bar and
        # records; every process's log lines).
        # torchrun's restart variables, as its agent sets them for each attempt.
        attempt = {**(env or {}), "TORCHELASTIC_RESTART_COUNT": str(restarts),
                   "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts)}
        launcher = Launcher(config.layout(), port=config.port, env=attempt,
                            timeout_s=config.timeout_s, shape=config.link(), rank_prefix=False)
        try:
            metrics = launcher.run_fn(train, (config,))[0]
            break
        except LaunchError as e:
            # Not after an interrupt, nor after bad input: a rerun would fail the same.
            if restarts >= config.max_restarts or e.interrupted or e.bad_input:
                raise
            restarts += 1
            assert config.out is not None  # checked with --max-restarts
            # This run's newest checkpoint, else where it started (its --resume, or step 0).
            found = newest(Path(config.out) / "checkpoints", after=start)
            back = str(found) if found is not None else origin
            where = (f"checkpoint {found.name}" if found is not None else
                     f"{origin} (no checkpoint of its own yet)" if origin is not None else
                     "step 0 (no checkpoint yet)")
            say(f"polytrain: {e.what}; restart {restarts} of {config.max_restarts} from "
                f"{where}")
            restarted_from.append(back)
            # From a checkpoint, its weights replace --init's (kept only for step 0).
            config = resume_point(config.replace(resume=back,
                                                 init=config.init if back is None else None))
    assert metrics is not None
    if restarts:
        # The last attempt wrote where it resumed: the run started where the user said.
        metrics["restarts"], metrics["restarted_from"] = restarts, restarted_from
        if "checkpoints" in metrics:
            metrics["checkpoints"].update(resumed_from=origin, resumed_at=start)
        if init is not None:
            metrics["init"] = init
        if config.out is not None:  # worker 0 wrote it before the count was known
            write_metrics(Path(config.out), metrics)
    return metrics
