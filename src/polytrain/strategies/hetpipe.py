"""``hetpipe``: pipelined virtual workers on heterogeneous devices, Wave Synchronous Parallel."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm.partition import TensorSpec
from ..errors import ConfigError
from ..launch.layout import Layout
from ..pipeline.allocation import (
    POLICIES,
    HetPipePlan,
    VirtualWorker,
    allocate,
    count_virtual_workers,
    plan_hetpipe,
)
from ..pipeline.asyncpipe import AsyncPipeline
from ..pipeline.devices import Cluster, homogeneous
from ..pipeline.emulation import clock_of
from ..pipeline.profile import ModelProfile, layers_of, optimizer_state_factor, profile_model
from ..pipeline.stage import Stage, StageSpec
from ..pipeline.wsp import WaveSync
from ..ps.store import optimizer_spec
from .base import LossFn, Strategy, register

__all__ = ["HetPipe", "HetPipeOptions"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class HetPipeOptions:
    """HetPipe's options (flags ``--policy``, ``--inflight``, ``--staleness``).

    Args:
        policy: how devices form virtual workers: ``np``, ``ed`` or ``hd`` (default).
        inflight: N_m, minibatches in flight per virtual worker (default: the
            partitioner's choice); local staleness is N_m - 1.
        staleness: D, the most waves a virtual worker may run ahead of the slowest
            (default 0: a barrier every wave).
        predict: stages whose gradients arrive late (N_m > 1) run forward and backward on
            the weights predicted after the updates in flight (default True; False is the
            paper's semantics). See :mod:`polytrain.pipeline.predict`.
        lag_lr: the learning-rate factor of a stage whose gradients arrive late (lag >= 1:
            with N_m > 1 the first stages), 0 < F <= 1 (default 0.25; 1 is the paper). With
            Adam a gradient one update late is stable only in much flatter regions; see
            :class:`polytrain.pipeline.AsyncPipeline`.
        server_optimizer: the parameter servers run the optimizer, one step per minibatch
            on the sum of every virtual worker's gradients, and stages push gradients
            (default True); False is the paper: each virtual worker's optimizer makes its
            updates and stages push their sum every wave.
    """

    policy: str = field(default="hd", metadata={
        "help": "how devices form virtual workers: np (one per machine), ed (one device of "
                "every machine), hd (fast and slow machines paired; default)",
        "choices": POLICIES})
    inflight: int | None = field(default=None, metadata={
        "help": "N_m, minibatches in flight per virtual worker (default: the partitioner's "
                "choice)", "metavar": "N_m"})
    staleness: int = field(default=0, metadata={
        "help": "how many clocks a worker may run ahead of the slowest (hetpipe: D, in "
                "waves; default 0)", "metavar": "D"})
    predict: bool = field(default=True, metadata={
        "help": "hetpipe: run every forward on the live weights, as the paper does "
                "(default: a stage whose gradients arrive late runs on the weights predicted "
                "after the updates in flight)"})
    lag_lr: float = field(default=0.25, metadata={
        "help": "hetpipe: learning-rate factor of a stage whose gradients arrive late "
                "(N_m > 1: the first stages; default 0.25, 1 is the paper)", "metavar": "F"})
    server_optimizer: bool = field(default=True, metadata={
        "help": "hetpipe: let each virtual worker's optimizer make the updates and push "
                "their sum every wave, as the paper does (default: the servers run the "
                "optimizer on every minibatch's gradients summed over the virtual workers)"})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown allocation policy {self.policy!r}; the policies are: "
                              f"{', '.join(POLICIES)}", "pass --policy np, ed or hd")
        if self.inflight is not None and self.inflight < 1:
            raise ConfigError(f"--inflight (N_m) must be at least 1 (got {self.inflight})",
                              "pass --inflight 2, or leave it out to let the partitioner choose")
        if not 0 < self.lag_lr <= 1:
            raise ConfigError(f"--lag-lr must be in (0, 1] (got {self.lag_lr})",
                              "pass --lag-lr 0.25, or 1 for the paper's learning rate on "
                              "every stage")
        if self.staleness < 0:
            raise ConfigError(f"--staleness (D) must be 0 or more (got {self.staleness})",
                              "pass --staleness 0 for a barrier every wave")


@register
class HetPipe(Strategy):
    """HetPipe (Park et al., USENIX ATC 2020): virtual workers of pipelined stages, joined by WSP.

    Devices (``--devices``) are grouped into virtual workers (VWs) by an
    allocation policy; the model's layers are cut into one stage per device
    of a VW by the exact partitioner, which also picks N_m. Each VW trains
    its slice of every global batch through HetPipe's asynchronous pipeline
    (updates per minibatch, weight stashing, N_m in flight). Each stage pushes
    every minibatch's gradient to the parameter servers, whose optimizer steps
    on their sum over the VWs (``--no-server-optimizer``: every N_m
    minibatches, a wave, each stage pushes its wave's update, as the paper),
    and pulls the global weights every wave, at most D waves ahead of the
    slowest VW. D = 0 and N_m = 1 is synchronous training on the global batch
    (with the paper's pushes: for plain SGD only).

    Example::

        polytrain train --strategy hetpipe --devices "m0:fast*2,m1:slow*2" --servers 1 \\
            --policy ed --staleness 1

    ``train_step`` returns the loss on each VW's last stage and None elsewhere;
    ``state_dict`` drains the pipelines, waits for everyone's last wave and
    gathers the stages of VW 0 on worker 0.
    """

    name = "hetpipe"
    Options = HetPipeOptions

    @classmethod
    def uses_servers(cls, options: Any) -> bool:
        return True

    @classmethod
    def check_layout(cls, layout: Layout, options: Any) -> None:
        if layout.servers + layout.colocated == 0:
            raise ConfigError("strategy 'hetpipe' keeps the global weights on parameter "
                              "servers (Wave Synchronous Parallel), but the run has none",
                              "pass --servers 1 (or more)")
        count_virtual_workers(layout.workers, layout.nodes, options.policy)

    @classmethod
    def replicas(cls, layout: Layout, options: Any) -> int:
        return count_virtual_workers(layout.workers, layout.nodes, options.policy)

    @classmethod
    def check_devices(cls, cluster: Any, profile: Callable[[], ModelProfile], layout: Layout,
                      options: Any, *, batch_size: int, optimizer: str) -> str | None:
        if cluster is None:
            cluster = homogeneous(layout.workers, layout.nodes)
        plan = plan_hetpipe(cluster, profile(), policy=options.policy, global_batch=batch_size,
                            state_factor=optimizer_state_factor(optimizer),
                            inflight=options.inflight, staleness=options.staleness)
        return plan.describe()

    def __init__(self, ctx: Any, options: HetPipeOptions) -> None:
        super().__init__(ctx, options)
        self.plan: HetPipePlan | None = None
        self.pipe: AsyncPipeline | None = None
        self.stage: Stage | None = None
        self.vw = 0
        self.stage_index = 0
        self.virtual_workers: tuple[VirtualWorker, ...] = ()

    # -- set-up -----------------------------------------------------------------------------

    def _cluster(self) -> Cluster:
        ctx = self.ctx
        assert ctx is not None
        if isinstance(ctx.cluster, Cluster):
            return ctx.cluster
        return homogeneous(ctx.num_workers, ctx.num_nodes)

    def _label(self, vw: int, stage: int, rank: int) -> str:
        assert self.ctx is not None
        return (f"virtual worker {vw} stage {stage} (rank {rank}, machine "
                f"{self.ctx.topology.machine(rank)})")

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        self.virtual_workers = allocate(self._cluster(), self.options.policy)
        vw_of: dict[int, tuple[int, int]] = {}
        for vw in self.virtual_workers:
            for j, d in enumerate(vw.devices):
                vw_of[d.index] = (vw.index, j)
        self.vw, self.stage_index = vw_of[ctx.worker_index]
        ctx.set_label(f"virtual worker {self.vw} stage {self.stage_index}")
        mine = self.virtual_workers[self.vw]
        self.ranks = [ctx.topology.workers[d.index] for d in mine.devices]
        # Activations and gradients share the point-to-point group with the servers' traffic
        # (tags of their own): point-to-point needs only pairs, which it already connects.
        self.transport = ctx.transport
        self.model = model
        self.base_optimizer = optimizer
        return model, optimizer

    @property
    def replica(self) -> tuple[int, int]:
        return self.vw, len(self.virtual_workers)

    @property
    def shows_progress(self) -> bool:
        """The last stage of virtual worker 0: it computes the loss."""
        return self.vw == 0 and self.stage_index == len(self.virtual_workers[0].devices) - 1

    def _setup(self, inputs: torch.Tensor, loss_fn: LossFn) -> AsyncPipeline:
        """Plan and build this process's stage at the first step (when the minibatch is known)."""
        ctx = self.ctx
        assert ctx is not None
        count = len(self.virtual_workers)
        profile = profile_model(self.model, inputs[:1])
        plan = plan_hetpipe(self._cluster(), profile, policy=self.options.policy,
                            global_batch=inputs.shape[0] * count,
                            state_factor=optimizer_state_factor(self.base_optimizer),
                            inflight=self.options.inflight, staleness=self.options.staleness)
        self.plan = plan
        if ctx.worker_index == 0:
            log.info("%s", plan.describe())
        pipeline = plan.pipelines[self.vw]
        j = self.stage_index
        layers = layers_of(self.model)
        a, e = pipeline.bounds[j], pipeline.bounds[j + 1]
        module = nn.Sequential(OrderedDict(layers[a:e]))
        devices = self.virtual_workers[self.vw].devices
        cluster = self._cluster()
        first, last = j == 0, j == len(devices) - 1
        spec = StageSpec(
            index=j, count=len(devices),
            prev=None if first else self.ranks[j - 1],
            next=None if last else self.ranks[j + 1],
            label=self._label(self.vw, j, self.ranks[j]),
            prev_label="" if first else self._label(self.vw, j - 1, self.ranks[j - 1]),
            next_label="" if last else self._label(self.vw, j + 1, self.ranks[j + 1]),
            input_shape=profile.input_shape if first else profile.layers[a - 1].out_shape,
            input_dtype=profile.input_dtype if first else profile.layers[a - 1].out_dtype,
            link_prev=0.0 if first else cluster.bandwidth(devices[j - 1], devices[j]),
            link_next=0.0 if last else cluster.bandwidth(devices[j], devices[j + 1]))
        self.stage = Stage(spec, module, self.transport, loss_fn=loss_fn,
                           clock=clock_of(self.model))
        optimizer, sources, groups = self._stage_optimizer()
        specs = [TensorSpec.of(n, p) for n, p in self.model.named_parameters()]
        index = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        base = self.base_optimizer
        wsp = WaveSync(ctx, specs, {index[n]: i for i, n in enumerate(self.stage.names)},
                       self.stage.params, virtual_workers=count,
                       staleness=self.options.staleness, inflight=plan.inflight,
                       optimizer=[optimizer_spec(base, i) for i in sources]
                       if self.options.server_optimizer else None, groups=groups)
        wsp.start(initialise=self.vw == 0)
        return AsyncPipeline(self.stage, optimizer, inflight=plan.inflight,
                             update_scale=1.0 / count, wsp=wsp, predict=self.options.predict,
                             source=base, sources=sources, lag_lr=self.options.lag_lr)

    def _stage_optimizer(self) -> tuple[torch.optim.Optimizer, list[int], list[int]]:
        """The user's optimizer over this stage's parameters: its class, and one group for
        each of its groups that holds some (with their settings, which it follows every
        minibatch). Returns it, the user's group each of its groups follows, and each
        stage parameter's group."""
        assert self.stage is not None
        base = self.base_optimizer
        mine = {id(p): i for i, p in enumerate(self.stage.params)}
        groups: list[dict[str, Any]] = []
        sources: list[int] = []
        group_of: dict[int, int] = {}
        for i, group in enumerate(base.param_groups):
            params = [p for p in group["params"] if id(p) in mine]
            if not params:
                continue
            for p in params:
                group_of[mine[id(p)]] = len(groups)
            settings = {k: v for k, v in group.items() if k != "params"}
            if "foreach" in settings:  # one call per step for all tensors: it runs every minibatch
                settings["foreach"] = settings["foreach"] is not False and not settings.get("fused")
            groups.append({**settings, "params": params})
            sources.append(i)
        missing = [n for i, n in enumerate(self.stage.names) if i not in group_of]
        if missing:
            raise ConfigError(f"hetpipe: the optimizer does not hold the parameters "
                              f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                              f"of {self.stage.spec.label}",
                              "give the optimizer every parameter that trains (model."
                              "parameters()), or set requires_grad=False on the others")
        kind: Any = type(base)  # the user's class, built on this stage's share of its groups
        return kind(groups), sources, [group_of[i] for i in range(len(self.stage.params))]

    # -- training ---------------------------------------------------------------------------

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> float | None:
        if self.pipe is None:
            self.pipe = self._setup(inputs, loss_fn)
        return self.pipe.feed(inputs, targets)

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Drain, wait for every VW's last wave, and gather VW 0's stages on worker 0."""
        ctx = self.ctx
        assert ctx is not None
        if self.pipe is not None:
            self.pipe.drain()
        own: dict[str, torch.Tensor] = {}
        if self.stage is not None:
            own = {k: v.detach().cpu().clone() for k, v in self.stage.module.state_dict().items()}
        elif self.pipe is None:  # never stepped: the weights are the initial ones everywhere
            own = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        parts: list[Any] = [None] * ctx.num_workers if ctx.worker_index == 0 else []
        dist.gather_object(own if self.vw == 0 else None,
                           parts if ctx.worker_index == 0 else None,
                           dst=ctx.topology.workers[0], group=ctx.groups.workers)
        if ctx.worker_index != 0:
            return own
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part or {})
        return {k: merged[k] for k in model.state_dict()}

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.drain()
        if self.stage is not None:
            self.stage.close()
