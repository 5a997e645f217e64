"""The architecture's arrows: no strategy imports another; lower folders never import upper ones."""

import ast
from pathlib import Path

import polytrain

ROOT = Path(polytrain.__file__).parent
# Modules under strategies/ that are shared machinery, not a strategy.
SHARED = {"base", "checks", "served", "synced", "trainer", "__init__"}
# Folder -> the folders above it, which it must never import.
ABOVE = {
    "comm": {"ps", "emulation", "pipeline", "moe", "strategies", "train", "cli"},
    "ps": {"emulation", "pipeline", "moe", "strategies", "train", "cli"},
    "emulation": {"ps", "pipeline", "moe", "strategies", "train", "cli"},
    "pipeline": {"strategies", "train", "cli"},
    "moe": {"strategies", "train", "cli"},
    "strategies": {"checkpoint", "train", "cli"},
    "checkpoint": {"train", "cli"},
    "train": {"cli"},
}


def imports_of(path: Path) -> set[str]:
    """The polytrain modules ``path`` imports, as dotted names below ``polytrain``."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                name = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("polytrain"):
                name = node.module.removeprefix("polytrain").lstrip(".")
            else:
                continue
            if name:
                out.add(name)
            out.update(f"{name}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("polytrain").lstrip(".") for a in node.names
                       if a.name.startswith("polytrain"))
    return out


def strategy_of(path: Path) -> str | None:
    parts = path.relative_to(ROOT / "strategies").with_suffix("").parts
    return None if parts[0] in SHARED else parts[0]


def test_no_strategy_imports_another_strategy():
    strategies = {p.stem if p.is_file() else p.name for p in (ROOT / "strategies").iterdir()
                  if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir())} - SHARED
    assert {"byteps", "herring", "hetpipe", "moe", "ddp", "single"} <= strategies
    for path in (ROOT / "strategies").rglob("*.py"):
        own = strategy_of(path)
        if own is None:
            continue
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "strategies" and len(parts) > 1 and parts[1] in strategies:
                assert parts[1] == own, f"{path.relative_to(ROOT)} imports strategy {parts[1]}"


def test_folders_depend_downwards_only_and_the_engine_lives_below_the_strategies():
    for folder, above in ABOVE.items():
        for path in (ROOT / folder).rglob("*.py"):
            for name in imports_of(path):
                assert name.split(".")[0] not in above, \
                    f"{path.relative_to(ROOT)} imports {name} (above {folder}/)"
    assert (ROOT / "ps" / "engine.py").exists()
    assert not list((ROOT / "strategies").rglob("engine.py"))
