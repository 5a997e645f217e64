"""Herring: the single run's weights, shards of M/(n+k) on every server, balance, the drop-in."""

import functools
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polytrain
from polytrain import CommTimeout, ConfigError, LaunchError, TrainConfig
from polytrain.comm import TensorSpec
from polytrain.herring import HerringOptions, herring_traffic, plan_herring
from polytrain.launch.layout import Layout
from polytrain.models import GPT
from polytrain.strategies.herring import Herring
from polytrain.strategies.herring.ddp import bucket_cap_bytes
from tests.harness import (
    adam_tolerance,
    check_no_sync_gradients,
    max_abs_diff,
    no_sync_gradients,
    refused,
    run_cached,
    run_config,
    single_of,
    spawn,
)

STEPS = 4
MODEL = {"seq_len": 16, "d_model": 64, "layers": 2}  # ~0.5 MB: headers stay under 0.5%
TOLERANCE = {"sgd": 1e-6, "adam": adam_tolerance(3e-3, STEPS)}  # as BytePS's (test_sync.py)
CAP_MB = 0.1  # several buffers on this model, so buffers leave during backward

def config(nodes, workers, servers, optimizer="sgd", strategy="herring", **options):
    options = {"bucket_cap_mb": CAP_MB, **options} if strategy == "herring" else options
    return TrainConfig(strategy=strategy, workers=workers, nodes=nodes, servers=servers,
                       steps=STEPS, batch_size=12, optimizer=optimizer,
                       lr=0.05 if optimizer == "sgd" else 3e-3, model_options=MODEL,
                       strategy_options=options)


# -- the plan, without processes ---------------------------------------------------------------

def gpt_specs():
    return [TensorSpec.of(n, p) for n, p in GPT(**MODEL).named_parameters()]


def test_every_buffer_is_cut_into_equal_shards_one_per_server_and_piece_per_local_worker():
    specs = gpt_specs()
    plan = plan_herring(specs, bucket_cap_bytes=int(CAP_MB * 2**20), servers=[4, 5, 6],
                        local_workers=2)
    assert len(plan.buckets) > 2
    # Backward order: the last parameters fill the first buffer.
    assert plan.buckets[0].members[0] == len(specs) - 1
    assert sorted(m for b in plan.buckets for m in b.members) == list(range(len(specs)))
    assert all(b.nbytes <= int(CAP_MB * 2**20) or len(b.members) == 1 for b in plan.buckets)
    for b, spec in enumerate(plan.specs):
        parts = [(p, o, h) for p, o, h in zip(plan.placement.partitions, plan.placement.owners,
                                             plan.placement.handlers) if p.tensor == b]
        per_server = {s: sum(p.numel for p, o, _ in parts if o == s) for s in (4, 5, 6)}
        assert max(per_server.values()) - min(per_server.values()) <= 1  # to the element
        per_worker = [sum(p.numel for p, _, h in parts if h == j) for j in (0, 1)]
        assert abs(per_worker[0] - per_worker[1]) <= 3
        assert sum(p.numel for p, _, _ in parts) == spec.numel
    total = sum(s.nbytes for s in specs)
    load = plan.bytes_by_server()
    assert sum(load.values()) == total and max(load.values()) / min(load.values()) <= 1.001


def test_a_buffer_smaller_than_its_pieces_goes_to_as_many_servers_as_it_has_elements():
    # It was refused, naming --bucket-cap-mb, which cannot help a lone scalar of another
    # dtype (its own buffer whatever the cap).
    specs = [TensorSpec("w", (10,), torch.float32), TensorSpec("t", (), torch.float64),
             TensorSpec("b", (5,), torch.float32)]
    plan = plan_herring(specs, bucket_cap_bytes=1 << 20, servers=[4, 5, 6], local_workers=2)
    by_buffer: dict[str, list[tuple[int, int, int]]] = {}
    for p, o, h in zip(plan.placement.partitions, plan.placement.owners,
                       plan.placement.handlers):
        by_buffer.setdefault(p.name, []).append((p.numel, o, h))
    assert by_buffer["t"] == [(1, 5, 0)]  # one element: one server (the next in turn)
    # 5 elements over 3 servers of 2 local workers: 2, 2 and 1, the last in one piece.
    assert by_buffer["b"] == [(1, 4, 0), (1, 4, 1), (1, 5, 0), (1, 5, 1), (1, 6, 0)]
    assert [n for n, _, _ in by_buffer["w"]] == [2, 2, 2, 1, 2, 1]


def test_the_plans_refusals_name_the_rule_and_the_values():
    spec = [TensorSpec("b", (5,), torch.float32)]
    with pytest.raises(ConfigError, match="bucket cap must be positive"):
        plan_herring(spec, bucket_cap_bytes=0, servers=[4])
    with pytest.raises(ConfigError, match="--bucket-cap-mb must be positive"):
        TrainConfig(strategy="herring", workers=2, strategy_options={"bucket_cap_mb": 0.0})
    for bad in (float("nan"), float("inf")):  # int() of them raised deep in the drop-in
        with pytest.raises(ConfigError, match=r"bucket_cap_mb must be positive.*HINT: pass "
                                              r"bucket_cap_mb 25"):
            bucket_cap_bytes(bad)
    assert bucket_cap_bytes(1e-9) == 1 and bucket_cap_bytes(1.0) == 1 << 20
    assert bucket_cap_bytes(None) == 25 << 20  # torch DDP's reading of None: its default
    with pytest.raises(ConfigError, match=r"^bucket_cap_mb must be a number of MiB \(got "
                                          r"'25', a str\)\. HINT: pass bucket_cap_mb 25$"):
        bucket_cap_bytes("25")
    with pytest.raises(ConfigError, match="--no-colocate keeps only the dedicated servers"):
        TrainConfig(strategy="herring", workers=2, strategy_options={"colocate": False})


