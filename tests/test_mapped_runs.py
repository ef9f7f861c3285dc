"""Run batches copied out of memory maps (``storage/mapped.py``): which batches go through maps by
default, exact bytes in place, and what happens when the kernel will not populate a map.

The maps, files and reads are real; only where a disk error cannot be made to happen on demand
is the C library's ``madvise`` wrapped so that populating fails the way a disk error makes it
fail (an error code), to show the read calls then serve the batch.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Tuple

import numpy as np
import pytest
from helpers.files import random_file

from shardckpt.storage import mapped, uring
from shardckpt.storage.base import RunBatch
from shardckpt.storage.local import LocalFileSystem

SIZE = 8 << 20


@pytest.fixture()
def data(tmp_path: Path) -> Tuple[str, np.ndarray]:
    return random_file(tmp_path, SIZE, 11)


def _read(fs: LocalFileSystem, path: str, offsets: np.ndarray, rb: int) -> np.ndarray:
    dest = np.full(len(offsets) * rb + 64, 0xEE, dtype=np.uint8)
    fd = fs.open_read(path)
    try:
        fs.pread_batch(fd, RunBatch(offsets, rb, memoryview(dest[32:32 + len(offsets) * rb])), path)
    finally:
        fs.close(fd)
    assert (dest[:32] == 0xEE).all() and (dest[32 + len(offsets) * rb:] == 0xEE).all()  # nothing around
    return dest[32:32 + len(offsets) * rb]


def _want(raw: np.ndarray, offsets: np.ndarray, rb: int) -> np.ndarray:
    return raw[offsets[:, None] + np.arange(rb)].reshape(-1)


def test_maps_serve_dense_strided_batches_by_default(data: Tuple[str, np.ndarray]) -> None:
    """Half of every 16 KiB row, 2112 bytes off the pages (a resharded load's runs): out of maps,
    ``mapped_bytes`` exactly the runs' bytes, read calls and the ring not used."""
    path, raw = data
    assert mapped.available()  # Linux, not turned off: what the default below relies on
    offsets = np.arange(SIZE // 16384 - 1, dtype=np.int64) * 16384 + 2112
    fs = LocalFileSystem()
    got = _read(fs, path, offsets, 8192)
    assert np.array_equal(got, _want(raw, offsets, 8192))
    assert fs.mapped_bytes == len(offsets) * 8192 and fs.ring_bytes == 0


@pytest.mark.parametrize("case", ["sparse", "contiguous", "few", "small runs", "switched off", "env off"])
def test_other_batches_keep_read_calls(data: Tuple[str, np.ndarray], case: str, monkeypatch: Any) -> None:
    """Runs filling less than half their span (a narrow column: maps would fault in the rest), one
    range of the file (``preadv`` serves it in few calls), fewer than 8 runs, runs below a page,
    ``map_runs=False`` and ``SHARDCKPT_MAP_READS=0``: read calls, nothing mapped, bytes exact."""
    path, raw = data
    rb = 8192
    offsets = np.arange(200, dtype=np.int64) * 16384 + 2112
    kwargs: dict = {}
    if case == "sparse":
        offsets = np.arange(100, dtype=np.int64) * 65536 + 100
    elif case == "contiguous":
        offsets = np.arange(200, dtype=np.int64) * rb + 4096
    elif case == "few":
        offsets = offsets[:7]
    elif case == "small runs":
        rb = 3000
    elif case == "switched off":
        kwargs["map_runs"] = False
    else:
        monkeypatch.setenv("SHARDCKPT_MAP_READS", "0")
    fs = LocalFileSystem(**kwargs)
    got = _read(fs, path, offsets, rb)
    assert np.array_equal(got, _want(raw, offsets, rb))
    assert fs.mapped_bytes == 0
    if case in ("sparse", "switched off", "env off") and uring.available():
        assert fs.ring_bytes == len(offsets) * rb  # the strided runs went through io_uring instead


class _FailingPopulate:
    """The C library, except that ``madvise(MADV_POPULATE_READ)`` fails with ``errno`` (as a disk error
    found while populating makes it fail, or a kernel before 5.14 that does not know the advice)."""

    def __init__(self, libc: Any, errno: int) -> None:
        self._libc = libc
        self.errno = errno
        self.failed = 0
        self.mmap = libc.mmap
        self.munmap = libc.munmap

    def madvise(self, addr: int, length: int, advice: int) -> int:
        if advice == 22:
            self.failed += 1
            ctypes.set_errno(self.errno)
            return -1
        return int(self._libc.madvise(addr, length, advice))


@pytest.mark.parametrize("errno", [5, 14], ids=["EIO", "EFAULT"])
def test_a_failed_populate_leaves_the_batch_to_read_calls(data: Tuple[str, np.ndarray], errno: int,
                                                          monkeypatch: Any) -> None:
    """Populating fails (a disk error, a file cut short): nothing is copied out of the map, the read
    calls serve the batch (and would raise the usual error); the next batch tries maps again."""
    path, raw = data
    libc = mapped.libc()
    fake = _FailingPopulate(libc, errno)
    monkeypatch.setitem(mapped._state, "libc", fake)
    offsets = np.arange(300, dtype=np.int64) * 16384 + 2112
    fs = LocalFileSystem()
    for _ in range(2):
        got = _read(fs, path, offsets, 8192)
        assert np.array_equal(got, _want(raw, offsets, 8192))
    assert fake.failed == 2 and fs.mapped_bytes == 0
    assert mapped.can_populate() and mapped.available()


def test_a_kernel_without_populate_keeps_read_calls_unless_maps_are_asked_for(
        data: Tuple[str, np.ndarray], monkeypatch: Any) -> None:
    """``EINVAL`` (Linux before 5.14): the default stops mapping (no way to learn of a disk error but
    ``SIGBUS``); ``map_runs=True`` still copies out of maps, without populating."""
    path, raw = data
    fake = _FailingPopulate(mapped.libc(), 22)
    monkeypatch.setitem(mapped._state, "libc", fake)
    monkeypatch.setitem(mapped._state, "populate", None)
    offsets = np.arange(300, dtype=np.int64) * 16384 + 2112
    fs = LocalFileSystem()
    assert np.array_equal(_read(fs, path, offsets, 8192), _want(raw, offsets, 8192))
    assert fake.failed == 1 and not mapped.can_populate() and not mapped.available()
    assert np.array_equal(_read(fs, path, offsets, 8192), _want(raw, offsets, 8192))
    assert fake.failed == 1 and fs.mapped_bytes == 0  # not asked again
    forced = LocalFileSystem(map_runs=True)
    assert np.array_equal(_read(forced, path, offsets, 8192), _want(raw, offsets, 8192))
    assert forced.mapped_bytes == len(offsets) * 8192 and fake.failed == 1


def test_a_file_cut_short_is_a_data_loss_error_not_a_signal(data: Tuple[str, np.ndarray]) -> None:
    """The data file truncated after it was opened (someone else's doing): the batch's runs past the
    new end are not mapped (a copy there would be ``SIGBUS``); the read calls raise, naming the file."""
    from shardckpt.errors import DataLossError

    path, _ = data
    fs = LocalFileSystem()
    fd = fs.open_read(path)
    try:
        os.truncate(path, SIZE // 2)
        offsets = np.arange(SIZE // 16384 - 1, dtype=np.int64) * 16384 + 2112
        dest = np.zeros(len(offsets) * 8192, dtype=np.uint8)
        with pytest.raises(DataLossError, match="end of file") as err:
            fs.pread_batch(fd, RunBatch(offsets, 8192, memoryview(dest)), path)
        assert path in str(err.value)
    finally:
        fs.close(fd)
    assert fs.mapped_bytes == 0


def test_windows_and_huge_pages_give_the_same_bytes(data: Tuple[str, np.ndarray], monkeypatch: Any) -> None:
    """A batch spread over several windows, with and without ``MADV_HUGEPAGE``, evenly and unevenly
    spaced: the same bytes as the file's."""
    path, raw = data
    monkeypatch.setattr(mapped, "WINDOW", 3 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offsets in (np.arange(500, dtype=np.int64) * 16000 + 7,
                        np.cumsum(np.random.default_rng(3).integers(8192, 20000, size=400)).astype(np.int64)):
            for huge in (True, False):
                dest = np.zeros((len(offsets), 8192), dtype=np.uint8)
                assert mapped.copy_runs(fd, offsets, 8192, dest, huge=huge) == dest.size
                assert np.array_equal(dest.reshape(-1), _want(raw, offsets, 8192))
    finally:
        os.close(fd)
