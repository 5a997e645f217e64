"""The calls BytePS users know: push_pull, the broadcasts, DistributedOptimizer, staleness."""

import gc
import logging
import re
import time

import numpy
import pytest
import torch
from torch import nn

import polytrain
import polytrain.byteps as bps
from polytrain import ConfigError
from polytrain.byteps.parallel import DistributedDataParallel as DDP
from polytrain.ps.compression import TopK
from polytrain.ps.engine import engine_for
from polytrain.strategies.byteps import api
from polytrain.strategies.byteps.optimizer import checked_options
from tests.harness import refused, spawn

STEPS = 3


def micro_batches(step):
    """The same global batch on every worker: 4 workers x 2 micro-batches of 3 rows."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 6, generator=g), torch.randn(8, 3, 2, generator=g)


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def use_the_api():
    ctx = polytrain.init()
    w, workers = bps.rank(), bps.size()
    out = {"rank": w, "size": workers, "local": (bps.local_rank(), bps.local_size())}
    x = torch.arange(10, dtype=torch.float32) + 100 * w
    out["avg"] = bps.push_pull(x, name="x")
    out["again"] = bps.push_pull(2 * x, name="x")
    out["sum"] = bps.push_pull(torch.tensor([w + 1]), name="n", average=False)
    # Integers stay exact on the machine too (not through float32: 2^40 + 1 was 2^40).
    out["big"] = bps.push_pull(torch.tensor([2 ** 40 + w]), name="big", average=False)
    out["unnamed"] = bps.push_pull(torch.ones(3, 3))
    # The UNNAMED_WARN-th unnamed call warns, as docs/from-byteps.md says (the one after it
    # did): here the third.
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(api.__name__).addHandler(handler)
    api.UNNAMED_WARN = 3
    for _ in range(3):  # the second, third and fourth unnamed calls
        bps.push_pull(torch.ones(1))
    out["unnamed_warnings"] = said
    # A 16-bit average travels divided by the workers: the servers add in float32 but answer
    # in the tensor's dtype, so float16's 4 x 40,000 came back inf (and bfloat16's 4 x 3e38
    # overflowed float32 itself).
    out["half"] = bps.push_pull(torch.full((2,), 40000.0, dtype=torch.float16), name="half")
    out["bf16"] = bps.push_pull(torch.full((2,), 3e38, dtype=torch.bfloat16), name="bf16")
    out["half_inplace"] = bps.push_pull_inplace(torch.full((2,), 40000.0, dtype=torch.float16),
                                                name="half_inplace")
    # After the run's engine was closed (a byteps trainer's close() closes it), a name
    # declared before is summed again (it waited for the timeout on a new engine).
    engine_for(ctx).close()
    out["after_close"] = bps.push_pull(x, name="x")
    # An empty tensor (a model's 0-size parameter), twice: its rounds stay in step.
    out["empty"] = [bps.push_pull(torch.empty(0, 4), name="e") for _ in range(2)]
    # BytePS's priority (#241: always 0 there): a larger one is queued first, then by key.
    queue = engine_for(ctx).queue
    queued, put = [], queue.put
    queue.put = lambda order, nbytes, task, **kw: (queued.append((order, task.part.part.label)),
                                                   put(order, nbytes, task, **kw))
    handles = [bps.push_pull_async(torch.ones(2), name=n, priority=p)
               for n, p in (("late", 0), ("early", 5))]
    del queue.put  # the class's own again
    out["priorities"] = (queued, [bps.synchronize(h) for h in handles])
    try:
        bps.push_pull(torch.zeros(3), name="x")
    except ConfigError as e:
        out["reuse_error"] = str(e)
    # Compression by name, as DistributedOptimizer takes it (an AttributeError in the engine
    # before); another one for the same name (ignored before); an object the name's rules
    # refuse (the servers refused it in their own process before).
    out["fp16"] = bps.push_pull(x, name="xc", compression="fp16")
    # Each machine dithers with draws of its own (the same draws rounded every machine's
    # error alike): its codec's generator state is in what a checkpoint keeps of it.
    before = set(engine_for(ctx).codec_states())
    bps.push_pull(torch.ones(64), name="xd", compression="dithering:2")
    out["dithered"] = {k: v for k, v in engine_for(ctx).codec_states().items()
                       if k not in before}
    for key, call in (("recompressed", lambda: bps.push_pull(x, name="xc", compression="onebit")),
                      ("bad_object", lambda: bps.push_pull(x, name="xk",
                                                           compression=TopK(k=2.5)))):
        try:
            call()
        except ConfigError as e:
            out[key] = str(e)

    # Broadcasts: different seeds, then worker 1's weights and optimizer state everywhere.
    model = make_model(seed=w)
    bps.broadcast_parameters(model.state_dict(), root_rank=1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1 * (w + 1), momentum=0.9)
    bps.broadcast_optimizer_state(inner, root_rank=1)
    out["initial"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["lr"] = inner.param_groups[0]["lr"]

    # Two backward passes per step (gradient accumulation), an LR schedule on the wrapper.
    opt = bps.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2, partition_bytes=64)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        xs, ys = micro_batches(step)
        opt.zero_grad()
        for j in range(2):
            nn.functional.mse_loss(model(xs[2 * w + j]), ys[2 * w + j]).backward()
        opt.step()
        schedule.step()
    out["trained"] = {k: v.clone() for k, v in model.state_dict().items()}

    # Asynchronous with staleness 1: worker 1 is slow; worker 0 may run one step ahead only.
    slow = make_model(seed=0)
    aopt = bps.DistributedOptimizer(torch.optim.SGD(slow.parameters(), lr=0.01),
                                    named_parameters=slow.named_parameters(), async_=True,
                                    staleness=1)
    starts, ends = [], []
    for step in range(5):
        if w == 1:
            time.sleep(0.5)
        starts.append(time.time())
        xs, ys = micro_batches(step)
        aopt.zero_grad()
        nn.functional.mse_loss(slow(xs[w]), ys[w]).backward()
        aopt.step()
        ends.append(time.time())
    out["async"] = (starts, ends)
    ctx.shutdown()
    return out


def reference(initial):
    """The same steps in one process: accumulated gradients averaged over the 4 workers."""
    model = make_model(seed=0)
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        xs, ys = micro_batches(step)
        opt.zero_grad()
        sum(nn.functional.mse_loss(model(xs[i]), ys[i]) for i in range(8)).div(4).backward()
        opt.step()
        schedule.step()
    return model.state_dict()


@pytest.mark.timeout(120)
def test_push_pull_broadcasts_and_the_distributed_optimizer():
    out = spawn(use_the_api, workers=4, nodes=2, servers=1, colocated=1)
    xs = [torch.arange(10, dtype=torch.float32) + 100 * w for w in range(4)]
    for o in out:
        assert o["size"] == 4 and o["local"] == (o["rank"] % 2, 2)
        assert torch.allclose(o["avg"], sum(xs) / 4)
        assert torch.allclose(o["again"], 2 * sum(xs) / 4)
        assert o["sum"].tolist() == [10] and o["sum"].dtype == torch.int64
        assert o["big"].tolist() == [4 * 2 ** 40 + 6]
        assert torch.equal(o["unnamed"], torch.ones(3, 3))
        warned = [m.split(":")[0] for m in o["unnamed_warnings"]]
        assert warned == ["3 push_pull calls without a name"]
        for key in ("half", "half_inplace"):
            assert torch.equal(o[key], torch.full((2,), 40000.0, dtype=torch.float16)), key
        assert torch.equal(o["bf16"], torch.full((2,), 3e38, dtype=torch.bfloat16))
        assert [tuple(e.shape) for e in o["empty"]] == [(0, 4), (0, 4)]
        assert torch.allclose(o["after_close"], sum(xs) / 4)
        assert "name 'x' was first used for [10]" in o["reuse_error"]
        assert torch.equal(o["fp16"], sum(xs) / 4)
        assert "name 'xc' was first used with compression fp16, now with onebit" in o[
            "recompressed"]
        assert "topk:2.5: K must be a count" in o["bad_object"]
        queued, sums = o["priorities"]
        assert all(torch.equal(t, torch.ones(2)) for t in sums)
        assert [label for _, label in sorted(queued)] == (
            [label for _, label in queued if "early" in label]
            + [label for _, label in queued if "late" in label])
        assert o["lr"] == pytest.approx(0.2)  # worker 1's
        for k, v in o["initial"].items():
            assert torch.equal(v, out[1]["initial"][k])
    # One handler a machine for each dithered key, and the two machines drew apart.
    states = {}
    for o in out:
        for key, state in o["dithered"].items():
            states.setdefault(key, []).append(state)
    assert states and all(len(s) == 2 and not torch.equal(*s) for s in states.values())
    # Some worker queued both (it handles both partitions for its machine).
    assert any({"early", "late"} <= {label.split("[")[0] for _, label in o["priorities"][0]}
               for o in out)
    want = reference(out[0]["initial"])
    for o in out:
        for k, v in o["trained"].items():
            assert torch.allclose(v, want[k], atol=1e-6), k
    starts, ends = out[0]["async"]
    slow_starts, _ = out[1]["async"]
    for c in range(1, 5):  # step c (0-based) ends after the slow worker pushed step c - 1
        assert ends[c] >= slow_starts[c - 1]
    assert ends[4] < slow_starts[4]  # ... and no later: the fast worker did run ahead


def sum_of_bf16_pieces():
    polytrain.init()
    piece = [1.0, 2.0 ** -8, 2.0 ** -8][bps.rank()]
    return bps.push_pull(torch.full((4,), piece, dtype=torch.bfloat16), name="h",
                         average=False).tolist()


@pytest.mark.timeout(60)
def test_16_bit_pieces_are_summed_on_their_machine_in_float32_as_on_the_servers():
    # In bf16, 1 + 2^-8 rounds to 1 and again: three GPUs of a machine summed to 1.0, where
    # a server (float32) gets 1 + 2^-7, which bf16 holds exactly.
    out = spawn(sum_of_bf16_pieces, workers=3, nodes=1, servers=0, colocated=1)
    assert out == [[1 + 2 ** -7] * 4] * 3


def mismatched_names():
    polytrain.init()
    bps.push_pull(torch.ones(10), name="grad.a" if bps.rank() == 0 else "grad.b")


@pytest.mark.timeout(60)
def test_workers_that_declare_different_tensors_get_an_error_naming_them():
    with pytest.raises(polytrain.LaunchError, match=r"ConfigError: worker rank \d \(machine "
                                                    r"node\d\) declared key 0 = 'grad\.[ab]\[0\] "
                                                    r"of 10'.* 'grad\.[ab]\[0\] of 10'.*name"):
        spawn(mismatched_names, workers=2, nodes=2, colocated=1)


def mismatched_models():
    polytrain.init()
    model = nn.Linear(4, 2 if bps.rank() == 0 else 3)
    errors = {}
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    before = model.weight.detach().clone()
    calls = {"parameters": lambda: bps.broadcast_parameters(model.state_dict(), root_rank=0),
             "optimizer": lambda: bps.broadcast_optimizer_state(opt, root_rank=0),
             "ddp": lambda: DDP(model)}
    for what, call in calls.items():
        try:
            call()
        except ConfigError as e:  # raised on every worker, so the run goes on
            errors[what] = str(e)
    return (bps.rank(), errors, torch.equal(model.weight, before),
            opt.state_dict()["state"][0]["exp_avg"].shape)


@pytest.mark.timeout(60)
def test_workers_with_different_models_are_refused_before_any_tensor_is_overwritten():
    # gloo broadcasts a [2, 4] tensor into a [3, 4] one without a word, so each call checks
    # every worker's shapes first.
    out = spawn(mismatched_models, workers=2, nodes=2, colocated=1)
    assert [rank for rank, *_ in out] == [0, 1]
    for rank, errors, unchanged, exp_avg in out:
        differ = (r"'weight' is \[2, 4\] torch.float32 on worker rank 0 but \[3, 4\] "
                  r"torch.float32 on worker rank 1")
        assert re.search(r"worker rank 1's broadcast_parameters\(\) argument differs from "
                         r"worker rank 0's: .*" + differ, errors["parameters"])
        assert re.search(r"worker rank 1's list of optimizer parameters differs .*"
                         r"\"param_groups\[0\]\['params'\]\[0\]\" is \[2, 4\]",
                         errors["optimizer"])
        assert re.search(r"worker rank 1's model differs .*" + differ, errors["ddp"])
        assert "HINT: build the same model" in errors["ddp"]
        assert unchanged and exp_avg == torch.Size([2 + rank, 4])  # each its own, untouched


def same_size_other_models():
    """Two models of the same size and the same first and last names, one per worker."""
    polytrain.init()
    h1, h2 = (8, 4) if bps.rank() == 0 else (4, 8)
    model = nn.Sequential(nn.Linear(4, h1), nn.Linear(h1, h2), nn.Linear(h2, 4))
    said = {}
    for mode in (False, True):
        said[mode] = refused(lambda mode=mode: bps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(), async_=mode))
    return said


@pytest.mark.timeout(60)
def test_distributed_optimizer_refuses_workers_with_other_models_of_the_same_size():
    # Symptom: workers whose models differed but had the same number of elements and the
    # same first and last parameter names trained on mixed sums, silently. Cause: a fused
    # key is declared by its first and last names and its size only, and the drop-in
    # compared the workers' options, not their parameters.
    for said in spawn(same_size_other_models, workers=2, nodes=2, colocated=1):
        assert said[False] == said[True] == (
            "worker rank 1's list of parameters to DistributedOptimizer differs from worker "
            "rank 0's: '0.weight' is [8, 4] torch.float32 on worker rank 0 but [4, 4] "
            "torch.float32 on worker rank 1. HINT: build the same model on every worker, and "
            "freeze the same parameters before wrapping the optimizer")


def sparse_embedding(strategy):
    polytrain.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 2))
    try:
        model, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          strategy=strategy)
        model(torch.tensor([[1, 2]])).sum().backward()
    except ConfigError as e:  # raised on every worker, so the run goes on
        return str(e)
    return "trained"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["byteps", "herring"])
def test_a_sparse_gradient_is_refused_naming_the_parameter_and_what_takes_it(strategy):
    # It was "reshape is not implemented for sparse tensors", from inside a backward hook;
    # then the same refusal from the first backward; now from distribute(), before training.
    for said in spawn(sparse_embedding, workers=2, nodes=2, colocated=1, args=(strategy,)):
        assert re.search(rf"parameter '0\.weight' has sparse gradients \(an nn\.Embedding\("
                         rf"sparse=True\)\), and strategy '{strategy}' sums dense ones\. HINT: "
                         rf"train with --strategy parallax", said), said


def two_backwards() -> tuple[list[float], list[str], str]:
    """Under distribute(..., strategy="byteps"): a model partly outside its optimizer (the
    head's weight after three steps, and worker 0's warnings); then two backward passes and
    one step."""
    import logging

    ctx = polytrain.init()
    torch.manual_seed(0)
    said: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("polytrain.strategies.byteps").addHandler(catch)
    partial = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))
    partial[3].requires_grad_(False)  # frozen: not summed, and not warned of
    partial, head = polytrain.distribute(  # the backbone trains, and no optimizer steps it
        partial, torch.optim.SGD(partial[2].parameters(), lr=0.1), strategy="byteps")
    logging.getLogger("polytrain.strategies.byteps").removeHandler(catch)
    x = torch.full((2, 8), ctx.worker_index + 1.0)
    for _ in range(3):
        head.zero_grad()
        partial(x).sum().backward()
        head.step()
    trained = partial[2].weight.detach().flatten().tolist()
    polytrain.strategy_of(partial).close()
    model = nn.Linear(8, 4)
    model, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      strategy="byteps")
    x = polytrain.shard(torch.randn(8, 8), ctx.worker_index, ctx.num_workers)
    try:
        for _ in range(2):
            model(x).pow(2).mean().backward()
        opt.step()
    except ConfigError as e:
        return trained, said, str(e)
    return trained, said, "accepted"


@pytest.mark.timeout(120)
def test_more_backward_passes_than_a_step_sums_are_refused_not_lost():
    # The second backward's gradients were dropped: the sum had left with the first, and
    # the step trained on it alone (a new user's accumulation loop ended elsewhere than ddp).
    runs = spawn(two_backwards, workers=2, colocated=1)
    trained, warned, said = runs[0]
    # And parameters that train outside the optimizer given to distribute() are not summed:
    # stepped by a second optimizer, the workers ended 0.31 apart, without a word. Worker 0
    # warns of them at the wrap; left alone (a backbone that fine-tuning does not step), they
    # stay alike, and the head trains as one.
    assert trained == runs[1][0]
    assert warned == [
        "byteps sums the gradients of the optimizer given to distribute(), and it does not "
        "hold 2 parameter(s) that require a gradient (the first: '0.weight'): if another "
        "optimizer steps them, each worker's copy takes its own gradients and they drift "
        "apart; give that optimizer every parameter that trains, or set requires_grad=False "
        "on those nothing trains (which also saves their backward)"]
    assert runs[1][1] == []  # worker 0's alone
    assert re.match(r"'(weight|bias)' had a gradient from 2 backward passes before the step "
                    r"synchronised it, and 1 is summed", said), said
    assert "pass backward_passes_per_step=N" in said


def compressed_drop_in() -> dict:
    """BytePS's DistributedDataParallel with a compressor and the options that need one."""
    polytrain.init()
    out = {}
    model = DDP(nn.Linear(64, 64), compression=bps.Compression.onebit, error_feedback=True,
                compress_min_bytes=0)
    out["compressed"] = list(model.sync.packed)
    model.close()
    # Per tensor, some uncompressed: the options check the compressor in use.
    model = DDP(nn.Linear(64, 64), compression={"weight": "onebit", "bias": "none"},
                error_feedback=True, compress_min_bytes=0)
    out["mapped"] = list(model.sync.packed)
    model.close()
    out["both"] = refused(lambda: DDP(nn.Linear(4, 2), compression=bps.Compression.onebit,
                                      compress="topk:0.1"))
    # Options set on worker 0 alone (the other's default): refused at the wrap, on both.
    first = bps.rank() == 0
    out["differing"] = [
        refused(lambda: DDP(nn.Linear(4, 2), broadcast_buffers=not first)),
        refused(lambda: DDP(nn.Linear(4, 2), compression="onebit" if first else None)),
        refused(lambda: DDP(nn.Linear(4, 2), partition_bytes=64 if first else 4096000))]
    # The same compression written otherwise is the same (it was refused as differing).
    alike = []
    for mine, theirs in [(bps.Compression.named("topk:0.010"), "topk:0.01"),
                         ({"weight": "onebit", "bias": None}, {"weight": bps.Compression.onebit})]:
        model = DDP(nn.Linear(64, 64), compression=mine if first else theirs,
                    compress_min_bytes=0)
        alike.append(list(model.sync.packed))
        model.close()
    out["alike"] = alike
    # As BytePS's own, the wrap copies worker 0's buffers whatever broadcast_buffers says.
    net = nn.BatchNorm1d(2)
    net.running_mean.fill_(bps.rank() + 1.0)
    model = DDP(net, broadcast_buffers=False)
    out["buffer"] = model.module.running_mean.tolist()
    model.close()
    out["kind"] = refused(lambda: DDP(nn.Linear(4, 2), broadcast_buffers="no"))
    # BytePS's recipe for models with branches: backward(); model.synchronize(); step().
    model = DDP(nn.Linear(4, 2, bias=False))
    model(torch.full((1, 4), bps.rank() + 1.0)).sum().backward()
    model.synchronize()
    model.synchronize()  # nothing to do: the sum is not taken again
    out["synchronized"] = model.module.weight.grad.tolist()
    model.close()
    out["closed"] = closed_optimizer()
    out["momentum"] = drop_in_momentum()
    out["converted"] = converted_after_wrapping()
    out["async"] = async_misuse()
    out["optimizer"] = optimizer_misuse(first)
    return out


