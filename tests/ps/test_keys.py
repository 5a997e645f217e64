"""One key space per run: a script's own ``bps.push_pull`` beside a strategy's traffic."""

import pytest
import torch

import polytrain
import polytrain.byteps as bps
from polytrain.models import GPT
from polytrain.models import cross_entropy as loss_fn
from polytrain.ps import KeySpace
from tests.harness import max_abs_diff, spawn

TINY = {"seq_len": 16, "d_model": 32, "layers": 2, "heads": 2}
STEPS = 3


def test_a_key_space_hands_out_disjoint_consecutive_ranges():
    keys = KeySpace()
    assert [keys.take(n) for n in (4, 0, 3)] == [0, 4, 4] and keys.next == 7


def batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        w = torch.randint(0, 256, (8, TINY["seq_len"] + 1), generator=gen)
        yield w[:, :-1], w[:, 1:]


def single() -> dict:
    torch.manual_seed(0)
    model = GPT(**TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in batches():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


def beside(strategy: str, options: dict) -> dict:
    # Symptom this guards against: before one key space per run, WSP numbered its keys from
    # 0 and BytePS's engine from its own counter, so a script's push_pull in a HetPipe run
    # landed on a parameter server's key (a wrong sum, or a refused declaration).
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = GPT(**TINY)
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                   strategy, loss_fn=loss_fn, **options)
    sums = []
    for step, (x, y) in enumerate(batches()):
        trainer.step(x, y)
        mine = torch.full((5,), float(ctx.worker_index + 1 + 10 * step))
        sums.append(bps.push_pull(mine, name="metric", average=False).tolist())
    state = trainer.state_dict()
    trainer.close()
    return {"sums": sums, "state": state, "workers": ctx.num_workers}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,layout,options", [
    ("byteps", {"workers": 2, "nodes": 2, "colocated": 1}, {}),
    ("hetpipe", {"workers": 2, "nodes": 2, "servers": 1},
     {"policy": "np", "inflight": 1, "staleness": 0, "server_optimizer": False}),
])
def test_a_scripts_push_pull_beside_the_strategys_keys_gets_the_right_sums(strategy, layout,
                                                                           options):
    out = spawn(beside, args=(strategy, options), **layout)
    workers = out[0]["workers"]
    for step in range(STEPS):
        want = sum(w + 1 + 10 * step for w in range(workers))
        assert all(o["sums"][step] == [want] * 5 for o in out)
    # The strategy's own training is untouched: synchronous SGD on the global batch.
    reference = single()
    assert max_abs_diff(out[0]["state"], reference) < 1e-5
    torch.manual_seed(0)
    assert max_abs_diff(reference, GPT(**TINY).state_dict()) > 1e-3  # the weights moved
