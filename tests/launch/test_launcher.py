import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import polytrain
from polytrain import ConfigError, LaunchError, TrainConfig, _env
from polytrain.launch import child, free_port, launcher
from polytrain.launch.launcher import _OWNER, SHM_ROOT, mark_owner, run_shm, sweep_stale
from polytrain.launch.layout import Layout
from polytrain.launch.network import start_time
from tests.harness import as_from_a_terminal, spawn, torchrun
from tests.launch import scripts

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.timeout(60)
def test_roles_machines_and_groups_reach_every_process():
    results = spawn(scripts.identity, workers=4, nodes=2, servers=1)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["machine"] for r in results] == ["node0", "node0", "node1", "node1"]
    assert [r["group"] for r in results] == ["0", "0", "1", "1"]  # torchrun's GROUP_RANK
    for r in results:
        assert r["role"] == "worker"
        assert r["workers"] == (0, 1, 2, 3) and r["servers"] == (4,)
        assert r["leaders"] == (0, 2)
        assert r["sum_of_worker_ranks"] == 6.0
        assert r["threads"] == "1"
    assert results[2]["local"] == (2, 3)


@pytest.mark.timeout(20)
def test_every_process_gets_the_variables_torchrun_sets(tmp_path, monkeypatch):
    # Symptom: a torchrun script reading GROUP_RANK or ROLE_RANK failed with KeyError under
    # polytrain launch. Cause: the launcher set only RANK, WORLD_SIZE, LOCAL_RANK,
    # LOCAL_WORLD_SIZE and MASTER_*, though it says every process gets what torchrun sets.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    layout = Layout(workers=4, nodes=2, colocated=1, servers=1)
    run = launcher.Launcher(layout)
    seen = []
    for spec in layout.processes():
        env = run._child_env(spec, launcher._files(tmp_path, spec.rank), None, None)
        seen.append((spec.rank, env["GROUP_RANK"], env["ROLE_NAME"], env["ROLE_RANK"],
                     env["ROLE_WORLD_SIZE"]))
        assert env["GROUP_WORLD_SIZE"] == "3"  # node0, node1, server0
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert "TORCHELASTIC_RUN_ID" not in env  # it says torchrun started the process
    assert seen == [(0, "0", "worker", "0", "4"), (1, "0", "worker", "1", "4"),
                    (2, "1", "worker", "2", "4"), (3, "1", "worker", "3", "4"),
                    (4, "0", "server", "0", "3"), (5, "1", "server", "1", "3"),
                    (6, "2", "server", "2", "3")]


@pytest.mark.timeout(60)
def test_threads_the_caller_passes_are_kept(monkeypatch):
    # Symptom: launch(..., env={"OMP_NUM_THREADS": "1"}) without the variable in the caller's
    # own environment ran the children with cpu_count // world_size threads. Cause: only
    # os.environ counted as the user's choice; what the caller passes counts too.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    results = polytrain.launch(scripts.identity, workers=2, timeout_s=60,
                               env={"OMP_NUM_THREADS": "3"})
    assert [r["threads"] for r in results] == ["3", "3"]


@pytest.mark.timeout(60)
def test_a_worker_that_raises_stops_the_run_and_is_named(capfd):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        spawn(scripts.worker_raises, workers=3, args=(1,))
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "worker rank 1 (machine node0) failed: RuntimeError: boom on purpose from rank 1" \
        in message
    assert info.value.rank == 1 and info.value.role == "worker"
    assert not info.value.bad_input  # --max-restarts may restart it
    capfd.readouterr()
    with pytest.raises(LaunchError) as info:
        spawn(scripts.worker_raises, workers=2, args=(1, True))
    # Its own hint comes last, once: it came inside the cause, before the launcher's hint.
    assert re.fullmatch(r"worker rank 1 \(machine node0\) failed: ConfigError: bad on purpose"
                        r"( \(1 other process failed after it\))?\. HINT: pass a good one",
                        str(info.value)), str(info.value)
    assert info.value.bad_input  # not restarted: a rerun fails the same (a hetpipe resume ran 3x)
    # A refusal is one line, where the script raised it: its traceback said nothing more
    # (a --on-save-error stop printed one per worker).
    err = capfd.readouterr().err
    assert re.search(r"\[polytrain rank 1 worker@node0\] refused at scripts\.py:\d+: "
                     r"ConfigError: bad on purpose\. HINT: pass a good one\n", err), err
    assert "Traceback" not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code, cause, hint", [
    (3, r"exited with code 3", r"it called sys\.exit: its output above may say why$"),
    # It said "the traceback of that process is printed above": there was none.
    ("os._exit(3)", r"exited with code 3", r"find what ended it \(os\._exit or sys\.exit in "
                                            r"one of its threads"),
    # It was "exited with code bad config...", pointing at a traceback there was none of.
    ("bad config: no data file", r"exited: bad config: no data file",
     r"fix what it says, and rerun$"),
    # It was named as rank 0's gloo timeout: the rank that waited, not the one that left.
    (0, r"ended its script \d+\.\d s before worker rank 0( lost a peer|'s wait timed out "
        r"\(after 4 s\)): its peers may have waited for it", r"if they waited in a collective "
                                                            r"every worker makes"),
])
def test_a_worker_that_exits_is_named_with_what_it_said(code, cause, hint):
    with pytest.raises(LaunchError, match=r"worker rank 1 \(machine node0\) failed: " + cause
                       + r"( \(1 other process failed after it\))?\. HINT: " + hint):
        polytrain.launch(scripts.worker_exits, workers=2, args=(1, code), timeout_s=4,
                         env={"OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("busy", [False, True], ids=["sleeps", "spins"])
def test_a_worker_that_never_reaches_the_collective_is_named_not_its_waiting_peers(
        busy, capfd):
    # Its heartbeat thread beats on, so only the peers' timeouts told of it, and the run was
    # reported as "worker rank 0 failed: ... Timed out": the waiting peer, not the stuck one.
    timeout = 6
    with pytest.raises(LaunchError) as info:
        polytrain.launch(scripts.worker_stalls, workers=3, args=(2, busy), timeout_s=timeout,
                         env={"OMP_NUM_THREADS": "1"})
    message = str(info.value)
    assert info.value.rank == 2, message
    assert re.search(r"worker rank 2 \(machine node0\) failed: stopped making progress: its "
                     r"main thread has worked for \d+\.\d s without waiting for any peer, now "
                     r"at scripts\.py:\d+ in worker_stalls, while worker rank [01] timed out "
                     r"waiting 6 s", message)
    assert "its threads' stacks are printed above" in message
    assert float(re.search(r"worked for (\d+\.\d) s", message).group(1)) < 4 * timeout
    # faulthandler's dump of the stuck process, under its name, shows the line it was stuck on.
    assert re.search(r'\[polytrain rank 2 worker@node0\] its threads when named as stalled:\n'
                     r'(.*\n)*?'
                     r'(Current thread|Thread) 0x[0-9a-f]+ .*\n'
                     r'  File ".*scripts\.py", line \d+ in worker_stalls\n',
                     capfd.readouterr().err)


@pytest.mark.timeout(60)
def test_a_process_the_host_refuses_to_start_is_named_with_what_to_do(monkeypatch):
    # A full process table (ulimit -u) or no memory: subprocess's BlockingIOError came out as
    # a traceback naming no process.
    monkeypatch.setenv("POLYTRAIN_FORKSERVER", "0")
    real, started = launcher.subprocess.Popen, []

    def popen(*args, **kwargs):
        if started:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]
    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    with pytest.raises(LaunchError, match=r"could not start worker rank 1 \(machine node0\): "
                                          r"\[Errno 11\] .*HINT: .*ulimit -u"):
        polytrain.launch(scripts.identity, workers=2, timeout_s=30)
    assert started[0].poll() is not None  # the one started was stopped


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_processes_start_starts_no_more(monkeypatch):
    # Every process was started before the launcher looked at the interrupt (each start may
    # wait for the fork server): docker stop's grace ran out and SIGKILL left the run's files.
    real, calls = launcher._start, []

    def start(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGINT)
        return calls[-1]
    monkeypatch.setattr(launcher, "_start", start)
    with pytest.raises(LaunchError, match=r"interrupted \(Ctrl-C\): stopped all 1 processes"):
        polytrain.launch(scripts.identity, workers=3, timeout_s=30)
    assert len(calls) == 1 and calls[0].poll() is not None


@pytest.mark.timeout(60)
def test_a_result_that_cannot_be_sent_back_is_named_as_such():
    # It read as "exited with code 1", after pickle's traceback.
    with pytest.raises(LaunchError, match=r"worker rank 0 .*the function returned a function, "
                                          r"which cannot be sent back to the launcher .*HINT: "
                                          r"return plain data"):
        polytrain.launch(scripts.returns_a_lambda, workers=1, timeout_s=30)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie that its new parent has not reaped counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail", [False, True], ids=["ends", "fails"])
def test_processes_a_worker_leaves_behind_are_stopped_with_the_run(tmp_path, fail, caplog):
    # A script's helper process outlived the run (and, under --bandwidth, kept its machine's
    # network namespace alive); a failed worker's orphans too.
    caplog.set_level("WARNING", logger="polytrain")
    if fail:
        with pytest.raises(LaunchError, match=r"worker rank 1 .*the script failed"):
            spawn(scripts.leaves_a_helper, workers=2, args=(str(tmp_path), fail))
    else:
        spawn(scripts.leaves_a_helper, workers=2, args=(str(tmp_path), fail))
    helpers = [int(p.read_text()) for p in tmp_path.glob("helper-*")]
    helpers += [int(p.read_text()) for p in tmp_path.glob("forked-*")]
    assert len(helpers) == 4
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in helpers), helpers
    for rank in (0, 1):
        assert f"worker rank {rank} left 1 process running" in caplog.text


