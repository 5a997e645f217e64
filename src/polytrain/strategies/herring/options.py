"""Herring's options: one frozen dataclass; the CLI makes a flag of every field."""

from __future__ import annotations

from dataclasses import dataclass, field

from .ddp import DEFAULT_BUCKET_CAP_MB, bucket_cap_bytes

__all__ = ["HerringOptions"]


@dataclass(frozen=True, kw_only=True)
class HerringOptions:
    """How Herring fuses and places the gradients.

    Args:
        bucket_cap_mb: fusion buffer size in MiB (default 25, as torch's DDP; None too, as
            the drop-in and torch's DDP read it).
        colocate: a summation server on every worker machine (default True); False leaves
            only the ``--servers K`` dedicated CPU machines.
    """

    bucket_cap_mb: float | None = field(default=DEFAULT_BUCKET_CAP_MB, metadata={
        "help": "fusion buffer size in MiB; each buffer is cut into one shard per server "
                f"(default {DEFAULT_BUCKET_CAP_MB:g})", "metavar": "MB"})
    colocate: bool = field(default=True, metadata={
        "help": "no summation server on the worker machines: only the --servers K CPU "
                "machines"})

    def __post_init__(self) -> None:
        bucket_cap_bytes(self.bucket_cap_mb, "--bucket-cap-mb")
