"""Racing writers and dead saves' leftovers on a local disk (issue 16, defect 10 and "racing writers").

Real processes (tests/helpers/local_race_writer.py), no mocks:

* two processes saving to **one prefix** at once, while this test reads it in a loop:
  every read that succeeds is one writer's one generation, whole (every checksum verified),
  never a mix; both writers' saves all succeed; at the end the prefix holds the last save
  of one of them (the last commit wins: never an earlier generation) and nothing else;
* two ``CheckpointManager``\\ s in **one directory**, while this test, holding the folder's
  lock (the lock every commit, state-file write and deletion takes), checks again and
  again that the state file names only complete checkpoints; their retention deletions
  and cleaning race the other's saves;
* a save that lives long (slow writes) while another process saves to the same prefix:
  the other's cleaning leaves the live save's temporary folder alone, both commit, the
  later one wins;
* a save SIGKILLed while writing leaves a temporary folder; the next manager save removes
  it and does not touch the complete checkpoints (same inodes, same bytes).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import pytest

import shardckpt
from shardckpt.errors import CheckpointReplacedError, DataLossError, ShardckptError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.local import local_fs
from shardckpt.storage.location import Location
from shardckpt.storage.wrappers import FileSystemWrapper

HELPERS = Path(__file__).resolve().parent / "helpers"
WRITER = HELPERS / "local_race_writer.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

import local_race_writer  # noqa: E402  (tests/helpers)
from launchers import clean_env  # noqa: E402

values = local_race_writer.values


def _start(kind: str, where: str, writer: int, count: int, slow: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, str(WRITER), kind, where, str(writer), str(count)] + ([str(slow)] if slow else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"writer did not start: {line!r}\n{proc.communicate()[1]}")
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 120) -> List[str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"writer exit {proc.returncode}:\n{out}\n{err}"
    return out.splitlines()


def _generation_of(prefix: str, key=lambda name: name) -> Tuple[int, int]:
    """(writer, generation) of the checkpoint at ``prefix``, after checking it is exactly that, whole."""
    with shardckpt.load_checkpoint(prefix) as reader:
        writer, generation = (int(x) for x in reader.get_tensor(key("tag")))
        want = values(writer, generation)
        stored = {k.decode() for k in reader.bundle.keys()}
        assert {key(n) for n in want} <= stored, (prefix, sorted(stored))
        for name, value in want.items():
            reader.bundle.verify(key(name))
            got = reader.get_tensor(key(name))
            if value.dtype == object:
                assert [bytes(x) for x in got.ravel()] == [bytes(x) for x in value.ravel()], (prefix, name)
            else:
                assert got.dtype == value.dtype and np.array_equal(got, value), \
                    f"{prefix}: {name} is not writer {writer}'s generation {generation}"
    return writer, generation


def _own_files(prefix: str) -> Set[str]:
    with shardckpt.load_checkpoint(prefix) as reader:
        n = reader.bundle.num_shards
    base = os.path.basename(prefix)
    return {f"{base}.index"} | {f"{base}.data-{i:05d}-of-{n:05d}" for i in range(n)}


class _Reader(threading.Thread):
    """Reads ``check()`` in a loop until stopped; collects what it saw and every wrong answer.

    ``allowed``: the errors a read may raise (the checkpoint changed under it); any other, and a
    ``DataLossError`` always (the files are healthy), is a wrong answer."""

    def __init__(self, check, allowed: Tuple[type, ...] = (ShardckptError,)) -> None:
        super().__init__(daemon=True)
        self.check = check
        self.allowed = allowed
        self.stop = threading.Event()
        self.seen: Dict[object, int] = {}
        self.errors: Dict[str, int] = {}
        self.wrong: List[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                got = self.check()
                self.seen[got] = self.seen.get(got, 0) + 1
            except ShardckptError as exc:  # the checkpoint changed under the reader: a clear error is fine
                damage = isinstance(exc, DataLossError) and not isinstance(exc, CheckpointReplacedError)
                if damage or not isinstance(exc, self.allowed):  # healthy files: damage is a reader's mistake
                    self.wrong.append(f"{type(exc).__name__}: {exc}")
                self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
            except AssertionError as exc:  # wrong values, a mix, a missing key: never
                self.wrong.append(str(exc))
            time.sleep(0.002)


# -- two processes, one prefix ------------------------------------------------------------

def test_two_processes_racing_on_one_prefix_leave_one_whole_checkpoint_and_the_last_commit_wins(
        tmp_path: Path) -> None:
    prefix = str(tmp_path / "model")
    count = 6
    reader = _Reader(lambda: _generation_of(prefix) if os.path.exists(prefix + ".index") else None,
                     allowed=(CheckpointReplacedError,))
    writers = [_start("prefix", prefix, w, count) for w in (1, 2)]
    reader.start()
    outputs = [_finish(p) for p in writers]
    reader.stop.set()
    reader.join()
    for w, lines in zip((1, 2), outputs):
        assert lines == [f"SAVED {w} {g}" for g in range(1, count + 1)], lines  # every save succeeded
    assert not reader.wrong, reader.wrong[:3]
    seen = {k for k in reader.seen if k is not None}
    assert seen, f"the reader never read a checkpoint during the race (errors: {reader.errors})"
    final = _generation_of(prefix)
    assert final in {(1, count), (2, count)}, f"{final}: not the last save of either writer"
    names = set(os.listdir(tmp_path))
    assert names == _own_files(prefix), f"beside the checkpoint: {sorted(names - _own_files(prefix))}"
    print(f"\nreads during the race: {sum(reader.seen.values())} whole ({len(seen)} distinct generations), "
          f"clear errors {reader.errors}; final {final}")


def test_a_live_save_is_never_taken_for_leftovers_by_another_process(tmp_path: Path) -> None:
    prefix = str(tmp_path / "model")
    shardckpt.save_tensors(prefix, values(0, 1))
    slow = _start("prefix", prefix, 1, 1, slow=0.05)  # a long save: its writes into the temp folder crawl
    deadline = time.monotonic() + 60
    while not any("_temp_" in n for n in os.listdir(tmp_path)):
        assert time.monotonic() < deadline and slow.poll() is None, "the slow save never made its folder"
        time.sleep(0.01)
    live = {n for n in os.listdir(tmp_path) if "_temp_" in n}
    # this process saves to the same prefix and commits while the other is still writing
    shardckpt.save_tensors(prefix, values(2, 7))
    assert _generation_of(prefix) == (2, 7)
    assert live <= set(os.listdir(tmp_path)), "another save removed a live save's temporary folder"
    assert slow.poll() is None, "the slow save ended before the race was run: slow it down"
    assert _finish(slow) == ["SAVED 1 1"]
    assert _generation_of(prefix) == (1, 1)  # its commit came last: it wins, whole
    assert set(os.listdir(tmp_path)) == _own_files(prefix)


# -- two managers, one directory ----------------------------------------------------------

def _key(name: str) -> str:
    return f"model/{name}/.ATTRIBUTES/VARIABLE_VALUE"


def _state_names_only_complete_checkpoints(directory: str) -> Optional[Tuple[str, ...]]:
    """Under the folder's lock: the state file parses and every checkpoint it names is whole."""
    with local_fs.exclusive(directory):
        state = shardckpt.get_checkpoint_state(directory)
        if state is None:
            return None
        named = list(dict.fromkeys([state.model_checkpoint_path] + list(state.all_model_checkpoint_paths)))
        for prefix in named:
            assert os.path.exists(prefix + ".index"), f"the state file names {prefix}, which is not there"
            _, generation = _generation_of(prefix, _key)
            assert prefix.endswith(f"ckpt-{generation}"), f"{prefix} holds generation {generation}"
        assert shardckpt.latest_checkpoint(directory) == state.model_checkpoint_path
        return tuple(os.path.basename(p) for p in named)


