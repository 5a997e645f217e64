"""The synchronous BytePS optimizer: gradients pushed from hooks, the user's optimizer updates."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import torch
import torch.distributed as dist

from ...comm.bucket import Bucket, buckets_of, plan_buckets
from ...comm.partition import DEFAULT_PARTITION_BYTES, TensorSpec
from ...errors import ConfigError, at_least, unknown
from ...kinds import check_kinds
from ...ps.compression import DEFAULT_MIN_BYTES, CompressOptions, Compressor, compressor
from ...ps.engine import Engine
from ...ps.grads import (
    GradientSync,
    bucket_specs,
    check_as_wrapped,
    gradient_change,
    gradient_left,
)
from ..synced import check_still_frozen
from .options import DEFAULT_FUSE_BYTES, BytePSOptions, check_refresh
from .plan import Plan, plan_for

log = logging.getLogger(__name__)

__all__ = ["DistributedOptimizer", "WrappedOptimizer", "named_params_of", "Choice",
           "checked_options", "same_options", "SAME_OPTIONS", "tensor_compression",
           "warmup_compression", "fused_buckets", "gradient_sync", "check_compress_momentum",
           "check_passes", "check_unfrozen", "FROZEN_VARIANCE"]

#: A compressor, its name (``"topk:0.01"``), or None / ``"none"``: uncompressed.
Choice = Union[Compressor, str, None]


def checked_options(owner: str, compression: Choice | Mapping[str, Choice],
                    options: Mapping[str, Any]
                    ) -> tuple[BytePSOptions, Choice | Mapping[str, Choice]]:
    """The options a wrapper (``owner``) was given, checked as the CLI's flags are (and by
    kind, as the strategy's options: numpy's numbers made Python's), with each
    compressor in use as ``--compress`` (its name, the options that need one, async's
    refusal), and the compression chosen: ``compression`` (BytePS's name), else ``options``'
    ``compress``, else none; both given is refused."""
    options = dict(options)
    fields = sorted(f.name for f in dataclasses.fields(BytePSOptions))
    if "compression_params" in options:  # BytePS's MXNet dictionary
        raise ConfigError(f"{owner} takes no compression_params (BytePS's MXNet dictionary "
                          f"of compressor, ef, momentum)", "pass compression= (a "
                          "bps.Compression member or a name such as 'onebit' or "
                          "'topk:0.01'), with error_feedback=True and compress_momentum=M "
                          "as keywords of their own")
    strange = sorted(set(options) - set(fields))  # was BytePSOptions(**...)'s TypeError
    if strange:
        close = difflib.get_close_matches(strange[0], fields, n=1)
        raise unknown(f"{owner} keyword", strange[0], fields,
                      f"did you mean {close[0]}=?" if close else "pass one of them, or "
                      "leave it out", plural=f"{owner}'s keyword options")
    compress = options.pop("compress", None)  # a name or a Compressor, as compression=
    # Kinds as the strategy's options are checked: colocate="no" was kept (a true value).
    options = check_kinds(BytePSOptions, options, what=f"{owner} option ")
    if compress is not None and compression is not None:
        raise ConfigError(f"{owner} got both compression={compression!r} and "
                          f"compress={compress!r}", "pass one of them (compression is "
                          "BytePS's name for it)")
    chosen = (compress or "none") if compression is None else compression
    _check_choices(f"{owner} {'compress' if compression is None else 'compression'}", chosen)
    values = list(chosen.values()) if isinstance(chosen, Mapping) else [chosen]
    specs = sorted({v if isinstance(v, str) else v.spec() for v in values if v is not None}
                   - {"none"})  # a mapping's uncompressed tensors beside compressed ones
    opts = [BytePSOptions(**options, compress=spec) for spec in specs or ["none"]]
    return opts[0], chosen


#: The :class:`BytePSOptions` fields every worker's wrapper must share (compared at the wrap,
#: with the compression): differing, they declare other keys or sum other payloads. Not
#: ``credit_bytes``: each worker's own send window, it changes neither.
SAME_OPTIONS = ("partition_bytes", "fuse_bytes", "colocate", "async_",
                "error_feedback", "compress_momentum", "compress_min_bytes", "compress_warmup",
                "compress_warmup_with", "compress_adam", "compress_adam_refresh")


def same_options(opts: BytePSOptions, chosen: Choice | Mapping[str, Choice]
                 ) -> dict[str, Any]:
    """What every worker's wrapper must be given alike, by name: the compression ``chosen``
    by its canonical name (:func:`_spec`) and the :data:`SAME_OPTIONS`."""
    return {"compression": _spec(chosen), **{name: getattr(opts, name)
                                             for name in SAME_OPTIONS}}


def _spec(choice: Choice | Mapping[str, Choice]) -> str | dict[str, str]:
    """A compression choice by its canonical name (``none``, ``onebit``, ``topk:0.01``; a
    name as given is parsed first: ``topk:0.010`` is ``topk:0.01``), a mapping's by tensor
    (tensors it leaves uncompressed left out: None is as absent)."""
    if isinstance(choice, Mapping):
        named = {k: _name(v) for k, v in sorted(choice.items())}
        return {k: v for k, v in named.items() if v != "none"}
    return _name(choice)


def _name(choice: Choice) -> str:
    codec = _resolve(choice)
    return "none" if codec is None else codec.spec()


def _check_choices(what: str, chosen: Any) -> None:
    """Refuse a compression (``what``: who took it, as which argument) that is no compressor,
    name or None, nor a mapping of them: ``Compression.topk`` not called, a number."""
    for key, value in chosen.items() if isinstance(chosen, Mapping) else [(None, chosen)]:
        if value is None or isinstance(value, (str, Compressor)):
            continue
        uncalled = callable(value) and hasattr(value, "__qualname__")
        got = (f"{value.__qualname__}, a {type(value).__name__}" if uncalled else
               f"{value!r}, {'an' if type(value).__name__[0] in 'aeiou' else 'a'} "
               f"{type(value).__name__}")
        raise ConfigError(
            f"{what}{'' if key is None else f'[{key!r}]'} must be a compressor, a "
            f"compressor's name or None (got {got})",
            "call it with its argument: bps.Compression.topk(0.01), say" if uncalled else
            "pass a bps.Compression member (bps.Compression.fp16, say), a name such as "
            "'topk:0.01', or a dict of them by parameter name")


def _resolve(choice: Choice) -> Compressor | None:
    return compressor(choice) if isinstance(choice, str) else choice


def tensor_compression(specs: Sequence[TensorSpec], choice: Choice | Mapping[str, Choice], *,
                       error_feedback: bool = False, momentum: float = 0.0,
                       min_bytes: int = DEFAULT_MIN_BYTES) -> list[CompressOptions | None]:
    """Per tensor, how it is compressed: ``choice`` for all, or per name (a mapping; names
    it lacks travel uncompressed). Tensors under ``min_bytes`` bytes, and tensors that are
    not float32, travel uncompressed; where that leaves none of those asked for compressed,
    refused (ConfigError)."""
    if isinstance(choice, Mapping):
        not_params = sorted(set(choice) - {s.name for s in specs})
        if not_params:
            raise ConfigError(f"compression names tensors that are not parameters: "
                              f"{not_params}",
                              "key the mapping by the names of named_parameters")
    out: list[CompressOptions | None] = []
    asked: list[TensorSpec] = []  # asked to be compressed
    other_dtype: list[TensorSpec] = []  # asked to be compressed, and not float32
    for s in specs:
        codec = _resolve(choice.get(s.name) if isinstance(choice, Mapping) else choice)
        if codec is not None:
            asked.append(s)
        if codec is not None and s.nbytes >= min_bytes and s.dtype != torch.float32:
            other_dtype.append(s)
        small = s.nbytes < min_bytes or s.dtype != torch.float32
        out.append(None if codec is None or small else
                   CompressOptions(codec, error_feedback=error_feedback, momentum=momentum))
    floats = [s for s in asked if s.dtype == torch.float32]
    if floats and not other_dtype and not any(out):  # a tiny model moved every byte, silently
        largest = max(floats, key=lambda s: s.nbytes)
        raise ConfigError(f"compression applies to tensors of --compress-min-bytes "
                          f"(compress_min_bytes) {min_bytes:,} bytes or more, and the largest "
                          f"it would compress here is {largest.name!r} of {largest.nbytes:,} "
                          f"bytes: none would be",
                          f"pass --compress-min-bytes {largest.nbytes} (or less), or leave "
                          f"compression out")
    if asked and not floats and not any(out):  # all of another dtype, and small
        other_dtype = asked
    if other_dtype:  # it moved every byte of a bfloat16 model, saying nothing
        names = ", ".join(repr(s.name) for s in other_dtype[:3]) + (
            " and more" if len(other_dtype) > 3 else "")
        dtypes = ", ".join(sorted({str(s.dtype).removeprefix("torch.") for s in other_dtype}))
        if not any(out):
            raise ConfigError(f"compression applies to float32 tensors, and the tensors it "
                              f"would compress here are {dtypes} ({names}): none would be",
                              "train the model in float32 (model.float()), or leave "
                              "compression out")
        log.warning("compression applies to float32 tensors: %d of %s (%s) travel "
                    "uncompressed", len(other_dtype), dtypes, names)
    return out


def warmup_compression(compression: Sequence[CompressOptions | None], choice: Choice
                       ) -> list[CompressOptions | None] | None:
    """How each compressed tensor (or bucket) travels during the warm-up: ``choice``'s
    compressor with the same error feedback, momentum and bounds (None: uncompressed)."""
    codec = _resolve(choice)
    if codec is None:
        return None
    return [None if c is None else dataclasses.replace(c, compressor=codec) for c in compression]


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
                    ) -> tuple[list[tuple[str, torch.nn.Parameter]],
                               list[tuple[str, torch.nn.Parameter]]]:
    """The optimizer's parameters with names, in model order (earlier layers first): those
    that require a gradient (trained), and those that do not (frozen at the wrap: see
    :func:`check_unfrozen`)."""
    in_opt = [p for g in optimizer.param_groups for p in g["params"]]
    ids = {id(p) for p in in_opt}
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_opt)]
    else:
        pairs = list(named_parameters)
        for i, item in enumerate(pairs):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                kind = type(item).__name__
                raise ConfigError(f"named_parameters takes (name, parameter) pairs, and item "
                                  f"{i} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}",
                                  "pass model.named_parameters(), or leave named_parameters "
                                  "out (the parameters are then named by position)")
        named = [(n, p) for n, p in pairs if id(p) in ids]
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
    return ([(n, p) for n, p in named if p.requires_grad],
            [(n, p) for n, p in named if not p.requires_grad])


def check_unfrozen(frozen: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """Refuse a parameter frozen when the optimizer was wrapped (``frozen``) that requires a
    gradient now: it has no keys, so each worker would step it on its own gradients."""
    check_still_frozen(frozen, "unfreeze it before the optimizer is wrapped "
                               "(bps.DistributedOptimizer, distribute()): a parameter may be "
                               "frozen after the wrap, not unfrozen")


def check_compress_momentum(optimizer: torch.optim.Optimizer, momentum: float) -> None:
    """Refuse ``compress_momentum`` beside a momentum of the optimizer's own: SGD's (or
    RMSprop's) ``momentum``, Adam's (and its kin's) ``betas[0]``. BytePS's momentum wrapper
    moves the optimizer's momentum before compression; it does not add one."""
    if not momentum:
        return
    for group in optimizer.param_groups:
        own, where, fix, place = (float(group.get("momentum") or 0.0), "", "momentum=0",
                                  "its place")
        betas = tuple(float(b) for b in group.get("betas") or ())  # Adan's has three
        if not own and betas and betas[0]:
            own, where, place = betas[0], " (betas[0])", "the place of betas[0]"
            fix = f"betas=(0.0, {', '.join(str(b) for b in betas[1:])})"
        if own:
            raise ConfigError(f"compress_momentum {momentum} puts a momentum on the gradients "
                              f"before compression, and {type(optimizer).__name__} has "
                              f"momentum {own} of its own{where}: the update would have two",
                              f"give the optimizer {fix} (compress_momentum takes {place}), "
                              f"or leave compress_momentum out")


def gradient_sync(engine: Engine, named: Sequence[tuple[str, torch.nn.Parameter]], *,
                  compression: Choice | Mapping[str, Choice] = None,
                  error_feedback: bool = False, compress_momentum: float = 0.0,
                  compress_min_bytes: int = DEFAULT_MIN_BYTES, compress_warmup: int = 0,
                  compress_warmup_with: Choice = None, fuse_bytes: int = DEFAULT_FUSE_BYTES,
                  partition_bytes: int = DEFAULT_PARTITION_BYTES, colocate: bool = True,
                  passes_per_step: int = 1, in_backward: bool = False,
                  averaging: bool = False, owner: str = "wrapper") -> tuple[Plan, GradientSync]:
    """BytePS's gradient sums for ``named``: fusion groups (never across tensors compressed
    differently), Theorem 1's placement of their partitions, and the hooks that push them
    (the first ``compress_warmup`` steps uncompressed, or compressed by
    ``compress_warmup_with``); ``averaging``, ``owner``: see :class:`GradientSync`."""
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
                              describe=plan.describe(), compression=compressed,
                              warmup=compress_warmup,
                              warmup_compression=warmup_compression(compressed,
                                                                    compress_warmup_with),
                              averaging=averaging, owner=owner)


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


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS: it re-evaluates the loss)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


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
    :func:`gradient_sync`'s ``compression``, ``error_feedback``, ``compress_momentum``,
    ``compress_min_bytes``, ``compress_warmup`` and ``compress_warmup_with``.

    ``compress_adam``: 1-bit Adam (Tang et al., ICML 2021) around a ``torch.optim.Adam``.
    During the ``compress_warmup`` steps it is Adam on the sums (exact, or compressed by
    ``compress_warmup_with``). Then, for every
    compressed tensor, each worker pushes its own momentum ``b1 m + (1 - b1) g`` (``m``
    the last step's average momentum, the same on every worker) instead of ``g``, so
    what compression and its error feedback act on is the smooth momentum; the pulled
    average is the new ``m``, and the update is ``lr m / (sqrt(v) + eps)`` with Adam's
    variance ``v`` frozen at its bias-corrected value of the last warm-up step (a
    variance of compressed values would be the block's scale, not the element's).
    Uncompressed tensors step with Adam as before.

    ``compress_adam_refresh`` F (default 0: off): every worker also keeps the variance
    of its own gradients (Adam's ``b2``, no messages), and at steps W, W + F, W + F^2,
    ... (W the warm-up, which may then be 0) the workers' mean of it, summed exactly
    (one uncompressed push and pull of the compressed tensors), becomes the frozen
    variance (0/1 Adam's renewed variance, Lu et al. 2022, from the workers' own
    variances instead of an exact step's).

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
                 compress_adam: bool = False, compress_adam_refresh: int = 0,
                 **compress: Any) -> None:
        check_passes(backward_passes_per_step)
        if _needs_closure(optimizer):
            raise ConfigError(f"{type(optimizer).__name__} evaluates its closure several times "
                              f"a step, and a BytePS step sums the gradients of one backward",
                              "use an optimizer that steps on one gradient (SGD, Adam, ...)")
        check_compress_momentum(optimizer, compress.get("compress_momentum", 0.0))
        super().__init__(optimizer)
        self.engine = engine
        self.backward_passes_per_step = backward_passes_per_step
        named, self._frozen = named_params_of(optimizer, named_parameters)
        self.plan, self.sync = gradient_sync(
            engine, named, fuse_bytes=fuse_bytes, partition_bytes=partition_bytes,
            colocate=colocate, passes_per_step=backward_passes_per_step,
            averaging=compress_adam and compress_adam_refresh > 0,
            owner="DistributedOptimizer", **compress)
        self._skip = False  # inside skip_synchronize()
        #: Whether :meth:`close` removed the gradient hooks (a step is refused from then on).
        self.closed = False
        #: 1-bit Adam's: per parameter, its .grad and that tensor's version when synchronize()
        #: left the sum there (None: not compressed).
        self._pulled: list[tuple[torch.Tensor | None, int] | None] = []
        self.compress_adam: _OneBitAdam | None = None
        if compress_adam:
            try:
                self.compress_adam = _OneBitAdam(optimizer, self.sync, compress_adam_refresh)
            except BaseException:  # refused: the sync's hooks would refuse a corrected retry
                self.sync.close()
                raise
            self.sync.transform = self.compress_adam.local_momentum

    def synchronize(self) -> None:
        """Wait for every gradient's sum and leave the average over workers in ``.grad``
        (nothing to do if no gradient came since the last call). Call it before changing
        gradients (clipping, a GradScaler's ``unscale_``); ``step()`` then uses them::

            loss.backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        With ``compress_adam``, past the warm-up a compressed tensor's ``.grad`` holds the
        averaged momentum instead: a change to it before ``step()`` is refused.
        """
        fresh = not self.sync.synchronized
        self.sync.synchronize()
        if fresh and self.compress_adam is not None:  # see _check_momentum_unchanged
            self._pulled = [None if p is None else gradient_left(p)
                            for p in self.compress_adam.packed]
        check_unfrozen(self._frozen)  # after the sums: the engine is left idle
        check_as_wrapped(self.sync.as_wrapped)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """BytePS's: from the next step on, sum the gradients of ``passes`` backward passes
        (as ``backward_passes_per_step``); between steps only."""
        check_passes(passes)
        done = self.sync.passes_done
        if done:
            raise ConfigError(f"set_backward_passes_per_step({passes}) in the middle of a step "
                              f"(after {done} of its {self.backward_passes_per_step} backward "
                              f"passes): a step's passes are counted as it began",
                              "call it between steps (after optimizer.step(), before the next "
                              "backward)")
        self.backward_passes_per_step = self.sync.passes_per_step = passes

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's and BytePS's: ``step()`` inside it does not synchronise (call
        :meth:`synchronize` before it; a step with gradients not yet synchronised is
        refused)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Run ``closure`` (once: its backward's gradients are the ones summed), wait for
        the sums and step the wrapped optimizer; returns the closure's loss."""
        if self.closed:
            raise ConfigError("this byteps DistributedOptimizer was closed, releasing what it "
                              "trains with (its gradient hooks and sums): a step now would step "
                              "this worker's copy on its own gradients",
                              "close() the optimizer after its last step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._skip:
            self.synchronize()
        elif not self.sync.synchronized:
            raise ConfigError("step() inside skip_synchronize() with gradients not yet "
                              "synchronised: it would step on this worker's own gradients",
                              "call optimizer.synchronize() before the step")
        else:  # unfrozen, converted or moved since the user's synchronize()
            check_unfrozen(self._frozen)
            check_as_wrapped(self.sync.as_wrapped)
        # How this step's gradients travelled (the warm-up's last went exact), read after
        # the synchronisation, which may have come before this call (synchronize(); clip).
        if self.compress_adam is not None and self.sync.synced_compressed:
            self._check_momentum_unchanged()
            self.compress_adam.step()
            return loss
        if self.compress_adam is not None:
            self.compress_adam.thaw()
        self.optimizer.step()
        return loss

    def _check_momentum_unchanged(self) -> None:
        """Refuse a compressed tensor's .grad changed since synchronize() past 1-bit Adam's
        warm-up: it holds the averaged momentum there, which the step makes Adam's
        ``exp_avg``, so a GradScaler's unscale_ or clipping changed the momentum (S=1024 and
        S=1 ended 1.455 apart)."""
        for name, p, left in zip(self.sync.names, self.sync.params, self._pulled):
            how = None if left is None else gradient_change(p, left)
            if how is not None:
                raise ConfigError(
                    f"the gradient of {name!r} {how} between synchronize() and step() past "
                    f"compress_adam's warm-up: there .grad holds 1-bit Adam's averaged "
                    f"momentum (it becomes Adam's exp_avg), not a gradient, so unscaling or "
                    f"clipping it would change the momentum",
                    "leave .grad as synchronize() left it once the warm-up is over (clip or "
                    "unscale during the warm-up only), or leave compress_adam out to clip or "
                    "use a GradScaler")

    def carried(self) -> dict[str, Any]:
        """What the compression carries from one step to the next, for a checkpoint (between
        steps; worker 0 reads the servers'): the steps synchronised (where the warm-up
        stands), this worker's codecs and, on worker 0, the servers' (error feedback,
        momentum, random draws), and 1-bit Adam's own variance of the gradients (with a
        refresh). 1-bit Adam's frozen variance is in Adam's state."""
        engine = self.engine
        out: dict[str, Any] = {"synced": self.sync.synced, "codecs": engine.codec_states()}
        if engine.ctx.worker_index == 0:
            out["server_codecs"] = engine.server_codec_states()
        if self.compress_adam is not None:
            out["local_variance"] = [v.cpu().clone() for v in self.compress_adam.local_v]
            out["local_variance_from"] = self.compress_adam.v_from
        return out

    def carry_on(self, state: Mapping[str, Any]) -> bool:
        """Go on from :meth:`carried` (collective over the workers, before the first step).
        False, with nothing but the warm-up's count restored, where the saved codecs do not
        fit this run's partitions (another layout, or a checkpoint without them)."""
        self.sync.synced = int(state["synced"])
        engine, ctx = self.engine, self.engine.ctx
        mine, servers = state.get("codecs"), state.get("server_codecs")
        saved_v = list(state.get("local_variance", []))
        ours = self.compress_adam.local_v if self.compress_adam is not None else []
        fits = (mine is not None and engine.codecs_fit(mine, servers)
                and [v.shape for v in saved_v] == [v.shape for v in ours])
        if ctx.num_workers > 1:  # all or none: the servers' state goes with the workers'
            flag = torch.tensor([int(fits)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.groups.workers)
            fits = bool(flag.item())
        if fits:
            assert mine is not None
            engine.restore_codecs(mine, servers)
            for v, saved in zip(ours, saved_v):
                v.copy_(saved)
        if self.compress_adam is not None:  # the steps its own variances have seen start...
            self.compress_adam.v_from = (int(state.get("local_variance_from", 0)) if fits
                                         else self.sync.synced)  # ...anew where not restored
        if ctx.num_workers > 1:  # no worker pushes before the servers' codecs are set
            dist.barrier(group=ctx.groups.workers)
        return fits

    def close(self) -> None:
        """Remove the gradient hooks; :meth:`step` is refused from then on."""
        self.closed = True
        self.sync.close()


def check_passes(passes: int) -> None:
    at_least("backward_passes_per_step", passes, "pass 1, or the passes per step", whole=True)


def check_one_bit_adam(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what 1-bit Adam cannot run on: anything but a plain ``torch.optim.Adam``."""
    if type(optimizer) is not torch.optim.Adam:
        lazy = type(optimizer).__name__ == "LazyAdam"
        raise ConfigError(
            f"compress_adam (1-bit Adam) runs on torch.optim.Adam, not "
            f"{type(optimizer).__name__}: it freezes Adam's variance and compresses "
            f"Adam's momentum" + (" (--optimizer adam is LazyAdam on a model with sparse "
                                  "embeddings)" if lazy else ""),
            "leave out --compress-adam" if lazy else
            "use --optimizer adam (torch.optim.Adam), or leave out --compress-adam")
    for group in optimizer.param_groups:
        bad = {k: group.get(k) for k in ("weight_decay", "amsgrad", "maximize")
               if group.get(k)}
        if bad:
            raise ConfigError(f"compress_adam (1-bit Adam) supports plain Adam only (got "
                              f"{bad})", "leave weight_decay, amsgrad and maximize at "
                              "their defaults, or leave out --compress-adam")


class _OneBitAdam:
    """1-bit Adam's compression stage on a torch Adam (see :class:`DistributedOptimizer`).

    Reads and keeps Adam's own state: ``exp_avg`` holds the average momentum
    pulled each step (so checkpoints and the warm-up's momentum carry over),
    ``exp_avg_sq`` and ``step`` go on as Adam's; the frozen variance is taken
    from them at the first compressed step and kept there too, as
    ``FROZEN_VARIANCE`` (so a checkpoint carries it: recomputed after a resume,
    its bias correction would use the later step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, sync: GradientSync,
                 refresh: int = 0) -> None:
        check_one_bit_adam(optimizer)
        check_refresh(refresh)
        if sync.warmup < 1 and not refresh:
            raise ConfigError("compress_adam (1-bit Adam) freezes the variance Adam learns "
                              "during the warm-up, but compress_warmup is 0 (or "
                              "no tensor is compressed)", "pass --compress-warmup N (e.g. "
                              "a fifth of the steps) and a compressor")
        self.optimizer = optimizer
        self.sync = sync
        packed = {m for b in sync.packed for m in sync.buckets[b].members}
        self.packed = [p if i in packed else None for i, p in enumerate(sync.params)]
        # By index, not the dicts: load_state_dict (bps.broadcast_optimizer_state's) puts
        # new dicts in param_groups, and a scheduler then sets the lr in those.
        self.group_index = {id(p): i for i, g in enumerate(optimizer.param_groups)
                            for p in g["params"]}
        #: With ``refresh`` F: every step, each worker's own variance of its gradients, one
        #: flat buffer per compressed bucket; averaged over the workers at steps W, W + F^k.
        self.refresh = refresh
        packed_buckets = sync.packed if refresh else []
        self.local_v = [torch.zeros(sync.buckets[b].numel, dtype=torch.float32,
                                    device=sync.params[sync.buckets[b].members[0]].device)
                        for b in packed_buckets]
        self.slot = {m: (j, off) for j, b in enumerate(packed_buckets)
                     for m, off in zip(sync.buckets[b].members, sync.buckets[b].offsets)}
        #: The synchronised steps before ``local_v`` started (a resume that could not
        #: restore it starts it at zero there): its bias correction counts the steps since.
        self.v_from = 0
        if refresh and sync.warmup == 0:  # no warm-up: Adam's state starts here (as Adam's)
            for p in self.packed:
                if p is not None and not optimizer.state[p]:
                    optimizer.state[p].update(step=torch.zeros(()),
                                              exp_avg=torch.zeros_like(p),
                                              exp_avg_sq=torch.zeros_like(p))

    def group_of(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s parameter group, as the optimizer holds it now (lr, betas, eps)."""
        return self.optimizer.param_groups[self.group_index[id(p)]]

    @torch.no_grad()
    def local_momentum(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """What parameter i pushes: its gradient, or after the warm-up (compressed tensors
        only) this worker's momentum ``b1 m + (1 - b1) g``."""
        p = self.packed[i]
        if p is None:
            return grad
        beta1, beta2 = self.group_of(p)["betas"]
        if self.refresh:
            j, off = self.slot[i]
            flat = grad.detach().reshape(-1).float()
            self.local_v[j][off:off + flat.numel()].mul_(beta2).addcmul_(flat, flat,
                                                                         value=1 - beta2)
        if not self.sync.compressing:
            return grad
        m = self.optimizer.state[p]["exp_avg"]
        return (1 - beta1) * grad + beta1 * m

    @torch.no_grad()
    def step(self) -> None:
        """The compressed tensors' update from the pulled momentum (in ``.grad``); Adam's for
        the others."""
        if self.refreshing():
            self._refresh()
        held = []
        for p in self.packed:
            if p is None or p.grad is None:  # frozen since the wrap: Adam skips it too
                continue
            group, state = self.group_of(p), self.optimizer.state[p]
            frozen = state.get(FROZEN_VARIANCE)
            if frozen is None:
                _, beta2 = group["betas"]
                frozen = state[FROZEN_VARIANCE] = _frozen(state["exp_avg_sq"] / (
                    1 - beta2 ** float(state["step"])), group["eps"])
            state["exp_avg"].copy_(p.grad)
            state["step"] += 1
            lr = group["lr"]
            p.addcdiv_(p.grad, frozen, value=-(lr.item() if torch.is_tensor(lr) else lr))
            held.append((p, p.grad))
            p.grad = None  # Adam skips it
        try:
            self.optimizer.step()
        finally:
            for p, g in held:
                p.grad = g

    def thaw(self) -> None:
        """An exact Adam step (the warm-up's): the variance is frozen again after it (a run
        resumed on another layout warms up again, on a checkpoint's frozen variance)."""
        for p in self.packed:
            if p is not None and (state := self.optimizer.state.get(p)):
                state.pop(FROZEN_VARIANCE, None)

    def refreshing(self) -> bool:
        """Whether the step just synchronised is one at which the variance is frozen anew:
        steps W and W + F^k (k >= 1), W the warm-up, counted from 0 as this object's."""
        if not self.refresh:
            return False
        since = self.sync.synced - 1 - self.sync.warmup
        point = 1
        while point < since:
            point *= self.refresh
        return since == 0 or (since > 1 and point == since)

    @torch.no_grad()
    def _refresh(self) -> None:
        """Freeze again, at the workers' mean of their own gradients' variance (one exact sum
        of the compressed tensors' size), bias-corrected for the steps it has seen."""
        means = self.sync.average(self.local_v)
        seen = float(self.sync.synced - self.v_from)
        for i, p in enumerate(self.packed):
            if p is None:
                continue
            j, off = self.slot[i]
            group, state = self.group_of(p), self.optimizer.state[p]
            beta2 = group["betas"][1]
            v_hat = means[j][off:off + p.numel()].view(p.shape).to(p.device, p.dtype) / (
                1 - beta2 ** seen)
            state[FROZEN_VARIANCE] = _frozen(v_hat, group["eps"])
            # Adam's own state holds it too (as of this step's count), so that a checkpoint
            # carries a variance, for plain Adam or a warm-up after resuming.
            state["exp_avg_sq"].copy_(v_hat * (1 - beta2 ** (float(state["step"]) + 1)))


#: The key of 1-bit Adam's frozen variance (``sqrt(v hat) + eps``) in Adam's per-parameter state.
FROZEN_VARIANCE = "onebit_frozen_variance"


def _frozen(v_hat: torch.Tensor, eps: float) -> torch.Tensor:
    """What 1-bit Adam divides the momentum by: ``sqrt(v_hat) + eps``, and infinity where the
    variance is exactly 0 (an element no gradient has reached yet does not step: its packed
    momentum is its block's sign and scale, which eps would magnify without bound)."""
    out = v_hat.sqrt().add_(eps)
    return out.masked_fill_(v_hat == 0, float("inf"))
