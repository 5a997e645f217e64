"""The emulated cluster network: namespaces, shaped links, NIC counters, and their cleanup.

The tests that make namespaces need root and iproute2 (``ip``, ``tc``) and skip
without them; every one checks that no namespace, link or claim of a run is
left behind.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import polytrain
from polytrain import ConfigError, LaunchError, TrainConfig
from polytrain.cli import main
from polytrain.launch import network
from polytrain.launch.network import LinkShape, Network, link_shape, parse_rate, parse_time
from tests.harness import (
    COMM_TIMEOUT_S,
    as_from_a_terminal,
    max_abs_diff,
    run_config,
    single_of,
)
from tests.launch import scripts

ROOT = Path(__file__).resolve().parents[2]
IP = shutil.which("ip")  # resolved once: some tests take ip and tc off PATH
_MISSING = network.missing_tools()  # root, its capabilities (a container drops them), ip, tc
needs_netns = pytest.mark.skipif(bool(_MISSING), reason=f"needs root and iproute2; missing: "
                                                        f"{', '.join(_MISSING)}")
_ENV = {"OMP_NUM_THREADS": "1"}


def _leftovers() -> set[str]:
    """What runs leave on this host: their namespaces, claims and root-namespace links."""
    if IP is None:
        return set()
    names = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout
    found = {"netns " + line.split()[0] for line in names.splitlines()
             if re.match(r"pt-[0-9a-f]{6}-", line)}
    links = subprocess.run([IP, "-o", "link"], capture_output=True, text=True).stdout
    found |= {"link " + m for m in re.findall(r"^\d+: (pt-[^:@]+)", links, re.M)}
    if network.STATE_DIR.is_dir():
        found |= {"claim " + p.name for p in network.STATE_DIR.iterdir()}
    return found


@pytest.fixture
def clean_host():
    """Fails the test if it leaves any namespace, link or claim that was not there before."""
    before = _leftovers()
    yield
    assert _leftovers() - before == set()


def refused_launch(tmp_path: Path, captured: Any, pattern: str, *flags: str) -> None:
    """``polytrain launch FLAGS job.py`` of a job that must not start: exit status 2 and one
    line on stderr that ``pattern`` finds (``captured``: pytest's capsys or capfd)."""
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('must not start')\n")
    assert main(["launch", *flags, str(script)]) == 2
    err = captured.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(pattern, err), err


# -- input -------------------------------------------------------------------------------------

def test_rates_and_times_from_python_without_their_units_are_refused():
    # An AttributeError ('float' object has no attribute 'lower').
    with pytest.raises(ConfigError, match=r"--bandwidth 1000000000\.0 has no unit\. HINT: pass "
                                          r"it as a string with its unit, e\.g\. --bandwidth "
                                          r"1gbit"):
        link_shape(1e9)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"--latency 0\.001 has no unit"):
        link_shape("1gbit", 0.001)  # type: ignore[arg-type]


def test_rates_and_times_parse_as_tc_writes_them():
    assert parse_rate("200mbit") == 200_000_000
    assert parse_rate("1Gbit") == parse_rate("1GBIT") == parse_rate("1gbit") == 10**9
    assert parse_rate("5gbit") == 5 * 10**9 and parse_rate("1.5kbit") == 1500
    assert parse_rate("64 kbit") == 64_000 and parse_rate("100bit") == 100
    assert parse_rate("34tbit") == 34 * 10**12 == parse_rate("34000gbit")
    assert parse_time("0.2ms") == pytest.approx(2e-4) and parse_time("5us") == pytest.approx(5e-6)
    assert parse_time("1s") == 1.0 and parse_time("0") == 0.0 and parse_time("0ms") == 0.0
    assert parse_time("2msec") == pytest.approx(2e-3) and parse_time("1sec") == 1.0
    assert LinkShape.parse("1gbit", "0.2ms") == LinkShape(rate_bit_s=10**9, delay_s=2e-4)
    assert link_shape(None) is None and link_shape(None, "0") is None