@pytest.mark.timeout(20)
def test_run_config_under_torchrun_or_polytrain_launch_is_refused(monkeypatch):
    # Each process started a whole run of its own, all writing one --out.
    from polytrain.train import run as run_module
    monkeypatch.setattr(run_module, "Launcher", lambda *a, **k: pytest.fail("started a run"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(ConfigError, match=r"run_config\(\) \(polytrain train\) starts the run's "
                                          r"processes itself, and torchrun started this process "
                                          r"as one of 2"):
        run_module.run_config(TrainConfig(strategy="ddp", workers=2))


class _Running:
    pid = os.getpid()

    def poll(self):
        return None


@pytest.mark.timeout(20)
def test_a_heartbeat_is_aged_on_the_launchers_own_clock(tmp_path, monkeypatch):
    # Symptom: the age of a beat was the wall clock's time since the file's mtime. After a
    # Ctrl-Z and fg (the launcher checks before the children beat again), a suspend or a
    # clock step, every healthy process was reported hung: "no heartbeat for 600.0 s".
    from polytrain.launch.layout import ProcessSpec

    run = launcher.Launcher(Layout(workers=1), timeout_s=2.0)  # hung after 1 s without a beat
    files = launcher._files(tmp_path, 0)
    child = launcher._Child(ProcessSpec(0, "worker", "node0", 0), _Running(), *files,
                            started=time.monotonic(), beat_seen=time.monotonic())
    beat = child.heartbeat_file
    beat.write_text("{}")
    os.utime(beat, (time.time() - 600, time.time() - 600))  # the wall clock stepped on
    run._last_check = time.monotonic()
    assert run._check_heartbeats([child]) == []
    time.sleep(1.2)
    assert run._check_heartbeats([child]) == [child]  # no beat for 1.2 s: hung
    child.hung = ""
    os.utime(beat, (time.time(), time.time()))        # it beat again
    assert run._check_heartbeats([child]) == []
    clock = time.monotonic
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock() + 100)  # stopped 100 s
    assert run._check_heartbeats([child]) == []       # given its time again


class _Signalled(_Running):
    def send_signal(self, sig: int) -> None:  # the test writes its stacks itself
        pass


def _watched(tmp_path: Path, rank: int, role: str = "worker",
             beat: dict | None = None) -> launcher._Child:
    """A running child of a 4-worker, 1-server run, with a heartbeat record ``beat``."""
    from polytrain.launch.layout import ProcessSpec

    files = launcher._files(tmp_path, rank)
    child = launcher._Child(ProcessSpec(rank, role, f"node{rank // 2}", rank % 2), _Signalled(),
                            *files, started=time.monotonic(), beat_seen=time.monotonic())
    child.stacks_file.write_text(f"(rank {rank}'s threads)\n")
    if beat is not None:
        child.heartbeat_file.write_text(json.dumps(beat))
    return child


def _timed_out(rank: int, waited_s: float) -> launcher._Failure:
    from polytrain.launch.layout import ProcessSpec

    return launcher._Failure(ProcessSpec(rank, "worker", f"node{rank // 2}", rank % 2), 1,
                             "CommTimeout: ...", time.time(), False, waited_s=waited_s)


def test_a_process_working_for_half_the_timeout_is_named_though_it_began_after_the_wait(
        tmp_path, capfd):
    # Symptom: HetPipe, virtual worker 1's last stage asleep in the script for 40 s, --timeout
    # 10: 4 runs in 11 named worker rank 0 ("answer to PULL of key 0 ... waiting for server
    # rank 4"). Cause: a process was named as stalled only if it had worked since before the
    # waiter's wait began, and rank 0 waited (on the server, for the sleeper's pushes) from
    # before the sleep.
    run = launcher.Launcher(Layout(workers=4, nodes=2, servers=1), timeout_s=10.0)
    now = time.time()
    asleep = _watched(tmp_path, 3, beat={"working_since": now - 6, "where": "job.py:27 in body"})
    busy = _watched(tmp_path, 1, beat={"working_since": now - 2, "where": "job.py:20 in body"})
    waiting = _watched(tmp_path, 2, beat={"working_since": None, "where": "p2p.py:58 in wait"})
    assert run._stalled([busy, waiting, asleep], [], _timed_out(0, 10.0)) == [asleep]
    assert asleep.hung.startswith("stopped making progress: its main thread has worked for 6.0 s "
                                  "without waiting for any peer, now at job.py:27 in body, while "
                                  "worker rank 0 timed out waiting 10 s"), asleep.hung
    assert "(rank 3's threads)" in capfd.readouterr().err


def test_pushes_a_held_answer_waits_for_name_their_processes_not_the_server(tmp_path, capfd):
    # Symptom: a HetPipe run whose virtual worker 1 was slower than --timeout allowed ended
    # "server rank 4 (machine server0) failed: held answers ...", with the hint to look for
    # a push_pull only some workers run. Cause: the server's report named no process; it now
    # names those behind the others (working, not waiting for an answer there).
    run = launcher.Launcher(Layout(workers=4, nodes=2, servers=1), timeout_s=6.0)
    now = time.time()
    server = _watched(tmp_path, 4, "server")
    held = ("PULL of 'embed[0]' (key 0) round 4 for worker rank 0 (machine node0), held 6 s: 0 "
            "rounds applied; round 1 has 1 of its 2 pushes (from rank 0); pushes behind: worker "
            "rank 2 (machine node1) has pushed none yet")
    server.held_file.write_text(json.dumps({"held": held, "hint": "(the server's)",
                                            "behind": [2, 3]}))
    stage0 = _watched(tmp_path, 2, beat={"working_since": None, "where": "p2p.py:58 in wait"})
    stage1 = _watched(tmp_path, 3, beat={"working_since": now - 2, "where": "clock.py:9 in wait"})
    children = [_watched(tmp_path, 0), _watched(tmp_path, 1), stage0, stage1, server]
    assert run._holding(children, _timed_out(0, 6.0)) == [stage1, stage0]  # working first
    assert stage1.hung == ("fell behind the others: server rank 4 held answers that wait for its "
                           "pushes, and worker rank 0 timed out waiting 6 s: " + held)
    assert stage1.hint.startswith("its threads' stacks are printed above: it was working, not "
                                  "waiting for an answer; if it is only slower than the others")
    # One that waits elsewhere is not called working (the diff's review: a rank that skipped
    # its push and waits in a collective got "it was working" and lost the server's hint).
    assert stage0.hint.startswith("its threads' stacks are printed above: it waits elsewhere, "
                                  "not pushing here: look for a push_pull, a layer or a step "
                                  "that only some workers run"), stage0.hint
    assert server.hung == ""
    assert "(rank 3's threads)" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_a_process_whose_heartbeat_record_cannot_be_written_is_not_taken_for_hung(capfd):
    # On a full disk the heartbeat thread stopped at its first failed write, and the launcher
    # then stopped the working process as hung, once half the timeout had passed.
    assert polytrain.launch(scripts.heartbeat_unwritable, workers=1, args=(5.0,), timeout_s=2,
                            env={"OMP_NUM_THREADS": "1"}) == [7]
    err = capfd.readouterr().err
    assert err.count("its heartbeat record cannot be written") == 1, err
    assert re.search(r"\[polytrain rank 0 worker@node0\] its heartbeat record cannot be "
                     r"written \(Is a directory\): only the file's time is renewed", err), err


@pytest.mark.timeout(60)
def test_leaving_the_run_at_exit_that_times_out_says_so_in_one_line(capfd):
    # It printed gloo's traceback ("Exception ignored in atexit callback"), naming no one.
    assert polytrain.launch(scripts.late_to_leave, workers=2, args=(1, 11.0), timeout_s=5,
                            env={"OMP_NUM_THREADS": "1"}) == [0, 1]
    err = capfd.readouterr().err
    assert re.search(r"shutdown at exit failed: rank 0: leaving the run \(gathering every "
                     r"process's meter report\) did not complete within 5 s, waiting for any "
                     r"peer", err), err
    assert "Traceback" not in err and "atexit" not in err, err
    # A timeout after rank 0's leaving timed out, rank 1, still working alone, is named in a
    # warning, not stopped (a process stuck after the last collective hung the run with no
    # word of it: no process fails on it; one finishing work of its own must not be cut).
    assert re.search(r"polytrain: warning: worker rank 1 \(machine node0\) is still running: "
                     r"its main thread has worked for \d+\.\d s without waiting for any peer, "
                     r"now at scripts\.py:\d+ in late_to_leave, while worker rank 0 timed out "
                     r"waiting 5 s; the run ends when it does\. HINT: if it is stuck, stop the "
                     r"run", err), err
    assert "[polytrain rank 1 worker@node0] its threads when named as still running alone:" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script,what", [
    # It was joined without a word: a process that never ended said nothing of why.
    (scripts.thread_outlives_script, r"its thread 'uploader' \(not a daemon\)"),
    # It was waited for without a word: an exit handler that never returned hung the run
    # with nothing printed (and no timeout: Python waits for it too).
    (scripts.exit_handler_outlives_script, r"an exit handler \(atexit\)")],
    ids=["thread", "exit handler"])
