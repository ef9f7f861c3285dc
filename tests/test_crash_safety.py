"""Crash safety of the saving engine: real processes killed mid-save, full disks, failed commits.

What is proven (see :mod:`shardckpt.saving.commit` for the protocol):

* A save SIGKILLed at any moment leaves the prefix holding exactly one complete,
  checksum-clean generation: the one committed before, or the new one. Never a
  mix, never a partial one. The next save removes what the dead one left.
* A save that runs out of disk space (simulated at many points, and on a real
  2 MiB tmpfs) raises a clear :class:`~shardckpt.errors.ShardckptError` that says
  so and names the file, keeps the previous checkpoint whole, and leaves no
  temporary folder, ``.tempstate`` file or new data file behind.
* Saving over a checkpoint with the same shard count never touches the old data
  files before the commit.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

import numpy as np
import pytest

import shardckpt
import shardckpt.storage.local as local_storage
from shardckpt.errors import ShardckptError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.local import LocalFileSystem, StorageError
from shardckpt.storage.location import Location
from shardckpt.storage.registry import mounted
from shardckpt.storage.wrappers import FileSystemWrapper

HELPER = Path(__file__).parent / "helpers" / "save_loop.py"


def _load_helper():
    spec = importlib.util.spec_from_file_location("shardckpt_test_save_loop", HELPER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


save_loop = _load_helper()
make_tensors = save_loop.make_tensors

ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"


def _options(max_shard_size: int = save_loop.MAX_SHARD_SIZE) -> shardckpt.CheckpointOptions:
    return shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(max_shard_size))


# -- what is on disk --------------------------------------------------------------

def _num_shards(prefix: str) -> int:
    with BundleReader(Location.of(prefix)) as reader:
        return reader.num_shards


def _assert_holds_exactly(prefix: str, expected: Dict[str, np.ndarray]) -> int:
    """The checkpoint at ``prefix`` reads, every entry verifies, and it is ``expected``, exactly.

    Returns the checkpoint's shard count.
    """
    with shardckpt.load_checkpoint(prefix) as reader:
        keys = sorted(k.decode() for k in reader.bundle.keys())
        assert keys == sorted(expected), f"{prefix}: keys {keys} != {sorted(expected)}"
        for key in keys:
            reader.bundle.verify(key)
            got = reader.get_tensor(key)
            want = np.asarray(expected[key])
            assert got.shape == want.shape, f"{key}: shape {got.shape} != {want.shape}"
            if want.dtype == object:
                assert [bytes(x) for x in got.ravel()] == [bytes(x) for x in want.ravel()], key
            else:
                assert got.dtype == want.dtype, f"{key}: dtype {got.dtype} != {want.dtype}"
                assert np.array_equal(got, want), f"{key}: values differ from the expected generation"
        return reader.bundle.num_shards


def _committed_generation(prefix: str) -> int:
    """The generation at ``prefix``, after checking it is that generation exactly and whole."""
    with shardckpt.load_checkpoint(prefix) as reader:
        generation = int(reader.get_tensor("generation"))
    _assert_holds_exactly(prefix, make_tensors(generation))
    return generation


def _siblings(prefix: str) -> List[str]:
    """Names in the prefix's folder that belong to this prefix (files and folders)."""
    base = os.path.basename(prefix)
    return sorted(n for n in os.listdir(os.path.dirname(prefix)) if n.startswith(base))


def _assert_clean(prefix: str) -> None:
    """Only the committed checkpoint is there: its index and its data files, nothing else."""
    base = os.path.basename(prefix)
    n = _num_shards(prefix)
    want = sorted([f"{base}.index"] + [f"{base}.data-{i:05d}-of-{n:05d}" for i in range(n)])
    names = _siblings(prefix)
    assert names == want, f"leftovers next to {prefix}: {sorted(set(names) - set(want))}, " \
                          f"missing: {sorted(set(want) - set(names))}"
    assert not any("_temp_" in name or ".tempstate" in name for name in names)


# -- 1. SIGKILL at random moments -------------------------------------------------

def _start_helper(prefix: str, generation: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HELPER), prefix, str(generation)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"helper did not start: {line!r}\n{err}")
    return proc


