"""Herring's user API: ``from polytrain.herring import DistributedDataParallel`` where scripts
used ``torch.nn.parallel.DistributedDataParallel``, or torch's DDP with :func:`herring_hook`.

Example::

    import polytrain
    from polytrain.herring import DistributedDataParallel as DDP

    ctx = polytrain.init()
    model = DDP(model, bucket_cap_mb=25)        # gradients summed on every machine's server
"""

from .strategies.herring import (
    DistributedDataParallel,
    HerringHookState,
    HerringOptions,
    herring_hook,
    herring_traffic,
    plan_herring,
)

__all__ = ["DistributedDataParallel", "HerringHookState", "herring_hook", "HerringOptions",
           "plan_herring", "herring_traffic"]
