"""Run options as frozen dataclasses, validated before any process starts."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from ._env import check_seconds, timeout_of
from .comm.bucket import plan_buckets
from .comm.partition import TensorSpec
from .data import DEFAULT_DATASET, check_dataset, check_divisible, training_data
from .data.batches import check_seed
from .emulation.devices import parse_cluster
from .emulation.profile import ModelProfile, optimizer_state_factor, profile_model
from .errors import ConfigError, at_least, first_line, unknown
from .kinds import check_kinds, plain
from .launch.host import available_memory_bytes
from .launch.launcher import check_port
from .launch.layout import Layout
from .launch.network import LinkShape, check_links, link_shape
from .models import GPT, get_model, seq_len_of
from .optim import OPTIMIZERS, check_optimizer_name, make_optimizer
from .strategies.base import Strategy, get_strategy, make_options
from .strategies.byteps.plan import optimal_shares
from .strategies.herring.ddp import bucket_cap_bytes
from .strategies.herring.plan import herring_traffic

#: What ``device`` takes: each worker's GPU is chosen for it (``polytrain.init``).
DEVICES = ("cpu", "cuda")
#: The fields that count (steps, samples, processes): a whole number, or None where allowed.
_WHOLE = {"workers": "--workers", "nodes": "--nodes", "servers": "--servers",
          "steps": "--steps", "batch_size": "--batch-size", "warmup_steps": "--warmup-steps",
          "seed": "--seed", "eval_every": "--eval-every",
          "checkpoint_every": "--checkpoint-every", "keep": "--keep",
          "max_restarts": "--max-restarts", "port": "--port"}
#: The fields that name a file or directory: a str, or a path (``pathlib.Path``) kept as one.
_PATHS = ("out", "init", "resume", "devices")
#: What each of them takes, for the refusal of a blank one.
_BLANK_HINTS = {"out": "DIR", "init": "a final.pt of an earlier run",
                "resume": "a run's --out or one of its checkpoints/step-S",
                "devices": "a cluster ('m0:fast*2,m1:slow*2') or a JSON file"}

__all__ = ["TrainConfig", "OPTIMIZERS", "SCHEDULES", "SAMPLINGS", "ON_SAVE_ERROR",
           "check_init", "layout_of", "check_strategy", "check_link", "check_data_length",
           "model_sample", "model_profile", "check_weights_fit"]

SCHEDULES = ("constant", "cosine")
SAMPLINGS = ("random", "epoch")
ON_SAVE_ERROR = ("continue", "stop")

# torch's DistributedDataParallel copies worker 0's parameters and buffers to the others
# first of all, in messages of about this size (its broadcast_bucket_size).
_DDP_BROADCAST_BYTES = 250 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``polytrain train`` needs; the CLI builds one and so can a user.

    A field of another kind than its annotation is refused (``lr="0.1"``: ConfigError);
    the path fields (out, init, resume, devices) also take a ``pathlib.Path``, kept as a str.

    Args:
        strategy: a registered strategy (default ``ddp``).
        model: a registered model (default ``gpt``); model_options go to its constructor.
        data: a data set (default ``text``: the standard library's source, as bytes).
        workers, nodes, servers: the layout (default 2 workers on 1 machine, no servers;
            ``single`` runs 1 worker; with ``devices``, its workers and machines).
        steps: training steps (default 500). batch_size: GLOBAL batch (default 32).
        lr, optimizer: learning rate and ``sgd``, ``adam`` (lazy on sparse gradients) or
            ``adagrad`` (default 2e-3, adam).
        lr_schedule: ``constant`` (default) or ``cosine``: from ``lr`` after the warm-up
            down to ``lr / 10`` at the last step (a ``torch.optim.lr_scheduler`` on the
            optimizer the strategy returns, stepped after every step).
        warmup_steps: the first steps' learning rate rises linearly to ``lr`` (default 0).
        seed: weights and batches are a function of it (default 0).
        out: directory for ``metrics.json`` and ``final.pt`` (default: none written).
        quiet: no progress bar. timeout_s: longest wait on a peer (default
            POLYTRAIN_TIMEOUT, else 120 s, as ``polytrain train``). port: rendezvous port
            (default: a free one; refused for ``single``, which has no rendezvous).
        device: ``cpu`` or ``cuda``. strategy_options: the strategy's own options.
        bandwidth, latency: emulate the cluster's network: every machine in a network
            namespace of its own, its NIC shaped to ``bandwidth`` each way (``"1gbit"``,
            tc's units) and every packet it sends delayed by ``latency`` (``"0.2ms"``);
            needs root and iproute2, and a link to shape: 2 machines or more, or servers.
            Default: none (all processes on loopback).
        devices: the emulated cluster (``m0:fast*2,m1:slow*2`` or a JSON file; see
            :func:`polytrain.emulation.parse_cluster`): it sets the workers and machines,
            every worker runs at its device's speed (on CPU), and layouts that do not
            fit the devices' memory are refused. Default: none (real speed).
        init: start from this ``final.pt`` of the same model (any strategy); another model's
            weights are refused naming the first key that differs. Default: none.
        eval_every: every N steps (and after the last), the loss and next-token accuracy on
            held-out data (the last tenth of the data set, never trained on) go to
            ``metrics.json`` as ``eval``. Default: none.
        sampling: ``random`` windows of the corpus (default), or ``epoch``: a fixed set of
            non-overlapping windows, each once per epoch in a fresh order.
        checkpoint_every: write ``out/checkpoints/step-S/`` every this many steps (default:
            none; needs ``out``). keep: how many of the newest whole checkpoints stay
            (default: all). on_save_error: ``continue`` (default: warn, train on) or
            ``stop`` when a checkpoint cannot be written.
        resume: continue from a checkpoint (``.../step-S``) or the newest whole one of a
            run's ``out`` directory (default: none, start afresh).
        max_restarts: when a process dies or hangs, stop the run and start it again from the
            newest checkpoint, up to this many times (default 0).
        auto: set by ``--strategy auto`` (:func:`polytrain.plan.auto_record`): the
            planner's choice, why, and every strategy's prediction; ``metrics.json``
            records it as ``auto``. Default: none.
    """

    strategy: str = "ddp"
    model: str = "gpt"
    data: str = DEFAULT_DATASET
    workers: int | None = None  # None: 1 for ``single``, else 2
    nodes: int | None = None  # None: the devices' machines, else 1
    servers: int = 0
    steps: int = 500
    batch_size: int = 32
    lr: float = 2e-3
    optimizer: str = "adam"
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    seed: int = 0
    out: str | None = None
    quiet: bool = False
    timeout_s: float = field(default_factory=timeout_of)
    port: int | None = None
    device: str = "cpu"
    devices: str | None = None
    bandwidth: str | None = None
    latency: str | None = None
    model_options: Mapping[str, Any] = field(default_factory=dict)
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    init: str | None = None
    eval_every: int | None = None
    sampling: str = "random"
    checkpoint_every: int | None = None
    keep: int | None = None
    on_save_error: str = "continue"
    resume: str | None = None
    max_restarts: int = 0
    auto: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self._check_kinds()
        self._check_blank()
        # The model's options go to its constructor as given, and to the run record and
        # metrics.json: numpy's numbers as Python's (numpy.int64 failed writing them).
        object.__setattr__(self, "model_options",
                           {name: plain(v) for name, v in self.model_options.items()})
        if self.device not in DEVICES:
            raise unknown("device", self.device, DEVICES, "pass --device cpu or cuda (a worker "
                          "takes its own GPU)", plural="devices")
        self._check_checkpoints()
        # The layout fields left out, filled in below for this strategy and these devices:
        # replace() leaves them out again, so that they follow another strategy or devices.
        object.__setattr__(self, "_filled", tuple(n for n in ("workers", "nodes")
                                                  if getattr(self, n) is None))
        cluster = parse_cluster(self.devices) if self.devices is not None else None
        if cluster is not None:
            workers, nodes = cluster.fit_layout(self.workers, self.nodes)
            object.__setattr__(self, "workers", workers)
            object.__setattr__(self, "nodes", nodes)
        if self.nodes is None:
            object.__setattr__(self, "nodes", 1)
        if self.workers is None:
            object.__setattr__(self, "workers", 2 if get_strategy(self.strategy).distributed else 1)
        check_optimizer_name(self.optimizer)
        at_least("--steps", self.steps, "pass --steps 300")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"--lr must be a positive number (got {self.lr})",
                              "pass --lr 0.003")
        at_least("--batch-size", self.batch_size, "pass --batch-size 32")
        check_seed(self.seed, "--seed", "pass --seed 0")
        if self.port is not None and not get_strategy(self.strategy).distributed:
            raise ConfigError(f"--port {self.port} is the rendezvous port of a run's processes, "
                              f"and strategy {self.strategy!r} trains in this one process",
                              "leave --port out, or pick a distributed strategy such as ddp")
        check_port(self.port)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: torch sees no CUDA device on this machine",
                              "leave --device out to train on the CPU, or install a CUDA "
                              "build of torch where there is a GPU")
        if self.lr_schedule not in SCHEDULES:
            raise unknown("learning-rate schedule", self.lr_schedule, SCHEDULES,
                          "pass --lr-schedule constant or cosine", plural="schedules")
        if not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"--warmup-steps must be at least 0 and less than --steps "
                              f"{self.steps} (got {self.warmup_steps})",
                              f"pass --warmup-steps {max(0, self.steps // 10)}")
        check_seconds(self.timeout_s, "--timeout", "pass --timeout 120")
        if self.link() is not None and not get_strategy(self.strategy).distributed:
            raise ConfigError(f"--bandwidth shapes the links between machines, and strategy "
                              f"{self.strategy!r} trains in one process",
                              "leave --bandwidth and --latency out, or pick a distributed "
                              "strategy such as ddp")
        check_dataset(self.data)
        if self.sampling not in SAMPLINGS:
            raise unknown("sampling", self.sampling, SAMPLINGS, "pass --sampling random or epoch")
        if self.eval_every is not None and self.eval_every < 1:
            raise ConfigError(f"--eval-every must be at least 1 step (got {self.eval_every})",
                              "pass --eval-every 50")
        spec = get_model(self.model)
        spec.check_data(self.data)
        with torch.device("meta"):  # the model's own checks, without allocating it
            model = spec.make(**self.model_options)
        cls = get_strategy(self.strategy)
        if self.checkpoint_every is not None or self.resume is not None:
            cls.check_checkpoints()
        if self.eval_every is not None and not cls.evaluates():
            raise ConfigError(f"strategy {self.strategy!r} holds part of the model on each "
                              f"worker and has no held-out evaluation",
                              "leave out --eval-every, or evaluate the run's final.pt")
        if self.init is not None:
            check_init(self.init, model)
        options = make_options(cls, dict(self.strategy_options))
        # Kept as the options took them (a path as a str, numpy's numbers as Python's): the
        # run record and metrics.json write them as JSON.
        object.__setattr__(self, "strategy_options",
                           {name: getattr(options, name) for name in self.strategy_options})
        if self.model_options.get("dense_grads") and getattr(options, "sparse_embeddings", False):
            # parallax's default makes every embedding sparse, whatever the model built.
            raise ConfigError(f"--dense-grads builds model {self.model!r}'s embeddings dense, "
                              f"and strategy {self.strategy!r} makes every embedding sparse "
                              f"(sparse_embeddings=True): the run would train sparse gradients",
                              f"pass --no-sparse-embeddings too ({self.strategy} then sums the "
                              f"dense tables on the workers), or leave out --dense-grads")
        layout = self.layout()
        check_strategy(cls, options, layout, model, make_optimizer(self.optimizer, model, self.lr))
        check_divisible(self.batch_size, cls.replicas(layout, options))
        batches, _ = self._check_data(spec, model)
        self._check_devices(model)
        if self.resume is None:  # a resume runs as its checkpoint's run did (options checked)
            cls.check_steps(options, steps=self.steps, data=self.data,
                            batch_size=self.batch_size,
                            epoch_steps=getattr(batches, "steps_per_epoch", None))
        check_link(self.strategy, options, model, layout, bandwidth=self.bandwidth,
                   latency=self.latency, timeout_s=self.timeout_s,
                   # CUDA workers that share this host's GPUs go over gloo (runtime.cuda_backend)
                   gloo=self.device != "cuda" or torch.cuda.device_count() < layout.workers)
        # A strategy of its own step (a pipeline's) runs the model on micro-batches.
        whole = cls.train_step is Strategy.train_step
        self._check_memory(model, layout.workers, cls.replicas(layout, options), whole)
        self._check_out()  # last: a refused command leaves no directory behind

    def _check_out(self) -> None:
        """Refuse an ``--out`` that cannot be made a directory now, so that it fails before
        training (not after it, losing the run), without making it: a run refused later
        (a damaged --resume, say) leaves no directory behind."""
        if self.out is None:
            return
        out = Path(self.out).absolute()
        first = next(p for p in (out, *out.parents) if p.exists())  # "/" exists
        why = ("File exists" if first.is_file() and first == out else
               "Not a directory" if not first.is_dir() else
               "Permission denied or read-only" if not os.access(first, os.W_OK | os.X_OK)
               else None)
        if why is not None:
            raise ConfigError(f"--out {self.out} cannot be made a directory: {why}",
                              "pass --out a directory you can write to (it is made if missing)")

    def _check_blank(self) -> None:
        """Refuse a path field given blank: ``Path("")`` is the working directory, which an
        empty ``--resume ''`` resumed from (and ``--out ''`` wrote to) without a word."""
        for name in _PATHS:
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise ConfigError(f"--{name} is empty (got {value!r})",
                                  f"pass --{name} {_BLANK_HINTS[name]}, or leave it out")

    def _check_kinds(self) -> None:
        """Refuse a field of another kind than its annotation says, given from Python
        (:func:`~polytrain.kinds.check_kinds`, which strategy options go through too): a
        count by its flag, a path field's ``pathlib.Path`` kept as a str, numpy's numbers as
        Python's."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in check_kinds(TrainConfig, values, flags=_WHOLE, paths=_PATHS).items():
            if value is not values[name]:
                object.__setattr__(self, name, value)

    def _check_checkpoints(self) -> None:
        if self.checkpoint_every is not None:
            if self.checkpoint_every < 1:
                raise ConfigError(f"--checkpoint-every must be at least 1 step (got "
                                  f"{self.checkpoint_every})",
                                  f"pass --checkpoint-every {max(1, self.steps // 10)}, or "
                                  f"leave it out to write no checkpoints")
            if self.out is None:
                raise ConfigError("--checkpoint-every writes OUT/checkpoints/, and no --out "
                                  "is given", "pass --out DIR")
            if self.checkpoint_every > self.steps:
                raise ConfigError(f"--checkpoint-every {self.checkpoint_every} is past --steps "
                                  f"{self.steps}: no checkpoint would be written",
                                  f"pass --checkpoint-every {max(1, self.steps // 10)}")
        if self.keep is not None:
            at_least("--keep", self.keep, "pass --keep 2, or leave it out to keep every checkpoint")
            if self.checkpoint_every is None:
                raise ConfigError("--keep K prunes checkpoints, and no --checkpoint-every "
                                  "is given", "pass --checkpoint-every N")
        if self.on_save_error not in ON_SAVE_ERROR:
            raise unknown("--on-save-error", self.on_save_error, ON_SAVE_ERROR,
                          "pass --on-save-error continue or stop", plural="choices")
        if self.on_save_error == "stop" and self.checkpoint_every is None:
            raise ConfigError("--on-save-error stop says what a checkpoint that cannot be "
                              "written does, and no --checkpoint-every is given",
                              "pass --checkpoint-every N with --out DIR, or leave out "
                              "--on-save-error")
        if self.init is not None and self.resume is not None:
            raise ConfigError(f"--init {self.init} starts a run from a final.pt, and --resume "
                              f"{self.resume} continues a checkpoint, whose weights would "
                              f"replace it", "pass one of them")
        at_least("--max-restarts", self.max_restarts, "pass --max-restarts 2", minimum=0)
        if self.max_restarts and self.checkpoint_every is None:
            raise ConfigError(f"--max-restarts {self.max_restarts} restarts from the newest "
                              f"checkpoint, and no --checkpoint-every is given",
                              "pass --checkpoint-every N with --out DIR")
        if self.max_restarts and not get_strategy(self.strategy).distributed:
            raise ConfigError(f"--max-restarts {self.max_restarts} starts a run's processes "
                              f"again when one dies, and --strategy {self.strategy} trains "
                              f"in this one process, with none to restart",
                              f"leave out --max-restarts (and, after a failure, go on with "
                              f"--resume {self.out or 'OUT'}), or train with a distributed "
                              f"strategy")

    def _check_data(self, spec: Any, model: Any) -> tuple[Any, Any]:
        """Refuse data too short for the run's windows, batches or held-out part now, and not
        in every worker once the processes have started (:func:`check_data_length`)."""
        return check_data_length(spec, model, self.model_options, data=self.data,
                                 batch_size=self.batch_size, seed=self.seed,
                                 sampling=self.sampling, hold_out=self.eval_every is not None)

    def _check_memory(self, model: Any, processes: int, replicas: int, whole: bool) -> None:
        """Refuse a job whose weights, or weights and batch, cannot fit in this host's free
        memory. Every worker process builds the whole model on the CPU before its strategy
        keeps its part (``processes`` copies); on the CPU the optimizer's state comes on top,
        once at least. Every worker holds each global batch's token ids (int64); a GPT on
        the CPU whose step runs the model on a replica's whole slice (``whole``: not a
        pipeline's micro-batches) makes its logits, (slice, seq_len, vocab), on one worker
        at least. Gradients and other activations come on top of that, so a job that passes
        may still not fit: the launcher then names the kernel's out-of-memory kill."""
        states = optimizer_state_factor(self.optimizer) if self.device == "cpu" else 0
        weights = check_weights_fit(model, name=f"{self.model} with these options",
                                    copies=processes, per="one per worker",
                                    optimizer=self.optimizer if states else None,
                                    hint="pass a smaller model (--d-model, --layers)"
                                    + (" or fewer --workers" if processes > 1 else ""))
        if weights is None:  # this machine's free memory is unknown
            return
        need, available = weights
        window = seq_len_of(model, self.model_options) + 1
        per_sample = processes * window * 8  # bytes of each sample of the global batch
        where = f" on each of its {processes} workers" if processes > 1 else ""
        what = f"the batch's token ids{where}, {self.batch_size} x {window} int64"
        if whole and self.device == "cpu" and isinstance(model, GPT):
            head = model.get_submodule("head.out")  # (..., d_model) -> (..., vocab)
            assert isinstance(head, torch.nn.Linear)
            vocab, dtype = head.out_features, head.weight.dtype
            per_sample += (window - 1) * vocab * head.weight.element_size() // replicas
            whose = "the batch's logits" if replicas == 1 else "the logits of a replica's slice"
            what += (f", and {whose}, {self.batch_size // replicas} x {window - 1} x {vocab} "
                     f"{str(dtype).removeprefix('torch.')}")
        total = need + self.batch_size * per_sample
        if total > available:
            fits = (available - need) // per_sample // replicas * replicas
            raise ConfigError(
                f"--batch-size {self.batch_size} of {self.model} with these options needs at "
                f"least {total / 2**30:,.1f} GiB of this machine's memory (its weights"
                f"{f' and {self.optimizer} state' if states else ''}, {what}), and this "
                f"machine has {available / 2**30:,.1f} GiB available",
                f"pass a smaller --batch-size (at most {fits} fits this lower bound; the "
                f"model's other activations need more)" if fits else
                "pass a smaller model (--d-model, --layers) or fewer --workers")

    def _check_devices(self, model: Any) -> str | None:
        spec = get_model(self.model)
        cls = get_strategy(self.strategy)
        cluster = parse_cluster(self.devices) if self.devices is not None else None
        return cls.check_devices(cluster, lambda: model_profile(spec, model, self.model_options),
                                 self.layout(), make_options(cls, dict(self.strategy_options)),
                                 batch_size=self.batch_size, optimizer=self.optimizer)

    def plan_summary(self) -> str | None:
        """The strategy's plan on this run's devices, printable (None if it makes none)."""
        with torch.device("meta"):
            model = get_model(self.model).make(**self.model_options)
        return self._check_devices(model)

    def link(self) -> LinkShape | None:
        """The emulated network's links (None: no ``bandwidth``, no emulation)."""
        return link_shape(self.bandwidth, self.latency)

    def layout(self) -> Layout:
        assert self.workers is not None and self.nodes is not None
        return layout_of(self.strategy, self.strategy_options, workers=self.workers,
                         nodes=self.nodes, servers=self.servers)

    def replace(self, **changes: Any) -> TrainConfig:
        """This config with ``changes``; ``workers`` and ``nodes`` that it filled in itself (not
        given) are filled in again, for the new strategy or devices (``single``'s 1 worker
        made a ddp run of 1 worker)."""
        filled = {name: None for name in getattr(self, "_filled", ())}
        return dataclasses.replace(self, **{**filled, **changes})


