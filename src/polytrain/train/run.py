"""Run a whole training job from this process, as ``polytrain train`` does."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

from ..checkpoint import check_compatible, newest, resolve
from ..checkpoint.manifest import read_manifest
from ..config import TrainConfig
from ..errors import LaunchError
from ..launch.launcher import Launcher
from ..strategies.base import get_strategy
from .loop import train

__all__ = ["run_config", "resume_point"]

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


def run_config(config: TrainConfig, *, env: Mapping[str, str] | None = None,
               report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train ``config``; return worker 0's metrics.

    A strategy that is not distributed (``single``) trains in this process; any
    other starts its layout's processes on this machine (``config.port``, or a
    free one; ``env`` added to their environment; in network namespaces with shaped
    links when ``config.bandwidth`` is set) and waits for them. With
    ``config.max_restarts``, a run whose process dies is stopped and started again
    from the newest whole checkpoint, up to that many times; ``report`` (default: the
    log) hears what died and from which step the run resumes.

    Example::

        metrics = run_config(TrainConfig(strategy="ddp", workers=2, steps=50))
    """
    say = report or log.warning
    config = resume_point(config)
    if not get_strategy(config.strategy).distributed:
        metrics = train(config)
        assert metrics is not None
        return metrics
    restarts = 0
    while True:
        launcher = Launcher(config.layout(), port=config.port, env=env,
                            timeout_s=config.timeout_s, shape=config.link())
        try:
            metrics = launcher.run_fn(train, (config,))[0]
            break
        except LaunchError as e:
            if restarts >= config.max_restarts or e.exitcode == 130:
                raise
            restarts += 1
            assert config.out is not None  # checked with --max-restarts
            found = newest(Path(config.out) / "checkpoints")
            where = f"checkpoint {found.name}" if found is not None else "step 0 (no " \
                "checkpoint yet)"
            say(f"polytrain: {e.what}; restart {restarts} of {config.max_restarts} from "
                f"{where}")
            config = resume_point(config.replace(resume=str(found) if found else None))
    assert metrics is not None
    if restarts:
        metrics["restarts"] = restarts
        if config.out is not None:  # worker 0 wrote it before the count was known
            (Path(config.out) / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics
