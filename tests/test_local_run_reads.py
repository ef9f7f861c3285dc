"""Run batches on local files: io_uring reads of strided runs, preadv scatter reads into strided arrays.

Every read is checked against the file's bytes; neighbours of the destination are
checked untouched; counts of bytes and calls come from the real reads.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, List, Tuple

import numpy as np
import pytest
from helpers.files import random_file
from helpers.forking import fork_and_check

from shardckpt.errors import DataLossError
from shardckpt.format.bundle_reader import _scatter_runs
from shardckpt.storage import uring
from shardckpt.storage.base import RunBatch
from shardckpt.storage.local import LocalFileSystem

SIZE = 4 << 20


@pytest.fixture()
def data(tmp_path: Path) -> Tuple[str, np.ndarray]:
    return random_file(tmp_path, SIZE, 7)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_ring_reads_exactly_the_runs_or_says_it_cannot(data: Tuple[str, np.ndarray]) -> None:
    """3000 runs of 8 KiB, every other 8 KiB of the file (three submissions of up to 1024): each
    lands where it is asked to, nothing else is written, each result is the run's length."""
    path, raw = data
    rb, n = 8192, 3000
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = (np.arange(n, dtype=np.int64) * 2 * rb) % (SIZE - rb)
        dest = np.full(n * rb + 64, 0xEE, dtype=np.uint8)
        addresses = dest.ctypes.data + 32 + np.arange(n, dtype=np.uint64) * rb
        got = uring.read_runs(fd, offsets, addresses, rb)
        if not uring.available():  # no io_uring here: nothing read, the caller reads another way
            assert got is None and (dest == 0xEE).all()
            _fallback_reads_the_runs(path, raw, np.unique(offsets), rb)
            return
        assert got is not None and (got == rb).all()
        want = raw[offsets[:, None] + np.arange(rb)].reshape(-1)
        assert np.array_equal(dest[32:32 + n * rb], want)
        assert (dest[:32] == 0xEE).all() and (dest[32 + n * rb:] == 0xEE).all()
        # at the end of the file: the result says how much was there (the caller finishes or raises)
        tail = uring.read_runs(fd, np.array([SIZE - 100], dtype=np.int64), np.array([dest.ctypes.data],
                                                                                    dtype=np.uint64), rb)
        assert tail is not None and int(tail[0]) == 100
        assert np.array_equal(dest[:100], raw[SIZE - 100:])
        bad = uring.read_runs(10**6, offsets[:2], addresses[:2], rb)  # not a descriptor
        assert bad is not None and (bad < 0).all()
    finally:
        os.close(fd)


def _fallback_reads_the_runs(path: str, raw: np.ndarray, offsets: np.ndarray, rb: int) -> None:
    """Where io_uring is refused: the way callers read such runs instead (one read call each) gives the
    exact bytes, and the ring is not checked here: said loudly."""
    fs = LocalFileSystem(ring_runs=True, map_runs=False)
    fd = fs.open_read(path)
    try:
        dest = np.zeros(len(offsets) * rb, dtype=np.uint8)
        fs.pread_batch(fd, RunBatch(offsets, rb, memoryview(dest)), path)
    finally:
        fs.close(fd)
    assert np.array_equal(dest.reshape(-1, rb), raw[offsets[:, None] + np.arange(rb)]) and fs.ring_bytes == 0
    warnings.warn("io_uring is not available here (kernel, seccomp, kernel.io_uring_disabled or "
                  "SHARDCKPT_IO_URING=0): NOT checked here: reads through the ring; checked instead: the read "
                  "calls that replace it", stacklevel=2)