def drop_in_momentum() -> list[str]:
    """Worker 0's warnings at a drop-in wrap with compress_momentum (it cannot see the
    optimizer, whose momentum of its own would make two)."""
    said: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("polytrain.strategies.byteps").addHandler(catch)
    try:
        DDP(nn.Linear(64, 64), compression="onebit", compress_momentum=0.9,
            compress_min_bytes=0).close()
        DDP(nn.Linear(64, 64), compression="onebit", compress_min_bytes=0).close()  # none
    finally:
        logging.getLogger("polytrain.strategies.byteps").removeHandler(catch)
    return said


def converted_after_wrapping() -> dict[str, str]:
    """A model converted to float64 after its wrap: the drop-in's next forward; the
    synchronous optimizer's next backward (before any push) or, converted after it, its
    step; the asynchronous one's next step."""
    out = {}
    model = DDP(nn.Linear(4, 2))
    model.module.double()
    out["drop-in"] = refused(lambda: model(torch.ones(1, 4, dtype=torch.float64)))
    model.close()
    for mode in ("sync", "sync after backward", "async"):
        net = nn.Linear(4, 2)
        opt = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       named_parameters=net.named_parameters(),
                                       async_=mode == "async")
        if mode == "sync after backward":
            net(torch.ones(1, 4)).sum().backward()
        net.double()

        def train(net=net, opt=opt, mode=mode):
            if mode != "sync after backward":
                net(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
            opt.step()
        out[mode] = refused(train)
        opt.close()
    return out


def async_misuse() -> dict:
    """An asynchronous DistributedOptimizer wrapped twice, stepped after its close(), and its
    parameters wrapped again once it is closed."""
    said = {}
    net = nn.Linear(4, 2, bias=False)

    def wrap(**options):
        return bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        named_parameters=net.named_parameters(), **options)

    opt = wrap(async_=True)
    said["second"] = [refused(lambda: wrap(async_=True)), refused(wrap)]
    net(torch.ones(1, 4)).sum().backward()
    opt.step()
    said["closed"] = step_after_close(net, opt)
    again = []
    said["again"] = refused(lambda: again.append(wrap(async_=True)))
    for o in again:
        o.close()
    return said


