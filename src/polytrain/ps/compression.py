"""Gradient compressors: pure codecs (packed uint8 payloads), their registry, and error feedback.

Every compressor turns a flat float32 tensor of ``numel`` elements into a
uint8 payload whose size depends on ``numel`` only (:meth:`Compressor.nbytes`),
so a receiver always posts its receive before the message comes:

    =================  ==========================================  =====================
    name               payload                                     bytes for n floats
    =================  ==========================================  =====================
    ``fp16``           the values in half precision                2n
    ``onebit:B``       G scales (float32), then one sign bit each  4G + ceil(n / 8)
    ``topk:K``         K int32 indices, then K float32 values      8K
    ``randomk:K``      K int32 indices (seeded draw), K values     8K
    ``dithering:S``    max |x| per segment (float32), then sign    4s + ceil(n b / 8)
                       + level bits
    =================  ==========================================  =====================

A payload may cover several *segments*: the tensors that fusion laid back to
back in one partition (``segments``: their lengths, in order; one segment by
default). Their gradients' scales can differ by orders of magnitude, so no
statistic crosses a segment boundary: onebit keeps a scale per block of at
most B elements of each segment (G blocks in all; B = 128 by default,
``onebit:0``: one per segment, the reference's scale per tensor), dithering a
max |x| per segment (s of them), and topk / randomk choose K from each
segment (K a count, ``topk:1000``, or a fraction of it, ``topk:0.01``; the
payload's K is their sum). A dithering level takes ``b = 1 + ceil(log2(S + 1))``
bits. :class:`Codec`
adds what BytePS's wrappers add on one side of the wire: Nesterov momentum
(workers only) and error feedback (what compression dropped is added to the
next step's tensor). Paper: Jiang et al., OSDI 2020, section on compression;
the reference is bytedance/byteps ``byteps/common/compressor``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..errors import ConfigError, unknown

__all__ = ["Compressor", "FP16", "OneBit", "TopK", "RandomK", "Dithering", "CompressOptions",
           "Codec", "codec_states_fit", "compressor", "compressor_names", "pack_bits",
           "unpack_bits", "ASYNC_COMPRESSORS", "DEFAULT_MIN_BYTES", "DEFAULT_ONEBIT_BLOCK"]

#: Tensors smaller than this travel uncompressed (BytePS's ``BYTEPS_MIN_COMPRESS_BYTES``).
DEFAULT_MIN_BYTES = 65_536

#: Elements per onebit scale, at most, by default (see :class:`OneBit`).
DEFAULT_ONEBIT_BLOCK = 128

_F32 = torch.float32

#: The bytes of a CPU generator's state (a random compressor's draws so far).
_GENERATOR_BYTES = torch.Generator().get_state().numel()

def _segments(numel: int, segments: tuple[int, ...] | None) -> tuple[int, ...]:
    """``segments`` checked against ``numel`` (None: the whole payload is one segment)."""
    if segments is None:
        return (numel,)
    if sum(segments) != numel or any(n < 1 for n in segments):
        raise ConfigError(f"compression segments {list(segments)} must be positive lengths "
                          f"that add up to the payload's {numel} elements",
                          "pass the lengths of the tensors in the partition, in order")
    return tuple(segments)


def _starts(lengths: tuple[int, ...]) -> list[int]:
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += n
    return out


def _group_mean(values: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """The mean of each run of ``lengths`` consecutive values, in order: summed in float64,
    so the float32 result does not depend on the order of the additions."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    total = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, ids, values.double())
    return (total / torch.tensor(lengths, dtype=torch.float64)).to(_F32)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned ``codes`` (< 2**width), ``width`` bits each, most significant first, packed
    into bytes (NumPy's ``packbits`` order; the last byte is zero-padded)."""
    shifts = torch.arange(width - 1, -1, -1, dtype=torch.int64)
    bits = ((codes.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int64)
    return (bits.view(-1, 8) * weights).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: ``count`` codes of ``width`` bits (int64)."""
    shifts = torch.arange(7, -1, -1, dtype=torch.int64)
    bits = ((packed.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[:count * width]
    weights = 2 ** torch.arange(width - 1, -1, -1, dtype=torch.int64)
    return (bits.view(count, width) * weights).sum(1)


class Compressor(ABC):
    """A codec: ``encode`` a flat float32 tensor into a uint8 payload, ``decode`` it back.

    Pure: the only state is the generator a random compressor is handed.
    """

    name: str = ""
    #: Whether the same input always gives the same payload.
    deterministic = True
    #: Whether every machine's codec of a key draws what the server's draws (randomk: the
    #: same elements, so the servers' sum keeps all of them); otherwise each machine draws
    #: its own (dithering: alike draws would round every machine's error alike, and their
    #: sum's error would not shrink with the machines).
    shared_draws = False
    #: Whether it can send an element as exactly 0 while others of its block are not
    #: (a sparsifier's unchosen elements, dithering's lowest level): Adam's variance of such
    #: sums stays 0 there, which 1-bit Adam cannot freeze (docs/from-byteps.md).
    zeroes = False

    @abstractmethod
    def nbytes(self, numel: int, segments: tuple[int, ...] | None = None) -> int:
        """The payload's size for ``numel`` elements (in ``segments``: see the module)."""

    @abstractmethod
    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        """``x`` (numel,) float32 -> uint8 payload of :meth:`nbytes` bytes."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, numel: int,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        """The payload -> a (numel,) float32 tensor."""

    def spec(self) -> str:
        """The name that :func:`compressor` parses back into this compressor."""
        return self.name

    def __str__(self) -> str:
        return self.spec()


@dataclass(frozen=True)
class FP16(Compressor):
    """Half precision: 2 bytes per element (``Compression.fp16``)."""

    name = "fp16"

    def nbytes(self, numel: int, segments: tuple[int, ...] | None = None) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        return _bytes_of(x.to(torch.float16))

    def decode(self, payload: torch.Tensor, numel: int,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        return payload.view(torch.float16).to(_F32)


@dataclass(frozen=True)
class OneBit(Compressor):
    """Signs, one bit each (set for x < 0), times a scale per block: its mean |x| (``scaled``).

    Each segment is cut into blocks of ``block`` elements (the last one shorter);
    ``block`` 0: one block per segment, the reference's scale per tensor.
    Unscaled: one scale, 1, for the whole payload. A mean over a block of
    similar elements (a row of a weight) reconstructs far better than one over
    a tensor whose rows' scales differ (rare tokens' embedding rows, whose
    gradient is mostly zero, take the mean of the frequent ones): on the default
    GPT task, onebit with error feedback ends 58% above uncompressed with a
    scale per tensor (docs/from-byteps.md). 4 bytes per 128 elements is 1/32
    of the floats again, so the payload stays under 1/25 of them.
    """

    scaled: bool = True
    block: int = DEFAULT_ONEBIT_BLOCK
    name = "onebit"

    def blocks(self, numel: int, segments: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The lengths of the runs of elements that share a scale, in order."""
        if not self.scaled:
            return (numel,)
        out: list[int] = []
        for n in _segments(numel, segments):
            b = self.block or n
            out += [b] * (n // b) + ([n % b] if n % b else [])
        return tuple(out)

    def nbytes(self, numel: int, segments: tuple[int, ...] | None = None) -> int:
        return 4 * len(self.blocks(numel, segments)) + (numel + 7) // 8

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        lengths = self.blocks(x.numel(), segments)
        if self.scaled:
            scale = _group_mean(x.abs(), lengths)
        else:
            scale = torch.ones(1, dtype=_F32)
        return torch.cat([_bytes_of(scale), pack_bits(x < 0, 1)])

    def decode(self, payload: torch.Tensor, numel: int,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        lengths = self.blocks(numel, segments)
        scale = payload[:4 * len(lengths)].view(_F32)
        negative = unpack_bits(payload[4 * len(lengths):], 1, numel)
        return (1 - 2 * negative).to(_F32) * torch.repeat_interleave(scale,
                                                                     torch.tensor(lengths))

    def spec(self) -> str:
        if not self.scaled:
            return "onebit:unscaled"
        return "onebit" if self.block == DEFAULT_ONEBIT_BLOCK else f"onebit:{self.block}"


def _count(k: float, numel: int) -> int:
    """K as a count, or a fraction of ``numel`` (at least one element, at most all)."""
    return min(numel, max(1, round(k * numel)) if k < 1 else int(k))


@dataclass(frozen=True)
class _Sparse(Compressor):
    """K indices (int32) then K values (float32); the rest of the tensor is zero."""

    k: float = 0.01
    zeroes = True

    def counts(self, numel: int, segments: tuple[int, ...] | None = None) -> list[int]:
        """K of each segment."""
        return [_count(self.k, n) for n in _segments(numel, segments)]

    def nbytes(self, numel: int, segments: tuple[int, ...] | None = None) -> int:
        return 8 * sum(self.counts(numel, segments))

    @abstractmethod
    def choose(self, x: torch.Tensor, k: int, generator: torch.Generator | None
               ) -> torch.Tensor:
        """The ``k`` indices to send (int64)."""

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        lengths = _segments(x.numel(), segments)
        index = torch.cat([start + self.choose(x[start:start + n], k, generator)
                           for start, n, k in zip(_starts(lengths), lengths,
                                                  self.counts(x.numel(), lengths))])
        return torch.cat([_bytes_of(index.to(torch.int32)), _bytes_of(x[index].to(_F32))])

    def decode(self, payload: torch.Tensor, numel: int,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        k = sum(self.counts(numel, segments))
        index = payload[:4 * k].view(torch.int32).to(torch.int64)
        out = torch.zeros(numel, dtype=_F32)
        out[index] = payload[4 * k:].view(_F32)
        return out

    def spec(self) -> str:
        # Every digit (":g" kept six: topk:1234567 reached the servers as 1234570).
        k = self.k
        return f"{self.name}:{int(k) if float(k).is_integer() else repr(float(k))}"


@dataclass(frozen=True)
class TopK(_Sparse):
    """The K elements of largest magnitude of each segment (ties: the lower index first)."""

    name = "topk"

    def choose(self, x: torch.Tensor, k: int, generator: torch.Generator | None
               ) -> torch.Tensor:
        return torch.sort(x.abs(), descending=True, stable=True).indices[:k]


@dataclass(frozen=True)
class RandomK(_Sparse):
    """K elements of each segment drawn uniformly without replacement (``torch.randperm`` of
    the generator, segment after segment)."""

    name = "randomk"
    deterministic = False
    shared_draws = True

    def choose(self, x: torch.Tensor, k: int, generator: torch.Generator | None
               ) -> torch.Tensor:
        return torch.randperm(x.numel(), generator=generator)[:k]


@dataclass(frozen=True)
class Dithering(Compressor):
    """Stochastic quantization of |x| / max|x| to S levels, unbiased (QSGD-style).

    Levels are ``0, 1/S, ..., 1`` (``linear``) or ``0, 2^(1-S), ..., 1/2, 1``
    (``natural``); a value between two levels rounds up with probability its
    distance from the lower one over the gap, drawn with ``torch.rand`` of the
    generator. Normalised by max |x| of each segment (the reference's ``max``
    normalisation, per tensor).
    """

    levels: int = 4
    natural: bool = False
    name = "dithering"
    deterministic = False
    zeroes = True

    @property
    def width(self) -> int:
        return 1 + math.ceil(math.log2(self.levels + 1))

    def table(self) -> torch.Tensor:
        s = self.levels
        if self.natural:
            return torch.tensor([0.0] + [2.0 ** (j - s) for j in range(1, s + 1)], dtype=_F32)
        return torch.arange(s + 1, dtype=_F32) / s

    def nbytes(self, numel: int, segments: tuple[int, ...] | None = None) -> int:
        return 4 * len(_segments(numel, segments)) + (numel * self.width + 7) // 8

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        table = self.table()
        lengths = _segments(x.numel(), segments)
        norm = torch.stack([x[a:a + n].abs().max() for a, n in zip(_starts(lengths), lengths)]
                           ) if x.numel() else torch.zeros(1, dtype=_F32)
        each = torch.repeat_interleave(norm, torch.tensor(lengths))
        r = torch.where(each > 0, x.abs() / each, torch.zeros_like(x))
        low = (torch.searchsorted(table, r, right=True) - 1).clamp_(0, self.levels - 1)
        lo, hi = table[low], table[low + 1]
        up = torch.rand(x.numel(), generator=generator, dtype=_F32) < (r - lo) / (hi - lo)
        code = low + up.to(torch.int64)  # 0 .. S
        sign = (x < 0).to(torch.int64)
        return torch.cat([_bytes_of(norm.to(_F32)),
                          pack_bits(sign << (self.width - 1) | code, self.width)])

    def decode(self, payload: torch.Tensor, numel: int,
               segments: tuple[int, ...] | None = None) -> torch.Tensor:
        lengths = _segments(numel, segments)
        norm = torch.repeat_interleave(payload[:4 * len(lengths)].view(_F32),
                                       torch.tensor(lengths))
        codes = unpack_bits(payload[4 * len(lengths):], self.width, numel)
        sign = codes >> (self.width - 1)
        level = self.table()[codes & ((1 << (self.width - 1)) - 1)]
        return (1 - 2 * sign).to(_F32) * (level * norm)

    def spec(self) -> str:
        return f"dithering:{self.levels}" + (":natural" if self.natural else "")


def _fraction_or_count(name: str, arg: str) -> float:
    try:
        k = float(arg)
    except ValueError:
        k = -1.0
    if not (0 < k < 1 or (1 <= k < math.inf and k == int(k))):
        raise ConfigError(f"{name}:{arg}: K must be a count of elements (1 or more) or a "
                          f"fraction between 0 and 1", f"pass {name}:0.01 or {name}:1000")
    return k


def _onebit(args: list[str]) -> Compressor:
    if args in ([], ["scaled"], ["unscaled"]):
        return OneBit(scaled=args != ["unscaled"])
    if len(args) == 1 and args[0].isdigit():
        return OneBit(block=int(args[0]))
    raise ConfigError(f"onebit:{':'.join(args)}: onebit takes B, the elements per scale "
                      f"(default {DEFAULT_ONEBIT_BLOCK}; 0: one scale per tensor), 'scaled' "
                      f"(the default: signs times mean |x| of each block) or 'unscaled'",
                      "pass onebit, onebit:0 or onebit:unscaled")


def _dithering(args: list[str]) -> Compressor:
    text = ":".join(args)
    levels = int(args[0]) if args and args[0].isdigit() else 0
    kind = args[1] if len(args) > 1 else "linear"
    if levels < 2 or len(args) > 2 or kind not in ("linear", "natural"):
        raise ConfigError(f"dithering:{text}: dithering takes S levels, 2 or more, and "
                          f"optionally 'linear' (the default) or 'natural'",
                          "pass dithering:4 or dithering:4:natural")
    return Dithering(levels=levels, natural=kind == "natural")


def _sparse(kind: type[_Sparse]) -> Callable[[list[str]], Compressor]:
    def make(args: list[str]) -> Compressor:
        if len(args) != 1:
            raise ConfigError(f"{kind.name} takes K: a count or a fraction of each tensor",
                              f"pass {kind.name}:0.01")
        return kind(k=_fraction_or_count(kind.name, args[0]))
    return make


def _fp16(args: list[str]) -> Compressor:
    if args:
        raise ConfigError(f"fp16 takes no argument (got fp16:{':'.join(args)})", "pass fp16")
    return FP16()


_REGISTRY: dict[str, Callable[[list[str]], Compressor]] = {
    "onebit": _onebit, "topk": _sparse(TopK), "randomk": _sparse(RandomK),
    "dithering": _dithering, "fp16": _fp16}

#: Compressors asynchronous BytePS can use (see :func:`check_async`).
ASYNC_COMPRESSORS = ("fp16",)


def compressor_names() -> list[str]:
    """The registered compressors' names (and ``none``)."""
    return ["none", *_REGISTRY]


def compressor(text: str) -> Compressor | None:
    """Parse ``NAME[:ARG...]`` (``onebit``, ``topk:0.01``, ``dithering:4:natural``, ...);
    ``none`` is None. Raises ConfigError listing the names for an unknown one.

    Example::

        >>> compressor("topk:0.01").nbytes(1000)
        80
    """
    name, *args = text.strip().split(":")
    if name == "none" and not args:
        return None
    make = _REGISTRY.get(name)
    if make is None:
        raise unknown("compressor", text, compressor_names(), "pass one of them, e.g. "
                      "--compress onebit or --compress topk:0.01")
    return make(args)


@dataclass(frozen=True)
class CompressOptions:
    """How one tensor is compressed: the codec, error feedback, the worker's momentum.

    Plain data (a worker's engine and the server's store build a :class:`Codec`
    from it). ``momentum`` is BytePS's Nesterov wrapper, applied on the worker
    before compression: ``m = mu m + g; g' = g + mu m``. ``bounds``: where each
    tensor starts in a fused tensor (element offsets, the first 0; empty: one
    tensor), so a partition's codec keeps its statistics per tensor (see the module).
    """

    compressor: Compressor
    error_feedback: bool = False
    momentum: float = 0.0
    bounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"compression momentum must be in [0, 1) (got {self.momentum})",
                              "pass --compress-momentum 0.9, or leave it out")

    def segments(self, offset: int, numel: int) -> tuple[int, ...] | None:
        """The lengths of the tensors' pieces in elements ``[offset, offset + numel)`` of
        the fused tensor (None: one tensor's)."""
        cuts = [b for b in self.bounds if offset < b < offset + numel]
        if not cuts:
            return None
        edges = [offset, *cuts, offset + numel]
        return tuple(b - a for a, b in zip(edges, edges[1:]))

    def declaration(self, numel: int, segments: tuple[int, ...] | None = None
                    ) -> dict[str, Any]:
        """What the server's store needs, as JSON: the codec, its numel and segments, its
        feedback."""
        out: dict[str, Any] = {"compressor": self.compressor.spec(), "numel": numel,
                               "error_feedback": self.error_feedback}
        if segments is not None:
            out["segments"] = list(segments)
        return out


@dataclass
class Codec:
    """One tensor's compression state on one side of the wire.

    ``encode`` applies momentum (if any), adds the residual (error feedback),
    compresses and keeps the new residual; ``decode`` unpacks. ``seed`` seeds
    the generator of random compressors (the key: the same on every machine);
    ``stream``, the pushing process's rank (None: the server's), draws apart from
    the other machines where the compressor does not share its draws.
    ``segments``: the lengths of the tensors in the payload (None: one).
    """

    options: CompressOptions
    numel: int
    seed: int = 0
    stream: int | None = None
    segments: tuple[int, ...] | None = None
    residual: torch.Tensor | None = None
    velocity: torch.Tensor | None = None
    generator: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        seed = self.seed
        if self.stream is not None and not self.options.compressor.shared_draws:
            seed = (seed * 1_000_003 + 1 + self.stream) % 2 ** 63
        self.generator.manual_seed(seed)
        if self.segments is not None:
            self.segments = _segments(self.numel, tuple(self.segments))

    @property
    def nbytes(self) -> int:
        return self.options.compressor.nbytes(self.numel, self.segments)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(numel,) float32 -> the uint8 payload (this side's momentum and feedback applied).

        A step with an inf or nan (AMP's overflow, which its gradient scaler then skips) is
        sent, and neither momentum nor feedback keeps any of it: it would come back in every
        later step. So is one whose payload decodes to inf (a value past float16's range):
        the residual stays the one before it, as for a step that never came."""
        opts, x = self.options, x.to(_F32)
        if opts.momentum and not bool(torch.isfinite(x).all()):
            return opts.compressor.encode(x, self.generator, self.segments)
        if opts.momentum:
            if self.velocity is None:
                self.velocity = torch.zeros_like(x)
            self.velocity.mul_(opts.momentum).add_(x)
            x = x + opts.momentum * self.velocity
        if opts.error_feedback:
            if self.residual is not None:
                x = x + self.residual
        payload = opts.compressor.encode(x, self.generator, self.segments)
        if opts.error_feedback:
            residual = x - opts.compressor.decode(payload, self.numel, self.segments)
            if bool(torch.isfinite(residual).all()):
                self.residual = residual
        return payload

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return self.options.compressor.decode(payload, self.numel, self.segments)

    # -- what a checkpoint holds ---------------------------------------------------------------

    @staticmethod
    def state_bytes(numel: int) -> int:
        """The bytes of :meth:`state` for a codec of ``numel`` elements."""
        return 2 * (1 + 4 * numel) + _GENERATOR_BYTES

    def state(self) -> torch.Tensor:
        """What this codec carries from one step to the next, as one uint8 tensor (a server
        answers it as a key's whole state): error feedback's residual and the momentum's
        velocity (each a flag byte, then its float32 values, zeros where there is none yet),
        then the random compressors' generator."""
        parts = []
        for t in (self.residual, self.velocity):
            parts += [torch.tensor([t is not None], dtype=torch.uint8),
                      _bytes_of(torch.zeros(self.numel, dtype=_F32) if t is None else t)]
        return torch.cat([*parts, self.generator.get_state()])

    def load_state(self, state: torch.Tensor) -> None:
        """Carry on from :meth:`state`'s tensor (a codec of the same size)."""
        want = self.state_bytes(self.numel)
        if state.dtype != torch.uint8 or state.numel() != want:
            raise ConfigError(f"a codec's state of {self.numel} elements takes {want} bytes, "
                              f"not {state.numel()} {state.dtype}",
                              "load the state of a codec of the same tensor")
        at, n, kept = 0, 4 * self.numel, []
        for _ in range(2):
            kept.append(state[at + 1:at + 1 + n].clone().view(_F32) if state[at] else None)
            at += 1 + n
        self.residual, self.velocity = kept
        self.generator.set_state(state[at:].clone())


def codec_states_fit(states: Mapping[int, torch.Tensor], codecs: Mapping[int, Codec]) -> bool:
    """Whether ``states`` (by key, :meth:`Codec.state`'s, as a checkpoint holds them) are
    those of ``codecs``: the same keys, each of its codec's size."""
    return ({int(k): v.numel() for k, v in states.items()}
            == {k: Codec.state_bytes(c.numel) for k, c in codecs.items()})
