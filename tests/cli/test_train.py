import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from polytrain import ConfigError, TrainConfig
from polytrain.checkpoint.resume import run_record
from polytrain.cli import main
from polytrain.models import GPT
from polytrain.train.metrics import build_metrics

TINY = ["--steps", "5", "--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--quiet"]


def cli(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("polytrain")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(120)
def test_train_writes_metrics_and_final_state_as_the_contract_says(tmp_path):
    out = tmp_path / "ddp"
    run = cli("train", "--strategy", "ddp", "--workers", "4", "--nodes", "2", "--out", str(out),
              "--timeout", "30", *TINY)
    assert run.returncode == 0, run.stderr
    assert "final loss" in run.stdout and f"wrote {out}/metrics.json" in run.stdout
    m = json.loads((out / "metrics.json").read_text())
    assert (m["strategy"], m["model"], m["workers"], m["nodes"], m["servers"], m["steps"]) == \
        ("ddp", "gpt", 4, 2, 0, 5)
    assert len(m["losses"]) == 5 and all(math.isfinite(x) for x in m["losses"])
    assert m["final_loss"] == m["losses"][-1]
    assert m["losses"][0] > m["losses"][-1]  # it learns
    assert m["samples_per_s"] > 0
    assert 0 < m["step_time_s"]["median"] <= m["step_time_s"]["p90"]
    reference = GPT(seq_len=16, d_model=32)
    grad_bytes = sum(p.numel() * 4 for p in reference.parameters())
    assert m["model_bytes"] == grad_bytes
    machines = m["traffic"]["machines"]
    assert [x["name"] for x in machines] == ["node0", "node1"]
    for x in machines:
        # A ring of 4 workers over 2 machines: each machine's one outgoing edge carries
        # 2(p-1)/p of the gradient per step; torch moved it, so it is an estimate.
        assert x["kind"] == "worker" and x["estimated"] is True
        assert x["sent_bytes_per_step"] == pytest.approx(1.5 * grad_bytes, rel=1e-6)
        assert x["recv_bytes_per_step"] == pytest.approx(1.5 * grad_bytes, rel=1e-6)
    state = torch.load(out / "final.pt")
    assert list(state) == list(reference.state_dict())

    single = tmp_path / "single"
    run = cli("train", "--strategy", "single", "--out", str(single), *TINY)
    assert run.returncode == 0, run.stderr
    s = torch.load(single / "final.pt")
    assert max(float((s[k] - state[k]).abs().max()) for k in s) < 1e-5
    assert json.loads((single / "metrics.json").read_text())["traffic"]["machines"] == []


@pytest.mark.parametrize("args, message", [
    (["--strategy", "bytepz"], r"unknown strategy 'bytepz'; the strategies are: .*ddp"),
    (["--strategy", "bytepz"], r"the strategies are: .*ddp.*, or auto \(of ddp, byteps, "
                               r"herring, the one `polytrain plan`"),
    (["--model", "resnet"], r"unknown model 'resnet'; the models are: .*gpt.*mlp"),
    (["--data", "imagenet"], r"unknown data set 'imagenet'; the data sets are: text"),
    (["--workers", "3", "--nodes", "2"], r"--workers 3 is not divisible by --nodes 2.*HINT"),
    (["--workers", "3", "--batch-size", "32"],
     r"global batch 32 is not divisible by 3 data-parallel replicas.*HINT: pass --batch-size 33"),
    (["--servers", "1"], r"strategy 'ddp' does not use servers.*HINT: leave out --servers"),
    (["--strategy", "single", "--workers", "2"], r"strategy 'single' trains in one process"),
    (["--steps", "0"], r"--steps must be at least 1"),
    (["--steps", "10", "--warmup-steps", "10"],
     r"--warmup-steps must be at least 0 and less than --steps 10.*HINT: pass --warmup-steps 1"),
    (["--d-model", "64", "--heads", "5"], r"d_model 64 is not divisible by heads 5"),
    # Each of these was a traceback, a run that failed only after training, or nonsense run.
    (["--heads", "0"], r"--heads must be at least 1 \(got 0\)"),
    (["--layers", "-1"], r"--layers must be at least 1 \(got -1\)"),
    (["--timeout", "1e300"], r"--timeout must be a number of seconds from 2 to 2147483"),
    (["--timeout", "nan"], r"--timeout must be a number of seconds from 2"),
    # Half of it, 0.5 s, is one heartbeat: a busy, healthy process would be taken for hung.
    (["--timeout", "1"], r"--timeout must be a number of seconds from 2 to"),
    (["--port", "70000"], r"--port must be a TCP port, 1\.\.65535 \(got 70000\)"),
    # Taken and unused: single trains in this process, with no rendezvous.
    (["--strategy", "single", "--port", "29500"],
     r"--port 29500 is the rendezvous port of a run's processes, and strategy 'single' trains "
     r"in this one process\. HINT: leave --port out, or pick a distributed strategy such as "
     r"ddp$"),
    # Taken and unused: only a launched run's processes wait on each other.
    (["--strategy", "single", "--timeout", "30"],
     r"--timeout 30 is the longest wait on another of a run's processes, and strategy 'single' "
     r"trains in this one process\. HINT: leave --timeout out, or pick a distributed strategy "
     r"such as ddp$"),
    # Ran, and built a network namespace (as root) in which no link was shaped.
    (["--bandwidth", "10mbit"],
     r"--bandwidth 10mbit shapes the links between machines, and strategy 'ddp' uses no "
     r"servers, and this run's workers share one machine: no link would be shaped\. HINT: "
     r"pass --nodes 2 or more, or leave --bandwidth and --latency out$"),
    (["--seed", str(2**64)], r"--seed must be in 0\.\.2\*\*63-1"),
    (["--batch-size", "0"], r"--batch-size must be at least 1 \(got 0\)"),
    (["--lr", "inf"], r"--lr must be a positive number \(got inf\)"),
    (["--out", __file__], r"--out .*test_train\.py cannot be made a directory: File exists"),
    (["--strategy", "herring", "--bucket-cap-mb", "nan"], r"--bucket-cap-mb must be positive"),
    (["--strategy", "moe", "--model", "gpt-moe", "--balance-loss", "nan"],
     r"balance_weight \(--balance-loss\) must be 0 or more \(got nan\)"),
    # The hint named --vocab, which is then refused as wordlm's option.
    (["--model", "mlp", "--heads", "4"], r"model 'mlp' takes no option --heads\. HINT: its "
                                         r"options are: --seq-len, --d-model, --layers$"),
    # The hints spoke Python (capacity_factor=1.25, or None) to a command line.
    (["--strategy", "moe", "--model", "gpt-moe", "--gate", "gshard", "--capacity-factor", "0"],
     r"HINT: pass --capacity-factor 1\.25 \(capacity_factor=1\.25 in a script\), or "
     r"--dropless for no capacity limit"),
    (["--strategy", "moe", "--model", "gpt-moe", "--z-loss", "-1"],
     r"HINT: pass a small weight, e\.g\. --z-loss 0\.01 \(z_loss_weight=0\.01 in a script\)"),
    # The hint named moefy's every=, not the flag.
    (["--model", "gpt-moe", "--moe-every", "0"], r"--moe-every must be at least 1 \(got 0\)\. "
                                                  r"HINT: pass --moe-every 1"),
    (["--strategy", "pipetransformer", "--model", "wordlm", "--workers", "4", "--nodes", "2"],
     r"WordLM cannot be timed layer by layer: its forward does not run on shapes alone"),
    # They trained to the end and froze nothing (a warning in the workers' log said so).
    (["--strategy", "pipetransformer", "--workers", "2"],
     r"pipetransformer's freeze points default to one epoch of the data, and --sampling "
     r"random has no epochs: no layer would freeze\. HINT: pass --freeze-every N \(for "
     r"instance --freeze-every 100, a fifth of the run\), or --no-freeze"),
    (["--strategy", "pipetransformer", "--workers", "2", "--sampling", "epoch", "--steps", "40"],
     r"one epoch of text is 2016 steps of 32, the run 40: no layer would freeze\. HINT: pass "
     r"--freeze-every N \(for instance --freeze-every 8"),
])
def test_bad_input_gets_one_clear_line_and_no_process(args, message, capsys):
    import re

    code = main(["train", "--quiet", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("polytrain train: error: "), err
    assert re.search(message, err), err


@pytest.mark.parametrize("field, value, message", [
    # A JSON config's 1e3 is a float: range(start, 1000.0) failed in every worker.
    ("steps", 1e3, r"--steps must be a whole number \(got 1000.0\). HINT: pass --steps 1000"),
    ("steps", 10.5, r"--steps must be a whole number \(got 10.5\). HINT: pass --steps as"),
    ("seed", 1.5, r"--seed must be a whole number"),  # trained with seed 1, recorded 1.5
    ("batch_size", "32", r"--batch-size must be a whole number \(got '32'\)"),  # TypeError
    ("eval_every", True, r"--eval-every must be a whole number \(got True\)"),
    # Accepted, and "cuda:0" even passed the check that a GPU is there; failed in workers.
    ("device", "gpu", r"unknown device 'gpu'; the devices are: cpu, cuda"),
    ("device", "cuda:0", r"unknown device 'cuda:0'"),
    # Each failed inside torch's or Python's code (a TypeError), or was taken silently.
    ("lr", "0.1", r"^lr must be a number \(got '0.1', a str\)\. HINT: pass lr=0\.1$"),
    ("lr", True, r"^lr must be a number \(got True, a bool\)\. HINT: pass lr=0\.002$"),
    ("timeout_s", "30", r"^timeout_s must be a number \(got '30', a str\)\. HINT: pass "
                        r"timeout_s=30\.0$"),
    ("quiet", "no", r"^quiet must be True or False \(got 'no', a str\)\. HINT: pass "
                    r"quiet=True or quiet=False$"),  # taken for True
    ("port", "29500", r"^--port must be a whole number \(got '29500'\)"),
    ("port", True, r"^--port must be a whole number \(got True\)"),  # port 1, taken silently
    ("servers", None, r"^servers must be a whole number \(got None, a NoneType\)\. HINT: "
                      r"pass servers=0$"),
    ("model", 3, r"^model must be a str \(got 3, an int\)\. HINT: pass model='gpt'$"),
    ("out", 3, r"^out must be a str or a path, or None \(got 3, an int\)\. HINT: pass out "
               r"as a str or a path, or None$"),
    ("model_options", None, r"^model_options must be a mapping \(got None, a NoneType\)\. "
                            r"HINT: pass model_options as a mapping$"),
    ("auto", [1], r"^auto must be a mapping, or None \(got \[1\], a list\)"),
])
def test_a_python_config_of_the_wrong_kind_is_refused_in_one_line(field, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(strategy="single", **{field: value})


def test_a_config_takes_paths_as_str_and_an_int_for_a_float(tmp_path):
    # A path field takes a pathlib.Path, kept as a str: init=Path(...) was kept as a Path,
    # and the run failed after training, writing metrics.json (json cannot write a Path).
    config = TrainConfig(strategy="single", out=tmp_path / "out", lr=1, timeout_s=30)
    assert config.out == str(tmp_path / "out") and (config.lr, config.timeout_s) == (1, 30)
    # numpy's numbers as Python's (a numpy bool was refused as "a bool"), its bool kept as one.
    config = TrainConfig(strategy="single", quiet=numpy.True_, steps=numpy.int64(3),
                         lr=numpy.float32(0.5))
    assert config.quiet is True and (config.steps, config.lr) == (3, 0.5)


def test_strategy_options_are_kept_as_their_fields_take_them(tmp_path):
    # Symptom: strategy_options={"cache_dir": Path(...)} was accepted, then a checkpoint's run
    # record and metrics.json at the end of the run failed ("PosixPath is not JSON
    # serializable"); numpy's numbers likewise. Cause: TrainConfig checked the options and
    # kept the mapping it was given, not the values they were made.
    config = TrainConfig(strategy="pipetransformer", steps=4, strategy_options={
        "cache_dir": tmp_path, "freeze_every": numpy.int64(2)})
    assert config.strategy_options == {"cache_dir": str(tmp_path), "freeze_every": 2}
    assert type(config.strategy_options["freeze_every"]) is int
    assert json.loads(json.dumps(run_record(config)))["strategy_options"] == \
        {"cache_dir": str(tmp_path), "freeze_every": 2}
    config = TrainConfig(strategy="byteps", model="mlp", optimizer="sgd", strategy_options={
        "partition_bytes": numpy.int64(8192), "compress": "onebit",
        "compress_momentum": numpy.float32(0.5)})
    metrics = build_metrics(config=config, losses=[1.0], times=[0.1], model_bytes=0,
                            topology=None, reports=[], wall_s=1.0)
    assert json.loads(json.dumps(metrics))["strategy_options"] == \
        {"partition_bytes": 8192, "compress": "onebit", "compress_momentum": 0.5}
    assert [type(v) for v in config.strategy_options.values()] == [int, str, float]
    # The model's options too (a review: numpy.int64 failed the run record likewise).
    config = TrainConfig(model="mlp", steps=2, model_options={"d_model": numpy.int64(16)})
    assert json.loads(json.dumps(run_record(config)))["model_options"] == {"d_model": 16}


def test_replace_fills_in_again_the_workers_and_nodes_a_config_filled_in():
    # replace() kept the worker count filled in for the first strategy: 'single' made ddp a
    # run of 1 worker, silently, and ddp's 2 workers made 'single' refused ("leave out
    # --workers", never passed).
    single = TrainConfig(strategy="single", model="mlp", steps=2)
    assert (single.replace(strategy="ddp").workers, single.replace(strategy="ddp").nodes) == \
        (2, 1)
    assert TrainConfig(model="mlp", steps=2).replace(strategy="single").workers == 1
    # What was given stays, through any number of replaces.
    given = TrainConfig(model="mlp", steps=2, workers=4, nodes=2)
    assert (given.replace(strategy="herring").replace(steps=3).workers,
            given.replace(strategy="herring").nodes) == (4, 2)
    # Those the devices set follow other devices.
    emulated = TrainConfig(model="mlp", steps=2, devices="m0:fast*2,m1:fast*2")
    assert (emulated.workers, emulated.nodes) == (4, 2)
    assert (emulated.replace(devices="m0:fast*4").workers,
            emulated.replace(devices="m0:fast*4").nodes) == (4, 1)
    assert (emulated.replace(devices=None).workers, emulated.replace(devices=None).nodes) == \
        (2, 1)


def test_a_job_whose_weights_cannot_fit_in_memory_is_refused(monkeypatch, capsys):
    # 8 blocks of width 2048: 404 M weights (1.5 GiB), counted on the meta device; the
    # machine's free memory is faked to 8 GiB.
    monkeypatch.setattr("polytrain.config.available_memory_bytes", lambda: 8 * 2**30)
    big = ["--d-model", "2048", "--layers", "8", "--heads", "16"]
    assert main(["train", "--quiet", *big, "--workers", "4"]) == 2
    err = capsys.readouterr().err
    assert err == ("polytrain train: error: gpt with these options has 404 M weights (1.5 "
                   "GiB); 4 copies of them (one per worker) and adam state need at least 9.0 "
                   "GiB, and this machine has 8.0 GiB available. HINT: pass a smaller model "
                   "(--d-model, --layers) or fewer --workers\n")
    # 2 workers: 4 copies with Adam's, 6 GiB, fit (the lower bound only refuses).
    config = TrainConfig(workers=2, model_options={"d_model": 2048, "layers": 8, "heads": 16})
    assert config.workers == 2
    with pytest.raises(ConfigError, match=r"605 M weights \(2.3 GiB\); 4 copies of them "
                                         r"\(one per worker\) need at least 9.0 GiB"):
        config.replace(workers=4, optimizer="sgd", model_options={
            "d_model": 2048, "layers": 12, "heads": 16})


def test_a_batch_that_cannot_fit_in_memory_is_refused(monkeypatch):
    # Symptom: --batch-size 200000 of the default GPT (0.8 M weights) passed the memory
    # check, and the kernel killed the run. Cause: the check counted the weights and the
    # optimizer's state, not the batch: its token ids on every worker (8 bytes each) and the
    # logits of a replica's slice, (200000, 64, 256) floats: 12.2 GiB.
    monkeypatch.setattr("polytrain.config.available_memory_bytes", lambda: 8 * 2**30)
    with pytest.raises(ConfigError) as refused:
        TrainConfig(strategy="single", batch_size=200_000)
    assert str(refused.value) == (
        "--batch-size 200000 of gpt with these options needs at least 12.3 GiB of this "
        "machine's memory (its weights and adam state, the batch's token ids, 200000 x 65 "
        "int64, and the batch's logits, 200000 x 64 x 256 float32), and this machine has "
        "8.0 GiB available. HINT: pass a smaller --batch-size "
        "(at most 129882 fits this lower bound; the model's other activations need more)")
    # Over 2 replicas a slice's logits are half of them, 6.1 GiB, with 2 x 0.1 GiB of token
    # ids: it passes (the bound counts one replica's logits: their peaks may not coincide).
    assert TrainConfig(strategy="ddp", workers=2, batch_size=200_000).batch_size == 200_000
    with pytest.raises(ConfigError, match=r"^--batch-size 300000 .* needs at least 9\.5 GiB .* "
                                          r"on each of its 2 workers, 300000 x 65 int64, and the "
                                          r"logits of a replica's slice, 150000 x 64 x 256 "
                                          r"float32\), .*\(at most 253668 fits"):
        TrainConfig(strategy="ddp", workers=2, batch_size=300_000)
    # A pipeline's last stage makes the logits of its micro-batches, the plan's: not counted.
    assert TrainConfig(strategy="pipetransformer", workers=2, batch_size=200_000,
                       strategy_options={"freeze": False}).batch_size == 200_000


def test_a_link_too_slow_for_ddps_first_message_is_refused(capsys):
    # Symptom: --bandwidth 3mbit passed the check (the largest tensor, 2.1 MB, crosses in
    # 5.6 s of --timeout 10), and the run failed after 34 s in torch's traceback, gloo's
    # "Timed out waiting 10000ms for recv". Cause: torch's DDP copies worker 0's whole
    # model in one message (up to 250 MiB, of a dtype): 5.8 MB, 15.4 s.
    args = ["train", "--strategy", "ddp", "--workers", "2", "--nodes", "2", "--model", "mlp",
            "--seq-len", "64", "--d-model", "512", "--layers", "4", "--timeout", "10",
            "--steps", "2", "--batch-size", "4", "--optimizer", "sgd"]
    assert main([*args, "--bandwidth", "3mbit"]) == 2
    assert capsys.readouterr().err == (
        "polytrain train: error: --bandwidth 3mbit carries the model's parameters and buffers "
        "(5,792,768 bytes), which torch's DDP sends in one message from worker 0 at the "
        "start, in 15 s, longer than --timeout 10: the run would time out there. HINT: pass "
        "--bandwidth 5mbit or more (a real network's is 1gbit or more), or a --timeout above "
        "16\n")
    config = TrainConfig(strategy="ddp", workers=2, nodes=2, model="mlp", timeout_s=10,
                         optimizer="sgd", bandwidth="5mbit",
                         model_options={"seq_len": 64, "d_model": 512, "layers": 4})
    config.replace(strategy="herring")  # a tensor at a time: the largest crosses in time
    with pytest.raises(ConfigError, match=r"^--bandwidth 5mbit carries the model's largest "
                                          r"tensor \(fc0\.weight, 2,097,152 bytes\)"):
        config.replace(strategy="herring", timeout_s=2)
    # A message ends with the tensor that takes it to 250 MiB or more (fc4.weight): 285 MB.
    with pytest.raises(ConfigError, match=r"^--bandwidth 100mbit carries 285,294,592 bytes of "
                                          r"the model's parameters and buffers \(of "
                                          r"356,631,552\), which torch's DDP sends in one "
                                          r"message .* HINT: pass --bandwidth 229mbit or more"):
        config.replace(bandwidth="100mbit", model_options={"seq_len": 64, "d_model": 4096,
                                                           "layers": 6})


def test_a_link_of_one_machine_is_refused_unless_servers_are_machines_of_their_own():
    # `polytrain train --bandwidth 10mbit --nodes 1` ran (as root, in a namespace) with no
    # link shaped: a server beside the workers (byteps colocates one) is on their machine.
    with pytest.raises(ConfigError, match=r"^--bandwidth 1gbit shapes the links between "
                                          r"machines, and this run has one machine of "
                                          r"workers and no server machines: no link would be "
                                          r"shaped\. HINT: pass --nodes 2 or more \(or "
                                          r"--servers K\)"):
        TrainConfig(strategy="byteps", model="mlp", optimizer="sgd", bandwidth="1gbit")
    # A dedicated server is a machine of its own: the workers' link to it is shaped.
    config = TrainConfig(strategy="byteps", model="mlp", optimizer="sgd", servers=1,
                         bandwidth="1gbit")
    assert (config.nodes, config.layout().servers, config.link().rate_bit_s) == (1, 1, 10**9)


def test_a_port_in_use_is_refused(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["train", "--quiet", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on this host is in use" in err and "HINT: pass another --port" in err


def test_env_prints_versions_and_devices(capsys, monkeypatch):
    monkeypatch.delenv("POLYTRAIN_FORKSERVER", raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("polytrain", "torch", "numpy", "cpus", "gpus", "backend gloo", "strategies"):
        assert key in out
    assert torch.__version__ in out
    assert re.search(r"^fork server +on$", out, re.M), out
    assert re.search(r"^--bandwidth \(emulated network\) +(root, ip and tc present .*|no: "
                     r"missing .*)$", out, re.M), out
    # What --bandwidth would say is missing, in one line.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("POLYTRAIN_FORKSERVER", "0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^fork server +off \(POLYTRAIN_FORKSERVER\)$", out, re.M), out
    assert re.search(r"^--bandwidth \(emulated network\) +no: missing root \(running as uid "
                     r"1000\)", out, re.M), out
    assert re.search(r"^--latency \(tc netem\) +unknown: trying it needs root \(running as "
                     r"uid 1000\)$", out, re.M), out


def test_polytrain_timeout_is_trains_default_timeout(monkeypatch):
    # polytrain train ignored it (launch read it), though the hints name both.
    from polytrain.cli import build_parser
    from polytrain.cli.train import config_from_args

    monkeypatch.setenv("POLYTRAIN_TIMEOUT", "77")
    args = ["train", "--strategy", "ddp", "--steps", "1"]
    assert config_from_args(build_parser(args).parse_args(args)).timeout_s == 77
    args += ["--timeout", "30"]
    assert config_from_args(build_parser(args).parse_args(args)).timeout_s == 30
    # single refuses --timeout (nothing waits), and still takes the variable set for others
    args = ["train", "--strategy", "single", "--steps", "1"]
    assert config_from_args(build_parser(args).parse_args(args)).timeout_s == 77


def _on_second_forward(monkeypatch, act):
    """Make the GPT's head call ``act()`` on its second forward: step 2 of a run."""
    from polytrain.models.gpt import Head

    real, calls = Head.forward, []

    def forward(self, x):
        calls.append(1)
        if len(calls) == 2:
            act()
        return real(self, x)
    monkeypatch.setattr(Head, "forward", forward)


def test_a_single_run_that_raises_ends_in_one_line_under_its_traceback(monkeypatch, capsys):
    # Symptom: an error in a --strategy single run (a model whose forward raises) ended
    # polytrain train with a bare Python traceback and no "polytrain train: error:" line,
    # which a ddp run prints under its worker's traceback. Cause: single trains in the CLI's
    # own process, outside the launcher that turns a failure into a LaunchError.
    def boom():
        raise RuntimeError("boom in the model's forward\nsecond line")
    _on_second_forward(monkeypatch, boom)
    assert main(["train", "--strategy", "single", *TINY]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n"), err
    assert "in boom\n" in err, err  # where it was raised
    assert err.splitlines()[-1] == (
        "polytrain train: error: training failed: RuntimeError: boom in the model's forward. "
        "HINT: its traceback (printed above by polytrain train; the error's __cause__ in "
        "Python) shows where; fix that and rerun"), err


@pytest.mark.parametrize("signum, before, said, code", [
    (signal.SIGINT, "recorder", "Ctrl-C", 130),
    # SIGTERM ended the run at once, without a word (ddp's says which signal stopped it).
    (signal.SIGTERM, "recorder", "SIGTERM", 143),
    (signal.SIGHUP, "recorder", "SIGHUP", 129),
    # nohup's SIGHUP, a shell's background job's SIGINT: ignored, they stay so.
    (signal.SIGHUP, signal.SIG_IGN, None, 0),
    (signal.SIGINT, signal.SIG_IGN, None, 0),
], ids=["SIGINT", "SIGTERM", "SIGHUP", "ignored SIGHUP", "ignored SIGINT"])
def test_a_single_run_stops_on_a_signal_as_a_launched_run_does(monkeypatch, capsys, tmp_path,
                                                                 signum, before, said, code):
    # Symptom: --strategy single, which trains in the CLI's own process, ended on SIGTERM
    # with no message and on SIGINT with a KeyboardInterrupt traceback. Cause: only the
    # launcher (every other strategy) installed handlers for SIGINT, SIGTERM and SIGHUP.
    # ("recorder": the handler the process had, a stand-in for the default that ends it,
    # and which is to be back after the run.)
    heard = []
    handler = (lambda *_: heard.append(1)) if before == "recorder" else before
    previous = signal.signal(signum, handler)
    try:
        _on_second_forward(monkeypatch, lambda: os.kill(os.getpid(), signum))
        out = tmp_path / "out"
        args = ["train", "--strategy", "single", "--out", str(out), "--checkpoint-every", "1",
                *TINY]
        assert main(args) == code
        assert signal.getsignal(signum) is handler and heard == []
    finally:
        signal.signal(signum, previous)
    err = capsys.readouterr().err
    if said is None:  # the run went on to its end
        assert "error" not in err and (out / "final.pt").is_file(), err
        return
    assert err == (f"polytrain train: error: interrupted ({said}): "
                   f"stopped training in this process\n")
    # As a launched run's: the checkpoints written stay, and the results are not written.
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]


def test_the_first_copy_is_timed_to_the_last_worker_down_gloos_broadcast_tree():
    # Symptom: --workers 4 --nodes 4 --bandwidth 134kbit --timeout 10 passed the check (ddp's
    # first message, 100,480 bytes, in 6.0 s), and the run timed out 10 s into the start on
    # node3. Cause: gloo's broadcast is a binomial tree: worker 0 sends to workers 1 and 2 at
    # once (two copies share its link), then worker 1 to worker 3: three copies' time.
    args = dict(strategy="ddp", workers=4, nodes=4, model="mlp", optimizer="sgd",
                model_options={"d_model": 16}, timeout_s=10)
    with pytest.raises(ConfigError) as e:
        TrainConfig(**args, bandwidth="134kbit")
    assert str(e.value) == (
        "--bandwidth 134kbit carries the model's parameters and buffers (100,480 bytes), which "
        "torch's DDP sends in one message from worker 0 at the start, to the last worker in "
        "18 s (gloo's broadcast passes it down a tree whose senders share their links: 3 "
        "times one copy's 6.0 s), longer than --timeout 10: the run would time out there. "
        "HINT: pass --bandwidth 242kbit or more (a real network's is 1gbit or more), or a "
        "--timeout above 18")
    TrainConfig(**args, bandwidth="242kbit")
    from polytrain.config import _broadcast_copies
    # Copies' time to the last worker: n machines of one worker each; two workers a machine
    # (node0's workers 0 and 1 send to node1 at once); one machine sends nothing over a link.
    assert [_broadcast_copies(n, n) for n in (1, 2, 3, 4, 8)] == pytest.approx([0, 1, 2, 3, 6])
    assert [_broadcast_copies(w, n) for w, n in ((4, 2), (8, 4), (4, 1))] == \
        pytest.approx([2, 6, 0])
    # GPU workers broadcast over NCCL, which pipelines one copy down a chain: one copy's time
    # (the tree refused the planner's GPU clusters, 48 copies' time for 8 machines of 8).
    from polytrain.config import check_link
    from polytrain.launch.layout import Layout
    from polytrain.models import get_model
    model = get_model("mlp").make(d_model=16)
    check_link("ddp", None, model, Layout(workers=4, nodes=4), bandwidth="134kbit",
               latency=None, timeout_s=10, gloo=False)


def test_dense_grads_under_parallax_needs_no_sparse_embeddings(capsys):
    # Symptom: `--strategy parallax --model wordlm --dense-grads` trained sparse gradients
    # (its metrics.json listed both tables as sparse): parallax makes every embedding sparse
    # by default, whatever the model built.
    small = ["--model", "wordlm", "--seq-len", "8", "--d-model", "8", "--layers", "1",
             "--vocab", "300", "--negatives", "16", "--steps", "2"]
    assert main(["train", "--strategy", "parallax", *small, "--dense-grads"]) == 2
    assert capsys.readouterr().err == (
        "polytrain train: error: --dense-grads builds model 'wordlm''s embeddings dense, and "
        "strategy 'parallax' makes every embedding sparse (sparse_embeddings=True): the run "
        "would train sparse gradients. HINT: pass --no-sparse-embeddings too (parallax then "
        "sums the dense tables on the workers), or leave out --dense-grads\n")
    options = {"seq_len": 8, "d_model": 8, "layers": 1, "vocab": 300, "negatives": 16,
               "dense_grads": True}
    TrainConfig(strategy="parallax", model="wordlm", model_options=options,
                strategy_options={"sparse_embeddings": False})
    TrainConfig(strategy="ddp", model="wordlm", model_options=options)
