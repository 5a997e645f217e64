"""config.check_link on byteps's and herring's sums: a link too slow for one of their waits."""

import pytest
import torch

from polytrain.config import check_link, layout_of
from polytrain.errors import ConfigError
from polytrain.models import get_model
from polytrain.strategies.base import get_strategy, make_options


def _check(strategy: str, *, bandwidth: str, timeout_s: float, nodes: int = 2,
           servers: int = 0, options: dict | None = None) -> None:
    with torch.device("meta"):
        model = get_model("mlp").make(d_model=256)
    layout = layout_of(strategy, options or {}, workers=nodes, nodes=nodes, servers=servers)
    check_link(strategy, make_options(get_strategy(strategy), dict(options or {})), model,
               layout, bandwidth=bandwidth, latency=None, timeout_s=timeout_s)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("strategy", ["byteps", "herring"])
def test_a_link_too_slow_for_a_sums_push_and_answer_is_refused(strategy):
    # Symptom: `train --strategy byteps --model mlp --d-model 256 --nodes 2 --workers 2
    # --bandwidth 2mbit --timeout 5` passed the link check and failed its first step with
    # CommTimeout. Cause: check_link timed only worker 0's first copy (the largest tensor,
    # 4 s), not the sum a worker waits for at once: its push to the other machine's server
    # and that server's answer (half the model each way, 1.59 MB in all: 6.4 s).
    with pytest.raises(ConfigError, match=rf"^--bandwidth 2mbit carries .*{strategy}.* in 6 s, "
                                          r"longer than --timeout 5: the run would time out "
                                          r"there\. HINT: pass --bandwidth 3mbit or more \(a "
                                          r"real network's is 1gbit or more\), or a --timeout "
                                          r"above 7$"):
        _check(strategy, bandwidth="2mbit", timeout_s=5)
    _check(strategy, bandwidth="2mbit", timeout_s=7)  # time enough
    _check(strategy, bandwidth="3mbit", timeout_s=5)  # a fast enough link


@pytest.mark.timeout(20)
def test_smaller_fused_groups_wait_less():
    # byteps waits for one fused group at a time: groups of about 64 KiB cross in time.
    _check("byteps", bandwidth="2mbit", timeout_s=5, options={"fuse_bytes": 65536})
