"""The fork server: a launched process is what a fresh interpreter would be, without importing
torch itself."""

from __future__ import annotations

import os
import resource

import pytest

import polytrain
from polytrain.launch import forkserver
from tests.launch import scripts


def _start(tmp_path, monkeypatch, value: str, **env: str) -> list[dict]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POLYTRAIN_TEST_VAR", value)
    return polytrain.launch(scripts.what_a_process_starts_with, workers=3,
                            env={"OMP_NUM_THREADS": "1", **env}, timeout_s=30)


@pytest.mark.timeout(120)
def test_forked_processes_get_the_launchers_environment_streams_and_fresh_seeds(
        tmp_path, monkeypatch, capfd):
    got = _start(tmp_path, monkeypatch, "a")
    server = forkserver.server_for({**os.environ, "OMP_NUM_THREADS": "1"})  # the launch's
    assert server is not None
    assert {g["parent"] for g in got} == {server.pid}  # forked by the server, not the launcher
    assert [g["rank"] for g in got] == ["0", "1", "2"]
    assert {g["cwd"] for g in got} == {str(tmp_path)}
    assert {g["var"] for g in got} == {"a"}
    assert {g["threads"] for g in got} == {1}
    assert len({g["seed"] for g in got}) == 3 and len({g["draw"] for g in got}) == 3
    out = capfd.readouterr().out  # the launcher's standard output of this moment
    assert all(f"said by {r}" in out for r in "012"), out
    # A variable changed since: a server started with it (read at import, it must be there).
    again = _start(tmp_path, monkeypatch, "b")
    assert {g["var"] for g in again} == {"b"}
    assert {g["parent"] for g in again} != {server.pid} and not server.alive


@pytest.mark.timeout(120)
def test_the_variable_pytest_changes_for_each_test_starts_no_server_of_its_own(tmp_path,
                                                                              monkeypatch):
    # A server started for each of its values (torch imported again each test) had been most
    # of the test suite's time.
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "one")
    first = _start(tmp_path, monkeypatch, "e")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another")
    again = _start(tmp_path, monkeypatch, "e")
    assert len({g["parent"] for g in first + again}) == 1
    assert {g["parent"] for g in first} != {os.getpid()}  # forked, not fresh interpreters
    # Each child has the variable as the launcher had it at its launch.
    assert {g["test"] for g in first} == {"one"} and {g["test"] for g in again} == {"another"}


@pytest.mark.timeout(120)
def test_forked_processes_get_the_launchers_umask_and_limits_of_the_moment(tmp_path,
                                                                           monkeypatch):
    core = resource.getrlimit(resource.RLIMIT_CORE)
    if core[1] != resource.RLIM_INFINITY and core[1] < 4096:
        pytest.skip(f"this host's hard core-size limit ({core[1]}) is below the test's 4096")
    first = _start(tmp_path, monkeypatch, "d")  # the fork server starts with these
    mask = os.umask(0o027)
    resource.setrlimit(resource.RLIMIT_CORE, (4096, core[1]))
    try:
        got = _start(tmp_path, monkeypatch, "d")
    finally:
        os.umask(mask)
        resource.setrlimit(resource.RLIMIT_CORE, core)
    assert {g["parent"] for g in got} == {g["parent"] for g in first}  # the same server
    assert {g["umask"] for g in first} == {mask} and {g["umask"] for g in got} == {0o027}
    assert {g["core"] for g in got} == {4096}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["environment", "launch"])
def test_without_the_fork_server_every_process_is_a_fresh_interpreter(tmp_path, monkeypatch,
                                                                       where, capfd):
    if where == "environment":
        monkeypatch.setenv("POLYTRAIN_FORKSERVER", "0")
    got = _start(tmp_path, monkeypatch, "c",
                 **({"POLYTRAIN_FORKSERVER": "0"} if where == "launch" else {}))
    assert {g["parent"] for g in got} == {os.getpid()}
    assert {g["var"] for g in got} == {"c"} and {g["threads"] for g in got} == {1}
    # Each printed runpy's RuntimeWarning ('polytrain.launch.child' found in sys.modules
    # after import of package 'polytrain.launch') and ran a second copy of the module: the
    # launcher, which the package imports, imported it for a constant.
    err = capfd.readouterr().err
    assert "RuntimeWarning" not in err and "found in sys.modules" not in err, err


class _FailsToStart:
    """A server that fails each start but is not yet seen to have ended (its end not read)."""

    alive = True

    def __init__(self) -> None:
        self.starts = 0

    def start(self, *args: object) -> None:
        self.starts += 1
        raise BrokenPipeError(32, "Broken pipe")

    def adopted(self) -> set[int]:
        return set()


@pytest.mark.timeout(120)
def test_a_start_the_server_failed_leaves_it_out_for_the_runs_other_processes(
        tmp_path, monkeypatch, caplog):
    # A loaded machine: the server had died, and the launcher had not yet read its end, so
    # each of the run's processes tried it and warned (3 warnings, not 1).
    from polytrain.launch import launcher
    server = _FailsToStart()
    monkeypatch.setattr(launcher, "server_for", lambda env: server)
    got = _start(tmp_path, monkeypatch, "a server that is gone")
    assert {g["parent"] for g in got} == {os.getpid()}  # fresh interpreters
    assert server.starts == 1
    assert len([r for r in caplog.records if "fork server" in r.getMessage()]) == 1


@pytest.mark.timeout(120)
def test_a_fork_server_that_never_served_is_not_started_again(tmp_path, monkeypatch, caplog):
    # It was started (and failed: a torch import of seconds) at every launch, and warned for
    # every process of each.
    monkeypatch.setattr(forkserver, "_SERVER_CODE", "import sys; sys.exit(3)")
    monkeypatch.setattr(forkserver, "_unusable", {})
    started = []

    class Counted(forkserver.ForkServer):
        def __init__(self, base_env):
            started.append(1)
            super().__init__(base_env)

    monkeypatch.setattr(forkserver, "ForkServer", Counted)
    for _ in range(2):
        got = _start(tmp_path, monkeypatch, "a server that fails")
        assert {g["parent"] for g in got} == {os.getpid()}  # fresh interpreters
    assert len(started) == 1
    warnings = [r.getMessage() for r in caplog.records if "fork server" in r.getMessage()]
    assert len(warnings) == 2, warnings  # the run's first process; the server's failure
    assert "ended (code 3) before it started any process" in warnings[1]
