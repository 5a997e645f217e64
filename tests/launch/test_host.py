"""The kernel's memory figures as launch/host.py reads them, from faked /proc and cgroup files."""

from pathlib import Path

import pytest

from polytrain.launch import host

MEMINFO = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n"
VMSTAT = "pgfault 12\noom_kill 5\n"
V1 = "/sys/fs/cgroup/memory/job"
V2 = "/sys/fs/cgroup/job"


def fake(monkeypatch, files: dict[str, str]) -> None:
    monkeypatch.setattr(host, "_read", lambda path: files.get(str(path)))


@pytest.mark.parametrize("cgroup, files, available, kills", [
    # No cgroup files: the host's figures.
    ("0::/job\n", {}, 20000000 * 1024, 5),
    # cgroup v1 without a limit (a number near 2**63), its own kill count.
    ("4:memory:/job\n0::/\n", {f"{V1}/memory.limit_in_bytes": "9223372036854771712\n",
                               f"{V1}/memory.usage_in_bytes": "1000\n",
                               f"{V1}/memory.oom_control": "oom_kill_disable 0\noom_kill 2\n"},
     20000000 * 1024, 2),
    # cgroup v2 with an 8 GiB limit of which 3 GiB are used: 5 GiB, under MemAvailable.
    ("0::/job\n", {f"{V2}/memory.max": f"{8 << 30}\n", f"{V2}/memory.current": f"{3 << 30}\n",
                   f"{V2}/memory.events": "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n"},
     5 << 30, 1),
    # cgroup v2 without a limit ("max").
    ("0::/job\n", {f"{V2}/memory.max": "max\n", f"{V2}/memory.current": "5\n"},
     20000000 * 1024, 5),
])
def test_free_memory_and_oom_kills_come_from_the_cgroup_first(monkeypatch, cgroup, files,
                                                             available, kills):
    fake(monkeypatch, {"/proc/self/cgroup": cgroup, "/proc/meminfo": MEMINFO,
                       "/proc/vmstat": VMSTAT, **files})
    assert host.available_memory_bytes() == available
    assert host.oom_kills() == kills


def test_nothing_readable_means_unknown(monkeypatch):
    fake(monkeypatch, {})
    assert host.available_memory_bytes() is None and host.oom_kills() is None


def test_this_machine_reads_real_figures():
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc on this host")
    assert host.available_memory_bytes() > 0
    assert host.oom_kills() is not None and host.oom_kills() >= 0


def test_reading_the_nic_of_a_machine_whose_process_ended_is_a_lost_peer():
    # Worker 0 failed with FileNotFoundError ('/proc/PID/net/dev') from inside the meter when
    # a peer it read the NIC through had died: the launcher then took it for a cause.
    import subprocess
    import sys

    from polytrain.errors import PeerLost
    from polytrain.launch.network import NicSampler

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    with pytest.raises(PeerLost, match=r"process \d+ of machine node1, whose NIC counters this "
                                       r"process reads, has ended"):
        NicSampler({"node1": (int(done.stdout), "eth0")})()
