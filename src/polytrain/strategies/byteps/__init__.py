"""BytePS: the unified summation-service strategy, with all-reduce and PS as special cases."""

from .api import (
    DistributedOptimizer,
    PushPullHandle,
    broadcast_optimizer_state,
    broadcast_parameters,
    local_rank,
    local_size,
    push_pull,
    push_pull_async,
    rank,
    size,
    synchronize,
)
from .options import BytePSOptions
from .plan import Plan, Shares, optimal_shares, plan_for, plan_placement
from .strategy import BytePS

__all__ = ["BytePS", "BytePSOptions", "Shares", "Plan", "optimal_shares", "plan_placement",
           "plan_for",
           "push_pull", "push_pull_async", "synchronize", "PushPullHandle",
           "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
           "size", "rank", "local_rank", "local_size"]
