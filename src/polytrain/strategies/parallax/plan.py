"""Parallax's plan as plain data: which parameters go to servers, their row ranges and owners.

A parameter is *sparse* when a step's gradient touches only some of its rows:
it is the weight of an ``nn.Embedding``/``nn.EmbeddingBag`` with
``sparse=True`` or, with ``sparse_embeddings`` (the default), of any
embedding (whose gradients then become sparse). Every other parameter is
*dense* and is all-reduced. Each sparse parameter is cut into ``partitions``
near-equal row ranges, and the ranges go, largest first, to the server that
owns the fewest bytes so far (Parallax's greedy least-loaded rule).

Example::

    >>> import torch
    >>> plan = plan_parallax([SparseVar("emb", 10, 4, torch.float32)], ["w"], partitions=3,
    ...                      servers=[4, 5])
    >>> [(r.lo, r.hi, r.owner) for r in plan.ranges], plan.bytes_by_server()
    ([(0, 4, 4), (4, 7, 5), (7, 10, 5)], {4: 64, 5: 96})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from ...comm.partition import Partition, even_cuts
from ...errors import ConfigError, at_least
from ...ps.placement import Placement, balanced

__all__ = ["SparseVar", "RowRange", "ParallaxPlan", "plan_parallax", "classify",
           "parallax_traffic"]


@dataclass(frozen=True)
class SparseVar:
    """A sparse parameter: ``rows`` rows of ``width`` elements."""

    name: str
    rows: int
    width: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.width * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RowRange:
    """Rows ``[lo, hi)`` of sparse variable ``var`` (an index into the plan's ``sparse``),
    partition ``index`` of it, owned by server rank ``owner``."""

    var: int
    index: int
    lo: int
    hi: int
    owner: int


@dataclass(frozen=True)
class ParallaxPlan:
    """Dense parameters (all-reduced) and sparse ones (row ranges on servers)."""

    dense: tuple[str, ...]
    sparse: tuple[SparseVar, ...]
    partitions: int
    servers: tuple[int, ...]
    ranges: tuple[RowRange, ...]

    def of(self, var: int) -> list[RowRange]:
        """Variable ``var``'s ranges, in row order."""
        return sorted((r for r in self.ranges if r.var == var), key=lambda r: r.lo)

    def bytes_by_server(self) -> dict[int, int]:
        load = {s: 0 for s in self.servers}
        for r in self.ranges:
            load[r.owner] += (r.hi - r.lo) * self.sparse[r.var].row_bytes
        return load

    def placement(self) -> Placement:
        """The ranges as the engine's placement (one partition per range, in plan order)."""
        parts = tuple(_range_partition(i, r.var, self.sparse[r.var], r.index, r.lo, r.hi)
                      for i, r in enumerate(self.ranges))
        return Placement(parts, tuple(r.owner for r in self.ranges))

    def as_json(self) -> dict[str, Any]:
        return {"dense": list(self.dense), "partitions": self.partitions,
                "servers": list(self.servers),
                "sparse": [{"name": v.name, "rows": v.rows, "width": v.width,
                            "row_bytes": v.row_bytes} for v in self.sparse],
                "ranges": [asdict(r) for r in self.ranges],
                "bytes_by_server": {str(k): v for k, v in self.bytes_by_server().items()}}

    def describe(self) -> str:
        """Where every parameter goes, as a short table."""
        lines = [f"all-reduce: {len(self.dense)} dense parameters"
                 + (f" ({', '.join(self.dense[:4])}{', ...' if len(self.dense) > 4 else ''})"
                    if self.dense else "")]
        for i, v in enumerate(self.sparse):
            owners = ", ".join(f"[{r.lo}, {r.hi}) -> server rank {r.owner}" for r in self.of(i))
            lines.append(f"servers: {v.name} ({v.rows} x {v.width}), {self.partitions} "
                         f"partitions: {owners}")
        load = ", ".join(f"rank {s}: {b} bytes" for s, b in self.bytes_by_server().items())
        lines.append(f"server load: {load}")
        return "\n".join(lines)


def unservable(m: nn.Module) -> str | None:
    """Why an embedding's rows cannot live on servers (None: they can)."""
    if isinstance(m, nn.EmbeddingBag) and m.mode == "max":
        return "mode='max' has no sparse gradient"
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq:
        return "scale_grad_by_freq has no sparse gradient"  # torch: not supported
    if parametrize.is_parametrized(m, "weight"):
        # Its lookups read a weight computed from the parametrization's original, whose
        # gradient (sparse, made so) is no table's.
        return ("its weight is parametrized (torch.nn.utils.parametrize): a lookup reads "
                "rows computed from another tensor, not rows the servers could hold")
    if not isinstance(m._parameters.get("weight"), nn.Parameter):  # torch's old weight_norm
        return ("its weight is computed from other parameters (weight_norm, say), not a "
                "table the servers could hold")
    return None


def sparse_tables(model: nn.Module, *, sparse_embeddings: bool = True
                  ) -> list[nn.Embedding | nn.EmbeddingBag]:
    """The embeddings whose rows go to servers: those built with ``sparse=True``, and with
    ``sparse_embeddings`` every other ``nn.Embedding``/``nn.EmbeddingBag`` whose rows can
    (:func:`unservable`: the others stay dense). One built sparse that cannot is refused."""
    tables: list[nn.Embedding | nn.EmbeddingBag] = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        why = unservable(m)
        if why is not None and m.sparse:
            raise ConfigError(f"{name} is built with sparse=True, but parallax cannot hold its "
                              f"rows on servers: {why}", "build it with sparse=False (it is "
                              "then all-reduced), or without that option")
        if why is None and (m.sparse or sparse_embeddings):
            tables.append(m)
    return tables


def classify(model: nn.Module, *, sparse_embeddings: bool = True
             ) -> tuple[list[str], list[str]]:
    """(dense parameter names, sparse parameter names) of ``model``, in parameter order.

    Sparse: the weights of :func:`sparse_tables`. Embeddings that share one weight (an
    encoder's and a decoder's table) are one sparse parameter: every use of it is a
    lookup. Refused: a sparse weight another kind of module also uses (an output layer
    tied to the table: its gradient there is dense), an embedding of a sparse weight
    with ``max_norm`` (its forward renormalizes the rows it reads in place, on the
    worker's copy, which the servers' rows overwrite at the next fetch; one worker too),
    and a 16-bit sparse weight (the servers' row stores hold float32 or float64).
    """
    sparse_ids = {id(m.weight) for m in sparse_tables(model,
                                                      sparse_embeddings=sparse_embeddings)}
    tied: dict[int, str] = {}  # a sparse weight's first user that is no lookup of it
    for module_name, m in model.named_modules():
        is_lookup = isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for pname, p in m.named_parameters(recurse=False):
            if id(p) not in sparse_ids or not p.requires_grad:
                continue
            if is_lookup and pname == "weight":
                if m.max_norm is not None:
                    # Worded as the data-parallel refusal, which Parallax.check_model runs
                    # it before: that one's hint, a renorm after the step, is overwritten too.
                    raise ConfigError(
                        f"{module_name or type(m).__name__} renormalizes the rows it reads in "
                        f"place during the forward (max_norm={m.max_norm:g}): each worker "
                        f"would change only its own batch's rows, in its copy of a table that "
                        f"parallax holds on servers, and the next fetch would write the "
                        f"servers' rows over them (with one worker too)",
                        "leave max_norm out; to cap the rows' norms, keep the table on the "
                        "workers (sparse_embeddings=False, --no-sparse-embeddings, and "
                        "sparse=False) and renorm it after each optimizer step, the same on "
                        "every worker")
            else:
                tied.setdefault(id(p), f"{module_name or 'the model'} ({type(m).__name__})")
    dense, sparse = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in sparse_ids:
            if id(p) in tied:
                raise ConfigError(f"{name} is an embedding's weight that {tied[id(p)]} also "
                                  f"uses (tied weights): its gradient there is dense, and "
                                  f"parallax's servers take the rows a lookup read",
                                  "untie the weights, or pass --no-sparse-embeddings and "
                                  "sparse=False")
            if p.dim() != 2:
                raise ConfigError(f"sparse parameter {name} has shape {list(p.shape)}",
                                  "keep embeddings 2-D (rows, width)")
            if p.dtype not in (torch.float32, torch.float64):
                # Else the server refused the key's declaration, in two lines and two hints.
                raise ConfigError(f"sparse parameter {name} is {p.dtype}: parallax's servers "
                                  f"hold the rows of a sparse parameter in float32 or float64",
                                  "keep the table in float32, or keep it on the workers "
                                  "(sparse_embeddings=False, --no-sparse-embeddings, and "
                                  "sparse=False)")
            sparse.append(name)
        else:
            dense.append(name)
    return dense, sparse


def _range_partition(key: int, var: int, v: SparseVar, index: int, lo: int, hi: int
                     ) -> Partition:
    """Rows ``lo:hi`` of sparse variable ``var`` (``v``) as the engine's partition."""
    return Partition(key, var, v.name, index, lo * v.width, (hi - lo) * v.width,
                     (hi - lo) * v.row_bytes, v.dtype)


def plan_parallax(sparse: Sequence[SparseVar], dense: Sequence[str], *, partitions: int,
                  servers: Sequence[int]) -> ParallaxPlan:
    """Cut every sparse variable into ``partitions`` row ranges and spread them greedily by
    bytes over ``servers`` (least loaded first; ties to the lower rank)."""
    at_least("--partitions", partitions, "pass --partitions 8, or leave it out to search")
    if sparse and not servers:
        raise ConfigError("parallax puts sparse parameters on servers, but the run has none",
                          "launch with --colocated 1 and/or --servers K (polytrain.launch"
                          "(..., colocated=1, servers=K))")
    # A table of fewer rows than partitions has a range per row.
    cuts = [(v, i, lo, lo + n) for v, var in enumerate(sparse)
            for i, (lo, n) in enumerate(even_cuts(var.rows, max(1, min(partitions, var.rows))))]
    parts = [_range_partition(k, v, sparse[v], i, lo, hi)
             for k, (v, i, lo, hi) in enumerate(cuts)]
    owners = balanced(parts, list(servers)).owners if parts else ()
    ranges = tuple(RowRange(v, i, lo, hi, o) for (v, i, lo, hi), o in zip(cuts, owners))
    return ParallaxPlan(tuple(dense), tuple(sparse), partitions, tuple(servers), ranges)


def parallax_traffic(*, machines: int, sparse_bytes: float, alpha: float,
                     dense_bytes: float) -> dict[str, float]:
    """Bytes each worker machine sends (and receives) per step, by REFERENCE.md section 3:
    sparse rows through servers on every machine, 2 alpha W (N - 1) / N, and the dense
    part as a ring all-reduce among the machines, 2 D (N - 1) / N (per direction)."""
    n = machines
    sparse = 2 * alpha * sparse_bytes * (n - 1) / n
    dense = 2 * dense_bytes * (n - 1) / n
    return {"sparse": sparse, "dense": dense, "total": sparse + dense}