def check_link(strategy: str, options: Any, model: torch.nn.Module, layout: Layout, *,
               bandwidth: str | None, latency: str | None, timeout_s: float,
               emulated: bool = True, gloo: bool = True) -> None:
    """Refuse an emulated network that ``strategy`` on ``layout`` cannot use: one machine
    with no server machines has no link to shape (``emulated``; a real machine's network,
    which the planner may be told of, is not shaped), and a link too slow for a run's first
    wait fails it. At the start every strategy copies worker 0's model (``model``, the meta
    device's will do) to the other workers a tensor at a time (torch's DDP all of it in one
    message of up to 250 MiB), down gloo's broadcast tree (:func:`_broadcast_copies`;
    ``gloo``: CPU workers, not GPUs, whose NCCL broadcast pipelines one copy down a chain),
    and a wait longer than ``timeout_s`` fails the run. byteps and herring then wait for each
    sum at once, its pushes to the servers and their answers (:func:`_sum_wait`), which a
    wait longer than ``timeout_s`` fails too. TrainConfig runs it, and the planner on each
    candidate."""
    link = link_shape(bandwidth, latency)
    if link is None:
        return
    if emulated:
        check_links(layout, str(bandwidth), serverless=None if get_strategy(strategy)
                    .uses_servers(options) else strategy)
    if layout.nodes > 1:  # (on one machine the model crosses no link: it holds every worker)
        _check_first_copy(strategy, model, layout, link, bandwidth=bandwidth,
                          timeout_s=timeout_s, gloo=gloo)
    wait = _sum_wait(strategy, options, model, layout)
    if wait is not None:
        busiest, what = wait
        seconds = busiest * 8 / link.rate_bit_s
        if seconds > timeout_s:
            _too_slow(bandwidth, what, f"in {seconds:,.0f} s", seconds, busiest * 8 / timeout_s,
                      timeout_s)


