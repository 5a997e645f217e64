"""A worker's compute per step: measured on the real model here, or from emulated devices."""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping

import torch

from ..config import check_weights_fit, model_profile, model_sample
from ..emulation.devices import Cluster
from ..errors import ConfigError
from ..models import get_model
from ..optim import make_optimizer
from .cost import Compute

__all__ = ["measure_compute", "device_compute"]


#: About how long timing a model's step may take (one warm-up step at least).
BUDGET_S = 10.0


def _check_fits(model: str, model_options: Mapping[str, Any], optimizer: str) -> None:
    """Refuse a model whose weights and optimizer state alone outgrow this machine's free
    memory, naming its options, before building it: its allocation failed inside the timing
    and was blamed on the batch (``--vocab 3000000000``: "pass a smaller --batch-size")."""
    with torch.device("meta"):
        net = get_model(model).make(**model_options)
    # Its sizes as flags (a switch such as --dropless is no size: left out).
    given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in model_options.items()
                     if not isinstance(v, bool))
    smaller = f"smaller than {given}" if given else "--d-model, --layers"
    check_weights_fit(net, name=f"{model} with {given or 'its default options'}", copies=1,
                      per="to time a step here", optimizer=optimizer,
                      hint=f"pass a smaller model ({smaller}), or --devices to predict from the "
                      f"model's FLOPs without building it")


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
    _check_fits(model, model_options, optimizer)
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
            inputs, targets = model_sample(spec, net, model_options, batch=batch)
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
    profile = model_profile(spec, net, model_options)
    slowest = min(d.type.flops_per_s for d in cluster.devices)
    fwd = sum(x.fwd_flops for x in profile.layers) * batch / slowest
    bwd = sum(x.bwd_flops for x in profile.layers) * batch / slowest
    return Compute(forward_s=fwd, backward_s=bwd, optimizer_s=0.0, emulated=True)
