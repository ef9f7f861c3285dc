"""Incremental saves (issue 14): unchanged tensors are never written twice — linked locally, copied
server-side on object stores — and every checkpoint stays a complete TensorFlow checkpoint.

Bytes written are counted with ``RecordingFileSystem`` (every write of a save), shared data files
by their inode link counts, object-store uploads by the store's own counters.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest

import shardckpt
from shardckpt import CheckpointOptions, MaxShardSizePolicy
from shardckpt.saving.incremental import data_file_origins, sidecar_filename
from shardckpt.storage.local import local_fs
from shardckpt.storage.registry import get_fs, mounted
from shardckpt.storage.wrappers import RecordingFileSystem

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from crash_states import check_all, snapshot  # noqa: E402  (tests/helpers)
from launchers import clean_env, tool  # noqa: E402  (tests/helpers)

INCREMENTAL = CheckpointOptions(incremental=True)
FROZEN, ADAPTER = 6, 2
N_FROZEN, N_ADAPTER = 256 << 10, 4 << 10  # float32 elements: 1 MiB frozen, 16 KiB adapters


def _model(seed: int = 0) -> shardckpt.Module:
    rng = np.random.default_rng(seed)
    m = shardckpt.Module()
    m.frozen = [shardckpt.Variable(rng.standard_normal(N_FROZEN).astype(np.float32)) for _ in range(FROZEN)]
    m.adapter = [shardckpt.Variable(np.zeros(N_ADAPTER, np.float32)) for _ in range(ADAPTER)]
    return m


def _values(m: shardckpt.Module) -> List[np.ndarray]:
    return [v.numpy() for v in list(m.frozen) + list(m.adapter)]


def _restored(prefix: str) -> List[np.ndarray]:
    fresh = _model(seed=99)
    shardckpt.Checkpoint(model=fresh).read(prefix).assert_existing_objects_matched()
    return _values(fresh)


def _same(a: List[np.ndarray], b: List[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


def _data_bytes(ops: List[Any]) -> int:
    """Bytes written into data files (parts in the temp folder or final names) by recorded operations."""
    return sum(len(extra) for kind, path, extra in ops if kind == "write" and ".data-" in os.path.basename(path))


def _read_all(prefix: str) -> Dict[str, np.ndarray]:
    with shardckpt.load_checkpoint(prefix) as reader:
        return {k: np.asarray(reader.get_tensor(k)) for k in reader.get_variable_to_shape_map()}


# -- a manager saving ten checkpoints -------------------------------------------------------------

def test_manager_ten_saves_write_only_what_changed(tmp_path: Path, tf_oracle: Any) -> None:
    model = _model()
    ckpt = shardckpt.Checkpoint(model=model)
    manager = shardckpt.CheckpointManager(ckpt, str(tmp_path), max_to_keep=3, incremental=True)
    recording = RecordingFileSystem(local_fs)
    expected: Dict[str, List[np.ndarray]] = {}
    written: List[int] = []
    changed = ADAPTER * N_ADAPTER * 4
    with mounted(recording):
        for step in range(10):
            for v in model.adapter:
                v.assign_add(np.full(N_ADAPTER, step + 1, np.float32))
            if step == 6:  # one frozen tensor changes once: only its file is rewritten
                model.frozen[2].assign_add(np.ones(N_FROZEN, np.float32))
            before = len(recording.ops)
            path = manager.save()
            assert path is not None
            expected[path] = _values(model)
            written.append(_data_bytes(recording.ops[before:]))
    total = (FROZEN * N_FROZEN + ADAPTER * N_ADAPTER) * 4
    assert written[0] >= total
    # from the second save on, only the adapters (and the save counter / object graph) are written;
    # at step 6 also the frozen tensor that changed (in the file of the changed pieces, which step 7
    # links: the tensor is read from there, the adapters' old bytes in it are named by no entry)
    for step in range(1, 10):
        extra = N_FROZEN * 4 if step == 6 else 0
        assert changed + extra <= written[step] <= changed + extra + 8192, (step, written)
    kept = manager.checkpoints
    assert len(kept) == 3 and kept[-1].endswith("ckpt-10")
    for path in kept:
        assert _same(_restored(path), expected[path]), path
        shared = [f for f in os.listdir(tmp_path) if f.startswith(os.path.basename(path) + ".data-")
                  and os.stat(tmp_path / f).st_nlink >= 2]
        assert shared, f"{path}: no data file shared with a neighbour"
    # every older checkpoint is gone; TensorFlow reads the middle one on its own
    assert not any(f.startswith(("ckpt-1.", "ckpt-7.")) for f in os.listdir(tmp_path))
    middle = kept[1]
    got, errors, _ = tf_oracle.load_checkpoint(middle)
    assert errors == {}
    ours = _read_all(middle)
    assert set(got) == set(ours)
    for key, value in ours.items():
        assert np.array_equal(np.asarray(got[key]), value), key
    # inspect tells linked files from written ones
    from shardckpt.cli.main import main as cli
    out = subprocess.run([sys.executable, "-m", "shardckpt.cli.main", "inspect", kept[-1]], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "linked from ckpt-9.data-" in out.stdout and "written" in out.stdout, out.stdout
    assert "shared with the previous checkpoint" in out.stdout
    assert callable(cli)


def test_deleting_the_previous_checkpoint_keeps_the_newer_one(tmp_path: Path, tf_oracle: Any) -> None:
    model = _model(1)
    ckpt = shardckpt.Checkpoint(model=model)
    first = ckpt.save(str(tmp_path / "ck"), options=INCREMENTAL)
    model.adapter[0].assign(np.arange(N_ADAPTER, dtype=np.float32))
    second = ckpt.save(str(tmp_path / "ck"), options=INCREMENTAL)
    model.adapter[1].assign(np.ones(N_ADAPTER, np.float32))
    third = ckpt.save(str(tmp_path / "ck"), options=INCREMENTAL)
    want = _values(model)
    origins = data_file_origins(third, local_fs)
    assert origins is not None and any(o["how"] == "link" for o in origins.values())
    for prefix in (first, second):
        for name in os.listdir(tmp_path):
            if name.startswith(os.path.basename(prefix) + "."):
                os.remove(tmp_path / name)
    assert _same(_restored(third), want)
    got, errors, _ = tf_oracle.load_checkpoint(third)
    assert errors == {}
    for key, value in _read_all(third).items():
        assert np.array_equal(np.asarray(got[key]), value), key


def _data_files(prefix: str) -> List[Path]:
    folder, base = os.path.split(prefix)
    return sorted(Path(folder) / n for n in os.listdir(folder) if n.startswith(base + ".data-"))


def _named_bytes(prefix: str) -> int:
    """Bytes the index of ``prefix`` names (every entry's size)."""
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.storage.location import Location

    with BundleReader(Location.of(prefix)) as reader:
        return sum(int(reader.entry(k).size) for k in reader.keys(include_slices=True))


def test_chain_of_partial_changes_keeps_few_data_files(tmp_path: Path, tf_oracle: Any) -> None:
    """Fifteen saves, each changing another few tensors: a checkpoint never has more than one data file
    per callback shard plus EXTRA_LINKED_FILES linked plus two written, its files hold at most
    1/LIVE_FRACTION of the bytes it names, most saves write much less than the state, and every
    checkpoint the manager keeps restores exactly (and in TensorFlow) after retention deleted the
    older ones that its linked files came from."""
    from shardckpt.saving.incremental import EXTRA_LINKED_FILES, LIVE_FRACTION

    rng = np.random.default_rng(21)
    count, size = 24, 64 << 10  # float32 elements: 24 tensors of 256 KiB
    model = shardckpt.Module()
    model.w = [shardckpt.Variable(rng.standard_normal(size).astype(np.float32)) for _ in range(count)]
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), str(tmp_path), max_to_keep=2,
                                          incremental=True)
    recording = RecordingFileSystem(local_fs)
    expected: Dict[str, List[np.ndarray]] = {}
    written: List[int] = []
    state_bytes = count * size * 4
    with mounted(recording):
        for step in range(15):
            if step:
                for i in rng.choice(count, size=int(rng.integers(1, 4)), replace=False):
                    model.w[int(i)].assign_add(np.full(size, step, np.float32))
            before = len(recording.ops)
            path = manager.save()
            assert path is not None
            written.append(_data_bytes(recording.ops[before:]))
            expected[path] = [v.numpy() for v in model.w]
            files = _data_files(path)
            if step == 0:
                assert len(files) == 1  # the callback makes one shard here: the first save writes one file
            assert len(files) <= 1 + EXTRA_LINKED_FILES + 2, (step, files)
            on_disk = sum(f.stat().st_size for f in files)
            assert on_disk <= _named_bytes(path) / LIVE_FRACTION + 4096, (step, on_disk)
    assert written[0] >= state_bytes
    # later saves write the changed tensors and, now and then, the unchanged ones of a file no longer
    # linked: far less than the state on average
    assert sum(written[1:]) / 14 < 0.5 * state_bytes, written
    kept = manager.checkpoints
    assert len(kept) == 2
    names = {os.path.basename(p) for p in kept}
    assert all(n.split(".")[0] in names or not n.startswith("ckpt-") for n in os.listdir(tmp_path)), \
        sorted(os.listdir(tmp_path))
    for path in kept:
        fresh = shardckpt.Module()
        fresh.w = [shardckpt.Variable(np.zeros(size, np.float32)) for _ in range(count)]
        shardckpt.Checkpoint(model=fresh).read(path).assert_existing_objects_matched()
        assert _same([v.numpy() for v in fresh.w], expected[path]), path
    got, errors, _ = tf_oracle.load_checkpoint(kept[-1])
    assert errors == {}
    ours = _read_all(kept[-1])
    assert set(got) == set(ours)
    for key, value in ours.items():
        assert np.array_equal(np.asarray(got[key]), value), key


