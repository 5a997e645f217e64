"""Herring: balanced fusion buffers sharded over servers on every machine, on the one engine."""

from .ddp import DEFAULT_BUCKET_CAP_MB, DistributedDataParallel
from .hook import HerringHookState, herring_hook
from .options import HerringOptions
from .plan import HerringPlan, herring_traffic, plan_herring
from .strategy import Herring

__all__ = ["Herring", "HerringOptions", "DistributedDataParallel", "HerringHookState",
           "herring_hook", "HerringPlan", "plan_herring", "herring_traffic",
           "DEFAULT_BUCKET_CAP_MB"]
