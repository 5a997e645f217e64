"""``parallax``: the strategy behind ``polytrain train --strategy parallax`` and ``distribute``."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ...launch.layout import Layout
from ...ps.grads import gradient_change, gradient_left
from ...ps.placement import server_ranks
from ...runtime import Context
from ...wrapper import Wrapper
from ..base import register
from ..served import ServedStrategy
from ..synced import check_still_frozen
from .dense import DenseSync
from .options import DEFAULT_SEARCH_STEPS, ParallaxOptions
from .plan import ParallaxPlan, SparseVar, classify, plan_parallax, sparse_tables
from .rows import SparseRows, Touched
from .search import PartitionSearch

__all__ = ["Parallax"]

log = logging.getLogger(__name__)


@register
class Parallax(ServedStrategy[ParallaxOptions]):
    """Parallax: sparse parameters' rows on parameter servers, dense ones all-reduced.

    Paper: Kim et al., "Parallax: Sparsity-aware Data Parallel Training of Deep
    Neural Networks", EuroSys 2019. Every parameter is classified from the model
    (:func:`~polytrain.strategies.parallax.plan.classify`); the sparse ones are
    cut into row ranges spread over the servers (one per worker machine, plus
    ``--servers K``), which apply their updates (SGD, Adagrad, lazy Adam: the
    user's optimizer's rule); the others are averaged by all-reduce and stepped
    by the user's optimizer. The model and optimizer are the user's own.

    Example::

        model, opt = polytrain.distribute(model, opt, strategy="parallax")
        # polytrain train --strategy parallax --model wordlm --workers 4 --nodes 2
    """

    name = "parallax"
    no_colocate_means = "keeps only the dedicated servers"
    Options = ParallaxOptions
    # Worker 0's checkpoint state holds the servers' rows as whole variables, which any
    # layout cuts into its own ranges; the dense parameters are every worker's.
    resumes_on_other_layouts = True
    whole_state_on_worker_0 = True

    @classmethod
    def check_model(cls, model: nn.Module, layout: Layout, options: ParallaxOptions) -> None:
        """The plan's refusals (max_norm, a table tied to another kind of module, a 16-bit
        table) before any process starts, and before the data-parallel ones, whose hints do
        not fit rows held on servers; and options that a model without sparse parameters
        leaves idle."""
        _, sparse = classify(model, sparse_embeddings=options.sparse_embeddings)
        _check_idle_options(options, sparse, servers=0)

    @classmethod
    def check_run_model(cls, model: nn.Module, layout: Layout,
                        options: ParallaxOptions) -> None:
        """Dedicated servers that a model without sparse parameters leaves idle (a script's
        own ``bps.push_pull`` may use them: :func:`distribute` takes them)."""
        _, sparse = classify(model, sparse_embeddings=options.sparse_embeddings)
        _check_idle_options(options, sparse, layout.servers)

    @classmethod
    def check_resume(cls, saved: Mapping[str, Any], layout: Layout,
                     options: ParallaxOptions) -> None:
        """Which tables the servers hold is the checkpoint's: their rows' optimizer state
        lives only there (a resume without them restarted Adam's moments silently)."""
        super().check_resume(saved, layout, options)
        cls.refuse_other_options(saved, options, ["sparse_embeddings"],
                                 "the servers' rows and their optimizer state")

    def __init__(self, ctx: Context | None, options: ParallaxOptions) -> None:
        super().__init__(ctx, options)
        self.plan: ParallaxPlan | None = None
        self.rows: SparseRows | None = None
        self.dense: DenseSync | None = None
        self.unchanged: _Unchanged | None = None
        self.search: PartitionSearch | None = None
        self._count = 0  # the partition count in use
        self._since = 0  # steps at this count
        self._times: list[float] = []
        self._last: float | None = None  # when the step in progress began ...
        self._ended: float | None = None  # ... and when the last one's optimizer stepped
        self._warming = False  # the step in progress is a resumed process's first: untimed
        self._step_hooks: list[Any] = []  # on the user's optimizer, taken off by close()
        self._was_sparse: list[tuple[nn.Embedding | nn.EmbeddingBag, bool]] = []  # for close()
        self._frozen: list[tuple[str, nn.Parameter]] = []  # at the wrap: neither kind

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        model.to(ctx.device)
        for m in sparse_tables(model, sparse_embeddings=self.options.sparse_embeddings):
            self._was_sparse.append((m, bool(m.sparse)))
            m.sparse = True  # its gradient: the rows a step touched
        try:
            return self._wrap(model, optimizer)
        except BaseException:
            # A refused wrap leaves the model the user's (tables of sparse gradients failed
            # the plain step of torch's Adam after the refusal of AdamW's weight decay).
            self.close()
            raise

    def _wrap(self, model: nn.Module,
              optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        dense, sparse = classify(model, sparse_embeddings=self.options.sparse_embeddings)
        _check_idle_options(self.options, sparse, servers=0)  # a script may use servers
        params = dict(model.named_parameters())
        servers: list[int] = []  # none asked for without sparse parameters: pure all-reduce
        if sparse:
            colocated, dedicated = server_ranks(ctx.topology, colocate=self.options.colocate,
                                                strategy="parallax")
            servers = colocated + dedicated
        if self.options.partitions is None and sparse:
            self.search = PartitionSearch(max(len(servers), ctx.num_nodes))
            count = self.search.start
        else:
            count = self.options.partitions or max(1, len(servers))
        self._count = count
        variables = [SparseVar(n, params[n].shape[0], params[n].shape[1], params[n].dtype)
                     for n in sparse]
        self.plan = plan_parallax(variables, dense, partitions=count, servers=servers)
        if ctx.worker_index == 0:
            log.info("parallax plan:\n%s", self.plan.describe())
        if sparse:
            self.rows = SparseRows(ctx, model, self.plan, optimizer)
            self.rows.initial_state()
            # Worker 0's SETs are held (their receipts) before any worker pulls a row: a
            # first pull that overtook them read the store's zeros.
            dist.barrier(group=ctx.groups.workers)
        self.dense = DenseSync(ctx, [(n, params[n]) for n in dense])
        # Frozen at the wrap: neither all-reduced nor on the servers (check_still_frozen).
        planned = {*dense, *sparse}
        self._frozen = [(n, p) for n, p in params.items() if n not in planned]
        self.unchanged = _Unchanged([(n, p) for n, p in model.named_parameters()
                                     if p.requires_grad])
        # (torch hands the hook step's own arguments, the optimizer first.)
        self._step_hooks = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._before_step(
                args[1] if len(args) > 1 else kwargs.get("closure"))),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._step_done())]
        return model, optimizer

    def _step_done(self) -> None:
        self._ended = time.perf_counter()
        if self.rows is not None:
            self.rows.end_step()

    def _before_step(self, closure: Any) -> None:
        if self.search is not None and self._since == 0 \
                and self.options.search_steps != DEFAULT_SEARCH_STEPS:
            # The step API calls replan() before every step; the plain loop never does.
            raise ConfigError(
                f"parallax option search_steps={self.options.search_steps} paces the "
                f"partition search, which only the step API runs, and this step comes from "
                f"the plain loop: partitions stays at {self._count}",
                "leave out search_steps, or pass loss_fn to distribute() and train with "
                "trainer.step(x, y), which searches")
        assert self.dense is not None and self.unchanged is not None
        if closure is not None:  # its backward would run after the averaging below
            raise ConfigError(
                "optimizer.step(closure) under parallax: parallax averages the gradients as "
                "the step begins, before the step runs the closure, so the closure's "
                "backward would be applied unaveraged on each worker",
                "run the forward and loss.backward() before optimizer.step(), and call it "
                "without a closure (or train under ddp, which averages inside backward)")
        # One unfrozen since the wrap, with a gradient: each worker would step it on its own.
        check_still_frozen([(n, p) for n, p in self._frozen if p.grad is not None],
                           "set requires_grad before distribute(), which takes a model once: "
                           "a parameter may be frozen after it, not unfrozen")
        self.unchanged.check()
        if self.rows is not None:
            self.rows.begin_step()
        # The pushes are packed and sent (and the servers apply them) while the dense
        # all-reduce runs in gloo's thread.
        finish = self.dense.start()
        if self.rows is not None:
            self.rows.push()
        finish()

    # -- the partition search ------------------------------------------------------------------

    def replan(self, step: int) -> bool:
        now = time.perf_counter()
        if self.search is None:
            return False
        self._times.extend(self._step_time())
        self._since += 1
        # A resumed process's first step (a warm-up) has its start left unmarked: untimed.
        self._last = None if self._warming else now
        self._warming = False
        if self._since <= self.options.search_steps:
            return False
        # One sample is done: its steps after the first, the slowest worker's median.
        ctx = self.ctx
        assert ctx is not None and self.rows is not None and self.plan is not None
        measured = torch.tensor([statistics.median(self._times[-(self.options.search_steps - 1):])],
                                dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=ctx.groups.workers)
        self.search.record(self._count, float(measured))
        nxt = self.search.next_count()
        if nxt is None:
            nxt = self.search.choose()
            done = True
        else:
            done = False
        moved = nxt != self._count  # the tables' state moves to the new ranges
        if moved:
            plan = plan_parallax(self.plan.sparse, self.plan.dense, partitions=nxt,
                                 servers=self.plan.servers)
            self.rows.repartition(plan)
            self.plan = plan
            self._count = nxt
        if done:
            if ctx.worker_index == 0:
                log.info("parallax partition search: %s", self.search.as_json())
            self.final_search, self.search = self.search, None
        self._since = 1
        self._last = time.perf_counter()
        return moved

    def _step_time(self) -> list[float]:
        """The last step's own time, if it was timed and has ended: what the loop did after
        it (a held-out evaluation, a checkpoint's gathers of the tables) is not the
        partition count's."""
        if self._last is not None and self._ended is not None and self._ended > self._last:
            return [self._ended - self._last]
        return []

    # -- results -------------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        ctx = self.ctx
        assert ctx is not None
        out: dict[str, Any] = {}
        if self.plan is not None:
            out["plan"] = self.plan.as_json()
        if self.rows is not None:
            sparse = self.rows.alpha()
            # The mean over machines: every leader's alpha, summed over the workers.
            values = torch.tensor([v["alpha"] if self.rows.is_leader else 0.0
                                   for v in sparse.values()], dtype=torch.float64)
            dist.all_reduce(values, group=ctx.groups.workers)
            for v, a in zip(sparse.values(), values.tolist()):
                v["alpha"] = a / ctx.num_nodes
            out["sparse"] = sparse
        search = self.search or getattr(self, "final_search", None)
        if search is not None:
            out["partition_search"] = search.as_json()
        return out

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self.rows is not None:
            self.rows.gather()
        return super().state_dict(model)

    def evaluation_model(self, model: nn.Module) -> nn.Module | None:
        """Worker 0's model with every sparse row gathered from the servers, whose lookups
        read it as it is: they fetch nothing (a fetch is a collective of the machine's
        workers, which do not evaluate)."""
        if self.rows is not None:
            self.rows.gather()  # worker 0 pulls; every worker's pushes have left first
        net = super().evaluation_model(model)
        return net if net is None or self.rows is None else _Gathered(net, self.rows)

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The servers' sparse rows with their rule's state (worker 0's file: whole
        variables, so a resumed run may cut them into another partition count), the
        rounds pushed, the partition count and the search so far."""
        # The times with the step just ended (the next replan() would have taken it in).
        state: dict[str, Any] = {"partitions": self._count, "since": self._since,
                                 "times": self._times + self._step_time(), **self._layout()}
        search = self.search or getattr(self, "final_search", None)
        if search is not None:
            state["search"] = {"start": search.start, "low": search.low, "high": search.high,
                               "samples": list(search.samples), "going_up": search.going_up,
                               "done": self.search is None}
        if self.rows is not None:
            states = self.rows.pull_states()  # collective; worker 0's are the servers' states
            state["rounds"] = self.rows.round
            state["touched"] = {v.name: v.touched.state() for v in self.rows.vars}
            if states:
                state["rows"] = {v.name: m for v, m in
                                 zip(self.rows.vars, self.rows.whole_variables(states))}
                state["steps"] = dict(zip((v.name for v in self.rows.vars),
                                          self.rows.rule_steps(states)))
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Put the servers' rows back, at the saved partition count, and the search where it
        was. Every worker calls it after the checkpoint's weights are loaded."""
        ctx = self.ctx
        if not state:
            if self.rows is None:
                return
            raise ConfigError(f"strategy 'parallax' resumes only a checkpoint of its own worker "
                              f"count ({ctx.num_workers if ctx else 1} here): each worker's "
                              f"state of the servers' rows belongs to its place in the layout",
                              "resume with the checkpoint's --workers")
        assert ctx is not None and self.plan is not None
        # On another layout the rows carry over; the search's step times and the machines'
        # touched rows were the old layout's: the search starts afresh. (A checkpoint before
        # the machines and servers were saved is compared by its worker count.)
        moved = any(state.get(k, v) != v for k, v in self._layout().items())
        saved = None if moved else state.get("search")
        if saved is not None:
            search = PartitionSearch(saved["start"], low=saved["low"], high=saved["high"])
            search.samples, search.going_up = [tuple(s) for s in saved["samples"]], \
                saved["going_up"]
            if saved["done"]:
                search.choose()
                self.final_search, self.search = search, None
            elif self.options.partitions is None:
                self.search = search
        # The saved count goes on where its search does (or a finished one's choice); a run
        # of a fixed --partitions resumed without it starts a new search at its start.
        goes_on = saved is not None or self.search is None
        count = int(state["partitions"]) if (self.options.partitions is None and not moved
                                             and goes_on) \
            else self.options.partitions or self._count
        if not moved and goes_on:  # a new search times its own steps
            # The first step from here is not timed (a fresh process's warm-up): counted one
            # step less, the sample runs a step longer, so that the times it takes are its
            # steps' after its first, as without a resume (times holds those before the save).
            self._since, self._times = max(0, int(state["since"]) - 1), list(state["times"])
            self._warming = True
        self._last = None
        if self.rows is None:
            return
        if count != self._count:
            self.plan = plan_parallax(self.plan.sparse, self.plan.dense, partitions=count,
                                      servers=self.plan.servers)
            self.rows.repartition(self.plan)
            self._count = count
        rows = state.get("rows")
        merged = [rows[v.name] for v in self.rows.vars] if rows is not None and all(
            v.name in rows for v in self.rows.vars) else None
        if ctx.worker_index == 0 and merged is None:
            raise ConfigError("the checkpoint has no sparse rows for "
                              f"{[v.name for v in self.rows.vars]}",
                              "resume from a checkpoint this model's parallax run wrote")
        steps = state.get("steps")  # none in checkpoints before them: every round counted
        self.rows.restore(merged, int(state["rounds"]),
                          [int(steps[v.name]) for v in self.rows.vars]
                          if steps is not None and merged is not None else None)
        for v in self.rows.vars:
            v.touched = Touched() if moved else Touched.from_state(
                state.get("touched", {}).get(v.name, []))

    def _layout(self) -> dict[str, Any]:
        """What the search's samples and the touched rows were measured on: the worker
        machines, the workers and the server ranks."""
        assert self.ctx is not None
        return {"workers": self.ctx.num_workers, "nodes": self.ctx.num_nodes,
                "servers": list(self.plan.servers) if self.plan is not None else []}

    def close(self) -> None:
        for h in self._step_hooks:
            h.remove()
        self._step_hooks = []
        # The model is the user's again: a table's gradient as its module gave it (sparse,
        # the user's torch.optim.Adam refused the next local step).
        for m, sparse in self._was_sparse:
            m.sparse = sparse
        self._was_sparse = []
        if self.unchanged is not None:
            self.unchanged.close()
        if self.rows is not None:
            self.rows.close()


