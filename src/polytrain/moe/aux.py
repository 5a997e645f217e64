"""The auxiliary losses of every gate in a model, collected for the training loss."""

from __future__ import annotations

import torch
from torch import nn

from .gates import Gate

__all__ = ["aux_loss"]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The weighted sum of every gate's balance and z-losses from the model's last forward.

    FastMoE leaves users to collect these by hand; here one call does it for
    the whole model (wrapped or not). A model whose gates have no auxiliary
    loss gives an exact zero, so adding it changes nothing. Each gate gives its
    last call's loss: a layer applied twice in one forward (a shared block) adds
    its second call's alone.

    Example::

        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + aux_loss(model)
        loss.backward()
    """
    losses = [m.loss for m in model.modules() if isinstance(m, Gate) and m.loss is not None]
    if not losses:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return torch.zeros((), device=device)
    total = losses[0]
    for extra in losses[1:]:
        total = total + extra
    return total
