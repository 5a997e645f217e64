"""Gradients summed as backward produces them: hooks fill buckets, the engine sums each one.

The worker-side schedule BytePS and Herring share: every parameter's
gradient joins its bucket from a post-accumulate hook (after
``passes_per_step`` backward passes: gradient accumulation); once a bucket's
last member is in, the bucket is handed to the engine while backward goes on
(overlap); :meth:`GradientSync.synchronize` waits for what is still in
flight and leaves the average over workers in every ``.grad``. Parameters
whose gradient never came are summed as zeros, so every worker sends the same
keys every step; with :attr:`GradientSync.keep_missing`, one that no worker's
gradient came for is left without one (``None``), as in one process: a flag per
parameter travels in a sum of its own, on the servers with the gradients.

    backward:  grad(p9) grad(p8) | grad(p7) ... grad(p0)   (hooks, in this order)
    buckets:   [p9 p8] -> submit  | [p7 ..]  -> submit  ...
    sync:                                     wait(b0), wait(b1), ... -> .grad = sum / W
"""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from typing import Callable, Iterable, Protocol, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from ..comm.bucket import Bucket
from ..comm.partition import TensorSpec, partition
from ..errors import ConfigError
from .compression import CompressOptions
from .engine import Engine, SumTensor, forget_if_alive
from .placement import Placement

__all__ = ["GradientSync", "AsWrapped", "Holder", "as_wrapped", "bucket_specs",
           "check_as_wrapped", "flags_dtype", "gradient_change", "gradient_left", "hold",
           "let_go_of", "presence_flags", "read_presence", "refuse_held", "sparse_parameter"]


def flags_dtype(workers: int) -> torch.dtype:
    """The dtype of :attr:`GradientSync.keep_missing`'s flags, whose sums over ``workers``
    reach W (W + 2) (:func:`presence_flags`): int32 while they fit (up to 46,339 workers;
    float32 counted exactly to 4,095 only), else int64."""
    return torch.int32 if workers * (workers + 2) < 2**31 else torch.int64


