"""The summation / parameter service: server processes, stores and the worker-side client."""

from .client import Pending, PSClient, SumClient
from .placement import Placement, balanced
from .protocol import Kind, Op
from .server import Server
from .store import STORES, Declaration, ParamStore, Store, SumStore, register_store

__all__ = ["Server", "PSClient", "SumClient", "Pending", "Placement", "balanced", "Declaration",
           "Store", "SumStore", "ParamStore", "STORES", "register_store", "Kind", "Op"]
