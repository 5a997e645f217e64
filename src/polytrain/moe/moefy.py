"""``moefy``: turn the feed-forward block of every transformer layer into an MoE layer."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, SupportsIndex

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, at_least
from ..layers import FeedForward
from .layer import MoE

__all__ = ["moefy", "MoEEncoderLayer", "MoEDecoderLayer"]


class MoEEncoderLayer(nn.TransformerEncoderLayer):
    """A :class:`torch.nn.TransformerEncoderLayer` whose feed-forward block is ``self.moe``.

    Made by :func:`moefy` (which swaps the class of an existing layer); the
    feed-forward block becomes ``dropout2(moe(x))``. A layer of a subclass ``Mine``
    becomes a ``MoEMine``, both this and ``Mine``: its own methods stay.
    """

    moe: MoE

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout2(self.moe(x))


class MoEDecoderLayer(nn.TransformerDecoderLayer):
    """A :class:`torch.nn.TransformerDecoderLayer` whose feed-forward block is ``self.moe``."""

    moe: MoE

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout3(self.moe(x))


_TORCH = {nn.TransformerEncoderLayer: MoEEncoderLayer, nn.TransformerDecoderLayer: MoEDecoderLayer}
_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}  # a user's subclass -> its MoE class


def _moe_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The class a moefied layer of class ``cls`` takes: ``cls``'s methods, the MoE
    feed-forward block (before, every layer became an MoEEncoderLayer, and a subclass's
    own forward was dropped silently)."""
    base: type[nn.Module] = next(moe for torch_class, moe in _TORCH.items()
                                 if issubclass(cls, torch_class))
    if cls in _TORCH:
        return base
    if cls not in _CLASSES:
        # Not importable by name: pickle and copy rebuild it from ``cls``.
        def __reduce_ex__(self: nn.Module, protocol: SupportsIndex) -> Any:
            return (_new_layer, (cls,), *super(_CLASSES[cls], self).__reduce_ex__(protocol)[2:])

        _CLASSES[cls] = type(f"MoE{cls.__name__}", (base, cls),
                             {"__module__": cls.__module__, "__reduce_ex__": __reduce_ex__})
    return _CLASSES[cls]


def _new_layer(user: type[nn.Module]) -> nn.Module:
    """An empty layer of the MoE class of ``user`` (a subclass of torch's layers), for
    pickle and copy to fill."""
    cls = _moe_class(user)
    return cls.__new__(cls)


def _check_own_block(name: str, layer: nn.Module) -> None:
    """Refuse a subclass whose own feed-forward block the MoE layer would replace."""
    torch_class = next(c for c in _TORCH if isinstance(layer, c))
    if type(layer)._ff_block is not torch_class._ff_block:  # type: ignore[attr-defined]
        raise ConfigError(f"moefy cannot replace the feed-forward block of {name!r}: its class "
                          f"{type(layer).__name__} overrides _ff_block, which the MoE layer "
                          f"would replace", "moefy layers that keep torch's _ff_block, or "
                          "call an MoE layer in your _ff_block yourself (self.moe = MoE(...))")


def _check_options(options: dict[str, Any]) -> None:
    """Refuse an option MoE lacks, naming it and MoE's options (Python's TypeError "got an
    unexpected keyword argument" came from the first layer's build)."""
    known = [n for n in inspect.signature(MoE.__init__).parameters
             if n not in ("self", "d_model", "num_experts")]
    other = [o for o in options if o not in known]
    if other:
        near = {o: difflib.get_close_matches(o, known, n=1) for o in other}
        fixes = "; ".join(f"pass {m[0]} for {o}" for o, m in near.items() if m) or \
            "pass one of MoE's options"
        raise ConfigError(f"moefy: MoE takes no option {', '.join(other)} (its options: "
                          f"{', '.join(known)})", f"{fixes}; a gate's own options go in "
                          f"gate_options")


def _like(layer: MoE, reference: torch.Tensor) -> MoE:
    return layer.to(device=reference.device, dtype=reference.dtype)


