"""``ddp``: torch's own DistributedDataParallel: the peer every method is measured by."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from ..moe.checkpoint import moe_layers
from ..ps.grads import as_wrapped, check_as_wrapped
from .base import Strategy, register
from .checks import first_copy
from .synced import check_still_frozen

__all__ = ["DDP", "DDPOptions"]

# torch's DDP error at the forward after a backward that left parameters without gradients.
_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """Options of ``--strategy ddp``."""

    find_unused_parameters: bool = field(default=False, metadata={
        "help": "ddp: allow parameters that get no gradient in a step (torch's option of "
                "the same name; it costs a walk of the graph every step; on by itself for a "
                "model with MoE layers)"})


class _DDP(DistributedDataParallel):
    """torch's DDP whose error for parameters left without gradients names them, and that
    refuses a parameter frozen when it was built and unfrozen since, or one converted or
    moved since (its buckets were laid out for the dtype and device of the wrap)."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        # The parameters DDP reduces, in its order (its error gives indices into this list,
        # fixed now: requires_grad changed later does not change it).
        ignored = set(getattr(self, "parameters_to_ignore", ()))
        seen: set[int] = set()
        self._reduced_names: list[str] = []
        #: Frozen at the wrap: DDP reduces none of their gradients (check_still_frozen).
        self._frozen: list[tuple[str, nn.Parameter]] = []
        reduced: list[tuple[str, nn.Parameter]] = []
        for prefix, sub in module.named_modules():
            for name, p in sub.named_parameters(recurse=False):
                full = f"{prefix}.{name}" if prefix else name
                if full not in ignored and id(p) not in seen:
                    seen.add(id(p))
                    if p.requires_grad:
                        self._reduced_names.append(full)
                        reduced.append((full, p))
                    else:
                        self._frozen.append((full, p))
        #: The reduced parameters, with the dtype and device of their buckets (check_as_wrapped).
        self._as_wrapped = as_wrapped(reduced)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_still_frozen(self._frozen, "set requires_grad=True before distribute() on every "
                                         "parameter that will train, and pass find_unused_"
                                         "parameters=True to freeze some for a while after it")
        if torch.is_grad_enabled():  # an evaluation under torch.no_grad() sums nothing
            check_as_wrapped(self._as_wrapped)
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            if _UNFINISHED not in str(e):
                raise
            names = self._reduced_names
            found = _INDICES.search(str(e))
            unused = ([names[int(i)] for i in found.group(1).split() if int(i) < len(names)]
                      if found else [])
            which = (f"parameters {', '.join(repr(n) for n in unused[:5])}"
                     f"{' and more' if len(unused) > 5 else ''}" if unused else "some parameters")
            if self.find_unused_parameters:
                raise ConfigError(
                    f"{which} got no gradient in the last backward, although "
                    f"--find-unused-parameters is on: ddp could not trace them from the "
                    f"model's outputs", "make the loss depend on the model's outputs (not "
                    "detached copies), and return tensors from forward") from None
            raise ConfigError(
                f"{which} got no gradient in the last backward, and ddp waits for every "
                f"parameter's gradient", "pass --find-unused-parameters (find_unused_parameters"
                "=True to distribute()), or make every parameter take part in the loss, or "
                "set requires_grad=False before distribute() on what you do not train") from None


@register
class DDP(Strategy[DDPOptions]):
    """Data parallelism with :class:`torch.nn.parallel.DistributedDataParallel` over the workers.

    Its bytes move inside torch, so the traffic meter records the cost of a
    ring all-reduce of the gradients (2(p-1)/p of them per worker per step)
    marked ``estimated``.
    """

    name = "ddp"
    Options = DDPOptions
    resumes_on_other_layouts = True  # every worker holds the whole model and optimizer

    def wrap(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        ctx = self.ctx
        assert ctx is not None
        model.to(ctx.device)
        if ctx.device.type == "cuda" and any(p.device.type != "cuda" for p in model.parameters()):
            raise ConfigError("ddp on CUDA needs every parameter on the GPU",
                              "move the model with model.to('cuda') before distribute()")
        if not any(p.requires_grad for p in model.parameters()):
            # torch's DDP cannot be built without one (a RuntimeError and its traceback).
            # herring's and byteps' wrappers can, and refuse a parameter unfrozen later;
            # ddp would have to leave the model unwrapped, and such a parameter unsynced.
            count = sum(1 for _ in model.parameters())
            raise ConfigError(f"ddp has no gradient to all-reduce: no parameter of the model "
                              f"requires one (it has {count}, none with requires_grad=True)",
                              "set requires_grad=True on the parameters to train before "
                              "distribute() (a model that trains nothing needs no ddp)")
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # An MoE expert that no token chose has no gradient (None) in one process; DDP without
        # find_unused_parameters writes zeros there, which Adam then steps on. With it, a
        # parameter no worker used keeps None, as in one process (torch's reducer).
        find_unused = self.options.find_unused_parameters or bool(moe_layers(model))
        # Its construction copies worker 0's parameters and buffers in messages of up to
        # 250 MiB (config.check_link times them).
        nbytes = sum(t.numel() * t.element_size() for t in (*model.parameters(),
                                                            *model.buffers()))
        with first_copy(ctx, f"torch's DDP's copy of worker 0's model ({nbytes:,} bytes of "
                             f"parameters and buffers)"):
            wrapped = _DDP(model, device_ids=device_ids, process_group=ctx.groups.workers,
                           find_unused_parameters=find_unused)
        sparse = {id(m.weight) for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                         if p.requires_grad and id(p) not in sparse)
        workers = list(ctx.topology.workers)
        meter = ctx.meter

        def record(module: nn.Module, args: Any) -> None:
            # DDP all-reduces every dense gradient once per backward of a forward that syncs.
            if torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True):
                meter.record_ring_allreduce(workers, grad_bytes)
            # And before such a forward it broadcasts worker 0's buffers (broadcast_buffers,
            # as the drop-ins' SyncedModule does): a BatchNorm's statistics cross machines.
            if wrapped.will_sync_module_buffers():
                meter.record_broadcast(workers, workers[0], sum(
                    b.numel() * b.element_size() for b in wrapped.modules_buffers))

        def record_rows(p: torch.Tensor) -> None:
            # gloo gathers every worker's sparse gradient (its rows and their indices) once
            # the backward that syncs has produced it: bytes that depend on the rows touched.
            grad = p.grad
            if grad is not None and grad.is_sparse and wrapped.require_backward_grad_sync:
                rows = grad.coalesce()  # as gloo sends it: each row touched once
                meter.record_ring_allgather(workers, rows._values().nbytes
                                            + rows._indices().nbytes)

        wrapped.register_forward_pre_hook(record)
        for p in model.parameters():
            if id(p) in sparse and p.requires_grad:
                p.register_post_accumulate_grad_hook(record_rows)
        return wrapped, optimizer