def closed_optimizer() -> tuple[str, bool]:
    """A DistributedOptimizer's step after its close(): the refusal, and whether the weights
    stayed as they were."""
    net = nn.Linear(4, 2)
    opt = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters())
    net(torch.ones(1, 4)).sum().backward()
    opt.step()
    return step_after_close(net, opt)


def step_after_close(net: nn.Linear, opt: torch.optim.Optimizer) -> tuple[str, bool]:
    """close() ``opt``, then a backward and its step: the refusal, and whether the weights
    stayed as they were."""
    opt.close()
    before = net.weight.detach().clone()
    opt.zero_grad()
    net(torch.full((1, 4), bps.rank() + 1.0)).sum().backward()
    return refused(opt.step), torch.equal(net.weight, before)


def outcome(fn) -> str:
    """:func:`refused`'s answer, or another error's type and text (a lost peer)."""
    try:
        return refused(fn)
    except Exception as e:  # noqa: BLE001 - compared by its text
        return f"{type(e).__name__}: {e}"


def optimizer_misuse(first: bool) -> dict:
    """DistributedOptimizer's options set on worker 0 alone, a wrap refused and retried, one
    dropped without close(), a second one over the same parameters, push_pull's handles
    misused, and calls after bps.shutdown() (last)."""
    said = {}
    net = nn.Linear(64, 64)

    def wrap(**options):
        bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                 named_parameters=net.named_parameters(), compression="onebit",
                                 compress_min_bytes=0, **options).close()

    said["differing"] = [refused(lambda: wrap(compress_momentum=0.9 if first else 0.0)),
                         refused(lambda: wrap(compress_warmup=2 if first else 0))]
    said["credit"] = refused(lambda: wrap(credit_bytes=256 if first else 10_000_000))

    def one_bit(**adam):
        bps.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.1, **adam),
                                 named_parameters=net.named_parameters(), compression="onebit",
                                 compress_min_bytes=0, compress_adam=True,
                                 compress_warmup=2).close()

    said["retried"] = [refused(lambda: one_bit(weight_decay=0.01)), refused(one_bit)]
    gc.disable()  # 1-bit Adam's sync and optimizer refer to each other: a cycle
    try:
        kept = bps.DistributedOptimizer(
            torch.optim.Adam(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
            compression="onebit", compress_min_bytes=0, compress_adam=True, compress_warmup=2)
        del kept  # without close(), and no collection since
        said["dropped 1-bit"] = refused(one_bit)
    finally:
        gc.enable()
    dropped = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       named_parameters=net.named_parameters())
    del dropped  # without close()
    gc.collect()
    made = []
    said["after drop"] = refused(lambda: made.append(bps.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())))
    opt = made[0] if made else None
    if opt is not None:  # one step: the mean of 1 and 2 (the dropped one's hooks are gone)
        before = net.weight.detach().clone()
        net(torch.full((1, 64), bps.rank() + 1.0)).sum().backward()
        stepped = outcome(opt.step)
        said["moved"] = stepped if stepped != "accepted" else sorted(
            {round(v, 6) for v in (net.weight - before).flatten().tolist()})
        opt.zero_grad()
    said["second"] = refused(lambda: bps.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01), named_parameters=net.named_parameters()))
    handle = bps.push_pull_async(torch.ones(2), name="a")
    said["in flight"] = refused(lambda: bps.push_pull_async(torch.ones(2), name="a"))
    bps.synchronize(handle)
    said["twice"] = refused(lambda: bps.synchronize(handle))
    arrived = bps.push_pull_async(torch.full((3,), bps.rank() + 1.0), name="arrived")
    while not bps.poll(arrived):
        time.sleep(0.01)
    late = bps.push_pull_async(torch.ones(3), name="late")
    bps.shutdown()
    said["size"] = refused(bps.size)
    said["init again"] = refused(bps.init)
    said["handles"] = [outcome(lambda: call(h)) for h in (arrived, late)  # noqa: B023
                       for call in (bps.poll, bps.synchronize)]

    def step():
        net(torch.ones(1, 64)).sum().backward()
        opt.step()

    said["step"] = outcome(step)
    return said