def test_what_outlives_the_script_is_waited_for_and_named(capfd, script, what):
    assert polytrain.launch(script, workers=2, args=(5.0,), timeout_s=2,
                            env={"OMP_NUM_THREADS": "1"}) == [0, 1]
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert re.search(rf"\[polytrain rank {rank} worker@\S+\] its script has ended, but "
                         rf"{what} still runs, now at scripts\.py:\d+ in _upload", err), err


@pytest.mark.timeout(60)
def test_an_idle_thread_pool_left_at_exit_ends_as_under_python(capfd):
    # Its idle worker thread waits for the stop that Python's own shutdown sends: the join
    # alone waited for ever.
    assert polytrain.launch(scripts.executor_left_idle, workers=2, timeout_s=5,
                            env={"OMP_NUM_THREADS": "1"}) == [0, 1]
    assert "still runs" not in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_a_collective_on_the_default_group_with_servers_says_which_group_to_pass():
    # The servers never join the world group, so gloo times out naming only its own source.
    with pytest.raises(LaunchError, match=r"worker rank \d \(machine node0\) failed: "
                                          r"RuntimeError: .*Timed out.* HINT: if that call was "
                                          r"a collective on the default group: this run has "
                                          r"server processes, .*group=ctx\.groups\.workers"):
        polytrain.launch(scripts.all_reduce_on_the_default_group, workers=2, colocated=1,
                         timeout_s=5, env={"OMP_NUM_THREADS": "1"})


def mark_as(path, pid, start, pid_ns=None):
    """What mark_owner writes, for a launcher ``pid`` started at ``start``."""
    mark_owner(path)
    owner = json.loads((path / _OWNER).read_text())
    owner.update(pid=pid, start=start, **({} if pid_ns is None else {"pid_ns": pid_ns}))
    (path / _OWNER).write_text(json.dumps(owner))


@pytest.mark.timeout(10)
def test_the_sweep_removes_only_directories_a_launcher_that_is_gone_made(tmp_path):
    # Symptom: a user's /tmp/polytrain-2024-06-01 (an --out) was read as pid 2024 and
    # removed with its final.pt; so was a live run's directory of a container sharing /tmp.
    dirs = {name: tmp_path / name for name in (
        "polytrain-2024-06-01", "polytrain-4194999-12345-abcd_123", "polytrain-4194999-12345-"
        "unmarked", "polytrain-4194999-12345-otherns1", "polytrain-4194999-12345-stale123")}
    for path in dirs.values():
        path.mkdir()
        (path / "final.pt").write_bytes(b"x")
    mark_as(dirs["polytrain-2024-06-01"], 2024, 6)                   # not a launcher's name
    mark_as(dirs["polytrain-4194999-12345-abcd_123"], os.getpid(),   # a live launcher's
            start_time(os.getpid()))
    mark_as(dirs["polytrain-4194999-12345-otherns1"], 4194999, 12345, "pid:[1]")
    mark_as(dirs["polytrain-4194999-12345-stale123"], 4194999, 12345)
    sweep_stale(tmp_path, "polytrain-", "the work directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for n in dirs if n != "polytrain-4194999-12345-stale123")


@pytest.mark.timeout(30)
def test_the_sweep_stops_what_a_killed_launchers_processes_left_running(tmp_path):
    # Symptom: after kill -9 of the launcher, a helper a worker had started (its parent-death
    # signal is not inherited) ran on for good; the next launch removed only the directory.
    stale = tmp_path / "polytrain-4194999-12345-stale123"
    stale.mkdir()
    mark_as(stale, 4194999, 12345)
    env = {**os.environ, "POLYTRAIN_RUN_DIR": str(stale), "POLYTRAIN_ROLE": "worker",
           "RANK": "1"}
    helper = subprocess.Popen(["sleep", "60"], env=env)
    other = subprocess.Popen(["sleep", "60"])  # not the run's: left alone
    try:
        sweep_stale(tmp_path, "polytrain-", "the work directory")
        assert helper.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None and not stale.exists()
    finally:
        for p in (helper, other):
            p.kill()
            p.wait()


@pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this host")
@pytest.mark.timeout(90)
def test_the_runs_shared_memory_is_removed_however_the_run_ends():
    # Symptom: a killed PipeTransformer run left its AutoCache in /dev/shm. Now a run's
    # processes share a directory the launcher makes and removes, and a launcher that was
    # itself killed has its directory removed by the next one's start.
    mine = f"polytrain-run-{os.getpid()}-*"
    stale = SHM_ROOT / "polytrain-run-4194999-12345-deadbeef"  # no such pid
    stale.mkdir(exist_ok=True)
    (stale / "left").write_bytes(b"x")
    mark_as(stale, 4194999, 12345)
    live = run_shm()                              # this process's, still running
    assert live is not None and live.is_dir()
    try:
        shms = spawn(scripts.fill_shared_memory, workers=2, args=(-1,))
        assert shms[0] == shms[1] and shms[0].startswith(str(SHM_ROOT / "polytrain-run-"))
        assert not Path(shms[0]).exists()         # a clean end
        assert not stale.exists() and live.is_dir()
        with pytest.raises(LaunchError, match=r"worker rank 1 .* killed by SIGKILL"):
            spawn(scripts.fill_shared_memory, workers=2, args=(1,))
        assert sorted(SHM_ROOT.glob(mine)) == [live]  # a failed run's is gone too
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)


@pytest.mark.timeout(60)
def test_a_process_killed_by_a_signal_is_named():
    with pytest.raises(LaunchError, match=r"worker rank 2 \(machine node1\) failed: killed by "
                                          r"SIGKILL \(9\)"):
        spawn(scripts.killed_by_signal, workers=4, nodes=2, args=(2,))


@pytest.mark.timeout(60)
def test_a_crash_in_c_code_is_named_and_its_dump_printed_under_its_name(capfd):
    # faulthandler's dump went to the shared terminal naming no process: with several
    # processes (or several crashes) nobody could tell whose it was.
    with pytest.raises(LaunchError, match=r"worker rank 1 \(machine node0\) failed: killed by "
                                          r"SIGSEGV \(11\)\. HINT: a signal ended it"):
        spawn(scripts.killed_by_signal, workers=2, args=(1, "segfault"))
    err = capfd.readouterr().err
    assert re.search(r"\[polytrain rank 1 worker@node0\] where it crashed \(faulthandler\):\n"
                     r"Fatal Python error: Segmentation fault\n(.*\n)*?"
                     r'  File ".*scripts\.py", line \d+ in killed_by_signal\n', err), err
    assert err.count("Fatal Python error") == 1, err  # not also unlabelled


