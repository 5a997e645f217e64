"""Wrappers: modules that run the model they hold as ``.module`` (torch's, polytrain's),
and the model inside one; shared by every layer (imports torch only)."""

from __future__ import annotations

from torch import nn

__all__ = ["Wrapper", "unwrap"]


class Wrapper(nn.Module):
    """A module that runs the model it holds as ``module``, as torch's DDP does (a strategy's
    wrapper, a drop-in DDP, an evaluation model): :func:`unwrap` gives that model."""

    module: nn.Module


def unwrap(model: nn.Module) -> nn.Module:
    """The model a wrapper holds (:class:`Wrapper`, torch's DDP or DataParallel), else
    ``model`` itself.

    A wrapper is known by its class, never by an attribute's name: a model's own child
    named ``module`` (an EMA's, a loss wrapper's) is part of it (unwrapping it left the
    model's other layers out of its state, silently).
    """
    if isinstance(model, (Wrapper, nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    return model
