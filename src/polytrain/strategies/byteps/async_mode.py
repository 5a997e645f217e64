"""Asynchronous BytePS: servers hold the parameters; workers push updates and pull, unbarriered.

Each step a worker runs its own optimizer on its own gradient, pushes the
update ``(new - old) / workers`` of every partition to the partition's owner
and pulls the owner's value as of its step: every push of steps up to its own
that has arrived, none of a later step. A parameter store's clock counts each
worker's pushes; a pull of step c waits until the slowest worker has pushed
step c - staleness (bounded staleness; the reference had no bound). With
staleness 0 every pull waits for every worker's push of that step, so the
pulled parameters are ``w + sum_i (new_i - w) / workers``; for plain SGD that
is the synchronous step ``w - lr * mean_i g_i`` up to float32 rounding, not
bitwise (each update is rounded before the servers add it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from ...comm.partition import DEFAULT_PARTITION_BYTES, TensorSpec
from ...errors import ConfigError, at_least
from ...ps.client import Pending
from ...ps.compression import ASYNC_COMPRESSORS, DEFAULT_MIN_BYTES, Codec, codec_states_fit
from ...ps.engine import Engine
from ...ps.grads import as_wrapped, check_as_wrapped, hold, let_go_of, refuse_held
from ...ps.protocol import Kind
from ...tensors import host_copy
from .optimizer import (
    Choice,
    WrappedOptimizer,
    check_passes,
    check_unfrozen,
    named_params_of,
    tensor_compression,
)
from .plan import plan_for

__all__ = ["AsyncOptimizer", "check_async_passes"]

log = logging.getLogger(__name__)


def check_async_passes(passes: int) -> None:
    """Refuse ``backward_passes_per_step`` other than 1: each step pushes its own update."""
    check_passes(passes)
    if passes != 1:
        raise ConfigError(f"asynchronous BytePS pushes each step's update; "
                          f"backward_passes_per_step {passes} does not apply",
                          "leave backward_passes_per_step at 1 with async_=True")


class AsyncOptimizer(WrappedOptimizer):
    """Wraps any torch optimizer for asynchronous training against parameter servers.

    Example::

        opt = AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), engine=engine,
                             named_parameters=model.named_parameters(), staleness=2)
        loss_fn(model(x), y).backward()
        opt.step()                # local update, push it, pull the servers' parameters

    The servers take worker 0's parameters at the first ``step()``, so a checkpoint
    loaded (and broadcast) after wrapping is the one trained, as in BytePS's scripts.

    Args:
        optimizer: the worker's own optimizer (its update is what gets pushed).
        engine: this run's engine (keys, declarations, pushes and pulls).
        named_parameters: names in model order (earlier layers are pushed first).
        staleness: steps a worker may be ahead of the slowest (0: synchronous).
        partition_bytes, colocate: the placement's (Theorem 1, as the synchronous mode).
        compression: per tensor, how its updates are pushed (None: exact); only the
            compressors in ``ASYNC_COMPRESSORS`` (fp16): the pulls are parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, engine: Engine,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 staleness: int = 0, partition_bytes: int = DEFAULT_PARTITION_BYTES,
                 colocate: bool = True, compression: Choice | Mapping[str, Choice] = None,
                 error_feedback: bool = False, compress_min_bytes: int = DEFAULT_MIN_BYTES,
                 compress_momentum: float = 0.0) -> None:
        named, self._frozen = named_params_of(optimizer, named_parameters)
        refuse_held(named)  # another optimizer's pushes of them would mix with these
        specs = [TensorSpec.of(n, p) for n, p in named]
        per_tensor = tensor_compression(specs, compression, error_feedback=error_feedback,
                                        momentum=compress_momentum,
                                        min_bytes=compress_min_bytes)
        for c in per_tensor:
            if c is not None and c.compressor.name not in ASYNC_COMPRESSORS:
                raise ConfigError(f"asynchronous BytePS cannot push {c.compressor} updates: it "
                                  f"pulls parameters, which only {', '.join(ASYNC_COMPRESSORS)} "
                                  f"keeps (see --compress)", "use fp16, or synchronous BytePS")
        at_least("staleness", staleness, "pass 0 or more", minimum=0)
        super().__init__(optimizer)
        self.ctx = engine.ctx
        self.engine = engine
        self.staleness = staleness
        self._params = [p for _, p in named]
        #: With the dtype and device that their keys and pulls are laid out for.
        self._as_wrapped = as_wrapped(named)
        self.plan = plan_for(self.ctx.topology, specs, partition_bytes=partition_bytes,
                             colocate=colocate)
        self.placement = engine.keyed(specs, self.plan.placement)
        self.clock = 0
        # The clock at the servers' last SET (install), from which they count rounds afresh,
        # or a resumed run's saved clock: the wire carries ``clock - base``.
        self.base = 0
        self._pulled = [torch.empty(p.numel(), dtype=p.dtype) for p in self._params]
        # Per partition: its codec (half-precision pushes, with their own error feedback
        # where ``error_feedback`` asks for it).
        self._codecs = [Codec(c, p.numel, seed=p.key) if (c := per_tensor[p.tensor]) else None
                        for p in self.placement.partitions]
        # The servers take worker 0's parameters at the first step, not here: BytePS scripts
        # wrap first, then load a checkpoint on rank 0 and broadcast it.
        self.installed = False
        self.engine.declare(self.placement, kind=Kind.PARAM, pushers=self.ctx.num_workers,
                            pullers=self.ctx.num_workers, options={"staleness": staleness})
        #: Whether :meth:`close` let go of the parameters (a step is refused from then on).
        self.closed = False
        self.owner = "DistributedOptimizer (async_=True)"
        hold(self._params, self)
        log.info("asynchronous byteps, staleness %d:\n%s", staleness, self.plan.describe())

    def install(self) -> None:
        """Worker 0 sets the servers' parameters to its own (collective over the workers):
        before the first step (or pull), so that the weights trained are the ones the
        workers hold then, and when :func:`polytrain.load` loads a checkpoint (mid-run too:
        the SET restarts every pusher's rounds at 1, so the rounds count from here)."""
        ctx, engine, placement = self.ctx, self.engine, self.placement
        if ctx.worker_index == 0:
            flats = [p.detach().reshape(-1).cpu() for p in self._params]
            parts = placement.partitions
            sets = [engine.set(placement, i, flats[p.tensor][p.offset:p.offset + p.numel])
                    for i, p in enumerate(parts)]
            # A GET is answered after the SET before it (same key, same engine thread), so
            # once every GET is back the servers hold worker 0's parameters.
            gets = [engine.get(placement, i, torch.empty(p.numel, dtype=p.dtype))
                    for i, p in enumerate(parts)]
            for pending in sets + gets:
                pending.wait()
        dist.barrier(group=ctx.groups.workers)
        self.installed = True
        self.base = self.clock

    def install_once(self) -> None:
        """:meth:`install`, unless the servers hold the parameters already (collective the
        first time)."""
        if not self.installed:
            self.install()

    def synchronize(self) -> None:
        """Nothing to wait for: asynchronous workers step on their own gradients (``.grad``
        stays local; the update is what travels), so BytePS's ``synchronize(); clip;
        step()`` clips this worker's gradients."""
        check_unfrozen(self._frozen)
        check_as_wrapped(self._as_wrapped)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """BytePS's: only 1 here (each step pushes its update)."""
        check_async_passes(passes)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """BytePS's: ``step()`` inside it runs as outside it (no gradient is summed)."""
        yield

    @property
    def holding(self) -> bool:
        """Whether its steps push its parameters (until :meth:`close`)."""
        return not self.closed

    def close(self) -> None:
        """Let go of the parameters (another optimizer may wrap them); :meth:`step` is
        refused from then on."""
        self.closed = True
        let_go_of(self._params, self)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if self.closed:
            raise ConfigError("this byteps DistributedOptimizer (async_=True) was closed, "
                              "releasing its parameters (another optimizer may hold them "
                              "now): a step now would push this worker's update beside that "
                              "one's", "close() the optimizer after its last step")
        check_unfrozen(self._frozen)  # before any push: its update would stay local
        check_as_wrapped(self._as_wrapped)  # before any push: the keys hold the wrap's dtype
        self.install_once()
        old = [host_copy(p.reshape(-1)) for p in self._params]
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.clock += 1
        pushes: list[Pending] = []
        for i, part in enumerate(self.placement.partitions):  # key order: earlier layers first
            lo, n = part.offset, part.numel
            new = self._params[part.tensor].detach().reshape(-1)[lo:lo + n].to("cpu")
            delta = (new - old[part.tensor][lo:lo + n]).div_(self.ctx.num_workers)
            codec = self._codecs[i]
            if codec is not None:  # fp16 only: the payload is the update in half precision
                delta = codec.encode(delta).view(torch.float16)
            pushes.append(self.engine.push(self.placement, i, round=self.clock - self.base,
                                           tensor=delta))
        self._pull(self.clock - self.base, pushes)
        return loss

    def _pull(self, round_: int, before: list[Pending]) -> None:
        pulls = [self.engine.pull(self.placement, i, round=round_, out=self._pulled[
                     part.tensor][part.offset:part.offset + part.numel])
                 for i, part in enumerate(self.placement.partitions)]
        for pending in before + pulls:
            pending.wait()
        for p, value in zip(self._params, self._pulled):
            p.detach().copy_(value.view(p.shape))

    def peek_final(self) -> dict[int, torch.Tensor]:
        """The servers' parameters once every worker has pushed as many steps as this one,
        by ``id`` of this worker's parameter, leaving its own copy as it is (an evaluation
        must not change the training)."""
        self.install_once()
        out = [torch.empty(p.numel(), dtype=p.dtype) for p in self._params]
        Pending.all([self.engine.pull(self.placement, i, round=self.clock - self.base
                                      + self.staleness,
                                      out=out[part.tensor][part.offset:part.offset + part.numel])
                     for i, part in enumerate(self.placement.partitions)]).wait()
        return {id(p): v.view(p.shape) for p, v in zip(self._params, out)}

    def pull_final(self) -> None:
        """Load the servers' parameters once every worker has pushed as many steps as this one."""
        self.install_once()
        self._pull(self.clock - self.base + self.staleness, [])

    def resume_at(self, clock: int) -> None:
        """Continue from a checkpoint's clock, once its weights are installed (the servers
        count rounds afresh from their SET)."""
        self.clock = self.base = clock

    def carried(self) -> dict[str, Any]:
        """For a checkpoint: the clock, and by key the state of this worker's codecs (fp16's
        error feedback and momentum)."""
        return {"clock": self.clock, "codecs": {p.key: c.state() for p, c in zip(
            self.placement.partitions, self._codecs) if c is not None}}

    def carry_on(self, state: Mapping[str, Any]) -> bool:
        """Go on from :meth:`carried` (before the first step). False, with only the clock
        restored, where the saved codecs do not fit this run's partitions."""
        self.resume_at(int(state["clock"]))
        saved = state.get("codecs")
        ours = {p.key: c for p, c in zip(self.placement.partitions, self._codecs)
                if c is not None}
        fits = saved is not None and codec_states_fit(saved, ours)
        if fits:
            assert saved is not None
            for k, c in ours.items():
                c.load_state(saved[k])
        return fits

    def __repr__(self) -> str:
        return f"byteps.AsyncOptimizer({self.optimizer!r}, staleness={self.staleness})"