def test_a_sigkill_while_the_kernels_oom_kills_rose_is_named_as_out_of_memory(monkeypatch):
    # A real out-of-memory kill would take this shared machine's memory: the kernel's OOM
    # kill count (launch/host.py's oom_kills) is faked, the process killed by SIGKILL is real.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.kill()
    proc.wait()
    spec = Layout(workers=2).processes()[1]
    child = launcher._Child(spec, proc, *(Path("/nonexistent") / n for n in "erlhswc"))
    monkeypatch.setattr(launcher, "oom_kills", lambda: 8)
    oom = launcher._failure(child, oom_kills_before=7)
    assert oom.describe() == ("worker rank 1 (machine node0) failed: killed by SIGKILL (9), "
                              "likely by the kernel's out-of-memory killer (its kill count "
                              "rose during the run): the run needed more memory than this "
                              "machine has")
    assert oom.hint.startswith("run fewer processes on this machine, or a smaller model")
    for before in (8, None):  # no kill during the run, or no counter on this host
        plain = launcher._failure(child, oom_kills_before=before)
        assert plain.cause == "killed by SIGKILL (9)"
        assert plain.hint.startswith("a signal ended it without a traceback")


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.environ.get("POLYTRAIN_FORKSERVER") == "0",
                    reason="the processes are not forked (POLYTRAIN_FORKSERVER=0)")
@pytest.mark.parametrize("oom", [False, True], ids=["killed", "oom"])
def test_processes_that_died_with_their_fork_server_name_it(monkeypatch, oom):
    # They were "worker rank 0 failed: killed by SIGKILL (9)", as if killed themselves.
    counts = iter(range(1_000_000))
    monkeypatch.setattr(launcher, "oom_kills", lambda: next(counts) if oom else 0)
    with pytest.raises(LaunchError) as info:
        spawn(scripts.fork_server_killed, workers=2, args=(os.getpid(),))
    assert re.match(r"worker rank [01] \(machine node0\) failed: ended with the fork server "
                    r"that started it \(pid \d+\), which was killed by SIGKILL \(9\)"
                    + (r", likely by the kernel's out-of-memory killer" if oom else r" \(")
                    , str(info.value)), str(info.value)
    assert info.value.hint.startswith("run fewer processes" if oom
                                      else "find what ended the fork server")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, cause", [
    ("kill", r"killed by SIGKILL"),
    # It was named as the worker that lost it: "worker rank 0 (machine node0) failed:
    # PeerLost: ... lost server rank 2", the server itself only inside that message.
    ("exit0", r"exited with code 0 while worker rank [01] still needed it: worker rank [01] "
              r"lost it mid-run( \(\d other process(es)? failed after it\))?\. HINT: a server "
              r"ends only once every worker has finished"),
])
def test_a_server_gone_mid_run_stops_the_run_within_30_s_and_is_named(tmp_path, how, cause):
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^server rank 2 \(machine server0\) failed: "
                                          + cause):
        spawn(scripts.server_dies_mid_run, workers=2, servers=1, args=(str(tmp_path), how))
    assert time.monotonic() - start < 30
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_pushes_that_differ_across_workers_are_named_by_the_server_that_held_them():
    # It was "worker rank 1 failed: CommTimeout: rank 1: answer to push_pull of both[0] did
    # not complete within 6 s, waiting for server rank 2": a slow server, to all appearances.
    with pytest.raises(LaunchError) as info:
        polytrain.launch(scripts.pushes_that_differ, workers=2, nodes=2, servers=1,
                         timeout_s=6, env={"OMP_NUM_THREADS": "1"})
    message = str(info.value)
    assert message.startswith("server rank 2 (machine server0) failed: held answers the "
                              "workers waited for, and could not give them: "), message
    assert re.search(r"PUSHPULL of 'both\[0\] of 8' \(key \d+\) round 1 for worker rank 1 "
                     r"\(machine node1\), held \d+ s: round 1 has 1 of its 2 pushes \(from rank "
                     r"1\)", message), message
    assert re.search(r"PUSHPULL of 'only_rank0\[0\] of 8' \(key \d+\) round 0 for worker "
                     r"rank 0 \(machine node0\), held \d+ s: round 0 has 1 of its 2 pushes "
                     r"\(from rank 0\)", message), message
    assert info.value.hint.startswith("every worker must push and pull the same tensors")


