"""What strategies on summation servers share: servers on every worker machine, and/or dedicated."""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import ConfigError
from ..launch.layout import Layout
from .base import OptionsT, Strategy

__all__ = ["ServedStrategy"]


class ServedStrategy(Strategy[OptionsT]):
    """A strategy whose options have ``colocate``: a summation server on every worker
    machine (True) and the ``--servers K`` dedicated ones; False keeps only the latter."""

    #: What ``--no-colocate`` means for the strategy, in its refusal without servers.
    no_colocate_means: ClassVar[str] = "keeps only the dedicated servers"

    @classmethod
    def check_layout(cls, layout: Layout, options: Any) -> None:
        if not options.colocate and layout.servers == 0:
            raise ConfigError(f"{cls.name} --no-colocate {cls.no_colocate_means}, but "
                              f"--servers is 0", "pass --servers K (K >= 1), or leave out "
                              "--no-colocate")

    @classmethod
    def uses_servers(cls, options: Any) -> bool:
        return True

    @classmethod
    def colocated_servers(cls, options: Any) -> int:
        return 1 if options.colocate else 0
