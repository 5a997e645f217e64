"""polytrain: hybrid distributed training on torch.distributed.

BytePS, Herring, Parallax, FastMoE, HetPipe and PipeTransformer behind one API::

    import polytrain

    ctx = polytrain.init()                       # join the run; servers serve here
    model, opt = polytrain.distribute(model, opt, strategy="ddp")
    for x, y in batches:
        x = polytrain.shard(x, ctx.worker_index, ctx.num_workers)
        ...                                      # the plain PyTorch loop

    trainer = polytrain.distribute(model, opt, strategy="hetpipe", loss_fn=loss_fn)
    loss = trainer.step(x, y)                    # the step API: any strategy, pipelines too

    polytrain.launch(main, workers=4, nodes=2)   # run main() in 4 local processes

    polytrain.save("out/checkpoints", trainer, step=100)   # collective; load() resumes
"""

from . import log as _log  # noqa: F401 - configures the "polytrain" logger
from .checkpoint import CheckpointError, load, save
from .config import TrainConfig
from .data import shard
from .errors import (
    ClosedByTimeout,
    CommError,
    CommTimeout,
    ConfigError,
    LaunchError,
    PeerLost,
    PolytrainError,
)
from .launch import Layout, launch
from .runtime import Context, current, init, is_initialized
from .strategies import (
                         Strategy,
                         Trainer,
                         distribute,
                         full_state_dict,
                         get_strategy,
                         register,
                         strategy_names,
                         strategy_of,
)

__version__ = "0.1.0"

__all__ = ["init", "launch", "distribute", "shard", "current", "is_initialized", "Context",
           "Layout", "TrainConfig", "Strategy", "Trainer", "register", "get_strategy",
           "strategy_names",
           "strategy_of", "full_state_dict", "save", "load", "CheckpointError", "PolytrainError",
           "ConfigError", "LaunchError",
           "CommError", "CommTimeout", "PeerLost", "ClosedByTimeout", "__version__"]
