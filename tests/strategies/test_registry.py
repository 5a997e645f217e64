import os

import numpy
import pytest
import torch

import polytrain
from polytrain import ConfigError, LaunchError
from polytrain.checkpoint.state import _options_record
from polytrain.models import GPT
from polytrain.strategies.base import make_options
from tests.harness import spawn


def test_unknown_strategy_lists_the_valid_names():
    with pytest.raises(ConfigError, match=r"unknown strategy 'bytepz'; the strategies are: .*ddp"
                                          r".*single.*HINT"):
        polytrain.get_strategy("bytepz")


def test_unknown_strategy_option_lists_the_valid_ones():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"strategy 'single' has no option 'bucket_mb'; its "
                                          r"options are: none"):
        polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "single",
                             bucket_mb=25)



@pytest.mark.parametrize("strategy, options, message", [
    # Each was accepted from Python (strategy_options, or distribute()'s keywords): herring
    # kept its colocated servers for "no", "false" is a true value, and a partition of
    # 4096.5 bytes reached the engine.
    ("herring", {"colocate": "no"}, r"^strategy 'herring' option colocate must be True or "
                                    r"False \(got 'no', a str\)\. HINT: pass colocate=True or "
                                    r"colocate=False$"),
    ("ddp", {"find_unused_parameters": "false"},
     r"^strategy 'ddp' option find_unused_parameters must be True or False \(got 'false', a "
     r"str\)\. HINT: pass find_unused_parameters=True or find_unused_parameters=False$"),
    ("byteps", {"partition_bytes": 4096.5}, r"^strategy 'byteps' option partition_bytes must "
                                            r"be a whole number \(got 4096\.5\)\. HINT: pass "
                                            r"partition_bytes as a whole number$"),
    ("byteps", {"partition_bytes": 4096.0}, r"HINT: pass partition_bytes=4096$"),
    ("byteps", {"compress": 1}, r"^strategy 'byteps' option compress must be a str \(got 1, "
                                r"an int\)\. HINT: pass compress='none'$"),
    ("hetpipe", {"lag_beta2": "0.9"}, r"^strategy 'hetpipe' option lag_beta2 must be a number, "
                                      r"or None \(got '0\.9', a str\)\. HINT: pass "
                                      r"lag_beta2=0\.9$"),
    ("hetpipe", {"staleness": None}, r"^strategy 'hetpipe' option staleness must be a whole "
                                     r"number \(got None, a NoneType\)\. HINT: pass "
                                     r"staleness=0$"),
])
def test_a_strategy_option_of_the_wrong_kind_is_refused_in_one_line(strategy, options, message):
    with pytest.raises(ConfigError, match=message):
        make_options(polytrain.get_strategy(strategy), options)  # what distribute() calls
    if strategy == "herring":  # and TrainConfig, before any process starts
        with pytest.raises(ConfigError, match=message):
            polytrain.TrainConfig(strategy=strategy, model="mlp", strategy_options=options)