@pytest.mark.parametrize("ring", [True, False])
def test_strided_run_batch_reads_exact_bytes_with_or_without_ring(data: Tuple[str, np.ndarray], ring: bool) -> None:
    """Half of every 16 KiB row (a resharded load's reads): the same bytes with io_uring and with one
    ``preadv`` per run (no maps); ``ring_bytes`` counts the ring's bytes (``rchar`` does not see
    them), and the two together are exactly the bytes asked for."""
    path, raw = data
    rb, n = 8192, SIZE // 16384
    fs = LocalFileSystem(ring_runs=ring, map_runs=False)
    fd = fs.open_read(path)
    try:
        offsets = np.arange(n, dtype=np.int64) * 16384 + 8192
        dest = np.zeros(n * rb, dtype=np.uint8)
        before = _rchar()
        fs.pread_batch(fd, RunBatch(offsets, rb, memoryview(dest)), path)
        read = _rchar() - before
    finally:
        fs.close(fd)
    assert np.array_equal(dest.reshape(n, rb), raw.reshape(n, 16384)[:, 8192:])
    if ring and uring.available():
        assert fs.ring_bytes == n * rb
        assert read < n * rb // 2  # (rchar: the ring's reads are not counted there)
    else:
        if ring:
            warnings.warn("io_uring is not available here: the ring case read with one call per run (checked); "
                          "NOT checked here: reads through the ring", stacklevel=1)
        assert fs.ring_bytes == 0
        assert n * rb <= read < n * rb + 4096  # (+ the read of /proc/self/io itself)


def test_ring_runs_past_the_end_of_the_file_raise(data: Tuple[str, np.ndarray]) -> None:
    """A run that ends past the end of the file is finished by an ordinary read, which raises."""
    path, _ = data
    fs = LocalFileSystem()
    fd = fs.open_read(path)
    try:
        offsets = np.arange(16, dtype=np.int64) * 8192 + (SIZE - 15 * 8192 - 10)
        dest = np.zeros(16 * 8192, dtype=np.uint8)
        with pytest.raises(DataLossError, match="unexpected end of file"):
            fs.pread_batch(fd, RunBatch(offsets, 8192, memoryview(dest)), path)
    finally:
        fs.close(fd)


def _parent_reads(path: str) -> None:
    fs = LocalFileSystem(map_runs=False)  # the ring (maps would serve these half-dense runs)
    fd = fs.open_read(path)
    dest = np.zeros(64 * 4096, dtype=np.uint8)
    fs.pread_batch(fd, RunBatch(np.arange(64, dtype=np.int64) * 8192, 4096, memoryview(dest)), path)
    fs.close(fd)


def _child_reads(path: str) -> int:
    raw = np.fromfile(path, dtype=np.uint8)
    fs = LocalFileSystem(map_runs=False)
    fd = fs.open_read(path)
    dest = np.zeros(64 * 4096, dtype=np.uint8)
    offsets = np.arange(64, dtype=np.int64) * 8192
    fs.pread_batch(fd, RunBatch(offsets, 4096, memoryview(dest)), path)
    if not np.array_equal(dest.reshape(64, 4096), raw[:64 * 8192].reshape(64, 8192)[:, :4096]):
        return 2
    ring = getattr(uring._local, "ring", None)
    ring_pid = ring.pid if ring is not None else None
    if ring_pid not in (None, os.getpid()) or (ring_pid is None) != (not uring.available()):
        return 3  # the parent's ring was used, or no ring where io_uring exists
    return 0


def test_a_forked_child_reads_through_a_ring_of_its_own(data: Tuple[str, np.ndarray]) -> None:
    """The parent's ring is never used by a forked child (their rings would be shared memory).

    The parent and its fork run in a spawned interpreter (``helpers.forking``): nothing but
    shardckpt has started threads there."""
    path, _ = data
    code = fork_and_check(_parent_reads, _child_reads, path)
    assert code != 124, "the forked child hung"
    assert code == 0, {2: "wrong bytes", 3: "the parent's ring (or none)"}.get(code, code)