@pytest.mark.timeout(60)
def test_the_drop_in_takes_compression_with_the_options_that_need_one():
    # Its options were checked before compression= was seen: error_feedback=True was refused
    # as '--compress is none'; and compress= beside compression= was dropped silently.
    for rank, out in enumerate(spawn(compressed_drop_in, workers=2, colocated=1)):
        assert out["compressed"] and out["mapped"]  # the weight's bucket is compressed
        assert out["both"].startswith("DistributedDataParallel got both compression=")
        # Symptom: broadcast_buffers on one worker alone ended in a LaunchError after the
        # timeouts, with a hint about timeouts. Cause: the drop-in compared no options
        # (Herring's compares them at the wrap).
        assert out["differing"] == [
            f"worker rank 1's DistributedDataParallel option {option} differs from worker "
            f"rank 0's (machine node0: {theirs}; machine node0: {ours}). HINT: pass the same "
            f"options to DistributedDataParallel on every worker"
            for option, theirs, ours in [("broadcast_buffers", True, False),
                                         ("compression", "none", "onebit"),
                                         ("partition_bytes", 4096000, 64)]]
        assert out["alike"] == [[0], [0]]  # the weight's bucket compressed, on both
        assert out["buffer"] == [1.0, 1.0]  # worker 0's, on both (BytePS copies them)
        assert out["kind"] == ("DistributedDataParallel option broadcast_buffers must be True "
                               "or False (got 'no', a str). HINT: pass broadcast_buffers=True "
                               "or broadcast_buffers=False")
        # Symptom: model.synchronize(), BytePS's DDP's, raised AttributeError.
        assert out["synchronized"] == [[1.5] * 4] * 2  # the mean of 1 and 2
        # Symptom: a step after opt.close() (or the byteps strategy's close()) went on, each
        # worker on its own gradients (workers 4.75e-2 apart). Cause: close() removed the
        # gradient hooks, and step() found nothing to wait for.
        assert out["closed"] == (
            "this byteps DistributedOptimizer was closed, releasing what it trains with (its "
            "gradient hooks and sums): a step now would step this worker's copy on its own "
            "gradients. HINT: close() the optimizer after its last step", True)
        # Symptom: compress_momentum beside SGD's momentum=0.9 trained with two momenta,
        # silently. Cause: the drop-in cannot see the optimizer that DistributedOptimizer's
        # check reads; it warns, worker 0 once a wrap.
        assert out["momentum"] == ([
            "compress_momentum 0.9 puts a momentum on the gradients before compression, and "
            "DistributedDataParallel cannot see the optimizer: give it no momentum of its own "
            "(SGD's momentum=0, Adam's betas=(0.0, b2)), or the update has two; "
            "bps.DistributedOptimizer(..., compress_momentum=0.9) checks it"]
            if rank == 0 else [])
        # Symptom: model.double() after the wrap was summed in the wrap's float32 buffers
        # (6.6e-10 off one process), silently; a tensor in a bucket of its own failed the
        # engine ("declared float32 but got float64"), and with async_=True the server.
        # Cause: nothing compared the parameters' dtype with the one the sums were laid
        # out for.
        converted = ("parameter 'weight' is float64 on cpu now, and was float32 on cpu at the "
                     "wrap, which laid out its sums for that: the workers would step on sums "
                     "of another dtype, or drift apart. HINT: convert the model "
                     "(model.double(), .to(device)) before distribute() (or before wrapping "
                     "it)")
        assert out["converted"] == {"drop-in": converted, "sync": converted,
                                    "sync after backward": converted, "async": converted}
        # Symptom: with async_=True a second optimizer over the same parameters was taken, and
        # a step after close() still pushed and pulled. Cause: the asynchronous optimizer had
        # neither the synchronous one's registry of held parameters nor its close().
        said = out["async"]
        assert said["second"] == [
            "parameter 'weight' is held already by a DistributedOptimizer (async_=True) that "
            "was not closed: both would push it to the servers every step. HINT: close() the "
            "first DistributedOptimizer (async_=True) before wrapping its parameters again"] * 2
        assert said["closed"] == (
            "this byteps DistributedOptimizer (async_=True) was closed, releasing its "
            "parameters (another optimizer may hold them now): a step now would push this "
            "worker's update beside that one's. HINT: close() the optimizer after its last "
            "step", True)
        assert said["again"] == "accepted"
        said = out["optimizer"]
        # Symptom: compress_momentum on one worker alone was taken (mixed sums), and
        # compress_warmup ended in a timeout blaming a push_pull. Cause: DistributedOptimizer
        # compared no options (the drop-in did).
        assert said["differing"] == [
            f"worker rank 1's DistributedOptimizer option {option} differs from worker "
            f"rank 0's (machine node0: {theirs}; machine node0: {ours}). HINT: pass the same "
            f"options to DistributedOptimizer on every worker"
            for option, theirs, ours in [("compress_momentum", 0.0, 0.9),
                                         ("compress_warmup", 0, 2)]]
        # Symptom: a second optimizer over the same parameters failed at its first backward
        # ("had a gradient from 2 backward passes"): the first one's hooks were still there.
        assert said["second"] == (
            "parameter 'weight' is held already by a DistributedOptimizer that was not "
            "closed: both would push it to the servers every step. HINT: close() the first "
            "DistributedOptimizer before wrapping its parameters again")
        # Symptom: the hints named the engine's internals (submit(), wait()).
        assert said["in flight"] == (
            "push_pull name 'a' has a push_pull in flight already. HINT: synchronize the "
            "earlier handle for name 'a' first (bps.synchronize(handle)), or give this "
            "tensor another name")
        assert said["twice"] == (
            "this handle (push_pull name 'a') was already synchronized. HINT: synchronize "
            "each handle once, and keep the tensor that call returned")
        left = ("after this process left the run (the shutdown() of its context, "
                "polytrain.init()'s, which bps.shutdown() calls). HINT: ")
        # Symptom: synchronize() of a handle after the shutdown blamed a lost server (or a
        # live peer: the shutdown closed the groups its messages moved in); poll() said
        # True. Every handle is refused, one whose sum had arrived too.
        assert said["handles"] == [
            f"bps.{call}() of push_pull name '{name}' was called {left}synchronize every "
            f"handle before the shutdown: a launched process joins its run once"
            for name in ("arrived", "late") for call in ("poll", "synchronize")], said
        # Symptom: bps.init() after the shutdown waited in the gone run's rendezvous (its
        # server had exited; a run of workers alone mostly timed out in gloo's connect).
        assert said["init again"] == (
            f"polytrain.init() (or bps.init(), or distribute()'s) was called again {left}join "
            f"once, and make every call before the shutdown: a launched process joins its run "
            f"once")
        assert {k: said.get(k) for k in ("credit", "retried", "dropped 1-bit", "after drop",
                                         "moved")} == {
            # Symptom: refused as differing. Cause: credit_bytes was among the options every
            # worker must share, but it is each worker's own send window (no keys, no payload).
            "credit": "accepted",
            # Symptom: the corrected retry was refused as "held already by a
            # DistributedOptimizer that was not closed". Cause: the refused wrap had built its
            # gradient sync (hooks, holders) before 1-bit Adam's checks, and closed nothing.
            "retried": ["compress_adam (1-bit Adam) supports plain Adam only (got "
                        "{'weight_decay': 0.01}). HINT: leave weight_decay, amsgrad and "
                        "maximize at their defaults, or leave out --compress-adam", "accepted"],
            # Symptom: a wrap after `del opt; gc.collect()` was refused ("close() the first
            # DistributedOptimizer", which can no longer be done). Cause: each gradient hook
            # held its sync, and the parameter held the hooks, so the sync was never freed.
            "after drop": "accepted",
            # Symptom: refused as not closed until a garbage collection ran. Cause: 1-bit
            # Adam's optimizer and sync refer to each other; the refusal collects once first.
            "dropped 1-bit": "accepted",
            "moved": [-0.15]}  # SGD's lr 0.1 times the mean of 1 and 2: summed once
        # Symptom: 'called before bps.init()', and a step blaming a lost peer; then a message
        # that named bps.shutdown() however the process left, and said it left "for good"
        # (a plain python script may init() again).
        assert said["size"] == (f"bps.size() was called {left}make every BytePS call before "
                                f"the shutdown: a launched process joins its run once")
        assert said["step"] == (f"'weight..bias' was submitted {left}finish every sum before "
                                f"the shutdown: a launched process joins its run once")


