"""The reference for the example scripts: BytePS's calls over torch.distributed's all-reduce.

What data parallelism computes (ddp's averaged gradients), with no summation
service: the example scripts run with ``import ... allreduce_bps as bps`` in place
of ``import polytrain.byteps as bps`` must give the same losses.
"""

import torch.distributed as dist

import polytrain

__all__ = ["init", "size", "rank", "local_rank", "Compression", "DistributedOptimizer",
           "broadcast_parameters", "broadcast_optimizer_state", "push_pull"]


class Compression:
    none = None
    fp16 = "fp16"


def init():
    polytrain.init()


def _group():
    return polytrain.current().groups.workers


def size():
    return polytrain.current().num_workers


def rank():
    return polytrain.current().worker_index


def local_rank():
    return polytrain.current().local_index


def broadcast_parameters(state, root_rank):
    for t in state.values():
        dist.broadcast(t.data, src=polytrain.current().topology.workers[root_rank],
                       group=_group())


def broadcast_optimizer_state(optimizer, root_rank):
    pass  # a fresh optimizer's state is empty on every worker


def push_pull(tensor, average=True, name=None):
    out = tensor.detach().clone()
    dist.all_reduce(out, group=_group())
    return out / size() if average else out


class DistributedOptimizer:
    def __init__(self, optimizer, named_parameters=None, compression=None):
        self.optimizer = optimizer

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                dist.all_reduce(p.grad, group=_group())
                p.grad.div_(size())
        self.optimizer.step()