def test_a_bucket_cap_whose_bytes_overflow_an_int64_is_refused_in_one_line():
    # Symptom: --bucket-cap-mb 1e308 (HerringOptions, the drop-in) raised OverflowError
    # "cannot convert float infinity to integer". Cause: only the MiB were checked to be
    # finite, and 1e308 MiB is an infinite number of bytes.
    from polytrain.herring import DistributedDataParallel as DDP
    said = (r"^{} must be positive and under 2\*\*43 MiB, whose bytes an int64 holds \(got "
            r"1e\+308\)\. HINT: pass {} 25$")
    for make, name in ((lambda: bucket_cap_bytes(1e308), "bucket_cap_mb"),
                       (lambda: HerringOptions(bucket_cap_mb=1e308), "--bucket-cap-mb"),
                       (lambda: DDP(nn.Linear(2, 2), bucket_cap_mb=1e308), "bucket_cap_mb")):
        with pytest.raises(ConfigError, match=said.format(name, name)):
            make()  # the drop-in: before it looks for a run
    assert bucket_cap_bytes(2.0**43 - 1) == (2**43 - 1) << 20  # the largest whole one: taken


def test_the_comm_hooks_colocate_of_the_wrong_kind_is_refused_in_one_line():
    # Symptom: HerringHookState(ctx, colocate="no") kept a server on every worker machine
    # ("no" is true). Cause: the hook's state checked no kinds, where the drop-in does.
    from polytrain.herring import HerringHookState
    with pytest.raises(ConfigError, match=r"^HerringHookState option colocate must be True or "
                                          r"False \(got 'no', a str\)\. HINT: pass "
                                          r"colocate=True or colocate=False$"):
        HerringHookState(colocate="no")  # before it looks for a run


def test_a_frozen_sparse_embedding_is_not_refused():
    # It was refused as 'has sparse gradients', though it has none.
    frozen = nn.Sequential(nn.Embedding(10, 4, sparse=True).requires_grad_(False),
                           nn.Linear(4, 1))
    Herring.check_model(frozen, Layout(workers=2), HerringOptions())
    with pytest.raises(ConfigError, match=r"^parameter '0\.weight' has sparse gradients"):
        Herring.check_model(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)),
                            Layout(workers=2), HerringOptions())


# -- transparency and traffic ------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("nodes, workers, servers, colocate, optimizer", [
    (1, 2, 0, True, "sgd"), (2, 4, 0, True, "adam"), (2, 4, 2, True, "sgd"),
    (2, 4, 2, False, "adam"),
    *(pytest.param(*c, marks=pytest.mark.long) for c in [
        (1, 2, 0, True, "adam"), (2, 4, 0, True, "sgd"), (2, 4, 2, True, "adam"),
        (2, 4, 2, False, "sgd")])])
def test_herring_ends_where_single_ends(nodes, workers, servers, colocate, optimizer):
    c = config(nodes, workers, servers, optimizer, colocate=colocate)
    _, single = run_config(single_of(c))
    metrics, distributed = run_cached(c)
    assert max_abs_diff(single, distributed) < TOLERANCE[optimizer]
    _, untrained = run_config(single_of(c).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 50 * TOLERANCE[optimizer]
    hidden = metrics["overlap"]["hidden_fraction"]
    assert hidden is not None and 0.0 <= hidden <= 1.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nodes, workers, servers, colocate", [
    (2, 4, 0, True), (2, 4, 2, True), (2, 4, 2, False)])
def test_every_machine_moves_herrings_bytes_and_every_server_the_same(nodes, workers, servers,
                                                                      colocate):
    metrics, _ = run_cached(config(nodes, workers, servers, colocate=colocate))
    m = metrics["model_bytes"]
    want = herring_traffic(nodes, servers, colocated=colocate)
    kinds = [x["kind"] for x in metrics["traffic"]["machines"]]
    assert kinds == ["worker"] * nodes + ["server"] * servers
    for machine in metrics["traffic"]["machines"]:
        assert not machine["estimated"]  # the flags of unused parameters travel as sums too
        expected = want[machine["kind"]] * m
        assert machine["sent_bytes_per_step"] == pytest.approx(expected, rel=0.02)
        assert machine["recv_bytes_per_step"] == pytest.approx(expected, rel=0.02)
    recv = [s["recv_bytes_per_step"] for s in metrics["traffic"]["servers"]]
    assert len(recv) == servers + (nodes if colocate else 0)
    assert max(recv) / min(recv) <= 1.01


def test_the_formula_is_ring_all_reduce_without_cpu_servers():
    assert herring_traffic(4, 0)["worker"] == pytest.approx(2 * 3 / 4)
    assert herring_traffic(2, 2)["worker"] == pytest.approx((2 * 2 + 2 - 2) / 4)
    assert herring_traffic(2, 2)["server"] == pytest.approx(2 / 4)


# -- the drop-in and the comm hook, against torch's DDP on the same script ---------------------

def script(kind: str, steps: int = 4) -> dict:
    """A torch-DDP style script: only the wrapping line differs between ``kind``s."""
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 3))
    if kind == "torch":
        model = nn.parallel.DistributedDataParallel(model, process_group=ctx.groups.workers)
    elif kind == "hook":
        from polytrain.herring import HerringHookState, herring_hook
        model = nn.parallel.DistributedDataParallel(model, process_group=ctx.groups.workers,
                                                    bucket_cap_mb=0.01)
        state = HerringHookState(ctx)
        model.register_comm_hook(state, herring_hook)
    else:
        from polytrain.herring import DistributedDataParallel as DDP
        model = DDP(model, bucket_cap_mb=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
        x = polytrain.shard(x, ctx.worker_index, ctx.num_workers)
        y = polytrain.shard(y, ctx.worker_index, ctx.num_workers)
        opt.zero_grad()
        # Gradient accumulation over two halves, the second one synchronising.
        with model.no_sync():
            nn.functional.mse_loss(model(x[:1]), y[:1]).backward()
        nn.functional.mse_loss(model(x[1:]), y[1:]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(180)
def test_the_drop_in_and_the_comm_hook_equal_torch_ddp_on_the_same_script():
    torch_ddp = spawn(script, workers=4, nodes=2, colocated=1, args=("torch",))[0]
    drop_in = spawn(script, workers=4, nodes=2, colocated=1, args=("herring",))[0]
    hook = spawn(script, workers=4, nodes=2, colocated=1, args=("hook",))[0]
    bare = {k.removeprefix("module."): v for k, v in torch_ddp.items()}
    assert list(drop_in) == list(bare)  # the bare model's keys, no "module."
    assert max_abs_diff(bare, drop_in) < 1e-5
    assert max_abs_diff(torch_ddp, hook) < 1e-5
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 3)).state_dict()
    assert max_abs_diff(bare, start) > 1e-3