@pytest.mark.timeout(60)
def test_a_worker_that_exits_0_from_a_thread_is_named_not_the_peers_that_lost_it():
    # It was "worker rank 0 failed: RuntimeError: [...] Connection closed by peer": the
    # peer that lost it, as torch names no rank.
    with pytest.raises(LaunchError, match=r"^worker rank 2 \(machine node0\) failed: exited "
                                          r"with code 0 without returning from its script \(its "
                                          r"heartbeat never said it returned\), while worker rank "
                                          r"[013] still needed it.*HINT: find what ended it"):
        polytrain.launch(scripts.worker_exits_0_from_a_thread, workers=4, args=(2,),
                         timeout_s=6, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(90)
def test_a_worker_that_ends_with_os_exit_is_told_to_leave_the_run_first():
    # The hint said "must first wait for its peers (a barrier)": a script that did so still
    # failed, as the servers need every worker's finish, which only polytrain's shutdown
    # sends (os._exit skips the one at exit).
    with pytest.raises(LaunchError) as info:
        polytrain.launch(scripts.byteps_steps_then_os_exit, workers=2, servers=1, args=(False,),
                         timeout_s=8, env={"OMP_NUM_THREADS": "1"})
    assert "call polytrain.current().shutdown() before os._exit" in info.value.hint, \
        str(info.value)
    assert polytrain.launch(scripts.byteps_steps_then_os_exit, workers=2, servers=1,
                            args=(True,), timeout_s=8, env={"OMP_NUM_THREADS": "1"}) \
        == [None, None]


@pytest.mark.timeout(60)
def test_a_server_that_never_joins_is_named_not_the_workers_that_waited():
    # It was "worker rank 1 failed: CommTimeout: ... could not join the run of 3 processes".
    with pytest.raises(LaunchError, match=r"^server rank 2 \(machine server0\) failed: ended "
                                          r"its script without joining the run \(polytrain\."
                                          r"init\(\) was never called there\), \d+\.\d s before "
                                          r"worker rank [01] failed waiting for it.*HINT: every "
                                          r"process of a run, servers too, must call "
                                          r"polytrain\.init\(\)"):
        polytrain.launch(scripts.server_never_joins, workers=2, servers=1, timeout_s=4,
                         env={"OMP_NUM_THREADS": "1"})


def test_a_member_file_finds_only_processes_started_since_the_run(tmp_path):
    # Every process on the host had each open descriptor read at every scan (244 ms against
    # 16 with 20 processes of 2,000 files): only those started since the run's launcher
    # can be the run's.
    workdir = tmp_path / "run"
    workdir.mkdir()
    fd = os.open(workdir / f"{_env.MEMBER_PREFIX}worker-3", os.O_RDONLY | os.O_CREAT)
    holder = subprocess.Popen(["sleep", "60"], pass_fds=(fd,))
    os.close(fd)
    try:
        for since, found in [(0, {holder.pid: "worker rank 3"}),
                             (start_time(holder.pid) + 1, {})]:  # it started before the run
            record = {**json.loads(json.dumps(launcher.owner_record())), "start": since}
            (workdir / _OWNER).write_text(json.dumps(record))
            assert launcher._run_processes(workdir) == found
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(120)
def test_no_orphans_when_the_launcher_itself_is_killed(tmp_path, caplog):
    # The launcher's children die with it (PR_SET_PDEATHSIG), even on kill -9; what they
    # forked, handed to init, is stopped by the next launcher. Symptom: a worker's forked
    # child ran on for good. Cause: its /proc environ, the fork server's, names no run.
    code = (f"import polytrain; from tests.launch import scripts; "
            f"polytrain.launch(scripts.write_pid_and_hang, workers=2, servers=1, "
            f"args=({str(tmp_path)!r}, True))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    forked: list[int] = []
    try:
        pids = scripts.started_pids(tmp_path, 3)
        forked = [int(p.read_text()) for p in tmp_path.glob("forked-*")]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
        assert len(forked) == 3 and all(_alive(p) for p in forked)
        # Its work directory outlived it (kill -9: no cleanup); the next launcher's start
        # removes it, and stops what its processes forked.
        left = list(Path(tempfile.gettempdir()).glob(f"polytrain-{launcher.pid}-*"))
        assert len(left) == 1 and (left[0] / "processes.json").exists()
        assert spawn(scripts.identity, workers=1)[0]["sum_of_worker_ranks"] == 0.0
        assert not left[0].exists()
        assert not any(_alive(p) for p in forked)
        for who in ("worker rank 0", "worker rank 1", "server rank 2"):
            assert f"{who} left 1 process running" in caplog.text, caplog.text
    finally:
        launcher.kill()
        for pid in forked:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inherited", ["default", "sigterm", "sighup"])
def test_ctrl_c_stops_every_child(tmp_path, inherited):
    # "sigterm" (what timeout, docker stop and Slurm send) ended the launcher at once,
    # leaving its work directory and shared memory behind, and saying nothing; so did
    # "sighup" (the terminal or ssh session closed). A signal the launcher was started with
    # ignored stays ignored: test_signals_the_launcher_was_started_ignoring_stay_ignored.
    code = (f"import polytrain; from tests.launch import scripts; "
            f"polytrain.launch(scripts.write_pid_and_hang, workers=2, "
            f"args=({str(tmp_path)!r},))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=as_from_a_terminal)
    try:
        pids = scripts.started_pids(tmp_path, 2)
        sent = {"sigterm": signal.SIGTERM, "sighup": signal.SIGHUP}.get(inherited,
                                                                        signal.SIGINT)
        launcher.send_signal(sent)
        _, err = launcher.communicate(timeout=60)
    finally:  # its children die with it (PR_SET_PDEATHSIG)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    how = "Ctrl-C" if sent == signal.SIGINT else sent.name
    assert f"interrupted ({how}): stopped all 2 processes" in err
    assert not any(_alive(p) for p in pids)
    assert not list(Path(tempfile.gettempdir()).glob(f"polytrain-{launcher.pid}-*"))
    assert not list(Path("/dev/shm").glob(f"polytrain-run-{launcher.pid}-*"))


@pytest.mark.timeout(120)
def test_signals_the_launcher_was_started_ignoring_stay_ignored():
    # Symptom: `nohup polytrain train ... &` stopped when the terminal closed ("the fork
    # server ... ended (code -1)", then "interrupted (SIGHUP)"), and a shell script's
    # background job (started with SIGINT ignored) stopped on a `kill -INT` of its process
    # group. Cause: the launcher put its own handlers in place of SIG_IGN, and started the
    # fork server under them (exec resets a handler to the default, not to SIG_IGN); the
    # server's children took SIGINT's default from the server, not the launcher's SIG_IGN.
    ignored = [signal.SIGHUP, signal.SIGINT]
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    try:
        got = spawn(scripts.signals_reach_the_run, workers=2, args=(os.getpid(), ignored))
        assert [signal.getsignal(sig) for sig in ignored] == [signal.SIG_IGN] * 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert got == [[True, True], [True, True]]  # and the run ended as it does


def _children_of(pid):
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(cmdline)
    return found


@pytest.mark.timeout(120)
def test_ctrl_c_while_the_fork_server_starts_prints_the_launchers_line_alone(tmp_path):
    # The terminal sends SIGINT to the whole process group: the fork server, importing
    # torch, printed a KeyboardInterrupt traceback (and the launcher a warning that it had
    # ended) around the launcher's one line.
    code = (f"import polytrain; from tests.launch import scripts; "
            f"polytrain.launch(scripts.write_pid_and_hang, workers=2, "
            f"args=({str(tmp_path)!r},))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not any(b"forkserver" in c for c in _children_of(launcher.pid)):
        assert launcher.poll() is None and time.monotonic() < deadline, "no fork server"
        time.sleep(0.01)
    os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: every process of the group
    _, err = launcher.communicate(timeout=60)
    assert "LaunchError: interrupted (Ctrl-C)" in err  # what launch() raises in the script
    assert err.count("Traceback") == 1 and "KeyboardInterrupt" not in err, err
    assert "fork server" not in err, err


@pytest.mark.timeout(120)
def test_a_worker_ended_by_a_signal_from_outside_is_named_not_taken_for_an_interrupt(
        tmp_path):
    # A worker's own SIGTERM handler leaves with code 143 and no error file: it was reported
    # as "exited with code 143" pointing at a traceback there was none of, and taken for the
    # launcher's own interrupt (no --max-restarts restart; a review found it).
    code = ("import sys, polytrain\nfrom tests.launch import scripts\ntry:\n"
            f"    polytrain.launch(scripts.write_pid_and_hang, workers=2, "
            f"args=({str(tmp_path)!r},))\n"
            "except polytrain.LaunchError as e:\n"
            "    print('interrupted' if e.interrupted else 'failed', e.exitcode, e, "
            "file=sys.stderr)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                                stderr=subprocess.PIPE, text=True)
    scripts.started_pids(tmp_path, 2)
    os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    # As a signal, as docs/architecture.md says (polytrain train exits 1), not with 143: the
    # code of the launcher's own SIGTERM.
    assert re.search(r"failed -15 worker rank 1 \(machine node0\) failed: ended by SIGTERM \(exit "
                     r"code 143\).*HINT: a signal ended it.*SIGTERM or SIGINT, something "
                     r"outside the run", err), err


@pytest.mark.timeout(120)
def test_a_fixed_port_serves_one_run_after_another():
    # The last run's connections hold the port in TIME_WAIT for a minute, and the check that
    # it is free refused the next run (a rerun, or a --max-restarts restart) on it.
    from tests.harness import run_config

    config = polytrain.TrainConfig(strategy="ddp", workers=2, model="mlp", steps=2,
                                   batch_size=8, port=free_port(),
                                   model_options={"seq_len": 16, "d_model": 16, "layers": 1})
    for _ in range(2):
        metrics, _ = run_config(config)
        assert len(metrics["losses"]) == 2


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2"])
def test_a_port_in_use_is_refused_before_anything_starts(address):
    # The store listens on every address: a port taken at 127.0.0.2 (or a NIC's address)
    # passed the check on 127.0.0.1, and rank 0 failed to listen after every process started.
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} on this host is in use.*HINT: "
                                              r"pass another --port"):
            polytrain.launch(scripts.identity, workers=2, port=port)


@pytest.mark.timeout(60)
def test_a_function_of_python_c_is_refused_with_where_to_define_it():
    # The processes find it by importing the launching script, and `python -c` has none:
    # each ran polytrain's fork server's main (an IndexError), or found no such function.
    code = ("import polytrain\ndef main():\n    return polytrain.init().rank\n"
            "polytrain.launch(main, workers=2)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode != 0
    assert re.search(r"ConfigError: launch\(\) cannot send 'main': it is defined in an "
                     r"interactive session, `python -c` or stdin.*HINT: define the function "
                     r"in a module or script file", done.stderr), done.stderr


def test_a_function_that_cannot_be_sent_is_refused():
    with pytest.raises(ConfigError, match="function defined at module level"):
        polytrain.launch(lambda: None, workers=2)


@pytest.mark.timeout(90)
def test_the_same_script_runs_under_torchrun_standalone(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import json, os, sys, torch, torch.distributed as dist, polytrain\n"
        "ctx = polytrain.init()\n"
        "x = torch.tensor([1.0]); dist.all_reduce(x, group=ctx.groups.workers)\n"
        "out = {'rank': ctx.rank, 'role': ctx.role, 'machine': ctx.machine,\n"
        "       'servers': list(ctx.topology.servers), 'sum': float(x)}\n"
        "open(os.path.join(sys.argv[1], f'out-{ctx.rank}.json'), 'w').write(json.dumps(out))\n")
    run = torchrun(script, "worker,worker,server", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    import json
    outs = sorted((json.loads(p.read_text()) for p in tmp_path.glob("out-*.json")),
                  key=lambda o: o["rank"])
    assert [o["role"] for o in outs] == ["worker", "worker"]
    assert all(o["machine"] == "box" and o["servers"] == [2] and o["sum"] == 2.0 for o in outs)


@pytest.mark.timeout(90)
def test_a_collective_on_the_default_group_says_which_group_to_pass_under_torchrun(tmp_path):
    # Under torchrun only gloo's timeout was printed: polytrain's hint was the launcher's.
    script = tmp_path / "job.py"
    script.write_text("import torch, torch.distributed as dist, polytrain\n"
                      "polytrain.init(timeout_s=3)\n"
                      "dist.all_reduce(torch.ones(1))\n")
    run = torchrun(script, "worker,server")
    assert run.returncode != 0
    assert re.search(r"\[polytrain 0 worker@box\].*HINT: if that call was a collective on the "
                     r"default group: .*pass group=ctx\.groups\.workers", run.stderr), \
        run.stderr[-3000:]


@pytest.mark.timeout(90)
def test_a_server_under_torchrun_logs_the_answers_it_holds(tmp_path):
    # No launcher reads its report there: the server says it in its own log.
    script = tmp_path / "job.py"
    # Each process a machine of its own: a worker's pushes go to the server, not a local peer.
    script.write_text("import os, torch, polytrain\n"
                      "from polytrain import byteps as bps\n"
                      "os.environ['POLYTRAIN_NODE'] = 'm' + os.environ['LOCAL_RANK']\n"
                      "ctx = polytrain.init(timeout_s=4)\n"
                      "bps.push_pull(torch.ones(8), name='both')\n"
                      "if ctx.rank == 0:\n"
                      "    bps.push_pull(torch.ones(8), name='only_rank0')\n"
                      "bps.push_pull(torch.ones(8), name='both')\n")
    run = torchrun(script, "worker,worker,server")
    assert run.returncode != 0
    warnings = re.findall(r"server rank 2 holds answers the workers wait for, and cannot give "
                          r"them yet: (.*)\. HINT: every worker must push and pull the same "
                          r"tensors", run.stderr)
    held = [h for w in warnings for h in w.split("; ")]
    assert len(held) == 2, run.stderr[-3000:]  # each held answer said once
    assert any(re.fullmatch(r"PUSHPULL of 'both\[0\] of 8' \(key \d+\) round 1 for worker "
                            r"rank 1 \(machine m1\), held \d+ s: round 1 has 1 of its 2 "
                            r"pushes \(from rank 1\)", h) for h in held), held
    assert any(re.fullmatch(r"PUSHPULL of 'only_rank0\[0\] of 8' \(key \d+\) round 0 for "
                            r"worker rank 0 \(machine m0\), held \d+ s: round 0 has 1 of its "
                            r"2 pushes \(from rank 0\)", h) for h in held), held


@pytest.mark.timeout(90)
def test_herring_on_machines_of_other_worker_counts_is_refused(tmp_path):
    # Machines cut each shard into a piece per local worker: with 2 workers on one machine
    # and 1 on the other they declared other keys (a mismatch, or a hang).
    script = tmp_path / "job.py"
    script.write_text("import os, torch, polytrain\n"
                      "from polytrain.herring import DistributedDataParallel\n"
                      "os.environ['POLYTRAIN_NODE'] = 'a' if os.environ['LOCAL_RANK'] in "
                      "'013' else 'b'\n"
                      "ctx = polytrain.init(timeout_s=20)\n"
                      "DistributedDataParallel(torch.nn.Linear(4, 4))\n")
    run = torchrun(script, "worker,worker,worker,server")
    assert run.returncode != 0
    assert ("strategy 'herring' cuts every shard into one piece per worker of a machine and "
            "needs as many workers on each, but this run has 2 on a, 1 on b. HINT: start as "
            "many workers on every machine") in run.stderr, run.stderr[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body, said", [
    # Each child imports the launching script: an unguarded launch() started a run in every
    # child, and the run failed after a minute naming a heartbeat, runs deep.
    ("print(polytrain.launch(main, workers=2, timeout_s=20))\n",
     r"polytrain\.launch\(\) ran in a launched process, as it imported the "
     r"launching script.*HINT: put the call under "
     r"`if __name__ == \"__main__\":`"),
    # An unguarded run_config() of a one-process run trained again in every child of the
    # script's next (guarded) run, all writing the same folder.
    ("from polytrain.train import run_config\n"
     "run_config(polytrain.TrainConfig(steps=2, out=OUT, quiet=True, "
     "model_options={'d_model': 8, 'layers': 1, 'seq_len': 8}))\n"
     "if __name__ == '__main__':\n"
     "    print(polytrain.launch(main, workers=2, timeout_s=20))\n",
     r"polytrain\.train\.run_config\(\) ran in a launched process, as it "
     r"imported the launching script: the script calls run_config\(\) when "
     r"imported.*HINT: put the call under `if __name__ == \"__main__\":`"),
], ids=["launch", "run_config"])
def test_a_script_that_starts_a_run_when_imported_is_told_to_guard_the_call(tmp_path, body,
                                                                             said):
    script = tmp_path / "job.py"
    script.write_text("import polytrain\n"
                      f"OUT = {str(tmp_path / 'a')!r}\n"
                      "def main():\n"
                      "    return polytrain.init().rank\n" + body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=50)
    assert run.returncode == 1
    assert re.search(r"LaunchError: worker rank \d \(machine node0\) failed: ConfigError: "
                     + said, run.stderr), run.stderr[-2000:]


@pytest.mark.timeout(60)
def test_launched_functions_see_the_launching_scripts_argv(tmp_path):
    # A main() that parsed its script's arguments (argparse, sys.argv[1]) got the child's own
    # argv, [child.py, payload.pkl], and failed on the payload file's path.
    script = tmp_path / "job.py"
    script.write_text("import sys, polytrain\n"
                      "def main():\n"
                      "    polytrain.init()\n"
                      "    return sys.argv[1:]\n"
                      "if __name__ == '__main__':\n"
                      "    print('result', polytrain.launch(main, workers=2, timeout_s=20))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(script), "--lr", "0.1"], env=env,
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "result [['--lr', '0.1'], ['--lr', '0.1']]" in run.stdout, run.stdout


def _run_as_module(tmp_path, module: str, files: dict[str, str]) -> str:
    """``python -m module`` in ``tmp_path``, after writing package ``files`` (relative path:
    text) there; its stdout, once it ended well."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", module], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.timeout(60)
def test_a_script_run_as_a_module_with_relative_imports_launches(tmp_path):
    # `python -m pkg.train` of a module with `from .helper import f` failed in every process
    # ("ImportError: attempted relative import with no known parent package"): each child
    # ran the launching script's file by its path, as a module of no package, where
    # multiprocessing's spawn imports it by its module name (__main__.__spec__).
    out = _run_as_module(tmp_path, "pkg.train", {
        "pkg/__init__.py": "",
        "pkg/helper.py": "def f(rank):\n    return rank + 10\n",
        "pkg/train.py": "import polytrain\n"
                        "from .helper import f\n"
                        "def main():\n"
                        "    return f(polytrain.init().rank)\n"
                        "if __name__ == '__main__':\n"
                        "    print('result', polytrain.launch(main, workers=2, timeout_s=20))\n"})
    assert "result [10, 11]" in out, out


@pytest.mark.timeout(60)
def test_a_package_run_as_python_m_launches_from_its_unguarded_main(tmp_path):
    # `python -m app` of a package whose __main__.py calls launch() unguarded (the usual
    # idiom there) failed in every process: each imported app.__main__ by name, which
    # called launch() again ("ran in a launched process"). multiprocessing's spawn skips a
    # package's __main__ (the function comes from its own module), and so does launch().
    out = _run_as_module(tmp_path, "app", {
        "app/__init__.py": "",
        "app/job.py": "import polytrain\n"
                      "def main():\n"
                      "    return polytrain.init().rank + 20\n",
        "app/__main__.py": "import polytrain\n"
                           "from .job import main\n"
                           "print('result', polytrain.launch(main, workers=2, timeout_s=20))\n"})
    assert "result [20, 21]" in out, out


def _run_calling_launch(tmp_path, launch_args: str, cli_args: list[str] | None,
                        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    # One os.write per line: the processes share the pipe, and print's separate writes of
    # 'result', ' ' and the value interleaved across processes.
    script.write_text("import os, polytrain, torch\n"
                      "def main():\n"
                      "    ctx = polytrain.init()\n"
                      "    return ctx.rank, ctx.num_workers\n"
                      "if __name__ == '__main__':\n"
                      f"    result = polytrain.launch(main, {launch_args})\n"
                      "    os.write(1, f'result {result}\\n'.encode())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
               **(extra_env or {}))
    cli = Path(sys.executable).with_name("polytrain")
    command = ([str(cli), "launch", *cli_args, "--timeout", "20", str(script)]
               if cli_args is not None else [sys.executable, str(script)])
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(120)
def test_a_script_that_calls_launch_runs_under_polytrain_launch_as_it_is(tmp_path):
    # The README's script under `polytrain launch` started a nested run in every process.
    run = _run_calling_launch(tmp_path, "workers=4, nodes=2", ["--workers", "4", "--nodes", "2"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(re.findall(r"result \[\((\d), (\d)\)\]", run.stdout)) == [
        (str(r), "4") for r in range(4)], run.stdout
    # Another layout than the launcher's is refused, not run silently.
    run = _run_calling_launch(tmp_path, "workers=4, nodes=2", ["--workers", "2"])
    assert run.returncode == 2  # a refusal (ConfigError), from the processes as from the CLI
    assert "launch() asks for a run of 4 processes, but polytrain launch started this " \
           "process as one of 2" in run.stderr, run.stderr[-2000:]
    # A shell that merely has RANK and WORLD_SIZE set (a cluster's pod, say) still launches.
    run = _run_calling_launch(tmp_path, "workers=2", None, {"RANK": "0", "WORLD_SIZE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "result [(0, 2), (1, 2)]" in run.stdout, run.stdout


def launch_command(*args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``polytrain launch ARGS`` in a new process."""
    cli = Path(sys.executable).with_name("polytrain")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    return [str(cli), "launch", *args], env


def polytrain_launch(*args: str) -> subprocess.CompletedProcess[str]:
    """``polytrain launch ARGS`` in a new process, its output captured."""
    command, env = launch_command(*args)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=80)


@pytest.mark.timeout(90)
def test_polytrain_launch_runs_a_script_and_reports_its_failure(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, time, polytrain\n"
        "ctx = polytrain.init()\n"
        "if ctx.rank == 0:\n"
        "    for i in range(100):\n"
        "        print(f'line-{i}')\n"
        "    time.sleep(60)\n"
        "if ctx.rank == 1:\n"
        "    time.sleep(2)\n"
        "    raise ValueError('bad shard on rank 1')\n")
    command, env = launch_command("--workers", "2", "--servers", "1", str(script))
    env.pop("PYTHONUNBUFFERED", None)  # a pipe: the children's output is block-buffered
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=80)
    assert run.returncode == 1
    assert re.search(r"polytrain launch: error: worker rank 1 \(machine node0\) failed: "
                     r"ValueError: bad shard on rank 1", run.stderr), run.stderr[-2000:]
    # Rank 0, stopped with SIGTERM (which ends it with os._exit), keeps what it printed
    # into the pipe (it was in its buffer, dropped at the exit).
    assert "line-99" in run.stdout, run.stdout[-500:]


@pytest.mark.timeout(90)
def test_polytrain_launch_exits_with_the_code_a_failed_worker_exited_with(tmp_path):
    # It exited 1 whatever the worker's code, so a CI job could not tell sys.exit(3) apart.
    script = tmp_path / "job.py"
    script.write_text("import sys, polytrain\n"
                      "ctx = polytrain.init()\n"
                      "if ctx.rank == 1:\n"
                      "    sys.exit(3)\n")
    run = polytrain_launch("--workers", "2", "--timeout", "20", str(script))
    assert run.returncode == 3, run.stderr[-2000:]
    assert "worker rank 1 (machine node0) failed: exited with code 3" in run.stderr


@pytest.mark.timeout(60)
def test_output_into_a_pipe_whose_reader_ended_is_named_not_taken_for_a_lost_peer(tmp_path):
    # `polytrain launch script.py | head -1`: every worker's print raised BrokenPipeError,
    # which was taken for a lost peer ("it lost a peer"), and the run failed naming a
    # traceback that was never printed.
    script = tmp_path / "chatty.py"
    script.write_text("import polytrain, time\n"
                      "ctx = polytrain.init()\n"
                      "for i in range(2000):\n"
                      "    print(f'line {i} from rank {ctx.rank}', flush=True)\n"
                      "    time.sleep(0.005)\n")
    command, env = launch_command("--workers", "2", "--timeout", "20", str(script))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    assert re.match(r"\[rank [01] worker@node0\] line 0 ", proc.stdout.readline())
    proc.stdout.close()  # as head does once it has its line
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == 1, err
    assert "lost a peer" not in err, err
    assert re.search(r"polytrain launch: error: worker rank [01] \(machine node0\) failed: "
                     r"BrokenPipeError: \[Errno 32\] Broken pipe.*HINT: it wrote to a pipe "
                     r"whose reader had ended", err), err
    assert re.search(r"\[polytrain rank [01] worker@node0\] failed:\nTraceback", err), err


def test_a_bad_polytrain_timeout_is_refused_before_any_process_starts():
    # Every process raised it from polytrain.init(), each with its traceback.
    with pytest.raises(ConfigError, match=r"POLYTRAIN_TIMEOUT='abc' is not a number of seconds"):
        polytrain.launch(scripts.identity, workers=2, env={"POLYTRAIN_TIMEOUT": "abc"})
    # Not a string: an AttributeError, or a fork server's thread traceback then one.
    for env in ({"POLYTRAIN_TIMEOUT": 30}, {"OMP_NUM_THREADS": 1}):
        (key, value), = env.items()
        with pytest.raises(ConfigError, match=rf"env\['{key}'\] = {value}: environment "
                                              rf"variables are strings\. HINT: pass "
                                              rf"env={{'{key}': '{value}'}}"):
            polytrain.launch(scripts.identity, workers=2, env=env)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=2.0), r"--workers must be a whole number \(got 2\.0\)"),
    (dict(servers=1.5), r"--servers must be a whole number \(got 1\.5\)"),
    (dict(workers="2"), r"--workers must be a whole number \(got '2'\)"),
    (dict(workers=True), r"--workers must be a whole number \(got True\)"),
    (dict(port="29500"), r"--port must be a whole number \(got '29500'\)\. HINT: pass "
                         r"--port 29500"),
])
def test_a_layout_count_or_port_of_the_wrong_type_is_refused_in_one_line(kwargs, message):
    # Layout's counts were checked for their size alone, and check_port not at all: 2.0 and
    # 1.5 met range()'s TypeError, "2" and "29500" a TypeError of '<', and True ran 1 worker.
    with pytest.raises(ConfigError, match=message):
        polytrain.launch(scripts.identity, **{"workers": 2, **kwargs}, timeout_s=30)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("machine, options, message", [
    # torchrun may start 3 workers on one machine and 1 on another: pipetransformer then
    # trained with a pipeline across the two machines (ranks 2 and 3), its contract broken.
    ("'a' if os.environ['LOCAL_RANK'] < '3' else 'b'", "",
     "ConfigError: strategy 'pipetransformer' lays out its stages by machine and needs as many "
     "workers on each, but this run has 3 on a, 1 on b. HINT: start as many workers on every "
     "machine (torchrun: the same --nproc-per-node on every node)"),
    # The layout's own check ran only before polytrain train started its processes.
    ("'box'", ", pipeline_stages=3",
     "ConfigError: --pipeline-stages 3 does not divide a machine's 4 devices"),
])
def test_a_pipeline_layout_torchrun_cannot_hold_is_refused(tmp_path, machine, options, message):
    script = tmp_path / "job.py"
    script.write_text("import os, torch, polytrain\n"
                      "from polytrain.models import GPT, cross_entropy\n"
                      f"os.environ['POLYTRAIN_NODE'] = {machine}\n"
                      "polytrain.init(timeout_s=20)\n"
                      "m = GPT(seq_len=8, d_model=16, layers=2)\n"
                      "polytrain.distribute(m, torch.optim.SGD(m.parameters(), lr=0.1), "
                      "strategy='pipetransformer', loss_fn=cross_entropy, "
                      f"freeze=False{options})\n")
    run = torchrun(script, "worker", processes=4)
    assert run.returncode != 0
    assert message in run.stderr, run.stderr[-3000:]


