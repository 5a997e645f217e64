"""The training loop behind ``polytrain train``: one function per process, metrics, progress."""

from .loop import make_optimizer, train
from .metrics import build_metrics
from .progress import Progress
from .run import run_config

__all__ = ["train", "run_config", "make_optimizer", "build_metrics", "Progress"]
