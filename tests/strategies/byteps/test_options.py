"""Options: the CLI flags, the layout BytePS asks for, and bad input refused before a start."""

import re

import pytest

from polytrain import ConfigError, TrainConfig
from polytrain.cli import build_parser, main
from polytrain.cli.train import config_from_args
from polytrain.strategies.byteps import BytePSOptions


def parse(*args):
    return config_from_args(build_parser().parse_args(["train", "--strategy", "byteps", *args]))


def test_flags_become_the_strategys_options():
    c = parse("--workers", "4", "--nodes", "2", "--servers", "1", "--no-colocate",
              "--partition-bytes", "1000", "--async", "--staleness", "2")
    assert dict(c.strategy_options) == {"colocate": False, "partition_bytes": 1000,
                                        "async_": True, "staleness": 2}
    assert dict(parse("--fuse-bytes", "0", "--credit-bytes", "0").strategy_options) == {
        "fuse_bytes": 0, "credit_bytes": 0}
    assert parse().strategy_options == {}


def test_the_layout_has_a_colocated_server_per_machine_unless_told_otherwise():
    layout = parse("--workers", "4", "--nodes", "2", "--servers", "1").layout()
    assert layout.describe() == ("node0: worker 0, worker 1, server 4 | node1: worker 2, "
                                 "worker 3, server 5 | server0: server 6")
    classic = parse("--workers", "4", "--nodes", "2", "--servers", "1", "--no-colocate")
    assert classic.layout().world_size == 5


@pytest.mark.parametrize("options, message", [
    ({"staleness": 2}, r"--staleness 2 bounds asynchronous training only. HINT: add --async"),
    ({"async_": True, "staleness": -1}, r"--staleness must be 0 or more"),
    ({"partition_bytes": 0}, r"--partition-bytes must be at least 8"),
    ({"credit_bytes": -5}, r"--credit-bytes must be 0 \(no bound\) or more"),
    ({"fuse_bytes": -1}, r"--fuse-bytes must be 0 \(no fusion\) or more"),
    # It was accepted, and changed nothing: asynchronous mode pushes every tensor alone.
    ({"async_": True, "fuse_bytes": 0}, r"--fuse-bytes fuses synchronous BytePS's gradients; "
                                        r"--async pushes each parameter's update alone"),
    # Accepted too, and ignored: asynchronous pushes never go through the credit queue.
    ({"async_": True, "credit_bytes": 0}, r"--credit-bytes bounds synchronous BytePS's "
                                          r"gradient pushes; --async pushes each step's updates "
                                          r"without a credit \(got --credit-bytes 0\)\. HINT: "
                                          r"drop --async, or leave out --credit-bytes"),
])
def test_bad_options_are_refused_with_a_hint(options, message):
    with pytest.raises(ConfigError, match=message):
        BytePSOptions(**options)


def test_a_classic_parameter_server_without_servers_is_refused_before_any_process_starts():
    with pytest.raises(ConfigError, match=r"--no-colocate is the classic parameter server.*"
                                          r"HINT: pass --servers K"):
        TrainConfig(strategy="byteps", strategy_options={"colocate": False})


def test_compression_flags_become_the_strategys_options():
    c = parse("--optimizer", "sgd", "--compress", "topk:0.01", "--error-feedback",
              "--compress-momentum", "0.9", "--compress-min-bytes", "1024")  # Adam's refused
    assert dict(c.strategy_options) == {"compress": "topk:0.01", "error_feedback": True,
                                        "compress_momentum": 0.9, "compress_min_bytes": 1024}
    c = parse("--compress", "onebit", "--error-feedback", "--compress-warmup", "100",
              "--compress-adam")
    assert dict(c.strategy_options) == {"compress": "onebit", "error_feedback": True,
                                        "compress_warmup": 100, "compress_adam": True}
    c = parse("--compress", "onebit", "--compress-warmup", "2", "--compress-adam",
              "--compress-adam-refresh", "4")
    assert dict(c.strategy_options) == {"compress": "onebit", "compress_warmup": 2,
                                        "compress_adam": True, "compress_adam_refresh": 4}
    c = parse("--compress", "onebit", "--compress-adam", "--compress-adam-refresh", "4")
    assert dict(c.strategy_options) == {"compress": "onebit", "compress_adam": True,
                                        "compress_adam_refresh": 4}  # no warm-up needed
    c = parse("--compress", "onebit", "--compress-warmup", "30", "--compress-warmup-with",
              "dithering:4")
    assert dict(c.strategy_options) == {"compress": "onebit", "compress_warmup": 30,
                                        "compress_warmup_with": "dithering:4"}