def _run_helper_to_end(prefix: str, generation: int) -> "tuple[float, float]":
    """Save ``generation`` in a helper process; return seconds from READY to ``SAVED``, and to exit."""
    proc = _start_helper(prefix, generation)
    assert proc.stdout is not None
    started = time.perf_counter()
    line = proc.stdout.readline()
    saved = time.perf_counter() - started
    out, err = proc.communicate(timeout=60)
    ended = time.perf_counter() - started
    assert proc.returncode == 0, err
    assert line.strip() == f"SAVED {generation}", (line, out, err)
    return saved, ended


def test_sigkill_at_random_moments_leaves_exactly_one_complete_generation(tmp_path: Path) -> None:
    test_started = time.perf_counter()
    prefix = str(tmp_path / "ckpt" / "model")
    # The random kill moments (fractions of each save's measured length) replay with SHARDCKPT_KILL_SEED=<seed>.
    seed = int(os.environ.get("SHARDCKPT_KILL_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"\nkill seed {seed} (replay: SHARDCKPT_KILL_SEED={seed})", flush=True)
    rng = random.Random(seed)

    # Generation 0, in process.
    save_loop.save(prefix, 0)
    assert _committed_generation(prefix) == 0
    _assert_clean(prefix)

    # Calibration, per size of generation: how long a save takes after the helper's
    # start-up (to its "SAVED" line), and how long until the helper ends (it stays
    # alive HOLD_AFTER_SAVES seconds after its save, as a training process would).
    saved_after: Dict[int, float] = {}
    ended_after: Dict[int, float] = {}
    generation = 0
    while set(ended_after) != set(save_loop.SCALES):
        generation += 1
        saved, ended = _run_helper_to_end(prefix, generation)
        scale = save_loop.scale_of(generation)
        saved_after[scale] = max(saved_after.get(scale, 0.0), saved)
        ended_after[scale] = max(ended_after.get(scale, 0.0), ended)
        assert _committed_generation(prefix) == generation
        _assert_clean(prefix)
    committed = generation

    trials = 40
    killed_before = killed_after = completed = 0
    new_data_visible_before_commit = leftovers_after_commit = 0
    shard_counts: List[int] = []
    for trial in range(trials):
        generation += 1
        scale = save_loop.scale_of(generation)
        if trial % 5 == 4:
            # One trial in five aims at the end of the save and the time after it: the
            # commit, the clean-up, and the process living on with the new generation.
            delay = rng.uniform(0.9 * saved_after[scale], ended_after[scale] - 0.1 * save_loop.HOLD_AFTER_SAVES)
        else:
            # Uniform over the whole life of the helper and a bit past it: most kills land
            # before the commit, some after it, some too late.
            delay = rng.uniform(0.0, 1.15 * ended_after[scale])
        proc = _start_helper(prefix, generation)
        time.sleep(delay)
        proc.kill()  # SIGKILL
        _, err = proc.communicate(timeout=60)
        now = _committed_generation(prefix)  # reads, verifies, and is one generation exactly
        assert now in (committed, generation), f"generation {now} at the prefix, expected {committed} " \
                                                f"or {generation} (kill seed {seed})"
        if proc.returncode == 0:
            completed += 1
            assert now == generation
            _assert_clean(prefix)  # a save that ran to its end cleaned up after the dead ones
        else:
            assert proc.returncode == -9, f"helper failed by itself (rc {proc.returncode}, kill seed {seed}):\n{err}"
            names = _siblings(prefix)
            n = _num_shards(prefix)
            if now == generation:
                killed_after += 1
                if any("_temp_" in x or (".data-" in x and not x.endswith(f"-of-{n:05d}")) for x in names):
                    leftovers_after_commit += 1
            else:
                killed_before += 1
                if any(".data-" in x and not x.endswith(f"-of-{n:05d}") for x in names):
                    new_data_visible_before_commit += 1
        shard_counts.append(_num_shards(prefix))
        committed = now

    # A final save, in process, after all those deaths: whole, exact, and nothing left over.
    generation += 1
    save_loop.save(prefix, generation)
    assert _committed_generation(prefix) == generation
    _assert_clean(prefix)

    runtime = time.perf_counter() - test_started
    print(f"\nSIGKILL trials: {trials} (kill seed {seed}); killed before commit: {killed_before} "
          f"(with new data files already renamed: {new_data_visible_before_commit}); "
          f"killed after commit: {killed_after} (before cleanup finished: {leftovers_after_commit}); "
          f"finished before the kill: {completed}; shard counts seen: {sorted(set(shard_counts))}; "
          f"save durations by scale: { {s: round(d, 3) for s, d in sorted(saved_after.items())} }; "
          f"{runtime:.1f} s")
    assert killed_before >= 1, "no kill landed before the commit: widen or move the random window"
    assert killed_after >= 1, "no kill landed after the commit: widen or move the random window"


# -- 2. full disk -----------------------------------------------------------------

def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


class _FillingDisk:
    """Stands in for the ``os`` module of :mod:`shardckpt.storage.local`: a disk with ``budget`` bytes free.

    ``os.write`` writes what still fits (a short write, as the kernel does) and then
    fails with ENOSPC. Everything else is the real ``os``. With ``budget=None`` it
    only records ``(path, bytes)`` of every write. ``fail_fsync`` / ``fail_rename``
    make ``fsync`` of a matching file, or a rename onto a matching name, fail with
    ENOSPC (as delayed allocation and directory growth do).
    """

    def __init__(self, budget: Optional[int] = None, fail_fsync: Optional[str] = None,
                 fail_rename: Optional[str] = None) -> None:
        self.budget = budget
        self.written = 0
        self.writes: List[tuple] = []
        self.fail_fsync = re.compile(fail_fsync) if fail_fsync else None
        self.fail_rename = re.compile(fail_rename) if fail_rename else None
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, buf) -> int:
        with self._lock:
            if self.budget is not None:
                room = self.budget - self.written
                if room <= 0:
                    raise OSError(errno.ENOSPC, ENOSPC_TEXT)
                buf = buf[:room]
            n = os.write(fd, buf)
            self.written += n
            self.writes.append((_fd_path(fd), n))
            return n

    def fsync(self, fd: int) -> None:
        if self.fail_fsync is not None and self.fail_fsync.search(_fd_path(fd)):
            raise OSError(errno.ENOSPC, ENOSPC_TEXT)
        os.fsync(fd)

    def replace(self, src, dst) -> None:
        if self.fail_rename is not None and self.fail_rename.search(os.fspath(dst)):
            raise OSError(errno.ENOSPC, ENOSPC_TEXT)
        os.replace(src, dst)


_PART_DATA = r"/part-{shard:05d}-of-\d{{5}}\.data-00000-of-00001\.tempstate\d+$"
_PART_INDEX = r"/part-{shard:05d}-of-\d{{5}}\.index\.tempstate\d+$"
_MERGED_INDEX = r"/model\.index\.tempstate\d+$"
_ANY_SHARD_FILE = r"/model_temp_[0-9a-f]{32}/part-\d{5}-of-\d{5}\.(data-00000-of-00001|index)\.tempstate\d+$"


def _offsets(writes: List[tuple], pattern: str) -> tuple:
    """(total bytes written before the first write to a file matching ``pattern``, its size)."""
    regex = re.compile(pattern)
    before = 0
    for i, (path, _) in enumerate(writes):
        if regex.search(path):
            size = sum(n for p, n in writes[i:] if p == path)
            return before, size
        before += writes[i][1]
    raise AssertionError(f"no write to {pattern} in {[p for p, _ in writes]}")


# (case id, how to place the fault given the recorded writes, the file it must name)
_FULL_DISK_CASES = {
    "at-first-byte": (lambda w: 0, _PART_DATA.format(shard=0)),
    "inside-first-shard": (lambda w: _offsets(w, _PART_DATA.format(shard=0))[0]
                           + _offsets(w, _PART_DATA.format(shard=0))[1] // 2, _PART_DATA.format(shard=0)),
    "inside-later-shard": (lambda w: _offsets(w, _PART_DATA.format(shard=2))[0]
                           + _offsets(w, _PART_DATA.format(shard=2))[1] // 3, _PART_DATA.format(shard=2)),
    "in-shard-index": (lambda w: _offsets(w, _PART_INDEX.format(shard=1))[0] + 1, _PART_INDEX.format(shard=1)),
    "at-merged-index": (lambda w: _offsets(w, _MERGED_INDEX)[0], _MERGED_INDEX),
    "inside-merged-index": (lambda w: _offsets(w, _MERGED_INDEX)[0] + _offsets(w, _MERGED_INDEX)[1] - 1,
                            _MERGED_INDEX),
}


def _assert_enospc_error(exc: BaseException, file_pattern: str) -> None:
    assert isinstance(exc, ShardckptError), f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, StorageError), f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, OSError)
    message = str(exc)
    assert ENOSPC_TEXT in message, message
    assert exc.path is not None and re.search(file_pattern, exc.path), f"{exc.path!r} !~ {file_pattern}"
    assert exc.path in message, message


def _assert_previous_intact(prefix: str, generation: int) -> None:
    assert _committed_generation(prefix) == generation
    _assert_clean(prefix)


@pytest.mark.parametrize("new_generation", [1, 2], ids=["same-shard-count", "other-shard-count"])
@pytest.mark.parametrize("case", sorted(_FULL_DISK_CASES))
def test_full_disk_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             case: str, new_generation: int) -> None:
    place, file_pattern = _FULL_DISK_CASES[case]
    prefix = str(tmp_path / "model")
    save_loop.save(prefix, 0)

    # Record where the bytes of the new save go, in a copy (same names, same shard counts).
    rehearsal = tmp_path / "rehearsal"
    rehearsal.mkdir()
    for name in _siblings(prefix):
        shutil.copy(tmp_path / name, rehearsal / name)
    recorder = _FillingDisk()
    monkeypatch.setattr(local_storage, "os", recorder)
    shardckpt.save_tensors(str(rehearsal / "model"), make_tensors(new_generation), _options(), max_workers=1)
    monkeypatch.undo()
    shutil.rmtree(rehearsal)
    assert _num_shards(prefix) >= 3

    disk = _FillingDisk(budget=place(recorder.writes))
    monkeypatch.setattr(local_storage, "os", disk)
    with pytest.raises(ShardckptError) as info:
        shardckpt.save_tensors(prefix, make_tensors(new_generation), _options(), max_workers=1)
    monkeypatch.undo()
    _assert_enospc_error(info.value, file_pattern)
    _assert_previous_intact(prefix, 0)

    # Space again: the next save works and leaves only itself.
    save_loop.save(prefix, new_generation)
    _assert_previous_intact(prefix, new_generation)