def test_strategy_options_take_what_their_fields_mean(tmp_path):
    # An int for a float, None where a field may be None, numpy's numbers and bools (a bool
    # kept as one), and a path for a str (kept as a str, as TrainConfig's paths are).
    herring = make_options(polytrain.get_strategy("herring"),
                           {"bucket_cap_mb": 1, "colocate": numpy.False_})
    assert (herring.bucket_cap_mb, herring.colocate) == (1, False)
    assert herring.colocate is False
    byteps = make_options(polytrain.get_strategy("byteps"),
                          {"partition_bytes": numpy.int64(8192), "compress_momentum": 0})
    assert (byteps.partition_bytes, byteps.compress_momentum) == (8192, 0)
    hetpipe = make_options(polytrain.get_strategy("hetpipe"),
                           {"inflight": None, "lag_beta2": None, "lag_lr": numpy.float32(0.5)})
    assert (hetpipe.inflight, hetpipe.lag_beta2, hetpipe.lag_lr) == (None, None, 0.5)
    cache = make_options(polytrain.get_strategy("pipetransformer"), {"cache_dir": tmp_path})
    assert cache.cache_dir == str(tmp_path)
    # numpy's numbers made Python's: a checkpoint's record of the options (JSON) left out
    # numpy.int64(8192), and a resume read back the default partition size.
    assert [type(v) for v in (byteps.partition_bytes, hetpipe.lag_lr)] == [int, float]
    assert _options_record(byteps)["partition_bytes"] == 8192
    # herring's bucket_cap_mb=None is its default, as torch's DDP reads it (refused once the
    # option's kind was checked, as a float alone).
    assert make_options(polytrain.get_strategy("herring"),
                        {"bucket_cap_mb": None}).bucket_cap_mb is None
    assert polytrain.TrainConfig(strategy="herring", model="mlp", strategy_options={
        "bucket_cap_mb": None}).strategy_options == {"bucket_cap_mb": None}


@pytest.mark.parametrize("strategy", ["byteps", "herring"])
def test_sparse_gradients_are_refused_before_start_where_the_engine_sums_dense_ones(strategy):
    # Every worker failed in its first backward, each with a traceback, and the hint named
    # sparse=False, which the CLI cannot pass.
    with pytest.raises(ConfigError, match=rf"parameter 'tok.weight' has sparse gradients .*, "
                                          rf"and strategy '{strategy}' sums dense ones\. HINT: "
                                          rf"train with --strategy parallax .* --dense-grads"):
        polytrain.TrainConfig(strategy=strategy, model="wordlm", workers=2, servers=1,
                              model_options={"vocab": 1000})
    polytrain.TrainConfig(strategy=strategy, model="wordlm", workers=2, servers=1,
                          model_options={"vocab": 1000, "dense_grads": True})

def test_single_returns_the_model_and_its_full_state():
    model = torch.nn.Linear(2, 3)
    wrapped, _ = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      "single")
    state = polytrain.full_state_dict(wrapped)
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], model.weight)


def test_a_model_distributed_twice_is_refused():
    # Accepted silently: ddp wrapped its DDP in another DDP, and hooks ran twice.
    model = torch.nn.Linear(2, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, _ = polytrain.distribute(model, opt, "single")
    for again in (model, wrapped):
        with pytest.raises(ConfigError, match=r"this model was already given to "
                                              r"polytrain.distribute\(\) \(strategy 'single'\)"
                                              r".*HINT: call distribute\(\) once per model"):
            polytrain.distribute(again, opt, "single")
    # A copy is another model (the mark is not an attribute that copies carry).
    import copy
    twin = copy.deepcopy(model)
    polytrain.distribute(twin, torch.optim.SGD(twin.parameters(), lr=0.1), "single")


def build_and_distribute(strategy: str) -> None:
    ctx = polytrain.init()
    torch.manual_seed(ctx.rank)  # different seeds: distribute must still agree the weights
    d_model = 32 if ctx.worker_index != 1 else 48
    model = GPT(seq_len=8, d_model=d_model, layers=1, heads=4)
    polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)


def agree_on_weights(strategy: str) -> tuple[list[torch.Tensor], dict]:
    ctx = polytrain.init()
    torch.manual_seed(ctx.rank)
    model = GPT(seq_len=8, d_model=16, layers=1, heads=2)
    wrapped, _ = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      strategy)
    weights = [p.detach().clone() for p in wrapped.parameters()]
    return weights, nested_then_closed(wrapped) if strategy == "herring" else {}