def test_two_managers_in_one_directory_never_name_an_incomplete_checkpoint(tmp_path: Path) -> None:
    directory = str(tmp_path / "run")
    os.makedirs(directory)
    count = 8
    reader = _Reader(lambda: _state_names_only_complete_checkpoints(directory))
    managers = [_start("manager", directory, w, count) for w in (1, 2)]
    reader.start()
    outputs = [_finish(p) for p in managers]
    reader.stop.set()
    reader.join()
    assert not reader.wrong, reader.wrong[:3]
    assert not reader.errors, reader.errors  # under the lock nothing changes: no error may show
    assert len(reader.seen) >= 2, reader.seen
    failed = [line for lines in outputs for line in lines if line.startswith("FAILED")]
    # A save may lose only clearly: its checkpoint was deleted by the other manager's retention
    # before its state file named it (the state file then still names what the other kept).
    for line in failed:
        assert re.match(r"FAILED \d \d+ NotFoundError: the checkpoint just committed is gone", line), line
    final = _state_names_only_complete_checkpoints(directory)
    assert final is not None and final[0] == f"ckpt-{count}", final
    # what remains: the state file and whole checkpoints; no temporary folder or stray file
    names = set(os.listdir(directory))
    kept: Set[str] = {"checkpoint"}
    for name in names:
        m = re.fullmatch(r"(ckpt-\d+)\.index", name)
        if m:
            _generation_of(os.path.join(directory, m.group(1)), _key)
            kept |= _own_files(os.path.join(directory, m.group(1)))
    assert names == kept, f"leftovers: {sorted(names - kept)}"
    print(f"\nstate-file snapshots checked under the lock: {sum(reader.seen.values())} "
          f"({len(reader.seen)} distinct); failed saves: {len(failed)}")