@pytest.mark.parametrize("options, message", [
    ({"compress": "zip"}, r"unknown compressor 'zip'; the compressors are: none, onebit"),
    ({"compress": "topk:0"}, r"topk:0: K must be a count"),
    ({"compress": "dithering:1"}, r"dithering:1: dithering takes S levels, 2 or more"),
    ({"error_feedback": True}, r"apply to compressed gradients, but --compress is none"),
    ({"compress": "onebit", "async_": True}, r"--compress onebit cannot run with --async: "
                                             r"asynchronous BytePS .* pulls the parameters "
                                             r"themselves, not a sum.*supports: fp16"),
    ({"compress": "onebit", "compress_momentum": 1.0}, r"--compress-momentum must be in"),
    ({"compress": "onebit", "compress_warmup": -1}, r"--compress-warmup must be 0 or more "
                                                    r"steps \(got -1\)"),
    ({"compress_warmup": 100}, r"apply to compressed gradients, but --compress is none"),
    ({"compress_min_bytes": 0}, r"--compress-min-bytes apply to compressed gradients, but "
                                r"--compress is none"),  # (it was taken, and did nothing)
    ({"compress": "onebit", "compress_adam": True}, r"--compress-adam \(1-bit Adam\) freezes"
                                                    r".*HINT: add --compress-warmup N"),
    ({"compress": "onebit", "compress_adam": True, "compress_warmup": 10,
      "compress_momentum": 0.9}, r"would add a second momentum"),
    ({"compress": "fp16", "async_": True, "compress_warmup": 10},
     r"apply to synchronous BytePS.*HINT: drop --async"),
    ({"compress": "fp16", "async_": True, "error_feedback": True, "compress_momentum": 0.9},
     r"--async pushes updates \(the optimizer's steps\): it would put a second momentum on "
     r"them\. HINT: drop --async, or leave out --compress-momentum"),
    ({"compress": "onebit", "compress_warmup_with": "dithering:4"},
     r"--compress-warmup-with dithering:4 says what the warm-up travels as, but "
     r"--compress-warmup is 0.*HINT: add --compress-warmup N"),
    ({"compress": "onebit", "compress_warmup": 10, "compress_warmup_with": "zip"},
     r"--compress-warmup-with: unknown compressor 'zip'; the compressors are: none, onebit.*"
     r"HINT: pass a compressor as --compress takes it"),
    ({"compress": "onebit", "compress_warmup": 10, "compress_warmup_with": "dithering:1"},
     r"--compress-warmup-with: dithering:1: dithering takes S levels, 2 or more"),
    # Symptom: 1-bit Adam after a dithering:4 warm-up ended in NaN (the replay) or a loss of
    # 31715 (a tiny run). Cause: dithering sends small elements as 0, Adam's variance stays
    # 0 there and the frozen variance divides the compressed momentum by eps.
    ({"compress": "onebit", "compress_warmup": 10, "compress_warmup_with": "dithering:4",
      "compress_adam": True}, r"--compress-warmup-with dithering:4 sends elements as exactly "
                              r"0.*HINT: leave out --compress-warmup-with"),
    ({"compress": "onebit", "compress_warmup": 10, "compress_warmup_with": "topk:0.1",
      "compress_adam": True}, r"the run diverges"),
    ({"compress": "onebit", "compress_warmup": 2, "compress_adam_refresh": 4},
     r"--compress-adam-refresh 4 freezes 1-bit Adam's variance anew .* needs --compress-adam"
     r".*HINT: pass e.g. --compress-adam --compress-adam-refresh 4"),
    ({"compress": "onebit", "compress_warmup": 2, "compress_adam": True,
      "compress_adam_refresh": 1}, r"F of at least 2"),
    ({"compress": "onebit", "compress_adam": True, "compress_adam_refresh": -4},
     r"F of at least 2"),
])
def test_bad_compression_options_are_refused_with_the_reason(options, message):
    with pytest.raises(ConfigError, match=message):
        BytePSOptions(**options)
    BytePSOptions(compress="fp16", async_=True)  # the one async supports