def nested_then_closed(wrapped: torch.nn.Module) -> dict:
    """A herring DDP's state inside another module, changed and loaded back (its keys bare
    at every level), and what its forward says after close()."""
    from tests.harness import refused
    outer = torch.nn.ModuleDict({"net": wrapped})
    state = {k: v + 1 for k, v in outer.state_dict().items()}
    outer.load_state_dict(state)
    inner = wrapped.module.state_dict()
    top = wrapped.state_dict()
    wrapped.load_state_dict(top)  # the bare keys at the top too
    loaded = all(torch.equal(inner[k.removeprefix("net.")], v) for k, v in state.items())
    # What torch's load says names the keys as the state has them (it said "module.x").
    first = next(iter(top))
    lacking = outer.load_state_dict({**{k: v for k, v in state.items() if k != "net." + first},
                                     "net.extra": torch.zeros(1)}, strict=False)
    wrong = []
    for value in (torch.zeros(3, 1, 2), 1.0):  # another shape; not a tensor
        try:
            wrapped.load_state_dict({**top, first: value})
            wrong.append("loaded")
        except RuntimeError as e:  # torch's own error, as for the bare model
            wrong.append(str(e))
    polytrain.strategy_of(wrapped).close()
    wrapped.close()  # twice is fine
    x = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        evaluated = [wrapped(x).shape, wrapped.eval()(x).shape]  # evaluating after close
    wrapped.train()
    return {"keys": sorted(state), "top": sorted(top), "inner": sorted(inner), "loaded": loaded,
            "first": first, "lacking": (lacking.missing_keys, lacking.unexpected_keys),
            "wrong": wrong, "evaluated": evaluated,
            "closed": refused(lambda: wrapped.eval()(x))}  # eval mode trains too


# herring's drop-in DDP copies the weights itself; distribute checks the model for both.
@pytest.mark.parametrize("strategy", ["ddp", "herring"])
@pytest.mark.timeout(60)
def test_workers_whose_models_differ_get_one_clear_error(strategy):
    with pytest.raises(LaunchError, match=r"ConfigError: worker rank 1's model differs from "
                                          r"worker rank 0's: .*'embed.tok.weight' is \[256, 32\] "
                                          r"torch.float32 on worker rank 0 but \[256, 48\].*"
                                          r"HINT: build the same model"):
        spawn(build_and_distribute, workers=3, colocated=int(strategy == "herring"),
              args=(strategy,))


def distribute_other_optimizers(strategy: str, case: str) -> None:
    ctx = polytrain.init()
    model = GPT(seq_len=8, d_model=16, layers=1, heads=2)
    other = ctx.worker_index == 1
    if case == "class":
        opt = (torch.optim.Adam if other else torch.optim.SGD)(model.parameters(), lr=0.1)
    elif case == "lr":
        opt = torch.optim.SGD(model.parameters(), lr=0.2 if other else 0.1)
    else:  # the same settings, other parameter groups
        params = list(model.parameters())
        groups = ([{"params": params[:2], "weight_decay": 0.0}, {"params": params[2:]}]
                  if other else [{"params": params[:3], "weight_decay": 0.0},
                                 {"params": params[3:]}])
        opt = torch.optim.SGD(groups, lr=0.1, weight_decay=0.01)
    polytrain.distribute(model, opt, strategy)


@pytest.mark.parametrize("strategy, case, message", [
    ("ddp", "class", r"it is Adam, not SGD"),
    ("byteps", "lr", r"it sets lr 0.2 in parameter group 0, not 0.1"),
    ("ddp", "groups", r"it holds other parameters in parameter group 0"),
])
@pytest.mark.timeout(60)
def test_workers_whose_optimizers_differ_get_one_clear_error(strategy, case, message):
    with pytest.raises(LaunchError, match=r"ConfigError: worker rank 1's optimizer differs from "
                                          r"worker rank 0's: " + message + r".*HINT: build the "
                                          r"same optimizer"):
        spawn(distribute_other_optimizers, workers=2, args=(strategy, case))