# -- a killed save's leftovers ------------------------------------------------------------

def _fingerprint(directory: Path, prefix: str) -> Dict[str, Tuple[int, str]]:
    return {p.name: (p.stat().st_ino, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.iterdir()) if p.name == f"{prefix}.index" or p.name.startswith(f"{prefix}.data-")}


@pytest.mark.parametrize("moment", ["first-write", "mid-write"])
def test_a_killed_saves_leftovers_are_removed_by_the_next_save_and_complete_checkpoints_untouched(
        tmp_path: Path, moment: str) -> None:
    directory = tmp_path / "run"
    model = shardckpt.Module()
    for name, value in values(0, 1).items():
        setattr(model, name, shardckpt.Variable(value, name=name))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), str(directory), max_to_keep=5)
    for g in (1, 2):
        manager.save(checkpoint_number=g)
    before = {p: _fingerprint(directory, p) for p in ("ckpt-1", "ckpt-2")}
    state_before = (directory / "checkpoint").read_bytes()

    victim = _start("manager", str(directory), 1, 3, slow=0.05)  # saves ckpt-1.. of its own: slowly
    deadline = time.monotonic() + 60
    while True:
        temps = [p for p in directory.iterdir() if "_temp_" in p.name]
        files = [f for t in temps for f in t.iterdir()] if temps else []
        if temps and (moment == "first-write" or any(f.stat().st_size > 0 for f in files if ".data-" in f.name)):
            break
        assert time.monotonic() < deadline and victim.poll() is None, "the save never reached the moment"
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    leftovers = sorted(p.name for p in directory.iterdir() if "_temp_" in p.name)
    assert leftovers, "the kill left nothing to clean: the test shows nothing"
    assert (directory / "checkpoint").read_bytes() == state_before  # a dead save never touches the state
    assert {p: _fingerprint(directory, p) for p in ("ckpt-1", "ckpt-2")} == before

    manager.save(checkpoint_number=3)  # the next save cleans what the dead one left
    names = sorted(p.name for p in directory.iterdir())
    assert not [n for n in names if "_temp_" in n or ".tempstate" in n], names
    assert {p: _fingerprint(directory, p) for p in ("ckpt-1", "ckpt-2")} == before  # same inodes, same bytes
    assert shardckpt.latest_checkpoint(str(directory)) == str(directory / "ckpt-3")
    expected = {"checkpoint"} | set(before["ckpt-1"]) | set(before["ckpt-2"]) \
        | _own_files(str(directory / "ckpt-3"))
    assert set(names) == expected, sorted(set(names) ^ expected)