class _Tempered(nn.Module):
    """Linear layers and a float64 scalar: a buffer of one element, smaller than its pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.temperature = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.temperature.float()


def tempered_script(kind: str) -> dict:
    ctx = polytrain.init()
    torch.manual_seed(0)
    model: nn.Module = _Tempered()
    if kind == "torch":
        model = nn.parallel.DistributedDataParallel(model, process_group=ctx.groups.workers)
    else:
        from polytrain.herring import DistributedDataParallel as DDP
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(polytrain.shard(x, ctx.worker_index, ctx.num_workers)),
                               polytrain.shard(y, ctx.worker_index, ctx.num_workers)).backward()
        opt.step()
    return {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
def test_a_scalar_of_another_dtype_is_summed_as_torch_ddp_sums_it():
    # Herring refused it: its buffer of one element could not be cut into 2 x 2 pieces.
    torch_ddp = spawn(tempered_script, workers=4, nodes=2, colocated=1, args=("torch",))[0]
    herring = spawn(tempered_script, workers=4, nodes=2, colocated=1, args=("herring",))[0]
    assert max_abs_diff(torch_ddp, herring) < 1e-6
    assert abs(float(herring["temperature"]) - 1.5) > 1e-4  # it trained


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def unused_script(kinds: tuple[str, ...]) -> dict:
    """Adam on a model whose branch b only the first step uses (on every worker), once per
    kind of wrapping, in one process."""
    ctx = polytrain.init()
    out = {}
    for kind in kinds:
        torch.manual_seed(0)
        model: nn.Module = _Branchy()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if kind == "torch":
            model = nn.parallel.DistributedDataParallel(
                model, process_group=ctx.groups.workers, find_unused_parameters=True)
        elif kind in ("strategy", "byteps"):
            model, opt = polytrain.distribute(model, opt,
                                              strategy="herring" if kind == "strategy" else kind)
        else:
            from polytrain.herring import DistributedDataParallel as DDP
            model = DDP(model, find_unused_parameters=kind == "herring")
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            x = polytrain.shard(x, ctx.worker_index, ctx.num_workers)
            y = polytrain.shard(y, ctx.worker_index, ctx.num_workers)
            opt.zero_grad()
            nn.functional.mse_loss(model(x, step == 0), y).backward()
            opt.step()
        out[kind] = {k.removeprefix("module."): v.detach().clone()
                     for k, v in model.state_dict().items()}
    return out


@pytest.mark.timeout(120)
def test_find_unused_parameters_leaves_a_parameter_no_worker_used_as_torch_ddp_does():
    # Its gradient was summed as zeros, and Adam went on moving it with its momentum.
    ends = spawn(unused_script, workers=2, colocated=1,
                 args=(("torch", "herring", "zeros", "strategy", "byteps"),))[0]
    assert max_abs_diff(ends["torch"], ends["herring"]) < 1e-6
    assert float((ends["zeros"]["b.weight"] - ends["torch"]["b.weight"]).abs().max()) > 1e-3
    # --strategy herring, which has no find_unused_parameters: b.weight ended 0.016 off
    # single's, silently, as its drop-in was built without it.
    assert max_abs_diff(ends["torch"], ends["strategy"]) < 1e-6
    # --strategy byteps, the same way (it too ended 0.016 off).
    assert max_abs_diff(ends["torch"], ends["byteps"]) < 1e-6


def step_inside_no_sync(leave: bool = False, summed_first: bool = False) -> None:
    polytrain.init()
    model = nn.Linear(4, 2)
    trainer_model, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              strategy="herring")
    trainer_model(torch.randn(2, 4)).sum().backward()
    if not summed_first:
        opt.step()  # a synchronised step first: the check is per step
    with trainer_model.no_sync():
        trainer_model(torch.randn(2, 4)).sum().backward()
        if not leave:
            opt.step()
    opt.step()


class _Marked(nn.Module):
    """A layer and a buffer that forward adds to its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("mark", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.mark


class _Devices(nn.Module):
    """A layer, and a forward that answers where its inputs (nested, and a keyword) are."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, pair: tuple[torch.Tensor, list[torch.Tensor]],
                scale: torch.Tensor) -> list[str]:
        return [pair[0].device.type, pair[1][0].device.type, scale.device.type]


def drop_in_arguments() -> dict:
    ctx = polytrain.init()
    from polytrain.herring import DistributedDataParallel as DDP
    DDP(nn.Linear(4, 2), process_group=ctx.groups.workers)  # every worker: accepted
    # torch's DDP reads None as its default for both (25 MiB; broadcast the buffers).
    model = DDP(_Marked(), bucket_cap_mb=None, broadcast_buffers=None)
    model.module.mark.fill_(ctx.worker_index + 1.0)  # worker 1's buffer drifted
    model(torch.randn(2, 4))
    out = {"group": refused(lambda: DDP(nn.Linear(4, 2), process_group=dist.group.WORLD)),
           "mark": model.module.mark.tolist()}
    from polytrain.herring import herring_hook
    out["comm hook"] = refused(lambda: model.register_comm_hook(None, herring_hook))
    # Worker 0 evaluates alone, as torch's DDP lets it: its first forward under no_grad()
    # broadcasts (the call the others' next training forward makes), the rest do not.
    if ctx.worker_index == 0:
        model.module.mark.fill_(7.0)
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(2, 4))
        model.train()
    model(torch.randn(2, 4)).sum().backward()
    out["mark after evaluating"] = model.module.mark.tolist()
    # device_ids=[i] moves the inputs to device i, nested ones and keywords too (a fake
    # device here: the meta one).
    with torch.no_grad():
        out["devices"] = DDP(_Devices(), device_ids=[torch.device("meta")])(
            (torch.ones(1), [torch.ones(1)]), scale=torch.ones(1))
    # static_graph accepted; init_sync=False keeps each worker's own weights.
    torch.manual_seed(ctx.worker_index)
    own = nn.Linear(4, 2)
    start = own.weight.detach().clone()
    DDP(own, init_sync=False, static_graph=True)
    out["own weights kept"] = torch.equal(own.weight, start)
    # broadcast_buffers=False: as torch's DDP, the wrap copies worker 0's parameters, not its
    # buffers (each worker's own, rank-local).
    local = _Marked()
    local.mark.fill_(ctx.worker_index + 1.0)
    torch.manual_seed(ctx.worker_index)
    local.lin.reset_parameters()
    local = DDP(local, broadcast_buffers=False)
    out["local buffers"] = (local.module.mark.tolist(), local.module.lin.weight.detach().clone())

    def differing(option: str) -> str:  # True on worker 0 alone
        return refused(lambda: DDP(nn.Linear(4, 2), **{option: ctx.worker_index == 0}))
    out["options"] = [differing(o) for o in ("broadcast_buffers", "find_unused_parameters")]
    out["group name"] = refused(lambda: DDP(nn.Linear(4, 2), process_group="workers"))
    out["two devices"] = refused(lambda: DDP(nn.Linear(4, 2), device_ids=[0, 1]))
    out["no_sync"] = no_sync_gradients(DDP, ctx.worker_index)
    converted = DDP(nn.Linear(4, 2))
    converted.module.double()
    out["converted"] = refused(lambda: converted(torch.ones(1, 4, dtype=torch.float64)))
    with torch.no_grad():  # an evaluation sums nothing: converted for it, it runs
        out["converted, evaluated"] = converted(torch.ones(1, 4, dtype=torch.float64)).dtype
    converted.close()
    with torch.no_grad():  # and so after close(), as its refusal of a training forward says
        out["converted, closed, evaluated"] = converted(
            torch.ones(1, 4, dtype=torch.float64)).dtype
    # Frozen, then cast down to save memory (fine-tuning's backbone): it sums nothing, and the
    # rest trains, summed.
    torch.manual_seed(ctx.worker_index)
    backbone = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    backbone.module[0].requires_grad_(False)
    backbone.module[0].double()
    head = backbone.module[1]
    backbone.module[0].register_forward_hook(lambda m, a, o: o.float())
    # Each worker's own input: its head's gradient alone would differ from the other's.
    x = torch.full((1, 4), ctx.worker_index + 1.0, dtype=torch.float64)
    backbone(x).sum().backward()
    out["frozen, then converted"] = head.weight.grad.clone()
    with torch.no_grad():
        out["frozen, local gradient"] = backbone.module[0](x).expand(2, 4).clone()
    backbone.close()
    return out


@functools.cache
def drop_in_arguments_run() -> list[dict]:
    return spawn(drop_in_arguments, workers=2, colocated=1)


@pytest.mark.timeout(60)
def test_a_process_group_other_than_the_workers_is_refused():
    for said in drop_in_arguments_run():  # the world group holds the servers too
        assert said["group"] == ("herring sums gradients over every worker (ranks [0, 1]), "
                                 "but process_group has ranks [0, 1, 2]. HINT: leave "
                                 "process_group out, or pass ctx.groups.workers")


@pytest.mark.timeout(60)
def test_a_comm_hook_on_the_drop_in_is_refused_with_the_ddp_that_takes_one():
    # Symptom: register_comm_hook(...), as on torch's DDP, raised AttributeError. Cause: the
    # drop-in sums through the servers itself and had no such method.
    for said in drop_in_arguments_run():
        assert said["comm hook"] == (
            "herring's DistributedDataParallel sums its gradients through Herring's servers "
            "itself, and takes no comm hook. HINT: to keep torch's DDP and its buckets, wrap "
            "the model in torch.nn.parallel.DistributedDataParallel(model, "
            "process_group=ctx.groups.workers) and register herring_hook on that")


@pytest.mark.timeout(60)
def test_a_process_group_that_is_not_a_group_is_refused_in_one_line():
    # Symptom: DDP(model, process_group="workers") raised a bare KeyError: 'workers'. Cause:
    # the group's ranks were read from torch without a check that it is a group.
    for said in drop_in_arguments_run():
        assert said["group name"] == (
            "herring sums gradients over every worker (ranks [0, 1]), but process_group is "
            "'workers', a str, not a process group. HINT: leave process_group out, or pass "
            "ctx.groups.workers")


@pytest.mark.timeout(60)
def test_a_model_converted_after_the_wrap_is_refused_at_the_next_forward():
    # Symptom: model.double() after the wrap trained on, its float64 gradients summed in the
    # float32 buffers laid out at the wrap (6.6e-10 off one process), silently. Cause:
    # nothing compared the parameters' dtype with the wrap's.
    for said in drop_in_arguments_run():
        assert said["converted"] == (
            "parameter 'weight' is float64 on cpu now, and was float32 on cpu at the wrap, "
            "which laid out its sums for that: the workers would step on sums of another "
            "dtype, or drift apart. HINT: convert the model (model.double(), .to(device)) "
            "before distribute() (or before wrapping it)")
    # Not refused: an evaluation under torch.no_grad() (open or closed), and a parameter
    # frozen before it was converted, whose gradients are not summed (the rest's are).
    first, second = drop_in_arguments_run()
    for said in first, second:
        assert said["converted, evaluated"] == said["converted, closed, evaluated"] == \
            torch.float64
    assert torch.equal(first["frozen, then converted"], second["frozen, then converted"])
    # The head's gradient is the mean of the workers' own (its input, per output row).
    mean = (first["frozen, local gradient"] + second["frozen, local gradient"]) / 2
    assert torch.allclose(first["frozen, then converted"], mean.float())


@pytest.mark.timeout(60)
def test_device_ids_of_more_than_one_device_is_refused_as_torch_ddp_refuses_it():
    # Symptom: device_ids=[0, 1] was taken, and only device 0 used. Cause: only
    # device_ids[0] was read; torch's DDP refuses more than one.
    for said in drop_in_arguments_run():
        assert said["two devices"] == (
            "device_ids holds one device, this process's, as torch's DDP takes it (got "
            "[0, 1]). HINT: pass device_ids=[local_rank], or leave it out")


@pytest.mark.timeout(60)
def test_no_sync_is_read_at_the_backward_as_bytepss_ddp_reads_it():
    # The rule the drop-ins keep (herring's and BytePS's share SyncedModule): a backward
    # inside no_sync() stays local, one outside sums, whichever side its forward ran on, and
    # so does a second backward of one forward. torch's DDP reads no_sync() at the forward
    # (docs/herring.md says so); a change to its rule left these local, with no word.
    for w, said in enumerate(drop_in_arguments_run()):
        check_no_sync_gradients(said["no_sync"], w)


@pytest.mark.timeout(60)
def test_none_for_bucket_cap_mb_and_broadcast_buffers_means_torchs_defaults():
    # bucket_cap_mb=None raised TypeError ('<' between float and None); broadcast_buffers=None
    # turned the broadcast off, where torch's DDP reads it as True.
    assert [said["mark"] for said in drop_in_arguments_run()] == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.timeout(60)
def test_a_worker_that_evaluates_alone_under_no_grad_leaves_the_others_in_step():
    # The drop-in broadcast the buffers at every forward, under no_grad() too, where torch's
    # DDP does not: worker 0's evaluation made 3 broadcasts the others never matched, and
    # the run ended in gloo's "Timed out waiting ... for send".
    assert [said["mark after evaluating"] for said in drop_in_arguments_run()] == \
        [[7.0, 7.0], [7.0, 7.0]]


@pytest.mark.timeout(60)
def test_device_ids_moves_the_inputs_there_as_torch_ddp_does():
    # device_ids was accepted and ignored: inputs stayed where they were.
    for said in drop_in_arguments_run():
        assert said["devices"] == ["meta", "meta", "meta"]


@pytest.mark.timeout(60)
def test_static_graph_and_init_sync_are_taken_and_init_sync_false_keeps_each_workers_weights():
    # Both raised TypeError: unexpected keyword argument.
    for said in drop_in_arguments_run():
        assert said["own weights kept"] is True


@pytest.mark.timeout(60)
def test_broadcast_buffers_false_keeps_each_workers_buffers_at_the_wrap_as_torch_ddp_does():
    # Worker 0's buffers overwrote every worker's at the wrap, where torch's DDP copies them
    # only with broadcast_buffers (rank-local buffers were lost).
    said = drop_in_arguments_run()
    for w, s in enumerate(said):
        assert s["local buffers"][0] == [w + 1.0, w + 1.0]
    assert torch.equal(said[0]["local buffers"][1], said[1]["local buffers"][1])  # parameters


@pytest.mark.timeout(60)
def test_options_that_differ_between_workers_are_refused_at_the_wrap_naming_them():
    # find_unused_parameters on worker 0 alone declared flags worker 1 never sent: a
    # CommTimeout about 'present[0]' after the timeout; broadcast_buffers, a gloo hang.
    for said in drop_in_arguments_run():
        assert said["options"] == [
            f"worker rank 1's DistributedDataParallel option {option} differs from worker rank "
            f"0's (machine node0: False; machine node0: True). HINT: pass the same options to "
            f"DistributedDataParallel on every worker"
            for option in ("broadcast_buffers", "find_unused_parameters")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leave, summed_first, where", [
    (False, False, "inside"), (True, False, "after a backward inside"),
    (True, True, "after a backward inside")])
def test_a_step_after_a_backward_inside_no_sync_and_none_outside_it_is_refused(
        leave, summed_first, where):
    # A step after leaving no_sync(), with every backward of the step inside it, was let
    # through: each worker applied only its own gradients, and the replicas drifted apart;
    # so was one whose step had a summed backward before the no_sync() one (summed_first).
    with pytest.raises(LaunchError, match=rf"optimizer.step\(\) {where} herring's no_sync\(\) "
                                          r"with no gradient synchronised since"):
        spawn(step_inside_no_sync, workers=2, colocated=1, args=(leave, summed_first))


class _Loud(nn.Module):
    """One float16 parameter whose gradient, 40000 on every worker, is past float16's range
    once summed over two."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def loud_script(kind: str) -> torch.Tensor:
    ctx = polytrain.init()
    model = nn.parallel.DistributedDataParallel(_Loud(), process_group=ctx.groups.workers)
    if kind == "hook":
        from polytrain.herring import HerringHookState, herring_hook
        model.register_comm_hook(HerringHookState(ctx), herring_hook)
    model(torch.full((8,), 40000.0, dtype=torch.float16)).backward()
    return model.module.w.grad.clone()


@pytest.mark.timeout(90)
def test_the_comm_hook_averages_float16_gradients_whose_sum_overflows_as_torch_ddp_does():
    # The hook summed the bucket and divided after: 80000 is inf in float16.
    torch_ddp = spawn(loud_script, workers=2, colocated=1, args=("torch",))[0]
    hook = spawn(loud_script, workers=2, colocated=1, args=("hook",))[0]
    assert torch.equal(torch_ddp, torch.full((8,), 40000.0, dtype=torch.float16))
    assert torch.equal(hook, torch_ddp)


class _Mixed(nn.Module):
    """A float32 and a float64 vector of 10 elements each, in their own DDP buckets: bucket 0
    holds the float64 one, until DDP rebuilds its buckets after the first step (in the order
    the gradients came) and bucket 0 holds the float32 one."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 10))
        self.shift = nn.Parameter(torch.linspace(-1.0, 1.0, 10, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * self.scale).double() + self.shift).tanh().float()


def mixed_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


class _Unanswered:
    """The engine, but no sum comes back (a worker that left the run): a timeout."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.sums, self.submit = engine.sums, engine.submit

    def wait(self, t):
        raise CommTimeout("rank 0: ddp bucket 0 did not complete within 8 s", "raise the timeout",
                          waited_s=8.0)


def hook_edges() -> dict:
    """The comm hook on _Mixed, on a model whose sums time out, and its refusals; the
    engine's sums after re-wrapping."""
    ctx = polytrain.init()
    from polytrain.herring import HerringHookState, herring_hook
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 10, generator=gen), torch.randn(4, 10, generator=gen)
    model = nn.parallel.DistributedDataParallel(_Mixed(), process_group=ctx.groups.workers)
    model.register_comm_hook(HerringHookState(ctx), herring_hook)
    mixed_steps(model, polytrain.shard(x, ctx.worker_index, ctx.num_workers),
                polytrain.shard(y, ctx.worker_index, ctx.num_workers))
    out: dict = {"mixed": {k.removeprefix("module."): v.detach().clone()
                           for k, v in model.state_dict().items()}}
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=ctx.groups.workers)
    state = HerringHookState(ctx)
    state.engine = _Unanswered(state.engine)
    model.register_comm_hook(state, herring_hook)
    out["timeout"] = _raised(lambda: model(torch.randn(2, 4)).sum().backward())
    # A dead weakref.proxy alive in the process, as libraries leave them: the hook's search
    # for its DDP among the live objects passes it by.
    dead = _Mixed()
    proxies = [weakref.proxy(dead)]
    del dead
    gc.collect()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=ctx.groups.workers)
    model.register_comm_hook(HerringHookState(ctx), herring_hook)
    out["dead proxy"] = _raised(
        lambda: model(torch.full((2, 4), ctx.worker_index + 1.0)).sum().backward())
    out["dead proxy grad"] = model.module.weight.grad
    del proxies
    out["colocate differs"] = refused(
        lambda: HerringHookState(ctx, colocate=ctx.worker_index == 0))
    # One state on three DDPs at once, and on three one after another (each bucket 0 of
    # another size: a third layout), then the engine's sums after closing and re-wrapping.
    out["shared"] = _raised(functools.partial(three_at_once, ctx))
    out["one after another"] = _raised(functools.partial(one_after_another, ctx))
    out["held"] = rewrapped(ctx)
    # A replica group of this worker alone: the hook would average over every worker.
    alone = dist.new_group([ctx.rank], use_local_synchronization=True)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=alone)
    model.register_comm_hook(HerringHookState(ctx), herring_hook)
    out["subgroup"] = _raised(lambda: model(torch.randn(2, 4)).sum().backward())
    out["dropped"] = dropped(ctx)
    # A backward after the state's close() (last: it leaves this DDP's reducer midway).
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=ctx.groups.workers)
    state = HerringHookState(ctx)
    model.register_comm_hook(state, herring_hook)
    model(torch.randn(2, 4)).sum().backward()
    state.close()
    out["after close"] = _raised(lambda: model(torch.randn(2, 4)).sum().backward())
    return out


