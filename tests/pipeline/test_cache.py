"""AutoCache: cached activations give the same loss and gradients as recomputing them."""


import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import polytrain
from polytrain import ConfigError
from polytrain.models import GPT
from polytrain.models import cross_entropy as loss_fn
from polytrain.pipeline.cache import ActivationCache, expected_hits, frozen_forward
from polytrain.strategies.pipetransformer import PipeTransformerOptions
from tests.harness import spawn


def _model():
    torch.manual_seed(0)
    model = GPT(seq_len=16, d_model=32, layers=4)
    return model, list(model.children())


def _step(layers, h, y, frozen):
    """Loss and gradients of the trained layers on frozen-boundary activations ``h``."""
    for p in (p for layer in layers for p in layer.parameters()):
        p.grad = None
    out = h
    for layer in layers[frozen:]:
        out = layer(out)
    loss = loss_fn(out, y)
    loss.backward()
    grads = [p.grad.clone() for layer in layers[frozen:] for p in layer.parameters()]
    return float(loss.detach()), grads


@pytest.mark.parametrize("memory", [1 << 30, 0])  # the memory tier, and the disk tier alone
def test_a_step_on_cached_activations_equals_recomputing_them(memory, tmp_path):
    model, layers = _model()
    x = torch.randint(0, 256, (8, 16))
    y = torch.randint(0, 256, (8, 16))
    cache = ActivationCache(memory_bytes=memory, directory=str(tmp_path))
    fresh = frozen_forward(layers, x, frozen=2)
    first = frozen_forward(layers, x, frozen=2, cache=cache)   # misses: computed and stored
    cached = frozen_forward(layers, x, frozen=2, cache=cache)  # hits
    assert (cache.stats.misses, cache.stats.hits) == (8, 8)
    assert not cached.requires_grad
    assert torch.equal(first, fresh) and torch.equal(cached, fresh)
    loss_a, grads_a = _step(layers, fresh, y, 2)
    loss_b, grads_b = _step(layers, cached, y, 2)
    assert loss_a == loss_b
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    if memory == 0:
        assert cache.stats.disk_entries == 8 and cache.stats.memory_bytes == 0
        assert cache.stats.disk_bytes == 8 * 16 * 32 * 4
    else:
        assert cache.stats.memory_bytes == 8 * 16 * 32 * 4
    cache.close()


def test_the_frozen_front_runs_as_a_fixed_function_whatever_its_layers_mode():
    # A dropout in the front drew a fresh mask on every miss, and the cache replayed the
    # first one: with the cache and without, the run trained differently.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8)]
    x = torch.randn(4, 8)
    expected = layers[2](layers[0](x))  # the dropout as in eval mode: the identity
    cache = ActivationCache(memory_bytes=1 << 20)
    for out in (frozen_forward(layers, x, frozen=3),
                frozen_forward(layers, x, frozen=3, cache=cache),  # computed
                frozen_forward(layers, x, frozen=3, cache=cache)):  # served
        assert torch.allclose(out, expected)
    assert cache.stats.hits == 4
    assert all(layer.training for layer in layers)  # their modes are left as they were
    cache.close()


def test_cached_activations_advance_through_newly_frozen_layers():
    model, layers = _model()
    x = torch.randint(0, 256, (8, 16))
    y = torch.randint(0, 256, (8, 16))
    cache = ActivationCache(memory_bytes=1 << 30)
    frozen_forward(layers, x[:4], frozen=2, cache=cache)  # half the samples cached at depth 2
    calls = []
    hook = layers[0].register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    advanced = frozen_forward(layers, x, frozen=3, cache=cache)
    hook.remove()
    assert calls == [4]  # only the 4 uncached samples ran the embedding again
    assert cache.stats.advanced == 4
    recomputed = frozen_forward(layers, x, frozen=3)
    torch.testing.assert_close(advanced, recomputed, rtol=0, atol=1e-6)
    loss_a, grads_a = _step(layers, advanced, y, 3)
    loss_b, grads_b = _step(layers, recomputed, y, 3)
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_an_entry_advanced_into_memory_leaves_no_file_on_disk(tmp_path):
    # Symptom: advanced to a depth whose smaller entries fit in memory, every entry was held
    # in memory and 2 of 4 still on disk (disk_bytes 512, their files there until close()).
    # Cause: keeping an entry in memory dropped its older memory and published copies, not
    # its disk one (only a new file replaced an old one).
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 64), torch.nn.Linear(64, 2), torch.nn.Linear(2, 2)]
    cache = ActivationCache(memory_bytes=512, directory=str(tmp_path))
    x = torch.randn(4, 4)
    frozen_forward(layers, x, frozen=1, cache=cache)  # 256 bytes a sample: 2 fit in memory
    assert (len(cache.memory), cache.stats.disk_entries, cache.stats.disk_bytes) == (2, 2, 512)
    advanced = frozen_forward(layers, x, frozen=2, cache=cache)  # 8 bytes a sample
    assert cache.stats.advanced == 4 and len(cache.memory) == 4
    assert (cache.stats.memory_bytes, cache.stats.disk_entries, cache.stats.disk_bytes) == \
        (32, 0, 0)
    assert cache.disk == {} and list(cache._directory().glob("*.pt")) == []
    assert torch.equal(frozen_forward(layers, x, frozen=2, cache=cache), advanced)
    cache.close()