def test_a_rank_prefix_starts_every_line_a_process_prints():
    class Sink:
        def __init__(self):
            self.text = ""

        def write(self, text):
            self.text += text

        def isatty(self):
            return True

        def flush(self):
            self.text += "|"  # where the stream was flushed

    sink = Sink()
    out = child.RankPrefixed(sink, "[rank 3 worker@node1] ")
    print("loss", 2.5, file=out)  # print writes its parts, then the newline, apart
    assert sink.text == "[rank 3 worker@node1] loss 2.5\n"  # in one write: a whole line
    out.write("two\nlines\n")
    out.write("50%\r")  # a bar redrawn in place keeps its prefix
    out.write("100%\n")
    out.write("[polytrain rank 3 worker@node1] WARNING polytrain: named already\n")
    out.writelines(["a", "b\n"])
    print("epoch 1 ...", end="", file=out, flush=True)  # a line's start, shown at once
    print(" done", file=out)
    assert sink.text == ("[rank 3 worker@node1] loss 2.5\n[rank 3 worker@node1] two\n"
                         "[rank 3 worker@node1] lines\n[rank 3 worker@node1] 50%\r"
                         "[rank 3 worker@node1] 100%\n"
                         "[polytrain rank 3 worker@node1] WARNING polytrain: named already\n"
                         "[rank 3 worker@node1] ab\n[rank 3 worker@node1] epoch 1 ...|"
                         " done\n")
    assert out.isatty()  # the rest is the stream's: a progress bar still sees a terminal


