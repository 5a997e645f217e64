"""Local experts computed together on rows already sorted by expert.

Rows arrive as contiguous per-expert slices (``counts[i]`` rows for local expert
``i``). The default expert is GPT's feed-forward block, ``proj(gelu(fc(x)))``,
one module per expert (``experts[i]`` is a plain module; the state dict reads
``experts.3.fc.weight``). :class:`ExpertMLP` runs all local experts in one
autograd function:

- a grouped matmul (``torch._grouped_mm``) on GPUs where it runs; on the CPU
  (where torch's grouped matmul is itself one GEMM per group, without a fused
  bias or an output buffer) one ``addmm`` per expert slice, written in place;
- the backward is written out: it keeps only the input and the pre-activation
  (GELU is recomputed), and goes through the experts in chunks of rows, freeing
  each chunk's pre-activation as it goes and giving each expert its own
  gradient tensors. So the memory it holds, and how it allocates it, are those
  of a plain per-expert loop, without one autograd graph per expert.

Under ``torch.autocast`` the default experts compute as the ``nn.Linear`` feed-forward
block they replace does: in autocast's dtype (:func:`autocast_dtype`), their float32
weights cast differentiably. Their matmuls (``addmm(out=)``, ``torch._grouped_mm``) are
none that autocast casts itself.

Any other expert is a module factory ``f(d_model) -> nn.Module``; those
(:class:`ExpertList`) run one call per local expert on its slice.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from ..errors import ConfigError
from ..layers import FeedForward

__all__ = ["FeedForwardExpert", "ExpertMLP", "ExpertList", "grouped_mm", "chunk_plan",
           "autocast_dtype", "CHUNK_BYTES", "GPU_CHUNK_BYTES"]

#: Largest (rows x d_hidden) temporary the MLP experts hold at once, in bytes, on the CPU
#: (where a chunk that stays in cache is faster) ...
CHUNK_BYTES = 8 << 20
#: ... and on a GPU, where each chunk costs a dozen kernel launches whatever its size: 8 MiB
#: chunks left the layer launch-bound on an H200 (training 0.83-1.31x a per-expert loop's
#: speed); 128 MiB gave 0.91-3.30x with at most 1.39x its memory, 256 MiB 1.01-3.88x with
#: 1.87x (docs/moe.md, "On a GPU").
GPU_CHUNK_BYTES = 128 << 20


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs an ``nn.Linear`` on ``x`` in: where it is on for
    x's device, and x a float it casts (not float64); else None.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_dtype(torch.ones(2))
    torch.bfloat16
    """
    kind = x.device.type
    if (not x.is_floating_point() or x.dtype == torch.float64
            or not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind)):
        return None
    return torch.get_autocast_dtype(kind)


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


def _use_grouped(grouped: bool | None, *tensors: torch.Tensor) -> bool:
    # By default the grouped kernel runs off the CPU only: on the CPU torch runs it as one
    # GEMM per group anyway, so per-expert addmm into place does the same arithmetic with
    # fewer passes over memory.
    t = tensors[0]
    if grouped is False or (grouped is None and t.device.type == "cpu"):
        return False
    return _grouped_mm_works(t.device.type, t.dtype) and _aligned(*tensors)


