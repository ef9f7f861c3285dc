"""The typed object-store interface (issue 27): ``ObjectStore`` declares what object stores add,
wrappers forward every member (so a fault can be injected at any of them, the index PUT
included), and checkpoint deletion goes through ``FileSystem`` on every store.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import s3fs  # noqa: F401 - the optional extra; the test extra installs it (missing = failure, not a skip)

import shardckpt
from shardckpt.errors import ShardckptError, StorageError
from shardckpt.saving.commit import (
    IndexLastCommitter,
    InPlaceFilesCommitter,
    RenameCommitter,
    RenameFilesCommitter,
    committer_for,
    files_committer_for,
)
from shardckpt.storage import ObjectStore, get_fs
from shardckpt.storage.fsspec_fs import FsspecFileSystem
from shardckpt.storage.local import local_fs
from shardckpt.storage.location import Location
from shardckpt.storage.registry import mounted
from shardckpt.storage.wrappers import FaultInjectingFileSystem, FileSystemWrapper, RecordingFileSystem

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from s3_faults import s3_fs  # noqa: E402  (tests/helpers)


def _module(values: Dict[str, np.ndarray]) -> Any:
    model = shardckpt.Module()
    for name, value in values.items():
        setattr(model, name, shardckpt.Variable(value.copy(), name=name))
    return model


def _values(seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((64, 32)).astype(np.float32) for i in range(4)}


def test_a_fault_at_the_index_put_fails_the_save_and_keeps_the_previous_checkpoint(s3_server: Any, s3dir: str) -> None:
    """The index PUT of an index-last commit goes through the wrapper: a fault injected there fails the
    save, and the previous checkpoint stays latest and whole (before, the PUT bypassed the wrapper)."""
    old, new = _values(1), _values(2)
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=_module(old)), s3dir, max_to_keep=2)
    first = manager.save()
    assert first is not None
    faulty = FaultInjectingFileSystem(s3_fs())
    assert isinstance(faulty, ObjectStore)
    fault = faulty.fail("put", r"/ckpt-2\.index$", StorageError("injected: the index PUT failed"))
    model = _module(new)
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), s3dir, max_to_keep=2)
    with mounted(faulty, "s3"):
        with pytest.raises(ShardckptError, match="injected: the index PUT failed"):
            manager.save(checkpoint_number=2)
    assert fault.hits == 1
    fs = get_fs(s3dir)
    assert not fs.exists(f"{s3dir}/ckpt-2.index")
    assert shardckpt.latest_checkpoint(s3dir) == first
    restored = _module({k: np.zeros_like(v) for k, v in old.items()})
    shardckpt.Checkpoint(model=restored).restore(first).assert_consumed()
    for name, value in old.items():
        np.testing.assert_array_equal(getattr(restored, name).numpy(), value)
    # the failed save's data objects were removed (conditional deletes of its own objects)
    assert not [n for n in fs.listdir(s3dir) if n.startswith("ckpt-2.")], fs.listdir(s3dir)


def test_wrappers_of_object_stores_are_object_stores_and_pick_the_same_committer() -> None:
    store = FsspecFileSystem.for_scheme("memory", {})
    for kind in (FileSystemWrapper, FaultInjectingFileSystem, RecordingFileSystem):
        wrapper = kind(store)
        assert isinstance(wrapper, kind) and isinstance(wrapper, ObjectStore)
        assert type(committer_for(Location(wrapper, "memory://bucket/ck"))) is IndexLastCommitter
        assert isinstance(files_committer_for(wrapper, "memory://bucket/out", "x"), InPlaceFilesCommitter)
    local = FaultInjectingFileSystem(local_fs)
    assert not isinstance(local, ObjectStore)
    assert type(committer_for(Location(local, "/tmp/ck"))) is RenameCommitter


def test_files_committer_stages_and_renames_locally(tmp_path: Path) -> None:
    committer = files_committer_for(local_fs, str(tmp_path), "out")
    assert isinstance(committer, RenameFilesCommitter)
    committer.open("a.bin").write(b"abc")
    assert not (tmp_path / "a.bin").exists()
    assert committer.commit([("index.json", b"{}")]) == [str(tmp_path / "a.bin"), str(tmp_path / "index.json")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "index.json"]


def test_retention_deletes_through_the_filesystem(tmp_path: Path) -> None:
    """The manager's deletions go through the store (a mounted wrapper sees each), local disks included."""
    recorder = RecordingFileSystem(local_fs)
    with mounted(recorder):
        manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=_module(_values(3))), str(tmp_path),
                                              max_to_keep=1)
        manager.save()
        manager.save()
    removed = [path for kind, path, _ in recorder.ops if kind == "remove"]
    doomed = [p for p in removed if Path(p).name.startswith("ckpt-1.")]
    assert str(tmp_path / "ckpt-1.index") in doomed
    assert any(".data-" in p for p in doomed), removed
    assert doomed.index(str(tmp_path / "ckpt-1.index")) < min(i for i, p in enumerate(doomed) if ".data-" in p)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ckpt-1.")]
