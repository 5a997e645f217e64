"""Cluster specs, per-layer profiles and the emulated device clock."""

import json
import time

import pytest
import torch

from polytrain import ConfigError
from polytrain.emulation.clock import DeviceClock, clock_of, emulate
from polytrain.emulation.devices import BUILTIN_TYPES, DeviceType, parse_cluster
from polytrain.emulation.profile import profile_model
from polytrain.models import GPT
from polytrain.pipeline import Stage, make_stage
from polytrain.pipeline.assembly import check_cuts
from polytrain.wrapper import Wrapper


def test_spec_string_with_builtin_and_user_types_and_links():
    c = parse_cluster("big=8/4096, m0:big+fast*2, m1:slow*3, link=2000/50")
    assert [d.describe() for d in c.devices] == [
        "m0/0 big", "m0/1 fast", "m0/2 fast", "m1/0 slow", "m1/1 slow", "m1/2 slow"]
    assert c.types["big"].gflops == 8 and c.types["big"].memory_mb == 4096
    assert c.bandwidth(c.devices[0], c.devices[1]) == 2000e6
    assert c.bandwidth(c.devices[0], c.devices[3]) == 50e6
    assert "links: 2000 MB/s inside a machine, 50 MB/s across" in c.describe()


def test_spec_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"types": {"tiny": {"gflops": 1, "memory_mb": 8}},
                                "machines": {"a": ["tiny", "fast"], "b": ["slow", "slow"]},
                                "link_mb_s": {"intra": 500, "inter": 20}}))
    c = parse_cluster(str(path))
    assert [d.type.name for d in c.devices] == ["tiny", "fast", "slow", "slow"]
    assert c.inter_mb_s == 20
    c.check_layout(4, 2)
    # Each was a raw ValueError, or read "m0" as machine "m" of a type called "0".
    for bad, said in (({"machines": ["m0"]}, r'"machines" must map each machine'),
                      ({"machines": {"m0": "fast"}}, r"must be a list of type names"),
                      ({"machines": {"m0": ["x"]}, "types": {"x": {"gflops": "many",
                                                                  "memory_mb": 8}}},
                       r"TypeError: 'many' is not a number"),
                      # Each was accepted: a misnamed key fell back to its default, true was
                      # 1 GFLOP/s, a string a number.
                      ({"machines": {"m0": ["fast"]}, "link_mb_s": {"intra_mb_s": 5}},
                       r"\"link_mb_s\" has 'intra_mb_s', and takes only 'intra', 'inter'"),
                      ({"machines": {"m0": ["fast"]}, "links": {}},
                       r"the file has 'links', and takes only 'machines'"),
                      ({"machines": {"m0": ["x"]}, "types": {"x": {"gflops": True,
                                                                  "memory_mb": 8}}},
                       r"True is not a number"),
                      ({"machines": {"m0": ["x"]}, "types": {"x": {"gflops": 1,
                                                                  "memory_mb": "4096"}}},
                       r"'4096' is not a number")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=r"--devices: .* lacks, misnames or mistypes a "
                                              r"field \(.*" + said):
            parse_cluster(str(path))
    # json keeps a repeated key's last value: m0's two fast devices were lost, silently.
    path.write_text('{"machines": {"m0": ["fast", "fast"], "m0": ["slow"]}}')
    with pytest.raises(ConfigError, match=r"'m0' appears twice in one object of the file"):
        parse_cluster(str(path))
    for bad, said in (({"machines": {"a b": ["fast"]}}, r"machine name 'a b' is not a plain"),
                      ({"machines": {"m0": ["fast"]}, "types": {"fast": {
                          "gflops": 1000, "memory_mb": 1}}}, r"defines device type 'fast', "
                                                             r"which is built in")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=said):
            parse_cluster(str(path))