def _check_first_copy(strategy: str, model: torch.nn.Module, layout: Layout, link: LinkShape, *,
                      bandwidth: str | None, timeout_s: float, gloo: bool) -> None:
    """check_link's refusal of a ``link`` too slow for worker 0's first copy of ``model``."""
    nbytes, name = max(((t.numel() * t.element_size(), n) for n, t in model.named_parameters()),
                       key=lambda size_name: size_name[0])  # the first of the largest
    what = f"the model's largest tensor ({name}, {nbytes:,} bytes), which every worker gets"
    if strategy == "ddp":
        total, largest = _ddp_first_messages(model)
        if largest > nbytes:
            nbytes = largest
            what = (f"the model's parameters and buffers ({total:,} bytes), which torch's "
                    f"DDP sends in one message" if nbytes == total else
                    f"{nbytes:,} bytes of the model's parameters and buffers (of "
                    f"{total:,}), which torch's DDP sends in one message")
    one = nbytes * 8 / link.rate_bit_s
    copies = round(_broadcast_copies(layout.workers, layout.nodes), 6) if gloo else 1.0
    seconds = one * copies
    if seconds <= timeout_s:
        return
    took = (f"in {seconds:,.0f} s" if copies == 1 else
            f"to the last worker in {seconds:,.0f} s (gloo's broadcast passes it down a tree "
            f"whose senders share their links: {copies:g} times one copy's {one:,.1f} s)")
    _too_slow(bandwidth, f"{what} from worker 0 at the start", took, seconds,
              nbytes * 8 * copies / timeout_s, timeout_s)