def broadcast_bare_tensors():
    polytrain.init()
    model = make_model(seed=bps.rank())
    bps.broadcast_parameters(list(model.parameters()), root_rank=1)
    first = [p.detach().clone() for p in model.parameters()]
    other = make_model(seed=10 + bps.rank())  # named pairs and bare tensors in one list
    mixed = [("0.weight", other[0].weight), other[2].bias]
    bps.broadcast_parameters(mixed, root_rank=0)
    said = {"number": refused(lambda: bps.broadcast_parameters([model[0].weight, 3])),
            "one": refused(lambda: bps.broadcast_parameters(model[0].weight))}
    return first, other[0].weight.detach().clone(), other[2].bias.detach().clone(), said


@pytest.mark.timeout(60)
def test_broadcast_parameters_takes_bare_tensors_as_byteps_does():
    # Symptom: bps.broadcast_parameters(list(model.parameters())), which BytePS takes (its
    # docstring names model.parameters()), failed with "too many values to unpack". Cause:
    # only a state_dict or (name, tensor) pairs were read.
    out = spawn(broadcast_bare_tensors, workers=2, colocated=1)
    want = [p.detach() for p in make_model(seed=1).parameters()]
    for first, weight, bias, said in out:
        assert all(torch.equal(a, b) for a, b in zip(first, want))
        assert torch.equal(weight, make_model(seed=10)[0].weight.detach())
        assert torch.equal(bias, make_model(seed=10)[2].bias.detach())
        assert said["number"] == ("broadcast_parameters() takes tensors or (name, tensor) "
                                  "pairs, and item 1 is a int. HINT: pass model.state_dict(), "
                                  "model.named_parameters() or model.parameters()")
        assert said["one"].startswith("broadcast_parameters() got one tensor")


