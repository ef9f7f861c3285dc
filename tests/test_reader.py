"""The read side: CRC combine, read sessions, whole entries read on several threads, pread_batch,
and readers that see the checkpoint they opened (or say it was replaced) — locally and on S3."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from helpers.files import flip_byte as _flip

import shardckpt
from shardckpt.errors import CheckpointReplacedError, DataLossError
from shardckpt.format import bundle_reader as br
from shardckpt.format import crc
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.base import FileSystem
from shardckpt.storage.local import LocalFileSystem
from shardckpt.storage.location import Location

DATA = ".data-00000-of-00001"


# -- CRC combine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("len_a,len_b", [(0, 0), (0, 7), (7, 0), (1, 1), (3, 4096), (1 << 20, 12345),
                                         (100, (2 << 20) + 3)])
def test_crc32c_combine_equals_crc_of_the_concatenation(len_a: int, len_b: int) -> None:
    a, b = os.urandom(len_a), os.urandom(len_b)
    assert crc.combine(crc.value(a), crc.value(b), len_b) == crc.value(a + b)


def test_crc32c_combine_of_many_pieces_in_order() -> None:
    data = os.urandom(3 << 20)
    cuts = sorted({0, len(data), *np.random.default_rng(1).integers(0, len(data), 40).tolist()})
    total = 0
    for a, b in zip(cuts, cuts[1:]):
        total = crc.combine(total, crc.value(data[a:b]), b - a)
    assert total == crc.value(data)
    assert crc.combine(crc.value(b"ab"), crc.value(b"c"), 1) != crc.combine(crc.value(b"ac"), crc.value(b"b"), 1)


def test_crc32c_combine_through_byte_tables_equals_the_bit_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A length combined often gets byte tables (a restore's pieces share a few lengths): same values."""
    # the tables are process-wide and capped at 64 lengths: start from none, whatever ran before
    monkeypatch.setattr(crc, "_TABLES", {})
    monkeypatch.setattr(crc, "_USES", {})
    rng = np.random.default_rng(2)
    for length in (1, 4096, 3 << 20, 12345):
        for _ in range(crc._TABLE_AFTER + 4):  # past the point where the tables are built
            crc1, crc2 = (int(v) for v in rng.integers(0, 1 << 32, 2))
            assert crc.combine(crc1, crc2, length) == crc._multmodp(crc._shift_operator(length), crc1) ^ crc2
        assert length in crc._TABLES
    data = os.urandom(64 << 10)
    total = 0
    for a in range(0, len(data), 4096):  # every piece 4096 bytes: tables from the 8th on
        total = crc.combine(total, crc.value(data[a:a + 4096]), 4096)
    assert total == crc.value(data)


def test_default_checksum_context_is_created_once_under_concurrency() -> None:
    seen: List[Any] = []
    barrier = threading.Barrier(8)

    def grab() -> None:
        barrier.wait()
        seen.append(crc.default_context())

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in seen}) == 1
    assert crc.shared_executor() is seen[0].executor


