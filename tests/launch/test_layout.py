import pytest

from polytrain import ConfigError, Layout


def test_ranks_workers_then_colocated_then_dedicated_servers():
    layout = Layout(workers=4, nodes=2, servers=2, colocated=1)
    got = [(p.rank, p.role, p.machine, p.local_rank) for p in layout.processes()]
    assert got == [
        (0, "worker", "node0", 0), (1, "worker", "node0", 1),
        (2, "worker", "node1", 0), (3, "worker", "node1", 1),
        (4, "server", "node0", 2), (5, "server", "node1", 2),
        (6, "server", "server0", 0), (7, "server", "server1", 0),
    ]
    assert layout.world_size == 8


def test_describe_names_every_machine():
    assert Layout(workers=2, nodes=2, servers=1).describe() == \
        "node0: worker 0 | node1: worker 1 | server0: server 2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=3, nodes=2),
     r"--workers 3 is not divisible by --nodes 2.*HINT: pass --nodes one of \[1, 3\]"),
    (dict(workers=0), r"--workers must be at least 1"),
    (dict(workers=2, servers=-1), r"--servers must be 0 or more"),
])
def test_bad_layouts_say_what_to_pass(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Layout(**kwargs)
