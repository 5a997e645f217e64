"""The synchronous BytePS optimizer: gradients pushed from hooks, the user's optimizer updates."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ...comm.bucket import plan_buckets
from ...comm.partition import DEFAULT_PARTITION_BYTES, TensorSpec
from ...errors import ConfigError
from ...ps.engine import Engine
from ...ps.grads import GradientSync, bucket_specs
from .options import DEFAULT_FUSE_BYTES
from .plan import plan_for

__all__ = ["DistributedOptimizer", "WrappedOptimizer", "named_params_of"]


def named_params_of(optimizer: torch.optim.Optimizer,
                    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None
                    ) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's trainable parameters with names, in model order (earlier layers first)."""
    in_opt = [p for g in optimizer.param_groups for p in g["params"]]
    ids = {id(p) for p in in_opt}
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_opt)]
    else:
        named = [(n, p) for n, p in named_parameters if id(p) in ids]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"parameter names must be unique (repeated: {dup})",
                              "pass model.named_parameters()")
        missing = ids - {id(p) for _, p in named}
        if missing:
            raise ConfigError(f"{len(missing)} of the optimizer's parameters are not in "
                              f"named_parameters", "pass the named_parameters of the model "
                              "whose parameters the optimizer updates")
    return [(n, p) for n, p in named if p.requires_grad]


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch optimizer around another: groups, state and checkpoints are the inner one's.

    Optimizer.__init__ is not called: the wrapped optimizer owns the groups and
    the state, so learning-rate schedulers and ``state_dict`` see the real ones.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("parameters cannot be added to a BytePS optimizer after it is made "
                          "(the servers hold a plan of every gradient)",
                          "add the group to the torch optimizer before wrapping it")

    def close(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Release what the wrapper holds (hooks)."""

    def __repr__(self) -> str:
        return f"byteps.{type(self).__name__}({self.optimizer!r})"


class DistributedOptimizer(WrappedOptimizer):
    """Wraps any torch optimizer: gradients are summed by the summation service, then it steps.

    Each parameter's gradient is pushed from a post-accumulate hook as soon as
    backward produces it (after ``backward_passes_per_step`` passes), so
    communication overlaps the rest of backward; consecutive small tensors
    travel together until a group holds ``fuse_bytes`` (0: each on its own).
    :meth:`step` waits for the sums, divides them by the number of workers
    and runs the wrapped optimizer: summation on the servers, the update on
    the workers (BytePS, OSDI 2020). Parameters whose gradient never came get a zero gradient
    summed, so every worker sends the same keys every step.

    Example::

        opt = polytrain.byteps.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                                    named_parameters=model.named_parameters())
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, engine: Engine,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 backward_passes_per_step: int = 1,
                 fuse_bytes: int = DEFAULT_FUSE_BYTES,
                 partition_bytes: int = DEFAULT_PARTITION_BYTES, colocate: bool = True) -> None:
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be at least 1 (got "
                              f"{backward_passes_per_step})", "pass 1, or the passes per step")
        super().__init__(optimizer)
        self.engine = engine
        self.backward_passes_per_step = backward_passes_per_step
        named = named_params_of(optimizer, named_parameters)
        specs = [TensorSpec.of(n, p) for n, p in named]
        groups = plan_buckets(specs, fill_bytes=fuse_bytes, reverse=False)
        plan = plan_for(engine.ctx.topology, bucket_specs(groups, specs),
                        partition_bytes=partition_bytes, colocate=colocate)
        self.plan = plan
        self.sync = GradientSync(engine, named, groups, plan.placement,
                                 passes_per_step=backward_passes_per_step,
                                 describe=plan.describe())

    def synchronize(self) -> None:
        """Wait for every gradient's sum and leave the average over workers in ``.grad``."""
        self.sync.synchronize()

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        self.synchronize()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def close(self) -> None:
        """Remove the gradient hooks."""
        self.sync.close()