def _with_width(d_hidden: int, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the replaced block's width for the default experts (none for
    ``expert=``'s: MoE refuses a width beside them)."""
    return options if "expert" in options else {"d_hidden": d_hidden, **options}


def _is_exact_gelu(activation: object) -> bool:
    return activation is F.gelu or (isinstance(activation, nn.GELU) and
                                    activation.approximate == "none")


def _moefy_torch_layer(layer: nn.Module, num_experts: int, options: dict[str, Any]) -> None:
    linear1 = layer.linear1
    assert isinstance(linear1, nn.Linear)
    opts = _with_width(linear1.out_features, options)
    activation: Callable[[torch.Tensor], torch.Tensor] = layer.activation  # type: ignore[assignment]
    if "expert" not in opts and not _is_exact_gelu(activation):
        # The default experts are GELU's: the layer's own function, not another one.
        if isinstance(activation, nn.Module) and any(True for _ in activation.parameters()):
            raise ConfigError(f"moefy cannot give each expert the layer's activation "
                              f"{type(activation).__name__}: it has parameters, which the "
                              f"experts would share", "pass expert=... (a factory of one "
                              "expert) to moefy, or a layer with an activation without "
                              "parameters")
        hidden = opts.pop("d_hidden")
        opts["expert"] = lambda d: FeedForward(d, hidden, activation)
    moe = _like(MoE(linear1.in_features, num_experts, **opts), linear1.weight)
    for name in ("linear1", "dropout", "linear2"):
        delattr(layer, name)
    # The fused inference path reads linear1/linear2 directly; turning it off routes
    # every call through _ff_block.
    layer.activation_relu_or_gelu = 0  # type: ignore[assignment]
    layer.__class__ = _moe_class(type(layer))
    layer.moe = moe


def moefy(model: nn.Module, num_experts: int, *, every: int = 1, **options: Any) -> nn.Module:
    """Replace the feed-forward block of every ``every``-th transformer layer by an MoE layer.

    Knows polytrain's GPT (``block.mlp``) and :class:`torch.nn.TransformerEncoderLayer` /
    :class:`~torch.nn.TransformerDecoderLayer` (their ``linear1``/``linear2``
    become ``moe``; the dropout inside the old block goes, the one after it
    stays; experts apply the layer's own activation, ReLU by default in torch). The
    experts' hidden width is the replaced block's, unless ``expert=`` builds them. Works
    in place and returns the model. FastMoE's ``fmoefy`` for Megatron-LM, for
    these models.

    Example::

        model = moefy(GPT(d_model=128, layers=4), num_experts=8, top_k=2, gate="gshard")
        enc = moefy(nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4), 2), 4)

    Args:
        num_experts: experts per layer (in all). every: replace layers 0, every, 2*every, ...
        options: :class:`MoE` options (``top_k``, ``gate``, ``capacity_factor``, ``group``...).
    """
    from ..models.gpt import Block  # here: polytrain.models imports this package

    at_least("every", every, "pass every=1 or 2", whole=True)
    _check_options(options)
    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (Block, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))]
    if not layers:
        raise ConfigError(f"moefy found no transformer layer in {type(model).__name__}",
                          "pass polytrain's GPT or a model of torch.nn.TransformerEncoderLayer/"
                          "TransformerDecoderLayer")
    chosen = layers[::every]
    for name, layer in chosen:  # all before any is replaced ('MoE' has no attribute 'fc')
        block = layer.mlp if isinstance(layer, Block) else getattr(layer, "moe", None)
        if isinstance(block, MoE):
            raise ConfigError(f"moefy: the feed-forward block of {name!r} is an MoE layer "
                              f"already ({block.num_experts} experts)",
                              "moefy a model once (for other experts, build the model again "
                              "and moefy that)")
        if not isinstance(layer, Block):
            _check_own_block(name, layer)
    for _, layer in chosen:
        if isinstance(layer, Block):
            fc = layer.mlp.fc
            assert isinstance(fc, nn.Linear)
            opts = _with_width(fc.out_features, options)
            layer.mlp = _like(MoE(fc.in_features, num_experts, **opts), fc.weight)
        else:
            _moefy_torch_layer(layer, num_experts, options)
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False  # the nested fast path reads linear1 too
    return model
