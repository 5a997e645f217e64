"""The training loop behind ``polytrain train``: one function per process, metrics, progress."""

from .loop import make_optimizer, train
from .metrics import build_metrics
from .progress import Progress

__all__ = ["train", "make_optimizer", "build_metrics", "Progress"]
