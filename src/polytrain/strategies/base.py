"""The strategy contract, the registry of strategy names, and ``distribute``."""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Generic, Iterable, Mapping, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn

from .. import _env, runtime
from ..emulation.profile import ModelProfile, optimizer_state_factor, whole_model_bytes
from ..errors import ConfigError, left_run, unknown
from ..kinds import check_kinds
from ..launch.layout import Layout
from ..moe.checkpoint import moe_layers
from ..optim import placed_state
from ..runtime import Context
from ..tensors import host_state
from ..wrapper import unwrap
from .checks import (
    broadcast_module,
    check_even_machines,
    check_optimizer_of,
    check_same_optimizer,
    check_same_values,
    check_worker_models,
)
from .trainer import Trainer, with_gate_losses

__all__ = ["Strategy", "NoOptions", "register", "get_strategy", "strategy_names", "distribute",
           "strategy_of", "full_state_dict", "LossFn", "Trainer"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoOptions:
    """A strategy without options of its own."""


#: A strategy's options: the frozen dataclass it names as ``Options``.
OptionsT = TypeVar("OptionsT")


class Strategy(ABC, Generic[OptionsT]):
    """How a model and its optimizer train across processes.

    A strategy is named in the registry, takes its options as a frozen
    dataclass (``Options``: the CLI builds flags from its fields), says which
    layouts it can run on, and wraps a model and optimizer so that the plain
    PyTorch loop (``zero_grad``, forward, ``backward``, ``step``) trains them.
    Strategies whose step is not that loop (pipelines) set ``pipeline`` and
    override :meth:`train_step`; they are driven through the step API
    (:class:`~polytrain.strategies.trainer.Trainer`), which asks :meth:`replan`
    and :attr:`replica` before every step.
    """

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    #: False only for ``single``: everything else joins a run of processes.
    distributed: ClassVar[bool] = True
    #: True for pipelines: trained through ``trainer.step(x, y)`` only, never the plain loop.
    pipeline: ClassVar[bool] = False
    #: True where worker 0's local model holds every current weight (data parallelism).
    whole_model: ClassVar[bool] = True
    #: True where :meth:`wrap` itself copies worker 0's weights (herring's DDP does):
    #: :func:`distribute` then does not. It checks that every worker built the same model
    #: (and optimizer) for every strategy, before torch's own check can fail less clearly.
    agrees_model: ClassVar[bool] = False
    #: True where every machine must run as many workers (a pipeline, or the devices, of a
    #: machine): a run torchrun started otherwise is refused at :func:`distribute`.
    even_machines: ClassVar[bool] = False
    #: True where :meth:`wrap` hands back the user's own model and a copy or pickle of it
    #: is safe (byteps's and single's hooks are on parameters, which a copy lacks): its
    #: strategy, which holds process groups, is then kept beside it, not on it. Elsewhere a
    #: copy is refused (:meth:`__deepcopy__`): Parallax's lookup hooks are on modules, and
    #: a copy ran them against the original's tables; a pipeline's strategy holds the model.
    copyable_model: ClassVar[bool] = False
    #: Steps in one epoch of the training data, set by the training loop before the first
    #: step (None: the data has no epochs).
    epoch_steps: int | None = None

    def __init__(self, ctx: Context | None, options: OptionsT) -> None:
        self.ctx = ctx
        self.options = options

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise ConfigError(f"a model distributed with strategy {self.name!r} cannot be copied "
                          f"or pickled: its strategy holds the run's process groups",
                          "copy its weights: polytrain.full_state_dict(model) (or "
                          "trainer.state_dict()) into a model of your own")

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.__deepcopy__({})

    # -- what the launcher and CLI ask before starting processes -------------------------------

    @classmethod
    def check_layout(cls, layout: Layout, options: OptionsT) -> None:
        """Refuse layouts the strategy cannot run on (raise ConfigError with a hint)."""
        if layout.servers and not cls.uses_servers(options):
            raise ConfigError(f"strategy {cls.name!r} does not use servers (got --servers "
                              f"{layout.servers})", "leave out --servers")
        cls.check_machines(layout, options)

    @classmethod
    def check_machines(cls, layout: Layout, options: OptionsT) -> None:
        """Refuse workers and machines the strategy cannot lay itself out on (ConfigError):
        the part of :meth:`check_layout` that :func:`distribute` also checks, of a run
        torchrun started (the rest, as servers it does not use, a script may well have)."""

    @classmethod
    def check_model(cls, model: nn.Module, layout: Layout, options: OptionsT) -> None:
        """Refuse models the strategy cannot train on ``layout`` (raise ConfigError with a hint).

        Called before any process starts, on the model built on the meta device.
        Every model will do unless a strategy says otherwise.
        """
        return None

    @classmethod
    def check_run_model(cls, model: nn.Module, layout: Layout, options: OptionsT) -> None:
        """Refuse what ``polytrain train`` would start for ``model`` on ``layout`` and leave
        idle (ConfigError): the part of :meth:`check_model` that :func:`distribute` does not
        check, as :meth:`check_layout`'s is to :meth:`check_machines` (a script may use the
        run's servers itself). Nothing unless a strategy says otherwise."""

    @classmethod
    def check_optimizer(cls, optimizer: torch.optim.Optimizer, options: OptionsT) -> None:
        """Refuse an optimizer the strategy cannot run with ``options`` (raise ConfigError).

        Called before any process starts, on the optimizer of the meta-device model,
        and by :func:`distribute`. Every optimizer will do unless a strategy says otherwise.
        """
        return None

    @classmethod
    def uses_servers(cls, options: OptionsT) -> bool:
        return False

    @classmethod
    def check_steps(cls, options: OptionsT, *, steps: int, epoch_steps: int | None,
                    data: str, batch_size: int) -> None:
        """Refuse options the run's length makes void (ConfigError): ``steps`` steps of
        ``batch_size`` on data set ``data``, whose epoch is ``epoch_steps`` steps (None:
        ``--sampling random``, no epochs). By default nothing depends on it."""

    @classmethod
    def check_devices(cls, cluster: Any, profile: Callable[[], ModelProfile], layout: Layout,
                      options: OptionsT, *, batch_size: int, optimizer: str) -> str | None:
        """Refuse a run whose devices cannot hold what each worker keeps (ConfigError).

        ``cluster`` is the run's emulated ``pipeline.Cluster`` (None without
        ``--devices``: nothing to check); ``profile()`` measures the model's
        layers. By default every worker holds the whole model: its weights,
        gradients, optimizer state and the activations of its replica's slice.
        Returns a printable summary of the strategy's plan, if it makes one.
        """
        if cluster is None:
            return None
        prof = profile()
        per = batch_size // max(1, cls.replicas(layout, options))
        need = whole_model_bytes(prof, per, optimizer_state_factor(optimizer))
        for d in cluster.devices:
            if need > d.type.memory_bytes:
                raise ConfigError(
                    f"strategy {cls.name!r} keeps the whole model on every worker: "
                    f"{need / 2**20:.1f} MiB (weights, gradients, {optimizer} state and the "
                    f"activations of {per} samples), but device {d.describe()} has "
                    f"{d.type.memory_mb:g} MiB",
                    "use devices with more memory, a smaller --batch-size or model, or a "
                    "strategy that splits the model (--strategy hetpipe)")
        return None

    @classmethod
    def replicas(cls, layout: Layout, options: OptionsT) -> int:
        """How many data-parallel replicas share each global batch on ``layout``."""
        return layout.workers

    @classmethod
    def colocated_servers(cls, options: OptionsT) -> int:
        """Server processes the strategy wants on every worker machine (default none)."""
        return 0

    # -- the contract --------------------------------------------------------------------------

    @abstractmethod
    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Return the model and optimizer to train with (parameters already in agreement)."""

    @property
    def replica(self) -> tuple[int, int]:
        """(index, count) of this worker's data-parallel replica: its slice of a global batch.

        Asked before every step: a strategy may change it between steps (see :meth:`replan`).
        """
        assert self.ctx is not None
        return self.ctx.worker_index, self.ctx.num_workers

    def replan(self, step: int) -> bool:
        """Called before step ``step`` (from 0): the place to change the plan between steps
        (stages, replicas, groups). Every worker calls it at the same step.

        Returns whether the plan changed, moving state between processes: that step is not
        steady state, and the training loop leaves it out of the steady averages of traffic
        and step time (as a resumed run's first). Every worker returns the same.
        """
        return False

    @property
    def shows_progress(self) -> bool:
        """Whether this worker draws the progress bar: one worker that holds a loss."""
        return self.ctx is None or self.ctx.worker_index == 0

    def notices(self) -> list[str]:
        """What the run's output says since the last call (a re-plan's new plan): the
        training loop prints it where the progress bar is drawn. None by default."""
        return []

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> float | None:
        """One step on this replica's slice; returns its mean loss (None: not held here)."""
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    @classmethod
    def evaluates(cls) -> bool:
        """Whether :meth:`evaluation_model` can give the whole model (``--eval-every``)."""
        return (cls.evaluation_model is not Strategy.evaluation_model
                or (not cls.pipeline and cls.whole_model))

    def evaluation_model(self, model: nn.Module) -> nn.Module | None:
        """A module with the whole model's current weights on worker 0 for a held-out
        evaluation (None on the other workers); every worker calls it at the same step.

        By default worker 0's local model (data parallelism: it holds every weight);
        strategies that split the model override it or are refused.
        """
        if not type(self).evaluates():
            raise ConfigError(f"strategy {self.name!r} holds part of the model on each worker "
                              f"and cannot evaluate it on held-out data",
                              "leave out --eval-every, or evaluate the run's final.pt")
        if self.ctx is None or self.ctx.worker_index == 0:
            return unwrap(model)
        return None

    def metrics(self) -> dict[str, Any]:
        """The strategy's own records for ``metrics.json`` (worker 0's; default none)."""
        return {}

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full model's state on CPU, with the keys of the unwrapped model.

        Every worker calls it (it may gather shards or stages); worker 0's result is whole.
        """
        inner = unwrap(model)
        return host_state(inner.state_dict())

    def gather_parts(self, own: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Every worker's ``own`` part of the state (host copies; ``None`` for none) merged
        on worker 0, for strategies whose workers hold stages; other workers get ``{}``."""
        ctx = self.ctx
        assert ctx is not None
        first = ctx.worker_index == 0
        parts: list[Any] = [None] * ctx.num_workers if first else []
        dist.gather_object(own, parts if first else None, dst=ctx.topology.workers[0],
                           group=ctx.groups.workers)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part or {})
        return merged

    def close(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Release what the strategy holds (threads, buffers); the context stays open."""

    # -- checkpoints (polytrain.checkpoint calls these; every worker, at the same step) -------

    #: Whether a checkpoint may resume on another number of workers: True where every
    #: worker's state follows from the whole model and the per-name optimizer state, or
    #: from worker 0's strategy state (:attr:`whole_state_on_worker_0`). The workers that
    #: hold a parameter then hold alike optimizer state for it, which a checkpoint stores
    #: once.
    resumes_on_other_layouts: ClassVar[bool] = False
    #: Whether worker 0's :meth:`checkpoint_state` holds the whole strategy state, whatever
    #: the layout: a resume on another number of workers gives it to every worker (else {}).
    whole_state_on_worker_0: ClassVar[bool] = False
    #: Why this strategy cannot save or resume checkpoints yet (None: it can). Saving its
    #: model and optimizer alone would resume a different run without a word.
    checkpoint_gap: ClassVar[str | None] = None

    @classmethod
    def check_checkpoints(cls) -> None:
        """Refuse checkpoints for a strategy whose own state they do not hold yet."""
        if cls.checkpoint_gap is not None:
            raise ConfigError(f"strategy {cls.name!r} cannot save or resume checkpoints yet: "
                              f"{cls.checkpoint_gap}",
                              "leave out --checkpoint-every, --resume and --max-restarts (a "
                              "run's final.pt can start another with --init)")

    @classmethod
    def check_resume(cls, saved: Mapping[str, Any], layout: Layout, options: OptionsT) -> None:
        """Refuse to resume a checkpoint whose layout this strategy cannot carry its state to.

        ``saved`` is the checkpoint's manifest (``workers``, ``nodes``, ``servers``,
        ``strategy_options``, ...). By default another worker count is refused unless
        :attr:`resumes_on_other_layouts`; a strategy with state of its own says more.
        """
        if int(saved["workers"]) != layout.workers and not cls.resumes_on_other_layouts:
            raise ConfigError(
                f"strategy {cls.name!r} cannot resume a checkpoint of {saved['workers']} "
                f"workers on {layout.workers}: each worker's state belongs to its place in "
                f"the layout", f"resume with --workers {saved['workers']}")

    @classmethod
    def refuse_other_options(cls, saved: Mapping[str, Any], options: OptionsT,
                             names: Iterable[str], what: str) -> None:
        """Refuse a resume whose options ``names`` differ from the checkpoint's run's
        (``what``: the state those options made, which the checkpoint holds)."""
        theirs = {n: saved_option(cls, saved, n) for n in names}
        differ = [n for n in names if theirs[n] != getattr(options, n)]
        if differ:
            said = ", ".join(f"--{n.replace('_', '-')} {theirs[n]} there, "
                             f"{getattr(options, n)} here" for n in differ)
            raise ConfigError(f"strategy {cls.name!r} resumes {what} only with the options "
                              f"that made them ({said})",
                              f"resume with the checkpoint's {cls.name} options")

    def parameter_names(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters this worker holds, by their names in the plain model's
        ``state_dict`` (a checkpoint keys optimizer state by them)."""
        inner = unwrap(model)
        return dict(inner.named_parameters())

    def check_load(self) -> None:  # noqa: B027
        """Refuse a load this trainer cannot take now, before :func:`polytrain.load` changes
        anything (scheduler, model, optimizer, RNG); default: any time."""

    def load_model_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """Load the whole model's state (the plain model's keys, as :meth:`state_dict` gives)
        into this worker's part of it; called after :meth:`wrap`, before the first step."""
        inner = unwrap(model)
        inner.load_state_dict(dict(state))

    def checkpoint_state(self) -> dict[str, Any]:
        """The strategy's own state that a checkpoint must keep (clocks, ...); default none.

        Picklable; every worker saves its own, and gets it back in
        :meth:`load_checkpoint_state` on a layout of the same size.
        """
        return {}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        """Restore what :meth:`checkpoint_state` saved (empty: another layout, or none saved)."""