def test_a_reader_with_its_own_context_uses_its_threads(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    big = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: several units
    shardckpt.save_tensors(prefix, {"big": big})
    ctx = crc.ChecksumContext(workers=3)
    try:
        with BundleReader(Location.of(prefix), context=ctx) as reader:
            np.testing.assert_array_equal(reader.read("big"), big)
        assert ctx._executor is not None
    finally:
        ctx.shutdown()


# -- whole entries in units on several threads -----------------------------------------------------
@pytest.mark.parametrize("elements", [1, (512 << 10) + 1, (2 << 20) // 4 * 5 + 3])
def test_multi_unit_entries_read_exactly_and_every_unit_is_checked(tmp_path: Path, elements: int) -> None:
    prefix = str(tmp_path / "ck")
    value = np.random.default_rng(elements).standard_normal(elements).astype(np.float32)
    shardckpt.save_tensors(prefix, {"v": value})
    with BundleReader(Location.of(prefix)) as reader:
        np.testing.assert_array_equal(reader.read("v"), value)
        out = np.empty_like(value)
        with reader.session() as session:
            session.read_region("v", None, out)
        np.testing.assert_array_equal(out, value)
        entry = reader.entry("v")
        size, offset = entry.size, entry.offset
    for at in sorted({0, size // 2, size - 1}):  # first, a middle and the last unit
        _flip(prefix + DATA, offset + at)
        with BundleReader(Location.of(prefix)) as reader:
            with pytest.raises(DataLossError, match="checksum does not match"):
                reader.read("v")
            with pytest.raises(DataLossError, match="checksum does not match"):
                with reader.session() as session:
                    session.read("v")
        _flip(prefix + DATA, offset + at)


def test_two_threads_on_one_reader_each_see_only_their_own_checksum_failures(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    good = {f"good{i}": np.full((1 << 18) + i, i, np.float32) for i in range(4)}
    shardckpt.save_tensors(prefix, {**good, "bad": np.ones(1 << 20, np.float32)})
    with BundleReader(Location.of(prefix)) as reader:
        entry = reader.entry("bad")
    _flip(prefix + DATA, entry.offset + 12345)
    results: Dict[str, Any] = {}
    with BundleReader(Location.of(prefix)) as reader:
        barrier = threading.Barrier(2)

        def bad_reader() -> None:
            barrier.wait()
            try:
                with reader.session() as session:
                    for _ in range(5):
                        session.read("bad")
                results["bad"] = None
            except DataLossError as exc:
                results["bad"] = exc

        def good_reader() -> None:
            barrier.wait()
            try:
                with reader.session() as session:
                    for _ in range(5):
                        values = {k: session.read(k) for k in good}
                results["good"] = values
            except Exception as exc:  # noqa: BLE001 - recorded and failed below
                results["good"] = exc

        threads = [threading.Thread(target=bad_reader), threading.Thread(target=good_reader)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert isinstance(results["bad"], DataLossError) and "'bad'" in str(results["bad"])
    assert isinstance(results["good"], dict), results["good"]
    for k, v in good.items():
        np.testing.assert_array_equal(results["good"][k], v)


def test_restore_tensors_checks_every_entry_before_returning(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    arrays = {f"t{i}": np.arange(i, i + (300 << 10), dtype=np.float32) for i in range(6)}
    shardckpt.save_tensors(prefix, arrays)
    outs = {k: np.empty_like(v) for k, v in arrays.items()}
    shardckpt.restore_tensors(prefix, [shardckpt.RestoreRequest(k, out=o) for k, o in outs.items()])
    for k in arrays:
        np.testing.assert_array_equal(outs[k], arrays[k])
    with BundleReader(Location.of(prefix)) as reader:
        entry = reader.entry("t5")
    _flip(prefix + DATA, entry.offset + entry.size - 1)
    with pytest.raises(DataLossError, match="'t5'"):
        shardckpt.restore_tensors(prefix, [shardckpt.RestoreRequest(k, out=o) for k, o in outs.items()])


def test_read_many_plans_mixed_keys_in_order_and_checks_each(tmp_path: Path) -> None:
    """A session's read_many: whole entries in batches on the pump, the rest (sliced, strings, zero-sized,
    strided or wrong destinations) through the general path, in order; every entry checked."""
    prefix = str(tmp_path / "ck")
    rng = np.random.default_rng(3)
    plain = {f"p{i:02d}": rng.standard_normal(n).astype(np.float32)
             for i, n in enumerate([5, 3 << 20, 7, 100_000, 1, 40] * 6)}  # > one batch, small and large
    sliced = np.arange(64 * 8, dtype=np.float64).reshape(64, 8)
    strings = np.array([b"a", b"bc"], dtype=object)
    tensors: List[Any] = [shardckpt.ShardableTensor.from_value(k, v) for k, v in plain.items()]
    tensors += [shardckpt.ShardableTensor.from_value("s", sliced[r * 32:(r + 1) * 32], slice_spec=f"64 8 {r * 32},32:-")
                for r in range(2)]
    tensors += [shardckpt.ShardableTensor.from_value("str", strings),
                shardckpt.ShardableTensor.from_value("empty", np.zeros((0, 3), np.int32)),
                shardckpt.ShardableTensor.from_value("scalar", np.array(2.5, np.float16))]
    shardckpt.save_tensors(prefix, tensors)
    keys = list(plain)[:20] + ["s", "str"] + list(plain)[20:] + ["empty", "scalar"]
    expect: Dict[str, Any] = dict(plain, s=sliced, str=strings, empty=np.zeros((0, 3), np.int32),
                                  scalar=np.array(2.5, np.float16))
    strided = np.zeros((100_000, 2), np.float32)[:, 0]
    outs: List[Any] = [None] * len(keys)
    outs[keys.index("p03")] = strided  # not contiguous: the general path copies in
    with BundleReader(Location.of(prefix)) as reader:
        with reader.session() as session:
            got = session.read_many(keys, outs)
        assert got[keys.index("p03")] is strided
        for key, value in zip(keys, got):
            np.testing.assert_array_equal(value, expect[key])
        with pytest.raises(shardckpt.errors.InvalidArgumentError, match="destination has shape"):
            with reader.session() as session:
                session.read_many(["p00", "p01"], [None, np.zeros(3, np.float32)])
        big = reader.entry("p19")
    _flip(prefix + DATA, big.offset + big.size // 2)
    with BundleReader(Location.of(prefix)) as reader:
        with pytest.raises(DataLossError, match="'p19': checksum does not match"):
            with reader.session() as session:
                session.read_many(keys)


# -- the read pump: slow-copy skews, gathered neighbours, lanes ---------------------------------------
def _skewed(shape: tuple, dtype: Any, file_offset: int, skew: int) -> np.ndarray:
    """A C-contiguous array whose first byte lies ``skew`` bytes past ``file_offset`` modulo 4096."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.zeros(nbytes + 3 * 4096, np.uint8)
    start = (file_offset + skew - buf.ctypes.data) % 4096
    return buf[start:start + nbytes].view(dtype).reshape(shape)


@pytest.mark.parametrize("skew", [16, 8, 2048, 0])
@pytest.mark.parametrize("elements", [3000, (3 << 20) + 5])  # one small read; several units on helpers
def test_whole_entries_read_into_arrays_at_any_skew_and_every_byte_is_checked(tmp_path: Path, skew: int,
                                                                               elements: int) -> None:
    from shardckpt.format import whole_reads

    prefix = str(tmp_path / "ck")
    value = np.random.default_rng(skew).standard_normal(elements).astype(np.float32)
    shardckpt.save_tensors(prefix, {"pad": np.zeros(7, np.float32), "v": value})
    with BundleReader(Location.of(prefix)) as reader:
        entry = reader.entry("v")
        offset, size = int(entry.offset), int(entry.size)
        out = _skewed(value.shape, np.float32, offset, skew)
        assert whole_reads._slow_copy(out.ctypes.data, offset) == (0 < skew < 64)  # the bounce path when slow
        reader.read_region("v", None, out)
        np.testing.assert_array_equal(out, value)
        out[...] = 0
        with reader.session() as session:
            session.read_region("v", None, out)
        np.testing.assert_array_equal(out, value)
    for at in sorted({0, size // 2, size - 1}):
        _flip(prefix + DATA, offset + at)
        with BundleReader(Location.of(prefix)) as reader:
            with pytest.raises(DataLossError, match="'v': checksum does not match"):
                reader.read_region("v", None, out)
            with pytest.raises(DataLossError, match="'v': checksum does not match"):
                with reader.session() as session:
                    session.read_region("v", None, out)
        _flip(prefix + DATA, offset + at)


class _CountingLocal(LocalFileSystem):
    """The local filesystem, recording every positional read (offset, length)."""

    def __init__(self) -> None:
        self.reads: List[Any] = []
        self._lock = threading.Lock()

    def pread_into(self, fd: int, buf: memoryview, offset: int, path: str = "") -> None:
        with self._lock:
            self.reads.append((offset, len(buf)))
        super().pread_into(fd, buf, offset, path)


def test_small_neighbours_are_read_in_few_requests_and_each_is_checked_on_its_own(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    rng = np.random.default_rng(5)
    arrays = {f"t{i:03d}": rng.standard_normal(int(rng.integers(1, 9000))).astype(np.float32) for i in range(120)}
    arrays["big"] = rng.standard_normal(3 << 20).astype(np.float32)  # between two runs of small ones
    arrays.update({f"u{i:03d}": rng.standard_normal(700 + i).astype(np.float32) for i in range(40)})
    shardckpt.save_tensors(prefix, arrays)
    fs = _CountingLocal()
    with BundleReader(prefix, fs=fs) as reader:
        order = sorted(arrays, key=lambda k: reader.entry(k).offset)
        outs = {k: np.zeros_like(arrays[k]) for k in order}
        with reader.session() as session:
            for k in order:
                session.read_region(k, None, outs[k])
        data = sorted(r for r in fs.reads if r[1] > 0)
    for k in arrays:
        np.testing.assert_array_equal(outs[k], arrays[k])
    small = sum(a.nbytes for k, a in arrays.items() if k != "big")
    assert len(data) < 20, len(data)  # 160 small entries, gathered (and the large one in pieces)
    covered = sum(n for _, n in data)
    assert covered == small + arrays["big"].nbytes  # every byte read once
    bad = order[len(order) // 3]
    with BundleReader(Location.of(prefix)) as reader:
        entry = reader.entry(bad)
    _flip(prefix + DATA, int(entry.offset) + int(entry.size) // 2)
    with BundleReader(Location.of(prefix)) as reader:
        outs = {k: np.zeros_like(arrays[k]) for k in order}
        with pytest.raises(DataLossError, match=f"'{bad}'"):
            with reader.session() as session:
                for k in order:
                    session.read_region(k, None, outs[k])
        for k in order:  # every other entry was read and is right
            if k != bad:
                np.testing.assert_array_equal(outs[k], arrays[k])


@pytest.mark.parametrize("workers", [1, 3])
def test_many_entries_on_several_lanes_are_each_read_exactly_once(tmp_path: Path, workers: int) -> None:
    prefix = str(tmp_path / "ck")
    rng = np.random.default_rng(workers)
    sizes = [int(rng.integers(1, 3 << 20)) for _ in range(30)]
    arrays = {f"t{i:02d}": rng.standard_normal(n // 4 + 1).astype(np.float32) for i, n in enumerate(sizes)}
    shardckpt.save_tensors(prefix, arrays)
    fs = _CountingLocal()
    ctx = crc.ChecksumContext(workers=workers)
    try:
        with BundleReader(prefix, fs=fs, context=ctx) as reader:
            outs = shardckpt.restore_tensors(prefix, list(arrays), reader=reader)
            spans = sorted(r for r in fs.reads if r[1] > 0)
    finally:
        ctx.shutdown()
    for got, want in zip(outs, arrays.values()):
        np.testing.assert_array_equal(got, want)
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b  # no byte read twice
    assert sum(n for _, n in spans) == sum(a.nbytes for a in arrays.values())


# -- pread_batch ----------------------------------------------------------------------------------
class _SerialLocal(LocalFileSystem):
    """The local filesystem with the interface's default (serial) pread_batch."""

    pread_batch = FileSystem.pread_batch


@pytest.mark.parametrize("fs", [LocalFileSystem(), _SerialLocal(), LocalFileSystem(map_runs=True)],
                         ids=["local", "default", "mapped"])
def test_region_reads_through_pread_batch(tmp_path: Path, fs: FileSystem) -> None:
    prefix = str(tmp_path / "ck")
    a = np.arange(64 * 3000, dtype=np.float32).reshape(64, 3000)
    shardckpt.save_tensors(prefix, {"a": a})
    with BundleReader(prefix, fs=fs) as reader:
        for region in [((3, 40), (10, 12)), ((0, 64), (100, 2000)), ((5, 6), (0, 3000)), ((0, 64), (2999, 3000))]:
            got = reader.read_region("a", region)
            np.testing.assert_array_equal(got, a[tuple(slice(*r) for r in region)])
    c = np.arange(6 * 50 * 70, dtype=np.int16).reshape(6, 50, 70)  # tiny runs, unevenly spaced
    shardckpt.save_tensors(prefix + "3", {"c": c})
    with BundleReader(prefix + "3", fs=fs) as reader:
        for region in [((1, 5), (2, 40), (3, 9)), ((0, 6), (0, 50), (69, 70)), ((2, 3), (0, 50), (0, 35))]:
            got = reader.read_region("c", region)
            np.testing.assert_array_equal(got, c[tuple(slice(*r) for r in region)])
            out = np.zeros((8,) + got.shape, np.int16)[3]  # into a non-contiguous-parent view
            reader.read_region("c", region, out=np.ascontiguousarray(out))


def test_runs_of_a_page_or_more_are_read_in_one_loop(tmp_path: Path) -> None:
    """``pread_batch`` of page-sized runs: each run lands in its place; a run past the end of the
    file is a DataLossError; a subclass's ``pread_into`` sees every run."""
    from shardckpt.storage.base import RunBatch

    path = str(tmp_path / "f")
    data = os.urandom(1 << 20)
    with open(path, "wb") as f:
        f.write(data)
    offsets = np.arange(0, 1 << 20, 3 * 8192, dtype=np.int64)[:40] + 100  # 8 KiB runs, 16 KiB apart
    seen: List[int] = []

    class Counting(LocalFileSystem):
        def pread_into(self, fd: int, buf: memoryview, offset: int, path: str = "") -> None:
            seen.append(offset)
            super().pread_into(fd, buf, offset, path)

    for fs in (LocalFileSystem(), Counting()):
        dest = bytearray(len(offsets) * 8192)
        fd = fs.open_read(path)
        try:
            fs.pread_batch(fd, RunBatch(offsets, 8192, memoryview(dest)), path)
            with pytest.raises(DataLossError, match="end of file"):
                fs.pread_batch(fd, RunBatch(np.array([0, (1 << 20) - 4096], np.int64), 8192,
                                            memoryview(bytearray(2 * 8192))), path)
        finally:
            fs.close(fd)
        assert bytes(dest) == b"".join(data[o:o + 8192] for o in offsets.tolist())
    assert seen[:len(offsets)] == offsets.tolist()


def test_mapped_runs_count_their_bytes_and_fall_back_to_reads(tmp_path: Path, monkeypatch: Any) -> None:
    """``map_runs=True``: every batch of ascending runs (tiny, uneven, off the pages, over several
    windows) lands in place out of maps, ``mapped_bytes`` counts the bytes copied; a file too short
    is the read calls' DataLossError, with nothing counted."""
    from shardckpt.storage import mapped
    from shardckpt.storage.base import RunBatch

    path = str(tmp_path / "f")
    data = os.urandom(3 << 20)
    with open(path, "wb") as f:
        f.write(data)
    fs = LocalFileSystem(map_runs=True)
    fd = fs.open_read(path)
    try:
        for offsets, rb in [
            (np.arange(10, dtype=np.int64) * 16384, 8192),  # page-aligned rows
            (np.arange(10, dtype=np.int64) * 16384 + 100, 8192),  # off the pages
            (np.arange(64, dtype=np.int64) * 200, 100),  # tiny runs sharing pages
            (np.array([0, 5000, 9000, 2 << 20], np.int64), 3000),  # uneven spacing, across 2 MiB
        ]:
            before = fs.mapped_bytes
            dest = bytearray(len(offsets) * rb)
            fs.pread_batch(fd, RunBatch(offsets, rb, memoryview(dest)), path)
            assert bytes(dest) == b"".join(data[o:o + rb] for o in offsets.tolist())
            assert fs.mapped_bytes - before == len(offsets) * rb
        monkeypatch.setattr(mapped, "WINDOW", (2 << 20) + (64 << 10))  # several windows over one batch
        offsets = np.arange(0, (3 << 20) - 8192, 12288, dtype=np.int64)
        dest = bytearray(len(offsets) * 8192)
        fs.pread_batch(fd, RunBatch(offsets, 8192, memoryview(dest)), path)
        assert bytes(dest) == b"".join(data[o:o + 8192] for o in offsets.tolist())
        before = fs.mapped_bytes
        with pytest.raises(DataLossError, match="end of file"):
            fs.pread_batch(fd, RunBatch(np.array([0, (3 << 20) - 4096], np.int64), 8192,
                                        memoryview(bytearray(2 * 8192))), path)
        assert fs.mapped_bytes == before
    finally:
        fs.close(fd)


def test_a_reader_without_helper_threads_reads_and_checks_whole_entries(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    big = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: several units, all read by the calling thread
    shardckpt.save_tensors(prefix, {"big": big})
    solo = crc.ChecksumContext(workers=0)
    with BundleReader(Location.of(prefix), context=solo) as reader:
        with reader.session() as session:
            got = session.read("big")
        np.testing.assert_array_equal(got, big)
    assert solo._executor is None
    _flip(prefix + DATA, 5 << 20)
    with BundleReader(Location.of(prefix), context=solo) as reader:
        with pytest.raises(DataLossError, match="checksum"):
            reader.read("big")


def test_run_batch_is_a_sequence_of_requests() -> None:
    from shardckpt.storage.base import RunBatch

    dest = memoryview(bytearray(12))
    batch = RunBatch(np.array([5, 20, 40], np.int64), 4, dest)
    assert len(batch) == 3 and batch[1][0] == 20 and len(batch[2][1]) == 4 and batch[-1][0] == 40
    assert [o for o, _ in batch] == [5, 20, 40]


# -- a reader sees the checkpoint it opened -------------------------------------------------------
def _values(seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((256, 64)).astype(np.float32),
            "b": rng.standard_normal(1000).astype(np.float32)}


def _never_wrong(fn: Any, want: np.ndarray) -> bool:
    """Run a read: True if it raised CheckpointReplacedError, else its values must be ``want``."""
    try:
        got = fn()
    except CheckpointReplacedError as exc:
        assert "replaced while open" in str(exc)
        return True
    np.testing.assert_array_equal(got, want)
    return False


def _overwritten_twice(prefix: str) -> None:
    shardckpt.save_tensors(prefix, _values(2))
    shardckpt.save_tensors(prefix, _values(3))


def test_reader_opened_on_an_old_index_raises_after_the_prefix_is_overwritten_twice(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    old = _values(1)
    shardckpt.save_tensors(prefix, old)
    reads = [lambda r: r.read_region("w", ((10, 20), (3, 9))), lambda r: r.read("b"),
             lambda r: r.read("w", verify=False), lambda r: r.raw_bytes(r.pieces("b")[0])]
    for read in reads:
        reader = BundleReader(Location.of(prefix))  # the index is read now, data files are opened on first use
        try:
            _overwritten_twice(prefix)
            with pytest.raises(CheckpointReplacedError, match="replaced while open"):
                read(reader)
        finally:
            reader.close()
            shardckpt.save_tensors(prefix, old)


def test_reader_with_data_file_open_keeps_reading_what_it_opened(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    old = _values(1)
    shardckpt.save_tensors(prefix, old)
    with BundleReader(Location.of(prefix)) as reader:
        np.testing.assert_array_equal(reader.read("b"), old["b"])  # the data file is open now
        _overwritten_twice(prefix)
        # The open descriptor still reads the opened checkpoint's bytes: right values, or a clear error.
        _never_wrong(lambda: reader.read_region("w", ((10, 20), (3, 9))), old["w"][10:20, 3:9])
        _never_wrong(lambda: reader.read("w"), old["w"])


def test_data_file_rewritten_in_place_is_never_read_silently(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    old = _values(1)
    shardckpt.save_tensors(prefix, old)
    with BundleReader(Location.of(prefix)) as reader:
        reader.read("b")
        data = Path(prefix + DATA).read_bytes()
        entry = reader.entry("w")
        changed = bytearray(data)
        changed[entry.offset:entry.offset + entry.size] = os.urandom(entry.size)
        with open(prefix + DATA, "r+b") as f:  # the same inode, other bytes
            f.write(changed)
        os.utime(prefix + DATA, ns=(1, 1))
        with pytest.raises(CheckpointReplacedError):
            reader.read_region("w", ((0, 5), (0, 64)))
        with pytest.raises(DataLossError):
            reader.read("w")



def test_s3_reader_opened_on_an_old_index_raises_after_the_prefix_is_overwritten_twice(s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    old = _values(1)
    shardckpt.save_tensors(prefix, old)
    with BundleReader(Location.of(prefix)) as reader:
        _overwritten_twice(prefix)
        with pytest.raises(CheckpointReplacedError, match="replaced while open"):
            reader.read_region("w", ((10, 20), (3, 9)))
    shardckpt.save_tensors(prefix, old)
    with BundleReader(Location.of(prefix)) as reader:
        np.testing.assert_array_equal(reader.read("b"), old["b"])  # first use: identity checked
        _overwritten_twice(prefix)
        with pytest.raises(CheckpointReplacedError, match="replaced while open"):
            reader.read_region("w", ((10, 20), (3, 9)))  # no checksum covers a region: identity again
        with pytest.raises(CheckpointReplacedError, match="replaced while open"):
            reader.read("w")  # the checksum fails; the identity says why


def test_unit_sizes_are_what_the_reader_documents() -> None:
    assert br._SUB <= br._UNIT and br._UNIT % br._SUB == 0


def test_piece_at_looks_up_only_the_slice_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``piece_at``: the stored piece whose box starts at a point, found by looking up that one slice
    entry (a rank reading one chunk of a tensor in 4 slices looks up 1 slice entry, not 4); a point where
    no piece starts is ``None``; an unsliced tensor is its own piece at the origin."""
    from shardckpt.format.bundle_index import BundleIndex
    from shardckpt.format.bundle_writer import BundleWriter

    full = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    prefix = str(tmp_path / "ck")
    writer = BundleWriter(Location.of(prefix))
    for r in range(4):
        writer.add_slice("w", (64, 8), f"{r * 16},16:-", full[r * 16:(r + 1) * 16])
    writer.add("plain", full)
    writer.finish()
    looked: List[bytes] = []
    real = BundleIndex.entry  # (the reader's index looks entries up: BundleReader.entry is its face)

    def entry(self: BundleIndex, key: Any) -> Any:
        looked.append(key if isinstance(key, bytes) else key.encode())
        return real(self, key)

    with BundleReader(Location.of(prefix)) as reader:
        monkeypatch.setattr(BundleIndex, "entry", entry)
        piece = reader.piece_at("w", (32, 0))
        assert piece is not None and piece.box == ((32, 48), (0, 8))
        assert len({k for k in looked if k != b"w"}) == 1  # only the slice entry of rows 32..47
        assert np.array_equal(reader.read_piece_region(piece, ((0, 16), (0, 8))), full[32:48])
        assert reader.piece_at("w", (32, 0)) is piece  # kept
        assert reader.piece_at("w", (8, 0)) is None
        whole = reader.piece_at("plain", (0, 0))
        assert whole is not None and whole.box == ((0, 64), (0, 8))
        assert reader.piece_at("plain", (1, 0)) is None


def test_arrays_the_reader_allocates_are_64_byte_aligned(tmp_path: Path) -> None:
    """Every destination the reader allocates (``out=None``) of at least a page starts on a 64-byte boundary:
    whole reads (plain, in a session, ``read_many``), sliced tensors assembled, regions, a piece's region.
    (NumPy's own arrays are 16-byte aligned; JAX on CPU copies those instead of sharing them.)"""
    from shardckpt.format.buffers import ALIGN_FROM, ALIGNMENT, aligned_empty
    from shardckpt.format.bundle_writer import BundleWriter

    prefix = str(tmp_path / "ck")
    values = {f"w{i}": np.arange(1024 + 16 * i, dtype=np.float32).reshape(-1, 4) * (i + 1) for i in range(8)}
    full = np.arange(64 * 32, dtype=np.float64).reshape(64, 32)
    writer = BundleWriter(Location.of(prefix))
    for k, v in values.items():
        writer.add(k, v)
    for r in range(4):
        writer.add_slice("s", (64, 32), f"{r * 16},16:-", full[r * 16:(r + 1) * 16])
    writer.finish()

    def aligned(a: np.ndarray) -> bool:
        return a.ctypes.data % ALIGNMENT == 0 and a.flags.c_contiguous and a.flags.writeable

    with BundleReader(Location.of(prefix)) as reader:
        got = [reader.read(k) for k in values]
        with reader.session() as session:
            got += [session.read(k) for k in values] + session.read_many(list(values))
        got.append(reader.read("s"))
        got.append(reader.read_region("s", ((8, 40), (0, 32))))
        got.append(reader.read_region("w3", ((0, 256), (0, 4))))
        got.append(reader.read_piece_region(reader.pieces("s")[1], ((0, 16), (0, 32))))
    expected = [values[k] for k in values] * 3 + [full, full[8:40], values["w3"][:256], full[16:32]]
    for a, want in zip(got, expected):
        assert np.array_equal(a, want)
        assert aligned(a), (a.shape, a.ctypes.data % ALIGNMENT)
    small = aligned_empty((ALIGN_FROM // 8 - 1,), np.float64)  # below a page: NumPy's array as it comes
    assert small.base is None and small.shape == (ALIGN_FROM // 8 - 1,)
    assert aligned_empty((3,), object).dtype == object
