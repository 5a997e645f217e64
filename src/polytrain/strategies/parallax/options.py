"""Parallax's options: one frozen dataclass; the CLI makes a flag of every field."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError, at_least

#: Steps each sampled partition count runs in the search, by default.
DEFAULT_SEARCH_STEPS = 3

__all__ = ["ParallaxOptions", "DEFAULT_SEARCH_STEPS"]


@dataclass(frozen=True, kw_only=True)
class ParallaxOptions:
    """Where Parallax puts sparse parameters and how finely it cuts them.

    Args:
        partitions: row ranges per sparse parameter (default None: searched during the
            first steps of the run).
        sparse_embeddings: every ``nn.Embedding``/``EmbeddingBag`` is sparse, its gradient
            made sparse (default True); False keeps only those built with ``sparse=True``.
        colocate: a server on every worker machine (default True); False leaves only the
            ``--servers K`` dedicated CPU machines.
        search_steps: steps each sampled partition count runs during the search (default 3;
            the first of them is not timed).
    """

    partitions: int | None = field(default=None, metadata={
        "help": "row ranges per sparse parameter (default: searched during the first steps)",
        "metavar": "P"})
    sparse_embeddings: bool = field(default=True, metadata={
        "help": "only embeddings built with sparse=True are sparse (default: every "
                "nn.Embedding and EmbeddingBag)"})
    colocate: bool = field(default=True, metadata={
        "help": "no server on the worker machines: only the --servers K CPU machines"})
    search_steps: int = field(default=DEFAULT_SEARCH_STEPS, metadata={
        "help": "steps per sampled partition count in the search (default 3)",
        "metavar": "N"})

    def __post_init__(self) -> None:
        if self.partitions is not None:
            at_least("--partitions", self.partitions,
                     "pass --partitions 8, or leave it out to search")
        if self.search_steps < 2:
            raise ConfigError(f"--search-steps must be at least 2 (got {self.search_steps}): "
                              f"the first step of each sample is not timed",
                              "pass --search-steps 3")
        if self.partitions is not None and self.search_steps != DEFAULT_SEARCH_STEPS:
            raise ConfigError(f"--search-steps {self.search_steps} paces the search of the "
                              f"partition count, and --partitions {self.partitions} skips it",
                              "leave out --search-steps, or --partitions to search")
