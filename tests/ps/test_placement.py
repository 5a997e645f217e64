"""Placing partitions on servers: the refusals, in the words of both ways to start servers."""

import pytest

from polytrain.errors import ConfigError
from polytrain.ps.placement import balanced


def test_a_placement_without_servers_names_the_flag_and_the_launch_argument():
    # Symptom: the README's hetpipe step API under polytrain.launch(main, workers=4, nodes=2)
    # failed with "HINT: start servers with --servers K", a flag that script has no way to
    # take. Cause: the hint named the command line's flag only, not launch()'s servers=K.
    with pytest.raises(ConfigError, match=r"^a placement needs at least one server \(got "
                                          r"none\)\. HINT: start servers: --servers K on the "
                                          r"command line, servers=K in polytrain\.launch\(\)$"):
        balanced([], servers=[])


# Two workers and two servers on each of two machines: torchrun's
# POLYTRAIN_ROLE=worker,worker,server,server on both (ranks 2, 3 and 6, 7 the servers).
TWO_SERVERS_A_WORKER_MACHINE = ([("worker", "g0")] * 2 + [("server", "g0")] * 2
                                + [("worker", "g1")] * 2 + [("server", "g1")] * 2)


def test_several_servers_on_a_worker_machine_are_refused_where_one_a_machine_sums():
    # Symptom: under torchrun with POLYTRAIN_ROLE=worker,worker,server,server, BytePS and
    # Parallax summed on the first server of each worker machine; the second got no bytes,
    # and nothing said so. Cause: server_ranks kept s[0] of each machine's servers.
    from polytrain.comm.topology import Topology
    from polytrain.ps.placement import server_ranks
    topology = Topology.from_roles(TWO_SERVERS_A_WORKER_MACHINE)
    with pytest.raises(ConfigError, match=r"^byteps sums on one server per worker machine, "
                                          r"but machine 'g0' runs server ranks 2, 3 and "
                                          r"machine 'g1' 6, 7: all but the first of each "
                                          r"would sum nothing\. HINT: start one server on "
                                          r"each worker machine"):
        server_ranks(topology, colocate=True, strategy="byteps")
    # Left out (colocate=False), they are not refused: the dedicated servers sum.
    roles = TWO_SERVERS_A_WORKER_MACHINE + [("server", "cpu0")]
    assert server_ranks(Topology.from_roles(roles), colocate=False) == ([], [8])
