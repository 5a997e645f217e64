"""The worker side of Parallax's sparse parameters: pull the rows a forward reads, push the
rows a step touched, once per machine.

    forward: a model with ``sparse_reads(*inputs)`` (the rows of each sparse parameter the
    forward will read) has them all fetched before it (a forward pre-hook on the model), so
    its lookups only check; otherwise each lookup of a sparse embedding fetches its own:
        rows read, less those already fresh this step
        -> union over the machine's workers (all-gather inside the machine)
        -> the machine's leader pulls them from their ranges' servers (round t): every
           range's pull in flight at once, so one round trip for all the tables
        -> broadcast inside the machine; every worker writes them into its weight
    optimizer.step() (the pushes are packed and sent while the dense all-reduce runs):
        every worker's coalesced sparse gradient -> the leader (all-gather inside
        the machine), summed per row and averaged over the workers
        -> one push per range of the rows in it (round t + 1; none touched: only the lr)
        -> no row is fresh any more; the servers apply the update themselves
        -> the local optimizer steps without them; they are given back after it

Nothing crosses machines but the leader's pushes and pulls: local aggregation,
as Parallax's default.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...comm.partition import TensorSpec
from ...errors import ConfigError
from ...optim import coalesced, sparse_rule
from ...ps.client import Pending
from ...ps.engine import engine_for
from ...ps.placement import Placement
from ...ps.protocol import Kind, Op
from ...ps.sparse import STATE_NAMES, pack_rows, rule_settings, state_numel, state_tensors
from ...ps.stores import pack_counts, unpack_counts
from ...runtime import Context
from .plan import ParallaxPlan

__all__ = ["SparseRows"]

log = logging.getLogger(__name__)


def _gather_local(tensors: list[torch.Tensor], group: Any, workers: int, *, at: int,
                  labels: Sequence[str], flag: bool = False, training: bool = True
                  ) -> tuple[list[list[torch.Tensor]], bool]:
    """Every local worker's ``tensors`` (of one length along dim 0 on a worker, of any length
    across workers): per tensor, the workers' copies in local rank order, trimmed; and
    whether any worker passed ``flag``.

    gloo's all-gather takes equal sizes, so the lengths go first and every copy is padded
    to the longest; when every worker has none, nothing more is sent. With the lengths
    goes ``at``, which exchange this is (``labels[at]``), and whether it is ``training``'s
    (a fetch of an evaluation is not): workers at different ones (a lookup that only some
    workers' data reached, an evaluation on some workers only) are refused there, on
    every worker, where they would hang in gloo.
    """
    head = torch.tensor([tensors[0].shape[0], at, int(flag), int(training)], dtype=torch.int64)
    heads = [torch.zeros(4, dtype=torch.int64) for _ in range(workers)]
    dist.all_gather(heads, head, group=group)
    if len({(int(h[1]), int(h[3])) for h in heads}) > 1:
        where = ", ".join(f"local worker {i} {labels[int(h[1])]}"
                          + ("" if h[3] else " to evaluate (under no_grad or in eval mode)")
                          for i, h in enumerate(heads))
        if len({int(h[3]) for h in heads}) > 1:  # some evaluate, others train
            raise ConfigError(
                f"the workers of a machine reached different sparse-row exchanges ({where}): "
                f"an evaluation fetches its rows together with the machine's other workers, "
                f"so it must run on every worker of the machine",
                "evaluate on every worker (each on its part of the held-out batch), or "
                "through polytrain train's held-out evaluation (--eval-every), whose model "
                "fetches nothing")
        raise ConfigError(
            f"the workers of a machine reached different sparse-row exchanges ({where}): "
            f"every worker of a machine must look up the same tables in the same order each "
            f"step, as a table's lookup fetches its rows together inside the machine",
            "give the model sparse_reads(*inputs), the rows of each table the forward will "
            "read (a table a worker's data does not reach left out), or look up every table "
            "on every worker")
    sizes = [int(h[0]) for h in heads]
    flagged = any(int(h[2]) for h in heads)
    most = max(sizes)
    if most == 0:
        return [[t] * workers for t in tensors], flagged
    out = []
    for t in tensors:
        padded = t.new_zeros((most, *t.shape[1:]))
        padded[:t.shape[0]] = t
        every = [torch.empty_like(padded) for _ in range(workers)]
        dist.all_gather(every, padded, group=group)
        out.append([e[:size] for e, size in zip(every, sizes)])
    return out, flagged


def _training(module: nn.Module) -> bool:
    """Whether a forward of ``module`` now is training's: with gradients, in train mode."""
    return torch.is_grad_enabled() and module.training


class Touched:
    """How many rows a machine pushed per step, kept as counts (a list grew by a number a
    step, in memory and in every checkpoint): the first step apart, as it is no steady one."""

    def __init__(self, first: int | None = None, total: int = 0, steps: int = 0) -> None:
        self.first, self.total, self.steps = first, total, steps

    def add(self, rows: int) -> None:
        if self.first is None:
            self.first = rows
        else:
            self.total, self.steps = self.total + rows, self.steps + 1

    def mean(self) -> float:
        """Rows per step after the first (the first alone while there is no other)."""
        return self.total / self.steps if self.steps else float(self.first or 0)

    def state(self) -> dict[str, int | None]:
        return {"first": self.first, "total": self.total, "steps": self.steps}

    @classmethod
    def from_state(cls, state: Any) -> Touched:
        """From :meth:`state`, or an older checkpoint's list of every step's count."""
        if isinstance(state, (list, tuple)):
            return cls(state[0], sum(state[1:]), len(state) - 1) if state else cls()
        return cls(state.get("first"), int(state.get("total", 0)), int(state.get("steps", 0)))


class _Var:
    """One sparse parameter on this worker."""

    def __init__(self, index: int, name: str, param: nn.Parameter, rule: dict[str, Any]) -> None:
        self.index, self.name, self.param, self.rule = index, name, param, rule
        self.fresh = torch.ones(param.shape[0], dtype=torch.bool)  # rows current this step
        self.touched = Touched()  # rows this machine pushed per step (leaders)
        self.declared = False  # this step's rows came from the model's sparse_reads
        self.held: torch.Tensor | None = None  # its gradient, out of the local step's sight
        # The weight's version counter as parallax left it: its own writes (fetched rows,
        # through .data) do not move it, a user's in-place write or load_state_dict does.
        self.version = param._version


def check_range(var: _Var, rows: torch.Tensor) -> None:
    """Sorted ``rows`` all rows of ``var``, or ConfigError naming one that is not (an
    IndexError from deep inside, or, negative, another variable's rows)."""
    if rows.numel() and not 0 <= int(rows[0]) <= int(rows[-1]) < var.param.shape[0]:
        bad = rows[(rows < 0) | (rows >= var.param.shape[0])]
        raise ConfigError(f"a lookup of {var.name} reads row {int(bad[0])}, and it has "
                          f"rows 0..{var.param.shape[0] - 1}",
                          "pass token ids below the embedding's size (check the data "
                          "against the model's vocabulary)")


def check_declared(var: _Var, indices: torch.Tensor) -> None:
    """A lookup of rows the model's ``sparse_reads`` named (and the step fetched): all
    current, or ConfigError (the declaration missed some, which would be read stale)."""
    rows = torch.unique(indices.detach().reshape(-1).cpu())
    check_range(var, rows)
    stale = ~var.fresh[rows]
    if bool(stale.any()):
        missing = rows[stale]
        raise ConfigError(f"a lookup of {var.name} reads {missing.numel()} rows the model's "
                          f"sparse_reads did not name (e.g. {missing[:5].tolist()})",
                          "return from sparse_reads every row the forward looks up")


def check_unwritten(var: _Var) -> None:
    """``var``'s weight as parallax left it, or ConfigError: a write on the worker (in place
    under no_grad, or by load_state_dict) would be undone by the next fetch of its rows."""
    if var.param._version != var.version:
        raise ConfigError(
            f"{var.name} was written outside parallax since its last fetch or step (in place, "
            f"as a renorm of its rows after optimizer.step(), or by load_state_dict): its rows "
            f"live on the servers, which only the step's pushes update, and the next fetch "
            f"would write the servers' rows over the change",
            "set a sparse table's weights before distribute() (polytrain's checkpoints resume "
            "the servers' rows); to change its rows during training, keep it on the workers: "
            "sparse_embeddings=False (--no-sparse-embeddings) and sparse=False")


def check_gradient(var: _Var, grad: torch.Tensor) -> None:
    """A backward's gradient of ``var`` (sparse, or dense: its nonzero rows) has only rows
    this step fetched, or ConfigError: the forward read the weight outside its lookups,
    rows whose values were out of date."""
    g = grad.detach().cpu()
    rows = g._indices()[0] if g.is_sparse else g.ne(0).any(1).nonzero()[:, 0]
    stale = torch.unique(rows[~var.fresh[rows]])
    if stale.numel():
        raise ConfigError(
            f"{var.name} is read outside its embedding lookups: its gradient has "
            f"{stale.numel()} rows no lookup of this step read (e.g. {stale[:5].tolist()}), "
            f"whose values were out of date (a weight tied by use, as logits = h @ "
            f"weight.t(), or read by F.embedding(ids, weight) rather than its module)",
            "read it through its embedding module only, or train it dense: pass "
            "--no-sparse-embeddings (sparse_embeddings=False) and keep sparse=False")


class SparseRows:
    """Sparse parameters on row-range servers, for one worker (see the module's diagram).

    Args:
        ctx: the run. model: the wrapped model. plan: the run's plan (its ranges).
        optimizer: the user's optimizer: its rule and learning rate for each sparse parameter.
    """

    def __init__(self, ctx: Context, model: nn.Module, plan: ParallaxPlan,
                 optimizer: torch.optim.Optimizer) -> None:
        self.ctx = ctx
        self.optimizer = optimizer
        self.client = ctx.ps_client
        self.engine = engine_for(ctx)
        self.local = ctx.local_workers
        self.leader = self.local[0]
        self.is_leader = ctx.rank == self.leader
        params = dict(model.named_parameters())
        self.vars = [_Var(i, v.name, params[v.name], sparse_rule(optimizer, params[v.name], v.name))
                     for i, v in enumerate(plan.sparse)]
        self.round = 0  # rounds pushed (and, once the servers apply them, applied)
        self.paused = False  # lookups read the weights as they are (gathered for evaluation)
        self.inflight: list[tuple[Pending, torch.Tensor]] = []
        # What each exchange inside the machine is, for _gather_local's refusal.
        n = len(self.vars)
        self.labels = (["fetched the rows of the model's sparse_reads"]
                       + [f"looked up {v.name}" for v in self.vars]
                       + [f"pushed {v.name}'s gradient in optimizer.step()" for v in self.vars]
                       + ["began optimizer.step()"])
        self.at_lookup, self.at_push, self.at_step = 1, 1 + n, 1 + 2 * n
        self.hooks: list[Any] = []
        by_weight = {id(v.param): v for v in self.vars}
        for m in model.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and id(m.weight) in by_weight:
                var = by_weight[id(m.weight)]
                self.hooks.append(m.register_forward_pre_hook(self._lookup_hook(var),
                                                              with_kwargs=True))
        for var in self.vars:  # every backward's rows: fetched, or read outside the lookups
            self.hooks.append(var.param.register_hook(
                lambda grad, var=var: check_gradient(var, grad)))
        reads = getattr(model, "sparse_reads", None)
        if callable(reads):
            self.hooks.append(model.register_forward_pre_hook(self._reads_hook(reads),
                                                              with_kwargs=True))
        self.plan = plan
        self.placement = self._install(plan)

    # -- plans and keys ------------------------------------------------------------------------

    def _install(self, plan: ParallaxPlan) -> Placement:
        """Fresh keys for ``plan``'s ranges, declared by the leaders; worker 0 sets their
        whole state (values, the rules' state, rounds applied) from what it holds."""
        specs = [TensorSpec(v.name, tuple(v.param.shape), v.param.dtype) for v in self.vars]
        placement = self.engine.keyed(specs, plan.placement())
        if self.is_leader:
            for var in self.vars:
                only = [i for i, r in enumerate(plan.ranges) if r.var == var.index]
                self.engine.declare(placement, kind=Kind.SPARSE, pushers=self.ctx.num_nodes,
                                    pullers=self.ctx.num_nodes, only=only,
                                    options={"width": var.param.shape[1], "rule": var.rule})
        return placement

    def initial_state(self, states: list[torch.Tensor] | None = None) -> None:
        """Worker 0 sets every range's state: ``states[i]`` (a range's whole state), or
        the current weights with the rule's state that the user's optimizer holds (a
        script's steps before :func:`distribute`), else a fresh one."""
        if self.ctx.worker_index != 0:
            return
        pending = []
        for i, r in enumerate(self.plan.ranges):
            var = self.vars[r.var]
            state = states[i] if states is not None else self._held_state(var, r.lo, r.hi)
            pending.append((self.engine.set(self.placement, i, state), state))
        for p, _ in pending:
            p.wait()

    def _held_state(self, var: _Var, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of ``var``'s whole state from its weight and the state the user's
        optimizer holds for it (Adagrad's sum, Adam's moments, the step count: the servers
        go on from a script's own steps, as one process does), or a fresh rule state where
        it holds none."""
        rows = var.param.detach()[lo:hi].reshape(-1).cpu()
        held = self.optimizer.state.get(var.param, {})
        fill = float(var.rule.get("initial_accumulator_value", 0.0))
        tensors = [held[k].detach()[lo:hi].reshape(-1).cpu().to(rows.dtype)
                   if isinstance(held.get(k), torch.Tensor) else torch.full_like(rows, fill)
                   for k in STATE_NAMES[var.rule["name"]]]
        step = int(held.get("step", 0))  # a tensor in torch's optimizers, an int in LazyAdam
        return torch.cat([rows, *tensors, pack_counts([self.round, step], rows.dtype)])

    # -- pulls ---------------------------------------------------------------------------------

    def _lookup_hook(self, var: _Var) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self.paused:
                return
            indices = args[0] if args else kwargs["input"]
            if var.declared:
                check_declared(var, indices)
            else:
                self.fetch({var: indices}, exchange=self.at_lookup + var.index,
                           training=_training(module))
        return hook

    def _reads_hook(self, reads: Callable[..., Mapping[str, torch.Tensor]]
                    ) -> Callable[[nn.Module, Any, Any], None]:
        by_name = {v.name: v for v in self.vars}
        # The forward's inputs that sparse_reads takes (all, with *args or **kwargs): one
        # written for the forward's inputs, sparse_reads(ids), is not given the others.
        params = inspect.signature(reads).parameters.values()
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        positional = None if any(p.kind is p.VAR_POSITIONAL for p in params) else sum(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)

        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self.paused:
                return
            declared = reads(*args[:positional], **{k: v for k, v in kwargs.items()
                                                    if takes_all or k in named})
            if not isinstance(declared, Mapping):
                raise ConfigError(f"the model's sparse_reads returned a "
                                  f"{type(declared).__name__}, not a dict of each sparse "
                                  f"parameter's rows by name",
                                  f"return {{{next(iter(by_name))!r}: ids}}: the rows the "
                                  f"forward looks up in each table, by the names in "
                                  f"model.named_parameters() (without a return statement, a "
                                  f"function returns None)")
            unknown = sorted(set(declared) - set(by_name))
            if unknown:
                raise ConfigError(f"the model's sparse_reads names {unknown}, which are not "
                                  f"sparse parameters (those are {sorted(by_name)})",
                                  "return the rows of the sparse parameters only, by their "
                                  "names in model.named_parameters()")
            for n, rows in declared.items():
                if not isinstance(rows, torch.Tensor) or rows.is_floating_point() \
                        or rows.is_complex() or rows.dtype == torch.bool:
                    kind = (f"a {rows.dtype} tensor" if isinstance(rows, torch.Tensor)
                            else f"a {type(rows).__name__}")
                    raise ConfigError(f"the model's sparse_reads gives {n} {kind}, not a "
                                      f"tensor of row ids",
                                      "return an integer tensor of the rows the forward looks "
                                      "up for each table (the ids themselves, as torch.long)")
            self.fetch({by_name[n]: rows for n, rows in declared.items()},
                       training=_training(module))
            for n in declared:
                by_name[n].declared = True
        return hook

    def _local_union(self, rows: torch.Tensor, exchange: int, training: bool) -> torch.Tensor:
        """The union of ``rows`` over this machine's workers (sorted), as ``exchange``, of
        ``training`` or of an evaluation."""
        if len(self.local) == 1:
            return rows
        [every], _ = _gather_local([rows], self.ctx.groups.local, len(self.local),
                                   at=exchange, labels=self.labels, training=training)
        return torch.unique(torch.cat(every))

    def fetch(self, reads: Mapping[_Var, torch.Tensor], exchange: int = 0,
              training: bool = True) -> None:
        """Make the rows each ``reads[var]`` names current in ``var``'s weight: this
        machine's union of them, pulled once by the leader, every range's pull in flight
        at once (one round trip for all the variables). Every worker of the machine takes
        part, ``reads`` empty or not, and writes every row of the union: another worker's
        data may read a table this one's does not. ``training``: whether the forward is
        training's (with gradients, in train mode) or an evaluation's, which every worker
        of the machine must run alike."""
        self.check_unwritten()
        # One union inside the machine for every variable: rows offset by variable.
        offsets, at = {}, 0
        for var in self.vars:
            offsets[var.index], at = at, at + var.param.shape[0]
        order = sorted(reads, key=lambda v: v.index)  # so the offset rows come sorted
        wanted = []
        for var in order:
            rows = torch.unique(reads[var].detach().reshape(-1).cpu())
            check_range(var, rows)
            wanted.append(rows[~var.fresh[rows]] + offsets[var.index])
        union = self._local_union(torch.cat(wanted) if wanted
                                  else torch.empty(0, dtype=torch.int64), exchange, training)
        if union.numel() == 0:
            return
        needs = []
        for var in self.vars:
            lo, hi = torch.searchsorted(union, torch.tensor(
                [offsets[var.index], offsets[var.index] + var.param.shape[0]])).tolist()
            if hi > lo:
                need = union[lo:hi] - offsets[var.index]
                needs.append((var, need, torch.empty(need.numel(), var.param.shape[1],
                                                     dtype=var.param.dtype)))
        if self.is_leader:
            pending = []
            for var, need, values in needs:
                at = 0
                for i, r, part in self._split(var, need):
                    if part.numel() == 0:
                        continue  # a PULL without rows would ask for the range's whole state
                    pending.append(Pending(self.client.request(
                        self.placement.owners[i], Op.PULL, key=self.placement.partitions[i].key,
                        round=self.round, payload=part - r.lo,
                        answer=values[at:at + part.numel()],
                        what=f"pull of {part.numel()} rows of {var.name}[{r.index}]")))
                    at += part.numel()
            for p in pending:
                p.wait()
        with torch.no_grad():
            for var, need, values in needs:
                if len(self.local) > 1:
                    dist.broadcast(values, src=self.leader, group=self.ctx.groups.local)
                var.param.data[need.to(var.param.device)] = values.to(var.param.device)
                var.fresh[need] = True

    def _split(self, var: _Var, rows: torch.Tensor) -> list[tuple[int, Any, torch.Tensor]]:
        """Sorted ``rows`` cut by ``var``'s ranges: (placement index, range, its rows)."""
        out = []
        for i, r in enumerate(self.plan.ranges):
            if r.var != var.index:
                continue
            lo, hi = torch.searchsorted(rows, torch.tensor([r.lo, r.hi])).tolist()
            out.append((i, r, rows[lo:hi]))
        return out

    # -- pushes --------------------------------------------------------------------------------

    def _gradient(self, var: _Var) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's (unique rows, summed values) of ``var``'s gradient."""
        g = var.param.grad
        width = var.param.shape[1]
        if g is None:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, width, dtype=var.param.dtype)
        if g.is_sparse:
            rows, values = coalesced(g.cpu())
        else:  # a dense gradient of a sparse parameter: its nonzero rows (check_gradient
            g = g.cpu()  # saw each backward's were fetched)
            rows = g.ne(0).any(1).nonzero()[:, 0]
            values = g[rows]
        return rows, values

    def _local_sum(self, var: _Var, rows: torch.Tensor, values: torch.Tensor, read: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The machine's gradient of ``var`` (unique rows, values summed in local rank order)
        on every local worker, and whether some local worker had one (``read``)."""
        if len(self.local) == 1:
            return rows, values, read  # already unique and sorted
        (every_r, every_v), read = _gather_local(
            [rows, values], self.ctx.groups.local, len(self.local),
            at=self.at_push + var.index, labels=self.labels, flag=read)
        rows, values = torch.cat(every_r), torch.cat(every_v)
        unique, inverse = torch.unique(rows, return_inverse=True)
        summed = torch.zeros(unique.numel(), values.shape[1], dtype=values.dtype)
        summed.index_add_(0, inverse, values)
        return unique, summed, read

    def _rule(self, var: _Var) -> dict[str, Any]:
        """``var``'s rule as the optimizer's group has it now: a scheduler may have moved
        its learning rate and settings (OneCycleLR cycles Adam's beta1, or SGD's momentum,
        which has no sparse form) since :func:`distribute`."""
        try:
            return sparse_rule(self.optimizer, var.param, var.name)
        except ConfigError as e:
            raise ConfigError(f"{e.what}; changed after distribute() (by a scheduler?)",
                              f"{e.hint}, and keep it so through the run (OneCycleLR: pass "
                              f"cycle_momentum=False)") from None

    def check_unwritten(self) -> None:
        """Refuse a sparse weight written outside parallax (:func:`check_unwritten`), before
        the fetch, step or gather that would write over it."""
        for var in self.vars:
            check_unwritten(var)

    def begin_step(self) -> None:
        """Every worker of the machine is at optimizer.step() (a worker still looking up a
        table is refused, rather than met by the dense gradients' reduce)."""
        self.check_unwritten()
        if len(self.local) > 1:
            _gather_local([torch.empty(0)], self.ctx.groups.local, len(self.local),
                          at=self.at_step, labels=self.labels)

    def push(self) -> None:
        """Push this step's sparse gradients (once per machine); the local optimizer's step
        does not see them (:meth:`end_step` gives them back)."""
        self.drain()
        self.round += 1
        workers = self.ctx.num_workers
        for var in self.vars:
            rule = self._rule(var)  # every worker: all refuse a rule that has no sparse form
            # Read: some worker has its gradient, empty or not (only padding ids): one
            # process's optimizer counts that step.
            rows, values, read = self._local_sum(var, *self._gradient(var),
                                                 read=var.param.grad is not None)
            # The servers update it, not the local optimizer; it is kept for the next step,
            # as one process keeps a gradient that no zero_grad() clears.
            var.held, var.param.grad = var.param.grad, None
            var.fresh.zero_()
            var.declared = False
            if not self.is_leader:
                continue
            values = values / workers  # every replica's loss is a mean over its slice: average
            var.touched.add(rows.numel())
            for i, r, part in self._split(var, rows):
                lo, hi = torch.searchsorted(rows, torch.tensor([r.lo, r.hi])).tolist()
                # Whether the machine read the parameter at all: a step of its rule.
                payload = pack_rows(rule["lr"], part - r.lo, values[lo:hi],
                                    read=read, settings=rule_settings(rule))
                self.inflight.append((self.engine.push(self.placement, i, round=self.round,
                                                       tensor=payload), payload))

    def end_step(self) -> None:
        """After the local optimizer's step: every sparse gradient back where backward()
        left it (the next backward adds to it unless zero_grad() clears it)."""
        for var in self.vars:
            if var.held is not None:
                var.param.grad, var.held = var.held, None

    def drain(self) -> None:
        """Wait until this worker's pushes have left."""
        for p, _ in self.inflight:
            p.wait()
        self.inflight = []

    # -- whole state ---------------------------------------------------------------------------

    def pull_states(self) -> list[torch.Tensor]:
        """Every range's whole state after the last round (worker 0 only; others: [])."""
        self.drain()
        if self.ctx.worker_index != 0:
            return []
        outs, pending = [], []
        for i, r in enumerate(self.plan.ranges):
            var = self.vars[r.var]
            out = torch.empty(state_numel((r.hi - r.lo) * var.param.shape[1], var.rule["name"]),
                              dtype=var.param.dtype)
            outs.append(out)
            pending.append(Pending(self.client.request(
                self.placement.owners[i], Op.PULL, key=self.placement.partitions[i].key,
                round=self.round, answer=out, what=f"state of {var.name}[{r.index}]")))
        for p in pending:
            p.wait()
        return outs

    def gather(self) -> None:
        """Worker 0: every sparse weight whole and current (from the servers)."""
        self.check_unwritten()
        states = self.pull_states()
        with torch.no_grad():
            for state, r in zip(states, self.plan.ranges):
                var = self.vars[r.var]
                n = (r.hi - r.lo) * var.param.shape[1]
                var.param.data[r.lo:r.hi] = state[:n].view(r.hi - r.lo, -1).to(var.param.device)
        for var in self.vars:
            var.fresh.fill_(self.ctx.worker_index == 0)

    def whole_variables(self, states: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per sparse parameter, its whole tensors (values, then the rule's state tensors,
        each ``(rows, width)``) put together from ``states``, one per range of the plan."""
        merged = []
        for var in self.vars:
            olds = [(r, s) for r, s in zip(self.plan.ranges, states) if r.var == var.index]
            olds.sort(key=lambda x: x[0].lo)
            k = state_tensors(var.rule["name"])
            width = var.param.shape[1]
            merged.append([torch.cat([s[j * (r.hi - r.lo) * width:(j + 1) * (r.hi - r.lo) * width]
                                      .view(r.hi - r.lo, width) for r, s in olds])
                           for j in range(k)])
        return merged

    def rule_steps(self, states: list[torch.Tensor]) -> list[int]:
        """Per sparse parameter, the steps its rule has taken (the rounds that read it), from
        ``states``, one per range of the plan (every range of a parameter counts alike)."""
        steps = {r.var: unpack_counts(s[-1:])[0] for r, s in zip(self.plan.ranges, states)}
        return [steps[v.index] for v in self.vars]

    def _cut(self, merged: list[list[torch.Tensor]], plan: ParallaxPlan,
             steps: list[int]) -> list[torch.Tensor]:
        """``merged`` (as :meth:`whole_variables` gives) cut by ``plan``'s ranges: each
        range's whole state, with the rounds pushed as its rounds applied and its
        parameter's ``steps``."""
        return [torch.cat([t[r.lo:r.hi].reshape(-1) for t in merged[r.var]]
                          + [pack_counts([self.round, steps[r.var]], merged[r.var][0].dtype)])
                for r in plan.ranges]

    def repartition(self, plan: ParallaxPlan) -> None:
        """Move every range to ``plan``'s (new keys), with its optimizer state and round:
        no update is lost. Every worker calls it between steps."""
        states = self.pull_states()
        new_states = (self._cut(self.whole_variables(states), plan, self.rule_steps(states))
                      if states else None)
        old, self.plan = self.placement, plan
        self.placement = self._install(plan)
        self.initial_state(new_states)
        dist.barrier(group=self.ctx.groups.workers)
        if self.ctx.worker_index == 0:  # nobody uses the old ranges now: their memory goes
            self.engine.free(old)

    def restore(self, merged: list[list[torch.Tensor]] | None, rounds: int,
                steps: list[int] | None = None) -> None:
        """Continue from a checkpoint: ``rounds`` pushed and applied, and (worker 0, which
        alone passes ``merged``) every sparse parameter's whole state and its rule's
        ``steps`` (default: every round, as checkpoints before them counted), cut by this
        plan's ranges and set on the servers. Every worker calls it between steps, after
        the checkpoint's weights are loaded (every row is then current on every worker)."""
        self.drain()
        self.round = rounds
        if self.ctx.worker_index == 0:
            if merged is None or len(merged) != len(self.vars) or any(
                    [tuple(t.shape) for t in m] != [tuple(v.param.shape)] * len(m)
                    or len(m) != state_tensors(v.rule["name"])
                    for m, v in zip(merged, self.vars)):
                here = [(v.name, tuple(v.param.shape), v.rule["name"]) for v in self.vars]
                raise ConfigError(
                    "the checkpoint's sparse rows do not fit this run's sparse parameters "
                    f"and rules ({here})",
                    "resume with the checkpoint's model, optimizer and --sparse-embeddings")
            self.initial_state(self._cut(merged, self.plan,
                                         steps if steps is not None else [rounds] * len(merged)))
        for var in self.vars:
            var.fresh.fill_(True)
            var.version = var.param._version  # the checkpoint's weights, loaded before
        dist.barrier(group=self.ctx.groups.workers)

    def alpha(self) -> dict[str, dict[str, float]]:
        """Per sparse parameter: rows, row bytes and the mean fraction of rows this machine
        touched per step (after local aggregation; the first step left out)."""
        out = {}
        for var in self.vars:
            mean = var.touched.mean() / var.param.shape[0]
            out[var.name] = {"rows": int(var.param.shape[0]),
                             "row_bytes": var.param.shape[1] * var.param.element_size(),
                             "alpha": mean}
        return out

    def close(self) -> None:
        self.drain()
        for h in self.hooks:
            h.remove()
        self.hooks = []