def three_at_once(ctx) -> None:
    """One state on three DDPs of d inputs, d = 3, 4, 5, then a step of each."""
    from polytrain.herring import HerringHookState, herring_hook
    state = HerringHookState(ctx)
    models = [nn.parallel.DistributedDataParallel(nn.Linear(d, 2),
                                                  process_group=ctx.groups.workers)
              for d in (3, 4, 5)]
    for model in models:
        model.register_comm_hook(state, herring_hook)
    for d, model in zip((3, 4, 5), models):
        model(torch.randn(2, d)).sum().backward()


def one_after_another(ctx) -> None:
    """One state on a DDP of d inputs, d = 3, 4, 5, each registered after the last's step."""
    from polytrain.herring import HerringHookState, herring_hook
    state = HerringHookState(ctx)
    for d in (3, 4, 5):
        model = nn.parallel.DistributedDataParallel(nn.Linear(d, 2),
                                                    process_group=ctx.groups.workers)
        model.register_comm_hook(state, herring_hook)
        model(torch.randn(2, d)).sum().backward()


def _listed(engine, sums) -> int:
    """How many of ``sums`` the engine lists."""
    ids = {id(t) for t in engine.tensors}
    return sum(id(t) in ids for t in sums)


def rewrapped(ctx) -> list[int]:
    """The sums of this function's models that the engine holds: after a step of each of
    three drop-ins of one model, each closed and its ``.module`` wrapped again, then after a
    step of a comm hook's state (a closed model's sums stay listed, for a save of their
    codecs, until the next model declares its own)."""
    from polytrain.herring import DistributedDataParallel as DDP
    from polytrain.herring import HerringHookState, herring_hook
    from polytrain.ps.engine import engine_for
    engine = engine_for(ctx)
    held, sums = [], []
    net = nn.Linear(4, 2)
    for _ in range(3):
        model = DDP(net, find_unused_parameters=True)  # its flags' sum too
        model(torch.randn(2, 4)).sum().backward()
        sums += [*model.sync.tensors, model.sync._flags]
        held.append(_listed(engine, sums))
        model.close()
        net = model.module
    model = nn.parallel.DistributedDataParallel(net, process_group=ctx.groups.workers)
    state = HerringHookState(ctx)
    model.register_comm_hook(state, herring_hook)
    model(torch.randn(2, 4)).sum().backward()
    sums += state.sums.values()
    held.append(_listed(engine, sums))
    state.close()
    return held


