"""The planner: a job and its cluster in, every strategy's predicted step time and a choice out."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import _env
from ..config import check_data_length, check_link, check_strategy, layout_of, model_profile
from ..data import DEFAULT_DATASET, check_dataset
from ..emulation.devices import parse_cluster
from ..errors import ConfigError, at_least, check_whole, unknown
from ..launch.layout import Layout
from ..launch.network import link_shape
from ..models import get_model
from ..optim import check_optimizer_name, make_optimizer
from ..ps.grads import sparse_parameter
from ..strategies.base import get_strategy, make_options
from .compute import BUDGET_S, device_compute, measure_compute
from .cost import Candidate, Compute, Constants, Network, Prediction, candidates, predict, recommend

__all__ = ["Job", "Plan", "CONSTANTS", "HOSTS", "AUTO", "plan_job", "chosen", "auto_record",
           "host_cores"]

#: Fitted on ``./dev bench cluster`` runs of two model sizes, 27.3 MB and 1.59 MB of gradients
#: (benchmarks/results/cluster_stop36.json, cluster_small_stop36.json); docs/cluster.md says how.
CONSTANTS = Constants(
    efficiency={"ddp": 0.976, "byteps": 0.654, "herring": 0.969},
    host_s_per_byte={"ddp": 9.95e-10, "byteps": 8.99e-10, "herring": 9.04e-10},
    overhead_s={"ddp": 0.00699, "byteps": 0.0, "herring": 0.00300},
    tail={"byteps": 0.0126, "herring": 0.213},
    server_s={"byteps": 0.00375, "herring": 0.00327},
    combine={"ddp": 0.293, "byteps": 0.373, "herring": 0.563},
)

#: ``emulated``: every machine on this host, as ``polytrain train`` runs them; ``real``: each
#: machine its own host (a cluster larger than this machine).
HOSTS = ("emulated", "real")

#: ``--strategy auto``: the strategy the planner recommends.
AUTO = "auto"


def host_cores() -> int:
    """The cores this process may run on (the launcher's, :func:`polytrain._env.usable_cores`)."""
    return _env.usable_cores()


@dataclass(frozen=True, kw_only=True)
class Job:
    """What the planner needs: the model, the global batch, and the cluster it runs on.

    The fields are ``polytrain train``'s (``devices`` sets ``workers`` and ``nodes``);
    ``hosts`` says whether the machines are emulated on this host (``cores`` of it) or
    real ones; ``timeout_s`` is the run's (a link too slow for its first wait refuses a
    candidate, as ``polytrain train`` does).
    """

    model: str = "gpt"
    model_options: Mapping[str, Any] = field(default_factory=dict)
    workers: int | None = None
    nodes: int | None = None  # None: the devices' machines, else 1
    servers: int = 0
    batch_size: int = 32
    optimizer: str = "adam"
    bandwidth: str | None = None
    latency: str | None = None
    devices: str | None = None
    hosts: str = "emulated"
    cores: int | None = None
    data: str = DEFAULT_DATASET
    timeout_s: float = field(default_factory=_env.timeout_of)

    def __post_init__(self) -> None:
        # TrainConfig's checks: a count of 2.0 ended in a TypeError from inside torch, and
        # an unknown optimizer was timed as Adam.
        for name, flag in (("workers", "--workers"), ("nodes", "--nodes"),
                           ("servers", "--servers"), ("batch_size", "--batch-size"),
                           ("cores", "--cores")):
            check_whole(flag, getattr(self, name))
        for name, flag, default in (("servers", "--servers", 0),
                                    ("batch_size", "--batch-size", 32)):
            if getattr(self, name) is None:  # check_whole passes None: a TypeError in Layout
                raise ConfigError(f"{flag} must be a whole number (got None)",
                                  f"pass {flag} {default}")
        check_optimizer_name(self.optimizer)
        check_dataset(self.data)  # the prediction does not depend on it, but it must exist
        if self.devices is not None:
            cluster = parse_cluster(self.devices)
            workers, nodes = cluster.fit_layout(self.workers or None, self.nodes)
            if self.workers != 0:  # --workers 0 is Layout's to refuse, below
                object.__setattr__(self, "workers", workers)
            object.__setattr__(self, "nodes", nodes)
        if self.nodes is None:
            object.__setattr__(self, "nodes", 1)
        if self.workers is None:
            object.__setattr__(self, "workers", 2)
        assert self.workers is not None and self.nodes is not None
        if self.hosts not in HOSTS:
            raise unknown("--hosts", self.hosts, HOSTS,
                          "pass --hosts emulated (this machine) or real", plural="choices")
        if self.cores is not None and self.hosts == "real":
            raise ConfigError(f"--cores {self.cores} is the one host's cores that emulated "
                              f"machines share; with --hosts real each machine is a host",
                              "leave out --cores, or pass --hosts emulated")
        if self.cores is not None:
            at_least("--cores", self.cores, "pass --cores 2, or leave it out for this machine's")
        Layout(workers=self.workers, nodes=self.nodes, servers=self.servers)  # or its error
        at_least("--batch-size", self.batch_size, "pass --batch-size 32")
        if self.batch_size % self.workers:
            raise ConfigError(f"--batch-size {self.batch_size} (the global batch) does not "
                              f"split evenly over {self.workers} workers",
                              f"pass --batch-size a multiple of {self.workers}")
        link_shape(self.bandwidth, self.latency)  # a bad rate or time: its own ConfigError
        _env.check_seconds(self.timeout_s, "--timeout", "pass --timeout 120")
        spec = get_model(self.model)
        spec.check_data(self.data)
        # Before the timing (a minute, for a long window): train refused the choice.
        check_data_length(spec, self._meta_model(), self.model_options, data=self.data,
                          batch_size=self.batch_size)

    def network(self) -> Network:
        assert self.workers is not None and self.nodes is not None
        shape = link_shape(self.bandwidth, self.latency)
        return Network(machines=self.nodes, local_workers=self.workers // self.nodes,
                       servers=self.servers,
                       bandwidth_bit_s=None if shape is None else float(shape.rate_bit_s),
                       latency_s=0.0 if shape is None else shape.delay_s,
                       shared_host_cores=(self.cores or host_cores()) if self.hosts == "emulated"
                       else None)

    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._meta_model().parameters())

    def sparse_parameter(self) -> str | None:
        """The model's first parameter with sparse gradients (None: all dense)."""
        return sparse_parameter(self._meta_model())

    def _meta_model(self) -> torch.nn.Module:
        with torch.device("meta"):
            return get_model(self.model).make(**self.model_options)

    def compute(self, threads: int = 1, budget_s: float = BUDGET_S) -> Compute:
        """One worker's compute per step: its devices' speed, or measured here on
        ``threads`` threads within about ``budget_s`` (:func:`measure_compute`)."""
        assert self.workers is not None
        batch = self.batch_size // self.workers
        if self.devices is not None:
            return device_compute(self.model, self.model_options, batch=batch,
                                  cluster=parse_cluster(self.devices))
        return measure_compute(self.model, self.model_options, batch=batch,
                               optimizer=self.optimizer, threads=threads, budget_s=budget_s)

    def threads(self, candidate: Candidate) -> int:
        """The threads each worker of ``candidate`` gets when ``polytrain train`` launches it
        here (:func:`polytrain._env.process_threads`, the launcher's rule: servers take
        their share of the cores). Timed at one thread, the compute of ``--workers 1`` on 2
        cores was predicted at 174 ms and ran at 126. Real hosts (cores unknown) and
        emulated devices (a rate, not a timing) get 1.
        """
        if self.hosts == "real" or self.devices is not None:
            return 1
        # (timed here: never more threads than this machine has, whatever --cores says)
        return min(_env.process_threads(self._layout(candidate).world_size, self.cores),
                   host_cores())

    def refusals(self, candidates: Sequence[Candidate]) -> dict[Candidate, ConfigError]:
        """What ``polytrain train`` would refuse of each of ``candidates`` before starting it,
        with each strategy's defaults: the checks TrainConfig runs too, its strategy's of the
        layout, the model (built on the meta device) and the optimizer
        (:func:`~polytrain.config.check_strategy`), the network's
        (:func:`~polytrain.config.check_link`: ddp's first message is the whole model), and
        with ``devices`` whether every device holds what a worker keeps."""
        model = self._meta_model()
        optimizer = make_optimizer(self.optimizer, model, 1e-3)
        cluster = parse_cluster(self.devices) if self.devices is not None else None
        profile = functools.cache(lambda: model_profile(get_model(self.model), model,
                                                        self.model_options))
        if cluster is not None:  # up front: a model that cannot be profiled (wordlm, layer by
            profile()  # layer) is refused as itself, not as each candidate's refusal
        out = {}
        for c in candidates:
            cls = get_strategy(c.strategy)
            options = make_options(cls, {})
            layout = self._layout(c)
            try:
                check_strategy(cls, options, layout, model, optimizer)
                check_link(c.strategy, options, model, layout, bandwidth=self.bandwidth,
                           latency=self.latency, timeout_s=self.timeout_s,
                           # real hosts of GPUs (--devices): NCCL's broadcast, one copy
                           emulated=self.hosts == "emulated",
                           gloo=self.hosts == "emulated" or self.devices is None)
                cls.check_devices(cluster, profile, layout, options, batch_size=self.batch_size,
                                  optimizer=self.optimizer)
            except ConfigError as e:
                out[c] = e
        return out

    def _layout(self, candidate: Candidate) -> Layout:
        """The processes ``polytrain train`` starts for ``candidate`` (its strategy's defaults)."""
        assert self.workers is not None and self.nodes is not None
        return layout_of(candidate.strategy, {}, workers=self.workers, nodes=self.nodes,
                         servers=candidate.servers)