def test_a_cache_directory_that_is_not_writable_is_refused(tmp_path):
    # A path under a file, not a directory without write permission: root writes anywhere.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"the cache directory .*file/cache is not writable"):
        PipeTransformerOptions(cache_dir=str(blocker / "cache"))
    # A directory not there yet is checked, not made: the options are checked before the
    # rest of the command, which may be refused (it was made, and left behind).
    PipeTransformerOptions(cache_dir=str(tmp_path / "new" / "cache"))
    assert not (tmp_path / "new").exists()
    made = tmp_path / "made"
    made.mkdir()
    PipeTransformerOptions(cache_dir=str(made))
    assert list(made.iterdir()) == []
    if os.geteuid() != 0:  # root writes anywhere
        made.chmod(0o500)
        with pytest.raises(ConfigError, match=r"made is not writable"):
            PipeTransformerOptions(cache_dir=str(made))
        with pytest.raises(ConfigError, match=r"made/cache is not writable"):
            PipeTransformerOptions(cache_dir=str(made / "cache"))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to check as another user")
@pytest.mark.timeout(60)
def test_a_cache_directory_under_one_this_user_cannot_search_is_refused(tmp_path):
    # Path.exists() raised PermissionError (Python 3.11) outside the check's handler: a
    # traceback instead of the one line.
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                 sys.executable, "-c"]
    root = Path(__file__).resolve().parents[2]
    probe = subprocess.run([*as_nobody, "import polytrain"], capture_output=True, timeout=50,
                           cwd=root)
    if probe.returncode != 0:  # a checkout in a directory only root can read
        pytest.skip("user nobody cannot import polytrain from this checkout")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # root's: another user cannot look inside
    code = ("from polytrain import ConfigError\n"
            "from polytrain.strategies.pipetransformer import PipeTransformerOptions\n"
            "try:\n"
            f"    PipeTransformerOptions(cache_dir={str(private / 'x' / 'cache')!r})\n"
            "except ConfigError as e:\n"
            "    print(e)\n")
    run = subprocess.run([*as_nobody, code], capture_output=True, text=True, timeout=50,
                         cwd=root)
    assert run.returncode == 0 and "is not writable (Permission denied)" in run.stdout, \
        (run.stdout, run.stderr)


def test_first_stages_of_one_machine_share_their_entries(tmp_path):
    # Symptom: AutoCache hit 9% of the frozen front's samples on the benchmark. Cause: each
    # first stage cached only what it saw, and the data is re-sharded at random every
    # epoch; the paper's cache lives in the host's shared memory.
    model, layers = _model()
    x = torch.randint(0, 256, (8, 16))
    a = ActivationCache(memory_bytes=1 << 30, shared=str(tmp_path))
    b = ActivationCache(memory_bytes=1 << 30, shared=str(tmp_path))
    frozen_forward(layers, x[:4], frozen=2, cache=a)  # replica a sees half the samples
    calls = []
    hook = layers[0].register_forward_hook(lambda m, args, o: calls.append(args[0].shape[0]))
    served = frozen_forward(layers, x, frozen=2, cache=b)  # replica b gets all of them
    hook.remove()
    assert calls == [4]  # only the samples no one had seen ran the front
    assert (b.stats.hits, b.stats.shared_hits, b.stats.misses) == (4, 4, 4)
    assert torch.equal(served, frozen_forward(layers, x, frozen=2))
    again = frozen_forward(layers, x, frozen=3, cache=a)  # a advances b's entries too
    assert (a.stats.hits, a.stats.shared_hits, a.stats.advanced) == (8, 4, 8)
    torch.testing.assert_close(again, frozen_forward(layers, x, frozen=3), rtol=0, atol=1e-6)
    assert not list(tmp_path.glob(".*.part"))
    a.close()
    b.close()


