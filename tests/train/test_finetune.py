"""The fine-tuning task of the shared loop: ``--init`` (any strategy) and ``--eval-every``."""

import tempfile
from pathlib import Path

import pytest
import torch

from polytrain import ConfigError, TrainConfig
from tests.harness import adam_tolerance, max_abs_diff, run_config, single_of

TINY = {"seq_len": 16, "d_model": 32, "layers": 2}
BASE = TrainConfig(strategy="single", steps=4, batch_size=8, lr=3e-3, model_options=TINY)


@pytest.mark.timeout(240)
def test_held_out_loss_and_accuracy_every_n_steps_and_after_the_last():
    metrics, _ = run_config(BASE.replace(eval_every=3))
    assert [e["step"] for e in metrics["eval"]] == [3, 4]
    for e in metrics["eval"]:
        assert 0 < e["loss"] < 6 and 0 <= e["accuracy"] <= 1 and e["train_time_s"] > 0
    assert metrics["final_eval_loss"] == metrics["eval"][-1]["loss"]
    # A pipeline evaluates the whole model gathered from its stages: the same figures.
    pipe = BASE.replace(strategy="pipetransformer", workers=4, nodes=2, eval_every=3,
                        strategy_options={"freeze": False})
    pipe_metrics, _ = run_config(pipe)
    assert [e["loss"] for e in pipe_metrics["eval"]] == pytest.approx(
        [e["loss"] for e in metrics["eval"]], abs=1e-5)
    assert [e["accuracy"] for e in pipe_metrics["eval"]] == pytest.approx(
        [e["accuracy"] for e in metrics["eval"]], abs=1e-6)


@pytest.mark.timeout(240)
def test_init_starts_any_strategy_from_a_final_pt():
    with tempfile.TemporaryDirectory() as tmp:
        _, first = run_config(BASE)
        path = str(Path(tmp) / "final.pt")
        torch.save(first, path)
        # A learning rate of nothing: the run ends where --init started it.
        _, same = run_config(BASE.replace(init=path, steps=1, lr=1e-12))
        assert max_abs_diff(first, same) < 1e-6
        cont = BASE.replace(strategy="ddp", workers=2, init=path)
        _, ddp = run_config(cont)
        _, single = run_config(single_of(cont))
        assert max_abs_diff(ddp, single) < adam_tolerance(BASE.lr, BASE.steps)
        _, fresh = run_config(single_of(cont).replace(init=None))
        assert max_abs_diff(single, fresh) > 1e-2  # the start mattered


def test_init_of_another_models_weights_names_the_first_key_that_differs(tmp_path):
    _, first = run_config(BASE.replace(steps=1))
    path = tmp_path / "final.pt"
    torch.save(first, path)
    with pytest.raises(ConfigError, match=r"'embed.tok.weight' is \[256, 64\] here but "
                                          r"\[256, 32\] there"):
        BASE.replace(init=str(path), model_options={**TINY, "d_model": 64})
    with pytest.raises(ConfigError, match=r"the first key that differs is '.*' here but "
                                          r"'embed.tok.weight' there"):
        BASE.replace(init=str(path), model="mlp", model_options={})
    with pytest.raises(ConfigError, match=r"cannot be read as a final\.pt "
                                          r"\(FileNotFoundError: \[Errno 2\]"):
        BASE.replace(init=str(tmp_path / "missing.pt"))
    # The same tensors in another order load (refused as another model's, naming the
    # first key); a value that is not a tensor is named (AttributeError: 'int' ... 'shape').
    torch.save(dict(sorted(first.items())), path)
    BASE.replace(init=str(path))
    torch.save({**first, "embed.pos.weight": 5}, path)
    with pytest.raises(ConfigError, match=r"holds a int as 'embed.pos.weight', not a tensor"):
        BASE.replace(init=str(path))
    # Were EOFError and UnpicklingError tracebacks; then "(IndexError: list index out of
    # range)" for a text file of lines: what such bytes make torch raise says nothing.
    for junk in (b"", b"not a checkpoint", b"root:x:0:0:root:/root:/bin/bash\n",
                 b'{"final_loss": 2.3}'):
        (tmp_path / "junk.pt").write_bytes(junk)
        with pytest.raises(ConfigError, match=r"cannot be read as a final\.pt \(not a file of "
                                              r"tensors that torch.save wrote, or a damaged "
                                              r"one\)") as e:
            BASE.replace(init=str(tmp_path / "junk.pt"))
        # One line, and not torch's advice to load it with weights_only=False (unsafe).
        assert "\n" not in str(e.value) and "weights_only" not in str(e.value), str(e.value)


def test_eval_every_is_refused_where_no_worker_holds_the_model():
    with pytest.raises(ConfigError, match="holds part of the model"):
        TrainConfig(strategy="hetpipe", workers=2, servers=1, eval_every=5,
                    model_options=TINY)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy, workers", [("single", 1), ("ddp", 2)])
def test_a_held_out_part_shorter_than_a_window_is_refused_in_one_line(strategy, workers,
                                                                      capsys):
    # It divided by zero held-out samples at the first evaluation, after training (a review);
    # from the workers, a refusal ends the command as the CLI's own do (exit code 2).
    from polytrain.cli import main

    code = main(["train", "--quiet", "--strategy", strategy, "--workers", str(workers),
                 "--model", "mlp", "--data", "text-finetune", "--seq-len", "7000",
                 "--d-model", "8", "--layers", "1", "--eval-every", "1", "--steps", "1",
                 "--batch-size", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("--eval-every holds out the last tenth of the data, 6554 tokens, fewer than one "
            "window of --seq-len 7000 + 1") in err
    assert "HINT: pass a smaller --seq-len" in err