@pytest.mark.timeout(10)
def test_a_rank_prefix_lets_a_signal_handler_inside_a_write_print_and_flush():
    # The child's SIGTERM handler flushes sys.stdout, and a handler may run inside write():
    # with a plain lock held there, it waited for itself forever.
    class Reentering:
        def __init__(self):
            self.text, self.inside = "", False

        def write(self, text):
            if not self.inside:  # a signal arrives while the line is being written
                self.inside = True
                print("from the handler", file=out)
                out.flush()
            self.text += text

        def flush(self):
            pass

    sink = Reentering()
    out = child.RankPrefixed(sink, "[rank 0 worker@node0] ")
    out.write("a line\n")
    assert sink.text == "from the handler\n[rank 0 worker@node0] a line\n"


@pytest.mark.timeout(90)
def test_polytrain_launch_prefixes_each_processs_lines_unless_told_not_to(tmp_path, capfd):
    # Eight workers' prints interleaved with nothing to tell them apart (and, where Python
    # writes through, the parts of one print with another process's).
    script = tmp_path / "job.py"
    script.write_text("import sys, polytrain\n"
                      "ctx = polytrain.init()\n"
                      "print('out', ctx.rank)\n"
                      "print('err', ctx.rank, file=sys.stderr)\n")
    env = {"OMP_NUM_THREADS": "1"}
    for prefix in (True, False):
        capfd.readouterr()
        launcher.launch_script(str(script), layout=Layout(workers=2, nodes=2), env=env,
                               rank_prefix=prefix)
        out, err = capfd.readouterr()
        if not prefix:  # as printed (and where Python writes through, parts interleave)
            assert sorted(out) == sorted("out 0\nout 1\n") and "[rank" not in err, out
            continue
        assert sorted(out.splitlines()) == ["[rank 0 worker@node0] out 0",
                                            "[rank 1 worker@node1] out 1"], out
        assert {"[rank 0 worker@node0] err 0", "[rank 1 worker@node1] err 1"} <= set(
            err.splitlines()), err
    # One process: nothing to tell apart.
    capfd.readouterr()
    launcher.launch_script(str(script), layout=Layout(workers=1), env=env)
    assert capfd.readouterr().out == "out 0\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forkserver", ["1", "0"])