def trained_already(strategy: str, kept: str) -> ConfigError:
    """A load refused by :meth:`Strategy.check_load` of a trainer whose state installs at
    its first step (the stages, the plan) and that has taken it: ``kept``, what would stay
    the trained run's. (Only a script can: the CLI loads before any step.)"""
    return ConfigError(f"{strategy} loads a checkpoint only before the trainer's first step, "
                       f"and this trainer has trained: {kept} would stay as they are",
                       "load before the first trainer.step(), into a model distributed "
                       "afresh")


_REGISTRY: dict[str, type[Strategy[Any]]] = {}


def register(cls: type[Strategy[Any]]) -> type[Strategy[Any]]:
    """Class decorator: make a strategy available by its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ConfigError(f"two strategies are named {cls.name!r}", "give each a unique name")
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type[Strategy[Any]]:
    """The strategy class called ``name``; the error lists the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise unknown("strategy", name, strategy_names(), "pass one of them, e.g. --strategy ddp",
                      plural="strategies") from None


def saved_option(cls: type[Strategy[Any]], saved: Mapping[str, Any], name: str) -> Any:
    """Option ``name`` of the run that wrote checkpoint manifest ``saved``: as recorded, else
    its default (the CLI records the options it was given). Read as it is, not rebuilt into
    ``cls.Options``: their checks are of this machine (a cache directory the saving machine
    had), and a record may hold options polytrain has since dropped or refuses together."""
    recorded = dict(saved.get("strategy_options") or {})
    if name in recorded:
        return recorded[name]
    f = next(f for f in dataclasses.fields(cls.Options) if f.name == name)
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def make_options(cls: type[Strategy[Any]], options: dict[str, Any]) -> Any:
    """Build ``cls.Options`` from keyword options, naming any that it does not have, or of
    another kind than its field (:func:`~polytrain.kinds.check_kinds`, which makes numpy's
    numbers Python's and a path a str)."""
    fields = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(options) - fields)
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise ConfigError(f"strategy {cls.name!r} has no option {', '.join(map(repr, unknown))}; "
                          f"its options are: {valid}", "leave those options out")
    # A field whose flag takes a DIR or FILE takes a pathlib.Path too, as TrainConfig's do.
    return cls.Options(**check_kinds(cls.Options, options, paths=path_options(cls),
                                     what=f"strategy {cls.name!r} option "))


