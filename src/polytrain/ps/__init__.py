"""The summation / parameter service: server processes, stores and the worker-side client."""

from .client import Pending, PSClient, SumClient
from .placement import Placement, balanced
from .protocol import Kind, Op
from .server import Server
from .store import (
    STORES,
    Declaration,
    OptimizerStore,
    ParamStore,
    Store,
    SumStore,
    optimizer_spec,
    pack_round,
    register_store,
    round_settings,
)

__all__ = ["Server", "PSClient", "SumClient", "Pending", "Placement", "balanced", "Declaration",
           "Store", "SumStore", "ParamStore", "OptimizerStore", "optimizer_spec", "round_settings",
           "pack_round", "STORES",
           "register_store", "Kind", "Op"]