def unknown_keywords():
    polytrain.init()
    model = nn.Linear(4, 2)

    def wrap(**kw):
        return bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **kw)
    return {"typo": refused(lambda: wrap(error_feedbak=True)),
            "params": refused(lambda: wrap(compression_params={"compressor": "onebit"})),
            "ddp": refused(lambda: DDP(model, credit_byte=0))}


@pytest.mark.timeout(60)
def test_unknown_keywords_are_refused_in_one_line_listing_the_options():
    # Symptom: a misspelt option, or BytePS's compression_params={...}, gave a raw TypeError
    # from BytePSOptions(...). Cause: the keywords went to the dataclass unchecked.
    [said] = spawn(unknown_keywords, workers=1, colocated=1)
    assert re.fullmatch(r"unknown DistributedOptimizer keyword 'error_feedbak'; the "
                        r"DistributedOptimizer's keyword options are: async_, colocate, "
                        r"compress, .*, staleness\. HINT: did you mean error_feedback=\?",
                        said["typo"]), said["typo"]
    assert said["params"].startswith("DistributedOptimizer takes no compression_params")
    assert "HINT: pass compression= (a bps.Compression member" in said["params"]
    assert "error_feedback=True and compress_momentum=M" in said["params"]
    assert re.fullmatch(r"unknown DistributedDataParallel keyword 'credit_byte'; .*credit_bytes"
                        r".*HINT: did you mean credit_bytes=\?", said["ddp"]), said["ddp"]
    assert all("\n" not in s for s in said.values())


