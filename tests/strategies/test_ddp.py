"""``ddp``: a parameter that gets no gradient is named, or allowed with find_unused_parameters."""

import pytest
import torch
from torch import nn

import polytrain
from polytrain import LaunchError
from tests.harness import spawn


class HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def train(options: dict) -> dict[str, torch.Tensor]:
    ctx = polytrain.init()
    torch.manual_seed(0)
    model = HalfUsed()
    trainer = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp",
                                   loss_fn=lambda out, y: (out - y).square().mean(), **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 4, generator=g)
        trainer.step(x, x.flip(1))
    assert ctx.num_workers == 2
    return {k: v.clone() for k, v in trainer.state_dict().items()}


@pytest.mark.timeout(60)
def test_unused_parameters_are_named_with_the_option_that_allows_them():
    with pytest.raises(LaunchError, match=r"ConfigError: parameters 'unused.weight', "
                                          r"'unused.bias' got no gradient in the last backward"
                                          r".*HINT: pass --find-unused-parameters"):
        spawn(train, workers=2, args=({},))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def freeze_after_wrapping() -> None:
    polytrain.init()
    torch.manual_seed(0)
    # Nothing to train: torch's DDP raised its RuntimeError with a traceback at the wrap.
    frozen = Chain().requires_grad_(False)
    with pytest.raises(polytrain.ConfigError, match=r"^ddp has no gradient to all-reduce: "
                                                    r"no parameter of the model requires one "
                                                    r"\(it has 8, none with requires_grad="
                                                    r"True\)\. HINT: set requires_grad=True "):
        polytrain.distribute(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1), "ddp")
    # Frozen at the wrap and trained later: ddp reduced no gradient of it, so each worker
    # stepped on its own and the copies drifted apart (3.7e-2 in 4 steps), silently.
    late = Chain()
    late.a.requires_grad_(False)
    wrapped, opt = polytrain.distribute(late, torch.optim.SGD(late.parameters(), lr=0.1),
                                        "ddp", find_unused_parameters=True)
    late.a.requires_grad_(True)
    with pytest.raises(polytrain.ConfigError, match=r"^parameter 'a\.weight' requires a "
                                                    r"gradient, but did not when the model "
                                                    r"was wrapped: .* HINT: set "
                                                    r"requires_grad=True before distribute\(\)"):
        wrapped(torch.randn(2, 4))
    # Converted after the wrap (model.double()): torch's DDP all-reduced in the buckets it
    # had laid out for float32, and the workers ended 4.5e-2 apart, silently.
    converted = Chain()
    wrapped, opt = polytrain.distribute(converted,
                                        torch.optim.SGD(converted.parameters(), lr=0.1), "ddp",
                                        find_unused_parameters=True)
    converted.double()
    with pytest.raises(polytrain.ConfigError, match=r"^parameter 'a\.weight' is float64 on cpu "
                                                    r"now, and was float32 on cpu at the wrap, "
                                                    r".* HINT: convert the model \(model\."
                                                    r"double\(\), \.to\(device\)\) before "
                                                    r"distribute\(\)"):
        wrapped(torch.randn(2, 4, dtype=torch.float64))
    model = Chain()
    wrapped, opt = polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        "ddp")
    model.a.requires_grad_(False)  # after wrapping: ddp still waits for a's gradients
    for _ in range(2):
        wrapped(torch.randn(2, 4)).sum().backward()


@pytest.mark.timeout(60)
def test_ddp_refuses_a_model_with_nothing_to_train_and_names_what_it_waits_for():
    # The names are ddp's parameters even when requires_grad changed after wrapping.
    with pytest.raises(LaunchError, match=r"parameters 'a.weight', 'a.bias', 'd.weight', "
                                          r"'d.bias' got no gradient"):
        spawn(freeze_after_wrapping, workers=2)


def test_a_parameter_moved_since_the_wrap_is_named_with_both_devices():
    # The device half of the check (CPU-only here: the wrap's device stands in for a GPU).
    from polytrain.ps.grads import as_wrapped, check_as_wrapped

    net = nn.Linear(4, 2)
    check_as_wrapped(as_wrapped(net.named_parameters()))  # unchanged: accepted
    on_gpu = [(name, p, dtype, torch.device("cuda", 1))
              for name, p, dtype, _ in as_wrapped(net.named_parameters())]
    with pytest.raises(polytrain.ConfigError, match=r"^parameter 'weight' is float32 on cpu "
                                                    r"now, and was float32 on cuda:1 at the "
                                                    r"wrap, "):
        check_as_wrapped(on_gpu)


