"""The one spawn harness of the multi-process tests: local processes over gloo, bounded in time.

Functions given to :func:`spawn` run in fresh processes, so they live at module
level of a test module (or here). Each process uses one thread; every
communication wait inside is bounded by ``COMM_TIMEOUT_S``, and pytest-timeout
bounds the whole test (``@pytest.mark.timeout``; 120 s by default).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import polytrain
from polytrain.launch import free_port
from polytrain.train import run_config as run_job

__all__ = ["spawn", "run_config", "run_cached", "single_of", "max_abs_diff", "adam_tolerance",
           "Sleepy", "COMM_TIMEOUT_S"]

COMM_TIMEOUT_S = 30.0
_ENV = {"OMP_NUM_THREADS": "1"}


def spawn(fn: Callable[..., Any], *, workers: int, nodes: int = 1, servers: int = 0,
          colocated: int = 0, args: Sequence[Any] = ()) -> list[Any]:
    """Run ``fn(*args)`` in a local layout; return the workers' results by rank."""
    return polytrain.launch(fn, workers=workers, nodes=nodes, servers=servers,
                            colocated=colocated, args=args, timeout_s=COMM_TIMEOUT_S, env=_ENV)


def run_config(config: polytrain.TrainConfig) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train ``config`` as ``polytrain train`` would; return its metrics and ``final.pt``."""
    with tempfile.TemporaryDirectory() as tmp:
        config = config.replace(out=tmp, quiet=True, timeout_s=COMM_TIMEOUT_S)
        return run_job(config, env=_ENV), torch.load(Path(tmp) / "final.pt")


_cache: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}


def run_cached(config: polytrain.TrainConfig
               ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """:func:`run_config`, once per configuration in a test session (tests that read the same
    run for transparency and for traffic start it once)."""
    key = repr(config)
    if key not in _cache:
        _cache[key] = run_config(config)
    return _cache[key]


def single_of(config: polytrain.TrainConfig) -> polytrain.TrainConfig:
    """The ``single`` run with the same model, data, seed, steps and optimizer."""
    return config.replace(strategy="single", workers=1, nodes=1, servers=0, strategy_options={},
                          devices=None, bandwidth=None, latency=None)


def adam_tolerance(lr: float, steps: int) -> float:
    """How far an Adam run may end from ``single``'s: 1% of the farthest Adam's updates can
    take a weight (about ``lr`` a step).

    Adam divides by the root of tiny second moments, which magnifies summation-order
    rounding in gradients near zero. The gap depends on the CPU's kernels: with lr 3e-3 and
    4 to 6 steps, 5e-6 to 1.6e-5 on one machine, up to 3.6e-5 (3 machines, BytePS) on
    another, where a 1e-5 bound failed. A wrong gradient moves weights by a good part of lr.
    """
    return 0.01 * lr * steps


def refused(fn: Callable[[], Any]) -> str:
    """The text of the ConfigError ``fn()`` raises, or "accepted"."""
    try:
        fn()
    except polytrain.ConfigError as e:
        return str(e)
    return "accepted"


def no_sync_gradients(ddp: Callable[[torch.nn.Module], Any], worker_index: int
                      ) -> dict[str, torch.Tensor]:
    """A drop-in DDP (``ddp(module)``) under four uses of no_sync(), each a weight's
    gradient: a forward outside it with its backward inside, then the other way, then a
    forward inside whose backward comes after another forward's summed one (outside), last
    a second backward of one forward (retain_graph's: a regulariser's own backward). Worker
    w's input is w + 1 everywhere: its gradient 2 (w + 1), the average 3."""
    net = torch.nn.Linear(4, 2)
    model = ddp(net)
    x = torch.full((2, 4), worker_index + 1.0)
    loss = model(x).sum()
    with model.no_sync():
        loss.backward()
    out = {"forward outside": net.weight.grad.clone()}
    net.zero_grad()
    with model.no_sync():
        loss = model(x).sum()
    loss.backward()
    out["forward inside"] = net.weight.grad.clone()
    with model.no_sync():
        inside = model(x).sum()
    model(x).sum().backward()
    net.zero_grad()
    inside.backward()
    out["inside, after a sum"] = net.weight.grad.clone()
    net.zero_grad()
    twice = model(x)
    twice.sum().backward(retain_graph=True)
    net.zero_grad()
    (2 * twice).sum().backward()
    out["second backward"] = net.weight.grad.clone()
    return out


def check_no_sync_gradients(said: dict[str, torch.Tensor], worker_index: int) -> None:
    """Assert :func:`no_sync_gradients`'s answer: no_sync() read at the backward, as BytePS's
    DDP reads it (torch's DDP reads it at the forward: it sums the first and leaves the
    second and third local; and the fourth, a backward with no forward since the sum)."""
    assert torch.equal(said["forward outside"], torch.full((2, 4), 2.0 * (worker_index + 1)))
    assert torch.equal(said["forward inside"], torch.full((2, 4), 3.0))
    assert torch.equal(said["inside, after a sum"], torch.full((2, 4), 3.0))
    assert torch.equal(said["second backward"], torch.full((2, 4), 6.0))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference of two state dicts with the same keys."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


class Sleepy(torch.nn.Module):
    """A layer whose FLOPs misjudge its time (as a gather or a custom kernel may): a small
    Linear behind a sleep of ``seconds`` per call, then dropout ``p`` (0: none, no draw)."""

    def __init__(self, d: int, seconds: float = 0.02, p: float = 0.0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.seconds, self.p = seconds, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        out = self.lin(x)
        return torch.nn.functional.dropout(out, self.p, self.training) if self.p else out


def as_from_a_terminal() -> None:
    """``preexec_fn`` of a launcher a test starts and signals: SIGINT and SIGHUP at their
    defaults, as from a terminal. The launcher keeps a signal it was started with ignored,
    and pytest run as a shell's background job has SIGINT ignored."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def torchrun(script: Path, roles: str, *argv: str,
             processes: int | None = None) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone`` of ``script`` on one machine "box", a process per role (or
    ``processes`` of one role)."""
    env = dict(os.environ, POLYTRAIN_ROLE=roles, POLYTRAIN_NODE="box",
               PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
               "--nproc-per-node", str(processes or len(roles.split(","))),
               "--master-port", str(free_port()), str(script), *argv]
    # Output to files, not pipes, and in a session of its own: a process torchrun left
    # behind held the pipes open, and the test waited past its time limit for their end
    # (once in a loaded suite, after torchrun had returned); it is stopped here.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=80)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, code, out.read(), err.read())
