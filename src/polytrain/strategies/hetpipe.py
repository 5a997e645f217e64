"""``hetpipe``: pipelined virtual workers on heterogeneous devices, Wave Synchronous Parallel."""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..emulation.clock import clock_of
from ..emulation.devices import Cluster, homogeneous
from ..emulation.profile import ModelProfile, layers_of, optimizer_state_factor
from ..errors import ConfigError, at_least
from ..launch.layout import Layout
from ..pipeline.allocation import (
    POLICIES,
    HetPipePlan,
    VirtualWorker,
    allocate,
    check_batch,
    check_policy,
    count_virtual_workers,
    plan_hetpipe,
    roles_of,
)
from ..pipeline.assembly import (
    check_cuts,
    check_layer_costs,
    check_untied,
    costs_record,
    fused_keys,
    layer_costs_field,
    layer_of,
    layer_profile,
    make_stage,
    stage_optimizer,
)
from ..pipeline.asyncpipe import AsyncPipeline, lag_settings, stage_lag
from ..pipeline.stage import Stage
from ..pipeline.wsp import WaveSync, model_placement
from ..ps.settings import optimizer_spec
from ..runtime import Context
from ..tensors import host_state
from .base import LossFn, Strategy, register, saved_option, trained_already

__all__ = ["HetPipe", "HetPipeOptions"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class HetPipeOptions:
    """HetPipe's options (flags ``--policy``, ``--inflight``, ``--staleness``).

    Args:
        policy: how devices form virtual workers: ``np``, ``ed``, ``hd`` (default) or ``bd``
            (beyond HetPipe: every device runs a stage of two virtual workers that go in
            opposite directions, each with one minibatch in flight; see
            :mod:`polytrain.pipeline.allocation`).
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
        lag_beta2: Adam's second-moment decay on a stage whose gradients arrive late,
            0 < B < 1 (default 0.9; None keeps the optimizer's, as the paper does): the
            step shrinks soon after the late gradients start to swing, in the coordinates
            that swing. Optimizers without ``betas`` are left alone.
        layer_costs: what the partitioner balances: ``flops`` (default; what emulated
            devices charge, at each device's rate) or ``measured`` (each layer timed on the
            workers' devices at the first step, then at each device's rate:
            :func:`polytrain.pipeline.assembly.layer_profile`).
        server_optimizer: the parameter servers run the optimizer, one step per minibatch
            on the sum of every virtual worker's gradients, and stages push gradients
            (default True); False is the paper: each virtual worker's optimizer makes its
            updates and stages push their sum every wave.
    """

    policy: str = field(default="hd", metadata={
        "help": "how devices form virtual workers: np (one per machine), ed (one device of "
                "every machine), hd (fast and slow machines paired; default), bd (two "
                "machines: ed's virtual workers and twins running the other way, N_m = 1)",
        "choices": POLICIES})
    inflight: int | None = field(default=None, metadata={
        "help": "N_m, minibatches in flight per virtual worker (default: the partitioner's "
                "choice)", "metavar": "N_m"})
    staleness: int = field(default=0, metadata={
        "help": "D, how many waves a virtual worker may run ahead of the slowest (default "
                "0: a barrier every wave)", "metavar": "D"})
    predict: bool = field(default=True, metadata={
        "help": "hetpipe: run every forward on the live weights, as the paper does "
                "(default: a stage whose gradients arrive late runs on the weights predicted "
                "after the updates in flight)"})
    lag_lr: float = field(default=0.25, metadata={
        "help": "hetpipe: learning-rate factor of a stage whose gradients arrive late "
                "(N_m > 1: the first stages; default 0.25, 1 is the paper)", "metavar": "F"})
    lag_beta2: float | None = field(default=0.9, metadata={
        "help": "hetpipe: Adam's second-moment decay (beta2) on a stage whose gradients "
                "arrive late (N_m > 1: the first stages; default 0.9, 0.999 or the "
                "optimizer's own value keeps it)", "metavar": "B"})
    layer_costs: str = layer_costs_field()
    server_optimizer: bool = field(default=True, metadata={
        "help": "hetpipe: let each virtual worker's optimizer make the updates and push "
                "their sum every wave, as the paper does (default: the servers run the "
                "optimizer on every minibatch's gradients summed over the virtual workers)"})

    def __post_init__(self) -> None:
        check_policy(self.policy)
        check_layer_costs(self.layer_costs)
        if self.inflight is not None:
            at_least("--inflight (N_m)", self.inflight,
                     "pass --inflight 2, or leave it out to let the partitioner choose")
        if not 0 < self.lag_lr <= 1:
            raise ConfigError(f"--lag-lr must be in (0, 1] (got {self.lag_lr})",
                              "pass --lag-lr 0.25, or 1 for the paper's learning rate on "
                              "every stage")
        if self.lag_beta2 is not None and not 0 < self.lag_beta2 < 1:
            raise ConfigError(f"--lag-beta2 must be in (0, 1) (got {self.lag_beta2})",
                              "pass --lag-beta2 0.9, or the optimizer's own beta2 "
                              "(0.999 for Adam) to leave it alone")
        at_least("--staleness (D)", self.staleness, "pass --staleness 0 for a barrier every wave",
                 minimum=0)


@register
class HetPipe(Strategy[HetPipeOptions]):
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

    Driven through the step API (``polytrain.distribute(..., loss_fn=...)``, then
    ``trainer.step(x, y)``); a step returns the loss on each VW's last stage and None elsewhere;
    ``state_dict`` drains the pipelines, waits for everyone's last wave and
    gathers the stages of VW 0 on worker 0; training may go on after it (a checkpoint).
    """

    name = "hetpipe"
    Options = HetPipeOptions
    pipeline = True
    even_machines = True

    @classmethod
    def uses_servers(cls, options: HetPipeOptions) -> bool:
        return True

    @classmethod
    def check_layout(cls, layout: Layout, options: HetPipeOptions) -> None:
        if layout.servers + layout.colocated == 0:
            raise ConfigError("strategy 'hetpipe' keeps the global weights on parameter "
                              "servers (Wave Synchronous Parallel), but the run has none",
                              "pass --servers 1 (or more)")
        super().check_layout(layout, options)

    @classmethod
    def check_model(cls, model: nn.Module, layout: Layout, options: HetPipeOptions) -> None:
        # The stages per virtual worker depend on the machines' sizes, not their types.
        vws = allocate(homogeneous(layout.workers, layout.nodes), options.policy)
        check_untied(model, cls.name, max(len(vw.devices) for vw in vws))
        _check_in_layers(model, cls.name)

    @classmethod
    def check_optimizer(cls, optimizer: torch.optim.Optimizer, options: HetPipeOptions) -> None:
        """The servers' optimizer (the default) is built again on the servers from each
        parameter group's spec: refuse one they cannot run before any process trains."""
        if options.server_optimizer:
            with _server_optimizer_hint(True):
                for group in range(len(optimizer.param_groups)):
                    optimizer_spec(optimizer, group)

    @classmethod
    def check_machines(cls, layout: Layout, options: HetPipeOptions) -> None:
        count_virtual_workers(layout.workers, layout.nodes, options.policy)

    @classmethod
    def replicas(cls, layout: Layout, options: HetPipeOptions) -> int:
        return count_virtual_workers(layout.workers, layout.nodes, options.policy)

    @classmethod
    def check_resume(cls, saved: Mapping[str, Any], layout: Layout,
                     options: HetPipeOptions) -> None:
        """Each worker's checkpoint holds its stage of its virtual worker: the same workers,
        machines and policy cut the same stages (the devices are checked on load)."""
        super().check_resume(saved, layout, options)
        policy = saved_option(cls, saved, "policy")
        nodes = int(saved.get("nodes", layout.nodes))
        if (policy, nodes) != (options.policy, layout.nodes):
            raise ConfigError(f"strategy 'hetpipe' cannot resume a checkpoint of --policy "
                              f"{policy} on {nodes} machines as --policy {options.policy} on "
                              f"{layout.nodes}: each worker's state is its stage of its virtual "
                              f"worker, and they would be cut otherwise",
                              f"resume with --policy {policy} --nodes {nodes}")
        # The optimizer's state is the servers' with it and the stages' without: a resume
        # that switched would start the optimizer afresh.
        cls.refuse_other_options(saved, options, ["server_optimizer"],
                                 "a checkpoint's optimizer state")
        # The stages' cuts: FLOPs, or the times the checkpoint keeps.
        cls.refuse_other_options(saved, options, ["layer_costs"], "a checkpoint's stages")

    @classmethod
    def check_devices(cls, cluster: Any, profile: Callable[[], ModelProfile], layout: Layout,
                      options: HetPipeOptions, *, batch_size: int,
                      optimizer: str) -> str | None:
        if cluster is None:
            cluster = homogeneous(layout.workers, layout.nodes)
        plan = plan_hetpipe(cluster, profile(), policy=options.policy, global_batch=batch_size,
                            state_factor=optimizer_state_factor(optimizer),
                            inflight=options.inflight, staleness=options.staleness)
        if options.layer_costs == "measured":
            # The stages re-plan at the first step (_setup), which prints that plan.
            return (plan.describe() + "\n  This plan is by FLOPs: with --layer-costs measured "
                    "the run re-plans the cuts" + ("" if options.inflight is not None
                                                   else " and N_m")
                    + " from the layers' times measured at its first step (a resumed run: "
                    "its checkpoint's) and prints that plan then.")
        return plan.describe()

    def __init__(self, ctx: Context | None, options: HetPipeOptions) -> None:
        super().__init__(ctx, options)
        self.plan: HetPipePlan | None = None
        self.roles: list[_Role] = []
        self.started = False
        self.virtual_workers: tuple[VirtualWorker, ...] = ()
        self.resume_states: list[list[torch.Tensor] | None] | None = None  # per lane
        self.resume_optimizers: list[dict[str, Any] | None] | None = None  # per lane
        #: ``--layer-costs measured``: the layers' seconds per sample (forward, backward)
        #: this run planned with, and those of the run it resumes
        self.layer_seconds: list[tuple[float, float]] | None = None
        self.resume_seconds: list[tuple[float, float]] | None = None
        self.loaded: dict[str, Any] = {}  # what a load gave, for a save before the first step
        self._notices: list[str] = []  # the measured costs' plan, for the run's output

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
        # One stage here, or with policy bd two (of twin VWs, each on its own copy of the
        # weights: the twin's copy is made now, while both are the initial weights).
        self.roles = [_Role(vw, j, model if k == 0 else copy.deepcopy(model))
                      for k, (vw, j) in enumerate(roles_of(self.virtual_workers,
                                                           ctx.worker_index))]
        ctx.set_label(" and ".join(f"virtual worker {r.vw} stage {r.index}" for r in self.roles))
        # Activations and gradients share the point-to-point group with the servers' traffic
        # (tags of their own): point-to-point needs only pairs, which it already connects.
        self.transport = ctx.transport
        self.model = model
        self.base_optimizer = optimizer
        #: Whether each parameter trained at the first step: the stages, their optimizers and
        #: the servers' keys (:func:`fused_keys`) are built by it then
        #: (:func:`_check_still_trained`).
        self.trained_at_setup: list[tuple[str, nn.Parameter, bool]] = []
        return model, optimizer

    @property
    def replica(self) -> tuple[int, int]:
        # With policy bd a device's two VWs (twins, consecutive) share its slice of the batch.
        share = len(self.roles)
        return self.roles[0].vw // share, len(self.virtual_workers) // share

    @property
    def shows_progress(self) -> bool:
        """The last stage of virtual worker 0: it computes the loss."""
        last = len(self.virtual_workers[0].devices) - 1
        return any(r.vw == 0 and r.index == last for r in self.roles)

    def notices(self) -> list[str]:
        out, self._notices = self._notices, []
        return out

    def metrics(self) -> dict[str, Any]:
        """The plan the run used (``hetpipe_plan``) and, measured, the layers' costs."""
        if self.plan is None:  # no step ran
            return {}
        out: dict[str, Any] = {"hetpipe_plan": self.plan.record()}
        if self.layer_seconds is not None:
            out["layer_costs_ms"] = costs_record(self.plan.pipelines[0].layers,
                                                 self.layer_seconds)
        return out

    def _setup(self, inputs: torch.Tensor, loss_fn: LossFn) -> None:
        """Plan and build this process's stages at the first step (when the minibatch is known)."""
        ctx = self.ctx
        assert ctx is not None
        count = len(self.virtual_workers)
        # What trains is fixed now, not at the wrap: a twin's copy (policy bd, made then)
        # follows the model's freezing since.
        self.trained_at_setup = [(n, p, p.requires_grad)
                                 for n, p in self.model.named_parameters()]
        for role in self.roles:
            if role.model is not self.model:
                for name, p in role.model.named_parameters():
                    p.requires_grad_(self.model.get_parameter(name).requires_grad)
        # Measured, or as the run this one resumes measured them (its cuts are the saved
        # stages'): a new measurement could cut them otherwise.
        profile, self.layer_seconds = layer_profile(
            self.model, inputs, costs=self.options.layer_costs, group=ctx.groups.workers,
            owner=self.name, seconds=self.resume_seconds)
        plan = plan_hetpipe(self._cluster(), profile, policy=self.options.policy,
                            global_batch=inputs.shape[0] * count // len(self.roles),
                            state_factor=optimizer_state_factor(self.base_optimizer),
                            inflight=self.options.inflight, staleness=self.options.staleness)
        self.plan = plan
        if ctx.worker_index == 0:
            log.info("%s", plan.describe())
        if self.layer_seconds is not None:  # polytrain train printed the FLOPs' plan
            self._notices.append("hetpipe: the plan from the layers' measured times "
                                 "(--layer-costs measured):\n" + plan.describe())
        for i, pipe in enumerate(plan.pipelines):  # every worker alike, before any stage
            check_cuts(self.model, profile, pipe.bounds, label=f"virtual worker {i}'s pipeline")
        fused = fused_keys(self.model, self.base_optimizer)
        placement = model_placement(ctx, [spec for spec, _ in fused])  # one for both lanes
        late = self._late_keys(plan, fused)
        lag_lr, lag_beta2 = self.options.lag_lr, self.options.lag_beta2
        clock = clock_of(self.model)  # the twin's copy runs on the same device
        stages = [self._stage(role, plan, profile, loss_fn, clock) for role in self.roles]
        self._check_saved_stages(stages)
        for lane, (role, stage) in enumerate(zip(self.roles, stages)):
            optimizer, sources, groups = stage_optimizer(self.base_optimizer, self.model, stage)
            local = {n: i for i, n in enumerate(stage.names)}
            held = [k for k, (_, names) in enumerate(fused) if names[0] in local]
            buckets = [[local[n] for n in fused[k][1]] for k in held]
            base = self.base_optimizer
            with _server_optimizer_hint(self.options.server_optimizer):
                wsp = WaveSync(ctx, placement, {k: i for i, k in enumerate(held)},
                               stage.params, virtual_workers=count,
                               staleness=self.options.staleness, inflight=plan.inflight,
                               optimizer=[optimizer_spec(base, i) for i in sources]
                               if self.options.server_optimizer else None,
                               groups=[groups[b[0]] for b in buckets], lane=lane,
                               buckets=buckets, late=late,
                               lag=lambda values: lag_settings(values, lag_lr, lag_beta2))
                states = self.resume_states[lane] if self.resume_states else None
                # What the user's optimizer held at distribute (stage_optimizer copied it).
                user_state = [optimizer.state.get(p, {}) for p in stage.params]
                wsp.start(initialise=role.vw == 0, states=states if role.vw == 0 else None,
                          optimizer_state=user_state)
            role.wsp = wsp
            role.stage = stage
            role.pipe = AsyncPipeline(stage, optimizer, inflight=plan.inflight,
                                      update_scale=1.0 / count, wsp=wsp,
                                      predict=self.options.predict, source=base,
                                      sources=sources, lag_lr=self.options.lag_lr,
                                      lag_beta2=self.options.lag_beta2,
                                      unused_hint=_UNUSED_HINT + (
                                          f"; with one virtual worker, {_KEEP_ON_STAGES} "
                                          f"leaves it alone" if self.options.server_optimizer
                                          else ""))
            saved = self.resume_optimizers[lane] if self.resume_optimizers else None
            if saved is not None:
                optimizer.load_state_dict(saved["optimizer"])
        self.started = True

    def _check_saved_stages(self, stages: list[Stage]) -> None:
        """Refuse, on every worker and before any state reaches the servers, a resume whose
        stages are cut otherwise than the checkpoint's (other --devices, --batch-size or
        --inflight can move a cut): a stage's saved state is its layers'. With the servers'
        optimizer, also one that numbers the virtual workers otherwise (other --devices can):
        virtual worker 0's stages save the servers' state and load it."""
        ctx = self.ctx
        assert ctx is not None
        mine = None
        for lane, (role, stage) in enumerate(zip(self.roles, stages)):
            saved = self.resume_optimizers[lane] if self.resume_optimizers else None
            mine = (_stage_moved(saved, role, stage.names, ctx.rank,
                                 servers=self.resume_states is not None)
                    if saved is not None else None)
            if mine is not None:
                break
        said: list[str | None] = [None] * ctx.num_workers
        dist.all_gather_object(said, mine, group=ctx.groups.workers)
        first = next((m for m in said if m is not None), None)
        if first is not None:
            raise ConfigError(first, "resume with the checkpoint's --policy, --nodes, "
                                     "--devices, --batch-size and --inflight, or start from "
                                     "its model.pt with --init")

    def _late_keys(self, plan: HetPipePlan, fused: list[tuple[Any, list[str]]]) -> set[int]:
        """The servers' keys of layers on a late stage (lag >= 1) of any virtual worker:
        the servers step them with the late settings (``--lag-lr``, ``--lag-beta2``).
        Virtual workers of other device types cut the model elsewhere, so a layer may be
        late in one and not in another; a key's pushers must agree on its settings."""
        names = [n for n, _ in layers_of(self.model)]
        late = {names[layer] for pipe in plan.pipelines
                for j, (a, e) in enumerate(zip(pipe.bounds, pipe.bounds[1:]))
                if stage_lag(plan.inflight, j) for layer in range(a, e)}
        return {k for k, (_, members) in enumerate(fused)
                if layer_of(members[0], names) in late}

    def _stage(self, role: _Role, plan: HetPipePlan, profile: ModelProfile, loss_fn: LossFn,
               clock: Any) -> Stage:
        devices = self.virtual_workers[role.vw].devices
        assert self.ctx is not None
        ranks = [self.ctx.topology.workers[d.index] for d in devices]
        cluster = self._cluster()
        links = [cluster.bandwidth(a, b) for a, b in zip(devices, devices[1:])]
        labels = [self._label(role.vw, j, r) for j, r in enumerate(ranks)]
        return make_stage(role.model, plan.pipelines[role.vw].bounds, role.index, ranks=ranks,
                          labels=labels, links=links, profile=profile,
                          transport=self.transport, loss_fn=loss_fn, clock=clock,
                          cuts_move=False)  # (planned once: a resume keeps them)

    # -- training ---------------------------------------------------------------------------

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> float | None:
        if not self.started:
            self._setup(inputs, loss_fn)  # (the plan refuses the first step's batch)
        # On every worker before any stage runs, so every stage refuses the step alike.
        _check_still_trained(self.trained_at_setup)
        if inputs.shape[0] % len(self.roles):  # policy bd's twins: every step's too
            count = len(self.virtual_workers)
            check_batch(inputs.shape[0] * count // len(self.roles), count, self.options.policy)
        if len(self.roles) == 1:
            pipe = self.roles[0].pipe
            assert pipe is not None
            return pipe.feed(inputs, targets)
        # Policy bd: twin VWs, each with half of this slice (the VW of lower index first).
        # Forwards by stage order, then the backwards in reverse: on two devices, device A
        # runs F(VW, stage 0), F+B(twin, stage 1), B(VW, stage 0) while device B runs
        # F(twin, stage 0), F+B(VW, stage 1), B(twin, stage 0): never stale, and with balanced
        # cuts neither device waits for the other (the period is the cost model's).
        # The last stage's update runs on a helper thread while the device runs the other
        # stage's backward (a GPU would queue it behind; emulated, it would wait in line).
        half = inputs.shape[0] // len(self.roles)
        order = sorted(self.roles, key=lambda r: r.index)
        loss: float | None = None
        for role in order:
            assert role.pipe is not None
            k = self.roles.index(role)
            out = role.pipe.forward(inputs[k * half:(k + 1) * half],
                                    targets[k * half:(k + 1) * half])
            if self._is_last(role):
                role.pipe.catch_up(background=True)
            loss = out if out is not None else loss
        for role in reversed(order):
            assert role.pipe is not None
            if not self._is_last(role):
                role.pipe.catch_up()
        return loss

    def _is_last(self, role: _Role) -> bool:
        return role.index == len(self.virtual_workers[role.vw].devices) - 1

    def _drain(self) -> None:
        for role in self.roles:
            if role.pipe is not None:
                role.pipe.drain()

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Drain, wait for every VW's last wave, and gather the stages of VW 0 on worker 0."""
        ctx = self.ctx
        assert ctx is not None
        self._drain()
        own: dict[str, torch.Tensor] | None = None
        for role in self.roles:
            if role.vw == 0 and role.stage is not None:
                own = host_state(role.stage.module.state_dict())
        if not self.started:  # never stepped: the weights are the initial ones everywhere
            own = host_state(model.state_dict())
        merged = self.gather_parts(own)
        if ctx.worker_index != 0:
            return own or {}
        return {k: merged[k] for k in model.state_dict()}

    def check_load(self) -> None:
        """Refuse a load into a trainer that has trained: its stages hold their own weights
        and optimizers, and the saved state waits for a first step that has been."""
        if self.started:
            raise trained_already("hetpipe", "its stages' weights and optimizers")

    def load_model_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """Into the model and, with policy bd, the twin's copy (made by :meth:`wrap` from the
        weights then): a twin's stage takes its layers from it at the first step."""
        for role in self.roles:
            role.model.load_state_dict(dict(state))

    def checkpoint_state(self) -> dict[str, Any]:
        """Per lane of this process: its stage's own optimizer state (which makes the updates
        with ``--no-server-optimizer``, the paper's), and, with
        the servers' optimizer, the whole state of the keys VW 0's stages hold (values,
        optimizer state such as Adam's moments and step; None: not VW 0). Called after
        :meth:`state_dict` drained, so every push is applied."""
        if not self.started:  # the stages are not built: what a load gave, if any
            return dict(self.loaded)
        state: dict[str, Any] = {"stages": [
            {"names": list(role.stage.names), "optimizer": role.pipe.optimizer.state_dict(),
             "vw": role.vw, "index": role.index}
            if role.pipe and role.stage else None for role in self.roles],
            "layer_seconds": self.layer_seconds}
        if self.options.server_optimizer:
            state["servers"] = [role.wsp.server_states() if role.vw == 0 and role.wsp else None
                                for role in self.roles]
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Keep the servers' and the stages' saved state for the first step, which declares
        the keys and builds the stages."""
        self.loaded = dict(state)
        self.resume_optimizers = state.get("stages")
        self.resume_seconds = state.get("layer_seconds")
        servers = state.get("servers")
        if servers is not None and self.options.server_optimizer:
            self.resume_states = list(servers)

    def close(self) -> None:
        self._drain()
        for role in self.roles:
            if role.stage is not None:
                role.stage.close()


def _check_in_layers(model: nn.Module, owner: str) -> None:
    """Refuse a parameter or buffer of the model itself, outside its layers (children): the
    stages hold the layers only, so it would train nowhere and the gathered weights lack it
    (``state_dict`` failed on its key at the end of the run)."""
    layers = [n for n, _ in layers_of(model)]
    if layers == [""]:  # no children: the model is its one layer
        return
    params = dict(model.named_parameters())
    for key in model.state_dict():
        if layer_of(key, layers) == "":
            kind = "parameter" if key in params else "buffer"
            raise ConfigError(f"{key!r} is a {kind} of the model itself, not of one of its "
                              f"layers (children), and strategy {owner!r} cuts the model into "
                              f"stages of its layers: no stage would hold it",
                              "move it into a layer (a child module); for a built-in "
                              "--model, pick another --model, or a strategy that is not a "
                              "pipeline")


def _check_still_trained(trained: Sequence[tuple[str, nn.Parameter, bool]]) -> None:
    """Refuse a parameter frozen or unfrozen (``requires_grad``) since the first step, given
    as (name, parameter, whether it trained then): the servers' keys, each stage's trained
    parameters and its waves' sums are fixed then, so an unfrozen one never trained on the
    servers and a frozen one went on training (pushed zeros, stepped on momentum)."""
    for name, p, was in trained:
        if p.requires_grad == was:
            continue
        change, then = (("unfrozen (requires_grad=True)", "not train it") if p.requires_grad
                        else ("frozen (requires_grad=False)", "go on training it"))
        raise ConfigError(f"parameter {name!r} was {change} after the first step: hetpipe's "
                          f"stages and servers train the parameters that were trained then, "
                          f"and would {then}", "set requires_grad before the first "
                          "trainer.step(); to change it later, save trainer.state_dict() and "
                          "distribute a new model that loads it")


def _stage_moved(saved: Mapping[str, Any], role: _Role, names: Sequence[str],
                 rank: int, *, servers: bool = False) -> str | None:
    """Why a checkpoint's stage (``saved``, of :meth:`HetPipe.checkpoint_state`) cannot resume
    as ``role``'s stage holding ``names`` on worker ``rank``; None when it holds the same.
    Each side is named by its own place (a checkpoint from before it kept its place: by
    the worker alone). With ``servers`` (the checkpoint holds the servers' optimizer state)
    the stage must also keep its virtual worker: only virtual worker 0's stages save that
    state and load it, each its own lane's."""
    was = (f"stage {saved['index']} of virtual worker {saved['vw']} (worker rank {rank})"
           if "vw" in saved and "index" in saved else f"stage of worker rank {rank}")
    if saved["names"] == list(names):
        if servers and "vw" in saved and saved["vw"] != role.vw and 0 in (saved["vw"], role.vw):
            return (f"the checkpoint's {was} is this run's stage {role.index} of virtual "
                    f"worker {role.vw}: the servers' optimizer state is saved and loaded by "
                    f"virtual worker 0's stages, and would start afresh")
        return None
    return (f"the checkpoint's {was} held {_span(saved['names'])}, this run's stage "
            f"{role.index} of virtual worker {role.vw} holds {_span(list(names))}: the "
            f"stages differ")


def _span(names: list[str]) -> str:
    """A stage's parameters in a few words: the first and last, and how many."""
    return f"{names[0]} .. {names[-1]} ({len(names)} tensors)" if names else "no parameters"


@contextlib.contextmanager
def _server_optimizer_hint(on: bool) -> Iterator[None]:
    """The parameter service's refusals of the servers' optimizer, with HetPipe's way out."""
    try:
        yield
    except ConfigError as e:
        if not on:
            raise
        raise ConfigError(e.what, f"{e.hint or 'fix the optimizer'}; or "
                                  f"{_KEEP_ON_STAGES}") from None


#: What to do about a trained parameter that no step's minibatch reaches (asyncpipe).
_UNUSED_HINT = ("freeze a parameter that is not to train (requires_grad_(False)) before the "
                "first trainer.step()")
#: HetPipe's way out of what only the servers' optimizer does.
_KEEP_ON_STAGES = ("keep the optimizer on the stages: --no-server-optimizer (Python: "
                   "server_optimizer=False)")


@dataclass
class _Role:
    """One stage this process runs: its virtual worker, its index, the model whose layers
    it takes (policy bd: a twin's stage takes them from a copy), and once built its stage
    and pipeline."""

    vw: int
    index: int
    model: nn.Module
    stage: Stage | None = None
    pipe: AsyncPipeline | None = None
    wsp: WaveSync | None = None