def presence_flags(had: Sequence[bool], frozen: Sequence[bool], workers: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """One worker's flags, per parameter: 1 if it had a gradient, plus W + 1 if it is frozen
    here (requires_grad False), so that their sum over the W workers holds both counts
    (:func:`read_presence`)."""
    return torch.tensor([int(h) + (workers + 1) * int(f) for h, f in zip(had, frozen)],
                        dtype=flags_dtype(workers), device=device)


def read_presence(sums: torch.Tensor, workers: int) -> list[tuple[int, int]]:
    """Per parameter, from the sum of every worker's :func:`presence_flags`: (how many
    workers froze it, how many had a gradient)."""
    return [divmod(int(n), workers + 1) for n in sums.tolist()]


def sparse_parameter(model: torch.nn.Module) -> str | None:
    """The name of ``model``'s first parameter with sparse gradients (an
    ``nn.Embedding(sparse=True)`` or ``EmbeddingBag`` that trains: a frozen one has none), or
    None: the engine sums dense ones."""
    for prefix, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                and module.weight.requires_grad:
            return f"{prefix}.weight" if prefix else "weight"
    return None


def bucket_specs(buckets: Sequence[Bucket], specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """One flat spec per bucket, named after its members (``first..last``)."""
    out = []
    for b in buckets:
        first, last = specs[b.members[0]].name, specs[b.members[-1]].name
        out.append(TensorSpec(first if len(b.members) == 1 else f"{first}..{last}",
                              (b.numel,), b.dtype))
    return out


def travels_divided(dtype: torch.dtype) -> bool:
    """Whether gradients of ``dtype`` are divided by the workers before they are summed, as
    torch's DDP does: a 16-bit sum of W gradients can overflow (the servers add in float32
    but answer in the bucket's dtype)."""
    return dtype in (torch.float16, torch.bfloat16)


def gradient_left(param: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``param``'s gradient tensor as it is now and its version, for :func:`gradient_change`."""
    return param.grad, 0 if param.grad is None else param.grad._version


def gradient_change(param: torch.Tensor, left: tuple[torch.Tensor | None, int]) -> str | None:
    """How ``param``'s gradient changed since backward left it (``left``: the gradient
    tensor and its version then): "was replaced", "was changed in place", or None."""
    grad, version = left
    if param.grad is not grad:
        return "was replaced"
    if grad is not None and grad._version != version:
        return "was changed in place"
    return None


#: A trained parameter's name, the parameter, and its dtype and device at the wrap.
AsWrapped = tuple[str, torch.Tensor, torch.dtype, torch.device]


def as_wrapped(named: Iterable[tuple[str, torch.Tensor]]) -> list[AsWrapped]:
    """``named`` with each parameter's dtype and device now, for :func:`check_as_wrapped`."""
    return [(n, p, p.dtype, p.device) for n, p in named]


def check_as_wrapped(wrapped: Sequence[AsWrapped]) -> None:
    """Refuse a parameter of ``wrapped`` whose dtype or device changed since the wrap
    (``model.double()``, ``model.to(device)`` after it): its sums were laid out for the
    wrap's, so its gradients were summed in the wrap's dtype (herring, byteps) or the
    workers drifted apart (torch's DDP); one frozen since is not summed, and passes. Cheap
    enough for every step: a dtype compared by identity, a device by value, nothing else
    made. Parameters replaced by new objects (``load_state_dict(..., assign=True)`` after
    the wrap) are not seen: their hooks are gone with them, as under torch's DDP."""
    for name, p, dtype, device in wrapped:
        if not p.requires_grad:  # frozen since (then cast down, say): it has nothing to sum
            continue
        if p.dtype is not dtype or p.device != device:
            raise ConfigError(
                f"parameter {name!r} is {_placed(p.dtype, p.device)} now, and was "
                f"{_placed(dtype, device)} at the wrap, which laid out its sums for that: the "
                f"workers would step on sums of another dtype, or drift apart",
                "convert the model (model.double(), .to(device)) before distribute() (or "
                "before wrapping it)")


def _placed(dtype: torch.dtype, device: torch.device) -> str:
    return f"{str(dtype).removeprefix('torch.')} on {device}"


class Holder(Protocol):
    """What pushes parameters to the servers every step: a :class:`GradientSync`'s hooks,
    an asynchronous optimizer's steps. One at a time per parameter (:func:`hold`)."""

    #: What made it (``"DistributedOptimizer"``), named where a second wrap is refused.
    owner: str

    @property
    def holding(self) -> bool:
        """Whether it still pushes its parameters (not closed)."""


#: By parameter id: the parameter and the holder that pushes it (while it holds it).
_holders: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Holder]]] = {}


