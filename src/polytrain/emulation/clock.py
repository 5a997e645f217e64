"""Emulated devices: each layer runs for real, then waits out the time its device would take."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import ConfigError
from ..wrapper import unwrap
from .devices import DeviceType
from .profile import ModelProfile, layers_of

__all__ = ["DeviceClock", "emulate", "clock_of"]

log = logging.getLogger(__name__)

_ATTR = "_polytrain_clock"


class DeviceClock:
    """The timeline of one emulated device.

    Work is issued as operations of known emulated duration; an operation
    starts once the previous one has finished *on the emulated device*, so
    real compute hides inside emulated time as long as the CPU is faster than
    the device it plays. Anything that leaves the device (a send, a push)
    first waits for it (:meth:`wait`, or at :meth:`reserve`'s time); work a GPU
    would queue behind the device's and finish in no time (an optimizer step)
    does not wait, so its real time hides in the device's too.

    Example::

        clock = emulate(model, BUILTIN_TYPES["slow"], profile)
        loss_fn(model(x), y).backward()
        clock.wait()          # the emulated backward has finished too

    Attributes:
        emulated_s: total emulated busy time issued so far.
        waited_s: of that, how long the process slept (the rest was real work).
    """

    def __init__(self, device_type: DeviceType) -> None:
        self.type = device_type
        self.due = 0.0
        self.emulated_s = 0.0
        self.waited_s = 0.0
        self.running = True

    def begin(self, seconds: float) -> None:
        """Start an operation of ``seconds`` once the device is free."""
        self.wait()
        self.due = time.monotonic() + seconds
        self.emulated_s += seconds

    def reserve(self, seconds: float) -> float:
        """Queue an operation of ``seconds`` after everything issued, without waiting;
        returns the time (``time.monotonic``) it ends."""
        self.due = max(time.monotonic(), self.due) + seconds
        self.emulated_s += seconds
        return self.due

    def compute(self, flops: float) -> None:
        if self.running:
            self.begin(flops / self.type.flops_per_s)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Layers run at real speed meanwhile (a held-out evaluation is not training time)."""
        self.running = False
        try:
            yield
        finally:
            self.running = True

    def wait(self) -> None:
        """Block until the emulated device has finished everything issued."""
        delay = self.due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
            self.waited_s += delay

    @property
    def hidden_fraction(self) -> float:
        """Share of emulated time spent sleeping: near 1 means real compute is negligible."""
        return self.waited_s / self.emulated_s if self.emulated_s else 1.0


def emulate(model: nn.Module, device_type: DeviceType, profile: ModelProfile) -> DeviceClock:
    """Make ``model`` run at the speed of ``device_type``: hooks on each of its layers.

    A layer's forward is an operation of ``fwd_flops * batch / rate``; its
    backward (from when the gradient of its output is ready) one of
    ``bwd_flops * batch / rate``. A layer's last gradient of a backward leaves
    the device (to the hooks registered after this call, and DDP's reducer) once
    the device has finished the layer's backward: call this before
    ``distribute``. Its earlier gradients leave as the real backward makes them
    (up to the layer's emulated backward early; all of them, for a layer with a
    parameter the forward did not reach): holding each made the rest of the
    real backward run after the emulated time, not inside it. The clock is attached to
    ``model`` (see :func:`clock_of`). An optimizer step does not wait for the
    device (a GPU queues it behind the backward).
    """
    layers = layers_of(model)
    _check_fits([name for name, _ in layers], [p.name for p in profile.layers])
    clock = DeviceClock(device_type)
    for (_, layer), prof in zip(layers, profile.layers):
        # The real backward of a layer runs as soon as its emulated one begins. Its last
        # gradient waits for the device to have computed them all, before the hooks that
        # communicate it (registered later; torch's reducer hooks the accumulation itself,
        # after these): waiting at its first, the rest of its real backward ran after the
        # emulated one instead of inside it. ``left``: its gradients this backward still to
        # come (a parameter no forward reached never comes: that layer's are not held).
        trained = [p for p in layer.parameters() if p.requires_grad]
        left = [0]

        def pre(_m: nn.Module, args: Any, fwd: float = prof.fwd_flops) -> None:
            clock.compute(fwd * _batch(args))

        def post(_m: nn.Module, args: Any, out: Any, bwd: float = prof.bwd_flops,
                 trained: list[nn.Parameter] = trained, left: list[int] = left) -> None:
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                cost = bwd * _batch(args)

                def started(_g: torch.Tensor) -> None:
                    clock.compute(cost)
                    left[0] = sum(p.requires_grad for p in trained)

                t.register_hook(started)

        def came(_p: nn.Parameter, left: list[int] = left) -> None:
            left[0] -= 1
            if left[0] == 0:
                clock.wait()

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
        for p in trained:
            p.register_post_accumulate_grad_hook(came)
    setattr(model, _ATTR, clock)
    log.info("emulating %s on %d layers", device_type.describe(), len(profile.layers))
    return clock


def _check_fits(names: list[str], profiled: list[str]) -> None:
    """Refuse a profile whose layers are not the model's, in order (zip stopped at the
    shorter: the rest of the model ran at real speed), naming the first difference."""
    if names == profiled:
        return
    i = next((i for i, (a, b) in enumerate(zip(names, profiled)) if a != b),
             min(len(names), len(profiled)))
    if i < min(len(names), len(profiled)):
        first = f"layer {i} is {names[i]!r} in the model, {profiled[i]!r} in the profile"
    elif i < len(names):
        first = f"the model's layer {i} ({names[i]!r}) has no profile"
    else:
        first = f"the profile's layer {i} ({profiled[i]!r}) is not in the model"
    raise ConfigError(f"the profile does not fit the model: {first} (the model has "
                      f"{len(names)} layer{'' if len(names) == 1 else 's'}, the profile "
                      f"{len(profiled)})", "profile the model you emulate: emulate(model, "
                      "device_type, profile_model(model, sample))")


def clock_of(model: nn.Module) -> DeviceClock | None:
    """The emulated device ``model`` runs on (None: real speed), through the wrappers around
    it (:func:`~polytrain.wrapper.unwrap`: DDP's, Parallax's evaluation model's)."""
    while True:
        clock = getattr(model, _ATTR, None)
        if isinstance(clock, DeviceClock):
            return clock
        inner = unwrap(model)
        if inner is model:
            return None
        model = inner


def _batch(args: Any) -> int:
    for a in args:
        if isinstance(a, torch.Tensor):
            return int(a.shape[0]) if a.dim() else 1
    return 1