def test_two_managers_in_one_process_state_file_lists_only_checkpoints_that_exist(tmp_path: Path) -> None:
    """Manager b, one save ahead, deletes ckpt-1; manager a (which still keeps ckpt-1) records next:
    the state file it writes must not list the deleted checkpoint."""
    directory = str(tmp_path)

    def manager(writer: int) -> shardckpt.CheckpointManager:
        model = shardckpt.Module()
        model.tag = shardckpt.Variable(np.array([writer, 0], np.int64))
        return shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), directory, max_to_keep=2)

    a, b = manager(1), manager(2)
    a.save(checkpoint_number=1)
    for n in (1, 2, 3):
        b.save(checkpoint_number=n)  # the third deletes ckpt-1
    assert not os.path.exists(os.path.join(directory, "ckpt-1.index"))
    a.save(checkpoint_number=2)  # last record wins: ckpt-2 (a's) is latest; ckpt-1 is not listed
    state = shardckpt.get_checkpoint_state(directory)
    assert state is not None
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["ckpt-2"]
    assert shardckpt.latest_checkpoint(directory) == os.path.join(directory, "ckpt-2")
    assert a.checkpoints == [os.path.join(directory, "ckpt-2")]


def test_a_dead_state_file_write_is_removed_by_the_next_manager_save(tmp_path: Path) -> None:
    model = shardckpt.Module()
    model.v = shardckpt.Variable(np.arange(4.0))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), str(tmp_path), max_to_keep=2)
    manager.save()
    # what a process killed inside the state file's atomic write leaves: the write, never renamed
    (tmp_path / "checkpoint.tempstate8346012345").write_bytes(b"model_checkpoint_path: \"ckpt-9\"\n")
    (tmp_path / "checkpoint.tempstate_not_ours").write_bytes(b"x")  # not a name we write: kept
    manager.save()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == \
        ["checkpoint", "checkpoint.tempstate_not_ours"]
    # a plain Checkpoint.save writes the state file under the same lock, and cleans nothing
    shardckpt.Checkpoint(model=model).save(str(tmp_path / "other"))
    assert shardckpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "other-1")


def test_a_manager_killed_between_the_state_file_and_its_deletions_has_them_finished_by_the_next_save(
        tmp_path: Path) -> None:
    """The process dies right after the state file stopped naming ckpt-1 (max_to_keep=2, third save),
    before ckpt-1 is deleted: the next save of a manager in that folder deletes it, and nothing else."""
    directory = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(WRITER), "manager", str(directory), "1", "5", "0", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, out, err)
    assert out.split("\n")[:3] == ["READY", "SAVED 1 1", "SAVED 1 2"], out
    state = shardckpt.get_checkpoint_state(str(directory))
    assert state is not None and [os.path.basename(p) for p in state.all_model_checkpoint_paths] == \
        ["ckpt-2", "ckpt-3"]
    assert (directory / "ckpt-1.index").exists(), "the kill came too late: ckpt-1 is already deleted"
    assert (directory / "ckpt-1.deleting").exists()
    kept = {p: _fingerprint(directory, p) for p in ("ckpt-2", "ckpt-3")}

    model = shardckpt.Module()
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), str(directory), max_to_keep=3)
    for name, value in values(9, 4).items():
        setattr(model, name, shardckpt.Variable(value, name=name))
    manager.save(checkpoint_number=4)
    names = sorted(p.name for p in directory.iterdir())
    assert not [n for n in names if n.startswith("ckpt-1.") or n.endswith(".deleting")], names
    assert {p: _fingerprint(directory, p) for p in ("ckpt-2", "ckpt-3")} == kept
    assert shardckpt.latest_checkpoint(str(directory)) == str(directory / "ckpt-4")


