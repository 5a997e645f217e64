"""HetPipe's pipeline in one stage: N_m in flight, an update per minibatch, stashed weights."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from ..ps.settings import is_numeric_setting
from .predict import predict_weights
from .stage import Stage
from .wsp import WaveSync

__all__ = ["AsyncPipeline", "numeric_settings", "stage_lag", "lag_settings"]

log = logging.getLogger(__name__)


def numeric_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's numeric settings (``lr``, ``betas``, ...: what a schedule changes)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in group.items() if k != "params" and is_numeric_setting(v)}


def stage_lag(inflight: int, index: int) -> int:
    """How many updates late stage ``index``'s gradients arrive with N_m = ``inflight``
    (its backward of a minibatch comes after ``max(1, N_m - index)`` forwards)."""
    return max(1, inflight - index) - 1


def lag_settings(settings: dict[str, Any], lr_factor: float, beta2: float | None) -> None:
    """A late stage's changes to a group's settings, in place: its learning rate times
    ``lr_factor`` and, with Adam's ``betas``, ``beta2`` as its second-moment decay."""
    if lr_factor != 1.0:
        settings["lr"] = settings["lr"] * lr_factor
    if beta2 is not None and isinstance(settings.get("betas"), (tuple, list)):
        settings["betas"] = (settings["betas"][0], beta2)