def _check_idle_options(options: ParallaxOptions, sparse: list[str], servers: int) -> None:
    """Refuse an option of the sparse parameters' servers, or ``servers`` dedicated ones, for
    a model that has no sparse parameter (every parameter is all-reduced): taken, it would
    do nothing, and the servers' machines would sit idle."""
    if sparse:
        return
    idle = [(f"parallax option partitions={options.partitions}", "cuts the sparse parameters "
             "into row ranges", "leave out partitions (--partitions)",
             options.partitions is not None),
            (f"parallax option search_steps={options.search_steps}", "paces the search of the "
             "sparse parameters' partition count", "leave out search_steps (--search-steps)",
             options.search_steps != DEFAULT_SEARCH_STEPS),
            ("parallax option colocate=False", "picks the sparse parameters' servers",
             "leave out colocate=False (--no-colocate)", not options.colocate),
            (f"parallax's {servers} dedicated server{'s' if servers > 1 else ''} (--servers "
             f"{servers})", "would hold the sparse parameters' rows", "leave out --servers",
             servers > 0)]
    for given, does, hint, taken in idle:
        if taken:
            which = ("trained embedding whose rows servers can hold" if options.sparse_embeddings
                     else "trained embedding built with sparse=True, the only ones "
                     "sparse_embeddings=False puts on servers")
            raise ConfigError(f"{given} {does}, and this model has no sparse parameter (no "
                              f"{which}): every parameter is all-reduced", hint)