def test_full_disk_during_parallel_shard_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = str(tmp_path / "model")
    save_loop.save(prefix, 0)
    total = sum(v.nbytes for v in make_tensors(3).values() if v.dtype != object)
    disk = _FillingDisk(budget=total // 2)
    monkeypatch.setattr(local_storage, "os", disk)
    with pytest.raises(ShardckptError) as info:
        shardckpt.save_tensors(prefix, make_tensors(3), _options(), max_workers=4)
    monkeypatch.undo()
    _assert_enospc_error(info.value, _ANY_SHARD_FILE)
    _assert_previous_intact(prefix, 0)


def test_enospc_from_fsync_of_the_index_keeps_previous_checkpoint(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Filesystems with delayed allocation report a full disk at fsync, not at write."""
    prefix = str(tmp_path / "model")
    save_loop.save(prefix, 0)
    monkeypatch.setattr(local_storage, "os", _FillingDisk(fail_fsync=_MERGED_INDEX))
    with pytest.raises(ShardckptError) as info:
        save_loop.save(prefix, 1)
    monkeypatch.undo()
    _assert_enospc_error(info.value, _MERGED_INDEX)
    _assert_previous_intact(prefix, 0)


def test_enospc_from_the_index_rename_leaves_no_tempstate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rename() can fail with ENOSPC (the directory must grow); the written index temp must go too."""
    prefix = str(tmp_path / "model")
    save_loop.save(prefix, 0)
    monkeypatch.setattr(local_storage, "os", _FillingDisk(fail_rename=r"/model\.index$"))
    with pytest.raises(ShardckptError) as info:
        save_loop.save(prefix, 1)
    monkeypatch.undo()
    assert ENOSPC_TEXT in str(info.value)
    assert _committed_generation(prefix) == 0
    _assert_clean(prefix)  # no model.index.tempstate<N> left behind


# -- 2b. a real full filesystem (tmpfs; we are root in a container that permits mounts) --

@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 2 MiB tmpfs mounted on a fresh folder. Not being allowed to mount is a failure, not a skip."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail("cannot mount a tmpfs for the real full-disk tests (they need root and mount "
                    f"permission): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def _small_tensors(generation: int, kib_per_tensor: int, count: int = 6) -> Dict[str, np.ndarray]:
    n = kib_per_tensor * 128  # int64 elements
    tensors = {"generation": np.array(generation, dtype=np.int64)}
    for i in range(count):
        tensors[f"w{i}"] = (np.int64(generation) << 40) | (np.int64(i) << 32) | np.arange(n, dtype=np.int64)
    return tensors


_SMALL_POLICY = 256 << 10


def _save_small(prefix: str, tensors: Dict[str, np.ndarray]) -> None:
    shardckpt.save_tensors(prefix, tensors, _options(_SMALL_POLICY))


def test_real_full_tmpfs_during_data_writes(small_tmpfs: Path) -> None:
    prefix = str(small_tmpfs / "model")
    old = _small_tensors(1, 100)  # 600 KiB, 3 shards
    _save_small(prefix, old)
    assert _assert_holds_exactly(prefix, old) == 3
    with pytest.raises(ShardckptError) as info:
        _save_small(prefix, _small_tensors(2, 260))  # 1.5 MiB more does not fit in 2 MiB
    _assert_enospc_error(info.value, _ANY_SHARD_FILE)
    assert _assert_holds_exactly(prefix, old) == 3
    _assert_clean(prefix)
    # After the failure all space is back: a save that fits next to the old one succeeds.
    new = _small_tensors(3, 100)
    _save_small(prefix, new)
    _assert_holds_exactly(prefix, new)
    _assert_clean(prefix)


def test_real_full_tmpfs_at_the_index_write(small_tmpfs: Path) -> None:
    """Fill the disk so that exactly the merged index no longer fits (found by bisection)."""
    prefix = str(small_tmpfs / "model")
    filler = small_tmpfs / "filler"
    old, new = _small_tensors(1, 100), _small_tensors(2, 100)  # same shard count: 3, then 4 with padding

    def attempt(filler_bytes: int) -> Optional[BaseException]:
        for name in os.listdir(small_tmpfs):
            path = small_tmpfs / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        _save_small(prefix, old)
        with open(filler, "wb") as f:
            f.write(b"\0" * filler_bytes)
        try:
            _save_small(prefix, new)
        except ShardckptError as exc:
            return exc
        return None

    page = 4096
    assert attempt(0) is None
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    lo, hi = 0, (free // page) * page  # hi: the disk is full before the save starts
    assert attempt(hi) is not None
    while hi - lo > page:
        mid = (lo + hi) // 2 // page * page
        if attempt(mid) is None:
            lo = mid
        else:
            hi = mid
    failure = attempt(hi)
    assert failure is not None
    _assert_enospc_error(failure, _MERGED_INDEX)
    assert _assert_holds_exactly(prefix, old) == 3
    _assert_clean(prefix)
    filler.unlink()
    _save_small(prefix, new)
    assert _assert_holds_exactly(prefix, new) == 4
    _assert_clean(prefix)


# -- 3. same-prefix overwrite atomicity, without killing ---------------------------

_MIB = 1 << 20


def _three_shard_tensors(generation: int) -> Dict[str, np.ndarray]:
    """Three 1 MiB tensors: three shards under a 1 MiB policy."""
    n = _MIB // 8
    return {f"t{i}": (np.int64(generation) << 40) | (np.int64(i) << 32) | np.arange(n, dtype=np.int64)
            for i in range(3)}


def _save_three(prefix: str, generation: int) -> None:
    shardckpt.save_tensors(prefix, _three_shard_tensors(generation), _options(_MIB))


def _data_files(prefix: str) -> Set[str]:
    return {n for n in _siblings(prefix) if ".data-" in n}


class _FailingIndexWrite(FileSystemWrapper):
    """The local filesystem; ``write_atomic`` of ``path`` raises ``exc()`` before or ``after`` writing."""

    def __init__(self, path: str, exc: Callable[[], BaseException], after: bool = False,
                 seen: Optional[Callable[[], None]] = None) -> None:
        super().__init__(LocalFileSystem())
        self.path, self.exc, self.after, self.seen = os.path.abspath(path), exc, after, seen

    def write_atomic(self, target: str, data: bytes, *, fsync: bool = False) -> None:
        hit = os.path.abspath(target) == self.path
        if hit and self.seen is not None:
            self.seen()
        if hit and not self.after:
            raise self.exc()
        self.inner.write_atomic(target, data, fsync=fsync)
        if hit and self.after:
            raise self.exc()


def test_failed_index_write_over_same_shard_count_keeps_old_checkpoint(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = str(tmp_path / "model")
    a, b = _three_shard_tensors(1), _three_shard_tensors(2)
    _save_three(prefix, 1)
    assert _assert_holds_exactly(prefix, a) == 3
    a_files = _data_files(prefix)
    a_bytes = {n: (tmp_path / n).read_bytes() for n in a_files}
    assert len(a_files) == 3

    seen: List[Set[str]] = []
    failing = _FailingIndexWrite(prefix + ".index",
                                 lambda: StorageError("injected failure before the index rename", path=prefix),
                                 seen=lambda: seen.append(_data_files(prefix)))  # on disk right before the commit
    with mounted(failing), pytest.raises(StorageError, match="injected failure"):
        _save_three(prefix, 2)
    # Right before the commit B's data files were there beside A's, under other names (4 shards: 3 + 1 empty).
    assert seen and seen[0] == a_files | {f"model.data-{i:05d}-of-00004" for i in range(4)}
    # A is still exactly A, byte for byte, and B's data files are gone again.
    assert _assert_holds_exactly(prefix, a) == 3
    assert {n: (tmp_path / n).read_bytes() for n in _data_files(prefix)} == a_bytes
    _assert_clean(prefix)

    _save_three(prefix, 2)
    assert _assert_holds_exactly(prefix, b) == 4  # the extra empty shard kept A's names free
    assert not (_data_files(prefix) & a_files)
    _assert_clean(prefix)
    # And back to 3 shards: B's 4 data files do not clash with 3.
    _save_three(prefix, 3)
    assert _assert_holds_exactly(prefix, _three_shard_tensors(3)) == 3
    _assert_clean(prefix)


@pytest.mark.parametrize("failure", ["StorageError", "KeyboardInterrupt"])
def test_failure_right_after_the_commit_keeps_a_readable_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    failure: str) -> None:
    """An error after the index rename (a failing directory fsync, Ctrl-C) must not break the checkpoint.

    The save may report the error, but the prefix must then hold A or B, whole.
    """
    prefix = str(tmp_path / "model")
    a, b = _three_shard_tensors(1), _three_shard_tensors(2)
    _save_three(prefix, 1)
    make_exc = (lambda: StorageError("fsync directory failed: Input/output error", path=str(tmp_path))) \
        if failure == "StorageError" else KeyboardInterrupt
    with mounted(_FailingIndexWrite(prefix + ".index", make_exc, after=True)), \
            pytest.raises((StorageError, KeyboardInterrupt)):
        _save_three(prefix, 2)
    with shardckpt.load_checkpoint(prefix) as reader:
        generation_of_t0 = int(reader.get_tensor("t0")[0]) >> 40
    _assert_holds_exactly(prefix, a if generation_of_t0 == 1 else b)
    # And the next save cleans up whatever is left.
    _save_three(prefix, 3)
    _assert_holds_exactly(prefix, _three_shard_tensors(3))
    _assert_clean(prefix)
