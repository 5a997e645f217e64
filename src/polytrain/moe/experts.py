"""Local experts computed together on rows already sorted by expert.

Rows arrive as contiguous per-expert slices (``counts[i]`` rows for local expert
``i``). The default expert, a two-layer GELU MLP, keeps every expert's weights
stacked, ``w1`` (experts, d_model, d_hidden) and ``w2`` (experts, d_hidden,
d_model), and runs all of them in one autograd function: a grouped matmul
(``torch._grouped_mm``) on GPUs where it runs, else, and on the CPU, one
``addmm`` per expert slice written in place (torch's CPU grouped matmul is
itself one GEMM per group, with no fused bias and no output buffer). The
backward is written out: it saves only the input and the pre-activation (GELU
is recomputed), writes gradients in place, and works through the experts in
chunks of rows, so no full-width temporary of every row is held at once.

Any other expert is a module factory ``f(d_model) -> nn.Module``; those run one
call per local expert on its slice.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

__all__ = ["ExpertMLP", "ExpertList", "ExpertView", "grouped_mm", "chunk_plan", "CHUNK_BYTES"]

#: Largest (rows x d_hidden) temporary the MLP experts hold at once, in bytes.
CHUNK_BYTES = 8 << 20


@functools.lru_cache(maxsize=None)
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here (CPU fp32 does in torch 2.13; CUDA fp32 may not)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros(8, 16, device=device_type, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device_type, dtype=dtype)
        offs = torch.tensor([4, 8], device=device_type, dtype=torch.int32)
        torch._grouped_mm(a, b, offs=offs)
        torch._grouped_mm(a.t(), a, offs=offs)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _aligned(*tensors: torch.Tensor) -> bool:
    # _grouped_mm wants 16-byte aligned pointers and strides (except the unit stride).
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        if any(s != 1 and (s * t.element_size()) % 16 for s in t.stride()):
            return False
    return True


def _offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(counts), dtype=torch.int64).cumsum(0).to(device, torch.int32)


def _use_grouped(grouped: bool | None, *tensors: torch.Tensor) -> bool:
    # By default the grouped kernel runs off the CPU only: on the CPU torch runs it as one
    # GEMM per group anyway, without a fused bias or an output buffer, so per-expert
    # addmm into place does the same arithmetic with fewer passes over memory.
    t = tensors[0]
    if grouped is False or (grouped is None and t.device.type == "cpu"):
        return False
    return _grouped_mm_works(t.device.type, t.dtype) and _aligned(*tensors)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int], *,
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               grouped: bool | None = None) -> torch.Tensor:
    """Rows of expert i times its matrix, plus its bias: (rows, a) x (experts, a, b) -> (rows, b).

    ``torch._grouped_mm`` where it runs off the CPU (``grouped=True`` asks for it
    anywhere it runs, False never); else one ``addmm`` per expert slice, written
    into ``out`` in place.

    >>> x, w = torch.ones(3, 2), torch.stack([torch.eye(2), 2 * torch.eye(2)])
    >>> grouped_mm(x, w, [1, 2]).tolist()
    [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
    """
    if _use_grouped(grouped, x, w):
        y = torch._grouped_mm(x, w, offs=_offsets(counts, x.device))
        if bias is not None:
            _add_rows(y, bias, counts)
        return y if out is None else out.copy_(y)
    if out is None:
        out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for i, n in enumerate(counts):
        if n:
            if bias is None:
                torch.mm(x[start:start + n], w[i], out=out[start:start + n])
            else:
                torch.addmm(bias[i], x[start:start + n], w[i], out=out[start:start + n])
        start += n
    return out


def _grouped_mm_t(a: torch.Tensor, g: torch.Tensor, counts: Sequence[int],
                  out: torch.Tensor) -> None:
    """Per-expert ``a_i^T g_i`` into ``out`` (experts, p, q): the weight gradients."""
    if _use_grouped(None, a.t(), g):
        out.copy_(torch._grouped_mm(a.t(), g, offs=_offsets(counts, a.device)))
        return
    start = 0
    for i, n in enumerate(counts):
        if n:
            torch.mm(a[start:start + n].t(), g[start:start + n], out=out[i])
        else:
            out[i].zero_()
        start += n


def _add_rows(out: torch.Tensor, bias: torch.Tensor, counts: Sequence[int]) -> None:
    start = 0
    for i, n in enumerate(counts):
        if n:
            out[start:start + n] += bias[i]
        start += n


def _row_sums(g: torch.Tensor, counts: Sequence[int], out: torch.Tensor) -> None:
    start = 0
    for i, n in enumerate(counts):
        if n:
            torch.sum(g[start:start + n], dim=0, out=out[i])
        else:
            out[i].zero_()
        start += n


def chunk_plan(counts: Sequence[int], max_rows: int) -> list[tuple[int, int, int, int]]:
    """Runs of whole experts of at most ``max_rows`` rows (or one expert if it alone is more).

    Returns ``(first expert, last expert + 1, first row, last row + 1)`` per chunk.

    >>> chunk_plan([2, 2, 5, 0, 1], max_rows=4)
    [(0, 2, 0, 4), (2, 3, 4, 9), (3, 5, 9, 10)]
    """
    plan: list[tuple[int, int, int, int]] = []
    e0, r0, rows = 0, 0, 0
    for e, n in enumerate(counts):
        if rows and rows + n > max_rows:
            plan.append((e0, e, r0, r0 + rows))
            e0, r0, rows = e, r0 + rows, 0
        rows += n
    if e0 < len(counts):
        plan.append((e0, len(counts), r0, r0 + rows))
    return plan


class _GroupedMLP(torch.autograd.Function):
    """``gelu(x W1_e + b1_e) W2_e + b2_e`` for every expert e's rows, in chunks of experts."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, counts: list[int], max_rows: int,
                save: bool, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], w2.shape[2])
        # Training keeps every pre-activation for the backward; inference only a chunk's.
        h_all = x.new_empty(x.shape[0], w1.shape[2]) if save else None
        plan = chunk_plan(counts, max_rows)
        for e0, e1, r0, r1 in plan:
            part = counts[e0:e1]
            if h_all is not None:
                h = grouped_mm(x[r0:r1], w1[e0:e1], part, bias=b1[e0:e1], out=h_all[r0:r1])
                a = F.gelu(h)                                              # (rows, d_hidden)
            else:  # inference: nothing saved, GELU in place
                a = torch.ops.aten.gelu_(grouped_mm(x[r0:r1], w1[e0:e1], part, bias=b1[e0:e1]))
            grouped_mm(a, w2[e0:e1], part, bias=b2[e0:e1], out=y[r0:r1])   # (rows, d_model)
        if h_all is not None:
            ctx.save_for_backward(x, h_all, w1, w2)
            ctx.counts, ctx.plan = counts, plan  # type: ignore[attr-defined]
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, h_all, w1, w2 = ctx.saved_tensors
        gy = gy.contiguous()
        gx = torch.empty_like(x)
        gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
        gb1 = w1.new_empty(w1.shape[0], w1.shape[2])
        gb2 = w2.new_empty(w2.shape[0], w2.shape[2])
        for e0, e1, r0, r1 in ctx.plan:
            part = ctx.counts[e0:e1]
            h, g = h_all[r0:r1], gy[r0:r1]
            _grouped_mm_t(F.gelu(h), g, part, out=gw2[e0:e1])
            _row_sums(g, part, out=gb2[e0:e1])
            gh = grouped_mm(g, w2[e0:e1].transpose(1, 2), part)            # grad of GELU out
            torch.ops.aten.gelu_backward.grad_input(gh, h, grad_input=gh)   # grad of its input
            _grouped_mm_t(x[r0:r1], gh, part, out=gw1[e0:e1])
            _row_sums(gh, part, out=gb1[e0:e1])
            grouped_mm(gh, w1[e0:e1].transpose(1, 2), part, out=gx[r0:r1])
        return gx, None, None, None, gw1, gb1, gw2, gb2