@pytest.mark.parametrize("strategy", ["ddp", "herring"])
@pytest.mark.timeout(60)
def test_parameters_start_identical_on_every_worker(strategy):
    (a, nested), (b, _) = spawn(agree_on_weights, workers=2,
                                colocated=int(strategy == "herring"), args=(strategy,))
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
    if strategy != "herring":
        return
    # herring's DDP nested in another module (a ModuleDict, AveragedModel) could not load
    # its own state_dict: "Missing key(s) net.module.a.weight" (its state_dict and
    # load_state_dict dropped "module." at the top only, and nesting never calls them).
    assert nested["keys"] == ["net." + k for k in nested["inner"]] == \
        ["net." + k for k in nested["top"]] and nested["loaded"], nested
    # After close() (its gradient hooks removed) a step was accepted, summing nothing: the
    # workers' weights drifted apart.
    first = nested["first"]
    assert nested["lacking"] == (["net." + first], ["net.extra"]), nested
    shape, kind = nested["wrong"]
    assert f"size mismatch for {first}: copying a param with shape torch.Size([3, 1, 2])" in \
        shape and f'While copying the parameter named "{first}"' in kind and \
        "module." not in shape + kind, nested["wrong"]
    # After close() (its gradient hooks removed) a step was accepted, summing nothing: the
    # workers' weights drifted apart. Evaluating (no_grad, or eval mode) is not training.
    shape = nested["evaluated"][0]
    assert nested["evaluated"] == [shape, shape] and shape[:2] == (1, 8), nested["evaluated"]
    assert nested["closed"] == (
        "this DistributedDataParallel was closed (close() removed its gradient hooks): a "
        "forward with gradients on now would train this worker's copy alone. HINT: close() "
        "it after the last step; evaluate it under torch.no_grad(), or train its .module, or "
        "wrap that again"), nested


def freeze_on_one_worker(strategy: str) -> str:
    from polytrain.models import cross_entropy
    from polytrain.models.gpt_moe import gpt_moe
    from tests.harness import refused
    ctx = polytrain.init()
    model = (gpt_moe(seq_len=8, d_model=16, layers=2, heads=2, experts=2) if strategy == "moe"
             else GPT(seq_len=8, d_model=16, layers=2, heads=2))
    model.embed.requires_grad_(ctx.worker_index != 1)
    return refused(lambda: polytrain.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, loss_fn=cross_entropy))


# Herring's and BytePS's drop-in DDP checked this, no other strategy: under moe the
# workers' dense buckets differed (a gloo size mismatch, or a timeout).
@pytest.mark.parametrize("strategy", ["moe", "hetpipe", "ddp"])
@pytest.mark.timeout(60)
def test_workers_that_freeze_other_parameters_are_refused_under_every_strategy(strategy):
    for said in spawn(freeze_on_one_worker, workers=2, args=(strategy,)):
        assert said.startswith("worker rank 1's trained parameters (requires_grad) differs "
                               "from worker rank 0's: worker rank 1 lacks 'embed.tok.weight' [256, "
                               "16], which worker rank 0 has"), said


def train_on_own_corpus() -> None:
    import polytrain.data
    from polytrain.train.loop import train

    if os.environ["RANK"] == "1":  # another Python's standard library, say
        other = polytrain.data.stdlib_corpus().clone()
        other[:100] = ord("#")
        polytrain.data._DATASETS["text"] = lambda: other
    train(polytrain.TrainConfig(strategy="ddp", workers=2, steps=1, batch_size=4,
                                model_options={"seq_len": 8, "d_model": 16, "layers": 1},
                                quiet=True))


@pytest.mark.timeout(60)
def test_workers_whose_corpora_differ_get_one_clear_error():
    # Each sliced its share of another "global" batch, and nothing said so.
    with pytest.raises(LaunchError, match=r"ConfigError: worker rank 1's corpus \(the data "
                                          r"set's token ids, by sha256\) differs from worker "
                                          r"rank 0's \(machine node0: [0-9a-f]{64}; machine "
                                          r"node0: [0-9a-f]{64}\).*HINT: run every machine on "
                                          r"the same Python, with the same standard library"):
        spawn(train_on_own_corpus, workers=2)