@pytest.mark.parametrize("options, message", [
    ({"colocate": "no"}, r"^DistributedOptimizer option colocate must be True or False \(got "
                         r"'no', a str\)\. HINT: pass colocate=True or colocate=False$"),
    ({"partition_bytes": 4096.5}, r"^DistributedOptimizer option partition_bytes must be a "
                                  r"whole number \(got 4096\.5\)\. HINT: pass partition_bytes "
                                  r"as a whole number$"),
])
def test_the_wrappers_keyword_options_of_the_wrong_kind_are_refused(options, message):
    # Symptom: DistributedOptimizer(..., colocate="no") kept the colocated servers ("no" is
    # true), and partition_bytes=4096.5 reached the engine. Cause: the wrappers built
    # BytePSOptions from their keywords without the kind check that the strategy's options
    # go through.
    with pytest.raises(ConfigError, match=message):
        checked_options("DistributedOptimizer", None, options)
    opts, _ = checked_options("DistributedDataParallel", None, {
        "colocate": numpy.False_, "partition_bytes": numpy.int64(8192)})
    assert (opts.colocate, opts.partition_bytes) == (False, 8192)
    assert [type(opts.colocate), type(opts.partition_bytes)] == [bool, int]


def poll_while_the_other_worker_sleeps():
    polytrain.init()
    out = []
    for late in (0, 1):  # each worker is once the late one; one of them handles the sum
        if bps.rank() == late:
            time.sleep(1.5)
        started = time.time()
        handle = bps.push_pull_async(torch.full((4,), bps.rank() + 1.0), name="polled")
        first = bps.poll(handle)
        while not bps.poll(handle):
            time.sleep(0.01)
        polled = time.time()
        t0 = time.perf_counter()
        total = bps.synchronize(handle)
        out.append({"late": late, "started": started, "first": first, "polled": polled,
                    "sync_s": time.perf_counter() - t0, "total": total.tolist(),
                    "handler": handle.tensor.parts[0].handler == polytrain.runtime.current().rank})
    return out


@pytest.mark.timeout(60)
def test_poll_is_true_only_once_the_sum_is_here():
    # Symptom: on a worker that handles no partition of the tensor, bps.poll() was True at
    # once, and synchronize() then waited 3 s for the sum. Cause: poll() read an event that
    # says this worker's own partitions are summed, which a worker without any has at once.
    out = spawn(poll_while_the_other_worker_sleeps, workers=2, colocated=1)
    for rank, rounds in enumerate(out):
        for r in rounds:
            assert r["total"] == [1.5] * 4
            assert r["sync_s"] < 0.5  # poll() said it would not wait
        early = [r for r in rounds if r["late"] != rank]
        for r in early:  # the sum needs the late worker's piece, not pushed yet
            assert not r["first"]
            assert r["polled"] >= out[r["late"]][r["late"]]["started"]
    # Both cases came: the early worker was once the handler and once not.
    assert sorted(r["handler"] for rank, rounds in enumerate(out) for r in rounds
                  if r["late"] != rank) == [False, True]
