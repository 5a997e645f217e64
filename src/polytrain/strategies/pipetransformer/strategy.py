"""``pipetransformer``: K-stage synchronous pipelines x R replicas that freeze, shorten, widen."""

from __future__ import annotations

import atexit
import copy
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ... import _env
from ...data import shard
from ...emulation.clock import clock_of
from ...emulation.devices import Cluster, homogeneous
from ...emulation.profile import ModelProfile, layers_of, optimizer_state_factor
from ...errors import ConfigError, divisors
from ...launch.launcher import SHM_ROOT
from ...launch.layout import Layout
from ...launch.network import owner_alive, owner_record
from ...optim import placed_state
from ...pipeline.assembly import (
    check_untied,
    costs_record,
    layer_profile,
    make_stage,
    stage_optimizer,
)
from ...pipeline.asyncpipe import numeric_settings
from ...pipeline.autopipe import PipePlan, fewest_stages, plan_pipe
from ...pipeline.cache import ActivationCache, expected_hits, frozen_forward
from ...pipeline.freeze import (
    GradNormTracker,
    freezable_layers,
    next_frozen,
    reference_length,
)
from ...pipeline.stage import Stage
from ...pipeline.sync import SyncPipeline
from ...runtime import Context
from ...tensors import host_copy, host_state
from ..base import LossFn, Strategy, register, trained_already
from .options import PipeTransformerOptions

__all__ = ["PipeTransformer"]

log = logging.getLogger(__name__)


def _stages(layout_workers: int, nodes: int, options: PipeTransformerOptions) -> int:
    per = layout_workers // max(1, nodes)
    return options.pipeline_stages or per


#: The counts of a cache's :class:`CacheStats` that add up over the caches a worker had
#: (its bytes are what it holds at the end).
_SERVED = ("hits", "shared_hits", "misses", "advanced")


