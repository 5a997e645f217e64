"""``byteps.torch.parallel``: ``from polytrain.byteps.parallel import DistributedDataParallel``."""

from ..strategies.byteps import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