def test_scatter_read_of_one_file_range_into_a_strided_array(data: Tuple[str, np.ndarray],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows 100..1123 of a stored (2048, 256) block of 4-byte values into columns 256..511 of a (1024, 1024) array:
    one range of the file, read by ``preadv`` calls of up to IOV_MAX row buffers (here 1024 rows: one
    call), exactly the range's bytes, the other columns untouched, no temporary."""
    path, raw = data
    offset = 4096
    block = raw[offset:offset + 2048 * 256 * 4].view(np.uint32).reshape(2048, 256)
    full = np.full((1024, 1024), 0xDEADBEEF, dtype=np.uint32)
    dest = full[:, 256:512]
    batch = _scatter_runs(offset, (2048, 256), ((100, 1124), (0, 256)), 4, dest)
    assert batch is not None and len(batch) == 1024 and batch.run_bytes == 1024
    calls: List[int] = []
    real = os.preadv

    def counted(fd: int, buffers: Any, at: int, *rest: Any) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, at, *rest)

    fs = LocalFileSystem()
    fd = fs.open_read(path)
    monkeypatch.setattr(os, "preadv", counted)
    try:
        before = _rchar()
        fs.pread_batch(fd, batch, path)
        read = _rchar() - before
    finally:
        monkeypatch.undo()
        fs.close(fd)
    assert np.array_equal(dest, block[100:1124])
    assert (full[:, :256] == 0xDEADBEEF).all() and (full[:, 512:] == 0xDEADBEEF).all()
    assert calls == [1024]
    assert 1024 * 1024 <= read < 1024 * 1024 + 4096  # (+ the read of /proc/self/io itself)


def test_scatter_reads_of_boxes_of_three_dimensions(data: Tuple[str, np.ndarray]) -> None:
    """Sub-boxes of a stored (8, 64, 1024) block into strided views: pieces cut where either side
    has a gap, every value in place, nothing around them written."""
    path, raw = data
    offset = 64
    block = raw[offset:offset + 8 * 64 * 1024 * 4].view(np.uint32).reshape(8, 64, 1024)
    fs = LocalFileSystem()
    fd = fs.open_read(path)
    try:
        for local, shape, where in [
            (((1, 5), (0, 64), (0, 1024)), (4, 128, 1024), (slice(None), slice(64, 128), slice(None))),
            (((1, 5), (3, 40), (0, 1024)), (4, 80, 2048), (slice(None), slice(3, 40), slice(1024, 2048))),
            (((0, 8), (10, 20), (0, 1024)), (8, 10, 3072), (slice(None), slice(None), slice(1024, 2048))),
        ]:
            full = np.full(shape, 0xDEADBEEF, dtype=np.uint32)
            dest = full[where]
            batch = _scatter_runs(offset, (8, 64, 1024), local, 4, dest)  # type: ignore[arg-type]
            assert batch is not None
            fs.pread_batch(fd, batch, path)
            assert np.array_equal(dest, block[tuple(slice(a, b) for a, b in local)])
            mask = np.ones(shape, dtype=bool)
            mask[where] = False
            assert (full[mask] == 0xDEADBEEF).all()
    finally:
        fs.close(fd)
    # pieces too small to be worth a call each: the caller reads through a temporary instead
    narrow = np.zeros((64, 2048), dtype=np.float32)[:, :16]
    assert _scatter_runs(0, (64, 1024), ((0, 64), (0, 16)), 4, narrow) is None


def test_a_batch_whose_runs_do_not_fit_its_destination_is_refused(data: Tuple[str, np.ndarray]) -> None:
    """Runs are read by address (io_uring): a batch naming bytes outside its destination reads nothing."""
    path, _ = data
    fs = LocalFileSystem()
    fd = fs.open_read(path)
    dest = np.zeros(16 * 4096 + 100, dtype=np.uint8)
    try:
        with pytest.raises(ValueError, match="do not fit"):
            fs.pread_batch(fd, RunBatch(np.arange(16, dtype=np.int64) * 8192, 8192, memoryview(dest)), path)
        with pytest.raises(ValueError, match="do not fit"):
            fs.pread_batch(fd, RunBatch(np.arange(16, dtype=np.int64) * 8192, 4096, memoryview(dest), None,
                                        np.arange(16, dtype=np.int64) * 4096 + 200), path)
    finally:
        fs.close(fd)
    assert (dest == 0).all()
