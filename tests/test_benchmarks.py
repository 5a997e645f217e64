"""Every benchmark script imports against the current library (a moved function broke one)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_the_benchmark_imports_and_has_a_main(path, monkeypatch):
    module = _load(path.stem, monkeypatch)  # the module's top level only: main() is guarded
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def _load(name, monkeypatch):
    path = next(p for p in BENCHMARKS if p.stem == name)
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_onebit_replay_runs_take_their_defaults_by_position(monkeypatch):
    # A run of three parts got variance "none" (the padding came from the front), and one
    # of two parts crashed on int("none").
    parse = _load("onebit_adam_replay", monkeypatch).parse_run
    assert parse("none") == ("none", "none", "0", "sums")
    assert parse("onebit/dithering:4") == ("onebit", "dithering:4", "0", "sums")
    assert parse("onebit:1024/dithering:4/30") == ("onebit:1024", "dithering:4", "30", "sums")
    assert parse("onebit/none/1/refresh4") == ("onebit", "none", "1", "refresh4")


@pytest.mark.timeout(180)
def test_the_pipetransformer_benchmark_runs_its_quick_settings(monkeypatch, tmp_path):
    # --quick was refused before any run: its base config (12 steps) kept the default freeze
    # points, one epoch of 108 steps ("no layer would freeze"), though no run uses it as is.
    out = tmp_path / "quick.json"
    pytest.importorskip("matplotlib")  # (the plot: ./dev installs it, .[test] does not)
    main = _load("pipetransformer", monkeypatch).main
    assert main(["--quick", "--only", "no freeze", "--out", str(out)]) == 0
    import json
    said = json.loads(out.read_text())
    assert said["summary"]["no freeze"]["speedup_rounds"] == [1.0]
    assert (tmp_path / "quick.png").exists()
