"""Synchronous pipeline steps on the stage engine: GPipe or 1F1B micro-batches, then a flush."""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import ConfigError, at_least, unknown
from .schedule import FORWARD, SCHEDULES, describe
from .stage import Stage

__all__ = ["SyncPipeline"]


class SyncPipeline:
    """One stage's part of a synchronous pipeline step (GPipe, Huang et al. 2019; 1F1B).

    A minibatch is cut into ``microbatches`` equal micro-batches that run
    through the schedule; every stage accumulates its weights' gradients of
    the mean loss into ``.grad``, so after :meth:`step` the caller's optimizer
    step equals one step on the whole minibatch (the pipeline flush). A trained
    weight that no micro-batch reached keeps ``.grad`` None, as autograd leaves
    it in one process, so the optimizer skips it.

    Example::

        pipe = SyncPipeline(stage, schedule="1f1b", microbatches=4)
        opt.zero_grad()
        loss = pipe.step(x, y)       # the mean loss on the last stage, None elsewhere
        opt.step()

    Args:
        stage: this process's stage.
        schedule: ``gpipe`` or ``1f1b``.
        microbatches: how many micro-batches a minibatch is cut into.
    """

    def __init__(self, stage: Stage, *, schedule: str = "1f1b", microbatches: int = 4) -> None:
        if schedule not in SCHEDULES:
            raise unknown("pipeline schedule", schedule, SCHEDULES, "pass gpipe or 1f1b",
                          plural="schedules")
        at_least("micro-batches", microbatches, "pass microbatches=4")
        self.stage = stage
        self.schedule = schedule
        self.microbatches = microbatches
        self.orders = SCHEDULES[schedule](stage.spec.count, microbatches)
        self._next = 0  # minibatch numbers keep growing, so tags never repeat across steps

    def describe(self) -> str:
        return f"{self.schedule}, {self.microbatches} micro-batches\n" + describe(self.orders)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *,
             prepare: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float | None:
        """Run one minibatch (this replica's slice) through the pipeline; grads go to ``.grad``.

        ``prepare`` (first stage) maps each micro-batch's inputs before the stage's layers,
        when the schedule reaches its forward: PipeTransformer's frozen front, so that the
        next stage starts on the first micro-batch, not after the whole minibatch's front.
        """
        self.stage.check_inputs(inputs)
        m = self.microbatches
        if inputs.shape[0] % m:
            raise ConfigError(f"a minibatch of {inputs.shape[0]} samples cannot be cut into {m} "
                              f"equal micro-batches", f"pick a batch size divisible by {m}")
        xs, ys = inputs.chunk(m), targets.chunk(m)
        size = xs[0].shape[0]
        base = self._next
        self._next += m
        losses = []
        for action in self.orders[self.stage.spec.index]:
            i = action.minibatch
            if action.kind == FORWARD:
                x = xs[i] if prepare is None or not self.stage.spec.is_first else prepare(xs[i])
                loss = self.stage.forward(base + i, batch=size, inputs=x, targets=ys[i])
                if loss is not None:
                    losses.append(float(loss))
            else:
                grads = self.stage.backward(base + i, scale=1.0 / m, unused_zero=False)
                for p, g in zip(self.stage.params, grads):
                    if g is None:
                        continue
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.add_(g)
        return sum(losses) / m if losses else None