def test_what_a_stage_publishes_in_shared_memory_counts_against_its_budget(tmp_path):
    # Every entry went to the shared directory (host memory: /dev/shm) whatever --cache-mb
    # said, and was kept in the process as well: 2 GiB a machine an epoch on the default
    # task against 256 MiB asked (a review found it).
    entry = 32 * 1024
    cache = ActivationCache(memory_bytes=4 * entry, directory=str(tmp_path / "disk"),
                            shared=str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    for i in range(20):
        cache.put(bytes([i]) * 16, 1, torch.full((entry // 4,), float(i)))
    shm = sum(f.stat().st_size for f in (tmp_path / "shm").iterdir())
    stats = cache.stats
    assert stats.memory_bytes + stats.shared_bytes <= 4 * entry
    assert (stats.memory_bytes, stats.shared_bytes) == (2 * entry, 2 * entry)
    assert entry * 2 <= shm < entry * 3  # two entries (and torch.save's headers)
    assert stats.disk_entries == 18
    for i in range(20):  # every entry is still served
        depth, value = cache.get(bytes([i]) * 16)
        assert depth == 1 and float(value[0]) == i
    cache.close()


def test_a_shared_directory_that_cannot_be_written_ends_the_publishing_not_the_run(tmp_path,
                                                                                 caplog):
    (tmp_path / "file").write_text("")  # a small /dev/shm fills up: torch.save raises
    cache = ActivationCache(memory_bytes=1 << 20, shared=str(tmp_path / "file" / "shm"))
    cache.put(b"k" * 16, 1, torch.ones(8))
    assert "stops publishing its entries there" in caplog.text
    assert cache.shared is None and cache.stats.shared_bytes == 0
    assert cache.get(b"k" * 16)[0] == 1  # kept in the process's own memory
    cache.close()


def test_a_disk_tier_that_fails_costs_recomputing_not_the_run(tmp_path, caplog):
    # torch.save and torch.load raised from the first stage (a full disk, a tmp cleaner),
    # and the other stages waited out the timeout naming it as a lost peer.
    model, layers = _model()
    x = torch.randint(0, 256, (4, 16))
    fresh = frozen_forward(layers, x, frozen=2)
    cache = ActivationCache(memory_bytes=0, directory=str(tmp_path))
    frozen_forward(layers, x, frozen=2, cache=cache)
    assert cache.stats.disk_entries == 4
    first = next(iter(cache.disk.values()))[1]
    first.write_bytes(b"not a tensor")  # damaged: a miss too (UnpicklingError)
    assert cache.get(next(iter(cache.disk))) is None and cache.stats.disk_entries == 3
    shutil.rmtree(cache._dir)  # its files are gone, and so is the directory to write to
    again = frozen_forward(layers, x, frozen=2, cache=cache)
    assert torch.equal(again, fresh)
    assert cache.stats.misses == 8 and cache.stats.hits == 0
    assert "cannot read" in caplog.text and "cannot write to its disk tier" in caplog.text
    assert not cache.spilling and cache.stats.disk_entries == 0 == cache.stats.disk_bytes
    assert torch.equal(frozen_forward(layers, x, frozen=2, cache=cache), fresh)
    cache.close()


def test_float_inputs_of_any_dtype_are_cached_and_told_apart_by_dtype_and_shape():
    # The key went through numpy, which has no bfloat16: a model fed bfloat16 inputs failed.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 8).to(torch.bfloat16)]
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    cache = ActivationCache(memory_bytes=1 << 20)
    fresh = frozen_forward(layers, x, frozen=1)
    assert torch.equal(frozen_forward(layers, x, frozen=1, cache=cache), fresh)
    assert torch.equal(frozen_forward(layers, x, frozen=1, cache=cache), fresh)
    assert (cache.stats.misses, cache.stats.hits) == (4, 4)
    a = torch.zeros(4)
    assert len({ActivationCache.key(a), ActivationCache.key(a.view(2, 2)),
                ActivationCache.key(a.to(torch.int32))}) == 3  # the same bytes, told apart
    cache.close()


def _spill_and_fail() -> None:
    cache = ActivationCache(memory_bytes=0)  # every entry on disk
    cache.put(b"k" * 16, 1, torch.ones(8))
    print("CACHE-DIR", cache._dir, flush=True)
    raise RuntimeError("a step failed")  # the process leaves without closing the cache


@pytest.mark.timeout(60)
def test_a_failed_process_leaves_no_disk_tier_behind(capfd):
    # A process that fails leaves with os._exit and never closes its cache: the disk tier
    # stayed in /tmp (a review found it). Under polytrain launch it is now made in the
    # launcher's work directory, which goes at the end of the run.
    with pytest.raises(polytrain.LaunchError, match="a step failed"):
        spawn(_spill_and_fail, workers=1)
    out = capfd.readouterr().out
    where = Path(out.split("CACHE-DIR ", 1)[1].split()[0])
    assert where.name.startswith("polytrain-cache-") and where.parent.name.startswith(
        "polytrain-")
    assert not where.exists()


@pytest.mark.timeout(60)
def test_a_killed_processs_disk_tier_in_cache_dir_goes_with_the_next_cache_there(tmp_path,
                                                                                  caplog):
    # --cache-dir's disk tier of a killed process stayed, however large, until removed by
    # hand. A process's own directory there names it; the next cache removes those whose
    # process is gone, and leaves those of a live one, of another host (kernel boot) and the
    # user's own.
    killed = subprocess.run(
        [sys.executable, "-c", "import os, torch\n"
         "from polytrain.pipeline.cache import ActivationCache\n"
         f"cache = ActivationCache(memory_bytes=0, directory={str(tmp_path)!r})\n"
         "cache.put(b'k' * 16, 1, torch.ones(8))\n"
         "print(cache._dir, flush=True)\n"
         "os._exit(9)"], capture_output=True, text=True, timeout=50)
    left = Path(killed.stdout.split()[0])
    assert left.parent == tmp_path and any(left.iterdir()), killed.stderr
    elsewhere = tmp_path / left.name.replace(left.name[-8:], "abcdef12")
    shutil.copytree(left, elsewhere)
    marker = elsewhere / ".polytrain-owner"
    marker.write_text(marker.read_text().replace('"boot": "', '"boot": "another-'))
    mine = tmp_path / "polytrain-cache-runs"  # a user's own folder, named like ours
    mine.mkdir()
    live = ActivationCache(memory_bytes=0, directory=str(tmp_path))
    live.put(b"a" * 16, 1, torch.ones(8))
    with caplog.at_level("WARNING"):
        cache = ActivationCache(memory_bytes=0, directory=str(tmp_path))
        cache.put(b"b" * 16, 1, torch.ones(8))
    assert not left.exists()
    assert "removed an AutoCache disk tier of a run whose process (pid " in caplog.text
    assert elsewhere.exists() and mine.exists() and live._dir.exists() and cache._dir.exists()
    live.close()
    cache.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([elsewhere.name, mine.name])


def test_the_cache_is_counted_on_for_samples_it_met_since_it_began():
    # Epochs of 10 steps, caching from step 25: epoch 2 (steps 20-29) and epoch 3 meet
    # samples last seen in epochs 1 and 2; of epoch 2's steps, 25-29 come after caching
    # began, so half of epoch 3's samples are cached, and all of epoch 4's.
    def hits(start, steps, **kw):
        return expected_hits(start, steps, since=25, epoch_steps=10, **kw)

    assert hits(25, 5) == 0.0                     # still the epoch caching began in
    assert hits(30, 10) == pytest.approx(0.5)
    assert hits(40, 10) == pytest.approx(1.0)
    assert hits(30, 20) == pytest.approx(0.75)
    assert hits(40, 10, same_cache=0.5) == pytest.approx(0.5)  # half land on another cache
    assert expected_hits(40, 10, since=None, epoch_steps=10) == 0.0  # not caching
    assert expected_hits(40, 10, since=25, epoch_steps=None) == 0.0  # no epochs