@pytest.mark.parametrize("bandwidth, latency, message", [
    ("fast", None, r"--bandwidth 'fast' is not a rate: a number and one of the units bit, kbit, "
                   r"mbit, gbit, tbit is\. HINT: pass e\.g\. --bandwidth 1gbit"),
    ("5gb", None, r"--bandwidth '5gb' is not a rate"),
    ("1000", None, r"--bandwidth '1000' is not a rate"),
    ("0mbit", None, r"--bandwidth must be a rate of at least 100bit and at most 34tbit, tc's "
                    r"range for a link \(got '0mbit'\)\. HINT: pass e\.g\. --bandwidth 1gbit$"),
    ("0", None, r"--bandwidth must be a rate of at least 100bit"),
    ("-1gbit", None, r"--bandwidth must be a rate of at least 100bit and at most 34tbit, tc's "
                     r"range for a link \(got '-1gbit'\)"),
    # Each was an OverflowError, or a plan of nan seconds.
    ("1e400gbit", None, r"--bandwidth must be a rate of at least 100bit and at most 34tbit"),
    # Each built the network, then failed in tc: 100tbit with tc's whole usage text ('Illegal
    # "burst"': a millisecond's bucket overflows its 32 bits) and a hint to check the kernel;
    # 4bit with '"rate" is required' (under a byte a second); 50bit silently got a bucket of
    # 279 bytes, not 3028 (longer than 2**32 of the kernel's 64 ns ticks to fill).
    ("100tbit", None, r"--bandwidth must be a rate of at least 100bit and at most 34tbit, tc's "
                      r"range for a link \(got '100tbit'\)"),
    ("4bit", None, r"--bandwidth must be a rate of at least 100bit .*\(got '4bit'\)"),
    ("50bit", None, r"--bandwidth must be a rate of at least 100bit .*\(got '50bit'\)"),
    ("1gbit", "1e400s", r"--latency must be 0 or more, and at most 60s \(got '1e400s'\)"),
    ("1gbit", "-1ms", r"--latency must be 0 or more, and at most 60s \(got '-1ms'\)"),
    ("1gbit", "3 parsecs", r"--latency '3 parsecs' is not a time: a number and one of the units "
                           r"us, usec, ms, msec, s, sec is"),
    ("1gbit", "5", r"--latency '5' is not a time"),
    (None, "1ms", r"--latency 1ms needs --bandwidth"),
])
def test_bad_rates_and_times_are_one_line_each(bandwidth, latency, message, capsys, clean_host):
    argv = ["train", "--strategy", "ddp", "--model", "mlp", "--steps", "2"]
    argv += [f"--bandwidth={bandwidth}"] if bandwidth is not None else []
    argv += [f"--latency={latency}"] if latency is not None else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(r"^polytrain train: error: " + message, err), err
    with pytest.raises(ConfigError, match=message):
        polytrain.launch(scripts.identity, workers=2, bandwidth=bandwidth, latency=latency)


def test_the_fastest_link_fits_tc_and_the_kernels_queue_bound(monkeypatch):
    # Above about 17 Tbit/s tcp_limit_output_bytes (an int) was refused, with a warning.
    monkeypatch.setattr(network, "check_tools", lambda: ("ip", "tc"))
    net = Network(["node0"], LinkShape.parse("34tbit"))
    assert net._burst_bytes() == 4_250_000_000 < 2**32  # tc's burst is 32 bits
    assert net._queue_bytes() == 2**31 - 1
    assert Network(["node0"], LinkShape.parse("1gbit"))._queue_bytes() == 125_000
    with pytest.raises(ConfigError, match=r"a link's rate must be 100 to 34000000000000 bit/s, "
                                          r"tc's range \(got 35000000000000\)"):
        LinkShape(rate_bit_s=35 * 10**12)


def test_a_delay_under_a_microsecond_reaches_netem_as_given(monkeypatch):
    # --latency 0.4us was accepted, described as 0.0004 ms, and given to netem as "delay 0us":
    # no delay at all (whole microseconds). tc's netem reads a fraction of one (and, in
    # iproute2 6.1, no "ns").
    monkeypatch.setattr(network, "check_tools", lambda: ("ip", "tc"))
    for latency, delay in [("0.4us", "0.400us"), ("1.5us", "1.500us"), ("0.2ms", "200.000us"),
                           ("60s", "60000000.000us")]:
        net = Network(["node0", "node1"], LinkShape.parse("1gbit", latency))
        assert net._qdiscs("pt-0abcde-n0", net.shape.delay_s)[-1] == (
            f"qdisc add dev pt-0abcde-n0 parent 1:1 handle 10: netem delay {delay} limit 100000")
    assert LinkShape.parse("1gbit", "0.4us").describe() == ("1000 Mbit/s each way, 0.0004 ms "
                                                            "one-way delay")