def _too_slow(bandwidth: str | None, what: str, took: str, seconds: float, need_bit_s: float,
              timeout_s: float) -> None:
    """check_link's refusal: ``bandwidth`` carries ``what`` (``took``: how long, ``seconds``)
    past ``timeout_s``; ``need_bit_s`` would carry it in time."""
    rate = (f"{math.ceil(need_bit_s / 1e3)}kbit" if need_bit_s < 1e6 else
            f"{math.ceil(need_bit_s / 1e6)}mbit")
    raise ConfigError(f"--bandwidth {bandwidth} carries {what}, {took}, longer than --timeout "
                      f"{timeout_s:g}: the run would time out there",
                      f"pass --bandwidth {rate} or more (a real network's is 1gbit or more), "
                      f"or a --timeout above {math.ceil(seconds)}")


def _sum_wait(strategy: str, options: Any, model: torch.nn.Module, layout: Layout
              ) -> tuple[float, str] | None:
    """The bytes the busiest machine's link carries one way while a byteps or herring worker
    waits for one sum, and what they are (None: another strategy, or compressed or
    asynchronous byteps, whose sums this does not size).

    A worker waits for a sum at once: byteps's fused group of gradients (``fuse_bytes``,
    cut into partitions over the servers by Theorem 1's shares), herring's fusion buffer
    (``bucket_cap_mb``, a shard a server machine). Every machine pushes the shards it does
    not own and answers the others' pulls of its own, and a server answers a shard only when
    every machine's push of it is in: the busiest link carries its traffic per step
    (:func:`~polytrain.strategies.byteps.plan.optimal_shares`,
    :func:`~polytrain.strategies.herring.plan.herring_traffic`, in units of the model) times
    the group, one way, before the last worker's wait ends (at least: pushes and answers of
    one partition do not overlap). The group is the first a worker waits for: its bytes
    cannot cross before its wait begins (byteps waits in model order after the backward pass,
    which makes the first layers' gradients last; herring waits from its first bucket's
    push), where a later, larger group's may have crossed in part during the waits before
    its own (each wait has a timeout of its own), so that a run it would refuse may finish.
    """
    if strategy not in ("byteps", "herring"):
        return None
    specs = [TensorSpec.of(n, p) for n, p in model.named_parameters() if p.requires_grad]
    colocated = layout.colocated > 0
    if not specs or not (layout.nodes > 1 or layout.servers):
        return None  # nothing to sum, or nothing crosses a link
    if strategy == "byteps":
        if options.async_ or options.compress != "none" or options.compress_adam:
            return None
        groups = plan_buckets(specs, fill_bytes=options.fuse_bytes, reverse=False)
        share = optimal_shares(layout.nodes, layout.servers,
                               colocate=colocated).traffic_per_machine()
        unit = "fused group of gradients"
    else:
        groups = plan_buckets(specs, cap_bytes=bucket_cap_bytes(options.bucket_cap_mb),
                              reverse=True)
        traffic = herring_traffic(layout.nodes, layout.servers, colocated=colocated)
        share = max(traffic.values())
        unit = "fusion buffer"
    first = groups[0].nbytes  # byteps's in model order, herring's backward's first
    busiest = share * first
    return busiest, (f"{strategy}'s first sum, which a worker waits for at once (a {unit} "
                     f"of {first:,} bytes: {busiest:,.0f} bytes over the busiest machine's "
                     f"link, the pushes to the servers and their answers)")