def dropped(ctx) -> dict:
    """Three drop-ins, then three torch DDPs with a comm hook's state, each dropped after a
    step without close(): the sums of theirs the engine lists after each step, and how many
    states and waiter threads are left."""
    from polytrain.herring import DistributedDataParallel as DDP
    from polytrain.herring import HerringHookState, herring_hook
    from polytrain.ps.engine import engine_for
    engine = engine_for(ctx)
    out: dict = {"drop-in": [], "hook": []}
    sums: list = []
    net = nn.Linear(4, 2)
    for _ in range(3):
        model = DDP(net)
        model(torch.randn(2, 4)).sum().backward()
        sums += model.sync.tensors
        out["drop-in"].append(_listed(engine, sums))
        del model
        gc.collect()
    states, waiters = [], []
    for _ in range(3):
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2),
                                                    process_group=ctx.groups.workers)
        state = HerringHookState(ctx)
        model.register_comm_hook(state, herring_hook)
        model(torch.randn(2, 4)).sum().backward()
        sums += state.sums.values()
        out["hook"].append(_listed(engine, sums))
        states.append(weakref.ref(state))
        waiters.append(state._thread)
        del model, state
        gc.collect()
    for waiter in waiters:
        waiter.join(timeout=5.0)
    out["states left"] = sum(ref() is not None for ref in states)
    out["waiters left"] = sum(waiter.is_alive() for waiter in waiters)
    return out


