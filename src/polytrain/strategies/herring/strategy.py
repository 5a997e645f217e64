"""``herring``: the strategy that ``polytrain train --strategy herring`` and ``distribute`` use."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...launch.layout import Layout
from ...runtime import Context
from ..base import register
from ..checks import check_dense_gradients
from ..served import ServedStrategy
from .ddp import DistributedDataParallel
from .options import HerringOptions

__all__ = ["Herring"]


@register
class Herring(ServedStrategy[HerringOptions]):
    """Herring: balanced fusion buffers sharded over servers on every machine, hierarchical.

    Paper: Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for
    the Cloud", SC 2020. The model is wrapped in
    :class:`polytrain.herring.DistributedDataParallel`; the optimizer is the user's.

    Example::

        model, opt = polytrain.distribute(model, opt, strategy="herring")
        # polytrain train --strategy herring --workers 4 --nodes 2 --servers 2
    """

    name = "herring"
    no_colocate_means = "keeps only the dedicated servers"
    agrees_model = True  # its DistributedDataParallel checks and copies the model
    # Every worker holds the whole model and optimizer; the servers only sum.
    resumes_on_other_layouts = True
    Options = HerringOptions

    @classmethod
    def check_model(cls, model: nn.Module, layout: Layout, options: HerringOptions) -> None:
        check_dense_gradients(model, cls.name)

    def __init__(self, ctx: Context | None, options: HerringOptions) -> None:
        super().__init__(ctx, options)
        self.ddp: DistributedDataParallel | None = None
        self._check_hook: Any = None  # the optimizer's step pre-hook (no_sync's check)

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        model.to(ctx.device)
        # A parameter no worker gave a gradient keeps .grad None, as in one process: summed as
        # zeros, Adam would step on it with its momentum. It costs a flag per parameter
        # summed a step (GradientSync.keep_missing), and needs no flag of the user (ddp's
        # refusal does).
        ddp = DistributedDataParallel(model, bucket_cap_mb=self.options.bucket_cap_mb,
                                      find_unused_parameters=True,
                                      colocate=self.options.colocate, ctx=ctx)
        self.ddp = ddp
        synced = [0]

        def check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            # A backward inside no_sync() with none outside it since (even after a summed
            # one): .grad holds this worker's own gradients of it. A step inside no_sync()
            # with nothing summed since the last step: none at all.
            sync = ddp.sync
            if sync.unsynced or (not sync.enabled and sync.synced == synced[0]):
                where = "inside" if not sync.enabled else "after a backward inside"
                raise ConfigError(f"optimizer.step() {where} herring's no_sync() with no "
                                  f"gradient synchronised since: each worker would apply "
                                  f"its own gradients, and the copies would drift apart",
                                  "run the last backward of the step outside no_sync(), "
                                  "then step")
            synced[0] = sync.synced

        self._check_hook = optimizer.register_step_pre_hook(check)
        return ddp, optimizer

    def metrics(self) -> dict[str, Any]:
        if self.ddp is None:
            return {}
        sync = self.ddp.sync
        steps = sync.comm_s[1:]
        return {"overlap": {
            "hidden_fraction": sync.hidden_fraction(),
            "comm_s_per_step": sum(steps) / len(steps) if steps else None,
            "exposed_s_per_step": (sum(sync.exposed_s[1:]) / len(steps)) if steps else None,
            "note": "communication time from a step's first buffer leaving to its last sum "
                    "arriving; exposed: the part backward did not hide (the wait at its end)"},
            "plan": self.ddp.plan.describe()}

    def close(self) -> None:
        if self._check_hook is not None:  # the optimizer outlives the run's wrapping
            self._check_hook.remove()
            self._check_hook = None
        if self.ddp is not None:
            self.ddp.close()
