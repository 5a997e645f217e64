"""PipeTransformer's options: one frozen dataclass; the CLI makes a flag of every field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ...errors import ConfigError, at_least, unknown
from ...pipeline.assembly import check_layer_costs, layer_costs_field
from ...pipeline.cache import check_writable
from ...pipeline.freeze import DEFAULT_THRESHOLDS, SIGNALS
from ...pipeline.schedule import SCHEDULES

__all__ = ["PipeTransformerOptions"]

# The options that only AutoFreeze (with AutoPipe and AutoDP) and only AutoCache read.
_FREEZE_FLAGS = {"freeze_every": "--freeze-every", "freeze_alpha": "--freeze-alpha",
                 "freeze_signal": "--freeze-signal", "freeze_threshold": "--freeze-threshold",
                 "autopipe": "--no-autopipe", "autodp": "--no-autodp"}
_CACHE_FLAGS = {"cache_mb": "--cache-mb", "cache_dir": "--cache-dir",
                "cache_from": "--cache-from", "cache_shared": "--no-cache-shared"}


@dataclass(frozen=True, kw_only=True)
class PipeTransformerOptions:
    """How PipeTransformer pipelines, freezes, re-plans and caches.

    Args:
        pipeline_stages: K, stages per pipeline at the start (default: the devices of one
            machine; it must divide them). R = workers / K pipelines train in data parallel.
        schedule: ``1f1b`` (default) or ``gpipe``.
        micro_batches: per pipeline step (default: re-chosen at every plan, the smallest
            divisor of the replica's batch that is at least 2 K).
        layer_costs: what AutoPipe balances: ``flops`` (default; exactly what emulated
            devices charge) or ``measured`` (each layer timed on the workers' devices at the
            first step: :func:`polytrain.pipeline.assembly.layer_profile`).
        freeze: AutoFreeze (default True; ``--no-freeze`` trains every layer throughout).
        freeze_every: steps between freeze points, at least 2 (default: one epoch of the
            data; a ``polytrain train`` without epochs, ``--sampling random``, must give it).
        freeze_alpha: the cap's fraction of the remaining layers, in (0, 1) (default 1/3).
        freeze_signal: what says a layer has stopped learning, from its mean gradient norm
            over the last interval (:mod:`polytrain.pipeline.freeze`): ``change`` (default),
            its relative change from the interval before; ``level``, its ratio to its
            first steps'; ``relative``, its change over the median change of the
            freezable layers still trained.
        freeze_threshold: a layer whose signal is at most this has stopped learning
            (default: 0.1 for ``change``, its norm moved by at most 10%; 1.0 for
            ``level``, its norm no longer shrinks; 0.5 for ``relative``, it moved by at
            most half as much as the median layer).
        autopipe: frozen layers move to the first stage forward-only, the rest are re-cut,
            the pipeline halves when it can (default True; False: freeze only).
        autodp: the devices a shorter pipeline frees run new replicas (default True;
            False: they idle).
        cache: AutoCache (default True).
        cache_mb: the memory tier per first stage, MiB (default 256); past it, disk.
        cache_dir: the disk tier's directory (default: a temporary one).
        cache_from: cache once at least this many layers are frozen (default 2).
        cache_shared: the first stages of one machine share their entries through the
            host's shared memory (``/dev/shm``), as the paper's AutoCache (default True;
            False: each process its own).
    """

    pipeline_stages: int | None = field(default=None, metadata={
        "help": "pipetransformer: stages per pipeline at the start, K (default: the devices "
                "of one machine, which K must divide)", "metavar": "K"})
    schedule: str = field(default="1f1b", metadata={
        "help": "pipetransformer: 1f1b (default) or gpipe", "choices": tuple(SCHEDULES)})
    micro_batches: int | None = field(default=None, metadata={
        "help": "pipetransformer: micro-batches per pipeline step, a divisor of a replica's "
                "batch (where AutoDP's replicas later halve it, the largest divisor of it up "
                "to M); default: re-chosen at every plan, the smallest divisor of the "
                "replica's batch >= 2 x stages",
        "metavar": "M"})
    layer_costs: str = layer_costs_field()
    freeze: bool = field(default=True, metadata={
        "help": "pipetransformer: no AutoFreeze; every layer trains throughout"})
    freeze_every: int | None = field(default=None, metadata={
        "help": "pipetransformer: steps between freeze points (default: one epoch of the "
                "data, with --sampling epoch; --sampling random has no epochs, so give N)",
        "metavar": "N"})
    freeze_alpha: float = field(default=1 / 3, metadata={
        "help": "pipetransformer: AutoFreeze's cap, the fraction of the remaining layers that "
                "may freeze at a freeze point, in (0, 1) (default 1/3)", "metavar": "A"})
    freeze_signal: str = field(default="change", metadata={
        "help": "pipetransformer: what says a layer has stopped learning: change (default; "
                "its gradient norm's relative change over the last interval), level (its "
                "norm over its first steps') or relative (its change over the median change "
                "of the freezable layers still trained)", "choices": SIGNALS})
    freeze_threshold: float | None = field(default=None, metadata={
        "help": "pipetransformer: a layer has stopped learning once its signal is at most "
                "this (default: " + ", ".join(f"{t:g} for {signal}" for signal, t
                                              in DEFAULT_THRESHOLDS.items()) + ")",
        "metavar": "F"})
    autopipe: bool = field(default=True, metadata={
        "help": "pipetransformer: keep the cuts when layers freeze (freeze only: no AutoPipe, "
                "no AutoDP)"})
    autodp: bool = field(default=True, metadata={
        "help": "pipetransformer: devices a shorter pipeline frees idle instead of running "
                "new replicas"})
    cache: bool = field(default=True, metadata={
        "help": "pipetransformer: no AutoCache; the frozen front runs forward every step"})
    cache_mb: float = field(default=256.0, metadata={
        "help": "pipetransformer: AutoCache's memory per first stage in MiB, then disk "
                "(default 256)", "metavar": "MB"})
    cache_dir: str | None = field(default=None, metadata={
        "help": "pipetransformer: AutoCache's disk tier (default: a temporary directory)",
        "metavar": "DIR"})
    cache_from: int = field(default=2, metadata={
        "help": "pipetransformer: cache once at least this many layers are frozen (default 2)",
        "metavar": "L"})
    cache_shared: bool = field(default=True, metadata={
        "help": "pipetransformer: AutoCache's entries stay in each first stage's process "
                "instead of the machine's shared memory"})

    def __post_init__(self) -> None:
        if self.pipeline_stages is not None:
            at_least("--pipeline-stages", self.pipeline_stages, "pass --pipeline-stages 2")
        if self.schedule not in SCHEDULES:
            raise unknown("pipeline schedule", self.schedule, SCHEDULES,
                          "pass --schedule 1f1b or gpipe", plural="schedules")
        if self.micro_batches is not None:
            at_least("--micro-batches", self.micro_batches,
                     "pass --micro-batches 4, or leave it out")
        check_layer_costs(self.layer_costs)
        if not 0 < self.freeze_alpha < 1:
            raise ConfigError(f"--freeze-alpha must be in (0, 1) (got {self.freeze_alpha})",
                              "pass --freeze-alpha 0.333 (the paper's 1/3)")
        if self.freeze_every is not None and self.freeze_every < 2:
            # (the signal compares the interval with the layers' first steps: at least one
            # step that is not one of them)
            raise ConfigError(f"--freeze-every must be at least 2 steps (got "
                              f"{self.freeze_every}): a freeze point compares each layer's "
                              f"gradient norms over the interval with its first steps'",
                              "pass --freeze-every 100, or leave it out for one epoch of "
                              "the data")
        if self.freeze_signal not in SIGNALS:
            raise unknown("freeze signal", self.freeze_signal, SIGNALS,
                          "pass --freeze-signal change", plural="signals")
        if self.freeze_threshold is not None and not self.freeze_threshold > 0:
            raise ConfigError(f"--freeze-threshold must be positive (got "
                              f"{self.freeze_threshold})", "pass --freeze-threshold 0.5")
        if not 0 <= self.cache_mb < math.inf:
            raise ConfigError(f"--cache-mb must be 0 or more (got {self.cache_mb})",
                              "pass --cache-mb 256 (0: disk only)")
        if self.cache_from < 1:
            raise ConfigError(f"--cache-from must be at least 1 layer (got {self.cache_from})",
                              "pass --cache-from 2")
        if self.cache and self.cache_dir is not None:
            check_writable(self.cache_dir)
        defaults = {f.name: f.default for f in fields(self)}
        for off, switch, part, needs in (
                (not self.freeze, "--no-freeze", "AutoFreeze",  # AutoCache caches frozen
                 {**_FREEZE_FLAGS, "cache": "--no-cache", **_CACHE_FLAGS}),  # layers only
                (not self.cache, "--no-cache", "AutoCache", _CACHE_FLAGS),
                # AutoCache caches the front AutoPipe moves out; AutoDP takes the devices
                # AutoPipe's halving frees
                (not self.autopipe, "--no-autopipe", "AutoPipe",
                 {**_CACHE_FLAGS, "autodp": "--no-autodp"})):
            given = [flag for name, flag in needs.items()
                     if getattr(self, name) != defaults[name]]
            if off and given:
                raise ConfigError(f"{switch} turns {part} off, so {', '.join(given)} would do "
                                  f"nothing", f"leave out {switch}, or {', '.join(given)}")

    @property
    def cuts_move(self) -> bool:
        """Whether the pipeline's cuts may move as it trains (AutoPipe re-cuts at freeze
        points); without freezing, or freezing without AutoPipe, they stay the first plan's."""
        return self.freeze and self.autopipe

    @property
    def threshold(self) -> float:
        """``freeze_threshold``, or the signal's default."""
        if self.freeze_threshold is not None:
            return self.freeze_threshold
        return DEFAULT_THRESHOLDS[self.freeze_signal]
