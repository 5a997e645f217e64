import os
import signal

import pytest
import torch

# The test process itself stays on one thread: spawned processes share the 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Started as a shell's background job (`./dev test &`), the suite inherits SIGINT ignored,
# as do the launchers its tests start: the Ctrl-C tests then saw no Ctrl-C. Python's own
# handler again (a child it starts gets SIGINT's default).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="also run the long tier: convergence studies and the extra layouts "
                          "of tests whose every path the default tier covers already")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--long"):
        long = pytest.mark.skip(reason="long tier: ./dev test --long runs it")
        for item in items:
            if "long" in item.keywords:
                item.add_marker(long)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
