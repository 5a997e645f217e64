"""The byteps.torch calls that need no servers: init twice, calls before init, Compression,
arguments of the wrong kind."""

import numpy
import pytest
import torch
from torch import nn

import polytrain
import polytrain.byteps as bps
from polytrain import ConfigError
from polytrain.strategies.byteps.optimizer import DistributedOptimizer as SyncOptimizer
from polytrain.strategies.byteps.optimizer import (
    check_compress_momentum,
    checked_options,
    named_params_of,
)
from tests.harness import refused, spawn


def test_a_call_before_init_says_so():
    assert not polytrain.is_initialized()
    with pytest.raises(ConfigError, match=r"bps\.size\(\) was called before bps\.init\(\)"):
        bps.size()
    with pytest.raises(ConfigError, match=r"bps\.rank\(\) was called before bps\.init\(\)"):
        bps.rank()


def test_compression_members_follow_the_names_rules():
    assert bps.Compression.none is None
    assert bps.Compression.fp16.spec() == "fp16"
    assert bps.Compression.topk(0.01).spec() == "topk:0.01"
    assert bps.Compression.dithering(4, natural=True).spec() == "dithering:4:natural"
    with pytest.raises(ConfigError, match="topk:0: K must be"):
        bps.Compression.topk(0)
    with pytest.raises(ConfigError, match="dithering:1"):
        bps.Compression.dithering(1)


def init_twice():
    bps.init()
    try:
        bps.init()
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_init_twice_is_refused():
    [message] = spawn(init_twice, workers=1)
    assert message == ("bps.init() was called twice in this process. HINT: call bps.init() "
                       "once, at the start of the script")


def test_arguments_of_the_wrong_kind_are_refused_naming_them():
    # Symptom: each of these failed deep inside with a raw Python error: 'function' object
    # has no attribute 'spec', too many values to unpack, list indices must be integers,
    # a TypeError in the engine's queue, 'numpy.ndarray' object has no attribute
    # 'is_floating_point'; backward_passes_per_step=1.5 was taken, and a later refusal
    # said "1.5 are summed". Cause: the drop-in's arguments were not checked by kind at
    # its edge. Checked before bps.init(): no process is needed.
    model = nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    adan = torch.optim.Adam(model.parameters())  # as timm's Adan: three betas
    adan.param_groups[0]["betas"] = (0.98, 0.92, 0.99)
    said = {
        "uncalled": refused(lambda: checked_options("DistributedOptimizer",
                                                    bps.Compression.topk, {})),
        "number": refused(lambda: checked_options("DistributedOptimizer", 42, {})),
        "mapped": refused(lambda: checked_options("DistributedDataParallel",
                                                  {"weight": "onebit", "bias": 1.0}, {})),
        "bare": refused(lambda: named_params_of(sgd, model.parameters())),
        "passes": refused(lambda: SyncOptimizer(sgd, engine=None, backward_passes_per_step=1.5)),
        "root": refused(lambda: bps.broadcast_parameters(model.state_dict(), root_rank=1.0)),
        "root_state": refused(lambda: bps.broadcast_optimizer_state(sgd, root_rank="1")),
        "priority": refused(lambda: bps.push_pull(torch.ones(2), priority="high")),
        "numpy": refused(lambda: bps.push_pull(numpy.ones(2), name="x")),
        # Each variant names itself (the diff's review: every one said push_pull()).
        "inplace": refused(lambda: bps.push_pull_inplace(torch.ones(2), priority="high")),
        "async": refused(lambda: bps.push_pull_async_inplace(numpy.ones(2))),
        # The diff's review: "too many values to unpack" from Adan's three betas.
        "three_betas": refused(lambda: check_compress_momentum(adan, 0.9)),
    }
    assert said == {
        "uncalled": "DistributedOptimizer compression must be a compressor, a compressor's "
                    "name or None (got Compression.topk, a function). HINT: call it with its "
                    "argument: bps.Compression.topk(0.01), say",
        "number": "DistributedOptimizer compression must be a compressor, a compressor's name "
                  "or None (got 42, an int). HINT: pass a bps.Compression member "
                  "(bps.Compression.fp16, say), a name such as 'topk:0.01', or a dict of them "
                  "by parameter name",
        "mapped": "DistributedDataParallel compression['bias'] must be a compressor, a "
                  "compressor's name or None (got 1.0, a float). HINT: pass a bps.Compression "
                  "member (bps.Compression.fp16, say), a name such as 'topk:0.01', or a dict "
                  "of them by parameter name",
        "bare": "named_parameters takes (name, parameter) pairs, and item 0 is a Parameter. "
                "HINT: pass model.named_parameters(), or leave named_parameters out (the "
                "parameters are then named by position)",
        "passes": "backward_passes_per_step must be a whole number (got 1.5). HINT: pass 1, "
                  "or the passes per step",
        "root": "broadcast_parameters() root_rank must be a whole number (got 1.0). HINT: "
                "pass root_rank=1",
        "root_state": "broadcast_optimizer_state() root_rank must be a whole number (got "
                      "'1'). HINT: pass root_rank as a whole number",
        "priority": "push_pull() priority must be a whole number (got 'high'). HINT: pass "
                    "priority as a whole number",
        "numpy": "push_pull() takes a torch.Tensor (got a numpy.ndarray). HINT: pass "
                 "torch.as_tensor(...) of it (torch.from_numpy for a numpy array)",
        "inplace": "push_pull_inplace() priority must be a whole number (got 'high'). HINT: "
                   "pass priority as a whole number",
        "async": "push_pull_async_inplace() takes a torch.Tensor (got a numpy.ndarray). HINT: "
                 "pass torch.as_tensor(...) of it (torch.from_numpy for a numpy array)",
        "three_betas": "compress_momentum 0.9 puts a momentum on the gradients before "
                       "compression, and Adam has momentum 0.98 of its own (betas[0]): the "
                       "update would have two. HINT: give the optimizer betas=(0.0, 0.92, "
                       "0.99) (compress_momentum takes the place of betas[0]), or leave "
                       "compress_momentum out",
    }
