"""Strategies: the contract, the registry, the references ``single`` and ``ddp``, the methods."""

from . import byteps as _byteps  # noqa: F401 - registers "byteps"
from . import ddp as _ddp  # noqa: F401 - registers "ddp"
from . import herring as _herring  # noqa: F401 - registers "herring"
from . import hetpipe as _hetpipe  # noqa: F401 - registers "hetpipe"
from . import moe as _moe  # noqa: F401 - registers "moe"
from . import parallax as _parallax  # noqa: F401 - registers "parallax"
from . import pipetransformer as _pipetransformer  # noqa: F401 - registers "pipetransformer"
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
from .trainer import Trainer

__all__ = ["Strategy", "NoOptions", "Trainer", "register", "get_strategy", "strategy_names",
           "distribute",
           "strategy_of", "full_state_dict"]
