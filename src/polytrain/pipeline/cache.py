"""AutoCache (PipeTransformer): the frozen front's output, cached per sample, advanced as it grows.

Frozen layers never change, so a sample's activation at the frozen boundary
is the same every epoch: the first stage keeps it (in memory up to a budget,
past it in files under a directory) and later epochs skip the frozen
forward. An entry remembers the depth it was computed at; when more layers
freeze, a hit is *advanced* through the newly frozen layers only, instead
of being recomputed from the input. Samples are keyed by their content (a
hash of the input row), so any data set works. With ``shared`` (a directory
in host shared memory, one per machine), every entry is also published there
for the other first stages of the same machine, as the paper's cache lives in
the host's shared memory: a sample re-sharded to another replica of the
machine still hits (frozen layers are the same in every replica). What a
process publishes there is host memory too: it counts against the process's
budget (``--cache-mb``) with its own copy, and an entry past the budget is
neither published nor kept in memory; a shared directory that fills up (a
small ``/dev/shm``) ends the publishing with a warning, not the run.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import hashlib
import logging
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from .. import _env
from ..errors import ConfigError
from ..launch.launcher import owned_dir
from ..tensors import host_copy

__all__ = ["ActivationCache", "CacheStats", "frozen_forward", "check_writable", "expected_hits"]

log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    """Counts for ``metrics.json``: samples served from the cache (of those, found in the
    machine's shared directory, and advanced through newly frozen layers), samples
    computed, bytes held in memory and on disk (this process's tiers) and published in the
    machine's shared directory (by this process)."""

    hits: int = 0
    shared_hits: int = 0
    misses: int = 0
    advanced: int = 0
    memory_bytes: int = 0
    shared_bytes: int = 0
    disk_bytes: int = 0
    disk_entries: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def check_writable(directory: str) -> None:
    """Refuse a cache directory this process cannot create files in (one clear line).

    Creates nothing: a directory not there yet is checked by its nearest existing parent
    (the options are checked before any other check may refuse the command)."""
    path = Path(directory).absolute()
    try:  # (exists() raises where a parent is not searchable: Python 3.11)
        there = next(p for p in (path, *path.parents) if p.exists())
        if not there.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        if there == path:
            probe = tempfile.NamedTemporaryFile(dir=path, prefix=".polytrain-probe-")
            probe.close()
        elif not os.access(there, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"{os.strerror(errno.EACCES)} in {there}")
    except OSError as e:
        raise ConfigError(f"the cache directory {directory} is not writable ({e.strerror})",
                          "pass --cache-dir DIR with a directory you can write, or "
                          "--no-cache") from None


class ActivationCache:
    """Per-sample activations at the frozen boundary: memory first, then disk.

    Example::

        cache = ActivationCache(memory_bytes=64 << 20)
        h = frozen_forward(layers, x, frozen=3, cache=cache)   # misses: computes, stores
        h = frozen_forward(layers, x, frozen=3, cache=cache)   # hits: no layer runs

    Args:
        memory_bytes: the host memory budget (``--cache-mb``): the memory tier and what this
            process publishes in ``shared``; entries past it go to disk.
        directory: where the disk tier's files go, in a directory of this process's that
            :meth:`close` removes, or at the latest the end of the process, and the next
            cache there if this process is killed (default: a fresh temporary directory;
            under ``polytrain launch`` in the launcher's work directory, so that it goes with
            it even when the process is killed).
        shared: a directory the first stages of one machine share (``/dev/shm/...``):
            every entry is published there as a file and looked up there on a miss
            (default: none, this process's entries only). Its owner removes it.
    """

    def __init__(self, *, memory_bytes: int, directory: str | None = None,
                 shared: str | None = None) -> None:
        self.budget = memory_bytes
        self.shared = Path(shared) if shared is not None else None
        self._own_dir = directory is None
        self._dir_arg = directory
        self._dir: Path | None = None
        self._remove_at_exit: Callable[[], None] | None = None  # registered with atexit
        self.memory: dict[bytes, tuple[int, torch.Tensor]] = {}
        self.disk: dict[bytes, tuple[int, Path, int]] = {}
        self.published: dict[bytes, int] = {}  # key -> bytes this process put in ``shared``
        #: False once the disk tier failed (full, removed): entries past the budget are
        #: dropped, and their samples' frozen layers run again.
        self.spilling = True
        self.stats = CacheStats()

    @staticmethod
    def key(sample: torch.Tensor) -> bytes:
        """A sample's identity: a hash of its input's dtype, shape and bytes (as raw bytes:
        numpy has no bfloat16)."""
        t = sample.detach().cpu().contiguous().reshape(-1)
        digest = hashlib.blake2b(f"{t.dtype}{tuple(sample.shape)}".encode(), digest_size=16)
        digest.update(t.view(torch.uint8).numpy().tobytes())
        return digest.digest()

    def get(self, key: bytes) -> tuple[int, torch.Tensor] | None:
        """(depth, activation) of a cached sample, or None."""
        if key in self.memory:
            return self.memory[key]
        if key in self.disk:
            depth, path, _ = self.disk[key]
            try:
                return depth, torch.load(path, weights_only=True)
            except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
                # removed, cut short or damaged: a miss
                log.warning("AutoCache: cannot read %s (%s); the sample's frozen layers run "
                            "again", path, e)
                self._drop_disk(key)
                return None
        if self.shared is not None:
            try:
                depth, value = torch.load(self.shared / (key.hex() + ".pt"), weights_only=True)
            except FileNotFoundError:  # no first stage of this machine has seen the sample
                return None
            self.stats.shared_hits += 1
            self._keep(key, int(depth), value)
            return int(depth), value
        return None

    def put(self, key: bytes, depth: int, value: torch.Tensor) -> None:
        value = host_copy(value)  # host memory, off a GPU too
        published = key in self.published
        self._forget(key)  # an entry advanced to a new depth replaces the old
        nbytes = value.numel() * value.element_size()
        if self.shared is not None and self._in_budget(2 * nbytes):  # its copy and ours
            self._publish(key, depth, value, nbytes)
        elif published and self.shared is not None:  # not the old one either, then
            (self.shared / (key.hex() + ".pt")).unlink(missing_ok=True)
        self._keep(key, depth, value)

    def _in_budget(self, nbytes: int) -> bool:
        return self.stats.memory_bytes + self.stats.shared_bytes + nbytes <= self.budget

    def _publish(self, key: bytes, depth: int, value: torch.Tensor, nbytes: int) -> None:
        assert self.shared is not None
        # Written aside and renamed: a reader sees the whole entry or none.
        path = self.shared / (key.hex() + ".pt")
        part = self.shared / f".{key.hex()}-{os.getpid()}.part"
        try:
            torch.save((depth, value), part)
            os.replace(part, path)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
            log.warning("AutoCache: cannot write to the machine's shared cache %s (%s); this "
                        "first stage stops publishing its entries there and caches on its "
                        "own", self.shared, e)
            self.shared = None
            return
        self.published[key] = nbytes
        self.stats.shared_bytes += nbytes

    def _forget(self, key: bytes) -> None:
        """Drop ``key`` from the memory tier and the bytes published (not from disk:
        :meth:`_keep` replaces its file, or drops it)."""
        old = self.memory.pop(key, None)
        if old is not None:
            self.stats.memory_bytes -= old[1].numel() * old[1].element_size()
        self.stats.shared_bytes -= self.published.pop(key, 0)

    def _keep(self, key: bytes, depth: int, value: torch.Tensor) -> None:
        """Hold an entry (not in the memory tier: ``put`` forgot it, ``get`` found it
        elsewhere) in this process's tiers: memory within the budget, then disk; an older
        depth's file goes (an entry advanced into memory left it there until close())."""
        nbytes = value.numel() * value.element_size()
        if self._in_budget(nbytes):
            self._drop_disk(key)
            self.memory[key] = (depth, value)
            self.stats.memory_bytes += nbytes
            return
        if not self.spilling:
            self._drop_disk(key)
            return
        try:
            path = self._directory() / (key.hex() + ".pt")
            torch.save(value, path)
        except (OSError, RuntimeError, ConfigError) as e:  # torch.save reports a full disk
            # as RuntimeError; a --cache-dir removed since the start is a ConfigError
            log.warning("AutoCache: cannot write to its disk tier %s (%s); this first stage "
                        "keeps no more entries past --cache-mb (they are recomputed)",
                        self._dir or self._dir_arg, e)
            self.spilling = False
            self._drop_disk(key)
            return
        if key in self.disk:
            self.stats.disk_bytes -= self.disk[key][2]
        else:
            self.stats.disk_entries += 1
        self.disk[key] = (depth, path, nbytes)
        self.stats.disk_bytes += nbytes

    def _drop_disk(self, key: bytes) -> None:
        """Forget ``key``'s disk entry (an older depth's, or one that cannot be read), if it
        has one."""
        old = self.disk.pop(key, None)
        if old is not None:
            self.stats.disk_bytes -= old[2]
            self.stats.disk_entries -= 1
            with contextlib.suppress(OSError):
                old[1].unlink(missing_ok=True)

    def _directory(self) -> Path:
        if self._dir is None:
            if self._dir_arg is None:  # in the launcher's work directory, if launched: a
                # process that fails leaves without closing the cache, and it is removed then
                self._dir = Path(tempfile.mkdtemp(prefix="polytrain-cache-", dir=_env.run_dir()))
            else:  # a killed process leaves it: the next cache there removes it
                check_writable(self._dir_arg)
                Path(self._dir_arg).mkdir(parents=True, exist_ok=True)
                self._dir = owned_dir(Path(self._dir_arg), "polytrain-cache-",
                                      "an AutoCache disk tier")
            # Removed by close(), and at the latest when the process ends: a script that
            # ends without close() (the README's step API, run by torchrun) left it in /tmp.
            self._remove_at_exit = functools.partial(shutil.rmtree, self._dir,
                                                     ignore_errors=True)
            atexit.register(self._remove_at_exit)
        return self._dir

    def close(self) -> None:
        """Drop every entry and remove the disk tier's files."""
        self.memory.clear()
        self.disk.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._remove_at_exit is not None:
            atexit.unregister(self._remove_at_exit)
            self._remove_at_exit = None


def expected_hits(start: int, steps: int, *, since: int | None, epoch_steps: int | None,
                  same_cache: float = 1.0) -> float:
    """The share of the samples of steps [``start``, ``start + steps``) the cache should serve.

    The cache has kept every sample its first stages computed from step ``since`` on (None:
    not caching). With epochs of ``epoch_steps`` steps (each sample once, in a fresh
    order), a sample of epoch e was last met at a uniformly random step of epoch e - 1,
    so it is cached with the chance that this step came at or after ``since``;
    ``same_cache`` is the chance that it then came to a first stage sharing the cache it
    went into (the same process, or the same machine with the shared tier). Without
    epochs (None) nothing is counted on. A plan that took the cache as full from its
    start put the whole frozen front's cost nowhere while a cold cache served nothing.

    Example::

        expected_hits(80, 40, since=80, epoch_steps=55)   # 0.136: steps 110-119, 30/55 each
    """
    if since is None or not epoch_steps or steps <= 0:
        return 0.0
    seen = sum(min(1.0, max(0.0, (u // epoch_steps * epoch_steps - since) / epoch_steps))
               for u in range(start, start + steps))
    return same_cache * seen / steps


def _run(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@contextlib.contextmanager
def _evaluating(layers: Sequence[nn.Module]) -> Iterator[None]:
    """``layers`` in eval mode meanwhile (every module's own mode restored after)."""
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    for layer in layers:
        layer.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@torch.no_grad()
def frozen_forward(layers: Sequence[nn.Module], inputs: torch.Tensor, *, frozen: int,
                   cache: ActivationCache | None = None) -> torch.Tensor:
    """The output of the frozen front ``layers[:frozen]`` on ``inputs``, without autograd.

    The front runs in eval mode: a frozen layer is a fixed function (no dropout mask,
    a batch norm on its running statistics), so a cached entry equals recomputing it and
    a run trains the same with the cache or without.

    With ``cache``: a sample cached at depth ``frozen`` is taken as is, one cached at a
    smaller depth runs only ``layers[depth:frozen]``, the rest run from the input; every
    sample is then cached at depth ``frozen``. Samples are batched by the depth they start
    from, so the layers run once per group.
    """
    if frozen == 0:
        return inputs
    with _evaluating(layers[:frozen]):
        return _cached_forward(layers, inputs, frozen, cache)


def _cached_forward(layers: Sequence[nn.Module], inputs: torch.Tensor, frozen: int,
                    cache: ActivationCache | None) -> torch.Tensor:
    if cache is None:
        return _run(layers[:frozen], inputs)
    keys = [cache.key(row) for row in inputs.cpu()]  # one copy off a GPU, not one a row
    found = [cache.get(k) for k in keys]
    groups: dict[int, list[int]] = {}
    for i, hit in enumerate(found):
        groups.setdefault(hit[0] if hit is not None else 0, []).append(i)
    parts: dict[int, torch.Tensor] = {}
    for depth, rows in sorted(groups.items()):
        if depth == 0:
            out = _run(layers[:frozen], inputs[rows])
            cache.stats.misses += len(rows)
        else:
            start = torch.stack([found[i][1] for i in rows]  # type: ignore[index]
                                ).to(inputs.device)
            out = _run(layers[depth:frozen], start) if depth < frozen else start
            cache.stats.hits += len(rows)
            if depth < frozen:
                cache.stats.advanced += len(rows)
        host = out.cpu() if depth != frozen else out  # one copy off a GPU, not one a row
        for k, i in enumerate(rows):
            parts[i] = out[k]
            if depth != frozen:
                cache.put(keys[i], frozen, host[k])
    return torch.stack([parts[i] for i in range(len(keys))])
