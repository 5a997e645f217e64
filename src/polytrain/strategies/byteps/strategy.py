"""``byteps``: the strategy that ``polytrain train --strategy byteps`` and ``distribute`` use."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from ...comm.partition import TensorSpec
from ...emulation.profile import hookless_copy
from ...errors import ConfigError
from ...launch.layout import Layout
from ...ps.compression import compressor
from ...ps.engine import Engine, engine_for
from ...runtime import Context
from ..base import register, saved_option
from ..checks import check_dense_gradients
from ..served import ServedStrategy
from ..synced import keep_missing_for
from .async_mode import AsyncOptimizer
from .optimizer import (
    DistributedOptimizer,
    check_compress_momentum,
    check_one_bit_adam,
    tensor_compression,
)
from .options import BytePSOptions
from .plan import optimal_shares

__all__ = ["BytePS"]

log = logging.getLogger(__name__)
# The layouts whose idle servers this process has said (check_layout runs again on a resume).
_warned: set[tuple[int, int]] = set()


@register
class BytePS(ServedStrategy[BytePSOptions]):
    """BytePS: gradient summation on CPU servers, the update on the workers.

    A summation server runs on every worker machine (``colocate``) and on each
    of ``--servers K`` CPU machines; gradient partitions are placed by
    Theorem 1 so that every machine moves the fewest bytes (k = 0 gives
    all-reduce's traffic, ``colocate=False`` a classic parameter server).
    Workers of a machine reduce locally first, push and pull each partition
    once per machine from hooks during backward (earlier layers first, bounded
    by a credit), and run their own optimizer on the average. With ``async_``
    the servers hold the parameters instead.

    Paper: Jiang et al., "A Unified Architecture for Accelerating Distributed DNN
    Training in Heterogeneous GPU/CPU Clusters", OSDI 2020.

    Example::

        model, opt = polytrain.distribute(model, opt, strategy="byteps")
        # polytrain train --strategy byteps --workers 4 --nodes 2 --servers 1
    """

    name = "byteps"
    Options = BytePSOptions
    copyable_model = True  # its hooks are on the parameters: a copy has none

    @classmethod
    def check_model(cls, model: nn.Module, layout: Layout, options: BytePSOptions) -> None:
        check_dense_gradients(model, cls.name)
        # What the wrap would refuse in every worker (compression that compresses nothing),
        # refused before any process starts: the trained parameters' specs are the model's.
        tensor_compression([TensorSpec.of(n, p) for n, p in model.named_parameters()
                            if p.requires_grad], options.compress,
                           error_feedback=options.error_feedback,
                           momentum=options.compress_momentum,
                           min_bytes=options.compress_min_bytes)
    no_colocate_means = ("is the classic parameter server: every gradient goes to "
                         "dedicated servers")

    @classmethod
    def check_layout(cls, layout: Layout, options: BytePSOptions) -> None:
        super().check_layout(layout, options)
        # Servers Theorem 1 gives no share: a right run, with processes that sum nothing.
        n, k = layout.nodes, layout.servers
        if not options.colocate or k == 0:
            return
        shares = optimal_shares(n, k)
        if (n, k) in _warned:  # once a process (a resume and a restart check the layout again)
            return
        _warned.add((n, k))
        if shares.cpu_servers == 0:  # one worker machine: nothing crosses between machines
            log.warning("byteps --servers %d with one worker machine (--nodes 1): Theorem 1 "
                        "gives the CPU servers no share of the model, so they sum nothing and "
                        "the worker machine's own server sums every gradient; spread the "
                        "workers over machines (--nodes N), or leave out --servers", k)
        elif shares.per_colocated_server == 0:
            log.info("byteps --servers %d on %d worker machines: Theorem 1 gives the CPU "
                     "servers the whole model when they are as many as the worker machines or "
                     "more, so the colocated servers sum nothing (--no-colocate runs without "
                     "them)", k, n)

    @classmethod
    def check_optimizer(cls, optimizer: torch.optim.Optimizer, options: BytePSOptions) -> None:
        if options.compress_adam:
            check_one_bit_adam(optimizer)
        check_compress_momentum(optimizer, options.compress_momentum)  # before a start

    def __init__(self, ctx: Context | None, options: BytePSOptions) -> None:
        super().__init__(ctx, options)
        self.engine: Engine | None = None
        self.optimizer: DistributedOptimizer | AsyncOptimizer | None = None

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        opts: BytePSOptions = self.options
        model.to(ctx.device)
        self.engine = engine_for(ctx, credit_bytes=opts.credit_bytes)
        named = list(model.named_parameters())
        placing: dict[str, Any] = {"partition_bytes": opts.partition_bytes,
                                   "colocate": opts.colocate, "compression": opts.compress,
                                   "error_feedback": opts.error_feedback,
                                   "compress_momentum": opts.compress_momentum,
                                   "compress_min_bytes": opts.compress_min_bytes}
        if opts.async_:  # the options refuse the warm-up and 1-bit Adam with async
            self.optimizer = AsyncOptimizer(optimizer, engine=self.engine, named_parameters=named,
                                            staleness=opts.staleness, **placing)
        else:
            self.optimizer = DistributedOptimizer(optimizer, engine=self.engine,
                                                  named_parameters=named,
                                                  fuse_bytes=opts.fuse_bytes,
                                                  compress_warmup=opts.compress_warmup,
                                                  compress_warmup_with=opts.compress_warmup_with,
                                                  compress_adam=opts.compress_adam,
                                                  compress_adam_refresh=(
                                                      opts.compress_adam_refresh),
                                                  **placing)
            # A parameter no worker gave a gradient keeps .grad None, as in one process
            # (summed as zeros, Adam would step on it with its momentum): a flag per
            # parameter summed a step, beside the gradients (GradientSync.keep_missing).
            keep_missing_for(self.optimizer.sync, model, find_unused=True)
        _warn_outside(ctx, model, optimizer)
        return model, self.optimizer

    def evaluation_model(self, model: nn.Module) -> nn.Module | None:
        # Asynchronous: worker 0's copy may lack up to --staleness steps of the others'
        # pushes; it waits for them (as state_dict does) and evaluates a copy of the model
        # with them, so that a held-out loss describes the model final.pt holds, and its own
        # copy trains on as it would without the evaluation.
        if isinstance(self.optimizer, AsyncOptimizer):
            self.optimizer.install_once()  # collective: before worker 0 alone pulls
        net = super().evaluation_model(model)
        if net is None or not isinstance(self.optimizer, AsyncOptimizer):
            return net
        pulled = self.optimizer.peek_final()
        copy = hookless_copy(net)
        with torch.no_grad():
            for (_, p), (_, q) in zip(net.named_parameters(), copy.named_parameters()):
                if id(p) in pulled:
                    q.copy_(pulled[id(p)])
        return copy

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if isinstance(self.optimizer, AsyncOptimizer):
            self.optimizer.pull_final()  # every worker's pushes are in the servers' copy
        return super().state_dict(model)

    @classmethod
    def check_resume(cls, saved: Mapping[str, Any], layout: Layout,
                     options: BytePSOptions) -> None:
        was_async = bool(saved_option(cls, saved, "async_"))
        if was_async != options.async_:
            mode = {True: "asynchronous (--async)", False: "synchronous"}
            raise ConfigError(f"checkpoint of {mode[was_async]} BytePS cannot resume as "
                              f"{mode[options.async_]} BytePS",
                              "resume in the checkpoint's mode, or start without --resume")
        if options.async_ and int(saved["workers"]) != layout.workers:
            raise ConfigError(
                f"asynchronous BytePS cannot resume a checkpoint of {saved['workers']} workers "
                f"on {layout.workers}: each worker's optimizer state and clock are its own",
                f"resume with --workers {saved['workers']}")
        # Synchronous: every worker holds the whole model and optimizer state, and the
        # servers only sum: any layout resumes (compression's state only on the same one).

    def load_model_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        super().load_model_state(model, state)
        if isinstance(self.optimizer, AsyncOptimizer):
            self.optimizer.install()  # the servers hold the parameters

    def checkpoint_state(self) -> dict[str, Any]:
        # Asynchronous: the clock; synchronous: the steps synchronised (where the warm-up
        # and 1-bit Adam's switch stand). Both: what the compression carries across steps.
        if isinstance(self.optimizer, (AsyncOptimizer, DistributedOptimizer)):
            return self.optimizer.carried()
        return {}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        # Empty: a checkpoint of another worker count (synchronous only: asynchronous refuses).
        restored = False
        if isinstance(self.optimizer, AsyncOptimizer) and "clock" in state:
            restored = self.optimizer.carry_on(state)
        elif isinstance(self.optimizer, DistributedOptimizer) and "synced" in state:
            restored = self.optimizer.carry_on(state)
        fresh = [] if restored else self._carried_across_steps(warm_up=not state)
        if fresh and self.ctx is not None and self.ctx.worker_index == 0:
            log.warning("resumed with compressed gradients from a checkpoint of another layout "
                        "(or an older one): %s start afresh, so this run is close to, not "
                        "bit-equal with, the uninterrupted one", ", ".join(fresh))

    def _carried_across_steps(self, *, warm_up: bool) -> list[str]:
        """What the compression options carry from step to step, in words."""
        opts, codec = self.options, compressor(self.options.compress)
        return [what for what, on in (
            ("the warm-up", warm_up and opts.compress_warmup > 0 and not opts.async_),
            ("error feedback's residuals", opts.error_feedback),
            ("the compression's momentum", opts.compress_momentum),
            (f"{opts.compress}'s random draws", codec is not None and not codec.deterministic),
            ("1-bit Adam's own variances", opts.compress_adam_refresh > 0)) if on]

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.close()
        if self.engine is not None:
            self.engine.close()


def _warn_outside(ctx: Context, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Warn (worker 0) of parameters that require a gradient and that the optimizer does not
    hold: nothing sums their gradients. Left alone (a backbone that fine-tuning does not
    step) they stay alike; stepped by a second optimizer of the script's, each worker's copy
    takes its own gradients, and they drift apart (0.31 in two steps). (A check at every
    step cost a gather of every worker a step, and could hang where workers differed.)"""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if outside and ctx.worker_index == 0:
        log.warning("byteps sums the gradients of the optimizer given to distribute(), and it "
                    "does not hold %d parameter(s) that require a gradient (the first: %r): "
                    "if another optimizer steps them, each worker's copy takes its own "
                    "gradients and they drift apart; give that optimizer every parameter that "
                    "trains, or set requires_grad=False on those nothing trains (which also "
                    "saves their backward)", len(outside), outside[0])
