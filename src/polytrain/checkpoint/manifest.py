"""A checkpoint directory on disk: its manifest (sizes, checksums), atomic commit, lookup, pruning.

A run's checkpoints live under ``OUT/checkpoints/``::

    checkpoints/
      step-40/            a whole checkpoint: manifest.json names every file below
        manifest.json     format, step, run (strategy, model, layout), files: bytes + sha256
        model.pt          the whole model, the single run's keys
        run.pt            step, scheduler, losses and times so far (worker 0)
        worker-0.pt ...   per worker: optimizer state by parameter name, RNG, strategy state
      .step-60.tmp/       being written: never read; a crash leaves it, the next save sweeps it
      .step-20.old/       a whole step-20 that a save of step 20 moved aside (see commit()): a
                          crash between its renames leaves it, read as step-20 until the next
                          save gives it its name back

A checkpoint is written under a temporary name and renamed once every file and
the manifest are on disk, so a directory named ``step-S`` is whole unless its
files were damaged later, which the checksums catch on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, overload

from ..errors import ConfigError

__all__ = ["FORMAT", "MANIFEST", "checkpoint_dir", "temporary_dir", "write_manifest",
           "verify", "read_manifest", "require", "step_dirs", "checked", "whole_checkpoints",
           "whole_past", "newest", "resolve", "run_out", "prune", "commit", "CheckpointError",
           "write_atomically", "tidy"]

FORMAT = "polytrain.checkpoint/1"
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")
_ASIDE = re.compile(r"^\.step-(\d+)\.old$")
# A save's counts (each the least it can be) and tables besides ``step`` and ``files``: one
# of another kind gave a resume's traceback (workers "x") or was taken (steps "x").
_COUNTS = {"workers": 1, "nodes": 1, "servers": 0, "steps": 1}
_TABLES = ("model_options", "strategy_options", "keys", "optimizer_index")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, damaged, or of another run."""


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def temporary_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".step-{step}.tmp"


def _aside(final: Path) -> Path:
    """Where :func:`commit` keeps the whole ``step-S`` it replaces until the new one is in."""
    return final.with_name(f".{final.name}.old")


# The checksums this process computed, by file (device, inode), with the size and times they
# were computed at: the prune at every save checks the kept checkpoints again, and an
# unchanged file is not read again (a file written, truncated or replaced since has another
# size, mtime or ctime, or another inode). A manifest's checksums are always computed afresh
# (a new file may take a removed one's inode within one timestamp tick), and a new process
# (a restart) reads every file.
_hashed: dict[tuple[int, int], tuple[int, int, int, str]] = {}


