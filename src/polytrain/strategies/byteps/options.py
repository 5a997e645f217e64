"""BytePS's options: one frozen dataclass; the CLI makes a flag of every field."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...comm.partition import DEFAULT_PARTITION_BYTES
from ...errors import ConfigError, at_least
from ...ps.compression import ASYNC_COMPRESSORS, DEFAULT_MIN_BYTES, compressor
from ...ps.engine import DEFAULT_CREDIT_BYTES

__all__ = ["BytePSOptions", "DEFAULT_FUSE_BYTES"]

#: Consecutive gradients travel as one group up to a partition's size: every group costs
#: a request and a round of messages per machine, hundreds of microseconds of CPU at both
#: ends, which at 256 KiB groups made k = 0 cost 1.3-1.6x ddp's step (docs/byteps.md).
DEFAULT_FUSE_BYTES = DEFAULT_PARTITION_BYTES


def check_refresh(refresh: int, compress_adam: bool = True) -> None:
    """Refuse a ``compress_adam_refresh`` that is not 0 (off) or at least 2, or one without
    1-bit Adam."""
    if refresh and (refresh < 2 or not compress_adam):
        raise ConfigError(f"--compress-adam-refresh {refresh} freezes 1-bit Adam's variance "
                          f"anew at steps W, W+F, W+F^2, ..., so it needs --compress-adam and "
                          f"F of at least 2", "pass e.g. --compress-adam "
                          "--compress-adam-refresh 4, or leave it out")


@dataclass(frozen=True, kw_only=True)
class BytePSOptions:
    """How BytePS places, schedules and applies the summed gradients.

    Args:
        partition_bytes: tensors are cut into partitions of at most this many bytes
            (default 4,096,000, as BytePS).
        fuse_bytes: consecutive tensors travel as one until the group holds this many
            bytes, so tensors do not each pay a request (default 4,096,000, one partition;
            0: every tensor on its own, as the reference).
        colocate: run a summation server on every worker machine and give it Theorem 1's
            share (default True); False is the classic parameter server.
        credit_bytes: at most this many bytes pushed to one server and not yet held by
            it (a larger partition goes alone), so that earlier layers overtake later ones
            queued behind them; every server has its own window (default 1,024,000; 0: no
            bound). Synchronous mode only.
        async_: asynchronous training: servers hold the parameters, workers push their
            optimizer's update and pull the current parameters, with no barrier.
        staleness: with ``async_``, a worker may run at most this many steps ahead of the
            slowest (default 0: synchronous).
        compress: the gradient compressor between machines and servers, ``NAME[:ARG]``:
            ``onebit``, ``topk:K``, ``randomk:K`` (K a count or a fraction), ``dithering:S``
            (``:natural`` for natural levels), ``fp16``; default ``none``.
        error_feedback: workers and servers keep what compression dropped and add it to
            the next step's tensor.
        compress_momentum: Nesterov momentum on the worker before compression (BytePS's
            ``momentum`` wrapper; default 0: none).
        compress_min_bytes: tensors smaller than this travel uncompressed (default 65,536).
        compress_warmup: the first N steps travel uncompressed (1-bit Adam's warm-up;
            default 0), or as ``compress_warmup_with`` says. Their bytes count in the run's
            bytes per step.
        compress_warmup_with: what the warm-up's compressed tensors travel as: a
            compressor, as ``compress`` (e.g. ``dithering:4``), with the same error feedback;
            default ``none``: uncompressed (needs ``compress_warmup``; with ``compress_adam``
            not one that sends elements as 0: dithering, topk, randomk).
        compress_adam: 1-bit Adam (Tang et al., 2021) on the workers' torch Adam: after
            the warm-up, workers push Adam's momentum, compressed, instead of the gradient,
            and Adam's variance stays at its warm-up value (needs ``compress_warmup``).
        compress_adam_refresh: with ``compress_adam``, F >= 2: the variance is frozen at
            steps W, W + F, W + F^2, ... (W = ``compress_warmup``, then 0 allowed) from
            every worker's own gradient variance, averaged in one uncompressed sum each
            time (default 0: frozen once, from the warm-up's Adam).
    """

    partition_bytes: int = field(default=DEFAULT_PARTITION_BYTES, metadata={
        "help": f"largest partition of a tensor in bytes (default {DEFAULT_PARTITION_BYTES})",
        "metavar": "B"})
    fuse_bytes: int = field(default=DEFAULT_FUSE_BYTES, metadata={
        "help": f"fuse consecutive tensors until a group holds this many bytes (default "
                f"{DEFAULT_FUSE_BYTES}; 0: no fusion)", "metavar": "B"})
    colocate: bool = field(default=True, metadata={
        "help": "no summation server on the worker machines: everything on --servers (a "
                "classic parameter server)"})
    credit_bytes: int = field(default=DEFAULT_CREDIT_BYTES, metadata={
        "help": "bytes pushed to one server and not yet held by it, at most, so "
                f"earlier layers go first (default {DEFAULT_CREDIT_BYTES}; 0: no bound; "
                f"synchronous only)",
        "metavar": "B"})
    async_: bool = field(default=False, metadata={
        "help": "asynchronous: servers hold the parameters, workers push updates"})
    staleness: int = field(default=0, metadata={
        "help": "with --async, how many steps a worker may run ahead of the slowest "
                "(default 0)", "metavar": "S"})
    compress: str = field(default="none", metadata={
        "help": "gradient compressor: onebit, topk:K, randomk:K (K a count or a fraction), "
                "dithering:S[:natural], fp16 (default none)", "metavar": "NAME[:ARG]"})
    error_feedback: bool = field(default=False, metadata={
        "help": "with --compress: keep what compression dropped and add it next step"})
    compress_momentum: float = field(default=0.0, metadata={
        "help": "with --compress: Nesterov momentum on the worker before compression "
                "(default 0)", "metavar": "M"})
    compress_min_bytes: int = field(default=DEFAULT_MIN_BYTES, metadata={
        "help": f"with --compress: smaller tensors travel uncompressed (default "
                f"{DEFAULT_MIN_BYTES})",
        "metavar": "B"})
    compress_warmup: int = field(default=0, metadata={
        "help": "with --compress: the first N steps travel uncompressed (default 0)",
        "metavar": "N"})
    compress_warmup_with: str = field(default="none", metadata={
        "help": "with --compress-warmup: what the warm-up steps travel as, a compressor as "
                "--compress (e.g. dithering:4; default none: uncompressed)",
        "metavar": "NAME[:ARG]"})
    compress_adam: bool = field(default=False, metadata={
        "help": "with --compress and --optimizer adam: 1-bit Adam: after --compress-warmup, "
                "push Adam's momentum compressed and freeze Adam's variance"})
    compress_adam_refresh: int = field(default=0, metadata={
        "help": "with --compress-adam: freeze the variance at steps W, W+F, W+F^2, ... "
                "(W = --compress-warmup, may be 0) from the workers' own gradient "
                "variances, one uncompressed sum each (default 0: frozen once)",
        "metavar": "F"})

    def __post_init__(self) -> None:
        if self.partition_bytes < 8:
            raise ConfigError(f"--partition-bytes must be at least 8 (got {self.partition_bytes})",
                              "pass --partition-bytes 4096000 (BytePS's default)")
        if self.fuse_bytes < 0:
            raise ConfigError(f"--fuse-bytes must be 0 (no fusion) or more (got "
                              f"{self.fuse_bytes})", "pass --fuse-bytes 4096000, or 0")
        if self.async_ and self.fuse_bytes != DEFAULT_FUSE_BYTES:
            raise ConfigError(f"--fuse-bytes fuses synchronous BytePS's gradients; --async "
                              f"pushes each parameter's update alone (got --fuse-bytes "
                              f"{self.fuse_bytes})", "drop --async, or leave out --fuse-bytes")
        if self.credit_bytes < 0:
            raise ConfigError(f"--credit-bytes must be 0 (no bound) or more (got "
                              f"{self.credit_bytes})", "pass --credit-bytes 1024000")
        if self.async_ and self.credit_bytes != DEFAULT_CREDIT_BYTES:
            raise ConfigError(f"--credit-bytes bounds synchronous BytePS's gradient pushes; "
                              f"--async pushes each step's updates without a credit (got "
                              f"--credit-bytes {self.credit_bytes})",
                              "drop --async, or leave out --credit-bytes")
        at_least("--staleness", self.staleness,
                 "pass --staleness 0 (synchronous) or a small bound such as 2", minimum=0)
        if self.staleness and not self.async_:
            raise ConfigError(f"--staleness {self.staleness} bounds asynchronous training only",
                              "add --async, or leave out --staleness")
        codec = compressor(self.compress)  # an unknown name or a bad argument: its error
        if codec is None and (self.error_feedback or self.compress_momentum
                              or self.compress_min_bytes != DEFAULT_MIN_BYTES):
            raise ConfigError("--error-feedback, --compress-momentum and --compress-min-bytes "
                              "apply to compressed gradients, but --compress is none",
                              "add --compress NAME (e.g. onebit), or leave them out")
        if self.compress_warmup < 0:
            raise ConfigError(f"--compress-warmup must be 0 or more steps (got "
                              f"{self.compress_warmup})", "pass --compress-warmup 100, or 0")
        if codec is None and (self.compress_warmup or self.compress_adam):
            raise ConfigError("--compress-warmup and --compress-adam apply to compressed "
                              "gradients, but --compress is none",
                              "add --compress NAME (e.g. onebit), or leave them out")
        try:
            warming = compressor(self.compress_warmup_with)
        except ConfigError as e:
            raise ConfigError(f"--compress-warmup-with: {e.what}", "pass a compressor as "
                              "--compress takes it, e.g. --compress-warmup-with dithering:4"
                              ) from None
        if warming is not None and not self.compress_warmup:
            raise ConfigError(f"--compress-warmup-with {self.compress_warmup_with} says what "
                              f"the warm-up travels as, but --compress-warmup is 0",
                              "add --compress-warmup N, or leave out --compress-warmup-with")
        if self.compress_adam and warming is not None and warming.zeroes:
            raise ConfigError(f"--compress-adam (1-bit Adam) freezes the variance Adam learns "
                              f"in the warm-up, but --compress-warmup-with "
                              f"{self.compress_warmup_with} sends elements as exactly 0, so "
                              f"their variance can stay 0 and 1-bit Adam then divides their "
                              f"momentum by eps (the run diverges)", "leave out "
                              "--compress-warmup-with (an uncompressed warm-up), or use fp16 "
                              "or onebit")
        if self.compress_adam and not self.compress_warmup and not self.compress_adam_refresh:
            raise ConfigError("--compress-adam (1-bit Adam) freezes the variance Adam learns "
                              "in the warm-up, but --compress-warmup is 0",
                              "add --compress-warmup N (e.g. a fifth of the steps)")
        check_refresh(self.compress_adam_refresh, self.compress_adam)
        if self.compress_adam and self.compress_momentum:
            raise ConfigError(f"--compress-adam compresses Adam's momentum; "
                              f"--compress-momentum {self.compress_momentum} would add a "
                              f"second momentum before it", "leave out --compress-momentum")
        if self.async_ and self.compress_momentum:
            raise ConfigError("--compress-momentum is a momentum on the gradients before "
                              "compression, and --async pushes updates (the optimizer's "
                              "steps): it would put a second momentum on them",
                              "drop --async, or leave out --compress-momentum")
        if self.async_ and (self.compress_warmup or self.compress_adam):
            raise ConfigError("--compress-warmup and --compress-adam apply to synchronous "
                              "BytePS (--async pushes updates, not sums)",
                              "drop --async, or leave them out")
        if not 0.0 <= self.compress_momentum < 1.0:
            raise ConfigError(f"--compress-momentum must be in [0, 1) (got "
                              f"{self.compress_momentum})", "pass --compress-momentum 0.9")
        at_least("--compress-min-bytes", self.compress_min_bytes,
                 "pass --compress-min-bytes 65536", minimum=0)
        if self.async_ and codec is not None and codec.name not in ASYNC_COMPRESSORS:
            raise ConfigError(
                f"--compress {self.compress} cannot run with --async: asynchronous BytePS "
                f"pushes updates into parameter stores and pulls the parameters themselves, "
                f"not a sum; {codec.name} of the weights would lose them, and its packed "
                f"pushes would need a parameter store that decodes them (there is none). "
                f"The compressors --async supports: {', '.join(ASYNC_COMPRESSORS)} (updates "
                f"pushed in half precision, with error feedback under --error-feedback; "
                f"parameters pulled exact)",
                "drop --async, or use --compress fp16")
