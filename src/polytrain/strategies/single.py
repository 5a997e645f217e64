"""``single``: one process, no distribution; the reference every strategy is checked against."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..launch.layout import Layout
from .base import NoOptions, Strategy, register

__all__ = ["Single"]


@register
class Single(Strategy[NoOptions]):
    """Train in this process alone. Its ``final.pt`` is what synchronous strategies must match."""

    name = "single"
    resumes_on_other_layouts = True  # every worker holds the whole model and optimizer
    distributed = False
    copyable_model = True  # (no hooks at all)

    @classmethod
    def check_layout(cls, layout: Layout, options: NoOptions) -> None:
        if layout.world_size > 1:
            raise ConfigError(
                f"strategy 'single' trains in one process (got {layout.describe()})",
                "leave out --workers, --nodes and --servers, or pick --strategy ddp")

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        return model, optimizer

    @property
    def replica(self) -> tuple[int, int]:
        return 0, 1
