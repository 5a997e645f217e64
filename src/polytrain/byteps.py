"""BytePS's user API: ``import polytrain.byteps as bps`` where scripts used ``byteps.torch``.

Example::

    import polytrain, polytrain.byteps as bps

    ctx = polytrain.init()
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bps.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                   named_parameters=model.named_parameters())
    bps.broadcast_optimizer_state(opt, root_rank=0)
    ...
    mean = bps.push_pull(metric, name="metric")      # averaged over every worker
"""

from .strategies.byteps import (
    BytePSOptions,
    DistributedOptimizer,
    PushPullHandle,
    broadcast_optimizer_state,
    broadcast_parameters,
    local_rank,
    local_size,
    optimal_shares,
    plan_placement,
    push_pull,
    push_pull_async,
    rank,
    size,
    synchronize,
)

__all__ = ["push_pull", "push_pull_async", "synchronize", "PushPullHandle",
           "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
           "BytePSOptions", "optimal_shares", "plan_placement", "size", "rank", "local_rank",
           "local_size"]
