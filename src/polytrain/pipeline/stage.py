"""One stage of a pipeline: its layers, its forwards and backwards, its point-to-point traffic."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from ..comm import tags
from ..comm.p2p import Transport
from ..emulation.clock import DeviceClock
from ..errors import CommError, CommTimeout, ConfigError

__all__ = ["StageSpec", "Stage"]

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StageSpec:
    """Where a stage sits in its pipeline, as plain data.

    ``label`` names the stage in errors and logs ("virtual worker 1 stage 0
    (rank 3, machine node1)"); ``peers`` names its neighbours the same way.
    Shapes are per sample (the batch dimension comes from the minibatch).
    """

    index: int
    count: int
    prev: int | None                  # rank of the previous stage
    next: int | None                  # rank of the next stage
    label: str
    prev_label: str = ""
    next_label: str = ""
    input_shape: tuple[int, ...] = ()  # what the previous stage sends (stage > 0)
    input_dtype: torch.dtype = torch.float32
    link_prev: float = 0.0            # bytes/s to the previous stage (0: not emulated)
    link_next: float = 0.0
    #: The pipeline's inputs per sample, and their dtype, as profiled at the first step:
    #: every stage is given them (None: not checked; see :meth:`Stage.check_inputs`).
    sample_shape: tuple[int, ...] | None = None
    sample_dtype: torch.dtype | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


class _Flight:
    """What a minibatch's backward needs from its forward."""

    __slots__ = ("x", "out", "weights")

    def __init__(self, x: torch.Tensor, out: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
        self.x = x
        self.out = out
        self.weights = weights


class Stage:
    """A contiguous run of a model's layers in one process, fed by point-to-point messages.

    :meth:`forward` receives the previous stage's activation (or takes the
    input on the first stage), runs the layers, and sends the output on (or
    computes the loss on the last stage). :meth:`backward` receives the
    output's gradient (or starts from the loss), computes the gradients of the
    weights *used in that forward* and of the input, and sends the latter
    back. Sends never block the schedule: a thread waits for them.

    Example (one process of a two-stage pipeline)::

        stage = Stage(spec, nn.Sequential(*layers[:3]), transport, loss_fn=loss)
        for a in schedule.one_f_one_b(2, 4)[spec.index]:
            if a.kind == "F": stage.forward(a.minibatch, batch=8, inputs=xs[a.minibatch])
            else: grads = stage.backward(a.minibatch)

    Args:
        spec: its place in the pipeline.
        module: its layers (an ``nn.Sequential``).
        transport: metered point-to-point messages over a group of the pipeline's ranks.
        loss_fn: the loss on the last stage.
        clock: the emulated device the layers run on (None: real speed).
        device: where the layers compute (default: where their parameters are; the CPU
            for a stage of none, such as a lone activation).
    """

    def __init__(self, spec: StageSpec, module: nn.Module, transport: Transport, *,
                 loss_fn: LossFn, clock: DeviceClock | None = None,
                 device: torch.device | None = None) -> None:
        self.spec = spec
        self.module = module
        self.transport = transport
        self.loss_fn = loss_fn
        self.clock = clock
        self.names = [n for n, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        #: Where the layers compute: received activations and gradients land there.
        self.device = device if device is not None else next(
            (t.device for t in (*self.params, *module.buffers())), torch.device("cpu"))
        self._flights: dict[int, _Flight] = {}
        self._sends: queue.Queue[_Send | None] = queue.Queue()
        self._send_error: BaseException | None = None
        self._reaper = threading.Thread(target=self._reap, daemon=True,
                                        name=f"polytrain-stage{spec.index}-sends")
        self._reaper.start()

    # -- compute ----------------------------------------------------------------------------

    def check_inputs(self, inputs: torch.Tensor) -> None:
        """Refuse the pipeline's inputs of another shape past the batch dimension, or another
        dtype, than the first step's (:attr:`StageSpec.sample_shape`): the stages after the
        first receive into buffers of the shapes profiled then. Every stage is given the same
        inputs, so every stage refuses alike, without a message (a pipeline of one stage too,
        so that a run is refused on any cluster, not only where its pipelines are cut)."""
        spec = self.spec
        if spec.sample_shape is None:
            return
        shape, dtype = tuple(inputs.shape[1:]), inputs.dtype
        if shape != spec.sample_shape or (spec.sample_dtype is not None
                                          and dtype != spec.sample_dtype):
            raise ConfigError(
                f"{spec.label}: pipeline stages take inputs of the first step's shape "
                f"{_shape(spec.sample_shape)} and dtype {spec.sample_dtype} (the stages after "
                f"the first receive activations of the shapes profiled then), not "
                f"{_shape(shape)} {dtype}",
                "pad to a fixed length: every step's inputs of one shape and dtype past the "
                "batch dimension")

    def forward(self, mb: int, *, batch: int, inputs: torch.Tensor | None = None,
                targets: torch.Tensor | None = None,
                weights: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """Run minibatch ``mb`` forward; the last stage returns its (detached) loss.

        ``weights`` replace the module's parameters for this minibatch (a
        stashed version, in the order of :attr:`names`); default: the live ones.
        """
        self._check_sends()
        spec = self.spec
        if spec.is_first:
            if inputs is None:
                raise ValueError(f"{spec.label}: the first stage needs the inputs")
            x = inputs
        else:
            x = torch.empty((batch, *spec.input_shape), dtype=spec.input_dtype,
                            device=self.device)
            self._recv(x, spec.prev, spec.prev_label, self._tag(mb, 0),
                       f"the activations of minibatch {mb}")
            if x.is_floating_point():
                x.requires_grad_(True)
        used = list(self.params if weights is None else weights)
        with torch.enable_grad():
            if weights is None:
                out = self.module(x)
            else:
                out = functional_call(self.module, dict(zip(self.names, used)), (x,))
            if spec.is_last:
                if targets is None:
                    raise ValueError(f"{spec.label}: the last stage needs the targets")
                out = self.loss_fn(out, targets)
        self._flights[mb] = _Flight(x, out, used)
        if spec.is_last:
            self._device_done()
            return out.detach()
        self._send(out.detach(), spec.next, spec.next_label, self._tag(mb, 0),
                   f"the activations of minibatch {mb}", spec.link_next)
        return None

    def backward(self, mb: int, *, scale: float = 1.0,
                 unused_zero: bool = True) -> list[torch.Tensor | None]:
        """Run minibatch ``mb`` backward; returns the gradients of its weights (None: frozen).

        ``scale`` multiplies the loss on the last stage (1 / micro-batches for a flush).
        A trained weight the minibatch did not reach gets zeros, or with ``unused_zero``
        False None, as autograd leaves it: an optimizer then skips it, as in one process.
        """
        self._check_sends()
        spec = self.spec
        flight = self._flights.pop(mb)
        outputs: list[torch.Tensor] = []
        grad_outputs: list[torch.Tensor] | None = None
        if spec.is_last:
            outputs = [flight.out * scale]
        elif flight.out.is_floating_point():
            grad_out = torch.empty_like(flight.out)
            self._recv(grad_out, spec.next, spec.next_label, self._tag(mb, 1),
                       f"the gradients of minibatch {mb}")
            outputs, grad_outputs = [flight.out], [grad_out]
        # else: an integer activation (token ids) carries no gradient, and the next stage
        # sends none (it marks only floating-point inputs as requiring grad): nothing flows.
        wanted = [w for w in flight.weights if w.requires_grad]
        needs_input = flight.x.requires_grad and not spec.is_first
        inputs = wanted + ([flight.x] if needs_input else [])
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        if inputs and outputs:
            grads = list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
        if needs_input:
            gx = grads.pop()
            gx = torch.zeros_like(flight.x) if gx is None else gx
            self._send(gx, spec.prev, spec.prev_label, self._tag(mb, 1),
                       f"the gradients of minibatch {mb}", spec.link_prev)
        # The emulated device may still run this backward: the caller's update (queued
        # behind it on a GPU) runs meanwhile; the next operation waits for the device.
        it = iter(grads)
        out: list[torch.Tensor | None] = []
        for w in flight.weights:
            if not w.requires_grad:
                out.append(None)
                continue
            g = next(it)
            out.append(torch.zeros_like(w) if g is None and unused_zero else g)
        return out

    @property
    def inflight(self) -> int:
        return len(self._flights)

    # -- messages ---------------------------------------------------------------------------

    @staticmethod
    def _tag(mb: int, direction: int) -> int:
        return tags.tag(tags.PIPELINE, mb * 2 + direction)

    def _device_done(self) -> None:
        if self.clock is not None:
            self.clock.wait()

    def _recv(self, buf: torch.Tensor, peer: int | None, peer_label: str, tag: int,
              what: str) -> None:
        assert peer is not None
        try:
            self.transport.irecv(buf, peer, tag, what).wait()
        except CommError as e:
            raise self._error(e, peer_label, f"receiving {what}") from None

    def _send(self, t: torch.Tensor, peer: int | None, peer_label: str, tag: int, what: str,
              link: float) -> None:
        assert peer is not None
        ready = 0.0  # when the tensor has left the emulated device
        if self.clock is not None:
            ready = self.clock.due
            if link > 0:
                ready = self.clock.reserve(t.numel() * t.element_size() / link)
        self._sends.put(_Send(t, peer, tag, what, f"sending {what} to {peer_label}", ready))

    def _reap(self) -> None:
        # gloo completes a send only once the peer receives it, so the schedule never waits
        # on sends (two stages sending to each other would deadlock): this thread does. It
        # also waits for the emulated device to have produced (and sent) the tensor, while
        # the schedule goes on.
        while (item := self._sends.get()) is not None:
            try:
                delay = item.ready - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self.transport.isend(item.tensor, item.peer, item.tag, item.what).wait()
            except BaseException as e:  # noqa: BLE001 - raised by the main thread
                if self._send_error is None:
                    self._send_error = _with_context(e, f"{self.spec.label}: {item.context}")
                return

    def _check_sends(self) -> None:
        if self._send_error is not None:
            raise self._send_error

    def _error(self, e: CommError, peer_label: str, doing: str) -> CommError:
        return _with_context(e, f"{self.spec.label}: {doing} from/to {peer_label}")

    def close(self, *, wait: bool = True) -> None:
        """Finish the sends in flight (when ``wait``) and stop the send thread."""
        self._sends.put(None)
        if wait:
            self._reaper.join(self.transport.timeout_s)
            self._check_sends()
            if self._reaper.is_alive():  # a send that each wait's own timeout let go on
                raise CommTimeout(f"{self.spec.label}: its sends were still in flight "
                                  f"{self.transport.timeout_s:g} s after the last step",
                                  "if the next stage is alive but slow, raise the timeout "
                                  "(--timeout)", waited_s=self.transport.timeout_s)


@dataclass(frozen=True)
class _Send:
    tensor: torch.Tensor
    peer: int
    tag: int
    what: str
    context: str
    ready: float  # time.monotonic() when the emulated device has it out (0: at once)


def _with_context(e: BaseException, context: str) -> CommError:
    """The same kind of error (a lost peer stays a lost peer), prefixed with who and what."""
    if isinstance(e, CommError):
        err = type(e)(f"{context}: {e.what}", e.hint)
        # And what else it carries (a timeout's waited_s, a lost peer's rank): the launcher
        # words and dates the failure from them.
        vars(err).update({k: v for k, v in vars(e).items() if k not in ("what", "hint")})
    else:
        err = CommError(f"{context}: {type(e).__name__}: {e}")
    return err


def _shape(per_sample: Sequence[int]) -> str:
    """A shape with its batch dimension: ``(batch, 16)``."""
    return "(" + ", ".join(["batch", *map(str, per_sample)]) + ")"