def _raised(fn) -> str:
    """What ``fn()`` raised, as the user reads it, or "accepted"."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads what the user would see
        return f"{type(e).__name__}: {e}"
    return "accepted"


@functools.cache
def hook_edges_run() -> list[dict]:
    return spawn(hook_edges, workers=2, colocated=1)


@pytest.mark.timeout(90)
def test_the_comm_hook_sums_buckets_that_change_dtype_when_ddp_rebuilds_them():
    # Bucket 0 turned from float64 to float32 at the rebuild, with the same 10 elements, and
    # the hook's sum for it, keyed by size alone, refused: "'ddp bucket 0' was declared [10]
    # torch.float64 but got [10] torch.float32".
    hook = hook_edges_run()[0]["mixed"]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 10, generator=gen), torch.randn(4, 10, generator=gen)
    single = _Mixed()
    mixed_steps(single, x, y)
    assert max_abs_diff(single.state_dict(), hook) < 1e-6
    assert max_abs_diff(_Mixed().state_dict(), hook) > 1e-3


@pytest.mark.timeout(90)
def test_the_comm_hook_on_a_ddp_of_some_workers_is_refused_naming_its_group():
    # The hook averaged every bucket over all the workers, whatever the DDP's process_group
    # (two replica groups of 2 of 4 workers: 0.212 off torch's DDP), silently.
    for rank, said in enumerate(hook_edges_run()):
        assert said["subgroup"] == (
            f"ConfigError: herring_hook sums gradients over every worker (ranks [0, 1]), but "
            f"the process_group of the DistributedDataParallel it is registered on has ranks "
            f"[{rank}]. HINT: pass process_group=ctx.groups.workers to that "
            f"DistributedDataParallel, or leave the hook out of it"), said


@pytest.mark.timeout(90)
def test_the_comm_hook_sums_beside_a_dead_weakref_proxy():
    # Symptom: herring_hook failed at its first bucket with "ReferenceError: weakly-referenced
    # object no longer exists". Cause: its search for the DDPs it is registered on called
    # isinstance() on every live object, which reads a dead proxy's __class__.
    for said in hook_edges_run():
        assert said["dead proxy"] == "accepted", said
        # Each worker's gradient is 2 x (its index + 1) everywhere: averaged, 3.
        assert torch.equal(said["dead proxy grad"], torch.full((2, 4), 3.0))


@pytest.mark.timeout(90)
def test_the_comm_hooks_colocate_that_differs_between_workers_is_refused_naming_it():
    # Symptom: colocate=(ctx.worker_index == 0) was taken on both workers, which then
    # declared other servers; the run hung for --timeout and ended in a CommTimeout blaming
    # a push_pull only some workers run. Cause: the drop-in compares colocate across the
    # workers, the hook's state did not.
    for said in hook_edges_run():
        assert said["colocate differs"] == (
            "worker rank 1's HerringHookState option colocate differs from worker rank 0's "
            "(machine node0: False; machine node0: True). HINT: pass the same options to "
            "HerringHookState on every worker"), said


@pytest.mark.timeout(90)
def test_one_comm_hook_state_on_several_ddps_is_refused_with_one_state_per_ddp():
    # Symptom: three torch DDPs sharing one HerringHookState were refused as "bucket 0 of
    # 12 torch.float32 elements is past the 4096 buckets x 2 layouts it reserved. HINT:
    # raise bucket_cap_mb", which cannot help. Cause: the state keys its sums by bucket
    # index, which every DDP numbers from 0, and only counted the sizes bucket 0 came in.
    for said in hook_edges_run():
        assert said["shared"] == (
            "ConfigError: herring_hook's HerringHookState is registered on 3 "
            "DistributedDataParallel models, and keys its sums by bucket index, which each "
            "of them numbers from 0. HINT: make one HerringHookState per "
            "DistributedDataParallel"), said
        assert said["one after another"] == (
            "ConfigError: herring_hook's bucket 0 came in a third layout (12 torch.float32 "
            "elements; before: 8 torch.float32, 10 torch.float32 elements), where a "
            "DistributedDataParallel changes its buckets once (its rebuild after the first "
            "step): the HerringHookState serves another DistributedDataParallel's buckets "
            "too. HINT: make one HerringHookState per DistributedDataParallel"), said


@pytest.mark.timeout(90)
def test_closing_and_rewrapping_leaves_the_engine_no_sums_of_the_closed_models():
    # Symptom: each close() and wrap of .module again (the docs' way to unfreeze) kept
    # another model-sized CPU buffer for the run. Cause: the engine listed every sum ever
    # declared, and GradientSync.close() (HerringHookState.close()) only removed hooks.
    for said in hook_edges_run():
        # One model's sums at a time (its bucket, its flags): 2, 4, 6 before.
        assert said["held"] == [2, 2, 2, 1], said


@pytest.mark.timeout(90)
def test_models_dropped_without_close_leave_the_engine_no_sums_and_no_waiters():
    # Symptom: each drop-in or comm hook's state dropped without close() (torch's DDP has
    # none: a drop-in user re-wrapping per fold) kept a model-sized CPU buffer for the run,
    # and each state its waiter thread. Cause: a dropped sync's finalizer only removed its
    # hooks, and the waiter thread held its state, which was never collected.
    for said in hook_edges_run():
        assert said["dropped"] == {"drop-in": [1, 1, 1], "hook": [1, 1, 1],
                                   "states left": 0, "waiters left": 0}, said


@pytest.mark.timeout(90)
def test_a_backward_after_the_comm_hooks_state_closed_is_refused():
    # Symptom: the backward hung forever, past --timeout. Cause: close() stopped the
    # waiter, but the hook still sent the bucket and queued its future for the waiter.
    for said in hook_edges_run():
        assert said["after close"] == (
            "ConfigError: herring_hook's HerringHookState was closed (close() stopped its "
            "waiter and let its sums go), and sums no more buckets. HINT: close() it after "
            "the last backward; to train on, wrap the model in a new "
            "DistributedDataParallel and register a new HerringHookState on it"), said


@pytest.mark.timeout(90)
def test_a_sum_that_fails_under_the_comm_hook_reaches_the_user_as_polytrains_error():
    # The hook set the error as its future's exception, which DDP's reducer read as the
    # value: "RuntimeError: Unable to cast rank 0: ... to Tensor".
    assert hook_edges_run()[0]["timeout"] == ("CommTimeout: rank 0: ddp bucket 0 did not complete "
                                           "within 8 s. HINT: raise the timeout")


def refreeze_script(change: str) -> dict:
    """SGD with momentum and weight decay; the first layer's requires_grad changes at step 2,
    after the wrap."""
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[0].requires_grad_(change == "freeze")
    from polytrain.herring import DistributedDataParallel as DDP
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    at_change = None
    for step in range(4):
        if step == 2:
            model[0].requires_grad_(change == "unfreeze")
            at_change = model[0].weight.detach().clone()
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(polytrain.shard(x, ctx.worker_index, ctx.num_workers)),
                               polytrain.shard(y, ctx.worker_index, ctx.num_workers)).backward()
        opt.step()
    return {"at_change": at_change, "end": model[0].weight.detach().clone(),
            "grad": model[0].weight.grad}


@pytest.mark.timeout(90)
def test_a_parameter_frozen_after_the_wrap_is_left_alone_as_in_one_process():
    # Its gradient came back as zeros, and momentum and weight decay moved it.
    out = spawn(refreeze_script, workers=2, colocated=1, args=("freeze",))[0]
    assert out["grad"] is None
    assert torch.equal(out["end"], out["at_change"])


@pytest.mark.timeout(90)
def test_a_parameter_unfrozen_after_the_wrap_is_refused_naming_it():
    # It had no sum: each worker stepped on its own gradient, and the copies drifted apart.
    with pytest.raises(LaunchError, match=r"parameter '0.weight' requires a gradient, but did "
                                          r"not when the model was wrapped"):
        spawn(refreeze_script, workers=2, colocated=1, args=("unfreeze",))


def frozen_on_one_worker() -> dict:
    """Worker 1 freezes the first layer before the wrap, then, in a second model, after it."""
    ctx = polytrain.init()
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[0].requires_grad_(ctx.worker_index != 1)
    from polytrain.herring import DistributedDataParallel as DDP
    out = {"before": refused(lambda: DDP(model))}
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    ddp = DDP(model, find_unused_parameters=True)

    def steps() -> None:
        for step in range(3):
            if step == 1 and ctx.worker_index == 1:
                model[0].requires_grad_(False)
            ddp(torch.randn(4, 6)).sum().backward()
    out["after"] = refused(steps)
    return out


@pytest.mark.timeout(90)
def test_workers_that_freeze_other_parameters_are_refused_on_every_worker():
    # Their buckets differed: a declaration mismatch naming bucket keys on some workers, a
    # timeout on the others. Frozen on some workers after the wrap: the others stepped it,
    # and the copies drifted apart (0.045 in 3 steps), silently.
    for said in spawn(frozen_on_one_worker, workers=2, colocated=1):
        assert said["before"].startswith("worker rank 1's trained parameters (requires_grad) "
                                         "differs from worker rank 0's"), said
        assert said["before"].endswith("HINT: freeze the same parameters on every worker "
                                       "before wrapping the model")
        assert said["after"] == (
            "parameter '0.weight' is frozen (requires_grad False) on 1 of the 2 workers and "
            "trains on the others: they would step it and the rest would not, and the "
            "workers' copies would drift apart. HINT: freeze it on every worker at the same "
            "step, or on none"), said


class _Fragile(nn.Module):
    """Two layers; on worker 1 the gradient between them raises once (an out-of-memory
    error in backward, say), after the second layer's gradients have left."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.fail and h.requires_grad:
            self.fail = False
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("out of memory")))
        return self.b(h)