@dataclass(frozen=True)
class Plan:
    """Every candidate's prediction, the recommended one, and what they rest on."""

    job: Job
    network: Network
    compute: Compute
    model_bytes: int
    predictions: tuple[Prediction, ...]
    recommended: Prediction
    constants: Constants
    #: A parameter with sparse gradients, which only ddp of the candidates can sum (None: none).
    sparse: str | None = None
    #: The threads ``compute`` was timed on: the recommended candidate's workers'.
    threads: int = 1
    #: ``(key, why)`` of each candidate left out because ``polytrain train`` would refuse it
    #: (its strategy's checks: the devices' memory, say).
    refused: tuple[tuple[str, str], ...] = ()

    def why(self) -> str:
        """One line: the choice, its predicted step, and the runner-up's."""
        best = self.recommended
        others = sorted((p for p in self.predictions if p is not best),
                        key=lambda p: p.step_time_s)
        fastest = all(best.step_time_s <= p.step_time_s for p in others)
        verdict = ("is predicted fastest" if fastest else
                   "is recommended (within 1% of the fastest, with fewer servers or simpler)")
        line = (f"{best.candidate.key} {verdict}: {best.step_time_s * 1e3:.0f} ms "
                f"per step (compute {best.compute_s * 1e3:.0f} ms, communication "
                f"{best.comm_s * 1e3:.0f} ms for {best.nic_bytes_M:.3f} M on the busiest NIC)")
        if others:
            line += f"; next {others[0].candidate.key} {others[0].step_time_s * 1e3:.0f} ms"
            # ddp's too, unless it is one of these two, or refused (not predicted)
            ddp = [p for p in others[1:] if p.candidate.key == "ddp"]
            if ddp:
                line += f", ddp {ddp[0].step_time_s * 1e3:.0f} ms"
        if self.sparse is not None:
            line += (f"; byteps and herring left out: parameter {self.sparse!r} has sparse "
                     f"gradients, which their push/pull engine cannot sum (parallax is built "
                     f"for them)")
        for key, why in self.refused:
            line += f"; {key} left out: {why}"
        return line

    def get(self, key: str) -> Prediction:
        for p in self.predictions:
            if p.candidate.key == key:
                return p
        raise KeyError(key)

    def as_dict(self) -> dict[str, Any]:
        """``{"predictions": {KEY: {...}}, "recommended": KEY, ...}`` (the ``--json`` output)."""
        return {"predictions": {p.candidate.key: p.as_dict() for p in self.predictions},
                "recommended": self.recommended.candidate.key,
                "why": self.why(),
                "refused": dict(self.refused),
                "job": {"model": self.job.model, "model_options": dict(self.job.model_options),
                        "model_bytes": self.model_bytes, "workers": self.job.workers,
                        "nodes": self.job.nodes, "servers": self.job.servers,
                        "batch_size": self.job.batch_size, "optimizer": self.job.optimizer,
                        "bandwidth": self.job.bandwidth, "latency": self.job.latency,
                        "devices": self.job.devices, "hosts": self.job.hosts,
                        "timeout_s": self.job.timeout_s,
                        "shared_host_cores": self.network.shared_host_cores},
                "compute": {"forward_s": self.compute.forward_s,
                            "backward_s": self.compute.backward_s,
                            "optimizer_s": self.compute.optimizer_s,
                            "threads": self.threads,
                            "source": "devices" if self.job.devices else "measured here"},
                "constants": self.constants.as_dict()}

    def describe(self) -> str:
        """A table, fastest first, then the recommendation."""
        rows = [f"{'strategy':<14} {'step ms':>9} {'compute':>9} {'comm':>9} {'busiest NIC':>12}"]
        for p in sorted(self.predictions, key=lambda p: p.step_time_s):
            rows.append(f"{p.candidate.key:<14} {p.step_time_s * 1e3:9.1f} "
                        f"{p.compute_s * 1e3:9.1f} {p.comm_s * 1e3:9.1f} "
                        f"{p.nic_bytes_M:10.3f} M")
        rows.append(f"recommended: {self.recommended.candidate.key} ({self.why()})")
        return "\n".join(rows)


