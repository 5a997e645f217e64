"""BytePS's options: one frozen dataclass; the CLI makes a flag of every field."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...comm.partition import DEFAULT_PARTITION_BYTES
from ...errors import ConfigError
from ...ps.engine import DEFAULT_CREDIT_BYTES

__all__ = ["BytePSOptions", "DEFAULT_FUSE_BYTES"]

#: Consecutive gradients travel as one group up to a partition's size: every group costs
#: a request and a round of messages per machine, hundreds of microseconds of CPU at both
#: ends, which at 256 KiB groups made k = 0 cost 1.3-1.6x ddp's step (docs/byteps.md).
DEFAULT_FUSE_BYTES = DEFAULT_PARTITION_BYTES


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
        credit_bytes: at most this many bytes pushed and not yet left, so that earlier
            layers overtake later ones queued behind them (default 8,192,000; 0: no bound).
        async_: asynchronous training: servers hold the parameters, workers push their
            optimizer's update and pull the current parameters, with no barrier.
        staleness: with ``async_``, a worker may run at most this many steps ahead of the
            slowest (default 0: synchronous).
    """

    partition_bytes: int = field(default=DEFAULT_PARTITION_BYTES, metadata={
        "help": "largest partition of a tensor in bytes (default 4096000)", "metavar": "B"})
    fuse_bytes: int = field(default=DEFAULT_FUSE_BYTES, metadata={
        "help": "fuse consecutive tensors until a group holds this many bytes (default "
                "4096000; 0: no fusion)", "metavar": "B"})
    colocate: bool = field(default=True, metadata={
        "help": "no summation server on the worker machines: everything on --servers (a "
                "classic parameter server)"})
    credit_bytes: int = field(default=DEFAULT_CREDIT_BYTES, metadata={
        "help": "bytes pushed and not yet sent at most, so earlier layers go first "
                "(default 8192000; 0: no bound)", "metavar": "B"})
    async_: bool = field(default=False, metadata={
        "help": "asynchronous: servers hold the parameters, workers push updates"})
    staleness: int = field(default=0, metadata={
        "help": "with --async, how many steps a worker may run ahead of the slowest "
                "(default 0)", "metavar": "S"})

    def __post_init__(self) -> None:
        if self.partition_bytes < 8:
            raise ConfigError(f"--partition-bytes must be at least 8 (got {self.partition_bytes})",
                              "pass --partition-bytes 4096000 (BytePS's default)")
        if self.fuse_bytes < 0:
            raise ConfigError(f"--fuse-bytes must be 0 (no fusion) or more (got "
                              f"{self.fuse_bytes})", "pass --fuse-bytes 4096000, or 0")
        if self.credit_bytes < 0:
            raise ConfigError(f"--credit-bytes must be 0 (no bound) or more (got "
                              f"{self.credit_bytes})", "pass --credit-bytes 8192000")
        if self.staleness < 0:
            raise ConfigError(f"--staleness must be 0 or more (got {self.staleness})",
                              "pass --staleness 0 (synchronous) or a small bound such as 2")
        if self.staleness and not self.async_:
            raise ConfigError(f"--staleness {self.staleness} bounds asynchronous training only",
                              "add --async, or leave out --staleness")
