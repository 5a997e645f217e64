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
