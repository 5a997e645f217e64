"""Mixture of experts with expert parallelism (FastMoE, arXiv 2103.13262), on CPU and GPU.

Layered, each layer usable alone:

- :mod:`~polytrain.moe.dispatch` and :mod:`~polytrain.moe.exchange`: route tokens to
  experts across an expert-parallel group and back (autograd through all of it);
- :class:`MoE`: the layer (gate, dispatch, experts, combine);
- :mod:`~polytrain.moe.gates`: naive, noisy, gshard, switch; capacity, z-loss, dropless;
- :func:`aux_loss`: every gate's auxiliary loss, for the training loss;
- :func:`moefy`: MoE feed-forward blocks in polytrain's GPT and torch transformer layers;
- :mod:`~polytrain.moe.checkpoint`: checkpoints that load on any expert-parallel size.

Example::

    from polytrain.moe import MoE, aux_loss
    layer = MoE(512, num_experts=32, top_k=2, gate="gshard")
    loss = task_loss(model(x), y) + aux_loss(model)
"""

from .aux import aux_loss
from .checkpoint import full_state_dict, load_sharded, local_state_dict, save_sharded
from .dispatch import moe_apply
from .exchange import ExpertGroup
from .gates import Gate, gate_names, make_gate
from .layer import MoE
from .moefy import moefy

__all__ = ["MoE", "aux_loss", "moefy", "moe_apply", "ExpertGroup", "Gate", "make_gate",
           "gate_names", "full_state_dict", "local_state_dict", "save_sharded", "load_sharded"]