def skip_a_failed_batch() -> None:
    ctx = polytrain.init()
    torch.manual_seed(0)
    from polytrain.herring import DistributedDataParallel as DDP
    model = DDP(_Fragile(fail=ctx.worker_index == 1), bucket_cap_mb=1e-5)
    for _ in range(2):
        try:
            model(torch.randn(4, 6)).sum().backward()
        except RuntimeError:  # skip the batch, as a loop that survives OOM does
            continue


@pytest.mark.timeout(90)
def test_a_worker_that_skips_a_batch_whose_backward_failed_is_named_with_the_cause():
    # Its next backward was refused as 'had a gradient from 2 backward passes ... pass
    # backward_passes_per_step=N', advice that does not apply.
    with pytest.raises(LaunchError) as e:
        spawn(skip_a_failed_batch, workers=2, colocated=1)
    said = str(e.value)
    assert said.startswith("worker rank 1 (machine node0) failed: ConfigError: the last "
                           "backward pass on this worker raised after some of its gradients "
                           "had been sent to be summed"), said


@pytest.mark.parametrize("option, value, message", [
    ("colocate", "no", r"^DistributedDataParallel option colocate must be True or False \(got "
                       r"'no', a str\)\. HINT: pass colocate=True or colocate=False$"),
    ("find_unused_parameters", "false",
     r"^DistributedDataParallel option find_unused_parameters must be True or False \(got "
     r"'false', a str\)\. HINT: pass find_unused_parameters=True or "
     r"find_unused_parameters=False$"),
    ("broadcast_buffers", 1, r"^DistributedDataParallel option broadcast_buffers must be True "
                             r"or False, or None \(got 1, an int\)\."),
])
def test_the_drop_ins_options_of_the_wrong_kind_are_refused_in_one_line(option, value, message):
    # Symptom: DDP(model, colocate="no") kept a server on every worker machine ("no" is
    # true). Cause: the drop-in's own keywords went unchecked, where the strategy's
    # options (colocate=) are checked by kind.
    from polytrain.herring import DistributedDataParallel as DDP
    with pytest.raises(ConfigError, match=message):  # before it looks for a run
        DDP(nn.Linear(2, 2), **{option: value})