def path_options(cls: type[Strategy[Any]]) -> set[str]:
    """The options of ``cls`` that name a place on a machine (their flag takes a DIR or
    FILE): a pathlib.Path is taken, and each machine's may differ."""
    return {f.name for f in dataclasses.fields(cls.Options)
            if f.metadata.get("metavar") in ("DIR", "FILE")}


@overload
def distribute(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = ...,
               *, ctx: Context | None = ..., loss_fn: None = ...,
               **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]: ...


@overload
def distribute(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = ...,
               *, ctx: Context | None = ..., loss_fn: LossFn, gate_losses: bool = ...,
               **options: Any) -> Trainer: ...


def distribute(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "ddp", *,
               ctx: Context | None = None, loss_fn: LossFn | None = None,
               gate_losses: bool = True,
               **options: Any) -> tuple[nn.Module, torch.optim.Optimizer] | Trainer:
    """Wrap ``model`` and ``optimizer`` to train with ``strategy``.

    Checks that every worker passed the same strategy and options and built the same
    model (names, shapes, dtypes) and optimizer (settings, state's steps), makes
    the parameters identical everywhere (broadcast from worker 0), and hands
    the model to the strategy. Without ``loss_fn`` it returns the model and
    optimizer for the plain loop (data-parallel strategies only); with it, a
    :class:`Trainer` whose ``step(x, y)`` trains one global batch (every
    strategy; pipelines need it).

    Example::

        ctx = polytrain.init()
        model, opt = polytrain.distribute(model, torch.optim.Adam(model.parameters()),
                                          strategy="ddp")
        for x, y in batches:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

        trainer = polytrain.distribute(model, opt, strategy="hetpipe", loss_fn=loss_fn)
        for x, y in batches:                      # global batches: the trainer shards them
            loss = trainer.step(x, y)

    Args:
        strategy: a registered name (:func:`strategy_names` lists them).
        ctx: the run (default: :func:`polytrain.init`'s).
        loss_fn: ``loss_fn(outputs, targets)``, the mean loss over a slice of samples.
        gate_losses: with ``loss_fn``, add the model's MoE gates' balance and z-losses
            (:func:`polytrain.moe.aux_loss`) to it at every step (default True; False
            when ``loss_fn`` adds them itself). The plain loop adds them by hand.
        options: the strategy's own options (its ``Options`` fields).
    """
    _check_arguments(model, optimizer, ctx, loss_fn)
    cls = get_strategy(strategy)
    given = model.strategy.name if isinstance(model, Trainer) else _DISTRIBUTED.get(model)
    if given is not None:
        raise ConfigError(f"this model was already given to polytrain.distribute() (strategy "
                          f"{given!r}): a second call would wrap it, and hook its gradients, "
                          f"twice", "call distribute() once per model, and train what it "
                          "returned")
    if cls.pipeline and loss_fn is None:
        raise ConfigError(
            f"strategy {strategy!r} is a pipeline: each process holds a stage, so the plain "
            f"backward()/step() loop would train one local copy per worker",
            f"use the step API: trainer = polytrain.distribute(model, opt, "
            f"strategy={strategy!r}, loss_fn=loss_fn), then loss = trainer.step(x, y) on "
            f"each global batch")
    opts = make_options(cls, options)
    gate_losses = check_kinds(distribute, {"gate_losses": gate_losses},
                              what="distribute() option ")["gate_losses"]
    if not cls.distributed:
        _check_one_process(strategy)
    _check_whole_experts(model, strategy)
    if cls.distributed:
        ctx = ctx or runtime.init()
        if ctx.closed:  # its groups are gone: torch's "Group ... is not registered"
            raise left_run("distribute() was called", "distribute the model before the "
                           "shutdown: a launched process joins its run once"
                           if _env.started_by() else "call polytrain.init() again and pass "
                           "its context (a plain script may join a new run)")
        if not ctx.is_worker:
            raise ConfigError(f"rank {ctx.rank} is a server and cannot train a model",
                              "call distribute() on workers only")
        # Before anything a strategy does alone (its checks, its wrap's collectives): a worker
        # on another strategy would wait in another collective until the timeout. A path
        # (a DIR or FILE) names a place on each worker's machine, which may differ.
        here = path_options(cls)
        check_same_values(ctx, {"strategy": strategy, **{
            f"strategy {strategy!r} option {f.name}": getattr(opts, f.name)
            for f in dataclasses.fields(opts) if f.name not in here}},
            "pass the same strategy and options to distribute() on every worker")
        _check_device(model, ctx.device, strategy)
        if cls.even_machines:
            check_even_machines(strategy, ctx.topology)
        layout = layout_of(ctx)
        if layout is not None:  # what the CLI checks before any process starts
            cls.check_machines(layout, opts)
        cls.check_model(model, layout or _workers_layout(ctx), opts)
        cls.check_optimizer(optimizer, opts)
        check_optimizer_of(model, optimizer)
        check_worker_models(ctx, model)
        check_same_optimizer(ctx, model, optimizer)
        if not cls.agrees_model:
            broadcast_module(ctx, model)
    instance = cls(ctx, opts)
    wrapped, opt = instance.wrap(model, optimizer)
    _place_state(optimizer)
    if wrapped is model and cls.copyable_model:
        # The user's own model (byteps): its strategy, which holds process groups, kept
        # beside it, so that a copy or a torch.save of it does not pickle them.
        _OWN_MODELS[wrapped] = instance
    else:
        # On the model (polytrain.moe.checkpoint reads it there): in _OWN_MODELS, a strategy
        # that holds the model (a pipeline's) or its wrapper (herring's) kept both alive.
        object.__setattr__(wrapped, "_polytrain_strategy", instance)
    for given_model in (model, wrapped):
        _DISTRIBUTED[given_model] = strategy
    if ctx is not None and not cls.pipeline and instance.replica[1] == ctx.num_workers > 1:
        # Data parallelism over every worker, gradients averaged: MoE gates route over the
        # global batch, so that they decide and balance as one process would.
        for _, layer in moe_layers(wrapped):
            layer.set_batch_group(ctx.groups.workers)
    if loss_fn is None:
        return wrapped, opt
    # 'single' trains the model where it is (a ctx given to it is not where it computes);
    # the others moved it to the worker's device.
    first = next(iter(wrapped.parameters()), None)
    device = (ctx.device if cls.distributed and ctx is not None
              else first.device if first is not None else None)
    if gate_losses:
        loss_fn = with_gate_losses(loss_fn, wrapped)
    return Trainer(instance, wrapped, opt, loss_fn, device=device)