@pytest.mark.timeout(30)
def test_a_hung_tool_is_named_and_left_within_its_bound(monkeypatch):
    monkeypatch.setattr(network, "_TOOL_TIMEOUT_S", 0.5)
    monkeypatch.setattr(network, "_KILLED_TOOL_S", 0.5)
    assert network._tool(["cat"], input="qdisc").stdout == "qdisc"
    # A tool that a kill does not end (stuck in the kernel): subprocess.run waited it out.
    monkeypatch.setattr(subprocess.Popen, "kill", lambda self: None)
    began = time.monotonic()
    with pytest.raises(LaunchError, match=r"`sleep 5` did not end within 0\.5 s"):
        network._tool(["sleep", "5"])
    assert time.monotonic() - began < 3.0


def test_a_link_too_slow_for_the_first_wait_is_refused_before_any_process_starts(capsys):
    # --bandwidth 1kbit started the run, waited out --timeout in the model's first broadcast
    # and ended in gloo's "Timed out waiting 20000ms for recv operation" and a traceback.
    # (herring: ddp's first message is the whole model, tested in tests/cli/test_train.py)
    assert main(["train", "--strategy", "herring", "--workers", "2", "--nodes", "2",
                 "--bandwidth", "1kbit", "--timeout", "20", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(r"--bandwidth 1kbit carries the model's largest tensor \(h0\.mlp\.fc\.weight, "
                     r"262,144 bytes\), which every worker gets from worker 0 at the start, in "
                     r"2,097 s, longer than --timeout 20: the run would time out there\. HINT: "
                     r"pass --bandwidth 105kbit or more .*, or a --timeout above 2098$", err), err
    # One machine of workers (and a server's machine): the first copy crosses no link, but
    # each sum crosses to the server and back (tests/test_config_link.py); a fast enough link
    # passes both.
    with pytest.raises(ConfigError, match=r"^--bandwidth 1kbit carries herring's first sum"):
        TrainConfig(strategy="herring", workers=2, nodes=1, servers=1, bandwidth="1kbit",
                    timeout_s=20)
    TrainConfig(strategy="herring", workers=2, nodes=2, bandwidth="2mbit", timeout_s=20)


def test_a_launch_on_one_machine_has_no_links_to_shape(tmp_path, capsys, clean_host):
    # Symptom: `polytrain launch --workers 2 --bandwidth 1gbit` (and launch(bandwidth=) on
    # one machine) built namespaces and qdiscs, and nothing crossed a shaped link; `polytrain
    # train` refuses the same (config.check_link).
    message = (r"--bandwidth 1gbit shapes the links between machines, and this run has one "
               r"machine of workers and no server machines: no link would be shaped\. HINT: "
               r"pass --nodes 2 or more \(or --servers K\){}, or leave --bandwidth and "
               r"--latency out$")
    python = message.format(r" \(polytrain\.launch\(\.\.\., nodes=2\)\)")
    message = message.format("")
    for colocated in (0, 1):
        with pytest.raises(ConfigError, match="^" + python):
            polytrain.launch(scripts.identity, workers=2, colocated=colocated,
                             bandwidth="1gbit")
    with pytest.raises(ConfigError, match="^--bandwidth 1000mbit shapes"):  # as given
        polytrain.launch(scripts.identity, workers=2, bandwidth="1000mbit")
    refused_launch(tmp_path, capsys, message, "--workers", "2", "--bandwidth", "1gbit")


def test_a_single_process_strategy_has_no_links_to_shape():
    with pytest.raises(ConfigError, match=r"strategy 'single' trains in one process"):
        TrainConfig(strategy="single", model="mlp", bandwidth="1gbit")


_ALL_CAPS = (1 << 41) - 1  # root's effective capabilities (CapEff 000001ffffffffff)
_ROOT_HINT = r"HINT: run as root, or leave --bandwidth out"
_TOOLS_HINT = r"HINT: install iproute2 \(apt-get install iproute2\), or leave --bandwidth out"


@pytest.mark.parametrize("uid, path, caps, missing, hint", [
    (1000, True, 0, r"missing: root \(running as uid 1000\)\.", _ROOT_HINT),
    (0, False, _ALL_CAPS, r"missing: ip \(not on PATH\), tc \(not on PATH\)\.", _TOOLS_HINT),
    (1000, False, 0, r"missing: root \(running as uid 1000\), ip \(not on PATH\), tc \(not on "
                     r"PATH\)\.",
     r"HINT: run as root and install iproute2 \(apt-get install iproute2\), or leave "
     r"--bandwidth out"),
    # Root without the capabilities (a container's default, `setpriv --bounding-set`): the run
    # made half its network, then "mount --make-shared /run/netns failed: Operation not
    # permitted. HINT: check that this kernel has network namespaces"; `polytrain env` said
    # root, ip and tc were there.
    (0, True, _ALL_CAPS & ~(1 << 21 | 1 << 12),
     r"missing: CAP_SYS_ADMIN \(to mount the namespaces\), CAP_NET_ADMIN \(to make links and "
     r"qdiscs\)\.",
     r"HINT: give this process CAP_SYS_ADMIN and CAP_NET_ADMIN \(a container: docker run "
     r"--cap-add SYS_ADMIN --cap-add NET_ADMIN, or --privileged\), or leave --bandwidth out$"),
    (0, True, _ALL_CAPS & ~(1 << 12), r"missing: CAP_NET_ADMIN \(to make links and qdiscs\)\.",
     r"HINT: give this process CAP_NET_ADMIN \(a container: docker run --cap-add NET_ADMIN, "
     r"or --privileged\), or leave --bandwidth out$"),
], ids=["uid", "path", "uid+path", "caps", "net_admin"])
def test_without_root_or_iproute2_one_line_says_what_is_missing(monkeypatch, uid, path, caps,
                                                                missing, hint, capsys, tmp_path,
                                                                clean_host):
    monkeypatch.setattr(network.os, "geteuid", lambda: uid)
    monkeypatch.setattr(network, "_capabilities", lambda: caps)
    if not path:
        monkeypatch.setenv("PATH", str(tmp_path))  # no ip, no tc
    with pytest.raises(ConfigError, match=r"--bandwidth emulates machines in network namespaces, "
                                          r"which needs root \(with CAP_SYS_ADMIN and "
                                          r"CAP_NET_ADMIN\) and iproute2's ip and tc; " +
                                          missing + " " + hint):
        polytrain.launch(scripts.identity, workers=2, nodes=2, bandwidth="1gbit")
    refused_launch(tmp_path, capsys, missing, "--workers", "2", "--nodes", "2", "--bandwidth",
                   "1gbit")
    assert main(["env"]) == 0  # says the same
    out = capsys.readouterr().out
    said = missing.replace("missing: ", "missing ", 1).removesuffix(r"\.")
    assert re.search(r"^--bandwidth \(emulated network\) +no: " + said, out, re.M), out


def test_capabilities_come_from_linux_and_count_only_where_it_says(monkeypatch):
    status = Path("/proc/self/status").read_text()
    [mask] = [line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")]
    assert network._capabilities() == int(mask, 16)
    monkeypatch.setattr(network.os, "geteuid", lambda: 0)
    monkeypatch.setattr(network, "_capabilities", lambda: None)  # unknown: not claimed missing
    assert network.missing_tools() == [
        f"{name} (not on PATH)" for name in ("ip", "tc") if shutil.which(name) is None]


# -- links -------------------------------------------------------------------------------------

@needs_netns
@pytest.mark.timeout(60)
def test_a_machines_nic_is_shaped_and_its_own_processes_talk_over_loopback(clean_host):
    rate, nbytes = 100e6, 4 << 20
    results = polytrain.launch(scripts.transfer_over_the_nic, workers=4, nodes=2,
                               args=(nbytes,), bandwidth="100mbit", timeout_s=COMM_TIMEOUT_S,
                               env=_ENV)
    node0, same, other = results[0], results[1], results[2]
    assert (node0["machine"], same["machine"], other["machine"]) == ("node0", "node0", "node1")
    # Worker 0 to worker 1 stays inside node0: its NIC sees only the barriers' bytes.
    assert node0["local"]["sent"] < 64 << 10
    # Worker 0 to worker 2 crosses both NICs: every byte, a few headers more.
    assert nbytes <= node0["remote"]["sent"] < 1.02 * nbytes
    assert nbytes <= other["remote"]["recv"] < 1.02 * nbytes
    mbit_s = nbytes * 8 / node0["remote"]["seconds"] / 1e6
    # htb counts each segment's headers (about 4% of a 1448-byte segment): the payload
    # gets a little less than the rate; never more than its burst allows (100.002 of
    # 100 Mbit/s once, the burst's millisecond landing inside the timed window).
    assert 0.75 * rate / 1e6 < mbit_s < 1.01 * rate / 1e6, mbit_s


@needs_netns
@pytest.mark.timeout(60)
def test_a_link_idle_for_a_while_sends_at_its_rate_from_the_first_byte(clean_host):
    # A real NIC saves no credit while idle: a message takes its bytes' time at the rate.
    # The shaper may send a little at once (a millisecond, or three frames on slow links).
    # One sender's upload paces its message; two senders' messages reach the hub at twice
    # the receiver's rate, and its download must pace them (240 KB: 192 ms).
    rate, nbytes = parse_rate("10mbit"), 120_000
    for senders in (1, 2):
        results = polytrain.launch(scripts.sends_after_idle_s, workers=senders + 1,
                                   nodes=senders + 1, args=([nbytes], 0.3, 3),
                                   bandwidth="10mbit", timeout_s=COMM_TIMEOUT_S, env=_ENV)
        line_s = senders * nbytes * 8 / rate
        for times in (r[nbytes] for r in results[1:]):
            assert min(times) > 0.9 * line_s, (senders, times, line_s)


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_polytrain_launch_runs_each_machine_in_its_namespace(tmp_path, clean_host, forked,
                                                            monkeypatch):
    # Forked processes enter their namespace with setns; fresh ones through `ip netns exec`.
    monkeypatch.setenv("POLYTRAIN_FORKSERVER", "1" if forked else "0")
    script = tmp_path / "job.py"
    script.write_text(
        "import json, os, sys, polytrain\n"
        "names = ('POLYTRAIN_NIC', 'GLOO_SOCKET_IFNAME', 'MASTER_ADDR')\n"
        "seen = {n: os.environ[n] for n in names}\n"
        "seen['netns'] = os.readlink('/proc/self/ns/net')\n"
        "seen['parent'] = os.getppid()\n"
        "path = os.path.join(sys.argv[1], os.environ['RANK'] + '.json')\n"
        "open(path, 'w').write(json.dumps(seen))\n"
        "polytrain.init()  # a server serves in here until the workers finish\n")
    assert main(["launch", "--workers", "2", "--nodes", "2", "--colocated", "1", "--servers",
                 "1", "--bandwidth", "1gbit", str(script), str(tmp_path)]) == 0
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(5)]
    # Ranks: workers 0, 1 (node0, node1), colocated servers 2, 3, the dedicated server 4.
    machine = ["n0", "n1", "n0", "n1", "s0"]
    for s, m in zip(seen, machine):
        assert re.fullmatch(rf"pt-[0-9a-f]{{6}}-{m}", s["POLYTRAIN_NIC"]), s
        assert s["GLOO_SOCKET_IFNAME"] == s["POLYTRAIN_NIC"] and s["MASTER_ADDR"] == "10.111.0.1"
    assert seen[0]["netns"] == seen[2]["netns"] != seen[1]["netns"] == seen[3]["netns"]
    assert seen[4]["netns"] not in (seen[0]["netns"], seen[1]["netns"])
    assert os.readlink("/proc/self/ns/net") not in {s["netns"] for s in seen}
    # Forked: by the fork server, not this (the launching) process.
    assert all((s["parent"] != os.getpid()) == forked for s in seen), seen


@needs_netns
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy, servers", [("ddp", 0), ("byteps", 1)])
def test_the_meter_agrees_with_the_nics_and_the_run_stays_transparent(strategy, servers,
                                                                       clean_host):
    config = TrainConfig(strategy=strategy, model="mlp", workers=2, nodes=2, servers=servers,
                         steps=16, batch_size=8, optimizer="sgd", lr=0.05, bandwidth="1gbit",
                         model_options={"d_model": 256})
    _, single = run_config(single_of(config))
    metrics, distributed = run_config(config)
    assert max_abs_diff(single, distributed) < 1e-6
    _, untrained = run_config(single_of(config).replace(steps=1, lr=1e-12))
    assert max_abs_diff(single, untrained) > 1e-4  # the weights did move
    machines = metrics["traffic"]["machines"]
    assert [m["name"] for m in machines] == ["node0", "node1"] + ["server0"] * servers
    for m in machines:
        # The wire carries what the library sent, plus TCP/IP headers (one per 64 KiB
        # segment on a veth) and ACKs: 0.3-0.5% on this model; 2% leaves room for noise.
        for way in ("sent", "recv"):
            meter, nic = m[f"{way}_bytes_per_step"], m[f"nic_{way}_bytes_per_step"]
            # (Every worker settles before worker 0 reads the NICs at the window's bounds.
            # Before it did, a machine still receiving a step's answers at the first bound
            # but not at the last put up to 2.2% more on its NIC than on its meter, and one
            # answering late at the last bound 2.4% less.)
            assert meter > 1e6 and 0.97 * meter <= nic < 1.02 * meter, (m["name"], way, meter,
                                                                         nic)
    assert metrics["bandwidth"] == "1gbit"


@needs_netns
@pytest.mark.timeout(60)
def test_latency_delays_every_packet_or_is_refused_without_netem(clean_host):
    try:
        rtt = polytrain.launch(scripts.round_trip_s, workers=2, nodes=2, args=(20,),
                               bandwidth="1gbit", latency="5ms", timeout_s=COMM_TIMEOUT_S,
                               env=_ENV)[0]
    except ConfigError as e:
        assert re.fullmatch(r"--latency 5ms needs tc's netem qdisc, which this kernel lacks "
                            r"\(CONFIG_NET_SCH_NETEM\)\. HINT: load it \(modprobe sch_netem\) "
                            r"or leave --latency out", str(e)), e
        return
    assert 10e-3 <= rtt < 14e-3  # one delay each way


@needs_netns
@pytest.mark.timeout(30)
def test_polytrain_env_says_whether_latency_can_work_here(clean_host):
    # netem put once on a throwaway namespace's loopback; the launch above agrees with it.
    said = network.netem_check()
    try:
        polytrain.launch(scripts.identity, workers=2, nodes=2, bandwidth="1gbit",
                         latency="1ms", timeout_s=COMM_TIMEOUT_S, env=_ENV)
        assert said == "yes"
    except ConfigError as e:
        assert "netem" in str(e)
        assert said == ("no: this kernel lacks tc's netem qdisc (CONFIG_NET_SCH_NETEM), so "
                        "--latency is refused; modprobe sch_netem where it is a module")


@needs_netns
@pytest.mark.timeout(60)
def test_a_set_waited_for_comes_before_any_workers_later_request(clean_host):
    # Each worker's requests reach a server on their own receive, so a GET sent after a
    # barrier could overtake a SET whose bytes were still on the link: without the SET's
    # receipt, every GET here saw the value before (0.0, 0.0, 1.0, ... at 100 Mbit/s).
    seen = polytrain.launch(scripts.set_then_get, workers=2, nodes=2, servers=1, args=(8,),
                            bandwidth="100mbit", timeout_s=COMM_TIMEOUT_S, env=_ENV)[1]
    assert seen == [float(i) for i in range(8)]


# -- cleanup -----------------------------------------------------------------------------------

@needs_netns
@pytest.mark.timeout(60)
def test_a_failing_child_leaves_no_network_behind(clean_host):
    with pytest.raises(LaunchError, match=r"worker rank 1 \(machine node1\) failed: RuntimeError: "
                                          r"boom on purpose from rank 1"):
        polytrain.launch(scripts.worker_raises, workers=2, nodes=2, servers=1, args=(1,),
                         bandwidth="1gbit", timeout_s=COMM_TIMEOUT_S, env=_ENV)


@needs_netns
def test_a_run_id_a_live_run_holds_is_refused(clean_host):
    shape = LinkShape.parse("1gbit")
    with Network(["node0", "server0"], shape, run_id="0abcde") as net:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert {"pt-0abcde-hub", "pt-0abcde-node0", "pt-0abcde-server0"} <= \
            {line.split()[0] for line in names.splitlines()}
        assert (net.nic("node0"), net.nic("server0"), net.address("server0")) == \
            ("pt-0abcde-n0", "pt-0abcde-s0", "10.111.0.2")
        with pytest.raises(ConfigError, match=rf"network namespace pt-0abcde-hub belongs to "
                                              rf"another live run \(0abcde, launcher pid "
                                              rf"{os.getpid()}\)\. HINT: let that run end"):
            Network(["node0"], shape, run_id="0abcde").open()
    assert not any("0abcde" in x for x in _leftovers())


def test_a_claim_is_never_seen_half_written(tmp_path, monkeypatch):
    # A claim was created empty and written after: another launcher's sweep that read it
    # then took it for ownerless and removed it, and later this live run's namespaces.
    monkeypatch.setattr(network, "STATE_DIR", tmp_path)
    claim, dump = tmp_path / "0abcdf.json", json.dump
    with monkeypatch.context() as m:
        m.setattr(network.json, "dump", lambda *a, **k: (assert_absent(claim), dump(*a, **k))[1])
        assert network.take_claim("0abcdf", {"machines": ["node0"]}) == claim
    assert json.loads(claim.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == ["0abcdf.json"]
    with pytest.raises(ConfigError, match=r"belongs to another live run \(0abcdf, launcher pid"):
        network.take_claim("0abcdf", {})
    assert [p.name for p in tmp_path.iterdir()] == ["0abcdf.json"]


@needs_netns
@pytest.mark.timeout(30)
def test_a_claim_that_cannot_be_written_is_one_line_naming_where(tmp_path, monkeypatch, capfd):
    # A read-only /run (docker --read-only), or one where the claims' directory cannot be
    # made: take_claim's OSError came out of `polytrain launch --bandwidth` as a traceback.
    (tmp_path / "run").write_text("")  # a file: no directory can be made under it
    monkeypatch.setattr(network, "STATE_DIR", tmp_path / "run" / "polytrain" / "netns")
    message = (rf"--bandwidth needs a writable {tmp_path}/run/polytrain/netns, where each run "
               rf"claims its emulated network \(NotADirectoryError: \[Errno 20\] Not a "
               rf"directory: '{tmp_path}/run/polytrain/netns'\)\. HINT: make it writable \(a "
               rf"read-only /run: mount a tmpfs there\), or leave --bandwidth out$")
    with pytest.raises(ConfigError, match="^" + message):
        network.take_claim("0abcdf", {})
    refused_launch(tmp_path, capfd, message, "--workers", "2", "--nodes", "2", "--bandwidth",
                   "1gbit")
    said = network.netem_check()
    assert said == (f"unknown: --bandwidth needs a writable {tmp_path}/run/polytrain/netns, "
                    f"where each run claims its emulated network (NotADirectoryError: [Errno 20] "
                    f"Not a directory: '{tmp_path}/run/polytrain/netns')"), said
    # A directory there that refuses the claim's file (read-only): the same line.
    monkeypatch.setattr(network, "STATE_DIR", tmp_path)
    monkeypatch.setattr(network.os, "link", lambda *a: (_ for _ in ()).throw(
        OSError(30, "Read-only file system")))
    with pytest.raises(ConfigError, match=rf"^--bandwidth needs a writable {tmp_path}, where "
                                          rf"each run claims its emulated network \(OSError: "
                                          rf"\[Errno 30\] Read-only file system\)\. HINT"):
        network.take_claim("0abcdf", {})
    assert list(tmp_path.glob(".*.tmp")) == []
    # A read-only /run where the directory exists: the claim's file cannot be opened, and
    # its cleanup's unlink fails too (EROFS before the file is found missing).
    monkeypatch.setattr(network, "open", lambda *a, **k: (_ for _ in ()).throw(
        OSError(30, "Read-only file system")), raising=False)
    monkeypatch.setattr(network.Path, "unlink", lambda *a, **k: (_ for _ in ()).throw(
        OSError(30, "Read-only file system")))
    with pytest.raises(ConfigError, match=r"Read-only file system\)\. HINT"):
        network.take_claim("0abcdf", {})
    assert network.netem_check().startswith(f"unknown: --bandwidth needs a writable {tmp_path}")


@needs_netns
@pytest.mark.timeout(30)
def test_a_sweep_removes_a_dead_writers_half_written_claim_and_leaves_a_live_ones(
        tmp_path, monkeypatch):
    # A launcher killed between writing its claim's copy and linking it left the copy for
    # good: sweeps read only the claims.
    monkeypatch.setattr(network, "STATE_DIR", tmp_path)
    dead, live = tmp_path / ".0abcdf.99999999.tmp", tmp_path / f".0abce0.{os.getpid()}.tmp"
    dead.write_text("{"), live.write_text("{")
    network.sweep_stale()
    assert not dead.exists() and live.exists()


@needs_netns
@pytest.mark.timeout(30)
def test_the_netem_probe_holds_a_claim_while_its_namespace_lives(monkeypatch, clean_host):
    # A launcher starting while `polytrain env` tried netem took the unclaimed probe for
    # ownerless and removed it, and the check said "unknown".
    seen: list[bool] = []
    tool = network._tool

    def spy(cmd, input=None):
        if cmd[1:3] == ["netns", "add"]:
            run_id = network._NAMESPACE.fullmatch(cmd[3]).group(1)
            seen.append((network.STATE_DIR / f"{run_id}.json").exists())
        return tool(cmd, input)

    monkeypatch.setattr(network, "_tool", spy)
    assert network.netem_check().startswith(("yes", "no: this kernel lacks tc's netem"))
    assert seen == [True]


def test_iproute2_runs_in_a_session_of_its_own():
    # A terminal's Ctrl-C reaches the whole foreground group: it killed ip and tc halfway
    # through a network's set-up, reported as a kernel that lacks veth or namespaces.
    out = network._tool(["sh", "-c", "ps -o sid= -p $$"])
    assert int(out.stdout) != os.getsid(0)


@needs_netns
@pytest.mark.timeout(60)
def test_close_removes_the_runs_namespaces_it_did_not_see_made(clean_host):
    net = Network(["node0"], LinkShape.parse("1gbit"))
    net.open()
    try:  # as an `ip netns add` that a signal ended after it made the namespace
        subprocess.run([IP, "netns", "add", net.prefix + "late"], check=True)
    finally:
        net.close()
    assert not any(net.run_id in x for x in _leftovers())


def assert_absent(path: Path) -> None:
    assert not path.exists(), f"{path} is visible while it is written"


def _start_launcher(tmp_path: Path, workers: int) -> tuple[subprocess.Popen, list[int]]:
    code = (f"import polytrain; from tests.launch import scripts; "
            f"polytrain.launch(scripts.write_pid_and_hang, workers={workers}, nodes={workers}, "
            f"bandwidth='1gbit', args=({str(tmp_path)!r},))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE,
                                text=True, preexec_fn=as_from_a_terminal,
                                env=dict(os.environ, **_ENV,
                                                    PYTHONPATH=os.pathsep.join(sys.path)))
    return launcher, scripts.started_pids(tmp_path, workers, launcher)


@needs_netns
@pytest.mark.timeout(90)
def test_ctrl_c_removes_the_network(tmp_path, clean_host):
    launcher, _ = _start_launcher(tmp_path, 2)
    launcher.send_signal(signal.SIGINT)
    try:
        _, err = launcher.communicate(timeout=60)
    finally:  # its children die with it (PR_SET_PDEATHSIG)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert "interrupted (Ctrl-C): stopped all 2 processes" in err


@needs_netns
@pytest.mark.timeout(120)
def test_a_killed_launchers_network_is_removed_by_the_next_start(tmp_path, clean_host):
    launcher, pids = _start_launcher(tmp_path, 2)
    claims = list(network.STATE_DIR.glob("*.json"))
    run_id = next(c.stem for c in claims if json.loads(c.read_text())["pid"] == launcher.pid)
    launcher.kill()
    launcher.wait()
    stale = {x for x in _leftovers() if run_id in x}
    assert {f"netns pt-{run_id}-hub", f"claim {run_id}.json"} <= stale  # SIGKILL: no cleanup
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    results = polytrain.launch(scripts.identity, workers=2, nodes=2, bandwidth="1gbit",
                               timeout_s=COMM_TIMEOUT_S, env=_ENV)
    assert [r["machine"] for r in results] == ["node0", "node1"]
    assert not any(run_id in x for x in _leftovers())
