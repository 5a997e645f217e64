"""``parallax``: the strategy behind ``polytrain train --strategy parallax`` and ``distribute``."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ps.placement import server_ranks
from ...runtime import Context
from ..base import register
from ..served import ServedStrategy
from .dense import DenseSync
from .options import ParallaxOptions
from .plan import ParallaxPlan, SparseVar, classify, plan_parallax
from .rows import SparseRows
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
    checkpoint_gap = ("the sparse rows and their optimizer state live on the servers, which "
                      "do not save them")
    no_colocate_means = "keeps only the dedicated servers"
    Options = ParallaxOptions

    def __init__(self, ctx: Context | None, options: ParallaxOptions) -> None:
        super().__init__(ctx, options)
        self.plan: ParallaxPlan | None = None
        self.rows: SparseRows | None = None
        self.dense: DenseSync | None = None
        self.search: PartitionSearch | None = None
        self._count = 0  # the partition count in use
        self._since = 0  # steps at this count
        self._times: list[float] = []
        self._last: float | None = None

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        model.to(ctx.device)
        if self.options.sparse_embeddings:
            for m in model.modules():
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                    m.sparse = True  # its gradient: the rows a step touched
        dense, sparse = classify(model, sparse_embeddings=self.options.sparse_embeddings)
        params = dict(model.named_parameters())
        colocated, dedicated = server_ranks(ctx.topology, colocate=self.options.colocate,
                                            strategy="parallax")
        servers = colocated + dedicated
        if self.options.partitions is None and sparse:
            self.search = PartitionSearch(max(len(servers), ctx.num_nodes))
            count = self.search.start
        else:
            count = self.options.partitions or len(servers)
        self._count = count
        variables = [SparseVar(n, params[n].shape[0], params[n].shape[1], params[n].dtype)
                     for n in sparse]
        self.plan = plan_parallax(variables, dense, partitions=count, servers=servers)
        if ctx.worker_index == 0:
            log.info("parallax plan:\n%s", self.plan.describe())
        if sparse:
            self.rows = SparseRows(ctx, model, self.plan, optimizer)
            self.rows.initial_state()
        self.dense = DenseSync(ctx, [params[n] for n in dense])
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._before_step())
        return model, optimizer

    def _before_step(self) -> None:
        assert self.dense is not None
        self.dense()
        if self.rows is not None:
            self.rows.push()

    # -- the partition search ------------------------------------------------------------------

    def replan(self, step: int) -> None:
        now = time.perf_counter()
        if self.search is None:
            return
        if self._last is not None:
            self._times.append(now - self._last)
        self._since += 1
        self._last = now
        if self._since <= self.options.search_steps:
            return
        # One sample is done: its steps after the first, the slowest worker's median.
        ctx = self.ctx
        assert ctx is not None and self.rows is not None and self.plan is not None
        measured = torch.tensor([statistics.median(self._times[-(self.options.search_steps - 1):])],
                                dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=ctx.groups.workers)
        self.search.record(self._count, float(measured))
        nxt = self.search.next_count()
        if nxt is None:
            nxt = self.search.best()
            done = True
        else:
            done = False
        if nxt != self._count:
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

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
