"""Strategies: the contract, the registry, and the reference strategies ``single`` and ``ddp``."""

from . import ddp as _ddp  # noqa: F401 - registers "ddp"
from . import hetpipe as _hetpipe  # noqa: F401 - registers "hetpipe"
from . import single as _single  # noqa: F401 - registers "single"
from .base import (
                   NoOptions,
                   Strategy,
                   distribute,
                   full_state_dict,
                   get_strategy,
                   register,
                   strategy_names,
                   strategy_of,
)

__all__ = ["Strategy", "NoOptions", "register", "get_strategy", "strategy_names", "distribute",
           "strategy_of", "full_state_dict"]
