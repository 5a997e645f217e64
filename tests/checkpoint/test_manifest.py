"""Checkpoint directories on disk: manifests, atomic commits, damage found on load."""

from __future__ import annotations

import json

import pytest
import torch

from polytrain.checkpoint import CheckpointError, newest, resolve, verify
from polytrain.checkpoint.manifest import commit, prune, temporary_dir, write_manifest


def make(root, step, payload=b"x" * 1000):
    tmp = temporary_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "model.pt").write_bytes(payload)
    torch.save({"a": torch.arange(4)}, tmp / "worker-0.pt")
    write_manifest(tmp, {"step": step, "workers": 1})
    final = root / f"step-{step}"
    commit(tmp, final)
    return final


def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path):
    ckpt = make(tmp_path, 5)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["format"] == "polytrain.checkpoint/1"
    assert sorted(manifest["files"]) == ["model.pt", "worker-0.pt"]
    assert manifest["files"]["model.pt"]["bytes"] == 1000
    assert len(manifest["files"]["model.pt"]["sha256"]) == 64
    assert verify(ckpt)["step"] == 5
    assert not temporary_dir(tmp_path, 5).exists()


def test_a_truncated_file_is_found_and_the_newest_whole_checkpoint_is_used(tmp_path):
    make(tmp_path, 2)
    bad = make(tmp_path, 4)
    with open(bad / "model.pt", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"model.pt has 10 bytes, the manifest says 1000 "
                                              r"\(truncated\?\)"):
        verify(bad)
    with pytest.raises(CheckpointError, match="damaged"):
        resolve(bad)  # asked for by name: refused, not replaced by another
    where, skipped = resolve(tmp_path)
    assert where == tmp_path / "step-2" and len(skipped) == 1 and "step-4" in skipped[0]
    assert newest(tmp_path) == tmp_path / "step-2"


def test_resume_reads_no_checkpoint_older_than_the_one_it_takes(tmp_path, monkeypatch):
    from polytrain.checkpoint import manifest

    for step in (2, 4, 6, 8):
        make(tmp_path, step)
    with open(tmp_path / "step-8" / "model.pt", "r+b") as f:
        f.truncate(10)
    read = []
    real = manifest.verify
    monkeypatch.setattr(manifest, "verify", lambda d: read.append(d.name) or real(d))
    where, skipped = resolve(tmp_path)
    assert where == tmp_path / "step-6" and len(skipped) == 1 and "step-8" in skipped[0]
    assert read == ["step-8", "step-6"]  # not every checkpoint of the run


def test_a_manifest_without_its_fields_is_a_damaged_checkpoint(tmp_path):
    # An edited manifest raised KeyError from deep in resume.
    ckpt = make(tmp_path, 2)
    path = ckpt / "manifest.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k != "files"}))
    with pytest.raises(CheckpointError, match=r"step-2 is damaged: its manifest.json has no "
                                              r"files.*HINT: resume from another checkpoint"):
        resolve(ckpt)


def test_a_corrupted_byte_is_found(tmp_path):
    ckpt = make(tmp_path, 3)
    data = bytearray((ckpt / "model.pt").read_bytes())
    data[500] ^= 1
    (ckpt / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 differs"):
        verify(ckpt)


def test_a_partial_checkpoint_is_never_taken_for_a_whole_one(tmp_path):
    make(tmp_path, 2)
    partial = temporary_dir(tmp_path, 4)  # a crash while writing step 4
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"half")
    assert resolve(tmp_path)[0] == tmp_path / "step-2"
    no_manifest = tmp_path / "step-6"  # a step directory without its manifest
    no_manifest.mkdir()
    assert resolve(tmp_path)[0] == tmp_path / "step-2"
    with pytest.raises(CheckpointError, match="no manifest.json"):
        resolve(no_manifest)


def test_no_checkpoint_in_the_resume_directory_is_one_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"no whole checkpoint in .*HINT: .*--checkpoint"
                                              r"-every N"):
        resolve(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve(tmp_path / "missing")


def test_a_new_checkpoint_of_the_same_step_replaces_the_old_only_when_whole(tmp_path):
    make(tmp_path, 2, b"old" * 10)
    make(tmp_path, 2, b"new" * 10)
    assert (tmp_path / "step-2" / "model.pt").read_bytes() == b"new" * 10
    assert verify(tmp_path / "step-2")
    assert [p.name for p in tmp_path.iterdir()] == ["step-2"]


def test_keep_prunes_the_oldest_whole_checkpoints(tmp_path):
    for s in (1, 2, 3, 4):
        make(tmp_path, s)
    removed = prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step-1", "step-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
