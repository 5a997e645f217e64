"""BytePS's user API: ``import polytrain.byteps as bps`` where scripts used ``byteps.torch``.

Example::

    import polytrain.byteps as bps

    bps.init()                                        # servers serve inside this call
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bps.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=bps.Compression.fp16)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    ...
    mean = bps.push_pull(metric, name="metric")      # averaged over every worker

docs/from-byteps.md maps BytePS's calls and environment variables.
"""

from ..strategies.byteps import (
    BytePSOptions,
    Compression,
    DistributedDataParallel,
    DistributedOptimizer,
    PushPullHandle,
    broadcast_optimizer_state,
    broadcast_parameters,
    declare,
    init,
    local_rank,
    local_size,
    optimal_shares,
    plan_placement,
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
from . import parallel

__all__ = ["init", "shutdown", "size", "rank", "local_rank", "local_size", "push_pull",
           "push_pull_async", "push_pull_inplace", "push_pull_async_inplace", "poll",
           "synchronize", "declare", "PushPullHandle", "broadcast_parameters",
           "broadcast_optimizer_state", "DistributedOptimizer", "DistributedDataParallel",
           "Compression", "BytePSOptions", "optimal_shares", "plan_placement", "parallel"]