class _Unchanged:
    """Every gradient as the last backward() left it (the tensor and its version), so that
    the step refuses one changed since: parallax averages the gradients inside
    ``optimizer.step()``, and a change before it (``clip_grad_norm_``) would act on each
    worker's own gradient, by its own norm."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        self.named = named
        self.left: list[tuple[torch.Tensor | None, int]] | None = None  # None: no backward
        self._queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for _, p in named]

    def _hook(self, param: torch.Tensor) -> None:
        if not self._queued:  # once per backward: what the whole pass left
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._record)

    def _record(self) -> None:
        self._queued = False
        self.left = [gradient_left(p) for _, p in self.named]

    def check(self) -> None:
        """Refuse a gradient replaced or changed in place since the last backward()."""
        left, self.left, self._queued = self.left, None, False
        if left is None:
            return
        for (name, p), then in zip(self.named, left):
            how = gradient_change(p, then)
            if how is None:
                continue
            raise ConfigError(
                f"the gradient of {name!r} {how} between backward() and optimizer.step() "
                f"(gradient clipping, or a GradScaler's unscale_?): parallax averages the "
                f"gradients over the workers inside the step, so the change would act on "
                f"this worker's own gradient only",
                "leave the gradients as backward() made them under parallax; to clip them, "
                "train with strategy 'ddp', which averages them during backward()")

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Gathered(Wrapper):
    """A model whose sparse rows are all current: its lookups fetch nothing while it runs."""

    def __init__(self, model: nn.Module, rows: SparseRows) -> None:
        super().__init__()
        self.module = model  # as wrappers name it: evaluation finds its emulated device
        self._rows = rows

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._rows.paused = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self._rows.paused = False