@pytest.mark.timeout(60)
def test_with_find_unused_parameters_ddp_trains_and_leaves_them_alone():
    first, second = spawn(train, workers=2, args=({"find_unused_parameters": True},))
    torch.manual_seed(0)
    untouched = HalfUsed()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(first["unused.weight"], untouched.unused.weight)
    assert not torch.equal(first["used.weight"], untouched.used.weight)


@pytest.mark.timeout(120)
def test_sparse_gradients_are_metered_by_the_rows_gloo_gathers_not_as_dense():
    # ddp's meter counted every parameter as a dense all-reduce: 52 MB a step for wordlm,
    # whose sparse rows gloo gathers (the NICs counted 0.64 MB; the meter now 0.64 MB).
    from polytrain import TrainConfig
    from tests.harness import run_config

    options = {"vocab": 20_000, "d_model": 16, "layers": 1, "heads": 2, "seq_len": 8,
               "negatives": 16}
    metrics, final = run_config(TrainConfig(strategy="ddp", model="wordlm", workers=2, nodes=2,
                                            steps=3, batch_size=8, optimizer="sgd",
                                            model_options=options))
    sparse = ("tok.weight", "out.weight")
    dense = sum(t.numel() * 4 for k, t in final.items() if k not in sparse)
    # At most every token's and every negative's row, with its index, per worker.
    rows = 2 * (8 // 2) * 8 + 16
    width = max(final[k].shape[1] for k in sparse)
    sent = [m["sent_bytes_per_step"] for m in metrics["traffic"]["machines"]]
    assert all(dense < s <= dense + rows * (width * 4 + 8) for s in sent), (sent, dense)
    assert max(sent) < metrics["model_bytes"] / 50


def distributes_a_max_norm_embedding(strategy: str, option: str = "max_norm") -> str:
    polytrain.init()
    embedding = ({"max_norm": 1.0} if option == "max_norm" else {"scale_grad_by_freq": True})
    model = nn.Sequential(nn.Embedding(10, 4, **embedding), nn.Linear(4, 2))
    try:
        if strategy == "herring drop-in":  # torch DDP's replacement, without distribute()
            from polytrain.herring import DistributedDataParallel
            DistributedDataParallel(model)
        else:
            polytrain.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    except polytrain.ConfigError as e:
        return str(e)
    return "distributed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ddp", "parallax"])
def test_an_embedding_that_renormalizes_in_the_forward_is_refused(strategy):
    # max_norm rescales the rows a worker's batch read, in its own copy: the copies drifted
    # apart (ddp), or away from the servers' rows (parallax), silently.
    said = spawn(distributes_a_max_norm_embedding, workers=2, args=(strategy,))
    assert said == [said[0]] * 2 and said[0].startswith(
        "0 renormalizes the rows it reads in place during the forward (max_norm=1): each "
        "worker would change only its own batch's rows"), said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy, option", [
    ("ddp", "scale_grad_by_freq"), ("herring", "scale_grad_by_freq"),
    ("herring drop-in", "scale_grad_by_freq"), ("herring drop-in", "max_norm")])
def test_an_embedding_that_scales_its_gradient_by_the_batchs_counts_is_refused(strategy,
                                                                                option):
    # Each worker scaled by its own slice's counts of each row: the sum was not the whole
    # batch's gradient (ddp), silently.
    # (The drop-in DDP checked neither this nor max_norm.)
    said = spawn(distributes_a_max_norm_embedding, workers=2, colocated=int(strategy != "ddp"),
                 args=(strategy, option))
    assert said == [said[0]] * 2 and said[0].startswith(
        "0 scales its gradient by how often each row occurs in the batch (scale_grad_by_freq="
        "True): each worker would count its own slice" if option == "scale_grad_by_freq" else
        "0 renormalizes the rows it reads in place during the forward (max_norm=1)"), said
