"""HetPipe with D = 0 written out in one process (SGD), to check the strategy against.

Each virtual worker runs its stages' orders (``schedule.asynchronous``) with
weight stashing and an SGD update of ``-lr * grad / V`` per minibatch; at the end
of a wave a stage adds the wave's update to the global weights, and before its
next forward it waits for every virtual worker's same wave and takes the
global weights. Nothing here shares code with the strategy's engine.
"""

from collections import OrderedDict

import torch
from torch import nn
from torch.func import functional_call

from polytrain.data import GlobalBatches, get_dataset, shard
from polytrain.models import GPT
from polytrain.models import cross_entropy as loss_fn
from polytrain.pipeline.schedule import asynchronous
from tests.pipeline.test_schedule import run_to_completion

__all__ = ["simulate"]


def simulate(*, model_options: dict, bounds: tuple[int, ...], vws: int, inflight: int,
             steps: int, lr: float, batch: int) -> tuple[dict, list[float]]:
    """The final global weights and the mean loss of every step."""
    torch.manual_seed(0)
    model = GPT(**model_options)
    layers = list(model.named_children())
    stages = [nn.Sequential(OrderedDict(layers[a:e])) for a, e in zip(bounds, bounds[1:])]
    count = len(stages)
    init = [{n: p.detach().clone() for n, p in s.named_parameters()} for s in stages]
    live = [[dict(x) for x in init] for _ in range(vws)]
    wave = [[{n: torch.zeros_like(t) for n, t in x.items()} for x in init] for _ in range(vws)]
    pushes: list[list[list[dict]]] = [[[] for _ in range(count)] for _ in range(vws)]
    installed = [[0] * count for _ in range(vws)]
    done = [[0] * count for _ in range(vws)]
    window = model_options["seq_len"] + 1
    batches = [(b[:, :-1], b[:, 1:]) for _, b in zip(range(steps), GlobalBatches(
        get_dataset("text"), batch_size=batch, window=window, seed=0))]
    orders = [run_to_completion(asynchronous(count, inflight, steps)) for _ in range(vws)]
    pos = [0] * vws
    saved: dict = {}
    grad_in: dict = {}
    losses = [[0.0] * steps for _ in range(vws)]

    def global_weights(j: int, waves: int) -> dict:
        g = {n: t.clone() for n, t in init[j].items()}
        for v in range(vws):
            for update in pushes[v][j][:waves]:
                for n in g:
                    g[n] = g[n] + update[n]
        return g

    while any(pos[v] < len(orders[v]) for v in range(vws)):
        progressed = False
        for v in range(vws):
            if pos[v] == len(orders[v]):
                continue
            j, action = orders[v][pos[v]]
            m = int(action[1:])
            x_all, y_all = batches[m]
            if action[0] == "F":
                c = len(pushes[v][j])
                if installed[v][j] < c:
                    if any(len(pushes[u][j]) < c for u in range(vws)):
                        continue  # D = 0: wait for everyone's wave c
                    live[v][j] = global_weights(j, c)
                    installed[v][j] = c
                weights = {n: t.clone().requires_grad_() for n, t in live[v][j].items()}
                x = shard(x_all, v, vws) if j == 0 else \
                    saved[(v, j - 1, m)][2].detach().requires_grad_()
                out = functional_call(stages[j], weights, (x,))
                if j == count - 1:
                    out = loss_fn(out, shard(y_all, v, vws))
                    losses[v][m] = float(out.detach())
                saved[(v, j, m)] = (weights, x, out)
            else:
                weights, x, out = saved.pop((v, j, m))
                names = list(weights)
                inputs = [weights[n] for n in names] + ([x] if j > 0 else [])
                grads = torch.autograd.grad(
                    [out], inputs, None if j == count - 1 else [grad_in.pop((v, j + 1, m))])
                if j > 0:
                    grad_in[(v, j, m)] = grads[-1]
                for n, g in zip(names, grads):
                    step = -lr * g / vws
                    live[v][j][n] = live[v][j][n] + step
                    wave[v][j][n] = wave[v][j][n] + step
                done[v][j] += 1
                if done[v][j] % inflight == 0 or done[v][j] == steps:
                    pushes[v][j].append(wave[v][j])
                    wave[v][j] = {n: torch.zeros_like(t) for n, t in init[j].items()}
            pos[v] += 1
            progressed = True
        assert progressed, "the written-out schedule is stuck"
    final: dict = {}
    for j in range(count):
        final.update(global_weights(j, len(pushes[0][j])))
    return final, [sum(losses[v][m] for v in range(vws)) / vws for m in range(steps)]