def refuse_held(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse a parameter of ``named`` that an open holder pushes already: both would push
    it, refused at the wrap rather than at the first backward ("a gradient from 2 backward
    passes") or never (an asynchronous optimizer's)."""
    for name, p in named:
        if _open_holder(p) is not None:
            gc.collect()  # one dropped in a reference cycle (1-bit Adam's) lets go now
        other = _open_holder(p)
        if other is not None:
            raise ConfigError(f"parameter {name!r} is held already by a {other.owner} that "
                              f"was not closed: both would push it to the servers every step",
                              f"close() the first {other.owner} before wrapping its "
                              f"parameters again")


def hold(params: Iterable[torch.Tensor], holder: Holder) -> None:
    """Record ``holder`` as the one that pushes ``params`` (:func:`refuse_held` first), by
    weak reference: one dropped without close() lets go of them."""
    for p in params:
        _holders[id(p)] = (weakref.ref(p), weakref.ref(holder))


def let_go_of(params: Iterable[torch.Tensor], holder: Holder) -> None:
    """``holder`` no longer pushes ``params`` (its close()): another may wrap them."""
    for p in params:
        ref, held = _holders.get(id(p), (None, None))
        if held is not None and held() is holder:
            del _holders[id(p)]


class GradientSync:
    """Sums the gradients of ``params`` over every worker, bucket by bucket, during backward.

    Example::

        buckets = plan_buckets(specs, cap_bytes=25 << 20)
        sync = GradientSync(engine, list(model.named_parameters()), buckets, placement)
        loss.backward()        # buckets leave as they fill
        sync.synchronize()     # .grad of every param = the mean over workers

    Args:
        engine: the run's engine. named: the parameters with names (``buckets`` index them).
        buckets: members and offsets of each flat bucket, in the order they are summed.
        placement: where each bucket's partitions go (its tensors are the buckets).
        passes_per_step: backward passes whose gradients add up before a sum.
        local_reduce: reduce inside each machine before pushing (default True).
        in_backward: synchronize at the end of the backward pass itself (an autograd
            callback queued by the first hook), as torch's DDP does; default False: the
            caller calls :meth:`synchronize` (BytePS: in ``optimizer.step()``).
        describe: logged with the placement by worker 0.
        compression: per bucket, how it is compressed between machines and servers
            (None: uncompressed; see :meth:`Engine.sums`).
        warmup: the first ``warmup`` steps of this object send the compressed buckets
            through keys of their own (1-bit Adam's warm-up; default 0), uncompressed or
            as ``warmup_compression`` says. Counted by :attr:`synced` (a resumed run
            sets it to carry on where the warm-up was).
        warmup_compression: per bucket, how the compressed buckets travel during the
            warm-up (as ``compression``; None: uncompressed, the default).
        averaging: declare uncompressed keys of their own for the compressed buckets, for
            :meth:`average` (1-bit Adam's variance refresh; default False).
        owner: what made it (``"DistributedOptimizer"``), named where a second sync over
            the same parameters is refused until this one is closed (default "wrapper").
    """

    def __init__(self, engine: Engine, named: Sequence[tuple[str, torch.nn.Parameter]],
                 buckets: Sequence[Bucket], placement: Placement, *, passes_per_step: int = 1,
                 local_reduce: bool = True, in_backward: bool = False,
                 describe: str = "",
                 compression: Sequence[CompressOptions | None] | None = None,
                 warmup: int = 0,
                 warmup_compression: Sequence[CompressOptions | None] | None = None,
                 averaging: bool = False, owner: str = "wrapper") -> None:
        # A second sync over a parameter would push its gradient from hooks of its own too.
        refuse_held(named)
        self.owner: str = owner
        self.engine = engine
        self.in_backward = in_backward
        self._queued = False
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        #: With the dtype and device their buckets are laid out for: a change is refused at
        #: the first gradient of a step, before anything leaves (:func:`check_as_wrapped`).
        self.as_wrapped = as_wrapped(named)
        self.buckets = list(buckets)
        self._local_reduce = local_reduce
        #: Where the flags of :attr:`keep_missing` are summed: with the last partition.
        self._flags_at = (placement.owners[-1] if placement.owners else None,
                          placement.handlers[-1] if placement.handlers else None)
        self._flags: SumTensor | None = None
        self._keep_missing = False
        self.passes_per_step = passes_per_step
        self.enabled = True  # False inside no_sync(): gradients only accumulate
        specs = bucket_specs(self.buckets, [TensorSpec.of(n, p) for n, p in named])
        self.tensors: Sequence[SumTensor] = engine.sums(specs, placement,
                                                        local_reduce=local_reduce,
                                                        describe=describe,
                                                        compression=compression)
        self.compression = list(compression or [None] * len(self.buckets))
        packed = [b for b, c in enumerate(self.compression) if c is not None]
        self.warmup = warmup if packed else 0
        #: During the warm-up, every bucket's sum: the compressed ones get keys of their own
        #: (plain, or packed by the warm-up's compressor, with its own error feedback).
        self._warming: Sequence[SumTensor] = self.tensors
        if self.warmup:
            warm = engine.sums([specs[b] for b in packed], _subset(placement, packed),
                               local_reduce=local_reduce,
                               compression=None if warmup_compression is None
                               else [warmup_compression[b] for b in packed])
            by_bucket = dict(zip(packed, warm))
            self._warming = [by_bucket.get(b, t) for b, t in enumerate(self.tensors)]
        #: The compressed buckets' indices and, with ``averaging``, their keys for average().
        self.packed = packed
        self._averaged: Sequence[SumTensor] = ()
        if averaging and packed:
            self._averaged = engine.sums([dataclasses.replace(specs[b], dtype=torch.float32)
                                          for b in packed], _subset(placement, packed),
                                         local_reduce=local_reduce)
        #: When set, what parameter i pushes instead of its gradient: ``transform(i, grad)``
        #: (1-bit Adam pushes the worker's momentum once the warm-up is over).
        self.transform: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self._bucket_of = {m: b for b, bucket in enumerate(self.buckets) for m in bucket.members}
        # A fused bucket gathers its members' gradients in one flat buffer as they come.
        self._buffers = [None if len(b.members) == 1 else torch.empty(
            b.numel, dtype=b.dtype, device=self.params[b.members[0]].device)
            for b in self.buckets]
        self._workers = engine.ctx.num_workers
        #: 16-bit buckets travel divided by the workers, so that their sum cannot overflow
        #: (the servers add in float32 but answer in the bucket's dtype); the rest divide
        #: the sum, in float32 where they are, as one process would.
        self._predivided = [travels_divided(b.dtype) for b in self.buckets]
        #: Synchronised, and no gradient has come since: ``.grad`` holds the average, and
        #: synchronize() has nothing to do (so Horovod's ``synchronize(); clip; step()``
        #: sums once).
        self.synchronized = False
        self._reset()
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        #: Every sum declared for this object (the flags' too, once declared): what close()
        #: and the finalizer let the engine forget.
        self._declared: list[SumTensor] = [*self.tensors, *self._warming, *self._averaged]
        # A sync dropped without close() (its wrapper deleted, torch's DDP having no close())
        # takes its hooks and its sums with it: each held a model-sized buffer for the run.
        self._let_go = weakref.finalize(self, _let_go, self._hooks, weakref.ref(engine),
                                        self._declared)
        hold(self.params, self)
        #: Per synchronised step: seconds from the first bucket's submit to the last sum's
        #: arrival (comm), and of that the part spent waiting in synchronize() (exposed).
        self.comm_s: list[float] = []
        self.exposed_s: list[float] = []
        self.synced = 0  # steps synchronised so far
        #: Whether the step synchronised last travelled compressed (past the warm-up): what
        #: the step after a user's synchronize() reads, once ``synced`` has counted it.
        self.synced_compressed = False

    @property
    def keep_missing(self) -> bool:
        """Leave ``.grad`` None where no worker had a gradient (an MoE expert no token
        chose, a branch no worker took: one process gives it none, and Adam would step on
        zeros). Off by default; on, a flag per parameter is summed each step, on a key of
        its own beside the gradients' (4 bytes a parameter each way, 8 past 46,339 workers,
        measured as theirs), sent as the last gradient comes in, ahead of buckets waiting
        for credit. The flags count the workers that froze a parameter too: one frozen on
        some workers only is refused at the synchronisation, naming it (the others would
        step it alone).
        Every worker sets it alike, at the same point: turning it on declares that key."""
        return self._keep_missing

    @keep_missing.setter
    def keep_missing(self, on: bool) -> None:
        owner, handler = self._flags_at
        if on and self._flags is None and owner is not None:
            spec = TensorSpec("gradients present", (len(self.params),),
                              flags_dtype(self._workers))
            parts = partition([spec], spec.nbytes)
            self._flags = self.engine.sums(
                [spec], Placement(parts, (owner,), None if handler is None else (handler,)),
                local_reduce=self._local_reduce)[0]
            self._declared.append(self._flags)
        self._keep_missing = on

    @property
    def holding(self) -> bool:
        """Whether its hooks push its parameters' gradients (:meth:`close` removes them)."""
        return bool(self._hooks)

    @property
    def compressing(self) -> bool:
        """Whether this step's compressed buckets travel as ``compression`` says (the warm-up
        is over)."""
        return self.synced >= self.warmup

    @property
    def backward_unfinished(self) -> bool:
        """A backward pass queued the synchronisation (``in_backward``) and it has not run:
        that backward is running now, or it raised after some gradients had left."""
        return self._queued

    @property
    def passes_done(self) -> int:
        """The backward passes of the step in progress counted so far (0 between steps)."""
        return max(self._passes, default=0)

    def _sums(self) -> Sequence[SumTensor]:
        return self.tensors if self.compressing else self._warming

    def _reset(self) -> None:
        self._passes = [0] * len(self.params)
        self._ready = [False] * len(self.params)
        self._unready = len(self.params)
        self._missing = [len(b.members) for b in self.buckets]
        self._first_submit: float | None = None
        self._queued = False
        self._checked = False  # check_as_wrapped at the step's first gradient
        #: Per parameter, the gradient handed to the engine and its version counter then
        #: (None: it had none, and zeros went): a change before synchronize() (clipping,
        #: unscaling) would be lost, and is refused.
        self._handed: list[tuple[torch.Tensor, int] | None] = [None] * len(self.params)
        #: Whether a backward inside no_sync() accumulated gradients since the last sum.
        self.unsynced = False

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        # By weak reference: the parameter holds its hooks, and a hook that held this object
        # kept a wrapper dropped without close() alive: its parameters were refused to a new wrap.
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            sync = ref()
            if sync is not None:
                sync._on_gradient(i)
        return hook

    def _on_gradient(self, i: int) -> None:
        """Parameter i's gradient accumulated (its hook): count the pass, and collect it
        once its passes for this step are in."""
        self.synchronized = False
        if not self.enabled:
            self.unsynced = True
            return
        if not self._checked:  # a float64 gradient pushed to a float32 key failed the engine
            check_as_wrapped(self.as_wrapped)
            self._checked = True
        if self.in_backward and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.synchronize)
        self._passes[i] += 1
        if self._passes[i] > self.passes_per_step:  # its sum left with the first ones
            raise ConfigError(
                f"{self.names[i]!r} had a gradient from {self._passes[i]} backward passes "
                f"before the step synchronised it, and {self.passes_per_step} "
                f"{'is' if self.passes_per_step == 1 else 'are'} summed: the sum left "
                f"with the first, and the others would be lost",
                "to accumulate over N backward passes, pass backward_passes_per_step=N "
                "(byteps.DistributedOptimizer); under distribute(), call "
                "optimizer.step() after each backward, or accumulate with strategy "
                "'ddp' or 'herring' (their no_sync())")
        if self._passes[i] == self.passes_per_step and not self._ready[i]:
            self._collect(i)

    @torch.no_grad()
    def _collect(self, i: int) -> None:
        """Parameter i's gradient is final for this step: submit its bucket once all are."""
        p = self.params[i]
        if p.grad is not None:
            self._handed[i] = (p.grad, p.grad._version)
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if grad.is_sparse:
            raise ConfigError(f"parameter {self.names[i]!r} has a sparse gradient (an "
                              f"nn.Embedding(sparse=True)), and the push/pull engine (byteps, "
                              f"herring) sums dense ones", "build it with sparse=False, or "
                              "train with strategy 'parallax' (its rows on servers) or 'ddp'")
        if self.transform is not None:
            grad = self.transform(i, grad)
        self._ready[i] = True
        self._unready -= 1
        b = self._bucket_of[i]
        bucket, buf = self.buckets[b], self._buffers[b]
        if buf is not None:
            off = bucket.offsets[bucket.members.index(i)]
            buf[off:off + p.numel()].copy_(grad.reshape(-1))
        self._missing[b] -= 1
        if self._missing[b] == 0:
            if self._first_submit is None:
                self._first_submit = time.perf_counter()
            flat = grad.reshape(-1) if buf is None else buf
            if self._predivided[b]:  # a 16-bit sum of W gradients can overflow: as torch's DDP
                flat = flat.div_(self._workers) if buf is not None else flat.div(self._workers)
            self.engine.submit(self._sums()[b], flat)
        if not self._unready and self.keep_missing and self._flags is not None:
            # Every gradient is in: the flags leave now, ahead of the buckets still waiting
            # for credit (priority), so that their round trip rides with those buckets'.
            # Per parameter: whether it had a gradient, whether it is frozen here.
            self.engine.submit(self._flags, presence_flags(
                [h is not None for h in self._handed],
                [not p.requires_grad for p in self.params], self._workers,
                self.params[0].device), priority=1)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Wait for every bucket's sum and leave the average over workers in ``.grad``.

        Nothing to do where no gradient came since the last call (``.grad`` holds the
        average). A gradient changed in place or replaced after backward handed it over
        (clipped, unscaled by a ``GradScaler``) is refused, naming it: its sum left
        without the change, so change gradients after this call, not before."""
        if self.synchronized:
            return
        waited = time.perf_counter()
        for i in range(len(self.params)):
            if not self._ready[i]:
                self._collect(i)
        self._check_unchanged()
        assert self._first_submit is not None or not self.buckets
        flags = self._flags if self.keep_missing else None  # submitted by the last _collect
        for bucket, t, divided in zip(self.buckets, self._sums(), self._predivided):
            total = self.engine.wait(t)
            for m, off in zip(bucket.members, bucket.offsets):
                p = self.params[m]
                if p.grad is None and not p.requires_grad:
                    continue  # frozen since (requires_grad_(False)): as one process, no .grad
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(total[off:off + p.numel()].view(p.shape))
                if not divided:
                    p.grad.div_(self._workers)
        # Per parameter, how many workers froze it and how many had a gradient (the flags).
        came = [] if flags is None else read_presence(self.engine.wait(flags), self._workers)
        done = time.perf_counter()
        if self._first_submit is not None:
            self.comm_s.append(done - self._first_submit)
            self.exposed_s.append(done - waited)
        for p, (_, had) in zip(self.params, came):
            if had == 0:
                p.grad = None
        self.synced_compressed = self.compressing
        self.synced += 1
        self._reset()
        split = [(name, frozen) for name, (frozen, _) in zip(self.names, came)
                 if 0 < frozen < self._workers]
        if split:  # every worker reads the same sums: each raises here
            name, frozen = split[0]
            raise ConfigError(
                f"parameter {name!r} is frozen (requires_grad False) on {frozen} of the "
                f"{self._workers} workers and trains on the others: they would step it and the "
                f"rest would not, and the workers' copies would drift apart",
                "freeze it on every worker at the same step, or on none")
        self.synchronized = True

    def _check_unchanged(self) -> None:
        for i, handed in enumerate(self._handed):
            how = None if handed is None else gradient_change(self.params[i], handed)
            if how is None:
                continue
            for t in [*self._sums(), *([self._flags] if self._flags is not None else [])]:
                if t.busy:  # leave the engine idle: every sum is waited for
                    self.engine.wait(t)
            self._reset()
            raise ConfigError(
                f"the gradient of {self.names[i]!r} {how} between backward() and the step's "
                f"synchronisation (gradient clipping, or a GradScaler's unscale_?): its sum "
                f"had left with the gradient backward made, and the change would be lost",
                "call optimizer.synchronize() first, then change the gradients, then "
                "optimizer.step() (it uses the synchronised gradients; Horovod's "
                "'with optimizer.skip_synchronize():' works too)")

    @torch.no_grad()
    def average(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The mean over every worker of one flat float32 tensor per compressed bucket (in the
        order of :attr:`packed`), summed exactly on the keys ``averaging`` declared. Every
        worker calls it at the same step, between steps."""
        if len(values) != len(self._averaged):
            raise ValueError(f"average() takes one tensor per compressed bucket "
                             f"({len(self._averaged)}; made with averaging=True), got "
                             f"{len(values)}")
        for t, v in zip(self._averaged, values):
            self.engine.submit(t, v)
        return [self.engine.wait(t).div(self._workers) for t in self._averaged]

    def hidden_fraction(self, skip: int = 1) -> float | None:
        """The share of communication time that backward hid, over the steps after ``skip``:
        1 - exposed / comm (None before any step)."""
        comm, exposed = sum(self.comm_s[skip:]), sum(self.exposed_s[skip:])
        return None if comm <= 0 else max(0.0, 1.0 - exposed / comm)

    def close(self) -> None:
        """Remove the gradient hooks, and let the engine drop this object's sums (each with
        a bucket-sized CPU result) at the next wrap: a model closed and wrapped again held
        both."""
        self._let_go()
        self._hooks = []
        let_go_of(self.params, self)


def _open_holder(param: torch.Tensor) -> Holder | None:
    """The open holder that pushes ``param``, if one does."""
    ref, held = _holders.get(id(param), (None, None))
    other = held() if held is not None and ref is not None and ref() is param else None
    return other if other is not None and other.holding else None


def _let_go(hooks: Sequence[RemovableHandle], engine: weakref.ref[Engine],
            declared: Sequence[SumTensor]) -> None:
    """Remove a sync's ``hooks`` and let ``engine`` (if alive) forget its sums ``declared``:
    at its close(), or when it is dropped without one (once: a finalizer)."""
    for h in hooks:
        h.remove()
    forget_if_alive(engine, declared)


def _subset(placement: Placement, tensors: Sequence[int]) -> Placement:
    """The partitions of ``tensors`` only, renumbered as tensors 0, 1, ... in that order."""
    new = {t: i for i, t in enumerate(tensors)}
    keep = [i for i, p in enumerate(placement.partitions) if p.tensor in new]
    return Placement(tuple(dataclasses.replace(placement.partitions[i],
                                               tensor=new[placement.partitions[i].tensor])
                           for i in keep),
                     tuple(placement.owners[i] for i in keep),
                     None if placement.handlers is None
                     else tuple(placement.handlers[i] for i in keep))
