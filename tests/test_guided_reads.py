"""Guided reads (issue 14): a cold restore of an incremental checkpoint whose linked data file holds dead
bytes (the old bytes of changed tensors) reads the bytes its index names, not the dead ones.

Bytes read from the device are counted by ``/proc/self/io`` ``read_bytes`` (every thread of the process,
the populating threads included); the page cache of the data files is dropped with
``POSIX_FADV_DONTNEED`` (no privileges needed).
"""

from __future__ import annotations

import os
import platform
import re
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

import shardckpt
from shardckpt import CheckpointOptions
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.saving.incremental import data_file_origins
from shardckpt.storage import guided
from shardckpt.storage.local import LocalFileSystem, local_fs
from shardckpt.storage.location import Location
from shardckpt.storage.mounts import filesystem_type

MIB = 1 << 20
TENSORS, CHANGED = 16, (2, 7, 12)  # 4 MiB float32 tensors; 3 of 16 change: the old file stays linked
ELEMENTS = (4 * MIB) // 4


def _read_bytes() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("read_bytes:")).split()[1])


def _drop_cache(prefix: str) -> None:
    """Write the checkpoint's files back and drop their pages from the page cache."""
    os.sync()
    folder, base = os.path.split(prefix)
    for name in os.listdir(folder):
        if name.startswith(base + "."):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _named_bytes(prefix: str) -> int:
    with BundleReader(Location.of(prefix)) as reader:
        return sum(int(reader.entry(k).size) for k in reader.keys(include_slices=True))


def _data_bytes(prefix: str) -> int:
    folder, base = os.path.split(prefix)
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.startswith(base + ".data-"))


@pytest.fixture(scope="module")
def gapped(tmp_path_factory: Any) -> Dict[str, Any]:
    """A full checkpoint ``p0`` and an incremental one ``inc`` (3 of 16 tensors changed) linking p0's file,
    which keeps the 3 old tensors as dead bytes (p0 is kept: it still names them)."""
    folder = tmp_path_factory.mktemp("guided")
    rng = np.random.default_rng(3)
    state = {f"t{i:02d}": rng.standard_normal(ELEMENTS).astype(np.float32) for i in range(TENSORS)}
    p0 = str(folder / "p0")
    shardckpt.save_tensors(p0, state, CheckpointOptions(incremental=True))
    for i in CHANGED:
        state[f"t{i:02d}"] = state[f"t{i:02d}"] + 1.0
    inc = str(folder / "inc")
    shardckpt.save_tensors(inc, state, CheckpointOptions(incremental=True), previous=p0)
    origins = data_file_origins(inc, local_fs)
    assert origins is not None and any(o["how"] == "link" for o in origins.values())
    assert _data_bytes(inc) - _named_bytes(inc) == len(CHANGED) * 4 * MIB  # the dead bytes
    return {"p0": p0, "inc": inc, "state": state}


def _kernel() -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])


def _restore(prefix: str, names: List[str]) -> List[np.ndarray]:
    return shardckpt.restore_tensors(prefix, names)


def _platform_has_guides() -> bool:
    """Guides are used on Linux with transparent huge pages not ``never`` (and not turned off)."""
    if platform.system() != "Linux" or os.environ.get("SHARDCKPT_GUIDED_READS", "1") == "0":
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


GUIDES = _platform_has_guides()


def _never_guided(path: str, unchecked: str = "") -> None:
    """Where guides are not used: an announcement with gaps changes nothing (reads as before). The fallback
    is checked; what a test could not check here (``unchecked``) is said loudly, as a warning."""
    if unchecked:
        warnings.warn(f"no guided reads on this host (transparent huge pages are 'never', or "
                      f"SHARDCKPT_GUIDED_READS=0): NOT checked here: {unchecked}; checked instead: an announcement "
                      "with gaps leaves the descriptor's reads as they were", stacklevel=2)
    fs = LocalFileSystem()
    fd = fs.open_read(path)
    try:
        assert fs.prefetch(fd, np.array([0, 8 * MIB]), np.array([MIB, 9 * MIB])) == 0
        assert fd not in fs._guides
    finally:
        fs.close(fd)


def test_guides_are_used_exactly_where_the_platform_has_them() -> None:
    assert guided.available() is GUIDES


