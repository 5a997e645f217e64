"""BytePS's own PyTorch examples, with only the import line changed, run unchanged.

``examples/`` holds a synthetic-data benchmark and an MNIST-style loop written
as ``byteps.torch`` scripts; with ``Compression.none`` their losses equal the
same scripts over torch.distributed's all-reduce (``allreduce_bps``: what ddp
computes), and ``Compression.fp16`` trains as well.
"""

import json
import re
from pathlib import Path

import pytest

from polytrain.launch import Layout
from polytrain.launch.launcher import launch_script
from tests.harness import COMM_TIMEOUT_S

EXAMPLES = Path(__file__).parent / "examples"
ROOT = Path(__file__).parents[3]  # the checkout, which holds tests/
IMPORT = "import polytrain.byteps as bps"
ENV = {"OMP_NUM_THREADS": "1"}


def run(script, tmp_path, *args, layout, reference=False):
    path = EXAMPLES / script
    if reference:  # the same script text, the import swapped for the all-reduce reference
        # (from this checkout, put on the path as `python SCRIPT` needs: a launched script's
        # path is its own folder's, not the working directory's)
        text = path.read_text().replace(IMPORT, f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                                                "import tests.strategies.byteps.allreduce_bps "
                                                "as bps")
        path = tmp_path / f"reference_{script}"
        path.write_text(text)
    out = tmp_path / f"{path.stem}{'-'.join(args)}.json"
    launch_script(str(path), ["--log-json", str(out), *args], layout=layout, env=ENV,
                  timeout_s=COMM_TIMEOUT_S)
    return json.loads(out.read_text())


@pytest.mark.parametrize("script", ["benchmark_synthetic.py", "train_mnist.py"])
def test_the_scripts_are_byteps_scripts_but_for_the_import(script):
    text = (EXAMPLES / script).read_text()
    assert [line for line in text.splitlines() if "polytrain" in line] == [IMPORT]
    assert re.search(r"\bbps\.init\(\)", text) and "bps.DistributedOptimizer(" in text


# 2 machines of one worker each and one CPU server: the pushes cross machines.
LAYOUT = Layout(workers=2, nodes=2, servers=1, colocated=1)


@pytest.mark.timeout(240)
def test_the_synthetic_benchmark_matches_all_reduce(tmp_path):
    got = run("benchmark_synthetic.py", tmp_path, layout=LAYOUT)
    want = run("benchmark_synthetic.py", tmp_path, layout=LAYOUT, reference=True)
    assert len(got["losses"]) == 7 and len(got["img_sec"]) == 3
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    assert got["losses"][-1] < got["losses"][0]  # it trained


@pytest.mark.long
@pytest.mark.timeout(240)
def test_the_mnist_loop_matches_all_reduce_and_fp16_trains_as_well(tmp_path):
    got = run("train_mnist.py", tmp_path, layout=LAYOUT)
    want = run("train_mnist.py", tmp_path, layout=LAYOUT, reference=True)
    for k in ("train_loss", "test_loss", "test_accuracy"):
        assert got[k] == pytest.approx(want[k], abs=1e-5), k
    half = run("train_mnist.py", tmp_path, "--fp16-pushpull", layout=LAYOUT)
    assert half["train_loss"] == pytest.approx(got["train_loss"], rel=1e-2, abs=1e-3)
    assert got["train_loss"][-1] < got["train_loss"][0]