def check_data_length(spec: Any, model: torch.nn.Module, model_options: Mapping[str, Any], *,
                      data: str, batch_size: int, seed: int = 0, sampling: str = "random",
                      hold_out: bool = False) -> tuple[Any, Any]:
    """Refuse data set ``data`` when it is too short for ``model``'s windows (``spec``'s, a
    registered model's; the meta device's will do), the batches or the held-out part:
    ``data.training_data``'s rules, on a stand-in of the corpus's length (``meta``: no copy
    of it is made). Returns its batches and held-out part (stand-ins too). TrainConfig runs
    it, and the planner before it times the model."""
    tokens = spec.tokens(model, data).numel()
    return training_data(torch.empty(tokens, dtype=torch.uint8, device="meta"),
                         window=seq_len_of(model, model_options) + 1, batch_size=batch_size,
                         seed=seed, sampling=sampling, hold_out=hold_out)


def _broadcast_copies(workers: int, nodes: int) -> float:
    """How long gloo's broadcast from worker 0 takes to reach the last of ``workers`` on
    ``nodes`` machines (Layout's order: ``workers // nodes`` a machine), in times one copy's
    time over a link.

    gloo's broadcast is a binomial tree: worker v, once it holds the tensor, sends it at
    once to each worker v + 2**i with 2**i > v. Copies between machines share each sender's
    upload and each receiver's download fairly (max-min, as TCP flows through one shaper);
    copies inside a machine take no time. Four machines of one worker: 0 sends to 1 and 2
    at once (2 copies' time), then 1 to 3 (3)::

        >>> [_broadcast_copies(n, n) for n in (2, 4, 8)]
        [1.0, 3.0, 6.0]
    """
    per_node = workers // nodes
    flows: list[list[Any]] = []  # [sender, receiver, what is left of the copy]
    now = last = 0.0

    def holds(v: int) -> None:  # worker v holds the tensor now: it sends to its children
        for child in (v + 2 ** i for i in range(v.bit_length(), workers.bit_length())):
            if child >= workers:
                break
            if child // per_node == v // per_node:
                holds(child)  # over its machine's loopback
            else:
                flows.append([v, child, 1.0])

    holds(0)
    while flows:
        links = [(("up", s // per_node), ("down", r // per_node)) for s, r, _ in flows]
        rates = _fair_shares(links)
        step = min(left / rate for (_, _, left), rate in zip(flows, rates))
        now += step
        for f, rate in zip(flows, rates):
            f[2] -= rate * step
        arrived = [r for _, r, left in flows if left <= 1e-9]
        flows = [f for f in flows if f[2] > 1e-9]
        for r in arrived:
            last = now
            holds(r)
    return round(last, 9)


def _fair_shares(links: list[tuple[Any, ...]]) -> list[float]:
    """Max-min fair rates of flows over links of rate 1, each flow crossing ``links[i]``:
    the link whose equal share among its unfixed flows is least fixes theirs, in turn."""
    rates = [0.0] * len(links)
    left = {link: 1.0 for path in links for link in path}
    unfixed = set(range(len(links)))
    while unfixed:
        share, link = min((left[link] / sum(link in links[i] for i in unfixed), link)
                          for link in left if any(link in links[i] for i in unfixed))
        for i in [i for i in unfixed if link in links[i]]:
            rates[i] = share
            unfixed.discard(i)
            for other in links[i]:
                left[other] -= share
    return rates


def _ddp_first_messages(model: Any) -> tuple[int, int]:
    """The bytes of ``model``'s parameters and buffers, and of the largest message torch's
    DDP copies them from worker 0 in (its ``_broadcast_coalesced``: the tensors of a dtype
    in turn, a message ending once it holds ``_DDP_BROADCAST_BYTES`` or more)."""
    total = largest = 0
    held: dict[torch.dtype, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        nbytes = t.numel() * t.element_size()
        total += nbytes
        size = held.get(t.dtype, 0) + nbytes
        largest = max(largest, size)
        held[t.dtype] = 0 if size >= _DDP_BROADCAST_BYTES else size
    return total, largest


def check_init(path: str, model: Any) -> dict[str, torch.Tensor]:
    """The state dict in ``path`` (a ``final.pt``), refused unless it has ``model``'s keys and
    shapes; the error names the first key that differs."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises what the bytes make it raise
        # torch's text for a file it cannot unpickle runs over lines and advises loading it
        # with weights_only=False, unsafe for a file that is not a checkpoint at all.
        # Any other bytes make it raise whatever they happen to (an IndexError for a text
        # file): only the file system's own errors say more than that.
        detail = (first_line(e) if isinstance(e, OSError)
                  else "not a file of tensors that torch.save wrote, or a damaged one")
        raise ConfigError(f"--init {path} cannot be read as a final.pt ({detail})",
                          "pass the final.pt of an earlier run of the same --model") from None
    if not isinstance(state, dict):
        raise ConfigError(f"--init {path} holds a {type(state).__name__}, not a state dict",
                          "pass the final.pt of an earlier run of the same --model")
    want = model.state_dict()
    hint = "pass the final.pt of a run of the same --model and model options"
    if set(state) != set(want):  # the first key that differs, in order (any order loads)
        for a, b in zip(want, list(state) + [None] * len(want)):
            if b != a:
                raise ConfigError(f"--init {path} holds another model's weights: the first "
                                  f"key that differs is {a!r} here but "
                                  f"{'missing' if b is None else repr(b)} there", hint)
        extra = list(state)[len(want)]
        raise ConfigError(f"--init {path} holds another model's weights: the first key that "
                          f"differs is {extra!r}, which this model lacks", hint)
    for a, ta in want.items():
        b = state[a]
        if not isinstance(b, torch.Tensor):
            raise ConfigError(f"--init {path} holds a {type(b).__name__} as {a!r}, not a "
                              f"tensor", hint)
        if tuple(b.shape) != tuple(ta.shape):
            raise ConfigError(f"--init {path} holds another model's weights: {a!r} is "
                              f"{list(ta.shape)} here but {list(b.shape)} there", hint)
    return state


def layout_of(strategy: str, options: Mapping[str, Any], *, workers: int, nodes: int,
              servers: int) -> Layout:
    """The processes ``polytrain train`` starts for ``strategy`` with its ``options``, its
    colocated servers too (TrainConfig's layout, and the planner's of each candidate)."""
    cls = get_strategy(strategy)
    return Layout(workers=workers, nodes=nodes, servers=servers,
                  colocated=cls.colocated_servers(make_options(cls, dict(options))))


def check_strategy(cls: type[Strategy], options: Any, layout: Layout, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> None:
    """A strategy's checks before any process starts, on ``layout`` and ``model`` (built on the
    meta device) with ``optimizer`` over it: TrainConfig runs them, and the planner on each
    candidate, to leave out those ``polytrain train`` would refuse (each then runs
    ``cls.check_devices`` too; TrainConfig its batch's and data's checks before it)."""
    cls.check_layout(layout, options)
    cls.check_model(model, layout, options)
    cls.check_run_model(model, layout, options)
    cls.check_optimizer(optimizer, options)


def model_sample(spec: Any, model: torch.nn.Module, model_options: Mapping[str, Any], *,
                 batch: int = 1) -> tuple[Any, Any]:
    """``batch`` windows of ``model``'s length (``spec``'s, a registered model's), split into
    its inputs and targets: token ids the model has (wordlm's ``--vocab`` may be under 256,
    the text's bytes), the same every call."""
    gen = torch.Generator().manual_seed(0)
    window = torch.randint(0, min(256, int(getattr(model, "vocab", 256))),
                           (batch, seq_len_of(model, model_options) + 1), generator=gen)
    return spec.split(window)


def model_profile(spec: Any, model: torch.nn.Module,
                  model_options: Mapping[str, Any]) -> ModelProfile:
    """``model``'s layers measured on one sample (:func:`model_sample`): what a strategy's
    ``check_devices`` places on the devices, and ``--devices``' compute rests on."""
    return profile_model(model, model_sample(spec, model, model_options)[0])


def check_weights_fit(model: torch.nn.Module, *, name: str, copies: int, per: str,
                      optimizer: str | None, hint: str) -> tuple[int, int] | None:
    """Refuse ``model`` (the meta device's will do) when ``copies`` of its weights (``per``:
    whose they are) and, once, the state of ``optimizer`` (None: none in this memory) outgrow
    this machine's free memory; the error names it ``name``. Returns the bytes they need and
    those available (None: unknown, nothing refused)."""
    available = available_memory_bytes()
    if available is None:
        return None
    count = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = optimizer_state_factor(optimizer) if optimizer is not None else 0
    need = weights * (copies + states)
    if need > available:
        raise ConfigError(f"{name} has {count / 1e6:,.0f} M weights ({weights / 2**30:,.1f} "
                          f"GiB); {copies} cop{'y' if copies == 1 else 'ies'} of them ({per})"
                          f"{f' and {optimizer} state' if states else ''} need at least "
                          f"{need / 2**30:,.1f} GiB, and this machine has "
                          f"{available / 2**30:,.1f} GiB available", hint)
    return need, available
