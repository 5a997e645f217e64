"""The synchronous BytePS optimizer: gradients pushed from hooks, the user's optimizer updates."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

from ...comm.bucket import Bucket, plan_buckets
from ...comm.partition import DEFAULT_PARTITION_BYTES, TensorSpec
from ...errors import ConfigError
from ...ps.engine import Engine, SumTensor
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


def _group_name(group: Bucket, specs: Sequence[TensorSpec]) -> str:
    first = specs[group.members[0]].name
    if len(group.members) == 1:
        return first
    return f"{first}..{specs[group.members[-1]].name}"


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
        self._params = [p for _, p in named]
        specs = [TensorSpec.of(n, p) for n, p in named]
        self._groups = plan_buckets(specs, fill_bytes=fuse_bytes, reverse=False)
        self._group_of = {m: g.index for g in self._groups for m in g.members}
        fused = [TensorSpec(_group_name(g, specs), (g.numel,), g.dtype) for g in self._groups]
        plan = plan_for(engine.ctx.topology, fused, partition_bytes=partition_bytes,
                        colocate=colocate)
        self.plan = plan
        self._tensors: Sequence[SumTensor] = engine.sums(fused, plan.placement,
                                                         describe=plan.describe())
        # A fused group gathers its members' gradients in one flat buffer as they come.
        self._buffers = [None if len(g.members) == 1 else torch.empty(
            g.numel, dtype=g.dtype, device=self._params[g.members[0]].device)
            for g in self._groups]
        self._passes = [0] * len(self._params)
        self._ready = [False] * len(self._params)
        self._missing = [len(g.members) for g in self._groups]
        self._workers = engine.ctx.num_workers
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(self._params)]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._passes[i] += 1
            if self._passes[i] == self.backward_passes_per_step and not self._ready[i]:
                self._collect(i)
        return hook

    @torch.no_grad()
    def _collect(self, i: int) -> None:
        """Parameter i's gradient is final for this step: submit its group once all are."""
        p = self._params[i]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        self._ready[i] = True
        g = self._groups[self._group_of[i]]
        buf = self._buffers[g.index]
        if buf is not None:
            off = g.offsets[g.members.index(i)]
            buf[off:off + p.numel()].copy_(grad.reshape(-1))
        self._missing[g.index] -= 1
        if self._missing[g.index] == 0:
            self.engine.submit(self._tensors[g.index], grad.reshape(-1) if buf is None else buf)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Wait for every gradient's sum and leave the average over workers in ``.grad``."""
        for i in range(len(self._params)):
            if not self._ready[i]:
                self._collect(i)
        for g, t in zip(self._groups, self._tensors):
            total = self.engine.wait(t)
            for m, off in zip(g.members, g.offsets):
                p = self._params[m]
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(total[off:off + p.numel()].view(p.shape)).div_(self._workers)
        self._passes = [0] * len(self._params)
        self._ready = [False] * len(self._params)
        self._missing = [len(g.members) for g in self._groups]

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        self.synchronize()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