def _check_one_process(strategy: str) -> None:
    """Refuse a strategy of one process in a run of several, each of which would train its
    own copy: the run's workers once :func:`polytrain.init` has joined it, else the
    processes of a torch.distributed group this one joined, or of its launcher."""
    if runtime.is_initialized():
        count = runtime.current().num_workers
        said = f"this run has {count} workers"
    elif dist.is_available() and dist.is_initialized():
        count = dist.get_world_size()
        said = f"this process joined a torch.distributed run of {count} processes"
    else:
        by = _env.started_by()
        count = _env.world_size() if by is not None else 1
        said = f"{by} started this process as one of {count}"
    if count > 1:
        raise ConfigError(f"strategy {strategy!r} trains in one process, and {said}: each "
                          f"would train its own copy",
                          "pick a distributed strategy, e.g. strategy='ddp'")


def _check_device(model: nn.Module, device: torch.device, strategy: str) -> None:
    """Refuse a model with a tensor on another kind of device than the run's workers compute
    on: the strategies move the model to ``device`` (a model on the CPU goes to the worker's
    GPU); a model on a GPU in a run on the CPU (no ``init(device="cuda")``) was moved to the
    CPU and trained there, silently."""
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if t.device.type not in ("cpu", device.type):
            kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
            hint = (f"pass device={t.device.type!r} to the run's first polytrain.init() "
                    f"(before distribute()) to train on the GPU, or move the model to "
                    f"{device.type} first"
                    if t.device.type == "cuda" else
                    f"move the model to {device.type} before distribute()")
            raise ConfigError(f"{kind} {name!r} is on {t.device.type}, and this run's workers "
                              f"compute on {device.type}: strategy {strategy!r} would move the "
                              f"model there", hint)