class ExpertView(nn.Module):
    """Expert ``i`` of an :class:`ExpertMLP`, as a module on (n, d_model) rows.

    It shares the stacked weights (gradients reach them); it owns no parameters,
    so the layer's ``state_dict`` keeps the stacked form only.
    """

    def __init__(self, bank: ExpertMLP, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "_bank", bank)  # not a submodule: no duplicate parameters
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b: ExpertMLP = self.__dict__["_bank"]
        i = self.index
        return torch.addmm(b.b2[i], F.gelu(torch.addmm(b.b1[i], x, b.w1[i])), b.w2[i])


class ExpertMLP(nn.Module):
    """Every local expert a two-layer GELU MLP, computed together (grouped matmul).

    Example::

        experts = ExpertMLP(4, d_model=64, d_hidden=256)
        y = experts(x_sorted, counts=[10, 0, 7, 3])   # (20, 64) rows sorted by expert
        experts[2](x_sorted[10:17])                    # expert 2 alone

    Args:
        num_local: experts held here.
        d_model, d_hidden: widths.
        chunk_bytes: largest (rows x d_hidden) temporary held at once (default 8 MiB).
    """

    def __init__(self, num_local: int, d_model: int, d_hidden: int, *,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__()
        self.d_model, self.d_hidden, self.chunk_bytes = d_model, d_hidden, chunk_bytes
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_hidden))
        self.b1 = nn.Parameter(torch.empty(num_local, d_hidden))
        self.w2 = nn.Parameter(torch.empty(num_local, d_hidden, d_model))
        self.b2 = nn.Parameter(torch.empty(num_local, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as :class:`torch.nn.Linear` would start (uniform in +-1/sqrt(fan_in))."""
        for w, b, fan_in in ((self.w1, self.b1, self.d_model), (self.w2, self.b2, self.d_hidden)):
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def __len__(self) -> int:
        return self.w1.shape[0]

    def __getitem__(self, i: int) -> ExpertView:
        if not -len(self) <= i < len(self):
            raise IndexError(f"expert {i} out of range: {len(self)} local experts")
        return ExpertView(self, i % len(self))

    def keep(self, first: int, count: int) -> None:
        """Keep experts ``first .. first+count-1`` only (expert parallelism shards the bank)."""
        # The same Parameter objects, smaller: an optimizer built on the full bank still holds them.
        for p in (self.w1, self.b1, self.w2, self.b2):
            p.data = p.data[first:first + count].clone()

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk: (rows x d_hidden) temporaries stay within ``chunk_bytes``."""
        return max(1, self.chunk_bytes // (self.d_hidden * self.w1.element_size()))

    @property
    def stream_rows(self) -> int:
        """Rows per chunk of streamed inference (:mod:`~polytrain.moe.dispatch`): a quarter of
        :attr:`chunk_rows`, about one expert's rows in a layer of many experts, so inference
        holds no more than a per-expert loop would."""
        return max(1, self.chunk_rows // 4)

    def forward(self, x: torch.Tensor, counts: Sequence[int], first: int = 0) -> torch.Tensor:
        """(rows, d_model) sorted by local expert, ``counts[i]`` rows each -> (rows, d_model).

        ``first``: the rows belong to local experts ``first .. first+len(counts)-1``.
        """
        n = len(counts)
        params = tuple(p if first == 0 and n == len(self) else p[first:first + n]
                       for p in (self.w1, self.b1, self.w2, self.b2))
        save = torch.is_grad_enabled() and (x.requires_grad or
                                            any(p.requires_grad for p in params))
        y: torch.Tensor = _GroupedMLP.apply(x, [int(c) for c in counts], self.chunk_rows, save,
                                            *params)
        return y


class ExpertList(nn.ModuleList):
    """Local experts built by any factory ``f(d_model) -> nn.Module``, one call per slice.

    Example::

        experts = ExpertList(4, d_model=64, factory=lambda d: nn.Sequential(
            nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, d)))
        y = experts(x_sorted, counts=[10, 0, 7, 3])
    """

    def __init__(self, num_local: int, d_model: int,
                 factory: Callable[[int], nn.Module]) -> None:
        super().__init__(factory(d_model) for _ in range(num_local))

    def keep(self, first: int, count: int) -> None:
        """Keep experts ``first .. first+count-1`` only."""
        kept = list(self)[first:first + count]
        for name in list(self._modules):
            del self._modules[name]
        self.extend(kept)

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        parts, start = [], 0
        for expert, n in zip(self, counts):
            n = int(n)
            # Every expert runs, on zero rows too: its parameters then join the graph on
            # every rank alike (their gradient is zero, not missing).
            parts.append(expert(x[start:start + n]))
            start += n
        if not parts:
            return x.new_empty(0, x.shape[1])
        return torch.cat(parts)