class AsyncPipeline:
    """One stage of a virtual worker running HetPipe's asynchronous schedule.

    Minibatches are fed one per :meth:`feed`; stage ``j`` keeps at most
    ``max(1, N_m - j)`` in flight (see :func:`schedule.asynchronous`), so a feed
    runs this minibatch's forward and then the backward that the schedule puts
    next. Each backward's gradients are applied at once by the stage's own
    optimizer (no flush); a forward uses the weights current when it starts,
    and its backward the same ones (weight stashing: a copy is kept while a
    minibatch that uses it is in flight). An update counts ``update_scale``
    (1 / virtual workers: a minibatch is that share of the global batch).

    With ``wsp``, every ``N_m`` minibatches end a wave: the stage pushes the
    wave's summed update (or, with the servers' optimizer, has pushed each
    minibatch's gradient) and pulls the global weights, then uses the pulled
    weights plus its own updates they do not hold yet. With D = 0 the pull of
    clock ``c`` (everyone's wave ``c``) is installed before the next forward;
    with D >= 1 the pull of clock ``c + 1`` (everyone's wave ``c + 1 - D``) is
    posted at once and installed at the end of the next wave, before its push.
    Either way a forward of wave ``c + 1`` sees every virtual worker's updates
    through wave ``c - D``, and the fast virtual worker waits only when it runs
    more than D waves ahead.

    With ``predict``, a stage whose gradients arrive ``lag = peak - 1`` updates
    late runs each forward (and its backward) on the weights predicted after
    those updates (:func:`predict.predict_weights`) instead of the live ones:
    beyond HetPipe, which loses accuracy to that staleness under momentum.

    With ``source`` (the user's optimizer, whose parameter group ``sources[i]``
    is the stage optimizer's group ``i``), each minibatch's update uses the
    numeric settings (``lr``, ``betas``, ...) that source had when the minibatch
    was fed, as a step of synchronous training would: a learning-rate schedule
    on the user's optimizer reaches every stage, and through :meth:`WaveSync.step`
    the servers.

    With ``lag_lr`` a stage whose gradients arrive late (``lag`` >= 1) steps
    with that fraction of the learning rate: beyond HetPipe. With Adam a
    gradient one update late is stable only up to about 5 / lr of preconditioned
    curvature even with prediction (38 / lr without the lag), so the late stage
    is held to flatter regions at a full learning rate; on the default GPT,
    0.25 halved the lag's cost with Adam's beta2 0.999 (see docs/hetpipe.md).

    With ``lag_beta2`` such a stage's Adam (or AdamW) keeps its second moment
    with that decay instead of the optimizer's: beyond HetPipe. A second moment
    that follows the last ten or so gradients shrinks the step soon after the
    late gradients start to swing, and only in the coordinates that swing,
    where a lower learning rate slows every coordinate all the time. The two
    work together: on the default GPT with N_m = 2, D = 1, beta2 0.9 with
    ``lag_lr`` 0.25 ended 3% below single's loss on average over eight seeds,
    0.999 with 0.25 5% above, 0.9 at the full rate 3% above (see docs/hetpipe.md).

    Args:
        stage: this process's stage.
        optimizer: over the stage's parameters (:attr:`Stage.params`).
        source, sources: the optimizer whose settings to follow, and which of its
            groups each of ``optimizer``'s groups follows (default: none followed).
        lag_lr: the learning-rate factor of a stage whose gradients arrive late (default
            1: the paper).
        lag_beta2: Adam's second-moment decay on a stage whose gradients arrive late
            (default None: the optimizer's own).
        unused_hint: what to do about a trained parameter that gets no gradient in a step,
            stepped on zeros (the warning's hint; see :meth:`_zero_unused`).
        inflight: N_m.
        update_scale: factor of each update (default 1).
        wsp: the parameter servers' side of WSP (None: a lone virtual worker).
        predict: forward on predicted weights where gradients arrive late (default False:
            the paper's semantics).
    """

    def __init__(self, stage: Stage, optimizer: torch.optim.Optimizer, *, inflight: int,
                 update_scale: float = 1.0, wsp: WaveSync | None = None,
                 predict: bool = False, source: torch.optim.Optimizer | None = None,
                 sources: Sequence[int] = (), lag_lr: float = 1.0,
                 lag_beta2: float | None = None,
                 unused_hint: str = "freeze a parameter that is not to train "
                                    "(requires_grad_(False))") -> None:
        self.stage = stage
        self.unused_hint = unused_hint
        self.warned_unused = False
        self.optimizer = optimizer
        self.source = source
        self.sources = list(sources)
        self.settings: dict[int, list[dict[str, Any]]] = {}  # minibatch -> its groups' settings
        self.inflight = inflight
        self.lag = stage_lag(inflight, stage.spec.index)
        self.peak = self.lag + 1
        self.predict = predict
        self.lr_factor = lag_lr if self.lag else 1.0
        self.beta2 = lag_beta2 if self.lag else None
        if source is None:  # no settings to follow: change them once
            for group in optimizer.param_groups:
                self._lagged(group)
        self.last_grads: list[torch.Tensor | None] = [None] * len(stage.params)
        self.last_deltas: list[torch.Tensor | None] = [None] * len(stage.params)
        self.update_scale = update_scale
        self.wsp = wsp
        self.params = stage.params
        self.fed = 0      # forwards done
        self.done = 0     # backwards done
        self.version = 0  # bumps whenever the live weights change
        # Backwards done at the last drain: waves count from there, as in a run resumed from
        # a checkpoint written at that drain.
        self.base = 0
        self._snapshot: tuple[tuple[int, int], list[torch.Tensor]] | None = None
        self.drained = False
        # With D >= 1 a wave's pull is posted one clock ahead and installed at the end of
        # the next wave: the same bound as installing it before the next forward (see
        # :meth:`WaveSync.pull`), without waiting for the servers every wave.
        self.overlap = wsp is not None and wsp.staleness >= 1
        self._helper: ThreadPoolExecutor | None = None
        self._update: Future[None] | None = None

    def feed(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Minibatch ``fed``: its forward, then the backward the schedule puts after it."""
        loss = self.forward(inputs, targets)
        self.catch_up()
        return loss

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Minibatch ``fed``'s forward only (:meth:`catch_up` runs the backward due after it):
        for a process that interleaves two pipelines' stages (policy ``bd``)."""
        self.stage.check_inputs(inputs)
        self._join()
        self.drained = False  # a drain before this (a checkpoint's) was not the last
        if self.wsp is not None and self.wsp.pending and not self.overlap:
            self._install()
        t = self.fed
        if self.source is not None:
            # As the source has them: the lag is the stage's own update's (see _apply).
            self.settings[t] = [numeric_settings(self.source.param_groups[i])
                                for i in self.sources]
        loss = self.stage.forward(t, batch=inputs.shape[0], inputs=inputs, targets=targets,
                                  weights=self._weights())
        self.fed += 1
        return None if loss is None else float(loss)

    def _lagged(self, settings: dict[str, Any]) -> None:
        """A late stage's changes to a group's settings: its learning rate and, with Adam's
        ``betas``, its second-moment decay."""
        lag_settings(settings, self.lr_factor, self.beta2)

    def catch_up(self, *, background: bool = False) -> None:
        """The backwards the schedule puts after the forwards fed so far; with
        ``background`` the last one's update runs on a helper thread until this pipeline
        is next used (for a process that runs two pipelines' stages: policy bd)."""
        self._join()
        while self.done <= self.fed - self.peak:
            self._backward(self.done, background=background and
                           self.done == self.fed - self.peak)

    def drain(self) -> None:
        """The backwards still in flight, the last (partial) wave, and the final global weights.

        Afterwards every virtual worker holds the same weights: the servers' after
        everyone's last wave. A flush, not an end: feeding may go on after it (a checkpoint
        drains mid-run), and a second drain with nothing fed since does nothing.
        """
        if self.drained:
            return
        self._join()
        while self.done < self.fed:
            self._backward(self.done)
        if self.wsp is not None:
            if (self.done - self.base) % self.inflight:
                self._end_wave()
            elif self.wsp.pending:
                self._install()
            self.wsp.pull(final=True)
            self._install()
        if self._helper is not None:  # made again if the run goes on (policy bd)
            self._helper.shutdown()
            self._helper = None
        # The run goes on as one resumed here would: waves from here, no prediction from
        # the gradients before.
        self.base = self.done
        self.last_grads = [None] * len(self.params)
        self.last_deltas = [None] * len(self.params)
        self.drained = True

    def _unseen(self) -> int:
        """Other virtual workers' updates this forward's weights may lack: for each, at most
        ``D`` waves and the current wave so far (WSP's bound), plus the ``lag`` updates they
        apply meanwhile. (Counting exactly the waves a pull contains, with a counter on
        the servers, did no better in runs over four seeds.)"""
        if self.wsp is None or self.wsp.virtual_workers < 2:
            return 0
        unseen = ((self.fed - self.base) % self.inflight + self.wsp.staleness * self.inflight
                  + self.lag)
        return (self.wsp.virtual_workers - 1) * unseen

    def _weights(self) -> list[torch.Tensor] | None:
        # Predicted: this stage's ``lag`` steps by its optimizer's rule, then the other virtual
        # workers' unseen ones, each like this stage's (no better guess at hand).
        ahead = self.lag + self._unseen() if self.predict and self.done > self.base else 0
        if ahead == 0 and self.peak == 1:
            return None  # the live weights: nothing changes them before this backward
        lag = min(ahead, max(self.lag, 1))  # with no lag of its own, one step stands for theirs
        extra = ahead - lag
        key = (self.version, ahead)
        if self._snapshot is None or self._snapshot[0] != key:
            if lag:
                copies = predict_weights(self.optimizer, self.params, self.last_grads,
                                         self.last_deltas, lag=lag, scale=self.update_scale,
                                         extra=extra)
            else:
                copies = [p.detach().clone() for p in self.params]
            for c, p in zip(copies, self.params):
                c.requires_grad_(p.requires_grad)
            self._snapshot = (key, copies)
        return self._snapshot[1]

    def _backward(self, mb: int, *, background: bool = False) -> None:
        grads = self.stage.backward(mb, unused_zero=False)
        if self.wsp is not None and (self.wsp.virtual_workers > 1
                                     or self.wsp.optimizer is not None):
            grads = self._zero_unused(grads)
        settings = self.settings.pop(mb, None)
        self.done += 1
        if background:  # the update runs while the device does other work (policy bd)
            if self._helper is None:
                self._helper = ThreadPoolExecutor(
                    1, thread_name_prefix=f"polytrain-update-{self.stage.spec.label}")
            self._update = self._helper.submit(self._finish, grads, settings, self.done)
        else:
            self._finish(grads, settings, self.done)

    def _finish(self, grads: Sequence[torch.Tensor | None],
                settings: list[dict[str, Any]] | None, done: int) -> None:
        """The update of the ``done``-th backward, and the wave's push and pull if it ends one."""
        self._apply(grads, settings)
        if self.wsp is not None and (done - self.base) % self.inflight == 0:
            if self.stage.clock is not None:
                self.stage.clock.wait()  # the wave's gradients leave the device when it is done
            self._end_wave()
            self.wsp.pull(ahead=1 if self.overlap else 0)

    def _zero_unused(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Zeros for the trained parameters the minibatch did not reach, where a skip would
        not be one process's step: with several virtual workers, another's minibatch may
        reach them, and the zero is this one's share of the sum (of gradients on the
        servers, of updates with the stages' optimizers); the servers' optimizer steps a
        layer's tensors as one flat key and cannot skip part of it. So in a step that no
        virtual worker reaches them, they are stepped where one process would leave them
        alone (a lone virtual worker with its stages' optimizer skips them: exact). Warns
        the first time."""
        unused = [i for i, (p, g) in enumerate(zip(self.params, grads))
                  if g is None and p.requires_grad]
        if not unused:
            return grads
        if not self.warned_unused:
            self.warned_unused = True
            names = ", ".join(repr(self.stage.names[i]) for i in unused[:4]) + (
                f" and {len(unused) - 4} more" if len(unused) > 4 else "")
            them = "them" if len(unused) > 1 else "it"
            log.warning("%s: trained parameter%s %s got no gradient in a step: %s stepped on "
                        "a zero gradient (its share of the virtual workers' sum, where another "
                        "reaches %s), so in a step that no virtual worker reaches %s, weight "
                        "decay and momentum move %s where one process would leave %s alone. "
                        "HINT: %s", self.stage.spec.label, "s" if len(unused) > 1 else "",
                        names, "they are" if len(unused) > 1 else "it is", them, them, them,
                        them, self.unused_hint)
        return [torch.zeros_like(p) if g is None and p.requires_grad else g
                for p, g in zip(self.params, grads)]

    def _join(self) -> None:
        """Wait for an update running in the background; raise its error if it failed."""
        if self._update is not None:
            update, self._update = self._update, None
            update.result()

    @torch.no_grad()
    def _apply(self, grads: Sequence[torch.Tensor | None],
               settings: list[dict[str, Any]] | None) -> None:
        if settings is not None:
            for group, values in zip(self.optimizer.param_groups, settings):
                group.update(values)
                self._lagged(group)
        if self.wsp is not None and self.wsp.synchronous:
            # The servers' weights of this very minibatch replace the stage's before its next
            # forward: an update of its own would be thrown away.
            self.wsp.step(None, grads, scale=self.update_scale, settings=settings)
            self.version += 1
            return
        if not self.params:  # a stage of parameter-free layers: nothing to update, but
            if self.wsp is not None:  # its waves are counted as every stage's
                self.wsp.step([], grads, scale=self.update_scale, settings=settings)
            self.version += 1
            return
        params = [p.detach() for p in self.params]
        before = torch._foreach_mul(params, 1.0)  # a copy of every tensor in one call
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        delta = torch._foreach_sub(params, before)
        if self.update_scale != 1.0:
            torch._foreach_mul_(delta, self.update_scale)
            torch._foreach_add_(before, delta)
            torch._foreach_copy_(params, before)
        if self.wsp is not None:
            self.wsp.step(delta, grads, scale=self.update_scale, settings=settings)
        if self.predict:
            self.last_grads = list(grads)
            self.last_deltas = list(delta)
        self.version += 1

    def _install(self) -> None:
        assert self.wsp is not None
        self.wsp.install(self.params)
        self.version += 1

    def _end_wave(self) -> None:
        assert self.wsp is not None
        if self.wsp.pending:
            # Installed before this wave's push (the paper's WSP), so the pull cannot have
            # seen it: the updates since the last push are exactly the ones it lacks.
            self._install()
        self.wsp.end_wave()
