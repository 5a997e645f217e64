"""Wave Synchronous Parallel, a stage's side: push a wave's update, pull the global weights.

The servers hold the model. By default (``optimizer`` given) they hold it in
optimizer stores (``ps.OptimizerStore``): a stage pushes each minibatch's
gradient, with the settings (``lr``, ...) its update used, a wave's in one
message per key, and once every virtual worker has pushed its t-th the
servers' optimizer takes one step with their sum under those settings, so the global
weights follow the optimizer of synchronous training on the global batch,
staleness aside. Otherwise (the paper) they hold it in parameter stores
(``ps.ParamStore``): a stage pushes each wave's summed update (computed by its
own optimizer) and the servers add it. Either way a PULL of wave ``c`` is
answered once every virtual worker is at least at ``c - D``. Keys are the
partitions of the whole model's parameters (or of buckets of them: HetPipe
fuses a layer's parameters of one group), placed by the caller
(:func:`model_placement`), so virtual workers cut differently still agree on
them; each key's pushers are the stages (one per virtual worker) that hold
its tensor. Declarations, pushes and pulls go through the run's engine
(:mod:`polytrain.ps.engine`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection, Sequence

import torch
import torch.distributed as dist

from ..comm.bucket import buckets_of, flatten, unflatten_into
from ..comm.partition import DEFAULT_PARTITION_BYTES, Partition, TensorSpec, partition
from ..errors import ConfigError
from ..ps.client import Pending
from ..ps.engine import engine_for
from ..ps.placement import Placement, balanced
from ..ps.protocol import Kind
from ..ps.settings import round_pieces, round_settings
from ..ps.stores import WHOLE_STATE, optimizer_state_numel, pack_counts, state_layout, unpack_counts
from ..runtime import Context
from ..tensors import host_copy

__all__ = ["WaveSync", "model_placement"]

log = logging.getLogger(__name__)


def model_placement(ctx: Context, specs: Sequence[TensorSpec]) -> Placement:
    """The servers' keys for a whole model (``specs`` in model order): its partitions spread
    over every server by bytes, with fresh keys of the run. Every stage of every virtual
    worker uses the one placement its process made (all processes make it alike)."""
    parts = partition(list(specs), DEFAULT_PARTITION_BYTES)
    return engine_for(ctx).keyed(specs, balanced(parts, ctx.topology.servers))


class WaveSync:
    """One stage's parameters on the servers, its own updates they lack, and its clock.

    Example::

        wsp = WaveSync(ctx, model_placement(ctx, specs), mine={7: 2, ...}, tensors=params,
                       virtual_workers=2, staleness=1, inflight=2,
                       optimizer=[optimizer_spec(opt)])
        wsp.start(initialise=(vw == 0))
        wsp.step(delta, grads, scale=0.5)  # after each local update
        wsp.end_wave(); wsp.pull()         # end of a wave: clock += 1, pull posted
        wsp.install(params)                # before the next forward: global + own newer

    Args:
        ctx: the run.
        placement: the keys of every parameter tensor of the whole model, in model order
            (with ``buckets``: every bucket, each a flat tensor): :func:`model_placement`.
        mine: tensor index in ``placement`` -> index in ``tensors`` (or ``buckets``) of
            what this stage holds.
        tensors: this stage's live parameters.
        virtual_workers: how many push every key (one stage per virtual worker).
        staleness: D, the most clocks a virtual worker may run ahead of the slowest.
        inflight: N_m, minibatches per wave.
        optimizer: the servers' optimizer, one :func:`ps.settings.optimizer_spec` per
            parameter group of the stage's optimizer; None: the
            servers add the updates the stages push (the paper).
        groups: the group of each of ``tensors`` (default: all in group 0).
        lane: which of this process's stages pushes (policy bd: a process runs stages of
            two virtual workers, which may hold the same keys; default 0).
        buckets: ``tensors`` fused into flat buckets (lists of indices into ``tensors``),
            each pushed and pulled as one tensor: fewer, larger requests (default: each
            tensor alone). ``groups`` then gives each bucket's group.
        late, lag: with the servers' optimizer, the tensors of ``placement`` (indices) whose
            rounds the servers step with the settings ``lag`` changes in place (a late
            stage's: HetPipe's ``--lag-lr``): every virtual worker pushes a key with the
            same settings, where virtual workers cut differently lag different stages.
    """

    def __init__(self, ctx: Context, placement: Placement, mine: dict[int, int],
                 tensors: Sequence[torch.Tensor], *, virtual_workers: int,
                 staleness: int, inflight: int = 1,
                 optimizer: Sequence[dict[str, Any]] | None = None,
                 groups: Sequence[int] | None = None, lane: int = 0,
                 buckets: Sequence[Sequence[int]] | None = None,
                 late: Collection[int] = (),
                 lag: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.ctx = ctx
        self.lane = lane
        self.params = list(tensors)
        self.buckets = buckets_of([TensorSpec.of(str(i), t) for i, t in enumerate(self.params)],
                                  buckets if buckets is not None else
                                  [[i] for i in range(len(self.params))])
        tensors = self._flat(self.params)
        self.engine = engine_for(ctx)
        self.staleness = staleness
        self.virtual_workers = virtual_workers
        self.inflight = inflight
        self.optimizer = None if optimizer is None else list(optimizer)
        self.tensors = list(tensors)
        self.groups = list(groups) if groups is not None else [0] * len(self.tensors)
        if optimizer is not None:
            odd = sorted({str(t.dtype) for t in self.tensors
                          if t.dtype not in (torch.float32, torch.float64)})
            if odd:
                raise ConfigError(f"the servers' optimizer steps float32 or float64 "
                                  f"parameters, but this stage has {', '.join(odd)} ones",
                                  "keep a float32 master copy of the weights, or keep the "
                                  "optimizer on the workers")
        self.placement = placement
        self.mine = [(i, p) for i, p in enumerate(placement.partitions) if p.tensor in mine]
        self._local = {p.tensor: mine[p.tensor] for _, p in self.mine}
        self._lag = lag
        # Per key of mine: 1 where the servers step it with the late settings.
        self._late = [int(lag is not None and p.tensor in late) for _, p in self.mine]
        papers = optimizer is None  # the buffers of one mode only: they hold weights' sizes
        self.pulled = [torch.empty_like(t, device="cpu") for t in self.tensors if papers]
        # An optimizer store answers its value and the rounds (minibatches) it holds.
        self.answers = [torch.empty(p.numel + 1, dtype=p.dtype) for _, p in self.mine
                        if not papers]
        self.clock = 0   # waves ended
        self.slots = 0   # minibatches pushed (optimizer stores)
        # Own updates the servers may lack: since the last push (parameter stores), or
        # per minibatch until the servers have applied it (optimizer stores).
        self.wave_update = [torch.zeros_like(t) for t in self.tensors if papers]
        self.since_push = [torch.zeros_like(t) for t in self.tensors if papers]
        self.history: list[tuple[int, list[torch.Tensor]]] = []
        self.wave_grads: list[list[torch.Tensor]] = []  # this wave's, to push at its end
        # And per minibatch their settings: per group, as given and as a late stage's.
        self.wave_settings: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._pull: Pending | None = None
        self._pushes: Pending | None = None

    def _flat(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-tensor values as per-bucket flat copies."""
        plain = [t.detach() for t in tensors]
        return [flatten(b, plain) for b in self.buckets]

    def _scatter(self, flat: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
        """Write per-bucket values back into the tensors."""
        plain = [t.detach() for t in tensors]
        for b, values in zip(self.buckets, flat):
            unflatten_into(b, values, plain)

    def _slice(self, tensors: Sequence[torch.Tensor], p: Partition) -> torch.Tensor:
        flat = tensors[self._local[p.tensor]].detach().reshape(-1)
        return flat[p.offset:p.offset + p.numel]

    def start(self, *, initialise: bool, states: Sequence[torch.Tensor] | None = None,
              optimizer_state: Sequence[dict[str, Any]] | None = None) -> None:
        """Declare this stage's keys; the first virtual worker writes the initial weights,
        or with ``states`` (:meth:`server_states` of a checkpoint) the servers' whole state.
        With the servers' optimizer, ``optimizer_state`` (per tensor of this stage: the
        state the user's optimizer held for it at ``distribute``, as a torch optimizer's
        ``state[param]``; empty where none) goes to the servers with the initial weights, so
        their optimizer goes on from a script's steps before ``distribute``, as one process
        does.

        Ends with a barrier of all workers, so nobody pushes before the weights are set.
        """
        engine, placement = self.engine, self.placement
        options: dict[str, Any]
        for i, p in self.mine:
            if self.optimizer is None:
                kind, options = Kind.PARAM, {"staleness": self.staleness}
            else:  # rounds are minibatches
                spec = self.optimizer[self.groups[self._local[p.tensor]]]
                kind, options = Kind.OPTIM, {"staleness": self.staleness * self.inflight,
                                             "optimizer": spec}
            engine.declare(placement, kind=kind, pushers=self.virtual_workers,
                           pullers=self.virtual_workers, options=options, only=[i])
        if initialise and states is not None:
            if self.optimizer is None or len(states) != len(self.mine):
                raise ConfigError(f"the checkpoint holds the servers' state of "
                                  f"{len(states)} keys for this stage, which has "
                                  f"{len(self.mine)} optimizer keys",
                                  "resume with the checkpoint's layout and options")
            for (i, _), state in zip(self.mine, states):
                # The stages count minibatches afresh: the rounds applied restart at 0.
                state = state.clone()
                state[-1] = 0
                engine.set(placement, i, state).wait()
        elif initialise:
            cpu = [t.cpu() for t in self._flat(self.params)]
            held = self._held_state(optimizer_state)
            for i, p in self.mine:
                engine.set(placement, i, self._slice(cpu, p) if held is None
                           else self._whole_state(cpu, held, p)).wait()
            # A GET is answered after the SET before it (same key, same server thread).
            for (i, _), out in zip(self.mine, self._outs()):
                engine.get(placement, i, out).wait()
        dist.barrier(group=self.ctx.groups.workers)

    def _held_state(self, optimizer_state: Sequence[dict[str, Any]] | None
                    ) -> list[dict[str, Any]] | None:
        """``optimizer_state`` for the servers' optimizer, or None where it holds nothing."""
        if self.optimizer is None or optimizer_state is None or not any(optimizer_state):
            return None
        if len(optimizer_state) != len(self.params):
            raise ValueError(f"optimizer_state for {len(optimizer_state)} tensors, the stage "
                             f"has {len(self.params)}")
        return list(optimizer_state)

    def _whole_state(self, cpu: Sequence[torch.Tensor], held: Sequence[dict[str, Any]],
                     p: Partition) -> torch.Tensor:
        """Key ``p``'s whole state (as :meth:`server_states` reads it) from the weights
        ``cpu`` (per bucket, flat) and the state ``held`` per tensor, its rounds at 0."""
        bucket = self.buckets[self._local[p.tensor]]
        spec = self.optimizer[self.groups[self._local[p.tensor]]]  # type: ignore[index]
        value = self._slice(cpu, p)
        parts = [value]
        for name, per, _ in state_layout(spec):
            values = [held[m].get(name) for m in bucket.members]
            if per:
                flat = torch.cat([torch.zeros(self.params[m].numel(), dtype=value.dtype)
                                  if v is None else v.detach().reshape(-1).cpu().to(value.dtype)
                                  for m, v in zip(bucket.members, values)])
                parts.append(flat[p.offset:p.offset + p.numel])
                continue
            # One number for the key (Adam's step): its tensors' must agree.
            numbers = {float(v) if v is not None else 0.0 for v in values}
            if len(numbers) > 1:
                raise ConfigError(f"the optimizer's {name!r} differs between tensors the "
                                  f"servers step as one key ({sorted(numbers)}): the "
                                  f"servers' optimizer keeps one per layer and group",
                                  "call polytrain.distribute before the script's own steps, "
                                  "or keep the optimizer on the stages "
                                  "(server_optimizer=False)")
            parts.append(torch.tensor([numbers.pop()], dtype=value.dtype))
        parts.append(pack_counts([0], value.dtype))  # rounds applied: none yet
        return torch.cat(parts)

    def server_states(self) -> list[torch.Tensor]:
        """The whole state of this stage's optimizer stores (value, the optimizer's state,
        rounds applied), read at once: call it when every push is applied (after a drain)."""
        assert self.optimizer is not None
        outs = [torch.empty(optimizer_state_numel(
            self.optimizer[self.groups[self._local[p.tensor]]], p.numel), dtype=p.dtype)
            for _, p in self.mine]
        Pending.all([self.engine.get(self.placement, i, out, round=WHOLE_STATE)
                     for (i, _), out in zip(self.mine, outs)]).wait()
        return outs

    @property
    def synchronous(self) -> bool:
        """The servers run the optimizer, D = 0 and N_m = 1: every pull holds the stage's
        last minibatch, so the stage needs no update of its own (see :meth:`step`)."""
        return self.optimizer is not None and self.staleness == 0 and self.inflight == 1

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor] | None, grads: Sequence[torch.Tensor | None],
             *, scale: float, settings: Sequence[dict[str, Any]] | None = None) -> None:
        """A local update was applied: ``delta`` (scaled) from ``grads`` (not scaled); None:
        none was (allowed when :attr:`synchronous`).

        With the servers' optimizer the gradients, times ``scale``, are kept for the
        wave's push as this stage's next minibatch, with ``settings`` (each group's
        settings as the user's optimizer had them for it, changed by ``lag`` for the
        ``late`` keys; default: the ones declared) for the servers' step.
        """
        if delta is None and not self.synchronous:
            raise ValueError("only a synchronous stage (the servers' optimizer, D = 0, "
                             "N_m = 1) may skip its own update")
        if self.optimizer is None:
            assert delta is not None
            flat = self._flat(delta)
            if flat:  # (a stage of parameter-free layers has none)
                torch._foreach_add_(self.wave_update, flat)
                torch._foreach_add_(self.since_push, flat)
            return
        self.slots += 1
        if delta is not None:
            self.history.append((self.slots, self._flat(delta)))
        optimizer = self.optimizer
        given = [dict(settings[g] if settings is not None else spec["settings"])
                 for g, spec in enumerate(optimizer)]

        def rounded() -> list[torch.Tensor]:
            return [torch.tensor(round_settings(spec, values), dtype=torch.float64)
                    for spec, values in zip(optimizer, given)]
        plain = lagged = rounded()
        if any(self._late):
            assert self._lag is not None
            for values in given:
                self._lag(values)
            lagged = rounded()
        self.wave_settings.append((plain, lagged))
        self.wave_grads.append(self._flat([
            torch.zeros(t.shape, dtype=t.dtype) if g is None else (g.detach() * scale).to("cpu")
            for t, g in zip(self.params, grads)]))

    def end_wave(self) -> None:
        """End a wave: this stage's clock advances by one and it pushes the wave: its summed
        update (the paper), or each minibatch's gradient, all of a key's in one message."""
        self.clock += 1
        if self.optimizer is None:
            if self._pull is not None:
                # A pull older than this push was never installed: it is superseded.
                self._pull.wait()
                self._pull = None
            # A copy: the buffers are reused while the sends are in flight.
            cpu = [host_copy(u) for u in self.wave_update]
            rnd, payloads = self.clock, [self._slice(cpu, p) for _, p in self.mine]
            for w, s in zip(self.wave_update, self.since_push):
                w.zero_()
                s.zero_()
        elif self.wave_grads:  # rounds are minibatches: this wave's first, then the others
            rnd = self.slots - len(self.wave_grads) + 1
            payloads = [torch.cat([
                piece for g, values in zip(self.wave_grads, self.wave_settings)
                for piece in round_pieces(self._slice(g, p),
                                          values[late][self.groups[self._local[p.tensor]]])])
                for (_, p), late in zip(self.mine, self._late)]
            self.wave_grads, self.wave_settings = [], []
        else:
            return
        if self._pushes is not None:
            self._pushes.wait()
        self._pushes = Pending.all([
            self.engine.push(self.placement, i, round=rnd, tensor=payload, lane=self.lane)
            for (i, _), payload in zip(self.mine, payloads)])

    def pull(self, *, ahead: int = 0, final: bool = False) -> None:
        """Post the pull of the global weights (answered later, see :meth:`install`).

        The servers answer the pull of wave ``clock + ahead`` once every virtual
        worker has ended ``clock + ahead - D`` waves; a ``final`` pull waits for
        everyone's last minibatch.
        """
        if self._pull is not None:
            self._pull.wait()
        if ahead > self.staleness:
            raise ValueError(f"a pull {ahead} clocks ahead would wait for this stage's own "
                             f"future pushes (D = {self.staleness})")
        if self.optimizer is None:
            rnd = self.clock + (self.staleness if final else ahead)
        elif final:  # rounds are minibatches
            rnd = self.slots + self.staleness * self.inflight
        else:  # from the rounds pushed, not the clock: a drain may have ended a short wave
            rnd = self.slots + ahead * self.inflight
        self._pull = Pending.all([
            self.engine.pull(self.placement, i, round=rnd, out=out)
            for (i, _), out in zip(self.mine, self._outs())])

    def _outs(self) -> list[torch.Tensor]:
        """Where the answers for this stage's keys land."""
        if self.optimizer is None:
            return [self._slice(self.pulled, p) for _, p in self.mine]
        return self.answers

    @property
    def pending(self) -> bool:
        return self._pull is not None

    @torch.no_grad()
    def install(self, params: Sequence[torch.Tensor]) -> None:
        """Wait for the pull; the weights become the global ones plus this stage's own
        updates they do not hold yet."""
        assert self._pull is not None
        if self._pushes is not None:
            self._pushes.wait()
        self._pull.wait()
        self._pull = None
        flat = self._flat(params)
        if self.optimizer is None:
            for p, g, own in zip(flat, self.pulled, self.since_push):
                p.copy_(g.to(p.device))
                p.add_(own)
            self._scatter(flat, params)
            return
        oldest = self.slots
        for (_, part), answer in zip(self.mine, self.answers):
            [applied] = unpack_counts(answer[-1:])
            oldest = min(oldest, applied)
            view = self._slice(flat, part)
            view.copy_(answer[:-1].to(view.device))
            for slot, delta in self.history:
                if slot > applied:
                    view.add_(self._slice(delta, part))
        self._scatter(flat, params)
        self.history = [(slot, d) for slot, d in self.history if slot > oldest]