def test_cold_restore_reads_the_named_bytes_not_the_dead_ones(gapped: Dict[str, Any]) -> None:
    if not GUIDES:  # no transparent huge pages here: nothing is guided
        _never_guided(gapped["p0"] + ".data-00000-of-00001", "a cold restore reads only the named bytes")
        return
    inc, state = gapped["inc"], gapped["state"]
    names = sorted(state)
    named = _named_bytes(inc)
    _drop_cache(inc)
    before, copied = _read_bytes(), local_fs.guided_bytes
    got = _restore(inc, names)
    read = _read_bytes() - before
    assert all(np.array_equal(a, state[n]) for a, n in zip(got, names))
    with open(inc + ".index", "rb") as fh:
        fits = guided.large_pages(fh.fileno())
    if guided.available():
        assert fits is not None  # the cold read probed this file system
    if fits:
        # the named bytes, rounded out to 2 MiB blocks (entries here are 4 MiB-aligned), plus the index
        assert named <= read <= named + MIB, (read, named)
        assert local_fs.guided_bytes > copied  # the linked file was read through its guide
    else:  # no large pages here: read as before, the kernel's readahead through the dead bytes
        warnings.warn(f"the file system of {inc} holds no large page-cache pages: the cold restore was checked "
                      "without a guide (NOT checked here: that a guide reads only the named bytes)", stacklevel=1)
        assert local_fs.guided_bytes == copied
        assert read >= named

    # warm: nothing from the device (a later read of a large page read ahead must not start the
    # kernel's readahead into the dead bytes after it)
    before = _read_bytes()
    got = _restore(inc, names)
    assert _read_bytes() - before < MIB
    assert all(np.array_equal(a, state[n]) for a, n in zip(got, names))


def test_without_guides_the_same_values(gapped: Dict[str, Any]) -> None:
    inc, state = gapped["inc"], gapped["state"]
    names = sorted(state)
    _drop_cache(inc)
    with BundleReader(inc, fs=LocalFileSystem(guide_reads=False)) as reader:
        got = shardckpt.restore_tensors(inc, names, reader=reader)
    assert all(np.array_equal(a, state[n]) for a, n in zip(got, names))