@pytest.mark.parametrize("args, message", [
    (["--compress-warmup", "10", "--compress-warmup-with", "zip"],
     r"--compress-warmup-with: unknown compressor 'zip'; the compressors are: .*dithering"),
    (["--compress-warmup-with", "dithering:4"],
     r"--compress-warmup-with dithering:4 .* but --compress-warmup is 0"),
])
def test_a_bad_warmup_compressor_gets_one_clear_line(args, message, capsys):
    code = main(["train", "--quiet", "--strategy", "byteps", "--compress", "onebit", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("polytrain train: error: "), err
    assert re.search(message, err), err


def test_compress_momentum_beside_adams_own_momentum_is_refused_before_a_start():
    # Symptom: --optimizer adam --compress onebit --compress-momentum 0.9 trained with two
    # momenta (SGD's momentum beside it is refused). Cause: only an optimizer's 'momentum'
    # was read, and Adam's is betas[0].
    options = {"compress": "onebit", "compress_momentum": 0.9}
    with pytest.raises(ConfigError, match=r"^compress_momentum 0\.9 puts a momentum on the "
                                          r"gradients before compression, and Adam has "
                                          r"momentum 0\.9 of its own \(betas\[0\]\)"):
        TrainConfig(strategy="byteps", optimizer="adam", strategy_options=options)
    TrainConfig(strategy="byteps", optimizer="sgd", strategy_options=options)  # no momentum


def test_cpu_servers_on_one_worker_machine_are_warned_of(caplog, monkeypatch):
    # Symptom: `--servers 2` with one worker machine (the default --nodes 1) started two CPU
    # servers that summed nothing (0 bytes each in traffic.servers), without a word. Cause:
    # Theorem 1 gives CPU servers no share when nothing crosses between worker machines.
    # (A warning, not a refusal: the run is right, only its CPU servers idle.)
    from polytrain.strategies.byteps import strategy
    monkeypatch.setattr(strategy, "_warned", set())  # said once a process: not said yet
    parse("--workers", "2", "--servers", "2")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "byteps --servers 2 with one worker machine (--nodes 1): Theorem 1 gives the CPU "
        "servers no share of the model, so they sum nothing and the worker machine's own "
        "server sums every gradient; spread the workers over machines (--nodes N), or leave "
        "out --servers"]
    caplog.clear()
    parse("--workers", "2", "--servers", "2", "--no-colocate")  # the classic PS: they sum
    parse("--workers", "4", "--nodes", "2", "--servers", "1")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # k >= n: the CPU servers hold the whole model, and the colocated ones idle (noted only).
    with caplog.at_level("INFO", logger="polytrain"):
        parse("--workers", "2", "--nodes", "2", "--servers", "2")
    assert [r.getMessage() for r in caplog.records] == [
        "byteps --servers 2 on 2 worker machines: Theorem 1 gives the CPU servers the whole "
        "model when they are as many as the worker machines or more, so the colocated servers "
        "sum nothing (--no-colocate runs without them)"]


def test_idle_cpu_servers_are_warned_of_once_though_a_resume_checks_the_layout_again(
        caplog, monkeypatch):
    # A resumed run (its config rebuilt with --resume) and every --max-restarts restart
    # checked the layout again, and printed the warning again each time.
    from polytrain.strategies.byteps import strategy
    monkeypatch.setattr(strategy, "_warned", set())
    config = parse("--workers", "2", "--servers", "2")
    config.replace(resume="somewhere")
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
