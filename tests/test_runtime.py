"""Context.new_group: members-only groups among any workers; hints for raw torch errors; the
timeouts init takes."""

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import polytrain
from polytrain import CommError, CommTimeout, ConfigError, PeerLost, _env
from tests.harness import refused, spawn


def pairs_then_cross_pairs() -> float:
    ctx = polytrain.init()
    r = ctx.worker_index
    pair = ctx.new_group([0, 1] if r < 2 else [2, 3])
    cross = ctx.new_group([0, 2] if r % 2 == 0 else [1, 3])
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=pair)
    dist.all_reduce(t, group=cross)
    return float(t)


def joined_then_left() -> tuple[bool, bool, bool, str]:
    before = polytrain.runtime.has_joined()
    ctx = polytrain.init()
    ctx.shutdown()
    model = torch.nn.Linear(2, 2)
    said = refused(lambda: polytrain.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp", ctx=ctx))
    return before, polytrain.runtime.has_joined(), polytrain.is_initialized(), said


@pytest.mark.timeout(60)
def test_a_process_that_left_the_run_still_counts_as_having_joined_it():
    # The launcher asks, of a process whose script ended, whether it ever joined: a server
    # leaves (shutdown) before its script ends, and was reported as never having joined.
    # distribute(..., ctx=ctx) of the closed context met torch's "ValueError: Group ... is
    # not registered" (without ctx=, init()'s refusal said why).
    said = ("distribute() was called after this process left the run (the shutdown() of "
            "its context, polytrain.init()'s, which bps.shutdown() calls). HINT: distribute "
            "the model before the shutdown: a launched process joins its run once")
    assert spawn(joined_then_left, workers=2) == [(False, True, False, said)] * 2


def init_twice() -> list[str]:
    ctx = polytrain.init(timeout_s=30)
    said = [str(polytrain.init() is ctx), str(polytrain.init(device="cpu", timeout_s=30) is ctx)]
    for kwargs in ({"timeout_s": 5}, {"device": "meta"}):
        said.append(refused(lambda: polytrain.init(**kwargs)))  # noqa: B023 - called at once
    return said


@pytest.mark.timeout(60)
def test_a_second_init_that_asks_for_another_device_or_timeout_is_refused():
    # It returned the first call's run: a script's init(device="cuda") after distribute()
    # (which joins the run itself) trained on the CPU, silently.
    said = spawn(init_twice, workers=1)[0]
    assert said[:2] == ["True", "True"]
    assert said[2].startswith("polytrain.init() was called again with timeout_s=5 (it has 30)")
    assert said[3].startswith("polytrain.init() was called again with device='meta' (it has "
                              "cpu)")
    assert said[3].endswith("HINT: pass them to the first call: polytrain.init(...) before "
                            "distribute() or bps.init(), which join the run themselves")


def init_on(devices: list[str]) -> list[str]:
    return [refused(lambda: polytrain.init(device=d)) for d in devices]  # noqa: B023


@pytest.mark.timeout(60)
def test_a_device_polytrain_does_not_run_on_is_refused_in_one_line():
    # device='meta' was taken, and distribute() failed inside torch ("Tensor.item() cannot
    # be called on meta tensors"); 'gpu' met torch's own list of every device type.
    said = spawn(init_on, workers=1, args=(["meta", "gpu", "mps"],))[0]
    for name, text in zip(["meta", "gpu", "mps"], said):
        assert text == f"device {name!r}: polytrain runs on cpu or cuda. HINT: pass " \
                       f"device='cpu' or device='cuda' (or 'cuda:N')", text


@pytest.mark.timeout(60)
def test_members_only_groups_between_leaders_and_others():
    # Regression: rank 0 (a leader) and rank 1 hung creating a group of [0, 1]. torch
    # names a members-only group by its ranks and the count of groups the process
    # holds; rank 0 held one more (the leaders' group) than rank 1.
    assert spawn(pairs_then_cross_pairs, workers=4, nodes=2) == [6.0] * 4


def test_a_gloo_timeout_gets_the_default_group_hint_only_from_the_users_own_call(monkeypatch):
    from types import SimpleNamespace

    from polytrain import runtime

    monkeypatch.setattr(runtime, "_context", SimpleNamespace(
        is_worker=True, topology=SimpleNamespace(servers=(2,))))
    text = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv"

    def raised_in(filename: str) -> BaseException:
        try:
            exec(compile(f"raise RuntimeError({text!r})", filename, "exec"))
        except RuntimeError as e:
            return e
        raise AssertionError("nothing raised")

    assert "group=ctx.groups.workers" in runtime.hint_for(raised_in(__file__))
    inside = str(Path(runtime.__file__).parent / "strategies" / "checks.py")
    assert runtime.hint_for(raised_in(inside)) is None  # polytrain's own collective
    assert runtime.hint_for(RuntimeError("boom")) is None
    monkeypatch.setattr(runtime, "_context", SimpleNamespace(
        is_worker=True, topology=SimpleNamespace(servers=())))
    assert runtime.hint_for(raised_in(__file__)) is None  # no servers: the world is the workers


def test_environment_values_are_read_without_their_spaces_and_empty_is_unset(monkeypatch):
    # POLYTRAIN_LOG_LEVEL="info " was refused as a level (WARNING taken), and
    # POLYTRAIN_TIMEOUT= (set to nothing, as `export X=` leaves it) stopped every run.
    assert _env.read({"POLYTRAIN_TIMEOUT": ""}).timeout_s == _env.DEFAULT_TIMEOUT_S
    assert _env.read({"POLYTRAIN_TIMEOUT": " 30 "}).timeout_s == 30
    monkeypatch.setenv("POLYTRAIN_LOG_LEVEL", " info ")
    assert _env.log_level() == "INFO"
    monkeypatch.setenv("POLYTRAIN_LOG_LEVEL", "")
    assert _env.log_level() == "WARNING"


def test_processes_share_the_cores_this_process_may_run_on(monkeypatch):
    # Symptom: `taskset -c 0 polytrain launch --workers 1` ran torch on 2 threads, two on
    # one core. Cause: process_threads divided os.cpu_count() (the machine's cores), not
    # the cores of the launcher's CPU affinity, which its processes inherit.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert _env.process_threads(1) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 4, 5}, raising=False)
    assert [_env.process_threads(n) for n in (1, 2, 3, 8)] == [4, 2, 1, 1]
    assert _env.process_threads(2, cores=16) == 8  # the planner's --cores
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    assert _env.process_threads(2) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _env.process_threads(2) == 3


def test_a_launchers_rank_or_port_that_is_not_a_whole_number_is_refused_in_one_line():
    # LOCAL_RANK=abc (RANK, WORLD_SIZE, MASTER_PORT) was int()'s bare ValueError.
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT"):
        with pytest.raises(ConfigError, match=rf"{name}='abc' is not a whole number\. HINT: "
                                              rf"set {name} as a launcher does"):
            _env.read({"RANK": "0", "WORLD_SIZE": "2", name: "abc"})
    assert _env.read({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}).master_port == \
        29500


def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused_in_one_line():
    # POLYTRAIN_TIMEOUT=abc was float()'s ValueError; init(timeout_s=-1) reached gloo's
    # "The client socket has timed out after -1000ms".
    # A timeout past 2**31 ms (1e300) was an OverflowError in every process.
    with pytest.raises(ConfigError, match=r"POLYTRAIN_TIMEOUT='abc' is not a number of "
                                          r"seconds\. HINT: set it to, say, 120"):
        _env.read({"POLYTRAIN_TIMEOUT": "abc"})
    for text in ("0", "-5", "1.5", "inf", "nan", "1e300"):
        got = re.escape(format(float(text), "g"))
        with pytest.raises(ConfigError, match=r"POLYTRAIN_TIMEOUT must be a number of seconds "
                                              rf"from 2 to 2147483 \(got {got}\)\. "
                                              r"HINT: set it to, say, 120"):
            _env.read({"POLYTRAIN_TIMEOUT": text})
    assert _env.read({"POLYTRAIN_TIMEOUT": "2.5"}).timeout_s == 2.5
    for kwargs in ({"timeout_s": -1}, {"server_idle_s": 0}, {"timeout_s": float("inf")},
                   {"timeout_s": 1e300}):
        with pytest.raises(ConfigError, match=r"polytrain\.init\(\w+=\.\.\.\) must be a "
                                              r"number of seconds from 2 to 2147483 "
                                              r"\(got \S+\)\. HINT: pass, say, \w+=(120|3600)$"):
            polytrain.init(**kwargs)
    assert not polytrain.is_initialized()


def test_a_run_configured_in_python_takes_the_timeout_from_the_environment(monkeypatch):
    # polytrain train and init() read POLYTRAIN_TIMEOUT; TrainConfig (run_config's) did not.
    monkeypatch.delenv("POLYTRAIN_TIMEOUT", raising=False)
    assert polytrain.TrainConfig().timeout_s == 120
    monkeypatch.setenv("POLYTRAIN_TIMEOUT", "600")
    assert polytrain.TrainConfig().timeout_s == 600
    assert polytrain.TrainConfig(timeout_s=30).timeout_s == 30


def test_a_join_that_fails_on_several_hosts_names_gloos_interface_where_it_is_loopback(
        monkeypatch):
    from polytrain import runtime

    env = _env.read({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
                     "MASTER_PORT": "29500"})
    for name in ("GLOO_SOCKET_IFNAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime.socket, "gethostbyname", lambda name: "127.0.1.1")
    assert "set GLOO_SOCKET_IFNAME to the interface" in runtime._interface_hint(env)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one host: loopback is right there
    assert runtime._interface_hint(env) == ""
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(runtime.socket, "gethostbyname", lambda name: "10.0.0.7")
    assert runtime._interface_hint(env) == ""
    monkeypatch.setattr(runtime.socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert runtime._interface_hint(env) == ""


@pytest.mark.timeout(30)
def test_a_rendezvous_port_taken_before_rank_0_listens_is_named_at_once():
    # It read as a join timeout ("could not join ... within 20 s"), with the hint to check
    # that every process was started, though rank 0 failed at once.
    import socket

    from polytrain import runtime

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        env = _env.read({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port), "POLYTRAIN_ROLE": "worker",
                         "POLYTRAIN_NODE": "node0"})
        started = time.monotonic()
        with pytest.raises(CommError, match=rf"rank 0 \(worker, machine node0\) could not "
                                            rf"listen .*:{port}: the port is in use.*HINT: "
                                            r"rerun") as caught:
            runtime._join(env, timeout=20)
    assert not isinstance(caught.value, CommTimeout) and time.monotonic() - started < 10


def test_what_fails_to_close_does_not_keep_the_rest_open(monkeypatch):
    # A close that raised at exit escaped Python's thread shutdown (which then stopped:
    # the executors' stop and the joins of the script's threads were skipped), and left
    # whatever was registered before it open.
    from polytrain import runtime

    closed = []

    class Closeable:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} failed")

    ctx = runtime.Context.__new__(runtime.Context)  # only what close_open needs
    ctx._open = [Closeable("first"), Closeable("second", fails=True), Closeable("third")]
    with pytest.raises(RuntimeError, match="second failed"):
        ctx.close_open()
    assert closed == ["third", "second", "first"] and ctx._open == []
    ctx._open = [Closeable("again", fails=True)]
    monkeypatch.delattr(sys, "last_value", raising=False)  # pytest's, of a test that failed
    runtime._context, before = ctx, runtime._context
    try:
        runtime._close_open_at_exit()  # logs, raises nothing
    finally:
        runtime._context = before
    assert closed[-1] == "again"


def test_a_join_whose_peer_closed_the_connection_says_it_lost_a_peer(monkeypatch):
    # A worker 0 killed at setup: every other process reported "CommTimeout: ... could not
    # join ... within 8 s: Failed to recv, got 0 bytes. Connection was likely closed", at
    # once, with its traceback, as a cause of its own (the launcher still named worker 0).
    from polytrain import runtime

    def closed(*args, **kwargs):
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed. Did "
                           "the remote server shutdown or crash?")
    monkeypatch.setattr(runtime.dist, "init_process_group", closed)
    env = _env.read({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "29500", "POLYTRAIN_ROLE": "server",
                     "POLYTRAIN_NODE": "node0"})
    with pytest.raises(PeerLost, match=r"rank 1 \(server, machine node0\) lost a peer while "
                                       r"joining the run of 2 processes .*: Failed to recv") as e:
        runtime._join(env, timeout=8)
    assert e.value.peer_lost and not isinstance(e.value, CommTimeout)