def _sha256(path: Path, *, fresh: bool = False) -> str:
    st = path.stat()
    key, seen = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = _hashed.get(key)
    if not fresh and known is not None and known[:3] == seen:
        return known[3]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    _hashed[key] = (*seen, h.hexdigest())
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` beside ``path``, flushed to disk, then renamed over it: a crash leaves
    the old file or the new one, never half of either.

        write_atomically(out / "final.pt", lambda tmp: torch.save(state, tmp))
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_manifest(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest.json`` listing every other file of ``directory`` with size and sha256."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.name == MANIFEST or not path.is_file():
            continue
        _fsync(path)
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path, fresh=True)}
    manifest = {"format": FORMAT, **meta, "files": files}
    write_atomically(directory / MANIFEST,
                     lambda tmp: tmp.write_text(json.dumps(manifest, indent=1) + "\n"))
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of ``directory`` (not checked against the files: see :func:`verify`)."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a whole checkpoint: it has no {MANIFEST}",
                              "pass a checkpoint directory (OUT/checkpoints/step-S) or the "
                              "run's --out directory") from None
    except (ValueError, OSError) as e:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} cannot be read ({e})",
                              "resume from another checkpoint (an older step-S)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"checkpoint {directory} has format {got!r}, not {FORMAT!r}",
                              "resume from a checkpoint this version of polytrain wrote")
    require(manifest, ("step", "files", "workers"), directory)
    step, files = manifest["step"], manifest["files"]
    entries_ok = isinstance(files, dict) and all(
        isinstance(e, dict) and type(e.get("bytes")) is int and isinstance(e.get("sha256"), str)
        for e in files.values())
    wrong = (f"its step is {step!r}" if type(step) is not int or step < 0
             else None if entries_ok else "its files are not listed as {name: {bytes, sha256}}")
    wrong = wrong or _wrong_field(manifest)
    if wrong:  # edited, or not a save's
        raise CheckpointError(f"checkpoint {directory} is damaged: {MANIFEST} is not a save's "
                              f"({wrong})", "resume from another checkpoint (an older step-S)")
    return manifest


def _wrong_field(manifest: dict[str, Any]) -> str | None:
    """The first of a save's other fields (where it wrote it: a script's save has no run
    record) that is of another kind, with its value: ``its workers is 'x'``."""
    for name, least in _COUNTS.items():
        value = manifest.get(name, least)
        if type(value) is not int or value < least:
            return f"its {name} is {value!r}"
    for name in _TABLES:
        if not isinstance(manifest.get(name, {}), dict):
            return f"its {name} is {manifest[name]!r}"
    return None


def require(manifest: dict[str, Any], fields: Iterable[str], directory: str | Path) -> None:
    """Refuse a manifest without ``fields`` (edited, or not written by a save)."""
    missing = [f for f in fields if f not in manifest]
    if missing:
        raise CheckpointError(f"checkpoint {directory} is damaged: its {MANIFEST} has no "
                              f"{', '.join(missing)}",
                              "resume from another checkpoint (an older step-S)")


def verify(directory: str | Path) -> dict[str, Any]:
    """The manifest of ``directory`` after checking every file's size and checksum."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, want in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} is missing",
                                  "resume from another checkpoint (an older step-S)")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {name} has {size} bytes, the manifest "
                f"says {want['bytes']} (truncated?)",
                "resume from another checkpoint (an older step-S)")
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {name}'s sha256 differs from the "
                f"manifest's (corrupted on disk?)",
                "resume from another checkpoint (an older step-S)")
    return manifest


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Every ``step-S`` directory under ``root`` (whole or not), newest first; where there is
    no ``step-S`` but a ``.step-S.old``, that one: a crash between :func:`commit`'s two
    renames left the whole checkpoint there until the next save's :func:`tidy` renames it
    (before, nothing read it there: a script's load with ``missing_ok`` started afresh)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir(), key=lambda p: p.name.startswith(".")):  # step-S first
        if p.is_dir() and (m := _STEP.match(p.name) or _ASIDE.match(p.name)):
            found.setdefault(int(m.group(1)), p)
    return sorted(found.items(), reverse=True)


def checked(root: str | Path, step: int = -1) -> Iterator[tuple[int, Path, str | None]]:
    """Every ``step-S`` under ``root`` past ``step``, newest first, with why it is not whole
    (None: whole), each verified only when reached."""
    for s, path in step_dirs(root):
        if s <= step:
            return
        try:
            verify(path)
        except CheckpointError as e:
            yield s, path, e.what
            continue
        yield s, path, None


def whole_checkpoints(root: str | Path) -> list[tuple[int, Path, str | None]]:
    """Every ``step-S`` under ``root``, newest first, with why it is not whole (None: whole)."""
    return list(checked(root))


def whole_past(root: str | Path, step: int = -1) -> Iterator[Path]:
    """The whole checkpoints under ``root`` past ``step``, newest first, each verified only
    when reached (damaged ones passed over)."""
    return (path for _, path, why in checked(root, step) if why is None)


def newest(root: str | Path, *, after: int = -1) -> Path | None:
    """The newest whole checkpoint under ``root`` past step ``after`` (None: there is none)."""
    return next(whole_past(root, after), None)


def run_out(path: str | Path) -> Path | None:
    """The ``--out`` directory of the run a ``--resume PATH`` continues (``OUT``,
    ``OUT/checkpoints`` or ``OUT/checkpoints/step-S``); None for a checkpoint elsewhere."""
    p = Path(path).resolve()
    if (p / "checkpoints").is_dir():
        return p
    if _STEP.match(p.name) or _ASIDE.match(p.name):
        p = p.parent
    return p.parent if p.name == "checkpoints" else None


_Caller = Literal["--resume", "load()"]


@overload
def resolve(path: str | Path, *, missing_ok: Literal[False] = ...,
            caller: _Caller = ...) -> tuple[Path, list[str]]: ...


@overload
def resolve(path: str | Path, *, missing_ok: bool,
            caller: _Caller = ...) -> tuple[Path, list[str]] | None: ...


def resolve(path: str | Path, *, missing_ok: bool = False,
            caller: _Caller = "--resume") -> tuple[Path, list[str]] | None:
    """The checkpoint a ``--resume PATH`` means, and the damaged ones skipped on the way.

    PATH is a checkpoint (``.../step-S``: it must be whole), a checkpoints folder, or a
    run's ``--out`` directory (its ``checkpoints/``): the newest whole one there. With
    ``missing_ok``, None where there is no checkpoint at all (no such folder, or none in
    it): a script's first run. ``caller`` words the refusals: the CLI's flags, or
    :func:`polytrain.load`'s arguments.
    """
    p = Path(path)
    if _STEP.match(p.name) and not p.exists() and _aside(p).is_dir():
        p = _aside(p)  # moved aside by a save that crashed (see step_dirs)
    # Nothing there: a first run (a path named step-S too, unless its folder holds others).
    if missing_ok and not p.exists() and not (_STEP.match(p.name) and p.parent.is_dir()
                                              and newest(p.parent) is not None):
        return None
    # A run's --out may itself be named step-N: its checkpoints/ says which it is.
    if (p / MANIFEST).exists() or (_STEP.match(p.name) and not (p / "checkpoints").is_dir()):
        verify(p)
        return p, []
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if p.is_file():  # a final.pt, say: weights alone, which --init starts from
        raise CheckpointError(f"checkpoint {path} is a file, and a checkpoint is a directory "
                              f"(model, optimizer, data position, RNG)",
                              "pass a run's --out or one of its checkpoints/step-S to "
                              "--resume; to start a new run from a final.pt's weights, pass "
                              "it to --init" if caller == "--resume" else
                              "pass load() the folder polytrain.save() wrote to, or one of its "
                              "step-S (a final.pt holds the weights alone)")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory",
                              "pass (to --resume, or polytrain.load) the --out directory of "
                              "an earlier run, or one of its checkpoints/step-S; a script's "
                              "first run can pass polytrain.load(DIR, ..., missing_ok=True)")
    skipped: list[str] = []
    for _, c, why in checked(root):  # the newest whole one: older ones are not read
        if why is None:
            return c, skipped
        skipped.append(f"{c}: {why}")
    if missing_ok and not skipped:  # (damaged ones only: refused, not a first run)
        return None
    detail = f" ({len(skipped)} damaged: {skipped[0]})" if skipped else ""
    if caller == "--resume":
        raise CheckpointError(f"--resume {path}: no whole checkpoint in {root}{detail}",
                              "pass a run's --out directory that holds checkpoints/step-S "
                              "(train with --checkpoint-every N), or start without --resume")
    # The CLI's words, in a script's load, sent it to flags it has none of.
    raise CheckpointError(f"polytrain.load({str(path)!r}): no whole checkpoint in {root}"
                          f"{detail}", "pass load() the folder polytrain.save() wrote to, or a "
                          "run's --out" + ("; remove the damaged ones to start afresh" if skipped
                                           else "; a script's first run, with nothing saved "
                                           "yet, passes missing_ok=True"))


def tidy(root: str | Path) -> list[str]:
    """Undo what a crash left in ``root`` (before a save, on worker 0 alone): temporary
    folders of unfinished saves are removed, and a whole checkpoint that :func:`commit` had
    moved aside when it crashed between its two renames gets its name back (removed where
    its replacement is in place). Returns what it did, to log."""
    root = Path(root)
    done = []
    for path in sorted(root.glob(".step-*.tmp")):
        shutil.rmtree(path, ignore_errors=True)
        done.append(f"removed {path.name}, an unfinished save")
    for path in sorted(root.glob(".step-*.old")):
        final = root / path.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.replace(path, final)
            done.append(f"restored {final.name}, moved aside by a save that did not finish")
    return done


def commit(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``; a whole checkpoint already there is replaced
    only after the new one is complete (it is moved aside, then removed)."""
    aside = _aside(final)
    if aside.exists():
        shutil.rmtree(aside)
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(final.parent)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)


def prune(root: str | Path, keep: int | None, *, protect: Iterable[Path] = ()) -> list[Path]:
    """Remove all but the newest ``keep`` whole checkpoints (None: keep all); returns removed.

    Every one is tried; an OSError after them names the first that could not be removed."""
    if keep is None:
        return []
    kept = {Path(p).resolve() for p in protect}
    removed, failed = [], list[OSError]()
    whole = [p for _, p, broken in whole_checkpoints(root) if broken is None]
    for path in whole[keep:]:
        if path.resolve() in kept:
            continue
        try:
            shutil.rmtree(path)
        except OSError as e:
            failed.append(e)
        else:
            removed.append(path)
    if failed:
        raise failed[0]
    return removed
