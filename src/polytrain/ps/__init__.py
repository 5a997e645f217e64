"""The summation / parameter service: server processes, stores, and the worker-side engine."""

from . import compressed as _compressed  # noqa: F401 - registers the compressed sum store
from . import sparse as _sparse  # noqa: F401 - registers the sparse row store
from .client import Pending, PSClient
from .engine import Engine, SumTensor, engine_for
from .keys import KeySpace
from .placement import Placement, balanced, server_ranks, spread_handlers
from .protocol import Kind, Op
from .server import Server
from .settings import optimizer_spec, pack_round, round_settings
from .stores import (
    STORES,
    Declaration,
    OptimizerStore,
    ParamStore,
    Store,
    SumStore,
    register_store,
    store_name,
)

__all__ = ["Server", "PSClient", "Pending", "Engine", "SumTensor", "engine_for", "KeySpace",
           "Placement", "balanced", "server_ranks", "spread_handlers", "Declaration", "Store",
           "SumStore", "ParamStore", "OptimizerStore", "optimizer_spec", "round_settings",
           "pack_round", "STORES", "register_store", "store_name", "Kind", "Op"]
