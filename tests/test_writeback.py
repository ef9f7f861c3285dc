"""Write-behind of durable saves (storage/writeback.py): hints only, never in place of an fsync."""

from __future__ import annotations

import os
import sys
from typing import Any, List, Tuple

import numpy as np
import pytest
from helpers.forking import fork_and_check

from shardckpt import save_tensors
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.bundle_writer import BundleWriter
from shardckpt.storage import writeback
from shardckpt.storage.local import local_fs
from shardckpt.storage.location import Location
from shardckpt.storage.registry import mounted
from shardckpt.storage.wrappers import FileSystemWrapper, RecordingFileSystem

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")


class HintLog(FileSystemWrapper):
    """The local filesystem, logging write-behind hints, writes and fsyncs in order."""

    def __init__(self) -> None:
        super().__init__(local_fs)
        self.log: List[Tuple[str, str, Any]] = []

    def write_all(self, handle: Any, buf: memoryview, path: str = "") -> None:
        super().write_all(handle, buf, path)
        self.log.append(("write", path, len(buf)))

    def start_writeback(self, handle: Any, offset: int, length: int, path: str = "") -> None:
        super().start_writeback(handle, offset, length, path)
        self.log.append(("hint", path, (offset, length)))

    def fsync(self, handle: Any, path: str = "") -> None:
        super().fsync(handle, path)
        self.log.append(("fsync", path, None))


@linux_only
def test_sync_file_range_is_used_here_and_drained_before_close(tmp_path):
    assert writeback.available()
    path = str(tmp_path / "f")
    fd = local_fs.open_write(path)
    data = np.arange(1 << 20, dtype=np.uint8)
    local_fs.write_all(fd, memoryview(data), path)
    local_fs.start_writeback(fd, 0, data.nbytes, path)
    assert fd in writeback._pending
    local_fs.close(fd)  # waits for the request: none may outlive the descriptor
    assert fd not in writeback._pending
    assert writeback.available()  # the kernel took the request (a refusal turns write-behind off)
    with open(path, "rb") as f:
        assert f.read() == data.tobytes()


def test_a_durable_bundle_hints_each_written_step_before_its_fsync(tmp_path):
    fs = HintLog()
    prefix = str(tmp_path / "ck")
    big = np.arange(10 << 20, dtype=np.float32)  # 40 MiB: hints at 16 and 32 MiB
    small = np.arange(5, dtype=np.int64)
    with BundleWriter(prefix, fsync=True, fs=fs) as w:
        w.add("big", big)
        w.add("small", small)
    data_events = [e for e in fs.log if ".data-" in e[1]]
    hints = [e[2] for e in data_events if e[0] == "hint"]
    assert hints == [(0, 16 << 20), (16 << 20, 16 << 20)]
    kinds = [e[0] for e in data_events]
    assert kinds[-1] == "fsync" and kinds.count("fsync") == 1  # the fsync still comes, after every write
    written = 0
    for kind, _, extra in data_events:  # a hint covers only bytes already written
        if kind == "write":
            written += extra
        elif kind == "hint":
            assert extra[0] + extra[1] <= written
    reader = BundleReader(Location.of(prefix))
    np.testing.assert_array_equal(reader.read("big"), big)
    np.testing.assert_array_equal(reader.read("small"), small)


def test_no_hints_without_fsync(tmp_path):
    fs = HintLog()
    with BundleWriter(str(tmp_path / "ck"), fsync=False, fs=fs) as w:
        w.add("big", np.zeros(10 << 20, np.float32))
    assert not [e for e in fs.log if e[0] in ("hint", "fsync")]


def test_a_save_fsyncs_every_data_file_before_the_commit_with_write_behind_on(tmp_path):
    recorder = RecordingFileSystem(local_fs)
    prefix = str(tmp_path / "model")
    tensors = {f"t{i}": np.full((3 << 20,), i, np.float32) for i in range(4)}  # 48 MiB in all
    with mounted(recorder):
        save_tensors(prefix, tensors)
    ops = recorder.ops
    commit = max(i for i, (kind, path, extra) in enumerate(ops)
                 if kind == "rename" and str(extra).endswith("model.index"))
    data_files = [path for kind, path, _ in ops if kind == "create" and "part-" in path and ".data-" in path]
    assert data_files
    for path in data_files:
        assert any(kind == "fsync" and p == path for kind, p, _ in ops[:commit])
    reader = BundleReader(Location.of(prefix))
    for key, value in tensors.items():
        np.testing.assert_array_equal(reader.read(key), value)


@linux_only
def test_a_refused_hint_turns_write_behind_off_and_the_save_still_succeeds(tmp_path, monkeypatch):
    r, w = os.pipe()  # sync_file_range refuses pipes (ESPIPE)
    try:
        monkeypatch.setattr(writeback, "_disabled", False)
        writeback.start(w, 0, 1)
        writeback.drain(w)
        assert not writeback.available()
    finally:
        os.close(r)
        os.close(w)
    prefix = str(tmp_path / "ck")
    save_tensors(prefix, {"a": np.arange(5 << 20, dtype=np.float32)})
    np.testing.assert_array_equal(BundleReader(Location.of(prefix)).read("a"), np.arange(5 << 20, dtype=np.float32))


def _parent_hints_write_behind(folder: str) -> None:
    data = np.arange(1 << 20, dtype=np.uint8)
    path = folder + "/parent"
    fd = local_fs.open_write(path)
    local_fs.write_all(fd, memoryview(data), path)
    local_fs.start_writeback(fd, 0, data.nbytes, path)  # the helper thread exists now
    local_fs.close(fd)


def _child_hints_write_behind(folder: str) -> int:
    # the child's requests must run (the parent's helper thread is not here)
    data = np.arange(1 << 20, dtype=np.uint8)
    child = folder + "/child"
    cfd = local_fs.open_write(child)
    local_fs.write_all(cfd, memoryview(data), child)
    local_fs.start_writeback(cfd, 0, data.nbytes, child)
    local_fs.fsync(cfd, child)
    local_fs.close(cfd)
    return 0


@linux_only
def test_a_forked_child_starts_write_behind_afresh(tmp_path):
    code = fork_and_check(_parent_hints_write_behind, _child_hints_write_behind, str(tmp_path), timeout=30)
    assert code != 124, "the forked child hung on write-behind"
    assert code == 0
    with open(str(tmp_path / "child"), "rb") as f:
        assert f.read() == np.arange(1 << 20, dtype=np.uint8).tobytes()