def plan_job(job: Job, *, constants: Constants = CONSTANTS,
             compute: Compute | Callable[[], Compute] | None = None) -> Plan:
    """Predict every candidate strategy for ``job`` and recommend the fastest.

    Each candidate's compute is timed on the threads its workers would get
    (:meth:`Job.threads`: servers take their share of the cores), once per thread count.
    ``compute`` overrides the job's compute profile for every candidate (a value, or a
    function that makes one): tests and the benchmark pass theirs.
    """
    network = job.network()
    given = compute() if callable(compute) else compute
    model_bytes = job.model_bytes()
    sparse = job.sparse_parameter()
    offered = [c for c in candidates(network) if sparse is None or c.strategy == "ddp"]
    # What train would refuse is left out (a choice it refused: byteps on devices too small).
    refused = job.refusals(offered)
    if len(refused) == len(offered):
        first = refused[offered[0]]
        raise ConfigError(f"every strategy the planner predicts is refused on this job "
                          f"({', '.join(c.key for c in offered)}); {offered[0].key}'s refusal: "
                          f"{first.what}", first.hint)
    threads = {c: job.threads(c) for c in offered if c not in refused}
    counts = sorted(set(threads.values()))
    # One timing's budget shared by them all (each still takes a warm-up and one timed
    # step at least: a batch whose step outlasts its share takes those two).
    timed = {t: given if given is not None else job.compute(t, budget_s=BUDGET_S / len(counts))
             for t in counts}
    predictions = tuple(predict(c, network=network, compute=timed[t], model_bytes=model_bytes,
                                constants=constants) for c, t in threads.items())
    best = recommend(predictions)
    profile = timed[threads[best.candidate]]
    return Plan(job, network, profile, model_bytes, predictions, best, constants, sparse,
                threads[best.candidate], tuple((c.key, e.what) for c, e in refused.items()))


def chosen(plan: Plan) -> Candidate:
    """What ``--strategy auto`` runs: the recommended strategy and its servers."""
    return plan.recommended.candidate


def auto_record(plan: Plan) -> dict[str, Any]:
    """``metrics.json``'s ``auto``: ``{chosen, why, predictions}`` (step times in seconds)."""
    return {"chosen": plan.recommended.candidate.key, "why": plan.why(),
            "predictions": {p.candidate.key: p.as_dict() for p in plan.predictions}}