def test_the_drop_ins_positional_arguments_are_torch_ddps_in_its_order():
    # A script passing torch's DDP arguments by position met gradient_as_bucket_view where
    # torch has check_reduction (a review).
    import inspect

    from polytrain.strategies.herring.ddp import DistributedDataParallel

    ours = list(inspect.signature(DistributedDataParallel).parameters)
    theirs = list(inspect.signature(nn.parallel.DistributedDataParallel).parameters)
    upto = theirs.index("gradient_as_bucket_view") + 1
    assert ours[:upto] == theirs[:upto]


def test_several_servers_on_a_worker_machine_split_its_shard_as_on_a_cpu_machine():
    # Symptom: under torchrun with POLYTRAIN_ROLE=worker,worker,server,server on each of two
    # machines, the second server of each got no bytes, and nothing said so. Cause:
    # herring_servers kept only the first server of each worker machine (server_ranks').
    from types import SimpleNamespace

    from polytrain.comm.topology import Topology
    from polytrain.strategies.herring.ddp import herring_servers
    roles = ([("worker", "g0")] * 2 + [("server", "g0")] * 2 + [("worker", "g1")] * 2
             + [("server", "g1")] * 2 + [("server", "cpu0")])
    servers = herring_servers(SimpleNamespace(topology=Topology.from_roles(roles)),
                              colocate=True)
    assert servers == [(2, 3), (6, 7), (8,)]
    plan = plan_herring([TensorSpec("w", (6000,), torch.float32)], bucket_cap_bytes=1 << 20,
                        servers=servers, local_workers=2)
    # A machine's shard (a third of 24000 bytes), over its servers as a CPU machine's.
    assert plan.bytes_by_server() == {2: 4000, 3: 4000, 6: 4000, 7: 4000, 8: 8000}
