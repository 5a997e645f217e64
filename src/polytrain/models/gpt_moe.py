"""``gpt-moe``: polytrain's GPT with a mixture of experts as every block's feed-forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import at_least
from ..moe import MoE, gate_names, make_gate, moefy
from .gpt import GPT, _init_weights

__all__ = ["GPTMoEOptions", "gpt_moe", "resolved_options"]


@dataclass(frozen=True, kw_only=True)
class GPTMoEOptions:
    """The options that make a gpt-moe model (each a ``polytrain train`` flag)."""

    experts: int = field(default=8, metadata={
        "help": "experts per MoE layer, in all (default 8)", "metavar": "E"})
    top_k: int | None = field(default=None, metadata={
        "help": "experts per token (default 2; switch 1)", "metavar": "K"})
    gate: str = field(default="naive", metadata={
        "help": "naive, noisy, gshard or switch (default naive)", "choices": gate_names(),
        "metavar": "NAME"})
    capacity_factor: float | None = field(default=None, metadata={
        "help": "expert capacity factor while training (default: the gate's; gshard 1.2, "
                "switch 1.25, naive and noisy none)", "metavar": "C"})
    dropless: bool = field(default=False, metadata={"help": "never drop tokens for capacity"})
    balance_loss: float | None = field(default=None, metadata={
        "help": "weight of the gate's balance loss (default 0.01; naive has none)",
        "metavar": "W"})
    z_loss: float = field(default=0.0, metadata={
        "help": "weight of the router z-loss (default 0: off)", "metavar": "W"})
    moe_every: int = field(default=1, metadata={
        "help": "an MoE feed-forward in every n-th block (default 1: all)", "metavar": "N"})


def gpt_moe(*, vocab: int = 256, seq_len: int = 64, d_model: int = 128, layers: int = 4,
            heads: int = 4, d_hidden: int | None = None, experts: int = 8,
            top_k: int | None = None, gate: str = "naive", capacity_factor: float | None = None,
            dropless: bool = False, balance_loss: float | None = None, z_loss: float = 0.0,
            moe_every: int = 1) -> nn.Module:
    """GPT (see :class:`~polytrain.models.GPT`) with :func:`~polytrain.moe.moefy` applied.

    Every expert starts as GPT initialises a linear layer (normal, std 0.02; zero
    biases), and with all experts local, so ``--strategy single`` and
    ``--strategy moe`` build the same model from the same seed.

    Example::

        model = gpt_moe(seq_len=32, d_model=64, layers=2, experts=4, gate="gshard")
    """
    at_least("--moe-every", moe_every, "pass --moe-every 1 (every block) or 2")  # its flag
    model = GPT(vocab=vocab, seq_len=seq_len, d_model=d_model, layers=layers, heads=heads,
                d_hidden=d_hidden)
    moefy(model, experts, every=moe_every, top_k=top_k, gate=gate,
          capacity_factor=capacity_factor, dropless=dropless, balance_weight=balance_loss,
          z_loss_weight=z_loss)
    for module in model.modules():
        if isinstance(module, MoE):
            module.apply(_init_weights)  # the gate and every expert, as GPT starts a Linear
    return model


def resolved_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (every option of :func:`gpt_moe`) with the values its gate gives those
    left None: ``top_k``, ``capacity_factor`` and ``balance_loss`` are the gate's defaults
    when not given, so a run that gives one at that default builds the same model."""
    with torch.device("meta"):  # a gate of the run's experts, to read its values
        gate = make_gate(options["gate"], 1, options["experts"], top_k=options["top_k"],
                         capacity_factor=options["capacity_factor"],
                         dropless=options["dropless"], balance_weight=options["balance_loss"])
    return {**options, "top_k": gate.top_k, "capacity_factor": gate.capacity_factor,
            "balance_loss": gate.balance_weight}
