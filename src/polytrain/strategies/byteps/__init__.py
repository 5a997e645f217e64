"""BytePS: the unified summation-service strategy, with all-reduce and PS as special cases."""

from .api import (
    Compression,
    DistributedOptimizer,
    PushPullHandle,
    broadcast_optimizer_state,
    broadcast_parameters,
    declare,
    init,
    local_rank,
    local_size,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    rank,
    shutdown,
    size,
    synchronize,
)
from .ddp import DistributedDataParallel
from .options import BytePSOptions
from .plan import Plan, Shares, optimal_shares, plan_for, plan_placement
from .strategy import BytePS

__all__ = ["BytePS", "BytePSOptions", "Shares", "Plan", "optimal_shares", "plan_placement",
           "plan_for",
           "push_pull", "push_pull_async", "synchronize", "PushPullHandle",
           "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
           "size", "rank", "local_rank", "local_size", "init", "shutdown", "poll", "declare",
           "push_pull_inplace", "push_pull_async_inplace", "Compression",
           "DistributedDataParallel"]
