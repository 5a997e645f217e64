"""A worker's compute per step: measured on the real model here, or from emulated devices."""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping

import torch

from ..emulation.devices import Cluster
from ..emulation.profile import profile_model
from ..errors import ConfigError
from ..models import get_model, seq_len_of
from ..optim import make_optimizer
from .cost import Compute

__all__ = ["measure_compute", "device_compute"]


def _sample(spec: Any, model: torch.nn.Module, options: Mapping[str, Any], batch: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = seq_len_of(model, options)
    gen = torch.Generator().manual_seed(0)
    # Token ids the model has (wordlm's --vocab may be under 256, the text's bytes).
    window = torch.randint(0, min(256, int(getattr(model, "vocab", 256))),
                           (batch, seq_len + 1), generator=gen)
    inputs, targets = spec.split(window)
    return inputs, targets


#: About how long timing a model's step may take (one warm-up step at least).
BUDGET_S = 10.0


def measure_compute(model: str, model_options: Mapping[str, Any], *, batch: int,
                    optimizer: str = "adam", repeats: int = 5, threads: int = 1,
                    budget_s: float = BUDGET_S) -> Compute:
    """Time forward, backward and the optimizer step of ``model`` at ``batch`` samples.

    In this process, on ``threads`` threads (a launched worker gets one per core it
    shares), after one warm-up step; each part is the median of ``repeats``, or of as
    many as the warm-up step says fit in ``budget_s`` (one at least): a large batch took
    minutes with nothing printed (``polytrain plan --batch-size 4096``: 18 s a step).
    """
    spec = get_model(model)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    # fork_rng: the caller's random numbers go on as if nothing had been timed (plan_job
    # reseeded them: a seed set before it gave other weights after it); devices=[]: only
    # the CPU's generator is used here.
    with torch.random.fork_rng(devices=[]):
        try:
            torch.manual_seed(0)
            net = spec.make(**model_options)
            opt = make_optimizer(optimizer, net, 1e-3)
            inputs, targets = _sample(spec, net, model_options, batch)
            parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
            i = 0
            while i <= repeats:
                opt.zero_grad(set_to_none=False)
                t0 = time.perf_counter()
                loss = spec.loss(net(inputs), targets)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                if i:  # the first step allocates gradients and optimizer state
                    parts["forward"].append(t1 - t0)
                    parts["backward"].append(t2 - t1)
                    parts["optimizer"].append(t3 - t2)
                else:
                    repeats = max(1, min(repeats, int(budget_s / max(t3 - t0, 1e-9))))
                i += 1
        except (MemoryError, RuntimeError) as e:
            if not isinstance(e, MemoryError) and "can't allocate memory" not in str(e):
                raise
            raise ConfigError(f"timing {model} at one worker's batch of {batch} needs more "
                              f"memory than this machine has", "pass a smaller --batch-size, "
                              "or --devices to predict from the model's FLOPs") from None
        finally:
            torch.set_num_threads(before)
    return Compute(forward_s=statistics.median(parts["forward"]),
                   backward_s=statistics.median(parts["backward"]),
                   optimizer_s=statistics.median(parts["optimizer"]))


def device_compute(model: str, model_options: Mapping[str, Any], *, batch: int,
                   cluster: Cluster) -> Compute:
    """The compute of the slowest device of ``cluster`` (a synchronous step waits for it),
    from the model's FLOPs (backward twice forward) and the device's rate; the optimizer's
    time is left out, as on a GPU it is small beside backward."""
    spec = get_model(model)
    with torch.device("meta"):
        net = spec.make(**model_options)
    inputs, _ = _sample(spec, net, model_options, 1)
    profile = profile_model(net, inputs)
    slowest = min(d.type.flops_per_s for d in cluster.devices)
    fwd = sum(x.fwd_flops for x in profile.layers) * batch / slowest
    bwd = sum(x.bwd_flops for x in profile.layers) * batch / slowest
    return Compute(forward_s=fwd, backward_s=bwd, optimizer_s=0.0, emulated=True)