def test_partial_change_links_the_old_file_and_names_only_its_unchanged_pieces(tmp_path: Path) -> None:
    """One changed tensor of twenty: two data files (the old one linked, with the changed tensor's old
    bytes named by no entry; the changed tensor in a new one); the checkpoint restores exactly after the
    older one is deleted, and ``shardckpt verify`` passes."""
    rng = np.random.default_rng(22)
    values = {f"t{i:02d}": rng.standard_normal(50_000).astype(np.float32) for i in range(20)}
    shardckpt.save_tensors(str(tmp_path / "a"), values, INCREMENTAL)
    values["t07"] = values["t07"] + 1
    shardckpt.save_tensors(str(tmp_path / "b"), values, INCREMENTAL, previous=str(tmp_path / "a"))
    files = _data_files(str(tmp_path / "b"))
    assert len(files) == 2
    old = _data_files(str(tmp_path / "a"))[0]
    linked = [f for f in files if os.path.samefile(f, old)]
    assert len(linked) == 1 and linked[0].stat().st_size == 20 * 200_000
    assert _named_bytes(str(tmp_path / "b")) == 20 * 200_000
    for f in _data_files(str(tmp_path / "a")):
        os.remove(f)
    os.remove(str(tmp_path / "a") + ".index")
    got = _read_all(str(tmp_path / "b"))
    assert set(got) == set(values) and all(np.array_equal(got[k], v) for k, v in values.items())
    out = subprocess.run([sys.executable, "-m", "shardckpt.cli.main", "verify", str(tmp_path / "b")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


# -- change detection is never wrong --------------------------------------------------------------

def _policy() -> CheckpointOptions:
    """Incremental, the default sharding callback."""
    return CheckpointOptions(incremental=True)


def test_writes_through_array_are_caught_by_hashing(tmp_path: Path) -> None:
    model = _model(2)
    ckpt = shardckpt.Checkpoint(model=model)
    ckpt.write(str(tmp_path / "ck"), options=_policy())
    model.frozen[3].array[17] += 1.0  # no API call, no mark_changed: the hash sees it
    model.adapter[1].array[:] = 5.0
    ckpt.write(str(tmp_path / "ck"), options=_policy())
    assert _same(_restored(str(tmp_path / "ck")), _values(model))


def test_variables_written_only_through_the_api_are_not_hashed(tmp_path: Path) -> None:
    """Default detection: an unchanged Variable that never handed out its live buffer is known unchanged
    by its version stamp alone. No byte of it is read: a write behind the library's back (the private
    attribute) goes unseen, which shows that no hash ran. Once ``.array`` or ``np.asarray`` hands the
    buffer out, the variable is hashed at every save, so a direct write through a kept reference is saved."""
    model = _model(11)
    ckpt = shardckpt.Checkpoint(model=model)
    prefix = str(tmp_path / "ck")
    ckpt.write(prefix, options=_policy())
    model.frozen[0].assign_add(np.ones(N_FROZEN, np.float32))  # through the API: a new stamp
    copied = np.array(model.frozen[1]) + model.frozen[1].numpy()  # copies hand nothing out
    model.frozen[2]._value[0] = 7.0  # behind the library's back
    ckpt.write(prefix, options=_policy())
    got = _restored(prefix)
    assert np.array_equal(got[0], model.frozen[0].numpy()) and np.array_equal(got[1] * 2, copied)
    assert got[2][0] != 7.0, "an unchanged stamp of a sealed variable was not trusted"
    assert not any(v._handed_out for v in model.frozen)
    kept = model.frozen[3].array  # handed out: hashed from now on
    live = np.asarray(model.frozen[4])
    ckpt.write(prefix, options=_policy())  # no change yet
    kept[5] = 9.0
    live[6] = 10.0
    ckpt.write(prefix, options=_policy())
    got = _restored(prefix)
    assert got[3][5] == 9.0 and got[4][6] == 10.0


def test_copies_of_a_variable_do_not_share_stamps_after_a_write(tmp_path: Path) -> None:
    """A deep copy shares its original's stamp only while it shares its bytes: after a write to each,
    saving the copy under the original's key writes the copy's bytes."""
    import copy

    original = shardckpt.Variable(np.zeros(N_FROZEN, np.float32))
    twin = copy.deepcopy(original)
    prefix = str(tmp_path / "ck")
    original.assign_add(np.float32(1.0))
    shardckpt.Checkpoint(v=original).write(prefix, options=_policy())
    twin.assign_add(np.float32(2.0))  # one write each since the copy
    shardckpt.Checkpoint(v=twin).write(prefix, options=_policy())
    fresh = shardckpt.Variable(np.zeros(N_FROZEN, np.float32))
    shardckpt.Checkpoint(v=fresh).read(prefix).assert_existing_objects_matched()
    assert np.array_equal(fresh.numpy(), twin.numpy())


def test_trust_versions_skips_hashing_and_honours_assign_and_mark_changed(tmp_path: Path) -> None:
    model = _model(3)
    ckpt = shardckpt.Checkpoint(model=model)
    trusting = CheckpointOptions(incremental=True, trust_versions=True)
    prefix = str(tmp_path / "ck")
    ckpt.write(prefix, options=trusting)
    model.frozen[0].assign_add(np.ones(N_FROZEN, np.float32))  # an API write bumps the version
    model.frozen[1].array[0] = 42.0
    model.frozen[1].mark_changed()  # a direct write, declared
    ckpt.write(prefix, options=trusting)
    assert _same(_restored(prefix), _values(model))
    # the documented contract: with trust_versions a direct write that is not declared is not seen
    # (without trust_versions, the previous test shows the hash catching it)
    model.frozen[4].array[0] = -1.0
    ckpt.write(prefix, options=trusting)
    assert _restored(prefix)[4][0] != -1.0
    model.frozen[4].mark_changed()
    ckpt.write(prefix, options=trusting)
    assert _same(_restored(prefix), _values(model))


def test_torch_in_place_op_is_saved(tmp_path: Path) -> None:
    import torch

    tensors = {f"w{i}": torch.randn(256 << 10) for i in range(4)}  # 1 MiB each, one data file
    prefix = str(tmp_path / "ck")
    shardckpt.save_tensors(prefix, {k: t.numpy() for k, t in tensors.items()}, _policy())
    tensors["w1"].mul_(2.0)  # in place: the numpy view shares the memory
    shardckpt.save_tensors(prefix, {k: t.numpy() for k, t in tensors.items()}, _policy())
    got = _read_all(prefix)
    for k, t in tensors.items():
        assert np.array_equal(got[k], t.numpy()), k
    origins = data_file_origins(prefix, local_fs)
    # the first file is linked (w0, w2 and w3 are read from it), w1 is written into a new one
    assert origins is not None and sorted(o["how"] for o in origins.values()) == ["link", "written"]


_RESTART = """
import sys, numpy as np, shardckpt
from shardckpt import CheckpointOptions
from shardckpt.saving.incremental import data_file_origins
from shardckpt.storage.local import local_fs
prefix, flip = sys.argv[1], int(sys.argv[2])
with shardckpt.load_checkpoint(prefix) as r:
    values = {k: np.array(r.get_tensor(k)) for k in r.get_variable_to_shape_map()}
if flip >= 0:
    values["big"].reshape(-1)[flip] += 1
shardckpt.save_tensors(prefix, values, CheckpointOptions(incremental=True))
print(sorted(o["how"] for o in data_file_origins(prefix, local_fs).values()))
"""


def test_another_process_only_knows_hashes(tmp_path: Path) -> None:
    """After a restart no version is known: a changed element is found by its hash, unchanged files reused."""
    prefix = str(tmp_path / "ck")
    rng = np.random.default_rng(4)
    values = {"big": rng.standard_normal((64, 4096)).astype(np.float32),
              "small": rng.standard_normal(100).astype(np.float32)}
    shardckpt.save_tensors(prefix, values, _policy())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    same = subprocess.run([sys.executable, "-c", _RESTART, prefix, "-1"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert same.returncode == 0, same.stderr
    assert "written" not in same.stdout.split("]")[0] or "'link'" in same.stdout, same.stdout
    flipped = subprocess.run([sys.executable, "-c", _RESTART, prefix, str(64 * 4096 - 7)], capture_output=True,
                             text=True, env=env, timeout=120)
    assert flipped.returncode == 0, flipped.stderr
    assert "'written'" in flipped.stdout, flipped.stdout
    values["big"].reshape(-1)[64 * 4096 - 7] += 1
    got = _read_all(prefix)
    for k in values:
        assert np.array_equal(got[k], values[k]), k


def test_one_flipped_element_of_a_100mb_tensor_is_saved(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck")
    big = np.random.default_rng(5).standard_normal(25 << 20, dtype=np.float32)  # 100 MiB
    other = np.arange(1000, dtype=np.float64)
    opts = CheckpointOptions(incremental=True)
    shardckpt.save_tensors(prefix, {"big": big, "other": other}, opts, fsync=False)
    big[12_345_678] = np.float32(-big[12_345_678] - 1)
    shardckpt.save_tensors(prefix, {"big": big, "other": other}, opts, fsync=False)
    with shardckpt.load_checkpoint(prefix) as reader:
        assert reader.get_tensor("big")[12_345_678] == big[12_345_678]
        assert np.array_equal(reader.get_tensor("big"), big)


def test_head_pre_check_and_sidecars_without_heads(tmp_path: Path) -> None:
    """A piece whose first bytes changed is written and hashed while it streams (the sidecar records the
    new bytes' hash and head); one changed only past its head is caught by the full hash; a sidecar
    written before heads existed (five fields a piece) is still used."""
    import xxhash

    from shardckpt.saving.incremental import HEAD_BYTES

    prefix = str(tmp_path / "ck")
    rng = np.random.default_rng(7)
    values = {k: rng.standard_normal(300_000).astype(np.float32) for k in "abcdefgh"}
    shardckpt.save_tensors(prefix, values, INCREMENTAL, fsync=False)

    def records() -> Dict[str, List[Any]]:
        return {p[0]: p for p in json.loads(Path(sidecar_filename(prefix)).read_bytes())["pieces"]}

    for k, v in values.items():
        assert records()[k][5] == xxhash.xxh3_128(v.tobytes()[:HEAD_BYTES]).hexdigest()
    values["a"][0] += 1  # the head changes
    values["b"][-1] += 1  # only the tail changes
    shardckpt.save_tensors(prefix, values, INCREMENTAL, fsync=False)
    got, recs = _read_all(prefix), records()
    for k, v in values.items():
        assert np.array_equal(got[k], v), k
        assert recs[k][2] == xxhash.xxh3_128(v.tobytes()).hexdigest(), k
        assert recs[k][5] == xxhash.xxh3_128(v.tobytes()[:HEAD_BYTES]).hexdigest(), k
    origins = data_file_origins(prefix, local_fs)
    assert origins is not None and sorted(o["how"] for o in origins.values()) == ["link", "written"]
    # an older sidecar: no heads; the full hashes still find every piece unchanged
    doc = json.loads(Path(sidecar_filename(prefix)).read_bytes())
    doc["pieces"] = [p[:5] for p in doc["pieces"]]
    Path(sidecar_filename(prefix)).write_text(json.dumps(doc))
    values["c"][-1] += 1
    shardckpt.save_tensors(prefix, values, INCREMENTAL, fsync=False)
    got = _read_all(prefix)
    assert all(np.array_equal(got[k], v) for k, v in values.items())
    # the file of a and b is linked; d..h fill less than LIVE_FRACTION of the first file now: written again
    origins = data_file_origins(prefix, local_fs)
    assert origins is not None and sorted(o["how"] for o in origins.values()) == ["link", "written", "written"]


def _expected_sample(data: bytes) -> str:
    """A piece's sample hash as the sidecar documents it, computed here from the bytes themselves."""
    import xxhash

    from shardckpt.saving.incremental import HEAD_BYTES, sample_windows

    windows = sample_windows(len(data))
    sampled = b"".join(data[a:z] for a, z in windows) + data[-HEAD_BYTES:] if windows else data[HEAD_BYTES:]
    return str(xxhash.xxh3_128(sampled).hexdigest())


def test_sample_pre_check_catches_changes_past_the_head_without_a_hashing_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece whose head is unchanged but whose tail, or a region its sample windows read, changed is
    known changed from its sample: it is written and hashed on the writer's pass, never hashed whole
    before. A change between the windows is still caught by the whole hash. Every piece's sample is
    recorded (computed on the writer's pass for written pieces); a sidecar without samples still works."""
    from shardckpt.saving import incremental
    from shardckpt.saving.incremental import HEAD_BYTES, sample_windows

    prefix = str(tmp_path / "ck")
    rng = np.random.default_rng(9)
    values = {k: rng.standard_normal(300_000).astype(np.float32) for k in "abcdefgh"}
    shardckpt.save_tensors(prefix, values, INCREMENTAL, fsync=False)

    def records() -> Dict[str, List[Any]]:
        return {p[0]: p for p in json.loads(Path(sidecar_filename(prefix)).read_bytes())["pieces"]}

    assert all(records()[k][6] == _expected_sample(v.tobytes()) for k, v in values.items())
    hashed: List[int] = []
    real = incremental.content_hash

    def counting(value: Any, dtype: Any) -> Optional[str]:
        hashed.append(int(np.asarray(value).nbytes))
        return real(value, dtype)

    monkeypatch.setattr(incremental, "content_hash", counting)
    windows = sample_windows(values["b"].nbytes)
    assert len(windows) == incremental.SAMPLE_WINDOWS and windows[0][0] == HEAD_BYTES
    inside = (windows[20][0] + 8) // 4  # a float32 read by the 21st window
    outside = (windows[20][1] + windows[21][0]) // 8  # one between the 21st and 22nd windows
    assert windows[20][1] <= outside * 4 and outside * 4 + 4 <= windows[21][0]
    values["a"][-1] += 1  # only the tail changes
    values["b"][inside] += 1  # only a sampled window changes
    values["c"][outside] += 1  # only bytes no window reads change
    shardckpt.save_tensors(prefix, values, INCREMENTAL, fsync=False)
    assert len(hashed) == len(values) - 2, "a and b were hashed whole although their samples differ"
    got, recs = _read_all(prefix), records()
    import xxhash

    for k, v in values.items():
        assert np.array_equal(got[k], v), k
        assert recs[k][2] == xxhash.xxh3_128(v.tobytes()).hexdigest(), k
        assert recs[k][6] == _expected_sample(v.tobytes()), k
    # an older sidecar: heads but no samples; a change past the head is then found by the whole hash
    doc = json.loads(Path(sidecar_filename(prefix)).read_bytes())
    doc["pieces"] = [p[:6] for p in doc["pieces"]]
    Path(sidecar_filename(prefix)).write_text(json.dumps(doc))
    hashed.clear()
    values["d"][-1] += 1
    shardckpt.save_tensors(prefix, values, INCREMENTAL, fsync=False)
    assert len(hashed) == len(values)
    got = _read_all(prefix)
    assert all(np.array_equal(got[k], v) for k, v in values.items())
    # what has no contiguous layout, or fits in the head, has no sample
    assert incremental.sample_hash(np.ones((100, 100), np.float32)[:, ::2], None) is None
    assert incremental.sample_hash(np.ones(HEAD_BYTES // 4, np.float32), None) is None
    small = np.arange(3000, dtype=np.float32)  # 12000 bytes: its sample is everything after the head
    assert incremental.sample_hash(small, None) == _expected_sample(small.tobytes())


# -- where links are impossible --------------------------------------------------------------------

def test_no_hard_links_across_filesystems_falls_back_to_a_copy_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shm = Path("/dev/shm") / f"shardckpt-{uuid.uuid4().hex[:8]}"
    assert os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev, "needs /dev/shm on another filesystem"
    shm.mkdir()
    try:
        rng = np.random.default_rng(6)
        values = {f"t{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(4)}
        shardckpt.save_tensors(str(shm / "old"), values, _policy())
        values["t0"] += 1
        with caplog.at_level(logging.WARNING, logger="shardckpt"):
            shardckpt.save_tensors(str(tmp_path / "new"), values, _policy(), previous=str(shm / "old"))
        origins = data_file_origins(str(tmp_path / "new"), local_fs)
        assert origins is not None
        hows = sorted(o["how"] for o in origins.values())
        assert hows.count("written") == 1 and len(set(hows) & {"copy", "reflink"}) == 1, hows
        for f in os.listdir(tmp_path):
            assert os.stat(tmp_path / f).st_nlink == 1
        got = _read_all(str(tmp_path / "new"))
        for k in values:
            assert np.array_equal(got[k], values[k])
        # said once per process at most (an earlier test may have said it already)
        assert sum("no hard links here" in r.getMessage() for r in caplog.records) <= 1
    finally:
        import shutil
        shutil.rmtree(shm, ignore_errors=True)


def test_a_sidecar_of_another_index_is_ignored(tmp_path: Path) -> None:
    """A sidecar that does not belong to the index at its prefix (a crash between the two, or a
    checkpoint replaced by a non-incremental save) is never trusted."""
    prefix = str(tmp_path / "ck")
    a = {"x": np.arange(10_000, dtype=np.float32), "y": np.ones(10_000, np.float32)}
    shardckpt.save_tensors(prefix, a, _policy())
    sidecar = Path(sidecar_filename(prefix)).read_bytes()
    b = {"x": np.zeros(10_000, np.float32), "y": np.full(10_000, 3.0, np.float32)}
    shardckpt.save_tensors(prefix, b, CheckpointOptions())  # a plain save replaces the index
    Path(sidecar_filename(prefix)).write_bytes(sidecar)  # ... and an old sidecar is left beside it
    c = {"x": np.arange(10_000, dtype=np.float32), "y": np.full(10_000, 3.0, np.float32)}
    shardckpt.save_tensors(prefix, c, _policy())
    got = _read_all(prefix)
    for k in c:
        assert np.array_equal(got[k], c[k]), k


def test_a_previous_index_whose_header_no_reader_reads_is_not_reused(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """One header parser (``format.bundle_index``): an index whose header the reader refuses (a version
    this format does not read) is never the previous checkpoint of an incremental save, even beside a
    sidecar that matches it; the log names the index. (The lax parser this replaces took its shard
    count and let the save link the files of a checkpoint no reader opens.)"""
    import json
    import logging

    from shardckpt.format.protos import tensor_bundle_pb2 as pb
    from shardckpt.format.sstable import TableWriter, read_table
    from shardckpt.saving.incremental import _index_digest, load_previous

    prefix = str(tmp_path / "ck")
    shardckpt.save_tensors(prefix, {"x": np.arange(10_000, dtype=np.float32)}, _policy())
    assert load_previous(prefix, local_fs) is not None  # as saved: the previous checkpoint
    index_path = prefix + ".index"
    pairs = list(read_table(Path(index_path).read_bytes()))
    header = pb.BundleHeaderProto.FromString(pairs[0][1])
    header.version.min_consumer = 5
    table = TableWriter()
    table.extend([(b"", header.SerializeToString())] + pairs[1:])
    index = table.finish()
    Path(index_path).write_bytes(index)
    sidecar = json.loads(Path(sidecar_filename(prefix)).read_bytes())
    sidecar["index_xxh3_128"] = _index_digest(index)  # the sidecar matches the edited index
    Path(sidecar_filename(prefix)).write_text(json.dumps(sidecar))
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        assert load_previous(prefix, local_fs) is None
    assert index_path in caplog.text and "not readable" in caplog.text


# -- object stores: server-side copies --------------------------------------------------------------

def test_object_store_copies_unchanged_objects_server_side(s3_server: Any) -> None:
    base = s3_server.url(f"inc-{uuid.uuid4().hex[:10]}")
    rng = np.random.default_rng(7)
    values = {f"t{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(4)}  # 1.2 MB each
    opts = CheckpointOptions(incremental=True)
    shardckpt.save_tensors(base + "/ck-1", values, opts)
    values["t2"] = values["t2"] * 2
    fs = get_fs(base)
    fs.reset_stats()
    shardckpt.save_tensors(base + "/ck-2", values, opts, previous=base + "/ck-1")
    stats = dict(fs.stats)
    changed = values["t2"].nbytes
    # the changed tensor, the index and the sidecar were uploaded; the data object of the three
    # unchanged ones was copied by the store (no upload of their bytes)
    assert changed <= stats["bytes_written"] <= changed + 16384, stats
    assert stats["server_copies"] == 1, stats
    origins = data_file_origins(base + "/ck-2", fs)
    assert origins is not None and sorted(o["how"] for o in origins.values()) == ["server-copy", "written"]
    for name in fs.listdir(base):
        if name.startswith("ck-1."):
            fs.remove(base + "/" + name)
    got = _read_all(base + "/ck-2")
    for k in values:
        assert np.array_equal(got[k], values[k]), k


# -- reused bytes that were damaged after their checkpoint committed (issue 24) --------------------

_RESTORE_LATEST = """
import sys, numpy as np, shardckpt
directory, expected = sys.argv[1], sys.argv[2]
frozen, n_frozen, adapter, n_adapter = map(int, sys.argv[3:7])
m = shardckpt.Module()
m.frozen = [shardckpt.Variable(np.zeros(n_frozen, np.float32)) for _ in range(frozen)]
m.adapter = [shardckpt.Variable(np.zeros(n_adapter, np.float32)) for _ in range(adapter)]
manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=m), directory, max_to_keep=2, incremental=True)
path = manager.restore_or_initialize()
want = np.load(expected)
got = [v.numpy() for v in list(m.frozen) + list(m.adapter)]
bad = [i for i in range(len(got)) if not np.array_equal(got[i], want[f"arr_{i}"])]
print("restored", path, "wrong:", bad)
sys.exit(1 if path is None or bad else 0)
"""


def _restore_latest_in_a_new_process(directory: Path, want: List[np.ndarray]) -> str:
    """A restart: a fresh process builds the model, restores the manager's latest checkpoint and compares
    every value with ``want``; returns its report."""
    np.savez(directory.parent / "expected.npz", *want)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _RESTORE_LATEST, str(directory), str(directory.parent / "expected.npz"),
                          str(FROZEN), str(N_FROZEN), str(ADAPTER), str(N_ADAPTER)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _damage(path: Path, how: str) -> None:
    """Damage a committed data file as something outside the library would: one byte in its middle
    rewritten in place (``flip``), the file cut to half its size (``truncate``), or one byte changed with
    the file's mtime put back (``rot``: bit rot, which leaves size and mtime alone)."""
    st = os.stat(path)
    if how == "truncate":
        os.truncate(path, st.st_size // 2)
        return
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    if how == "rot":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _manager_after_one_save(tmp_path: Path, seed: int) -> Tuple[Path, shardckpt.Module, Any, str]:
    """An incremental manager (max_to_keep=2) of a fresh model in ``tmp_path/ckpts``, after its first save."""
    folder = tmp_path / "ckpts"
    model = _model(seed)
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), str(folder), max_to_keep=2,
                                          incremental=True)
    first = manager.save()
    assert first is not None
    return folder, model, manager, first


def _save_after_adapters_change(model: shardckpt.Module, manager: Any, step: int) -> str:
    for v in model.adapter:
        v.assign_add(np.full(N_ADAPTER, step + 1, np.float32))
    path = manager.save()
    assert path is not None
    return str(path)


def _largest_data_file(prefix: str) -> Tuple[Path, int]:
    """The checkpoint's largest data file (the frozen tensors fill its middle) and its inode, held open
    for the rest of the test (a deleted file's inode number is not given to a new file while it is)."""
    path = max(_data_files(prefix), key=lambda f: f.stat().st_size)
    held = open(path, "rb")
    _HELD.append(held)
    return path, os.fstat(held.fileno()).st_ino


_HELD: List[Any] = []


@pytest.fixture(autouse=True)
def _close_held_files() -> Any:
    yield
    while _HELD:
        _HELD.pop().close()


def _verify(prefix: str) -> None:
    from shardckpt.cli.main import main as cli

    assert cli(["verify", prefix]) == 0, f"shardckpt verify {prefix} failed"


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_data_file_changed_after_its_commit_is_never_linked_again(tmp_path: Path, how: str) -> None:
    """One byte of ckpt-1's data file rewritten in place, or the file truncated to half: the next save
    sees its stamp (size, inode, mtime) differ from the one its commit recorded and writes its tensors
    from memory; three saves later (ckpt-1 deleted by retention) every checkpoint verifies and a new
    process restores the latest exactly."""
    folder, model, manager, first = _manager_after_one_save(tmp_path, 20)
    damaged, inode = _largest_data_file(first)
    time.sleep(0.05)  # mtimes tick with the kernel's clock (a few ms): the damage comes later than the commit
    _damage(damaged, how)
    for step in range(3):
        path = _save_after_adapters_change(model, manager, step)
        assert all(f.stat().st_ino != inode for f in _data_files(path)), "the damaged file was linked"
        _verify(path)
        assert _same(_restored(path), _values(model)), path
    assert not damaged.exists()  # retention deleted ckpt-1: what is left stands on its own
    for path in manager.checkpoints:
        _verify(path)
    report = _restore_latest_in_a_new_process(folder, _values(model))
    assert "ckpt-4" in report, report


def test_bit_rot_is_found_by_the_scrub_and_never_linked_again(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A byte of ckpt-1's data file changes with size and mtime left alone: the next save links the file
    (its stamp is unchanged) and queues its scrub (never read back since it was written); the scrub
    finds the CRC32C mismatch, names file and key, and moves the file's mtime: every later save writes
    those tensors from memory, verifies, and a new process restores the latest exactly."""
    from shardckpt.saving.scrub import wait_for_scrubs

    folder, model, manager, first = _manager_after_one_save(tmp_path, 21)
    damaged, inode = _largest_data_file(first)
    _damage(damaged, "rot")
    with caplog.at_level(logging.ERROR, logger="shardckpt"):
        for step in range(4):
            path = _save_after_adapters_change(model, manager, step)
            linked = any(f.stat().st_ino == inode for f in _data_files(path))
            if step == 0:  # within the scrub's window: linked, and its scrub queued
                assert linked
                assert wait_for_scrubs(60)
                found = [r.getMessage() for r in caplog.records if "scrub" in r.getMessage()]
                assert found and str(damaged) in found[0] and "/.ATTRIBUTES/VARIABLE_VALUE" in found[0], found
                assert "checksum does not match" in found[0], found
                continue
            assert not linked, f"{path} links the damaged file"
            _verify(path)
            assert _same(_restored(path), _values(model)), path
    for path in manager.checkpoints:
        _verify(path)
    report = _restore_latest_in_a_new_process(folder, _values(model))
    assert "ckpt-5" in report, report


def test_linked_files_are_scrubbed_and_never_linked_past_the_proof_limit(tmp_path: Path) -> None:
    """The documented schedule: a linked file is scrubbed after the first save that links it and again
    once linked in SCRUB_EVERY saves since its last proof (the sidecar records each file's stamp and the
    age of its proof); a file whose last proof is LINK_LIMIT saves old is written again, not linked."""
    from shardckpt.saving.scrub import LINK_LIMIT, SCRUB_EVERY, default_scrubber, wait_for_scrubs

    prefix = str(tmp_path / "ck")
    model = _model(22)
    ckpt = shardckpt.Checkpoint(model=model)
    scrubber = default_scrubber()

    def frozen_file() -> Dict[str, Any]:
        """The sidecar's record of the data file holding the frozen tensors (the largest), and how it came."""
        files = json.loads(Path(sidecar_filename(prefix)).read_bytes())["files"]
        assert all(isinstance(r["id"], list) and len(r["id"]) == 3 for r in files.values()), files
        shard, record = max(files.items(), key=lambda kv: kv[1]["id"][0])  # local stamp: [size, inode, mtime]
        origins = data_file_origins(prefix, local_fs)
        assert origins is not None
        return dict(record, how=origins[int(shard)]["how"])

    ckpt.write(prefix, options=INCREMENTAL)
    assert frozen_file() == {"id": frozen_file()["id"], "age": 0, "scrubbed": False, "how": "written"}
    read_before = scrubber.bytes_read
    ages = []
    for step in range(2 * SCRUB_EVERY + 2):  # the last one takes up the last scrub's proof
        model.adapter[0].assign_add(np.ones(N_ADAPTER, np.float32))
        ckpt.write(prefix, options=INCREMENTAL)
        assert wait_for_scrubs(60)
        record = frozen_file()
        assert record["how"] == "link", (step, record)
        ages.append((record["age"], record["scrubbed"]))
    # scrubbed after its first link; then its proof ages until SCRUB_EVERY, is renewed, ages again
    assert ages[:SCRUB_EVERY + 1] == [(1, False)] + [(a, True) for a in range(1, SCRUB_EVERY + 1)], ages
    assert ages[SCRUB_EVERY + 1] == (1, True), ages
    assert scrubber.bytes_read - read_before >= 2 * FROZEN * N_FROZEN * 4  # two whole scrubs at least
    # a proof LINK_LIMIT saves old (a scrub that never ended: here the sidecar says so) is not trusted
    doc = json.loads(Path(sidecar_filename(prefix)).read_bytes())
    for record in doc["files"].values():
        record.update(age=LINK_LIMIT, scrubbed=True)
    Path(sidecar_filename(prefix)).write_text(json.dumps(doc))
    model.adapter[0].assign_add(np.ones(N_ADAPTER, np.float32))
    ckpt.write(prefix, options=INCREMENTAL)
    origins = data_file_origins(prefix, local_fs)
    assert origins is not None and all(o["how"] == "written" for o in origins.values()), origins
    assert _same(_restored(prefix), _values(model))


def test_retention_keeps_the_newest_sound_checkpoint_while_newer_ones_share_a_damaged_file(
        tmp_path: Path) -> None:
    """ckpt-2 writes file B (every frozen tensor changed), B rots, ckpt-3 links it and its scrub finds the
    damage before ckpt-3's retention runs: ckpt-2 and ckpt-3 share a damaged file, so retention
    (max_to_keep=2) keeps ckpt-1, which verifies and restores. Once ckpt-4 (B written again from memory)
    is sound, ckpt-1 goes."""
    from shardckpt.saving.scrub import wait_for_scrubs
    from shardckpt.storage.wrappers import FaultInjectingFileSystem

    folder, model, manager, first = _manager_after_one_save(tmp_path, 23)
    at_first = _values(model)
    for v in model.frozen:
        v.assign_add(np.ones(N_FROZEN, np.float32))
    second = manager.save()
    assert second is not None
    file_b, _ = _largest_data_file(second)
    _damage(file_b, "rot")
    model.adapter[0].assign_add(np.ones(N_ADAPTER, np.float32))
    # the scrub queued by ckpt-3's arrange step ends before ckpt-3 commits (its sidecar is written)
    faulty = FaultInjectingFileSystem(local_fs)
    faulty.fail("write_atomic", r"ckpt-3\.hashes\.json$", when=lambda: not wait_for_scrubs(60))
    with mounted(faulty):
        third = manager.save()
    assert third is not None
    assert os.path.exists(first + ".index"), "retention deleted the only sound checkpoint"
    assert manager.checkpoints == [first, second, third]
    assert shardckpt.CheckpointManager(shardckpt.Checkpoint(model=_model(99)), str(folder), max_to_keep=2
                                       ).checkpoints == [first, second, third]  # the state file lists it
    _verify(first)
    assert _same(_restored(first), at_first)
    model.adapter[1].assign_add(np.ones(N_ADAPTER, np.float32))
    fourth = manager.save()
    assert fourth is not None
    _verify(fourth)
    assert _same(_restored(fourth), _values(model))
    assert not os.path.exists(first + ".index") and manager.checkpoints == [third, fourth]


def test_object_store_never_copies_an_object_replaced_after_its_commit(s3_server: Any) -> None:
    """On an object store the commit records each data object's size and ETag: an object rewritten in
    place afterwards (one byte changed, same size) is not copied into the next checkpoint, whose tensors
    are written from memory and restore exactly."""
    base = s3_server.url(f"inc-{uuid.uuid4().hex[:10]}")
    rng = np.random.default_rng(24)
    values = {f"t{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(4)}
    opts = CheckpointOptions(incremental=True)
    shardckpt.save_tensors(base + "/ck-1", values, opts)
    fs = get_fs(base)
    data = [n for n in fs.listdir(base) if n.startswith("ck-1.data-")]
    assert len(data) == 1
    blob = bytearray(fs.read_bytes(base + "/" + data[0]))
    blob[len(blob) // 2] ^= 0x10
    fs.write_atomic(base + "/" + data[0], bytes(blob))
    values["t2"] = values["t2"] * 2
    fs.reset_stats()
    shardckpt.save_tensors(base + "/ck-2", values, opts, previous=base + "/ck-1")
    assert fs.stats.get("server_copies", 0) == 0, dict(fs.stats)
    got = _read_all(base + "/ck-2")
    for k in values:
        assert np.array_equal(got[k], values[k]), k


def test_a_shallow_copy_of_a_variable_never_makes_a_save_store_stale_bytes(tmp_path: Path) -> None:
    """copy.copy of a Variable (as of a tf.Variable: the variable itself) written through the copy:
    the next incremental save stores the new bytes, whichever object it holds."""
    import copy

    original = shardckpt.Variable(np.zeros(N_FROZEN, np.float32))
    prefix = str(tmp_path / "ck")
    ckpt = shardckpt.Checkpoint(v=original)
    ckpt.write(prefix, options=INCREMENTAL)
    twin = copy.copy(original)
    twin.assign(np.full(N_FROZEN, 3.0, np.float32))
    ckpt.write(prefix, options=INCREMENTAL)
    fresh = shardckpt.Variable(np.zeros(N_FROZEN, np.float32))
    shardckpt.Checkpoint(v=fresh).read(prefix).assert_existing_objects_matched()
    assert np.array_equal(fresh.numpy(), np.full(N_FROZEN, 3.0, np.float32))
    original.assign_add(np.float32(1.0))
    shardckpt.Checkpoint(v=twin).write(prefix, options=INCREMENTAL)
    shardckpt.Checkpoint(v=fresh).read(prefix).assert_existing_objects_matched()
    assert np.array_equal(fresh.numpy(), np.full(N_FROZEN, 4.0, np.float32))


# -- crash states of an incremental save ------------------------------------------------------------

def test_crash_states_of_an_incremental_save(tmp_path: Path) -> None:
    """Every state a power loss can leave during an incremental save to the same prefix (links, the
    sidecar, the index rename, removal of the old names) reads as one whole generation, and the next
    incremental save from that state is exact."""
    root = tmp_path / "root"
    root.mkdir()
    prefix = str(root / "ck")
    opts = CheckpointOptions(incremental=True, sharding_callback=MaxShardSizePolicy(max_shard_size=2048))
    gens = []
    rng = np.random.default_rng(8)
    g1 = {f"t{i}": rng.standard_normal(300).astype(np.float32) for i in range(3)}
    shardckpt.save_tensors(prefix, g1, opts)
    g2 = dict(g1, t1=g1["t1"] + 1)
    shardckpt.save_tensors(prefix, g2, opts)  # the layout settles: t1 alone in its file
    gens = [g1, g2]
    g3 = dict(g2, t1=g2["t1"] + 1)
    initial = snapshot(str(root))
    recording = RecordingFileSystem(local_fs)
    with mounted(recording):
        shardckpt.save_tensors(prefix, g3, opts)
    assert any(kind == "link" for kind, _, _ in recording.ops), "the save linked nothing"
    gens.append(g3)
    g4 = dict(g3, t0=g3["t0"] - 1)

    def same(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> bool:
        return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    def judge(folder: str) -> Optional[str]:
        p = os.path.join(folder, "ck")
        try:
            got = _read_all(p)
        except Exception as exc:
            return f"unreadable: {type(exc).__name__}: {exc}"
        if not any(same(got, g) for g in gens[1:]):
            return "holds no whole generation"
        try:  # the next save cleans up and is exact
            shardckpt.save_tensors(p, g4, opts)
            if not same(_read_all(p), g4):
                return "the next incremental save is not exact"
        except Exception as exc:
            return f"the next save failed: {type(exc).__name__}: {exc}"
        return None

    checked, problems = check_all(str(root), recording.ops, initial, str(tmp_path / "state"), judge,
                                  max_per_point=16)
    print(f"incremental save: {checked} crash states checked")
    assert checked >= 40
    assert not problems, "\n".join(problems[:5])


# -- several clients -----------------------------------------------------------------------------

@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_multi_client_incremental_save(tmp_path: Path, launcher: str) -> None:
    """Two real clients (torchrun/gloo, mpiexec/MPI): each decides for its own pieces; the commit is collective."""
    out = tmp_path / "out"
    out.mkdir()
    worker = [str(HELPERS / "incremental_worker.py"), str(tmp_path / "ckpt"), str(out)]
    if launcher == "torchrun":
        cmd = [str(tool("torchrun")), "--standalone", "--nproc-per-node=2"] + worker
    else:
        cmd = [str(tool("mpiexec")), "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable] + worker
    log = tmp_path / "launcher.log"
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=clean_env(), cwd=str(HERE.parent),
                              timeout=240)
    tail = log.read_text(errors="replace")[-4000:]
    assert proc.returncode == 0, tail
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res.get("done"), (r, res, tail)
    # rank 0 changed its slice; rank 1 changed nothing of its own: only rank 0 wrote tensor bytes
    assert results[0]["bytes_written"] > 0 and results[1]["bytes_written"] == 0, results
    assert results[1]["bytes_reused"] > 0, results
    origins = data_file_origins(str(tmp_path / "ckpt" / "ck-2"), local_fs)
    assert origins is not None and any(o["how"] == "link" for o in origins.values())
    # ck-1 deleted: ck-2 complete on its own
    for name in os.listdir(tmp_path / "ckpt"):
        if name.startswith("ck-1."):
            os.remove(tmp_path / "ckpt" / name)
    got = _read_all(str(tmp_path / "ckpt" / "ck-2"))
    want = np.load(out / "expected.npz")
    assert set(got) == set(want.files)
    for k in want.files:
        assert np.array_equal(got[k], want[k]), k


# -- the other front doors -------------------------------------------------------------------------

def test_dtensor_checkpoint_incremental(tmp_path: Path) -> None:
    from shardckpt import dtensor as dt

    mesh = dt.create_mesh([("x", 2)])
    rng = np.random.default_rng(9)
    values = {f"v{i}": rng.standard_normal((64, 32)).astype(np.float32) for i in range(4)}
    variables = {k: dt.DVariable.from_global(v, dt.Layout(["x", dt.UNSHARDED], mesh), name=k)
                 for k, v in values.items()}
    ckpt = dt.DTensorCheckpoint(mesh, **variables)
    ckpt.save(str(tmp_path / "ck"), options=INCREMENTAL)
    prefixes = []
    for _ in range(2):
        variables["v1"].assign_add(np.ones((64, 32), np.float32))
        values["v1"] = values["v1"] + 1
        prefixes.append(ckpt.save(str(tmp_path / "ck"), options=INCREMENTAL))
    # the second incremental save reuses the file of the pieces that did not change the first time
    origins = data_file_origins(prefixes[-1], local_fs)
    assert origins is not None and any(o["how"] == "link" for o in origins.values()), origins
    got = _read_all(prefixes[-1])
    for k, v in values.items():
        assert np.array_equal(got[f"{k}/.ATTRIBUTES/VARIABLE_VALUE"], v), k


def test_async_incremental_saves(tmp_path: Path) -> None:
    model = _model(10)
    ckpt = shardckpt.Checkpoint(model=model)
    manager = shardckpt.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2, incremental=True)
    opts = CheckpointOptions(enable_async=True)
    expected = {}
    for step in range(4):
        model.adapter[step % ADAPTER].assign_add(np.full(N_ADAPTER, 1.0, np.float32))
        path = manager.save(options=opts)
        expected[path] = _values(model)  # the snapshot was taken when save() returned
        model.frozen[0].array[0] += 0.0  # touching memory after the call does not matter
    manager.sync()
    for path in manager.checkpoints:
        assert _same(_restored(path), expected[path]), path
    origins = data_file_origins(manager.checkpoints[-1], local_fs)
    assert origins is not None and any(o["how"] == "link" for o in origins.values())
    sidecar = json.loads(Path(sidecar_filename(manager.checkpoints[-1])).read_bytes())
    frozen = {f"model/frozen/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(FROZEN)}
    linked = {n for n, s in enumerate(sidecar["shards"]) if s["how"] == "link"}
    assert {p[0] for p in sidecar["pieces"] if p[4] in linked} >= frozen  # no frozen byte was written again


# -- kill -9 at random moments ----------------------------------------------------------------------

_SAVE_LOOP = """
import sys, numpy as np, shardckpt
from shardckpt import CheckpointOptions
prefix, start = sys.argv[1], int(sys.argv[2])
frozen = {f"f{i}": np.random.default_rng(i).standard_normal(300_000).astype(np.float32) for i in range(6)}
print("READY", flush=True)
for g in range(start, start + 10_000):
    values = dict(frozen, adapter=np.full(50_000, g, np.float32), moving=np.full(300_000, g % 7, np.float32))
    shardckpt.save_tensors(prefix, values, CheckpointOptions(incremental=True))
    print("SAVED", g, flush=True)
"""


def test_kill_9_during_incremental_saves(tmp_path: Path) -> None:
    """A process saving incrementally to one prefix is killed at random moments (linking, merging,
    between the sidecar and the index rename, removing old names): the prefix always holds one
    whole generation, and the next incremental save is exact."""
    import random
    import signal

    prefix = str(tmp_path / "ck")
    rng = random.Random(14)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    frozen = {f"f{i}": np.random.default_rng(i).standard_normal(300_000).astype(np.float32) for i in range(6)}
    saved_any = False
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", _SAVE_LOOP, prefix, str(trial * 1000)],
                                stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(rng.uniform(0.05, 1.0))
        proc.send_signal(signal.SIGKILL)
        out = proc.stdout.read()
        proc.wait()
        saved_any = saved_any or "SAVED" in out
        if not os.path.exists(prefix + ".index"):
            continue
        got = _read_all(prefix)
        g = int(got["adapter"][0])
        assert np.all(got["adapter"] == g) and np.all(got["moving"] == g % 7), f"trial {trial}: a mix"
        for k, v in frozen.items():
            assert np.array_equal(got[k], v), (trial, k)
    assert saved_any, "no save ever finished: the kills came too early to test anything"
    final = dict(frozen, adapter=np.full(50_000, -1, np.float32), moving=np.full(300_000, -1, np.float32))
    shardckpt.save_tensors(prefix, final, CheckpointOptions(incremental=True))
    got = _read_all(prefix)
    for k, v in final.items():
        assert np.array_equal(got[k], v), k
    leftovers = [n for n in os.listdir(tmp_path) if "_temp_" in n or ".tempstate" in n]
    assert not leftovers, leftovers
