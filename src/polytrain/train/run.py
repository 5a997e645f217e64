"""Run a whole training job from this process, as ``polytrain train`` does."""

from __future__ import annotations

from typing import Any, Mapping

from ..config import TrainConfig
from ..launch.launcher import Launcher
from ..strategies.base import get_strategy
from .loop import train

__all__ = ["run_config"]


def run_config(config: TrainConfig, *, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Train ``config``; return worker 0's metrics.

    A strategy that is not distributed (``single``) trains in this process; any
    other starts its layout's processes on this machine (``config.port``, or a
    free one; ``env`` added to their environment; in network namespaces with shaped
    links when ``config.bandwidth`` is set) and waits for them.

    Example::

        metrics = run_config(TrainConfig(strategy="ddp", workers=2, steps=50))
    """
    if not get_strategy(config.strategy).distributed:
        metrics = train(config)
    else:
        metrics = Launcher(config.layout(), port=config.port, env=env,
                           timeout_s=config.timeout_s,
                           shape=config.link()).run_fn(train, (config,))[0]
    assert metrics is not None
    return metrics
