"""The synchronous BytePS optimizer: gradients pushed from hooks, the user's optimizer updates."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import torch

from ...comm.bucket import Bucket, buckets_of, plan_buckets
from ...comm.partition import DEFAULT_PARTITION_BYTES, TensorSpec
from ...errors import ConfigError
from ...ps.compression import DEFAULT_MIN_BYTES, CompressOptions, Compressor, compressor
from ...ps.engine import Engine
from ...ps.grads import GradientSync, bucket_specs
from .options import DEFAULT_FUSE_BYTES
from .plan import Plan, plan_for

__all__ = ["DistributedOptimizer", "WrappedOptimizer", "named_params_of", "Choice",
           "tensor_compression", "fused_buckets", "gradient_sync"]

#: A compressor, its name (``"topk:0.01"``), or None / ``"none"``: uncompressed.
Choice = Union[Compressor, str, None]


def _resolve(choice: Choice) -> Compressor | None:
    return compressor(choice) if isinstance(choice, str) else choice


def tensor_compression(specs: Sequence[TensorSpec], choice: Choice | Mapping[str, Choice], *,
                       error_feedback: bool = False, momentum: float = 0.0,
                       min_bytes: int = DEFAULT_MIN_BYTES) -> list[CompressOptions | None]:
    """Per tensor, how it is compressed: ``choice`` for all, or per name (a mapping; names
    it lacks travel uncompressed). Tensors under ``min_bytes`` bytes, and tensors that are
    not float32, travel uncompressed."""
    if isinstance(choice, Mapping):
        unknown = sorted(set(choice) - {s.name for s in specs})
        if unknown:
            raise ConfigError(f"compression names tensors that are not parameters: {unknown}",
                              "key the mapping by the names of named_parameters")
    out: list[CompressOptions | None] = []
    for s in specs:
        codec = _resolve(choice.get(s.name) if isinstance(choice, Mapping) else choice)
        small = s.nbytes < min_bytes or s.dtype != torch.float32
        out.append(None if codec is None or small else
                   CompressOptions(codec, error_feedback=error_feedback, momentum=momentum))
    return out


def fused_buckets(specs: Sequence[TensorSpec], compression: Sequence[CompressOptions | None],
                  fuse_bytes: int) -> tuple[Bucket, ...]:
    """Consecutive tensors fused until a group holds ``fuse_bytes``, never across tensors
    that are compressed differently (a bucket travels one way)."""
    groups: list[list[int]] = []
    start = 0
    for i in range(1, len(specs) + 1):
        if i == len(specs) or compression[i] != compression[start]:
            run = plan_buckets(specs[start:i], fill_bytes=fuse_bytes, reverse=False)
            groups += [[start + m for m in b.members] for b in run]
            start = i
    return buckets_of(specs, groups)


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


def gradient_sync(engine: Engine, named: Sequence[tuple[str, torch.nn.Parameter]], *,
                  compression: Choice | Mapping[str, Choice] = None,
                  error_feedback: bool = False, compress_momentum: float = 0.0,
                  compress_min_bytes: int = DEFAULT_MIN_BYTES,
                  fuse_bytes: int = DEFAULT_FUSE_BYTES,
                  partition_bytes: int = DEFAULT_PARTITION_BYTES, colocate: bool = True,
                  passes_per_step: int = 1, in_backward: bool = False
                  ) -> tuple[Plan, GradientSync]:
    """BytePS's gradient sums for ``named``: fusion groups (never across tensors compressed
    differently), Theorem 1's placement of their partitions, and the hooks that push them."""
    specs = [TensorSpec.of(n, p) for n, p in named]
    per_tensor = tensor_compression(specs, compression, error_feedback=error_feedback,
                                    momentum=compress_momentum, min_bytes=compress_min_bytes)
    groups = fused_buckets(specs, per_tensor, fuse_bytes)
    plan = plan_for(engine.ctx.topology, bucket_specs(groups, specs),
                    partition_bytes=partition_bytes, colocate=colocate)
    # A fused group's codecs keep their statistics per tensor: they get its members' offsets.
    compressed = [c if (c := per_tensor[b.members[0]]) is None or len(b.members) == 1
                  else dataclasses.replace(c, bounds=b.offsets) for b in groups]
    return plan, GradientSync(engine, named, groups, plan.placement,
                              passes_per_step=passes_per_step, in_backward=in_backward,
                              describe=plan.describe(), compression=compressed)


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
    summed, so every worker sends the same keys every step. ``compress`` are
    :func:`gradient_sync`'s ``compression``, ``error_feedback``, ``compress_momentum``
    and ``compress_min_bytes``.

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
                 partition_bytes: int = DEFAULT_PARTITION_BYTES, colocate: bool = True,
                 **compress: Any) -> None:
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be at least 1 (got "
                              f"{backward_passes_per_step})", "pass 1, or the passes per step")
        super().__init__(optimizer)
        self.engine = engine
        self.backward_passes_per_step = backward_passes_per_step
        named = named_params_of(optimizer, named_parameters)
        self.plan, self.sync = gradient_sync(
            engine, named, fuse_bytes=fuse_bytes, partition_bytes=partition_bytes,
            colocate=colocate, passes_per_step=backward_passes_per_step, **compress)

    def synchronize(self) -> None:
        """Wait for every gradient's sum and leave the average over workers in ``.grad``."""
        self.sync.synchronize()

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        self.synchronize()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def close(self) -> None:
        """Remove the gradient hooks."""
        self.sync.close()
