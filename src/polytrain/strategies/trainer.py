"""The step API: ``trainer.step(x, y)`` trains one global batch with any strategy.

Pipeline strategies (HetPipe, PipeTransformer) cannot be driven by the plain
``backward()``/``step()`` loop: a stage holds part of the model, and a step
is a schedule of micro-batches across processes. They are driven as
``torch.distributed.pipelining`` schedules are (``schedule.step(x,
target=y)``), and every strategy can be: the CLI's loop uses this API too.

Each step the trainer asks the strategy, in this order:

    strategy.replan(step)      # may change the plan between steps (default: nothing);
                               # True where it did, moving state (trainer.replanned)
    strategy.replica           # (index, count) NOW: this process's slice of the batch
    strategy.train_step(...)   # the step itself, on that slice

so a strategy whose data-parallel width changes during the run (more
pipeline replicas as layers freeze) reshards the data without the caller
knowing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..data import shard
from ..errors import ConfigError
from ..moe import aux_loss
from ..moe.gates import Gate

if TYPE_CHECKING:
    from .base import LossFn, Strategy

__all__ = ["Trainer", "with_gate_losses"]


def with_gate_losses(loss_fn: LossFn, model: nn.Module) -> LossFn:
    """``loss_fn`` plus the MoE gates' balance and z-losses of the model's last forward.

    A model without MoE gates gets ``loss_fn`` itself.
    """
    if not any(isinstance(m, Gate) for m in model.modules()):
        return loss_fn

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(outputs, targets) + aux_loss(model)
    return loss


class Trainer:
    """A model, its optimizer and a loss, trained by a strategy one global batch at a time.

    Made by :func:`polytrain.distribute` when it is given ``loss_fn``.

    Example::

        trainer = polytrain.distribute(model, opt, strategy="hetpipe", loss_fn=loss_fn)
        for x, y in batches:              # the same GLOBAL batches on every worker
            loss = trainer.step(x, y)     # this worker's replica's mean loss, or None
        state = trainer.state_dict()      # the whole model, as the plain model's keys
        trainer.close()                   # drains a pipeline's last minibatches (done
                                          # as the script ends, if it does not)

    Attributes:
        model, optimizer: what the strategy trains (a learning-rate scheduler goes on
            ``optimizer``). Under a pipeline strategy ``model`` holds current weights
            only in this worker's own stages (its other layers are not kept
            current): the whole model is :meth:`state_dict`, not ``model``'s.
        strategy: the strategy instance; steps: steps taken; closed: whether
            :meth:`close` was called.
        replanned: whether the last step began with a new plan that moved state
            (:meth:`~polytrain.strategies.base.Strategy.replan`): not a steady step.
            False on a resumed run's first step, whose plan the strategy installs
            inside it (a cold step already).
    """

    def __init__(self, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: LossFn, *, device: torch.device | None = None) -> None:
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.steps = 0
        self.closed = False
        self.replanned = False
        # A pipeline's, closed as the script ends if the script does not (its minibatches in
        # flight): kept until then (the others are freed when the script drops them).
        self._kept_by = strategy.ctx if strategy.pipeline and strategy.distributed else None
        if self._kept_by is not None:
            self._kept_by.keep_open(self)

    @property
    def replica(self) -> tuple[int, int]:
        """(index, count) of this worker's data-parallel replica for the next step."""
        return self.strategy.replica

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Train on one global batch: a tensor of inputs and one of targets (dim 0: the
        samples, the same on every worker).

        Returns the mean loss over this worker's replica's slice, or None where this
        process holds no loss (a pipeline's earlier stages).
        """
        if self.closed:
            raise ConfigError(f"this trainer (strategy {self.strategy.name!r}) was closed, "
                              f"releasing what its strategy trains with (gradient sums, "
                              f"stages, threads): a step now would train without them",
                              "close() the trainer after its last step")
        for what, given in (("inputs", inputs), ("targets", targets)):
            if not isinstance(given, torch.Tensor):
                kind = type(given).__name__
                raise ConfigError(f"trainer.step takes one tensor of inputs and one of targets "
                                  f"(dim 0: the samples), but got {what} "
                                  f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}",
                                  "pack the inputs into one tensor (a model of several takes "
                                  "them as one and splits it in its forward), or train a "
                                  "data-parallel strategy with the plain loop")
            if given.dim() == 0:  # no samples to slice (two had passed the check of lengths)
                raise ConfigError(f"trainer.step takes tensors whose dim 0 is the samples of "
                                  f"the global batch, but got {what} of 0 dims (one number)",
                                  "pass a batch along dim 0 (one sample x is x.unsqueeze(0))")
        if inputs.shape[0] != targets.shape[0]:
            raise ConfigError(f"trainer.step got {inputs.shape[0]} inputs but {targets.shape[0]} "
                              f"targets (dim 0 is the samples of the global batch)",
                              "pass inputs and targets of the same global batch")
        self.replanned = self.strategy.replan(self.steps)
        index, count = self.strategy.replica
        x, y = shard(inputs, index, count), shard(targets, index, count)
        if self.device is not None:
            x, y = x.to(self.device), y.to(self.device)
        loss = self.strategy.train_step(self.model, self.optimizer, x, y, self.loss_fn)
        if self.strategy.pipeline:
            # The stages step optimizers of their own that follow this one's settings, never
            # this one: torch's learning-rate schedulers read this flag (set by the step they
            # wrap) to warn of a scheduler stepped before the optimizer, falsely here.
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        self.steps += 1
        return loss

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on CPU with the plain model's keys (every worker calls it;
        worker 0's is whole)."""
        return self.strategy.state_dict(self.model)

    def close(self) -> None:
        """Release what the strategy holds (threads, stages); the run stays open. The
        trainer steps no more; a second call does nothing."""
        if not self.closed:
            self.closed = True
            if self._kept_by is not None:
                self._kept_by.closed_one(self)
            self.strategy.close()

    def __repr__(self) -> str:
        return f"polytrain.Trainer(strategy={self.strategy.name!r}, steps={self.steps})"