def test_a_full_read_is_not_guided_and_a_partial_one_is(gapped: Dict[str, Any]) -> None:
    if not GUIDES:  # no transparent huge pages here: nothing is guided
        _never_guided(gapped["p0"] + ".data-00000-of-00001", "partial reads are guided and full ones not")
        return
    p0 = gapped["p0"]
    fs = LocalFileSystem()
    path = p0 + ".data-00000-of-00001"
    size = os.path.getsize(path)
    fd = fs.open_read(path)
    try:
        assert fs.prefetch(fd, np.array([0]), np.array([size])) == 0  # the whole file: readahead as before
        assert fd not in fs._guides
        four = 4 * MIB
        # every other tensor: guided, chunks of at most guided.CHUNK over the announced ranges only
        starts = np.arange(0, size, 2 * four)
        assert fs.prefetch(fd, starts, starts + four) == len(starts) * -(-four // guided.CHUNK)
        guide = fs._guides[fd]
        assert int(guide.starts.min()) == 0 and int(guide.ends.max()) == int(starts[-1]) + four
        # reads inside the ranges come from the map, reads outside from the descriptor: both exact
        want = np.fromfile(path, dtype=np.uint8)
        for offset, n in ((0, four), (four // 2, 100), (four, four), (four - 10, 20), (size - 5, 5)):
            buf = bytearray(n)
            fs.pread_into(fd, memoryview(buf), offset, path)
            assert bytes(buf) == want[offset:offset + n].tobytes(), (offset, n)
    finally:
        fs.close(fd)
    assert fd not in fs._guides  # closing drops (and unmaps) the guide


def test_a_guide_is_dropped_when_its_descriptor_number_is_reused(gapped: Dict[str, Any]) -> None:
    if not GUIDES:  # no transparent huge pages here: nothing is guided
        _never_guided(gapped["p0"] + ".data-00000-of-00001", "a guide is dropped with its descriptor")
        return
    path = gapped["p0"] + ".data-00000-of-00001"
    fs = LocalFileSystem()
    fd = fs.open_read(path)
    assert fs.prefetch(fd, np.array([0]), np.array([4 * MIB])) > 0
    os.close(fd)  # closed behind the filesystem's back
    again = fs.open_read(gapped["inc"] + ".index")
    try:
        if again == fd:
            assert fd not in fs._guides
            buf = bytearray(16)
            fs.pread_into(again, memoryview(buf), 0)
            with open(gapped["inc"] + ".index", "rb") as fh:
                assert bytes(buf) == fh.read(16)
    finally:
        fs.close(again)
        fs._drop_guide(fd)


def test_many_threads_read_through_one_guide(gapped: Dict[str, Any]) -> None:
    if not GUIDES:  # no transparent huge pages here: nothing is guided
        _never_guided(gapped["p0"] + ".data-00000-of-00001", "threads reading through one guide")
        return
    inc = gapped["inc"]
    path = inc + ".data-00000-of-00002"
    if not os.path.exists(path):
        path = next(str(p) for p in Path(inc).parent.glob("inc.data-*") if os.path.getsize(p) == TENSORS * 4 * MIB)
    size = os.path.getsize(path)
    want = np.fromfile(path, dtype=np.uint8)
    _drop_cache(inc)
    fs = LocalFileSystem()
    fd = fs.open_read(path)
    unit = 1 << 20
    offsets = [o for o in range(0, size, unit) if (o // (4 * MIB)) % 3 != 1]  # gaps of 4 MiB
    starts = np.array(offsets)
    assert fs.prefetch(fd, starts, starts + unit) > 0
    errors: List[BaseException] = []

    def work(part: List[int]) -> None:
        try:
            for o in part:
                buf = bytearray(unit)
                fs.pread_into(fd, memoryview(buf), o, path)
                assert bytes(buf) == want[o:o + unit].tobytes(), o
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(offsets[k::3],)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fs.close(fd)
    assert errors == []


def test_a_file_system_without_large_file_pages_is_probed_unfit(tmp_path: Path) -> None:
    """tmpfs (``/dev/shm``) never maps its pages as ``FilePmdMapped`` large pages: the probe says no, and
    ``plan`` makes no guide for a file system marked so."""
    if not GUIDES:  # no transparent huge pages here: nothing is guided
        (tmp_path / "f").write_bytes(bytes(10 * MIB))
        _never_guided(str(tmp_path / "f"), "the large-page probe of tmpfs")
        return
    shm = Path("/dev/shm")
    assert shm.is_dir(), "Linux provides /dev/shm"
    path = shm / f"shardckpt-probe-{os.getpid()}"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 8 * MIB, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        guide = guided.Guide(fd, 8 * MIB, np.array([0, 6 * MIB]), np.array([4 * MIB, 8 * MIB]))
        try:
            assert guide.probe() is False
            out = bytearray(MIB)
            assert guide.read(2 * MIB, memoryview(out))  # the probed chunk is populated: copies still work
            assert bytes(out) == path.read_bytes()[2 * MIB:3 * MIB]
        finally:
            guide.close()
        guided._large_pages[os.fstat(fd).st_dev] = False
        assert guided.large_pages(fd) is False
        assert guided.plan(fd, 8 * MIB, [0, 6 * MIB], [MIB, 8 * MIB]) is None
    finally:
        os.close(fd)
        guided._large_pages.pop(os.stat(shm).st_dev, None)
        path.unlink()


def test_this_file_system_is_probed_once_from_a_cold_guided_read(gapped: Dict[str, Any]) -> None:
    if not GUIDES:  # no transparent huge pages here: nothing is guided
        _never_guided(gapped["p0"] + ".data-00000-of-00001", "the large-page probe of this file system")
        return
    """The probe's verdict on the test folder's file system is what the cold read saw in ``/proc/self/smaps``."""
    inc = gapped["inc"]
    folder, base = os.path.split(inc)
    path = max((os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(base + ".data-")),
               key=os.path.getsize)  # the linked file, with the dead bytes
    names = sorted(gapped["state"])
    _drop_cache(inc)
    _restore(inc, names)
    fd = os.open(path, os.O_RDONLY)
    try:
        fits = guided.large_pages(fd)
        assert fits is not None
        if filesystem_type(path) == "ext4" and _kernel() >= (6, 16) or \
                filesystem_type(path) == "xfs" and _kernel() >= (5, 18):
            assert fits, "this kernel reads large pages into the cache for this file system"
        size = os.fstat(fd).st_size
        guide = guided.Guide(fd, size, np.array([0]), np.array([size]))
        try:
            _drop_cache(inc)
            assert guide.probe() is fits
        finally:
            guide.close()
    finally:
        os.close(fd)


def test_files_on_a_ram_disk_are_never_announced_their_pages_are_in_memory(gapped: Dict[str, Any]) -> None:
    """A bundle on tmpfs (a node-local tier on /dev/shm) is read without planning announcements: no guide
    could make copying pages already in memory faster; the same bundle on disk is announced."""
    inc = gapped["inc"]
    assert filesystem_type(inc + ".index") not in (None, "tmpfs", "ramfs")  # the test's folder: on a disk
    with BundleReader(Location.of(inc)) as reader:
        assert reader.prefetches is True  # on a disk: announced (guided where the platform has guides)
    shm = Path("/dev/shm")
    if filesystem_type(str(shm)) != "tmpfs":
        pytest.fail("this suite expects /dev/shm to be a tmpfs (it is on Linux machines and in containers)")
    copy = shm / f"shardckpt-guided-{os.getpid()}"
    copy.mkdir()
    try:
        for name in os.listdir(os.path.dirname(inc)):
            if name.startswith(("inc.", "p0.")):
                copy.joinpath(name).write_bytes(Path(os.path.dirname(inc), name).read_bytes())
        with BundleReader(Location.of(str(copy / "inc"))) as reader:
            assert reader.prefetches is False
            assert reader.prefetch([(f"t{i:02d}", None) for i in range(0, TENSORS, 2)]) == 0  # nothing planned
            got = reader.read("t07")
        assert np.array_equal(got, gapped["state"]["t07"])
    finally:
        for name in os.listdir(copy):
            os.remove(copy / name)
        copy.rmdir()
