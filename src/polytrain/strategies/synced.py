"""What the drop-ins for ``torch.nn.parallel.DistributedDataParallel`` share.

BytePS's and Herring's ``DistributedDataParallel`` differ only in how they
plan their gradient sums (fusion, placement, compression); both then hold a
:class:`~polytrain.ps.grads.GradientSync` and show torch DDP's surface:
``forward`` (worker 0's buffers first, when torch's DDP would broadcast them), ``no_sync()``,
a bare ``state_dict`` (without ``module.``, at whatever depth the wrapper is nested).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _to_kwargs

from ..errors import ConfigError
from ..moe.checkpoint import moe_layers
from ..ps.grads import GradientSync, check_as_wrapped
from ..runtime import Context
from ..wrapper import Wrapper
from .checks import broadcast_module, check_same_values, check_worker_models

__all__ = ["SyncedModule", "check_still_frozen", "input_device", "keep_missing_for"]


def input_device(device_ids: Sequence[Any] | None, module: nn.Module) -> torch.device | None:
    """Where torch's DDP moves the forward's inputs given ``device_ids``: ``device_ids[0]``
    (an index of the module's device type, or a device), or None: none given, or a CPU
    device (one per machine, where a move would only copy the inputs). More than one device
    is refused, as torch's DDP refuses it."""
    if not device_ids:
        return None
    if len(device_ids) > 1:
        raise ConfigError(f"device_ids holds one device, this process's, as torch's DDP takes "
                          f"it (got {list(device_ids)})",
                          "pass device_ids=[local_rank], or leave it out")
    first = device_ids[0]
    if isinstance(first, (str, torch.device)):
        device = torch.device(first)
    else:
        param = next(module.parameters(), None)
        device = torch.device("cuda" if param is None else param.device.type, int(first))
    return None if device.type == "cpu" else device


def keep_missing_for(sync: GradientSync, model: nn.Module, *, find_unused: bool = False
                     ) -> None:
    """Leave ``.grad`` None where no worker had one (as torch's reducer does with
    ``find_unused_parameters``, at about its cost: a flag per parameter summed a step, on a
    key of its own beside the gradients'), when ``find_unused`` or on models with MoE layers
    (an expert no token chose: one process gives it none), unless some buckets are
    compressed. Otherwise such a gradient is summed as zeros, which Adam steps on with its
    momentum."""
    sync.keep_missing = (find_unused or bool(moe_layers(model))) and not sync.packed


def check_still_frozen(frozen: Sequence[tuple[str, nn.Parameter]],
                       hint: str = "set requires_grad before wrapping the model, or close() "
                                   "the wrapped model and wrap its .module again") -> None:
    """Refuse a parameter of ``frozen`` (those frozen when the model was wrapped) that
    requires a gradient now: nothing sums its gradients, so each worker would step on its
    own and the copies drift apart. ``hint``: what the wrapper's user can do."""
    for name, p in frozen:
        if p.requires_grad:
            raise ConfigError(
                f"parameter {name!r} requires a gradient, but did not when the model was "
                f"wrapped: its gradients would not be summed, and each worker's copy "
                f"would drift apart", hint)


def _bare_keys(module: nn.Module, state: dict[str, Any], prefix: str,
               local_metadata: dict[str, Any]) -> None:
    # state_dict's post-hook: the wrapped model's keys without "module.". Its metadata (the
    # modules' versions, which a load reads) under both names: a load back here reads
    # "module."'s, into a bare model the bare ones.
    inner = prefix + "module."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner):]] = state.pop(key)
    metadata = getattr(state, "_metadata", {})  # keyed by module path: "net.module.a"
    for key in [k for k in metadata if (k + ".").startswith(inner)]:
        metadata[(prefix + key[len(inner):]).removesuffix(".")] = metadata[key]


def _wrapped_keys(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any,
                  strict: bool, missing: list[str], unexpected: list[str],
                  errors: list[str]) -> None:
    # load_state_dict's pre-hook: the bare keys the post-hook made, "module." again. (torch
    # calls it at every depth; an override of load_state_dict only at the top.)
    for key in [k for k in state if k.startswith(prefix)]:
        state[prefix + "module." + key[len(prefix):]] = state.pop(key)
    module.__dict__["_loading"] = (prefix, errors)  # for _bare_names, after the load


def _bare_names(module: nn.Module, incompatible: Any) -> None:
    # load_state_dict's post-hook: the keys its lists and messages name, bare again (a
    # strict=False load returned "module.1.bias" for a state whose key is "1.bias").
    prefix, errors = module.__dict__.pop("_loading", ("", []))
    inner = prefix + "module."
    for names in (incompatible.missing_keys, incompatible.unexpected_keys):
        names[:] = [prefix + n[len(inner):] if n.startswith(inner) else n for n in names]
    errors[:] = [e.replace(f"for {inner}", f"for {prefix}")
                 .replace(f'named "{inner}', f'named "{prefix}') for e in errors]