def test_workers_that_share_a_gpu_take_gloo_for_cuda_tensors():
    from polytrain.runtime import cuda_backend, shared_gpus
    assert cuda_backend([None, None]) == "gloo"  # CPU workers
    assert cuda_backend(["GPU-a", "GPU-b", None]) == "cpu:gloo,cuda:nccl"  # a server: None
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so one shared GPU
    # anywhere puts every group on gloo: all ranks must choose alike.
    assert cuda_backend(["GPU-a", "GPU-b", "GPU-a"]) == "gloo"
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", None]) == [[0, 2]]  # the warning's ranks


def test_a_worker_takes_the_gpu_of_its_index_among_the_hosts_workers(monkeypatch):
    monkeypatch.delenv(_env.HOST_WORKER, raising=False)
    monkeypatch.setenv(_env.RANK, "2")
    monkeypatch.setenv(_env.WORLD_SIZE, "4")
    monkeypatch.setenv(_env.TORCHELASTIC_RUN_ID, "x")
    monkeypatch.setenv(_env.PARENT_PID, "1")
    assert _env.gpu_index(local_rank=1, gpus=4) == 1  # torchrun: LOCAL_RANK
    monkeypatch.setenv(_env.HOST_WORKER, "2")  # inherited from a launched process: ignored
    assert _env.gpu_index(local_rank=1, gpus=4) == 1
    # polytrain launch: node1's first worker is the host's third, not a second GPU 0.
    monkeypatch.setenv(_env.PARENT_PID, str(os.getppid()))
    assert _env.gpu_index(local_rank=0, gpus=4) == 2
    assert _env.gpu_index(local_rank=0, gpus=2) == 0  # more workers than GPUs: round-robin