def test_polytrain_launch_gives_a_script_the_sys_path_python_gives_it(tmp_path, forkserver):
    # `python sub/job.py` cannot import a module of the working directory, but under
    # `polytrain launch sub/job.py` it could: the child put the script's folder before what
    # its own interpreter's start had put first ('' of the fork server's `-c`, the working
    # directory of `-m`), so the working directory stayed importable ahead of site-packages.
    (tmp_path / "sub").mkdir()
    (tmp_path / "mymod.py").write_text("X = 1\n")
    script = tmp_path / "sub" / "job.py"
    script.write_text("import importlib.util, json, sys\n"
                      "print('found', importlib.util.find_spec('mymod') is not None)\n"
                      "print('path', json.dumps(sys.path))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               OMP_NUM_THREADS="1", POLYTRAIN_FORKSERVER=forkserver)
    cli = Path(sys.executable).with_name("polytrain")
    python, launched = (subprocess.run(command, cwd=tmp_path, env=env, capture_output=True,
                                       text=True, timeout=80)
                        for command in ([sys.executable, "sub/job.py"],
                                        [str(cli), "launch", "--timeout", "20", "sub/job.py"]))
    assert python.returncode == 0 and launched.returncode == 0, launched.stderr[-2000:]
    assert "found False" in python.stdout, python.stdout
    assert launched.stdout == python.stdout


@pytest.mark.timeout(90)
def test_what_a_script_prints_after_it_ends_keeps_its_rank_prefix(tmp_path, capfd):
    # The child put the original streams back when the script returned, before it joined
    # the script's threads and ran its exit handlers: their lines came without
    # "[rank R role@machine]", which every line a script prints starts with.
    script = tmp_path / "job.py"
    script.write_text("import atexit, sys, threading, time, polytrain\n"
                      "ctx = polytrain.init()\n"
                      "atexit.register(print, 'at exit', ctx.rank)\n"
                      "def late():\n"
                      "    time.sleep(0.5)\n"
                      "    print('thread', ctx.rank)\n"
                      "    print('thread err', ctx.rank, file=sys.stderr)\n"
                      "threading.Thread(target=late).start()\n")
    capfd.readouterr()
    launcher.launch_script(str(script), layout=Layout(workers=2, nodes=2),
                           env={"OMP_NUM_THREADS": "1"}, timeout_s=20)
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == [
        "[rank 0 worker@node0] at exit 0", "[rank 0 worker@node0] thread 0",
        "[rank 1 worker@node1] at exit 1", "[rank 1 worker@node1] thread 1"], out
    assert {"[rank 0 worker@node0] thread err 0", "[rank 1 worker@node1] thread err 1"} <= set(
        err.splitlines()), err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("change, said", [
    ({"fn": 42}, r"^launch\(\) fn must be a Callable \(got 42, an int\)"),
    ({"env": ["A"]}, r"^launch\(\) env must be a mapping, or None \(got \['A'\], a list\)"),
    ({"kwargs": [1]}, r"^launch\(\) kwargs must be a mapping, or None \(got \[1\], a list\)"),
    ({"args": "abc"}, r"^launch\(\) args must be a sequence of fn's arguments, not a str \(got "
                      r"'abc'\)\. HINT: pass args=\('abc',\)"),
    ({"args": 3}, r"^launch\(\) args must be a Sequence \(got 3, an int\)"),
    ({"rank_prefix": "no"}, r"^launch\(\) rank_prefix must be True or False \(got 'no', a "
                            r"str\)\. HINT: pass rank_prefix=True or rank_prefix=False$"),
])
def test_launchs_arguments_of_another_kind_are_refused_before_any_process_starts(change, said,
                                                                                 monkeypatch):
    # env=["A"] was an AttributeError, launch(42) started processes that died, rank_prefix="no"
    # was taken for True, args="abc" was splatted into fn('a', 'b', 'c'), and kwargs=[1] met a
    # misleading pickling message. Cause: launch() checked none of them.
    started = []
    monkeypatch.setattr(launcher.Launcher, "run_fn", lambda self, *a: started.append(a))
    with pytest.raises(ConfigError, match=said) as e:
        polytrain.launch(**{"fn": print, **change})
    assert "\n" not in str(e.value) and started == []


@pytest.mark.timeout(30)
def test_launch_unpacks_args_of_any_iterable_as_it_did(monkeypatch):
    # The argument check refused a numpy array or a generator as args (not a Sequence),
    # which launch() had unpacked as fn(*args).
    import numpy as np

    started = []
    monkeypatch.setattr(launcher.Launcher, "run_fn",
                        lambda self, fn, args, kw: started.append(args))
    polytrain.launch(print, args=np.arange(2))
    polytrain.launch(print, args=(i for i in "ab"))
    assert [list(a) for a in started] == [[0, 1], ["a", "b"]]