class SyncedModule(Wrapper):
    """A model whose gradients :attr:`sync` sums over the workers during backward.

    The constructor checks that every worker built the same model (a clear
    error naming the first tensor that differs) and passed the same
    ``broadcast_buffers`` and options ``same`` (name -> value; named "<class>
    option <name>"), and copies worker 0's parameters, and its buffers with
    ``broadcast_buffers`` (or ``init_buffers``), to every worker (unless not
    ``init_sync``), as torch's DDP; the subclass then sets
    :attr:`sync` from :meth:`trained`'s parameters. The forward moves its
    inputs to ``device_ids[0]`` where given (:func:`input_device`).
    """

    sync: GradientSync

    def __init__(self, module: nn.Module, ctx: Context, *, broadcast_buffers: bool | None,
                 method: str, device_ids: Sequence[Any] | None = None, init_sync: bool = True,
                 init_buffers: bool | None = None, same: Mapping[str, Any] | None = None
                 ) -> None:
        super().__init__()
        device = input_device(device_ids, module)  # refused before the wrap's collectives
        if not ctx.is_worker:
            raise ConfigError(f"rank {ctx.rank} is a server; {method} trains on workers",
                              "wrap the model on workers only (servers serve inside init())")
        check_worker_models(ctx, module)  # as distribute(): the drop-in's way in too
        # torch's DDP reads None as True (its default): buffers broadcast.
        self.broadcast_buffers = broadcast_buffers is None or bool(broadcast_buffers)
        # Options whose difference would leave the workers' sums or broadcasts out of step.
        who = type(self).__name__
        check_same_values(ctx, {f"{who} option {name}": value for name, value in
                                {"broadcast_buffers": self.broadcast_buffers,
                                 **(same or {})}.items()},
                          f"pass the same options to {who} on every worker")
        self.module = module
        if init_sync:  # False: the user vouches that every worker starts from the same weights
            # The buffers too with ``init_buffers``, by default only with broadcast_buffers,
            # as torch's DDP: without it they are each worker's own (rank-local), at the wrap
            # as at every forward (BytePS's DDP copies its whole state_dict whatever it says).
            broadcast_module(ctx, module, buffers=self.broadcast_buffers
                             if init_buffers is None else init_buffers)
        #: Parameters frozen at the wrap: they have no sum (:meth:`_check_trained`).
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self.ctx = ctx
        #: Whether the next forward broadcasts the buffers: torch DDP's rule (its
        #: ``require_forward_param_sync``), set by each forward (see :meth:`forward`).
        self.require_forward_param_sync = True
        #: Where the forward's inputs are moved (torch DDP's ``device_ids[0]``), or None.
        self.device = device
        #: Whether :meth:`close` removed the gradient hooks (a forward with gradients on is
        #: then refused).
        self.closed = False
        self._register_state_dict_hook(_bare_keys)
        self._register_load_state_dict_pre_hook(_wrapped_keys, with_module=True)
        self.register_load_state_dict_post_hook(_bare_names)

    def trained(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters whose gradients are summed: those that require one."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Evaluating (no gradients) is fine; a forward whose backward could train is not.
        if self.closed and torch.is_grad_enabled() and self.trained():
            raise ConfigError(f"this {type(self).__name__} was closed (close() removed its "
                              f"gradient hooks): a forward with gradients on now would train "
                              f"this worker's copy alone", "close() it after the last step; "
                              "evaluate it under torch.no_grad(), or train its .module, or "
                              "wrap that again")
        if self.sync.backward_unfinished:
            raise ConfigError(
                "the last backward pass on this worker raised after some of its gradients had "
                "been sent to be summed, so the workers' sums are out of step (the others "
                "wait for the rest of this worker's)", "let that error stop the run (a batch "
                "skipped on one worker, after an out-of-memory error say, cannot be summed); "
                "resume from a checkpoint")
        self._check_trained()
        if self.broadcast_buffers and self.require_forward_param_sync \
                and self.ctx.num_workers > 1:
            workers = self.ctx.topology.workers
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b.data, src=workers[0], group=self.ctx.groups.workers)
                    self.ctx.meter.record_broadcast(workers, workers[0],
                                                    b.numel() * b.element_size())
        if self.device is not None and (args or kwargs):
            moved, moved_kwargs = _to_kwargs(args, kwargs, self.device, False)
            args, kwargs = moved[0], moved_kwargs[0]
        out = self.module(*args, **kwargs)
        # As torch's DDP: only a forward after one that trains and syncs (gradients on,
        # outside no_sync()) broadcasts. A worker that evaluates alone under no_grad() then
        # broadcasts once, the broadcast its next training forward would have made, and the
        # workers' broadcasts stay in step (at every forward, it made broadcasts the others
        # never matched: a gloo timeout).
        self.require_forward_param_sync = torch.is_grad_enabled() and self.sync.enabled
        return out

    def _check_trained(self) -> None:
        """Refuse a parameter unfrozen since the wrap (:func:`check_still_frozen`), or
        converted or moved since (:func:`check_as_wrapped`; in a forward that may train: an
        evaluation under ``torch.no_grad()`` sums nothing). (One frozen since keeps
        ``.grad`` None, as in one process: :meth:`GradientSync.synchronize`.)"""
        check_still_frozen(self._frozen)
        if torch.is_grad_enabled() and not self.closed:  # else no gradient is summed
            check_as_wrapped(self.sync.as_wrapped)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the first one after syncs them.
        (Read at the backward, as BytePS's DDP reads it: torch's DDP reads it at the forward,
        so keep a forward and its backward on the same side.)"""
        before = self.sync.enabled
        self.sync.enabled = False
        try:
            yield
        finally:
            self.sync.enabled = before

    def hidden_fraction(self) -> float | None:
        """The share of communication time backward hid (steps after the first)."""
        return self.sync.hidden_fraction()

    def close(self) -> None:
        """Remove the gradient hooks; a forward with gradients on is refused from then on."""
        self.closed = True
        self.sync.close()