def host_worker():
    polytrain.init()
    return os.environ.get(_env.HOST_WORKER)


@pytest.mark.timeout(120)
def test_the_launcher_numbers_workers_across_the_hosts_machines():
    assert spawn(host_worker, workers=4, nodes=2, servers=1) == ["0", "1", "2", "3"]


def test_a_bad_log_level_does_not_stop_import_polytrain():
    # `import polytrain` raised ValueError from logging.
    import os
    import subprocess
    import sys

    env = dict(os.environ, POLYTRAIN_LOG_LEVEL="loud", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", "import polytrain; print('imported')"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "imported\n", done.stderr
    assert "POLYTRAIN_LOG_LEVEL='LOUD' is not a level" in done.stderr


def test_server_threads_that_are_not_a_count_of_at_least_one_are_refused_before_joining():
    # Symptom: init(server_threads=1.5) or "2" killed each server with a raw TypeError, and
    # 0 or -1 ran one thread, silently. Cause: server_threads was passed on unchecked.
    for value, said in [(1.5, r"must be a whole number \(got 1\.5\)\. HINT: pass "
                              r"server_threads as a whole number"),
                        ("2", r"must be a whole number \(got '2'\)\. HINT: pass "
                              r"server_threads as a whole number"),
                        (0, r"must be at least 1 \(got 0\)\. HINT: pass, say, server_threads=4"),
                        (-1, r"must be at least 1 \(got -1\)\. HINT: pass, say, "
                             r"server_threads=4")]:
        with pytest.raises(ConfigError, match=r"^polytrain\.init\(\) server_threads " + said):
            polytrain.init(server_threads=value)
    assert not polytrain.is_initialized()


def init_again_with(calls: list[dict]) -> list[str]:
    polytrain.init(timeout_s=30)
    said = []
    for kwargs in calls:
        try:
            polytrain.init(**kwargs)
        except Exception as e:  # noqa: BLE001 - a raw error is what the test looks for
            said.append(f"{type(e).__name__}: {e}")
        else:
            said.append("accepted")
    return said


AGAIN = [({"timeout_s": "120"}, r"polytrain\.init\(timeout_s=\.\.\.\) must be a number of "
                                r"seconds from 2 to 2147483 \(got '120'\)\. HINT: pass, say, "
                                r"timeout_s=120"),
         ({"device": "tpu"}, r"device 'tpu': polytrain runs on cpu or cuda\. HINT: pass "
                             r"device='cpu'"),
         ({"server_threads": 0}, r"polytrain\.init\(\) server_threads must be at least 1 "
                                 r"\(got 0\)\. HINT: pass, say, server_threads=4"),
         ({"server_idle_s": -1}, r"polytrain\.init\(server_idle_s=\.\.\.\) must be a number of "
                                 r"seconds from 2 to 2147483 \(got -1\)")]


@pytest.mark.timeout(60)
def test_a_second_init_checks_its_arguments_as_the_first_does():
    # After init(), init(timeout_s="120") was "ValueError: Unknown format code 'g'",
    # init(device="tpu") torch's RuntimeError, and server_threads=0 or server_idle_s=-1 were
    # accepted silently; a first init(timeout_s="abc") was float()'s ValueError. Cause: the
    # second call returned before init()'s checks, and the first float()ed the timeout before
    # check_seconds looked at it.
    said = spawn(init_again_with, workers=1, args=([kwargs for kwargs, _ in AGAIN],))[0]
    for (kwargs, pattern), text in zip(AGAIN, said):
        assert re.match("ConfigError: " + pattern, text), (kwargs, text)
        assert "\n" not in text
    with pytest.raises(ConfigError, match=r"^polytrain\.init\(timeout_s=\.\.\.\) must be a "
                                          r"number of seconds from 2 to 2147483 \(got 'abc'\)"):
        polytrain.init(timeout_s="abc")
    assert not polytrain.is_initialized()