def _place_state(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer's state to its parameter's device where the wrap moved the model
    (to the worker's GPU) and left the state behind: ``Module.to`` moves none, and state
    loaded on the CPU before :func:`distribute` met torch's device mismatch at the first
    step. Placed as torch's ``load_state_dict`` places it (:func:`placed_state`)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and any(isinstance(v, torch.Tensor) and v.device != p.device
                             for k, v in state.items() if k != "step"):  # step: torch's rule
                optimizer.state[p] = placed_state(optimizer, p, state)


def _check_whole_experts(model: nn.Module, strategy: str) -> None:
    """Refuse an MoE layer built already split over ranks (``group=``): every strategy
    makes the workers' models agree from worker 0's (its experts over the others'), and
    ``moe`` splits whole layers itself."""
    for prefix, layer in moe_layers(model):
        if layer.group.size > 1:
            raise ConfigError(f"MoE layer {prefix.rstrip('.')!r} is already split over "
                              f"{layer.group.size} ranks (built with group=): strategy "
                              f"{strategy!r} would copy worker 0's experts over the others'",
                              "build the layer without group= (strategy 'moe' splits the "
                              "experts over the workers itself)")


# The models distribute() was given and returned, by strategy (weakly: a copy, or a model
# saved whole and loaded again, is another model).
_DISTRIBUTED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
# The users' own models that distribute() returned unwrapped, to their strategy instance.
_OWN_MODELS: weakref.WeakKeyDictionary[nn.Module, Strategy[Any]] = weakref.WeakKeyDictionary()


def _check_arguments(model: Any, optimizer: Any, ctx: Any, loss_fn: Any) -> None:
    """Refuse distribute()'s model, optimizer, ctx or loss_fn of another kind by name: None
    for a model was weakref's TypeError, for an optimizer an AttributeError, and a loss_fn
    of 3 was taken (a Trainer as the model is refused below, as given twice)."""
    for name, value, ok, said, hint in (
            ("model", model, isinstance(model, (nn.Module, Trainer)), "a torch.nn.Module",
             "pass the model to train"),
            # What polytrain uses of it: a wrapper that is no subclass (apex's, DeepSpeed's)
            # passes, as it worked before.
            ("optimizer", optimizer, hasattr(optimizer, "param_groups")
             and callable(getattr(optimizer, "step", None)),
             "an optimizer (param_groups and step(), as torch.optim.Optimizer's)",
             "pass, say, torch.optim.Adam(model.parameters())"),
            # (a stand-in with a device, as a test's for 'single', passes)
            ("ctx", ctx, ctx is None or isinstance(ctx, Context) or hasattr(ctx, "device"),
             "polytrain.init()'s Context, or None", "pass ctx=polytrain.init(), or leave it "
             "out"),
            ("loss_fn", loss_fn, loss_fn is None or callable(loss_fn),
             "a function loss_fn(outputs, targets), or None", "pass, say, "
             "loss_fn=torch.nn.functional.cross_entropy, or leave it out for the plain loop")):
        if not ok:
            raise ConfigError(f"distribute() {name} must be {said} (got {value!r:.60})", hint)


def layout_of(ctx: Context) -> Layout | None:
    """The run's layout as the CLI describes one (None where the machines are uneven, as
    torchrun may start them: the CLI's checks then do not apply as they are)."""
    top = ctx.topology
    machines = top.worker_machines
    colocated = {len(top.servers_on(m)) for m in machines}
    if len(colocated) != 1:
        return None
    try:
        return Layout(workers=len(top.workers), nodes=len(machines),
                      servers=len(top.dedicated_servers), colocated=colocated.pop())
    except ConfigError:
        return None


def _workers_layout(ctx: Context) -> Layout:
    """What the model's checks see of a run without a layout of the CLI's (machines of
    unlike sizes or servers, as torchrun may start them): its workers, over its machines
    where each holds as many (a strategy that lays itself out by machine needs that, and
    :func:`distribute` refused it otherwise), else as on one."""
    top = ctx.topology
    even = len({len(top.workers_on(m)) for m in top.worker_machines}) == 1
    return Layout(workers=len(top.workers), nodes=len(top.worker_machines) if even else 1)


def strategy_of(model: nn.Module | Trainer) -> Strategy[Any]:
    """The strategy instance of the model :func:`distribute` returned (or of a trainer)."""
    if isinstance(model, Trainer):
        return model.strategy
    strategy = (_OWN_MODELS.get(model) if isinstance(model, nn.Module) else None) or \
        getattr(model, "_polytrain_strategy", None)
    if not isinstance(strategy, Strategy):
        raise ConfigError("this model did not come from polytrain.distribute()",
                          "pass the model that distribute() returned")
    return strategy


def full_state_dict(model: nn.Module | Trainer) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU with the plain model's keys (shards and stages gathered)."""
    if isinstance(model, Trainer):
        return model.state_dict()
    return strategy_of(model).state_dict(model)