def grouped_mm(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor],
               counts: Sequence[int], *, bias: Sequence[torch.Tensor] | None = None,
               out: torch.Tensor | None = None, grouped: bool | None = None) -> torch.Tensor:
    """Rows of expert i times its matrix, plus its bias: (rows, a) x (experts, a, b) -> (rows, b).

    ``w`` is stacked or one (a, b) matrix per expert (views, e.g. ``weight.t()``).
    ``torch._grouped_mm`` where it runs off the CPU (``grouped=True``: anywhere it
    runs; False: never); else one ``addmm`` per expert slice, written into ``out``.

    >>> x, w = torch.ones(3, 2), [torch.eye(2), 2 * torch.eye(2)]
    >>> grouped_mm(x, w, [1, 2]).tolist()
    [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
    """
    first = w[0]
    if _use_grouped(grouped, x, first):
        stacked = w if isinstance(w, torch.Tensor) else torch.stack(list(w))
        # Host-to-device copies without a device-wide wait (a plain .to() waits for every
        # kernel queued before it; this one stages the few bytes and returns).
        sizes = torch.tensor(list(counts), dtype=torch.int64).to(x.device, non_blocking=True)
        offs = sizes.cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, stacked, offs=offs)
        if bias is not None:  # one add for every expert's rows (not one kernel per expert)
            y += torch.stack(list(bias)).repeat_interleave(sizes, dim=0,
                                                           output_size=x.shape[0])
        return y if out is None else out.copy_(y)
    if out is None:
        out = x.new_empty(x.shape[0], first.shape[-1])
    start = 0
    for i, n in enumerate(counts):
        if n:
            rows, target = x[start:start + n], out[start:start + n]
            if bias is None:
                torch.mm(rows, w[i], out=target)
            else:
                torch.addmm(bias[i], rows, w[i], out=target)
        start += n
    return out


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
    """``proj_e(gelu(fc_e(x)))`` for every expert e's rows, in chunks of whole experts.

    Inputs after the plan: the experts' tensors, four each (fc.weight (h, d),
    fc.bias, proj.weight (d, h), proj.bias).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, counts: list[int], max_rows: int,
                save: bool, *params: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = params[0::4], params[1::4], params[2::4], params[3::4]
        y = x.new_empty(x.shape[0], w2[0].shape[0])
        plan = chunk_plan(counts, max_rows)
        hidden: list[torch.Tensor | None] = []   # each chunk's pre-activation, for backward
        for e0, e1, r0, r1 in plan:
            part = counts[e0:e1]
            h = grouped_mm(x[r0:r1], [w.t() for w in w1[e0:e1]], part, bias=b1[e0:e1])
            if save:
                hidden.append(h)
                a = F.gelu(h)                                              # (rows, d_hidden)
            else:  # inference: nothing kept, GELU in place
                a = torch.ops.aten.gelu_(h)
            grouped_mm(a, [w.t() for w in w2[e0:e1]], part, bias=b2[e0:e1], out=y[r0:r1])
        if save:
            ctx.save_for_backward(x, *params)
            ctx.hidden, ctx.counts, ctx.plan = hidden, counts, plan  # type: ignore[attr-defined]
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        w1, w2 = params[0::4], params[2::4]
        gy = gy.contiguous()
        gx = torch.empty_like(x)
        grads: list[torch.Tensor | None] = [None] * len(params)
        for c, (e0, e1, r0, r1) in enumerate(ctx.plan):
            part = ctx.counts[e0:e1]
            h, g = ctx.hidden[c], gy[r0:r1]
            # Freed once this chunk is done, as a per-expert loop frees its activations;
            # a second backward (retain_graph) computes it again.
            ctx.hidden[c] = None
            if h is None:
                h = grouped_mm(x[r0:r1], [w.t() for w in w1[e0:e1]], part,
                               bias=params[1::4][e0:e1])
            a = F.gelu(h)
            gh = grouped_mm(g, w2[e0:e1], part)                             # grad of GELU out
            torch.ops.aten.gelu_backward.grad_input(gh, h, grad_input=gh)   # grad of its input
            grouped_mm(gh, w1[e0:e1], part, out=gx[r0:r1])
            start = 0
            for i, n in enumerate(part):
                if n:  # an expert without rows gets no gradient, as autograd would give it
                    e = e0 + i
                    rows = slice(start, start + n)
                    grads[4 * e] = gh[rows].t() @ x[r0:r1][rows]            # (h, d)
                    grads[4 * e + 1] = gh[rows].sum(0)
                    grads[4 * e + 2] = g[rows].t() @ a[rows]                # (d, h)
                    grads[4 * e + 3] = g[rows].sum(0)
                start += n
        return (gx, None, None, None, *grads)


FeedForwardExpert = FeedForward  # one expert: the feed-forward block of polytrain's GPT


def _refuse_shared(experts: list[nn.Module], factory_name: str) -> None:
    """Refuse experts that share a parameter: each expert trains its own (under expert
    parallelism a shared one took each worker's local experts' gradient only, and its
    copies drifted apart silently). A shared buffer (an activation's constant) is not
    trained, and passes."""
    owner: dict[int, tuple[int, str]] = {}  # id -> (first expert holding it, its name there)
    for i, expert in enumerate(experts):
        for n, t in expert.named_parameters():
            first, first_name = owner.setdefault(id(t), (i, n))
            if first != i:
                raise ConfigError(f"expert={factory_name} gave expert {i} the parameter {n!r} "
                                  f"of expert {first} ({first_name!r}): the experts would "
                                  f"share it", _NEW_EACH_CALL)


_NEW_EACH_CALL = ("make expert=f(d_model) build a new module at each call, with its own "
                  "parameters, e.g. lambda d: nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), "
                  "nn.Linear(4 * d, d))")


class ExpertList(nn.ModuleList):
    """Local experts built by any factory ``f(d_model) -> nn.Module``, one call per slice.

    Example::

        experts = ExpertList(4, d_model=64, factory=lambda d: nn.Sequential(
            nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, d)))
        y = experts(x_sorted, counts=[10, 0, 7, 3])
    """

    def __init__(self, num_local: int, d_model: int,
                 factory: Callable[[int], nn.Module]) -> None:
        name = getattr(factory, "__qualname__", type(factory).__name__)
        experts = [factory(d_model) for _ in range(num_local)]
        _refuse_shared(experts, name)
        super().__init__(experts)
        #: The factory's name, for the refusal of an expert of another width.
        self.factory_name = name

    def keep(self, first: int, count: int) -> None:
        """Keep experts ``first .. first+count-1`` only (expert parallelism shards the list)."""
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
            y = expert(x[start:start + n])
            if y.shape != (n, x.shape[1]):  # (a bare RuntimeError of reshape() later)
                raise ConfigError(f"an expert that expert={self.factory_name} builds maps "
                                  f"tokens of shape {(n, x.shape[1])} to {tuple(y.shape)}: an "
                                  f"expert must give back (tokens, d_model)",
                                  "make expert=f(d_model) return a module whose output has "
                                  "its input's shape, e.g. nn.Sequential(nn.Linear(d, 4 * d), "
                                  "nn.GELU(), nn.Linear(4 * d, d))")
            parts.append(y)
            start += n
        if not parts:
            return x.new_empty(0, x.shape[1])
        return torch.cat(parts)


class ExpertMLP(ExpertList):
    """Every local expert a :class:`FeedForwardExpert`, all computed in one autograd function.

    Example::

        experts = ExpertMLP(4, d_model=64, d_hidden=256)
        y = experts(x_sorted, counts=[10, 0, 7, 3])   # (20, 64) rows sorted by expert
        experts[2](x_sorted[10:17])                    # expert 2 alone, a plain module

    Args:
        num_local: experts held here.
        d_model, d_hidden: widths.
        chunk_bytes: largest (rows x d_hidden) temporary held at once (default 8 MiB on the
            CPU, 128 MiB on a GPU: :data:`CHUNK_BYTES`, :data:`GPU_CHUNK_BYTES`).
    """

    def __init__(self, num_local: int, d_model: int, d_hidden: int, *,
                 chunk_bytes: int | None = None) -> None:
        super().__init__(num_local, d_model, lambda d: FeedForwardExpert(d, d_hidden))
        self.d_model, self.d_hidden, self.chunk_bytes = d_model, d_hidden, chunk_bytes

    def chunk_budget(self, device: torch.device) -> int:
        """Bytes the experts' temporaries may hold at once on ``device``: ``chunk_bytes``,
        else the device's default."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return CHUNK_BYTES if device.type == "cpu" else GPU_CHUNK_BYTES

    def chunk_rows(self, device: torch.device) -> int:
        """Rows per chunk on ``device``: (rows x d_hidden) fp32 temporaries stay within
        :meth:`chunk_budget`."""
        return max(1, self.chunk_budget(device) // (self.d_hidden * 4))

    def stream_rows(self, device: torch.device) -> int:
        """Rows per chunk of streamed inference planned on the host (the CPU's:
        :mod:`~polytrain.moe.dispatch`): a quarter of :meth:`chunk_rows`, about one expert's
        rows in a layer of many experts, so inference holds no more than a per-expert loop
        would. (On a GPU inference takes :meth:`chunk_rows` at a time: ``docs/moe.md``.)"""
        return max(1, self.chunk_rows(device) // 4)

    def _mlps(self, first: int, end: int) -> list[FeedForwardExpert]:
        return list(self)[first:end]  # type: ignore[return-value]

    def grouped_here(self, x: torch.Tensor) -> bool:
        """Whether :meth:`on_offsets` runs for tokens like ``x``: the grouped matmul runs on
        their device and dtype, off the CPU, on aligned widths; the experts compute in x's
        dtype (their weights' or, under autocast, autocast's: :meth:`stacked` casts)."""
        fc = self._mlps(0, 1)[0].fc.weight
        size = x.element_size()
        return (x.device.type != "cpu" and fc.device == x.device
                and (autocast_dtype(x) or fc.dtype) == x.dtype
                and self.d_model * size % 16 == 0 and self.d_hidden * size % 16 == 0
                and _grouped_mm_works(x.device.type, x.dtype))

    def _pad(self, x: torch.Tensor) -> int:
        return 16 // x.element_size()  # columns after x's: a column of ones, zeros to align

    def with_ones(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, d_model) -> (tokens, d_model + pad): x, a column of ones, zeros; times
        :meth:`stacked`'s first matrix it adds fc's bias without a (rows, d_hidden) bias."""
        ones = x.new_zeros(x.shape[0], self._pad(x))
        ones[:, 0] = 1
        return torch.cat([x, ones], dim=1)

    def group_size(self, x: torch.Tensor) -> int:
        """Experts whose stacked weights (:meth:`stacked`) fit in the chunk budget at once."""
        pad, size = self._pad(x), x.element_size()
        each = (2 * self.d_model + pad) * self.d_hidden * size
        return max(1, self.chunk_budget(x.device) // each)

    def stacked(self, first: int, end: int,
                like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``first .. end-1``'s matrices, stacked (copies, in ``like``'s dtype):
        (E, d + pad, h), fc's weight^T with its bias as the row the ones of
        :meth:`with_ones` meet, and (E, h, d), proj's weight^T."""
        experts = self._mlps(first, end)
        d, pad = self.d_model, self._pad(like)
        w1 = like.new_zeros(len(experts), d + pad, self.d_hidden)
        torch.stack([e.fc.weight.t() for e in experts], out=w1[:, :d])
        torch.stack([e.fc.bias for e in experts], out=w1[:, d])
        w2 = like.new_empty(len(experts), self.d_hidden, d)
        torch.stack([e.proj.weight.t() for e in experts], out=w2)
        return w1, w2

    def proj_biases(self, like: torch.Tensor) -> torch.Tensor:
        """(E, d_model): every expert's proj.bias, in ``like``'s dtype."""
        return torch.stack([e.proj.bias for e in self._mlps(0, len(self))]).to(like.dtype)

    @staticmethod
    def on_offsets(x: torch.Tensor, stacked: tuple[torch.Tensor, torch.Tensor],
                   offs: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Inference on rows sorted by expert (:meth:`with_ones`'s) whose group ends ``offs``
        (int32) live on the device, so the host never reads them: two grouped matmuls,
        ``bias`` (rows, d_model: each row's proj.bias) added. The last group must end at
        the last row (the grouped matmul leaves rows past it unwritten). Run where
        :meth:`grouped_here` says.
        """
        w1, w2 = stacked
        h = torch._grouped_mm(x, w1, offs=offs)
        torch.ops.aten.gelu_(h)
        y = torch._grouped_mm(h, w2, offs=offs)
        return y.add_(bias)

    def forward(self, x: torch.Tensor, counts: Sequence[int], first: int = 0) -> torch.Tensor:
        """(rows, d_model) sorted by local expert, ``counts[i]`` rows each -> (rows, d_model).

        ``first``: the rows belong to local experts ``first .. first+len(counts)-1``.
        Under autocast the rows and the weights are cast to its dtype (:func:`autocast_dtype`)
        and so is the result, as ``nn.Linear``'s; the weights' gradients keep their dtype.
        """
        experts = self._mlps(first, first + len(counts))
        params = [t for e in experts for t in (e.fc.weight, e.fc.bias, e.proj.weight,
                                                e.proj.bias)]
        dtype = autocast_dtype(x)
        if dtype is not None:  # (differentiable casts: float32 weights get float32 gradients)
            x, params = x.to(dtype), [p.to(dtype) for p in params]
        save = torch.is_grad_enabled() and (x.requires_grad or
                                            any(p.requires_grad for p in params))
        y: torch.Tensor = _GroupedMLP.apply(x, [int(c) for c in counts],
                                            self.chunk_rows(x.device), save, *params)
        return y