def test_a_deletion_marker_of_a_checkpoint_named_again_removes_only_the_marker(tmp_path: Path) -> None:
    model = shardckpt.Module()
    model.v = shardckpt.Variable(np.arange(3.0))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), str(tmp_path), max_to_keep=2)
    manager.save(checkpoint_number=1)
    (tmp_path / "ckpt-1.deleting").write_bytes(b"")  # a dead manager's, before ckpt-1 was saved again
    manager.save(checkpoint_number=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]


# -- a reader opening the prefix while writers replace it ---------------------------------------

class _ReplacedWhileOpening(FileSystemWrapper):
    """The local disk, where each read of the index (a reader opening it) is followed by the next of
    ``meanwhile``: what racing writers did at that moment."""

    def __init__(self, meanwhile: list) -> None:
        super().__init__(local_fs)
        self.meanwhile = list(meanwhile)

    def read_bytes(self, path: str) -> bytes:
        data = self.inner.read_bytes(path)
        if path.endswith(".index") and self.meanwhile:
            self.meanwhile.pop(0)()
        return data


def _shards(prefix: str) -> int:
    with BundleReader(Location.of(prefix)) as reader:
        return reader.num_shards


@pytest.mark.parametrize("then", ["nothing", "another-save-renames-its-data-in"])
def test_a_reader_whose_first_open_saw_an_index_replaced_reads_the_new_checkpoint_whole(
        tmp_path: Path, then: str) -> None:
    """Issue 24, section 6: the reader reads the index of generation A; the prefix is overwritten by B
    (another shard count) before it checks that index again, so it opens again, on B's index. That
    second open must pair B's index with B's data files: it used the data file names of A's shard count
    (cached by the first attempt), so it raised NotFoundError or, when a third save had meanwhile
    renamed its data files in under A's names (before its own commit), "checksum does not match" on
    healthy files."""
    prefix = str(tmp_path / "model")
    options = shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(local_race_writer.MAX_SHARD))
    shardckpt.save_tensors(prefix, values(1, 1), options)
    count_a = _shards(prefix)
    other = str(tmp_path / "other" / "model")
    shardckpt.save_tensors(other, values(3, 1), options)  # A's shard count, other bytes
    assert _shards(other) == count_a

    def overwrite() -> None:  # B commits (its commit removes A's data files)
        shardckpt.save_tensors(prefix, values(2, 2), options)
        assert _shards(prefix) != count_a

    def rename_in() -> None:  # a third writer's data files, under A's names, not committed yet
        for i in range(count_a):
            name = f"model.data-{i:05d}-of-{count_a:05d}"
            os.link(os.path.join(os.path.dirname(other), name), tmp_path / name)

    meanwhile = [overwrite] + ([rename_in] if then != "nothing" else [])
    with BundleReader(prefix, fs=_ReplacedWhileOpening(meanwhile)) as bundle:
        got = {name: bundle.read(name) for name in values(2, 2)}
    assert int(got["tag"][0]) == 2 and int(got["tag"][1]) == 2
    for name, value in values(2, 2).items():
        if value.dtype == object:
            assert [bytes(x) for x in got[name].ravel()] == [bytes(x) for x in value.ravel()]
        else:
            np.testing.assert_array_equal(got[name], value)


def test_a_data_file_deleted_after_the_index_was_opened_is_a_replaced_checkpoint(tmp_path: Path) -> None:
    """The prefix overwritten (another shard count) between opening the index and reading a data file:
    the file the index named is gone, and the reader says the checkpoint was replaced (not that a file of
    the checkpoint is missing)."""
    prefix = str(tmp_path / "model")
    options = shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(local_race_writer.MAX_SHARD))
    shardckpt.save_tensors(prefix, values(1, 1), options)
    with BundleReader(Location.of(prefix)) as bundle:
        shardckpt.save_tensors(prefix, values(2, 2), options)
        with pytest.raises(CheckpointReplacedError, match="deleted after the index was opened"):
            bundle.read("a")