@register
class PipeTransformer(Strategy[PipeTransformerOptions]):
    """PipeTransformer (He et al., ICML 2021): freeze converged front layers, shorten the
    pipeline, and give the freed devices to more pipeline replicas.

    R = workers / K synchronous pipelines (1F1B or GPipe micro-batches, a flush per
    step, on polytrain's stage engine) train in data parallel: each pipeline takes an
    equal slice of the global batch and every stage all-reduces its gradients with the
    same stage of the other pipelines before its optimizer steps, so with
    ``--no-freeze`` the run is synchronous training on the global batch. At each freeze
    point (AutoFreeze, :mod:`polytrain.pipeline.freeze`) the front layers whose gradient
    norms say they have stopped learning freeze; AutoPipe moves them to the first stage
    forward-only and re-cuts the rest, halving the pipeline when it can; AutoDP makes the
    freed devices new replicas, which receive the weights and optimizer state of the
    pipeline they come from (:mod:`polytrain.pipeline.autopipe`); AutoCache keeps the
    frozen front's output per sample (:mod:`polytrain.pipeline.cache`).

    Example::

        polytrain train --strategy pipetransformer --devices "m0:fast*4,m1:fast*4" \\
            --freeze-every 50 --init pretrained/final.pt --eval-every 25

    Driven through the step API; a step returns the loss on each pipeline's last stage.
    """

    name = "pipetransformer"
    Options = PipeTransformerOptions
    pipeline = True
    even_machines = True

    # -- before any process starts ----------------------------------------------------------

    @classmethod
    def check_machines(cls, layout: Layout, options: PipeTransformerOptions) -> None:
        per = layout.workers // max(1, layout.nodes)
        k = _stages(layout.workers, layout.nodes, options)
        if per % k:
            raise ConfigError(f"--pipeline-stages {k} does not divide a machine's {per} "
                              f"devices (workers {layout.workers} over {layout.nodes} "
                              f"machines): a pipeline never spans machines",
                              f"pass --pipeline-stages one of {divisors(per)}")

    #: Options that only say where the activation cache lives: a resume may change them.
    _FREE_ON_RESUME = ("cache_mb", "cache_dir", "cache_shared")

    @classmethod
    def check_resume(cls, saved: Mapping[str, Any], layout: Layout,
                     options: PipeTransformerOptions) -> None:
        """The saved plan (stages, replicas, cuts) is of its layout and options: the same
        workers, machines and planning options, or the run would be another one."""
        super().check_resume(saved, layout, options)
        if int(saved.get("nodes", layout.nodes)) != layout.nodes:
            raise ConfigError(f"strategy 'pipetransformer' cannot resume a checkpoint of "
                              f"{saved['nodes']} machines on {layout.nodes}: its pipelines' "
                              f"stages belong to their machines",
                              f"resume with --nodes {saved['nodes']}")
        cls.refuse_other_options(saved, options, [
            f.name for f in dataclasses.fields(options) if f.name not in cls._FREE_ON_RESUME],
            "a checkpoint's plan and freeze timeline")

    @classmethod
    def replicas(cls, layout: Layout, options: PipeTransformerOptions) -> int:
        return layout.workers // _stages(layout.workers, layout.nodes, options)

    @classmethod
    def check_model(cls, model: nn.Module, layout: Layout,
                    options: PipeTransformerOptions) -> None:
        n = len(layers_of(model))
        k = _stages(layout.workers, layout.nodes, options)
        check_untied(model, cls.name, k, freezing="--no-freeze (Python: freeze=False)"
                     if options.freeze else None)
        if n < k:
            raise ConfigError(f"the model has {n} layers (children) but the pipeline has {k} "
                              f"stages: every stage needs at least one",
                              "pass a smaller --pipeline-stages, or a model with more blocks")
        freezable = freezable_layers([any(True for _ in m.parameters())
                                      for _, m in layers_of(model)])
        # AutoPipe keeps a trained layer on each of the fewest stages K halves to (an odd K:
        # all of them), so no more than n - fewest layers freeze. (The batch is not known
        # here: taken to split.)
        fewest = fewest_stages(k, layout.workers // k, autodp=options.autodp)
        reach = min(freezable, n - fewest) if options.autopipe else freezable
        # The default is left alone: a model of one layer that may freeze trains as it is.
        given = options.cache_from != PipeTransformerOptions.cache_from
        if options.freeze and options.cache and given and options.cache_from > reach:
            why = (f"the model's {freezable} that may freeze (those before its last layer "
                   f"with parameters)" if reach == freezable else
                   f"the {reach} of the model's {freezable} that may freeze on {k} stages "
                   f"(AutoPipe keeps a trained layer on each of the {fewest} stages the "
                   f"pipeline halves to)")
            raise ConfigError(f"--cache-from {options.cache_from} is more layers than {why}: "
                              f"AutoCache would never cache",
                              f"pass --cache-from {reach} or less, or --no-cache"
                              if reach else "pass --no-freeze: no layer would freeze")

    @classmethod
    def check_steps(cls, options: PipeTransformerOptions, *, steps: int,
                    epoch_steps: int | None, data: str, batch_size: int) -> None:
        """AutoFreeze's freeze points default to one epoch of the data: a run without epochs,
        or shorter than one, would freeze nothing, which a run of PipeTransformer asks for
        only with ``--no-freeze``."""
        if not options.freeze:
            return
        hint = (f"pass --freeze-every N (for instance --freeze-every {max(2, steps // 5)}, "
                f"a fifth of the run), or --no-freeze to train every layer throughout"
                if steps >= 3 else "pass --no-freeze: the first freeze point comes at step 2 "
                                   "at the earliest")
        if options.freeze_every is not None:
            if options.freeze_every >= steps:  # (it trained to the end, freezing nothing)
                raise ConfigError(f"--freeze-every {options.freeze_every} puts the first "
                                  f"freeze point past the run's {steps} steps: no layer "
                                  f"would freeze", hint)
            return
        if epoch_steps is None:
            raise ConfigError("pipetransformer's freeze points default to one epoch of the "
                              "data, and --sampling random has no epochs: no layer would "
                              "freeze", hint)
        if epoch_steps >= steps:
            raise ConfigError(f"pipetransformer's freeze points default to one epoch of the "
                              f"data, and one epoch of {data} is {epoch_steps} steps of "
                              f"{batch_size}, the run {steps}: no layer would freeze", hint)
        if epoch_steps < 2:  # (as --freeze-every 1 is refused)
            raise ConfigError(f"pipetransformer's freeze points default to one epoch of the "
                              f"data, and one epoch of {data} is 1 step of {batch_size}: a "
                              f"freeze point every step has no interval to compare with the "
                              f"layers' first steps", hint)

    @classmethod
    def check_devices(cls, cluster: Any, profile: Callable[[], ModelProfile], layout: Layout,
                      options: PipeTransformerOptions, *, batch_size: int,
                      optimizer: str) -> str | None:
        prof = profile()
        k = _stages(layout.workers, layout.nodes, options)
        memory = min(d.type.memory_bytes for d in cluster.devices) if cluster else math.inf
        plan = plan_pipe(prof, step=0, frozen=0, stages=k, replicas=layout.workers // k,
                         global_batch=batch_size, micro_batches=options.micro_batches,
                         memory=memory, state_factor=optimizer_state_factor(optimizer))
        per = batch_size // plan.replicas
        _check_micro_batches(options.micro_batches, batch_size, plan.replicas, python=False)
        if per % plan.micro_batches:
            raise ConfigError(f"a replica's {per} samples cannot be cut into "
                              f"{plan.micro_batches} micro-batches",
                              f"pass a --batch-size that is a multiple of "
                              f"{plan.replicas * plan.micro_batches}")
        return "pipetransformer " + plan.describe(prof.names)

    # -- per process ------------------------------------------------------------------------

    def __init__(self, ctx: Context | None, options: PipeTransformerOptions) -> None:
        super().__init__(ctx, options)
        self.plan: PipePlan | None = None
        self.timeline: list[dict[str, Any]] = []
        self.tracker = GradNormTracker()
        self.stage: Stage | None = None
        self.pipe: SyncPipeline | None = None
        self.stage_opt: torch.optim.Optimizer | None = None
        self.sources: list[int] = []
        self.group: Any = None
        self.cache: ActivationCache | None = None
        #: What caches this worker closed served (a first stage that stopped being one).
        self._served: dict[str, int] = {}
        self._notices: list[str] = []  # new plans, for the run's output (notices())
        self.shared_cache: str | None = None  # this machine's shared AutoCache directory
        self.profile: ModelProfile | None = None
        #: ``--layer-costs measured``: each layer's seconds per sample (forward, backward)
        self.layer_seconds: list[tuple[float, float]] | None = None
        self.global_batch = 0
        self._planned = -1
        self._next_mb = 0
        self._names: list[str] = []
        self._layer_params: dict[str, list[str]] = {}
        self._resume: dict[str, Any] | None = None  # a checkpoint's state, until the 1st step
        self._resume_replan: int | None = None  # a freeze point asked for before it
        #: set by the training loop: steps in one epoch of the data (None: unknown)
        self.epoch_steps: int | None = None

    @property
    def _k0(self) -> int:
        assert self.ctx is not None
        return _stages(self.ctx.num_workers, self.ctx.num_nodes, self.options)

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        self.model = model
        self.base_optimizer = optimizer
        self.transport = ctx.transport
        self.layers = [m for _, m in layers_of(model)]
        self._names = [n for n, _ in layers_of(model)]
        for name, _ in model.named_parameters():
            self._layer_params.setdefault(name.split(".", 1)[0], []).append(name)
        k = self._k0
        ctx.set_label(f"pipeline {ctx.worker_index // k} stage {ctx.worker_index % k}")
        return model, optimizer

    @property
    def replica(self) -> tuple[int, int]:
        assert self.ctx is not None
        if self.plan is None and self._resume is not None:
            return _slice(self._resume["plan"], self.ctx.worker_index)
        if self.plan is None:
            k = self._k0
            return self.ctx.worker_index // k, self.ctx.num_workers // k
        return _slice(self.plan, self.ctx.worker_index)

    @property
    def shows_progress(self) -> bool:
        """The last stage of pipeline 0 under the plan in force (before the first step, the
        first plan's, or a resumed run's saved one): it holds a loss. Without AutoDP the
        first plan's last stage idles once the pipeline halves."""
        assert self.ctx is not None
        plan = self.plan if self.plan is not None else (self._resume or {}).get("plan")
        return self.ctx.worker_index == (plan.stages if plan is not None else self._k0) - 1

    def notices(self) -> list[str]:
        out, self._notices = self._notices, []
        return out

    @property
    def freeze_every(self) -> int | None:
        return self.options.freeze_every or self.epoch_steps

    # -- planning ---------------------------------------------------------------------------

    def _cluster(self) -> Cluster:
        assert self.ctx is not None
        if isinstance(self.ctx.cluster, Cluster):
            return self.ctx.cluster
        return homogeneous(self.ctx.num_workers, self.ctx.num_nodes)

    def _setup(self, inputs: torch.Tensor, loss_fn: LossFn) -> None:
        ctx = self.ctx
        assert ctx is not None
        self.loss_fn = loss_fn
        k = self._k0
        # Measured at about a micro-batch's size (the default plan's: 2 K per replica batch;
        # 2 samples at least, as a batch norm in training takes no fewer), or as the run
        # this one resumes measured them.
        size = max(min(2, inputs.shape[0]), inputs.shape[0] // (2 * k))
        self.profile, self.layer_seconds = layer_profile(
            self.model, inputs[:size], costs=self.options.layer_costs,
            group=ctx.groups.workers, owner=self.name,
            seconds=(self._resume or {}).get("layer_seconds"))
        self.global_batch = inputs.shape[0] * self.replica[1]  # the plan's, or a resumed one's
        if self._resume is None:  # (polytrain train refused it before any process started)
            _check_micro_batches(self.options.micro_batches, self.global_batch,
                                 self.replica[1], python=True)
        self.memory = min(d.type.memory_bytes for d in self._cluster().devices)
        self.state_factor = optimizer_state_factor(self.base_optimizer)
        if self.options.cache and self.options.cache_shared:
            self.shared_cache = _shared_directory(ctx)
        if self._resume is not None:
            self._restore(self._resume)
            self._resume = None
        else:
            if self.freeze_every is not None:  # (a resumed run's tracker has its own)
                self.tracker = GradNormTracker(
                    reference_steps=reference_length(self.freeze_every))
            plan = plan_pipe(self.profile, step=0, frozen=0, stages=k,
                             replicas=ctx.num_workers // k, global_batch=self.global_batch,
                             micro_batches=self.options.micro_batches, memory=self.memory,
                             state_factor=self.state_factor)
            self._install(plan, None)
        if self.options.freeze and self.freeze_every is None and ctx.worker_index == 0:
            # (polytrain train refuses such a run before any process starts: this is a
            # script's, whose data the strategy knows nothing of)
            log.warning("pipetransformer: no freeze points (freeze_every is not set, and no "
                        "training loop gave an epoch length), so no layer will freeze; pass "
                        "--freeze-every N (freeze_every=N to distribute()) or --sampling epoch")

    def replan(self, step: int) -> bool:
        """At a freeze point: AutoFreeze decides, AutoPipe/AutoDP re-plan, state moves."""
        every = self.freeze_every
        if self.plan is None and self._resume is not None:
            # The plan comes back with the first step's inputs: a resumed run's first step,
            # cold already.
            self._resume_replan = step
            return False
        if (self.plan is None or not self.options.freeze or every is None or step == 0
                or step % every or step == self._planned):
            return False
        self._planned = step
        ctx = self.ctx
        assert ctx is not None and self.profile is not None
        plan = self.plan
        where = plan.pipeline_of(ctx.worker_index)
        mine = self.tracker if where is not None and where[0] == 0 else GradNormTracker()
        everyone: list[Any] = [None] * ctx.num_workers
        dist.all_gather_object(everyone, mine, group=ctx.groups.workers)
        self.tracker.merge(everyone)
        # The last layer with parameters always trains (a LogSoftmax after it has none).
        freezable = freezable_layers([n in self._layer_params for n in self._names])
        ratios = self.tracker.signal(self.options.freeze_signal,
                                     self._names[plan.frozen:freezable])
        frozen = next_frozen(plan.frozen, freezable, ratios, alpha=self.options.freeze_alpha,
                             threshold=self.options.threshold)
        self.tracker.new_interval()
        new = plan_pipe(self.profile, step=step, frozen=frozen, stages=plan.stages,
                        replicas=plan.replicas, global_batch=self.global_batch, previous=plan,
                        autopipe=self.options.autopipe, autodp=self.options.autodp,
                        micro_batches=self.options.micro_batches,
                        cached=self._cache_share(step),
                        memory=self.memory, state_factor=self.state_factor)
        signal = {n: None if r is None else round(r, 4)
                  for n, r in zip(self._names[plan.frozen:freezable], ratios)}
        if (new.frozen, new.bounds, new.stages, new.replicas, new.micro_batches) == \
                (plan.frozen, plan.bounds, plan.stages, plan.replicas, plan.micro_batches):
            self.timeline.append({**plan.record(), "step": step, "grad_norm_signal": signal,
                                  "changed": False})
            return False
        self._install(new, plan, signal)
        return True

    def _cache_share(self, step: int) -> Callable[[int, int, int], float]:
        """The share of the frozen front's samples AutoCache should serve until the next
        freeze point, for a plan from ``step`` on with (frozen, stages, replicas): it caches
        from the first plan whose front was ``--cache-from`` layers, and a sample comes
        back one epoch later, to a first stage of that plan's at random (its own cache, or
        its machine's with the shared tier)."""
        ctx = self.ctx
        assert ctx is not None
        since = next((e["step"] for e in self.timeline
                      if e["bounds"][0] >= self.options.cache_from), step)

        def share(frozen: int, stages: int, replicas: int) -> float:
            if not self.options.cache or frozen < self.options.cache_from:
                return 0.0
            firsts = [ctx.topology.machine(ctx.topology.workers[r * stages])
                      for r in range(replicas)]
            if self.options.cache_shared:
                same = sum((firsts.count(m) / replicas) ** 2 for m in set(firsts))
            else:
                same = 1 / replicas
            return expected_hits(step, self.freeze_every or 1, since=since,
                                 epoch_steps=self.epoch_steps, same_cache=same)
        return share

    def _install(self, plan: PipePlan, old: PipePlan | None,
                 signal: dict[str, float | None] | None = None) -> None:
        """Switch to ``plan``: move weights and optimizer state, rebuild the stage and groups."""
        ctx = self.ctx
        assert ctx is not None and self.profile is not None
        w = ctx.worker_index
        if old is not None:
            self._hand_over(plan, old)
        self.plan = plan
        self.timeline.append({**plan.record(), "grad_norm_signal": signal or {},
                              "changed": True})
        if w == 0:
            log.info("%s", plan.describe(self.profile.names))
        if old is not None:  # (the first plan is the run's summary: polytrain train prints it)
            self._notices.append("pipetransformer: a new plan at " +
                                 plan.describe(self.profile.names))
        frozen_names = {n for layer in self._names[:plan.frozen]
                        for n in self._layer_params.get(layer, [])}
        for name, p in self.model.named_parameters():
            if name in frozen_names:
                p.requires_grad_(False)
                p.grad = None
        where = plan.pipeline_of(w)
        # Exactly one new group per worker and plan, so every member has made as many
        # groups when it makes the next (torch names them by that count).
        members = plan.workers_of_stage(where[1]) if where is not None else [w]
        self.group = ctx.new_group([ctx.topology.workers[i] for i in members])
        self.group_size = len(members)
        if where is None:
            ctx.set_label(f"idle (step {plan.step})")
            self.stage, self.pipe, self.stage_opt = None, None, None
            self._drop_cache()  # an idle worker serves no sample
            return
        r, j = where
        ranks = [ctx.topology.workers[i] for i in range(r * plan.stages, (r + 1) * plan.stages)]
        cluster = self._cluster()
        devices = [cluster.devices[i] for i in range(r * plan.stages, (r + 1) * plan.stages)]
        links = [cluster.bandwidth(a, b) for a, b in zip(devices, devices[1:])]
        labels = [f"pipeline {r} stage {i} (rank {rank}, machine "
                  f"{ctx.topology.machine(rank)})" for i, rank in enumerate(ranks)]
        ctx.set_label(f"pipeline {r} stage {j}")
        self.stage = make_stage(self.model, plan.bounds, j, ranks=ranks, labels=labels,
                                links=links, profile=self.profile, transport=self.transport,
                                loss_fn=self.loss_fn, clock=clock_of(self.model),
                                cuts_move=self.options.cuts_move)
        self.pipe = SyncPipeline(self.stage, schedule=self.options.schedule,
                                 microbatches=plan.micro_batches)
        self.pipe._next = self._next_mb  # minibatch numbers (tags) never repeat across plans
        opt, self.sources, _ = stage_optimizer(self.base_optimizer, self.model, self.stage)
        self.stage_opt = opt
        if self._handed is not None:
            by_name = dict(zip(self.stage.names, self.stage.params))
            for name, state in self._handed.items():
                if name in by_name:
                    opt.state[by_name[name]] = placed_state(opt, by_name[name], state)
        if j != 0 or plan.bounds[0] < self.options.cache_from or not self.options.cache:
            if j != 0:
                self._drop_cache()
        elif self.cache is None:
            self.cache = ActivationCache(memory_bytes=int(self.options.cache_mb * 2**20),
                                         directory=self.options.cache_dir,
                                         shared=self.shared_cache)

    def _drop_cache(self) -> None:
        """Close this worker's cache (it is no first stage now); its counts stay counted."""
        if self.cache is None:
            return
        for key in _SERVED:
            self._served[key] = self._served.get(key, 0) + getattr(self.cache.stats, key)
        self.cache.close()
        self.cache = None

    _handed: dict[str, dict[str, Any]] | None = None

    def _held(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """The state this worker holds current (its stage's and frozen front's weights and
        buffers, as ``state_dict`` names them) and its stage optimizer's state, by
        parameter name."""
        if self.stage is None or self.plan is None:
            return {}, {}
        j = self.stage.spec.index
        layers = set(self._names[0 if j == 0 else self.plan.bounds[j]:self.plan.bounds[j + 1]])
        weights = {n: host_copy(t) for n, t in self.model.state_dict().items()
                   if n.split(".", 1)[0] in layers}
        return weights, self._stage_optimizer_state()

    def _stage_optimizer_state(self) -> dict[str, dict[str, Any]]:
        """This worker's stage optimizer's state, by parameter name."""
        state: dict[str, dict[str, Any]] = {}
        if self.stage is not None and self.stage_opt is not None:
            for n, p in zip(self.stage.names, self.stage.params):
                if p in self.stage_opt.state:
                    state[n] = host_state(self.stage_opt.state[p])
        return state

    def _hand_over(self, plan: PipePlan, old: PipePlan) -> None:
        """Every worker takes the whole model's weights, and its new stage's optimizer state,
        from the old pipeline whose devices its new pipeline takes (AutoDP's source)."""
        ctx = self.ctx
        assert ctx is not None
        where = old.pipeline_of(ctx.worker_index)
        weights, state = self._held()
        everyone: list[Any] = [None] * ctx.num_workers
        dist.all_gather_object(everyone, (where[0] if where else None, weights, state),
                               group=ctx.groups.workers)
        if self.stage is not None:
            self.stage.close()
        new_where = plan.pipeline_of(ctx.worker_index)
        source = (new_where[0] * plan.stages) // old.stages if new_where is not None else 0
        self.source_replica = source
        current = self.model.state_dict()  # weights and buffers, sharing their storage
        handed: dict[str, dict[str, Any]] = {}
        with torch.no_grad():
            for replica, w, s in everyone:
                if replica != source:
                    continue
                for n, t in w.items():
                    current[n].copy_(t)
                handed.update(s)
        self._handed = handed

    # -- training ---------------------------------------------------------------------------

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> float | None:
        if self.plan is None:
            before = self.replica  # the slice the trainer gave: by the saved plan
            self._setup(inputs, loss_fn)
            if self._resume_replan is not None:
                step, self._resume_replan = self._resume_replan, None
                saved = self._slices()
                self.replan(step)
                # From every worker's slice, not its own: resharding is a collective, and a
                # worker whose slice stayed (pipeline 0's first stage) skipped it while the
                # others waited in it (--no-autodp halving K at the first step: a timeout).
                if self._slices() != saved:  # the freeze point changed the replicas
                    inputs, targets = self._reshard(inputs, targets, before[0])
        plan = self.plan
        assert plan is not None
        self._next_mb += plan.micro_batches
        if self.stage is None or self.pipe is None or self.stage_opt is None:
            return None  # idle: a device freed without AutoDP
        stage, opt = self.stage, self.stage_opt
        for group, i in zip(opt.param_groups, self.sources):  # the user's lr schedule
            group.update(numeric_settings(self.base_optimizer.param_groups[i]))
        opt.zero_grad(set_to_none=True)
        front = None  # the frozen front, forward-only, a micro-batch at a time in the schedule
        if stage.spec.is_first and plan.bounds[0]:
            front = functools.partial(frozen_forward, self.layers, frozen=plan.bounds[0],
                                      cache=self.cache)
        loss = self.pipe.step(inputs, targets, prepare=front)
        trained = [p for p in stage.params if p.requires_grad]
        if self.group_size > 1 and trained:
            self._all_reduce(trained)
        if self.options.freeze:
            norms: dict[str, float] = {}
            for name, p in zip(stage.names, stage.params):
                if p.grad is not None:
                    layer = name.split(".", 1)[0]
                    norms[layer] = norms.get(layer, 0.0) + float(p.grad.double().pow(2).sum())
            self.tracker.record({k: v ** 0.5 for k, v in norms.items()})
        opt.step()
        return loss

    def _all_reduce(self, trained: list[nn.Parameter]) -> None:
        """Average the stage's gradients over its data-parallel group. A parameter no
        micro-batch of this replica reached has none (the optimizer skips it, as in one
        process), but another replica's may have: a flag per parameter rides at the end of
        the same all-reduce, and the parameter gets the mean (zeros from this replica) where
        some replica's slice reached it, and stays None where none did."""
        stage, plan, ctx = self.stage, self.plan, self.ctx
        assert stage is not None and plan is not None and ctx is not None
        # The data leaves the device once its backward has finished there.
        if stage.clock is not None:
            stage.clock.wait()
        reached = torch.tensor([float(p.grad is not None) for p in trained],
                               dtype=trained[0].dtype, device=trained[0].device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in trained] + [reached])
        ctx.meter.record_ring_allreduce(
            [ctx.topology.workers[i] for i in plan.workers_of_stage(stage.spec.index)],
            flat.numel() * flat.element_size())
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p, anywhere in zip(trained, flat[-len(trained):].tolist()):
            n = p.numel()
            if not anywhere:
                p.grad = None
            else:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                torch.div(flat[offset:offset + n].view_as(p), self.group_size, out=p.grad)
            offset += n

    def _slices(self) -> list[tuple[int, int]]:
        """Every worker's slice of the global batch (index, count) under the plan in force."""
        assert self.ctx is not None and self.plan is not None
        return [_slice(self.plan, w) for w in range(self.ctx.num_workers)]

    def _reshard(self, inputs: torch.Tensor, targets: torch.Tensor, index: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's slice under the current plan, from every worker's slice under the
        plan before (``index``: this worker's replica then). Only a resumed run's first
        step needs it: the trainer sliced the batch before the freeze point's re-plan,
        which the uninterrupted run made before slicing."""
        ctx = self.ctx
        assert ctx is not None
        indices: list[Any] = [None] * ctx.num_workers
        dist.all_gather_object(indices, index, group=ctx.groups.workers)
        out = []
        for t in (inputs, targets):
            every = [torch.empty_like(t) for _ in range(ctx.num_workers)]
            dist.all_gather(every, t.contiguous(), group=ctx.groups.workers)
            first = {i: every[w] for w, i in reversed(list(enumerate(indices)))}
            whole = torch.cat([first[i] for i in sorted(first)])
            out.append(shard(whole, *self.replica))
        return out[0], out[1]

    # -- results ----------------------------------------------------------------------------

    def stage_state(self) -> dict[str, Any]:
        """This worker's place, weights and optimizer state now (tests compare replicas)."""
        assert self.ctx is not None
        where = self.plan.pipeline_of(self.ctx.worker_index) if self.plan else None
        weights, state = self._held()
        return {"where": where, "weights": weights, "state": state,
                "source": getattr(self, "source_replica", None)}

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Replica 0's stages (and its frozen front) gathered on worker 0."""
        ctx = self.ctx
        assert ctx is not None
        where = self.plan.pipeline_of(ctx.worker_index) if self.plan is not None else None
        local = host_state(model.state_dict())
        if self.plan is None:  # never planned: every worker's model is the whole one
            own = local
        else:
            own = self._held()[0] if where is not None and where[0] == 0 else {}
        merged = self.gather_parts(own)
        return {**local, **merged}

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """This worker's plan (frozen layers, K, R, cuts, micro-batches), the freeze
        timeline and gradient-norm tracker, the minibatch count, the measured layer times
        (``--layer-costs measured``: a resumed run plans with them), and its stage
        optimizer's state by name; the weights are the checkpoint's model (replica 0's,
        which every replica equals). The activation cache is not kept: a resumed run refills
        it, and counts on from what it served (``served``). Before the first step, the state
        a load gave, which that step installs (none where nothing was loaded)."""
        if self.plan is None:
            return dict(self._resume or {})
        served = {key: self._served.get(key, 0) +
                  (getattr(self.cache.stats, key) if self.cache is not None else 0)
                  for key in _SERVED}
        return {"plan": self.plan, "timeline": copy.deepcopy(self.timeline),
                "tracker": copy.deepcopy(self.tracker), "planned": self._planned,
                "next_mb": self._next_mb, "stage_optimizer": self._stage_optimizer_state(),
                "source": getattr(self, "source_replica", None),
                "layer_seconds": self.layer_seconds, "served": served}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Keep the saved state until the first step, which installs its plan (planning
        needs that step's inputs). Its records are the run's at once: a restart at the run's
        last step trains none, and its ``metrics.json`` had no timeline and no cache counts."""
        self._resume = dict(state) if state else None
        if state:
            self.timeline = list(state["timeline"])
            self._served = dict(state.get("served", {}))  # (older checkpoints: none kept)

    def check_load(self) -> None:
        """Refuse a load into a trainer that has trained: its plan, frozen layers and stage
        optimizers stayed, and the loaded state waited for a first step that had been."""
        plan = self.plan
        if plan is not None:
            raise trained_already("pipetransformer", f"its plan ({plan.frozen} layers "
                                  f"frozen, {plan.stages} stages x {plan.replicas} replicas), "
                                  f"frozen layers and stage optimizers")

    def _restore(self, saved: Mapping[str, Any]) -> None:
        """Install the saved plan: its frozen layers, stage and groups, with the stage
        optimizer's state; the timeline (which the install added to) and tracker as they
        were. (The cache counts came back with :meth:`load_checkpoint_state`.)"""
        self._next_mb = int(saved["next_mb"])
        self._handed = dict(saved["stage_optimizer"])
        self._install(saved["plan"], None)
        self._handed = None
        self.timeline = list(saved["timeline"])
        self.tracker = saved["tracker"]
        self._planned = int(saved["planned"])
        if saved.get("source") is not None:
            self.source_replica = saved["source"]

    def evaluation_model(self, model: nn.Module) -> nn.Module | None:
        """Worker 0's model with replica 0's current weights (every worker calls it)."""
        state = self.state_dict(model)
        assert self.ctx is not None
        if self.ctx.worker_index != 0:
            return None
        model.load_state_dict(state)  # weights and buffers (a batch norm's statistics)
        return model

    def metrics(self) -> dict[str, Any]:
        ctx = self.ctx
        assert ctx is not None
        stats = self.cache.stats.as_dict() if self.cache is not None else {}
        for key, served in self._served.items():  # (before stop 48 a closed cache's were lost)
            stats[key] = stats.get(key, 0) + served
        everyone: list[Any] = [None] * ctx.num_workers
        dist.all_gather_object(everyone, stats, group=ctx.groups.workers)
        total: dict[str, int] = {}
        for s in everyone:
            for k, v in s.items():
                total[k] = total.get(k, 0) + v
        keys = ("hits", "shared_hits", "misses", "advanced", "memory_bytes", "shared_bytes",
                "disk_bytes", "disk_entries")
        out = {"freeze_timeline": self.timeline,
               "cache": {k: total.get(k, 0) for k in keys}}
        if self.layer_seconds is not None and self.profile is not None:
            out["layer_costs_ms"] = costs_record(self.profile.names, self.layer_seconds)
        return out

    def close(self) -> None:
        try:
            if self.stage is not None:
                self.stage.close()  # may time out on a peer: the cache's files go anyway
        finally:
            if self.cache is not None:
                self.cache.close()
            if self.shared_cache is not None:  # the machine's last worker out removes it
                _leave_shared(Path(self.shared_cache))


def _slice(plan: PipePlan, worker: int) -> tuple[int, int]:
    """(index, count) of worker ``worker``'s slice of the global batch under ``plan``: its
    pipeline's (an idle worker's is pipeline 0's, which it does not train on)."""
    where = plan.pipeline_of(worker)
    return (where[0] if where is not None else 0), plan.replicas


def _check_micro_batches(m: int | None, batch: int, replicas: int, *, python: bool) -> None:
    """Refuse a first plan's micro-batches that do not divide a replica's share of the global
    ``batch``: the plan would take the largest divisor below them, silently (only a later
    plan, after a halving, lowers them). ``python``: worded for the step API, else the CLI."""
    per = batch // replicas
    if m is None or per % m == 0:
        return
    option, given = ((f"micro_batches={m}", f"a global batch of {batch}") if python
                     else (f"--micro-batches {m}", f"--batch-size {batch}"))
    raise ConfigError(f"{option} does not divide a replica's {per} samples ({given} over "
                      f"{replicas} replicas)",
                      f"pass {'micro_batches' if python else '--micro-batches'} one of "
                      f"{divisors(per)}")


def _shared_directory(ctx: Context) -> str:
    """A directory in host shared memory that the workers of this machine share for
    AutoCache, fresh for the run (worker 0 names it; every worker makes its machine's);
    under ``polytrain launch`` inside the run's own, which the launcher removes even when
    the workers are killed."""
    name = [uuid.uuid4().hex if ctx.worker_index == 0 else None]
    dist.broadcast_object_list(name, src=ctx.topology.workers[0], group=ctx.groups.workers)
    run = _env.shm_dir()
    root = Path(run) if run is not None else (
        SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir()))
    path = root / f"polytrain-autocache-{name[0]}-{ctx.machine}"
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{_USER}{os.getpid()}").write_text(json.dumps(owner_record()))
    # Left by close(), and at the latest when the process ends: a script that ends without
    # close() (the README's step API, run by torchrun) left it in host memory.
    atexit.register(_leave_shared, path)
    return str(path)


_USER = ".polytrain-user-"  # in the machine's shared directory: a process that uses it


def _leave_shared(path: Path) -> None:
    """This process is done with the machine's shared directory: the last of its users
    removes it (a worker that ends first, an idle one, must not take it from the others)."""
    (path / f"{_USER}{os.getpid()}").unlink(missing_ok=True)
    try:
        marks = list(path.glob(f"{_USER}*"))
    except OSError:  # removed already: by another user that left at the same time
        return
    for mark in marks:
        try:
            owner = owner_alive(json.loads(mark.read_text()))
        except (OSError, ValueError):
            continue
        if owner is not None and owner[1]:
            return  # another user runs on
    shutil.rmtree(path, ignore_errors=True)