@pytest.mark.parametrize("spec, message", [
    ("m0:quick*2", r"unknown device type 'quick'; the types are: fast, mid, slow.*HINT: define"),
    ("m0:fast*2,m0:slow", r"machine 'm0' appears twice"),
    ("m0 fast", r"cannot read 'm0 fast'.*HINT: write machines as NAME:TYPE\*COUNT"),
    ("x=0/10,m0:x", r"needs a positive, finite rate"),
    ("x=8/1e999,m0:x", r"needs a positive, finite rate and memory \(got 8.0 GFLOP/s, inf MiB"),
    ("", r"at least one machine"),
    # A typo made a list of 2e10 names (a long stall, then MemoryError); *0, no device.
    ("m0:fast*20000000000", r"'fast\*20000000000' in 'm0:fast\*20000000000' asks for "
                            r"20000000000 devices, and a machine holds 1 to 1024"),
    ("m0:fast*0", r"asks for 0 devices"),
    # Both read as 'm0:fast*2,m1:slow*2': an empty item was skipped.
    ("m0:fast*2,,m1:slow*2", r"^--devices: 'm0:fast\*2,,m1:slow\*2' has an empty item \(two "
                             r"commas in a row, or one at an end\)\. HINT: join"),
    ("m0:fast*2,", r"^--devices: 'm0:fast\*2,' has an empty item"),
    # Accepted before: a third field dropped, infinite links, 2048 devices on one machine,
    # and a type defined twice (the last won, over a built-in's too).
    ("m0:fast,link=1/2/3", r"cannot read link bandwidths 'link=1/2/3' \(two numbers"),
    ("m0:fast,link=inf/inf", r"link bandwidths must be positive and finite"),
    ("m0:fast*1024+fast*1024", r"machine 'm0' holds 2048 devices, and a machine holds 1 to "
                               r"1024"),
    ("big=8/4096,m0:big,big=1/0.5", r"device type 'big' is defined twice. HINT"),
    ("fast=1000/1,m0:fast", r"device type 'fast' is defined twice \(it is built in\)"),
])
def test_bad_specs_are_refused_with_a_hint(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_cluster(spec)


def test_links_in_any_case_set_the_links_and_a_type_no_machine_uses_is_refused():
    # Symptom: 'm0:fast*2,LINK=2000/10' ran with the default links (1000/100 MB/s), without a
    # word. Cause: only a lower-case 'link=' was a link; 'LINK=' read as a new device type,
    # which no machine used.
    c = parse_cluster("m0:fast*2,LINK=2000/10")
    assert (c.intra_mb_s, c.inter_mb_s) == (2000.0, 10.0)
    assert sorted(c.types) == ["fast", "mid", "slow"]
    assert parse_cluster("Link=3/4,m0:fast").inter_mb_s == 4.0
    with pytest.raises(ConfigError, match=r"^--devices defines device types 'big', 'huge' that "
                                          r"no machine uses \(the machines use fast\)\. HINT: "
                                          r"list them on a machine \(e\.g\. m0:big\*2\), or "
                                          r"leave their definitions out$"):
        parse_cluster("big=8/4096,huge=16/8192,m0:fast")
    # A machine's misspelt type is named as unknown, not listed among the types in use.
    with pytest.raises(ConfigError, match=r"machine 'm0' uses unknown device type 'bgi'"):
        parse_cluster("big=8/4096,m0:bgi*2")


def test_layout_must_match_the_cluster():
    c = parse_cluster("m0:fast*2,m1:slow*2")
    c.check_layout(4, 2)
    with pytest.raises(ConfigError, match=r"describes 4 devices on 2 machines but the run has "
                                          r"2 workers on 1 machines"):
        c.check_layout(2, 1)
    with pytest.raises(ConfigError, match="different numbers of devices"):
        parse_cluster("m0:fast*2,m1:slow").check_layout(3, 2)


@pytest.mark.timeout(20)
def test_an_explicit_one_machine_that_contradicts_the_devices_is_refused():
    # `--devices m0:fast*2,m1:fast*2 --nodes 1` ran on the devices' 2 machines, saying
    # nothing, while --nodes 3 was refused: a given 1 was taken for the default (nodes != 1).
    from polytrain import TrainConfig
    from polytrain.plan import Job

    c = parse_cluster("m0:fast*2,m1:fast*2")
    assert c.fit_layout(None, None) == (4, 2)
    for nodes in (1, 3):
        message = rf"describes 4 devices on 2 machines but the run has 4 workers on {nodes} "
        with pytest.raises(ConfigError, match=message):
            c.fit_layout(None, nodes)
        with pytest.raises(ConfigError, match=message):
            TrainConfig(devices="m0:fast*2,m1:fast*2", nodes=nodes)
        with pytest.raises(ConfigError, match=message):
            Job(model="mlp", devices="m0:fast*2,m1:fast*2", nodes=nodes)
    # Left out, nodes is the devices' machines, or 1 without devices.
    assert TrainConfig(devices="m0:fast*2,m1:fast*2").nodes == 2
    assert TrainConfig().nodes == Job(model="mlp").nodes == 1


def test_profile_of_gpt_counts_blocks_head_and_memory():
    model = GPT(seq_len=16, d_model=32, layers=2, heads=2)
    p = profile_model(model, torch.zeros(3, 16, dtype=torch.long))
    assert p.names == ("embed", "h0", "h1", "head")
    d, t, v = 32, 16, 256
    # a block: qkv, proj and the two MLP matmuls, plus attention's two (t x t) products
    block = 2 * t * d * 3 * d + 2 * t * d * d + 2 * 2 * t * d * 4 * d + 2 * 2 * t * t * d
    assert p.layers[1].fwd_flops == block and p.layers[1].bwd_flops == 2 * block
    assert p.layers[3].fwd_flops == 2 * t * d * v
    assert p.layers[0].param_bytes == (v + t) * d * 4
    assert p.layers[1].out_bytes == t * d * 4 and p.layers[1].out_shape == (t, d)
    assert p.layers[1].act_bytes > p.layers[1].out_bytes  # it saves more than its output
    assert p.param_bytes == sum(x.numel() * 4 for x in model.parameters())
    assert all(x.device.type == "cpu" for x in model.parameters())  # profiled on a copy


class _Skip(torch.nn.Module):
    """Its forward adds the input back after the second child: not a chain of children."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)) + x)


class _Reordered(torch.nn.Module):
    """Its children are called in another order than they were registered in."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.body = torch.nn.Linear(4, 2), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _InPlace(torch.nn.Module):
    """A ReLU in place between its children: the same tensor, changed."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.relu_()
        return self.b(h)


class _Scaled(torch.nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_the_profile_says_where_a_forward_is_not_a_chain_of_its_children():
    x = torch.zeros(2, 4)
    chain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert profile_model(chain, x).chain_break is None
    assert profile_model(GPT(seq_len=8, d_model=16, layers=2, heads=2),
                         torch.zeros(1, 8, dtype=torch.long)).chain_break is None
    assert profile_model(_Skip(), x).chain_break == \
        "child 'c' does not get the previous child's output"
    assert profile_model(_Reordered(), x).chain_break == "child 'body' runs where 'head' should"
    assert profile_model(_InPlace(), x).chain_break == \
        "the previous child's output is changed in place before child 'b'"  # the ReLU
    assert profile_model(_Scaled(torch.nn.Linear(4, 4)), x).chain_break == \
        "the model does not return its last child's output as it was"
    relu = torch.nn.ReLU()  # one module twice: a cut has no place for its second call
    assert profile_model(torch.nn.Sequential(torch.nn.Linear(4, 4), relu, torch.nn.Linear(4, 4),
                                             relu), x).chain_break == "child '1' runs a second time"
    with pytest.raises(ConfigError, match=r"_Skip's forward is not its top-level children run "
                                          r"one after another \(child 'c' does not get the "
                                          r"previous child's output\).*HINT: .*nn\.Sequential"):
        make_stage(_Skip(), [0, 2, 3], 0, ranks=[0, 1], labels=["s0", "s1"], links=[0.0],
                   profile=profile_model(_Skip(), x), transport=None, loss_fn=None)


class _Pair(torch.nn.Module):
    """Returns its output and a sum as a tuple; takes a tensor or such a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h = h[0] if isinstance(h, tuple) else h
        return self.lin(h), h.sum()


class _First(torch.nn.Module):
    def forward(self, h: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return h[0]


def test_a_child_that_passes_a_tuple_on_is_refused_where_a_pipeline_is_cut_after_it():
    # Symptom: a child passing (output, sum) to the next child passed every check of
    # hetpipe and pipetransformer; every step then failed on the worker with "'tuple' object
    # has no attribute 'detach'" and a traceback. Cause: the profile measured the tuple's
    # first tensor only, and a stage sends one tensor to the next. The last child may
    # return a tuple (the loss function gets it); emulation runs a tuple through as it is.
    # Then every such model was refused, whatever its cuts: hetpipe's plan (0, 4, 5) with the
    # tuple inside stage 0, and pipelines of one stage (hetpipe's policy np, pipetransformer
    # with K = 1), which trained before. Cause: the profile kept the first such child only,
    # and the refusal did not look at the cuts.
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Pair(), _Pair(), _First(),
                                torch.nn.Linear(4, 2))
    profile = profile_model(model, x)
    assert profile.not_one_tensor == ((1, "tuple"), (2, "tuple"))
    assert profile_model(torch.nn.Sequential(torch.nn.Linear(4, 4), _Pair()),
                         x).not_one_tensor == ()

    def stage(bounds: list[int], **kw: bool) -> Stage:
        ranks = list(range(len(bounds) - 1))
        built = make_stage(model, bounds, 0, ranks=ranks, labels=[f"s{r}" for r in ranks],
                           links=[0.0] * (len(ranks) - 1), profile=profile, transport=None,
                           loss_fn=torch.nn.functional.mse_loss, **kw)
        built.close(wait=False)
        return built

    # Cuts planned once (hetpipe's) that keep the tuples inside a stage, and one stage: built,
    # and the tuples pass from child to child as in one process.
    assert stage([0, 4, 5], cuts_move=False).names == [
        "0.weight", "0.bias", "1.lin.weight", "1.lin.bias", "2.lin.weight", "2.lin.bias"]
    alone = stage([0, 5])
    loss = alone.forward(0, batch=2, inputs=x, targets=y)
    assert loss is not None and torch.equal(loss, torch.nn.functional.mse_loss(model(x), y))
    hint = ("HINT: return one tensor from every child but the last (pack several into one), "
            "or wrap the children that pass several in one child module")
    # A cut right after one (a frozen front of 2 layers too), each named.
    for bounds, child in (([0, 2, 5], 1), ([0, 3, 5], 2), ([3, 5], 2)):
        with pytest.raises(ConfigError) as refused:
            stage(bounds, cuts_move=False)
        assert str(refused.value) == (
            f"Sequential's child '{child}' returns a tuple to the next child, but the pipeline "
            f"is cut right after it (stage bounds {tuple(bounds)}), and pipeline stages send "
            f"one tensor between layers. {hint}")
    with pytest.raises(ConfigError) as refused:
        check_cuts(model, profile, (0, 2, 5), label="virtual worker 1's pipeline")
    assert str(refused.value).startswith("Sequential's child '1' returns a tuple to the next "
                                         "child, but virtual worker 1's pipeline is cut ")
    # Cuts a later plan moves (pipetransformer's AutoPipe; the default), with more than one
    # stage: refused wherever they are now.
    with pytest.raises(ConfigError) as refused:
        stage([0, 4, 5])
    assert str(refused.value) == (
        "Sequential's child '1' returns a tuple to the next child, but the pipeline has 2 "
        "stages whose cuts move as it trains (one may fall right after it), and pipeline "
        f"stages send one tensor between layers. {hint}")


def test_emulated_device_waits_out_the_layer_time():
    model = GPT(seq_len=16, d_model=32, layers=2, heads=2)
    x = torch.zeros(4, 16, dtype=torch.long)
    profile = profile_model(model, x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    slowest = BUILTIN_TYPES["slow"].__class__(name="crawl", gflops=0.2, memory_mb=64)
    clock = emulate(model, slowest, profile)
    assert clock_of(model) is clock
    # Through wrappers of wrappers (Parallax's evaluation model holds DDP's): its held-out
    # evaluation ran at the emulated device's speed, the clock never paused.
    wrapper = Wrapper()
    wrapper.module = Wrapper()
    wrapper.module.module = model
    assert clock_of(wrapper) is clock and clock_of(torch.nn.Linear(2, 2)) is None
    expected = 4 * profile.flops / 0.2e9
    start = time.monotonic()
    model(x).sum().backward()
    opt.step()  # queued behind the device's work: it does not wait for it
    clock.wait()  # the emulated backward has finished
    took = time.monotonic() - start
    assert clock.emulated_s == pytest.approx(expected, rel=1e-9)
    assert expected <= took < expected + 0.5
    assert clock.hidden_fraction > 0.5  # the real compute hid inside the emulated time


def gradients_leaving() -> tuple[dict[str, float], float]:
    """A step of DDP on an emulated device: how long the device still had to go when each
    gradient reached a hook registered after emulate (as a strategy's) and DDP's bucket
    reached its comm hook; and how long the clock waited."""
    import polytrain
    polytrain.init()  # one process: torch's DDP on polytrain's own gloo group
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x = torch.randn(32, 64)
    clock = emulate(model, DeviceType(name="crawl", gflops=0.01, memory_mb=64),
                    profile_model(model, x))
    early: dict[str, float] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda _p, n=name: early.__setitem__(n, clock.due - time.monotonic()))
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # its reducer hooks in C++
    ddp.register_comm_hook(None, lambda _state, bucket: _reduce_early(bucket, clock, early))
    ddp(x).sum().backward()
    return early, clock.waited_s


@pytest.mark.timeout(60)
def test_a_layers_gradients_leave_the_device_once_its_emulated_backward_ends():
    # Symptom: DDP's reducer (and BytePS's, Herring's gradient hooks) got each layer's
    # gradients while the emulated device was still computing them (an MLP's first layer:
    # 0.166 s early), and communicated a whole layer's backward early. Cause: the hook on a
    # layer's output only started its emulated backward; the real one ran at once.
    # (In a process of its own: a group made here with a HashStore once hung the suite.)
    from tests.harness import spawn
    [(early, waited_s)] = spawn(gradients_leaving, workers=1)
    assert sorted(early) == ["0.bias", "0.weight", "2.bias", "2.weight", "ddp"]
    # Each layer's last gradient, and DDP's bucket, once the device is done (the first
    # layer's were 0.05 s early). Only the last waits: waiting at a layer's first gradient,
    # the rest of its real backward ran after its emulated time, not inside it.
    assert early["ddp"] < 1e-3, early
    assert min(early["0.weight"], early["0.bias"]) < 1e-3, early
    assert min(early["2.weight"], early["2.bias"]) < 1e-3, early
    assert waited_s > 0.05  # the device took its time


def _reduce_early(bucket: torch.distributed.GradBucket, clock: DeviceClock,
                  early: dict[str, float]) -> torch.futures.Future[torch.Tensor]:
    early["ddp"] = clock.due - time.monotonic()
    work = torch.distributed.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


@pytest.mark.parametrize("layers, message", [
    # Symptom: zip() stopped at the shorter, and a model of 3 layers given a profile of 2
    # ran its third at real speed, without a word; a name that differed was a bare ValueError.
    (3, r"the profile does not fit the model: the model's layer 2 \('2'\) has no profile \(the "
        r"model has 3 layers, the profile 2\)"),
    (1, r"the profile does not fit the model: the profile's layer 1 \('1'\) is not in the model "
        r"\(the model has 1 layer, the profile 2\)"),
    ("renamed", r"the profile does not fit the model: layer 1 is 'out' in the model, '1' in the "
                r"profile \(the model has 2 layers, the profile 2\)"),
])
def test_a_profile_of_another_model_is_refused_before_any_layer_is_timed(layers, message):
    x = torch.zeros(4, 8)
    profiled = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model = (torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
             if isinstance(layers, int) else torch.nn.Sequential())
    if layers == "renamed":
        model.add_module("0", torch.nn.Linear(8, 8))
        model.add_module("out", torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match=message + r"\. HINT: profile the model you emulate: "
                                          r"emulate\(model, device_type, "
                                          r"profile_model\(model, sample\)\)$"):
        emulate(model, BUILTIN_TYPES["slow"], profile_model(profiled, x))
    assert clock_of(model) is None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
