"""shardckpt as a storage backend of torch.distributed.checkpoint (DCP), in real processes.

Launches of tests/helpers/torch_dcp_worker.py under ``torchrun --standalone`` (gloo, CPU):

* ``save4``: 4 ranks on a 2x2 mesh save a small transformer-like model and its AdamW state
  (``get_state_dict``) with ``[Shard(0), Shard(1)]``, ``[Replicate(), Shard(0)]``,
  ``[Shard(0), Replicate()]`` and replicated placements, with ``dcp.save`` and
  ``dcp.async_save`` with the thread and the PROCESS checkpointer (training goes on while they
  write; a failing PROCESS save leaves the previous checkpoint, the next one works), and an FSDP2 ``fully_shard`` (HSDP)
  model with its optimizer; a bad state dict is refused;
* ``load2`` / ``load3`` / ``load1`` (one process, no torch.distributed): other placements,
  uneven chunks; every value bit-exact and the training continues exactly as the
  uninterrupted run; ``load2`` also loads a TensorFlow fixture into DTensors;
* ``save4`` also saves with ``no_dist=True`` inside the job (no coordinator given), and its
  sync checkpoint is restored into a JAX pytree on a (2, 4) mesh (helpers/jax_from_torch.py);
* ``kill2``: a rank SIGKILLed in the middle of a save leaves the previous checkpoint loadable;
  so does (first) a checkpoint process of DCP's PROCESS checkpointer SIGKILLed mid-save.

This process checks what is on disk: TensorFlow (the oracle) reads every key and sees the
global values, ``shardckpt verify`` passes, no pickle anywhere, async == sync; TensorFlow
fixtures load through ``dcp.load`` into plain tensors; dtypes round-trip; the grid planner's
plans equal DCP's and take well under 50 ms for an 80x80-chunk tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.launchers import clean_env, launch_command
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardckpt.cli.main import main as cli_main
from shardckpt.errors import DataLossError, UnsupportedError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.location import Location
from shardckpt.torch import TFBundleReader, TFBundleWriter, read_items_for_chunks
from shardckpt.torch._objects import MAGIC, NESTING_KEY, decode_object

HERE = Path(__file__).resolve().parent
WORKER = HERE / "helpers" / "torch_dcp_worker.py"
LAUNCH_TIMEOUT = 300
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def launch(mode: str, nproc: int, data: Path, tmp: Path, worker: Path = WORKER
           ) -> Tuple[Any, Dict[int, Dict[str, Any]], str]:
    """Run one mode of ``worker``; returns the launcher's exit status, each rank's results, the log's tail."""
    out = tmp / f"{mode}-out"
    if mode == "load1":
        cmd = [sys.executable, str(worker)]
    else:
        cmd = launch_command("torch", nproc, worker)
    log = tmp / f"{mode}.log"
    with open(log, "wb") as f:
        try:
            rc: Any = subprocess.run(cmd + [mode, str(out), str(data)], stdout=f, stderr=subprocess.STDOUT,
                                     env=clean_env(), cwd=str(HERE.parent), timeout=LAUNCH_TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = log.read_text(errors="replace")[-6000:]
    results = {}
    for r in range(nproc):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (launcher exit {rc}); log:\n{tail}"
        results[r] = json.loads(path.read_text())
    return rc, results, tail


def assert_done(rc: Any, results: Dict[int, Dict[str, Any]], tail: str) -> None:
    for r, res in results.items():
        assert "fatal" not in res, f"rank {r} failed:\n{res['fatal']}\nlog:\n{tail}"
        assert res.get("done") and all(res["checks"].values()), (r, res, tail)
    assert rc == 0, f"launcher exit {rc}; log:\n{tail}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``save4`` launch; its data folder (checkpoints ``sync/ck``, ``async/ck``, ``saved.npz``, ...)."""
    tmp = tmp_path_factory.mktemp("torch_dcp")
    data = tmp / "data"
    rc, results, tail = launch("save4", 4, data, tmp)
    assert_done(rc, results, tail)
    assert set(results[0]["checks"]) == {"bad_object_refused", "bad_uint16_refused", "bad_nothing_written",
                                         "process_bad_refused", "process_again", "process_pair_refused", "no_dist_solo",
                                         "no_dist_solo_async", "no_dist_each_rank"}
    assert all(set(results[r]["checks"]) >= {"no_dist_each_rank", "process_again"} for r in results)
    assert [r for r in results if "process_pair_refused" in results[r]["checks"]] == [0, 1]
    return data


@pytest.mark.parametrize("mode,nproc", [("load2", 2), ("load3", 3), ("load1", 1)])
def test_load_other_layouts_and_continue(saved: Path, tmp_path: Path, mode: str, nproc: int) -> None:
    rc, results, tail = launch(mode, nproc, saved, tmp_path)
    assert_done(rc, results, tail)
    for res in results.values():
        for which in ("sync", "async"):  # the sync and the async checkpoint, default and grid planner
            for check in ("keys", "values", "extra", "losses", "continues"):
                assert res["checks"][f"{which}_{check}"] is True
        assert res["checks"]["fsdp_values"] and res["checks"]["fsdp_set"]  # the FSDP2 (HSDP) checkpoint
        if mode == "load2":
            assert res["checks"]["fixture_embed.weight"] and res["checks"]["fixture_dense.weight"]


def _stored(prefix: Path) -> Dict[str, Any]:
    with BundleReader(Location.of(str(prefix))) as reader:
        return {k.decode(): reader.read(k) for k in reader.keys()}


@pytest.mark.parametrize("which", ["async", "process"])
def test_async_checkpoint_equals_sync(saved: Path, which: str) -> None:
    """``dcp.async_save`` (thread, and PROCESS: the writer pickled to DCP's checkpoint processes) == ``dcp.save``.

    ``process/ck`` was also the target of a failed PROCESS save afterwards: it is as the first one left it.
    """
    sync, asyn = _stored(saved / "sync" / "ck"), _stored(saved / which / "ck")
    assert sync.keys() == asyn.keys()
    for key in sync:
        assert sync[key].dtype == asyn[key].dtype and np.array_equal(sync[key], asyn[key]), key
    assert not list((saved / which).glob("ck_temp_*"))


def test_no_pickle_on_disk(saved: Path) -> None:
    files = [p for p in saved.rglob("*") if p.is_file() and p.suffix != ".npz"]  # .npz: this test's own values
    assert files and not [p for p in files if p.name.endswith(".metadata") or "__" in p.name]
    for p in files:
        with open(p, "rb") as f:
            head = f.read(2)
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), p
    names = sorted(p.name for p in (saved / "sync").iterdir())
    assert names == ["ck.data-00000-of-00004", "ck.data-00001-of-00004", "ck.data-00002-of-00004",
                     "ck.data-00003-of-00004", "ck.index"]


def test_tensorflow_reads_every_key(saved: Path, tf_oracle: Any) -> None:
    values = dict(np.load(saved / "saved.npz"))
    got, errors, dtypes = tf_oracle.load_checkpoint(saved / "sync" / "ck")
    assert not errors
    tensors = {k: v for k, v in got.items() if dtypes[k] != "string"}
    assert set(tensors) == set(values)
    for key, expected in values.items():  # the global values, as bytes (bfloat16-safe)
        assert np.ascontiguousarray(tensors[key]).view(np.uint8).reshape(-1).tobytes() == expected.tobytes(), key
    objects = {k: v for k, v in got.items() if dtypes[k] == "string"}
    groups = {k for k in objects if k.startswith("optim.param_groups.0.")}  # DCP flattens the param groups
    assert set(objects) - groups == {"extra.step", "extra.note", "extra.sched.warmup", NESTING_KEY}
    assert all(bytes(v.reshape(()).item()).startswith(MAGIC) for v in objects.values())

    def obj(key: str) -> Any:
        return decode_object(bytes(objects[key].reshape(()).item()))
    assert obj("extra.step") == 3 and obj("extra.sched.warmup") == (1, 2.5)
    assert obj("optim.param_groups.0.betas") == (0.9, 0.99) and obj("optim.param_groups.0.lr") == 1e-2
    assert "emb" in obj("optim.param_groups.0.params")
    nesting = obj(NESTING_KEY)  # every key's path in the nested state dict, for loads without a target
    assert set(nesting) == set(objects) - {NESTING_KEY} | set(tensors)
    assert nesting["model.layers.0.q"] == ["model", "layers.0.q"] and nesting["extra.sched.warmup"] == [
        "extra", "sched", "warmup"]


def test_shardckpt_verify(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for which in ("sync", "async", "process", "process_again"):
        assert cli_main(["verify", str(saved / which / "ck")]) == 0
    capsys.readouterr()


def test_sharded_keys_are_tf_slices(saved: Path) -> None:
    with BundleReader(Location.of(str(saved / "sync" / "ck"))) as reader:
        # layers.0.q: [Shard(0), Shard(1)] on 2x2 -> four distinct slices, each written once
        specs = sorted(str(p.slice) for p in reader.pieces("model.layers.0.q"))
        assert specs == ["0,8:0,8", "0,8:8,8", "8,8:0,8", "8,8:8,8"]
        # emb: [Shard(0), Shard(1)] is index 0; head is replicated everywhere: one plain entry
        assert [p.slice for p in reader.pieces("model.emb")] != [None]
        entries = {k.decode() for k in reader.keys()}
        assert "optim.state.emb.exp_avg" in entries and "optim.state.emb.step" in entries


def test_no_dist_saves_in_a_multi_rank_job(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``no_dist=True`` with no coordinator given: each save was one process's own (one data file each)."""
    for name in ("solo", "solo_async", "rank0", "rank1", "rank2", "rank3"):
        assert sorted(p.name for p in (saved / "nodist").glob(f"{name}.*")) == [
            f"{name}.data-00000-of-00001", f"{name}.index"], name
        assert cli_main(["verify", str(saved / "nodist" / name)]) == 0
    assert not list((saved / "nodist").glob("*_temp_*"))
    assert np.array_equal(_stored(saved / "nodist" / "rank2")["w"], np.full(5, 2.0, dtype=np.float32))
    capsys.readouterr()


def test_jax_restores_torch_checkpoint(saved: Path, tmp_path: Path) -> None:
    """The 2x2-mesh DTensor checkpoint (sliced entries) restores bit-exact into a JAX pytree on a (2, 4) mesh."""
    out = tmp_path / "jax.json"
    proc = subprocess.run([sys.executable, str(HERE / "helpers" / "jax_from_torch.py"), str(saved / "sync" / "ck"),
                           str(saved / "saved.npz"), str(out)], env=clean_env(), cwd=str(HERE.parent),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    expected = set(np.load(saved / "saved.npz").files)
    assert set(result["checks"]) == expected and result["restored"] == len(expected)
    assert [k for k, ok in result["checks"].items() if not ok] == []
    assert result["sliced"] >= 10  # the sharded parameters and their AdamW moments are TF slices


def test_kill_mid_save_keeps_previous(tmp_path: Path) -> None:
    """A rank SIGKILLed mid-save, and before that a PROCESS checkpointer's checkpoint process SIGKILLed mid-save."""
    data = tmp_path / "data"
    rc, results, tail = launch("kill2", 2, data, tmp_path)
    assert rc not in (0, "timeout"), tail
    assert results[0].get("first_saved") and results[1].get("first_saved") and "second_saved" not in results[0]
    assert list((data / "kill").glob("ck_temp_*")), "the second save never started writing"
    sd = {"big": torch.zeros(1 << 23), "w": torch.zeros(1 << 20), "step": 0}
    dcp.load(sd, storage_reader=TFBundleReader(data / "kill" / "ck"))
    assert torch.equal(sd["big"], torch.arange(1 << 23, dtype=torch.float32))
    assert torch.equal(sd["w"], torch.arange(1 << 20, dtype=torch.float32) + 1000) and sd["step"] == 1
    assert cli_main(["verify", str(data / "kill" / "ck")]) == 0
    # the PROCESS checkpointer: every rank's future raised, the first checkpoint is intact and alone
    assert results[1].get("killed_mid_save"), tail
    assert all(res["checks"] == {"second_failed": True, "previous_intact": True} for res in results.values())
    assert "dead" in results[1]["second_error"]
    assert sorted(p.name for p in (data / "killproc").iterdir()) == [
        "ck.data-00000-of-00002", "ck.data-00001-of-00002", "ck.index"]
    sd = {"big": torch.zeros(1 << 23), "step": 0}
    dcp.load(sd, storage_reader=TFBundleReader(data / "killproc" / "ck"))
    assert torch.equal(sd["big"], torch.arange(1 << 23, dtype=torch.float32)) and sd["step"] == 1


# -- one process ------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def _value(dtype: Any, shape: Tuple[int, ...] = (5, 3)) -> Any:
    g = torch.Generator().manual_seed(3)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(-100 if dtype is not torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _bits(t: Any) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def test_dtypes_round_trip_one_process(tmp_path: Path) -> None:
    sd = {str(dt).replace("torch.", ""): _value(dt) for dt in DTYPES}
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.zeros(0, 3)
    sd["plain"] = {"i": 3, "f": float("inf"), "s": "x", "none": None, "t": [(1, 2), {"b": b"\x00", "k": [1.5]}]}
    prefix = tmp_path / "ck"
    dcp.save(sd, storage_writer=TFBundleWriter(prefix))
    target = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    # DCP flattens containers: the target has the same ones
    target["plain"] = {"i": 0, "f": 0, "s": "", "none": 1, "t": [None, {"b": None, "k": None}]}
    dcp.load(target, storage_reader=TFBundleReader(prefix))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert target[k].dtype == v.dtype and _bits(target[k]) == _bits(v), k
    assert target["plain"] == sd["plain"]
    with BundleReader(Location.of(str(prefix))) as reader:
        assert {k: reader.dtype(k).name for k in ("bfloat16", "float8_e4m3fn", "complex128", "bool")} == {
            "bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "complex128": "complex128", "bool": "bool"}


def test_writer_pickles_without_its_process_state(tmp_path: Path) -> None:
    """What DCP's PROCESS checkpointer does to the writer (in memory): the copy saves like the original."""
    import pickle

    writer = TFBundleWriter(tmp_path / "ck", fsync=False)
    writer.stage({"w": torch.ones(3)})  # a staging ticket of this process's stager: it stays here
    copy = pickle.loads(pickle.dumps(writer))
    assert copy._ticket is None and copy._background is None and copy._stager is writer._stager
    sd = {"w": torch.arange(6.0).reshape(2, 3), "step": 4}
    dcp.save(sd, storage_writer=copy)
    back = {"w": torch.zeros(2, 3), "step": 0}
    dcp.load(back, storage_reader=TFBundleReader(tmp_path / "ck"))
    assert torch.equal(back["w"], sd["w"]) and back["step"] == 4
    writer._stager.release(writer._ticket)  # type: ignore[arg-type]


def test_objects_round_trip_exactly() -> None:
    from shardckpt.torch._objects import encode_object

    value = {"lr": 1e-3, "betas": (0.9, 0.999), 3: [None, True, float("nan"), -float("inf"), b"\x00\xff"],
             (1, "a"): {"__tuple__": "not a tag"}, "s": "\u00e9"}
    back = decode_object(encode_object(value, "k"))
    assert back.keys() == value.keys() and back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert back[3][:2] == [None, True] and np.isnan(back[3][2]) and back[3][3:] == [-float("inf"), b"\x00\xff"]
    assert back[(1, "a")] == {"__tuple__": "not a tag"} and back["s"] == "\u00e9"


def test_an_object_entry_nested_too_deep_is_a_clear_error() -> None:
    with pytest.raises(DataLossError, match="unreadable encoded object"):
        decode_object(MAGIC + b"[" * 200_000, "k")


def test_writer_uses_tensor_memory(tmp_path: Path) -> None:
    """A CPU tensor's bytes go to storage from its own memory (the NumPy view shares the pointer)."""
    from shardckpt.format.dtypes import as_dtype
    from shardckpt.torch._dtypes import numpy_view

    for dt in (torch.float32, torch.bfloat16, torch.float8_e5m2):
        t = _value(dt, (64, 8))
        assert numpy_view(t, as_dtype(str(dt).replace("torch.", ""))).ctypes.data == t.data_ptr()


@pytest.mark.parametrize("bad,key,words", [
    ({"w": torch.zeros(2), "u": torch.zeros(2, dtype=torch.uint32)}, "'u'", "uint32"),
    ({"w": torch.zeros(2), "o": {"inner": [1, object()]}}, "'o.inner'", "pickle"),
    ({"w": torch.zeros(2), "s": {1, 2}}, "'s'", "pickle"),
])
def test_bad_state_dict_refused_nothing_written(tmp_path: Path, bad: Dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(BaseException) as info:  # DCP wraps errors in CheckpointException (a BaseException)
        dcp.save(bad, storage_writer=TFBundleWriter(tmp_path / "ck"))
    assert key in str(info.value) and words in str(info.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UnsupportedError, match="uint32"):
        from shardckpt.torch._dtypes import to_bundle_dtype
        to_bundle_dtype(torch.uint32, "k")


def _tf_key(key: str) -> str:
    return key.replace("/.ATTRIBUTES/VARIABLE_VALUE", "").replace("/", ".")


def test_tensorflow_fixtures_load_into_torch(tf_fixtures_dir: Path) -> None:
    case = tf_fixtures_dir / "01_basic_float32_int64"
    expected = np.load(case / "expected.npz")
    sd = {_tf_key(k): torch.zeros(tuple(expected[k].shape), dtype=torch.from_numpy(expected[k]).dtype)
          for k in expected.files}
    dcp.load(sd, storage_reader=TFBundleReader(case / "ckpt", key_map=_tf_key))
    for k in expected.files:
        assert np.array_equal(sd[_tf_key(k)].numpy(), expected[k]), k
    # a TF1 Saver checkpoint with partitioned (sliced) variables, names mapped by a dict
    case = tf_fixtures_dir / "08_tf1_saver_partitioned"
    expected = np.load(case / "expected.npz")
    names = {"embedding/table": "embed.weight", "lookup/ids": "ids", "global_step": "step"}
    sd = {fqn: torch.zeros(tuple(expected[k].shape), dtype=torch.from_numpy(expected[k]).dtype)
          for k, fqn in names.items()}
    dcp.load(sd, storage_reader=TFBundleReader(case / "model.ckpt-100", key_map=names))
    for k, fqn in names.items():
        assert np.array_equal(sd[fqn].numpy(), expected[k]), k


def _grid(n: int, size: int) -> Any:
    step = size // n
    return [ChunkStorageMetadata(offsets=torch.Size([i * step, j * step]), sizes=torch.Size([step, step]))
            for i in range(n) for j in range(n)]


def test_grid_planner_matches_dcp_and_is_fast() -> None:
    size = 6400
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([size, size]),
                               chunks=_grid(80, size))
    local = [ChunkStorageMetadata(offsets=torch.Size([i * 1600 + 7 * (i > 0), 0]),
                                  sizes=torch.Size([1600 - 7 * (i > 0) + 7 * (i < 3), size])) for i in range(4)]
    ours = read_items_for_chunks("w", md, local)
    theirs = create_read_items_for_chunk_list("w", md, local)

    def norm(items: Any) -> Any:
        return sorted((tuple(i.dest_index.offset), tuple(i.dest_offsets), tuple(i.storage_index.offset),
                       tuple(i.storage_offsets), tuple(i.lengths)) for i in items)
    assert norm(ours) == norm(theirs)
    # a rank of a resharded load: 80x80 stored chunks, its chunk an eighth of the rows, off the cuts
    md80 = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([size, size]),
                                 chunks=_grid(80, size))
    eighth = [ChunkStorageMetadata(offsets=torch.Size([840, 0]), sizes=torch.Size([800, size]))]
    best = min(_timed(lambda: read_items_for_chunks("w", md80, eighth)) for _ in range(7))
    assert best < 0.05, f"planning took {best * 1e3:.1f} ms"
    assert len(read_items_for_chunks("w", md80, eighth)) == 11 * 80
    # many local chunks (another 80x80 grid, shifted by half a chunk): the same reads as DCP's planner
    shifted = [ChunkStorageMetadata(offsets=torch.Size([i * 80 + 40 * (i > 0), j * 80]),
                                    sizes=torch.Size([80 - 40 * (i > 0) + 40 * (i < 79), 80]))
               for i in range(80) for j in range(80)]
    assert norm(read_items_for_chunks("w", md80, shifted)) == norm(create_read_items_for_chunk_list(
        "w", md80, shifted))


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class _RegionPlanner:
    """The two planner calls ``read_data`` makes, serving one destination tensor."""

    def __init__(self, dest: Any) -> None:
        self.dest = dest

    def resolve_tensor(self, item: Any) -> Any:
        out = self.dest
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            out = out.narrow(d, o, n)
        return out

    def commit_tensor(self, item: Any, tensor: Any) -> None:
        pass


def test_reader_reads_only_overlapping_bytes(tmp_path: Path) -> None:
    """Reading rows 256..383 of a stored 512x512 tensor reads those rows' bytes and no others."""
    from torch.distributed.checkpoint.planner import LoadPlan

    from shardckpt.storage.local import LocalFileSystem

    prefix = tmp_path / "ck"
    w = torch.randn(512, 512)
    dcp.save({"w": w}, storage_writer=TFBundleWriter(prefix))
    counted = [0]
    original = LocalFileSystem.pread_into

    def counting(self: Any, fd: Any, buf: Any, offset: int, path: str) -> Any:
        counted[0] += memoryview(buf).nbytes
        return original(self, fd, buf, offset, path)

    reader = TFBundleReader(prefix)
    md = reader.read_metadata()
    items = read_items_for_chunks("w", md.state_dict_metadata["w"], [
        ChunkStorageMetadata(offsets=torch.Size([256, 0]), sizes=torch.Size([128, 512]))])
    dest = torch.zeros(128, 512)
    LocalFileSystem.pread_into = counting  # type: ignore[method-assign]
    try:
        reader.read_data(LoadPlan(items), _RegionPlanner(dest)).wait()  # type: ignore[arg-type]
    finally:
        LocalFileSystem.pread_into = original  # type: ignore[method-assign]
    assert torch.equal(dest, w[256:384])
    assert counted[0] == 128 * 512 * 4


def test_stager_reuses_buffers_only_when_released() -> None:
    from shardckpt.torch._staging import HostStager

    stager = HostStager()
    sd = {"w": torch.arange(6.0), "inner": {"b": torch.ones(2, dtype=torch.bfloat16)}, "n": [1, 2]}
    first, ticket = stager.stage(sd)
    sd["w"].add_(1)  # training goes on: the staged copy keeps the old values
    assert torch.equal(first["w"], torch.arange(6.0)) and first["n"] == [1, 2] and first["n"] is not sd["n"]
    second, ticket2 = stager.stage(sd)  # the first save still writes: new buffers
    assert second["w"].data_ptr() != first["w"].data_ptr() and torch.equal(first["w"], torch.arange(6.0))
    stager.release(ticket)  # an old ticket frees nothing
    third, ticket3 = stager.stage(sd)
    assert third["w"].data_ptr() != second["w"].data_ptr()
    stager.release(ticket3)
    fourth, _ = stager.stage(sd)  # released: the same buffers, refilled
    assert fourth["w"].data_ptr() == third["w"].data_ptr() and torch.equal(fourth["w"], sd["w"])
    assert fourth["inner"]["b"].dtype == torch.bfloat16
    del ticket2


def test_staging_for_another_process_is_shared_and_never_reused() -> None:
    """DCP's PROCESS checkpointer sends the staged copy by file descriptor: ``shared`` staging makes its
    buffers in shared memory (sent as they are, not copied again) and new ones each time, even once
    released (this process cannot tell when the checkpoint process is done reading them)."""
    from shardckpt.torch._staging import HostStager

    stager = HostStager()
    sd = {"w": torch.arange(6.0), "b": [torch.ones(2, dtype=torch.bfloat16)]}
    first, ticket = stager.stage(sd, shared=True)
    assert first["w"].is_shared() and first["b"][0].is_shared() and torch.equal(first["w"], sd["w"])
    stager.release(ticket)
    second, _ = stager.stage(sd, shared=True)
    assert second["w"].is_shared() and second["w"].data_ptr() != first["w"].data_ptr()
    plain, _ = HostStager().stage(sd)
    assert not plain["w"].is_shared()


def test_released_staging_buffers_are_dropped_and_made_again() -> None:
    """``release_staging_buffers`` drops the kept buffers, so their memory returns; the next staging
    allocates new ones with the right values, and a copy a save still writes is left alone."""
    import weakref

    from shardckpt.torch import release_staging_buffers
    from shardckpt.torch._staging import HostStager, default_stager

    stager = HostStager()
    sd = {"w": torch.arange(6.0)}
    first, ticket = stager.stage(sd)
    stager.release(ticket)  # the save is over: the buffers are kept for the next one
    kept = weakref.ref(first["w"])
    del first
    assert kept() is not None  # held by the stager
    stager.clear()
    assert kept() is None  # nothing holds it: its memory is free
    sd["w"].add_(1)
    second, ticket = stager.stage(sd)
    assert torch.equal(second["w"], torch.arange(6.0) + 1)
    stager.clear()  # while a save writes `second`: its buffers stay valid
    assert torch.equal(second["w"], torch.arange(6.0) + 1)
    stager.release(ticket)
    stager_default = default_stager()
    _, ticket = stager_default.stage({"v": torch.ones(4)})
    stager_default.release(ticket)
    assert stager_default._buffers
    release_staging_buffers()
    assert not stager_default._buffers


def test_object_store_round_trip(s3_server: Any) -> None:
    """An ``s3://`` prefix: the index-last committer writes, region reads serve the load."""
    prefix = s3_server.url("torch", "step-1")
    sd = {"w": _value(torch.bfloat16, (64, 32)), "step": 1}
    dcp.save(sd, storage_writer=TFBundleWriter(prefix))
    target = {"w": torch.zeros(64, 32, dtype=torch.bfloat16), "step": 0}
    dcp.load(target, storage_reader=TFBundleReader(prefix))
    assert _bits(target["w"]) == _bits(sd["w"]) and target["step"] == 1
    assert TFBundleReader.validate_checkpoint_id(prefix) and not TFBundleReader.validate_checkpoint_id(prefix + "x")


def test_reads_shardckpt_checkpoints(tmp_path: Path) -> None:
    """What shardckpt's own front doors wrote (here a sliced save_tensors) loads through DCP."""
    import shardckpt
    from shardckpt.sharding.shardable import ShardableTensor

    full = np.arange(60, dtype=np.float32).reshape(6, 10)
    pieces = [ShardableTensor.from_value("layer/w", full[:3], slice_spec="6 10 0,3:-"),
              ShardableTensor.from_value("layer/w", full[3:], slice_spec="6 10 3,3:-"),
              ShardableTensor.from_value("count", np.int64(5))]
    shardckpt.save_tensors(str(tmp_path / "ck"), pieces)
    sd = {"layer.w": torch.zeros(6, 10), "count": torch.zeros((), dtype=torch.int64)}
    dcp.load(sd, storage_reader=TFBundleReader(tmp_path / "ck", key_map={"layer/w": "layer.w"}))
    assert np.array_equal(sd["layer.w"].numpy(), full) and int(sd["count"]) == 5


def test_load_casts_into_other_dtypes(tmp_path: Path) -> None:
    """A destination of another dtype is filled through a temporary and ``copy_`` (as DCP's reader casts)."""
    w = _value(torch.bfloat16, (16, 8))
    dcp.save({"w": w}, storage_writer=TFBundleWriter(tmp_path / "ck"))
    target = {"w": torch.zeros(16, 8, dtype=torch.float32)}
    dcp.load(target, storage_reader=TFBundleReader(tmp_path / "ck"))
    assert torch.equal(target["w"], w.to(torch.float32))


def test_key_map_drops_and_refuses_collisions(tf_fixtures_dir: Path) -> None:
    prefix = tf_fixtures_dir / "01_basic_float32_int64" / "ckpt"
    md = TFBundleReader(prefix, key_map=lambda k: "v" if k.startswith("vec_f32") else None).read_metadata()
    assert list(md.state_dict_metadata) == ["v"] and tuple(md.state_dict_metadata["v"].size) == (7,)
    with pytest.raises(ValueError, match="maps both"):
        TFBundleReader(prefix, key_map=lambda k: "same").read_metadata()
    with pytest.raises(ValueError, match="callable or a dict"):
        TFBundleReader(prefix, key_map=["not", "a", "map"])  # type: ignore[arg-type]


def _chunks(boxes: Any) -> Any:
    return [ChunkStorageMetadata(offsets=torch.Size([a for a, _ in box]), sizes=torch.Size([b - a for a, b in box]))
            for box in boxes]


def test_small_and_array_grids_agree() -> None:
    """The plain-Python grid (few chunks) and the NumPy one find the same grids and refuse the same non-grids."""
    from shardckpt.torch._planner import _array_grid, _small_grid

    cases = {
        "2x3": [((r, r + 5), (c, c + 4)) for r in (0, 5) for c in (0, 4, 8)],
        "uneven 3x1": [((0, 4), (0, 9)), ((4, 5), (0, 9)), ((5, 11), (0, 9))],
        "1-D shuffled": [((6, 9),), ((0, 2),), ((2, 6),)],
        "3-D": [((a, a + 2), (b, b + 3), (0, 4)) for a in (0, 2) for b in (0, 3, 6)],
        "gap": [((0, 4), (0, 2)), ((5, 8), (0, 2))],
        "overlap": [((0, 4),), ((3, 8),)],
        "two sizes at one start": [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((4, 8), (0, 3)), ((4, 8), (3, 4))],
        "missing cell": [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 2))],
        "duplicate cell": [((0, 2), (0, 2)), ((0, 2), (0, 2)), ((2, 4), (0, 2)), ((2, 4), (0, 2))],
        "empty size": [((0, 0), (0, 2))],
    }
    for name, boxes in cases.items():
        chunks = _chunks(boxes)
        small, array = _small_grid(chunks, len(boxes[0])), _array_grid(chunks, len(boxes[0]))
        assert (small is None) == (array is None), name
        assert (small is None) == (name in ("gap", "overlap", "two sizes at one start", "missing cell",
                                            "duplicate cell", "empty size")), name
        if small is not None and array is not None:
            assert (small.cuts, small.strides, small.cells) == (array.cuts, array.strides, array.cells), name


def test_reader_threads_follow_the_ranks_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With as many ranks on the host as cores, the reader reads on the calling thread without
    checksum helpers, and still checks every whole chunk it reads."""
    from torch.distributed.checkpoint.planner import LoadPlan

    from shardckpt.torch import _reader

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert _reader.threads_per_rank() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert _reader.threads_per_rank() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    prefix = tmp_path / "ck"
    w = torch.randn(1024, 1024)  # 4 MiB: one entry of several read units
    dcp.save({"w": w}, storage_writer=TFBundleWriter(prefix))
    reader = TFBundleReader(prefix)
    md = reader.read_metadata()
    assert reader._workers == 1 and reader._bundle is not None and reader._bundle._context.workers == 0
    items = read_items_for_chunks("w", md.state_dict_metadata["w"], [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1024, 1024]))])
    dest = torch.zeros(1024, 1024)
    reader.read_data(LoadPlan(items), _RegionPlanner(dest)).wait()  # type: ignore[arg-type]
    assert torch.equal(dest, w)
    reader.close()
    data = next(p for p in tmp_path.iterdir() if ".data-" in p.name)
    with open(data, "r+b") as f:  # one flipped bit in the middle of the entry
        f.seek(2 << 20)
        byte = f.read(1)
        f.seek(2 << 20)
        f.write(bytes([byte[0] ^ 1]))
    reader = TFBundleReader(prefix)
    md = reader.read_metadata()
    with pytest.raises(DataLossError, match="checksum"):
        reader.read_data(LoadPlan(items), _RegionPlanner(torch.zeros(1024, 1024)))  # type: ignore[arg-type]
    reader.close()


@pytest.mark.parametrize("map_reads", [None, True, False], ids=["default", "maps", "calls"])
def test_map_reads_copy_the_columns_out_of_a_map(tmp_path: Path, map_reads: Optional[bool]) -> None:
    """Half of every row of a stored 1024x2048 chunk (a load 4 -> 2, row- to column-sharded): by
    default and with ``map_reads=True`` copied out of a memory map (``mapped_bytes``: exactly the
    half rows' bytes, nothing through read calls' ``rchar`` beyond the index), with ``False``
    through read calls; the values exact either way."""
    from torch.distributed.checkpoint.planner import LoadPlan

    from shardckpt.storage import mapped

    assert mapped.available()  # Linux: maps serve resharded reads by default (what this test holds)
    prefix = tmp_path / "ck"
    w = torch.randn(1024, 2048)
    dcp.save({"w": w}, storage_writer=TFBundleWriter(prefix))
    reader = TFBundleReader(prefix, map_reads=map_reads, max_workers=1)
    md = reader.read_metadata()
    items = read_items_for_chunks("w", md.state_dict_metadata["w"], [
        ChunkStorageMetadata(offsets=torch.Size([0, 1024]), sizes=torch.Size([1024, 1024]))])
    dest = torch.zeros(1024, 1024)
    before = _rchar()
    reader.read_data(LoadPlan(items), _RegionPlanner(dest)).wait()  # type: ignore[arg-type]
    counted = _rchar() - before
    assert torch.equal(dest, w[:, 1024:])
    needed = 1024 * 1024 * 4
    if map_reads is False:
        assert reader.mapped_bytes == 0 and counted + reader.ring_bytes >= needed
    else:
        assert reader.mapped_bytes == needed and reader.ring_bytes == 0 and counted < needed // 8
    reader.close()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _sliced(prefix: Path, full: np.ndarray, boxes: Any) -> None:
    """A bundle holding ``full`` as the slices ``boxes`` (TF's slice spelling), like a sharded save."""
    from shardckpt.format.bundle_writer import BundleWriter

    writer = BundleWriter(Location.of(str(prefix)))
    for box in boxes:
        spec = ":".join("-" if (a, b) == (0, n) else f"{a},{b - a}" for (a, b), n in zip(box, full.shape))
        writer.add_slice("w", full.shape, spec, np.ascontiguousarray(full[tuple(slice(a, b) for a, b in box)]))
    writer.finish()


def test_whole_chunk_reads_checksum_each_piece_as_it_lands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load onto the saved layout (every read item one whole stored chunk): each chunk is read through
    the read pump in 2 MiB pieces, each piece checksummed right after it is read (no second pass over
    the chunk); a flipped byte in a chunk is a DataLossError naming the key, the slice and the data file."""
    from torch.distributed.checkpoint.planner import LoadPlan

    from shardckpt.format import crc, whole_reads

    full = np.random.default_rng(3).standard_normal((2048, 1024)).astype(np.float32)
    prefix = tmp_path / "ck"
    _sliced(prefix, full, [((0, 1024), (0, 1024)), ((1024, 2048), (0, 1024))])  # two chunks of 4 MiB
    pieces: List[int] = []
    real_read_range, real_extend = whole_reads.read_range, crc.extend

    def read_range(*args: Any, **kwargs: Any) -> int:
        pieces.append(-len(args[4]))  # an entry's range handed to the piece loop
        return real_read_range(*args, **kwargs)

    def extend(value: int, data: Any) -> int:
        pieces.append(memoryview(data).nbytes)
        return real_extend(value, data)

    monkeypatch.setattr(whole_reads, "read_range", read_range)
    monkeypatch.setattr(crc, "extend", extend)

    def load(rows: int) -> torch.Tensor:
        reader = TFBundleReader(prefix, max_workers=1)
        md = reader.read_metadata()
        items = read_items_for_chunks("w", md.state_dict_metadata["w"], [
            ChunkStorageMetadata(offsets=torch.Size([rows, 0]), sizes=torch.Size([1024, 1024]))])
        dest = torch.zeros(1024, 1024)
        pieces.clear()
        try:
            reader.read_data(LoadPlan(items), _RegionPlanner(dest)).wait()  # type: ignore[arg-type]
        finally:
            reader.close()
        return dest

    assert np.array_equal(load(1024).numpy(), full[1024:])
    assert pieces == [-(4 << 20), 2 << 20, 2 << 20]  # one 4 MiB chunk: two 2 MiB pieces, each checksummed
    with BundleReader(Location.of(str(prefix))) as bundle:
        piece = [p for p in bundle.pieces("w") if p.box[0][0] == 1024][0]
        data_file = bundle.data_path(piece.entry.shard_id)
        at = int(piece.entry.offset) + (3 << 20) + 5
    with open(data_file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    assert np.array_equal(load(0).numpy(), full[:1024])  # the other chunk is intact
    with pytest.raises(DataLossError, match="checksum does not match") as caught:
        load(1024)
    message = str(caught.value)
    assert "key 'w'" in message and "slice 1024,1024:-" in message and data_file in message
    assert caught.value.path == data_file


def test_columns_load_straight_into_a_strided_destination(tmp_path: Path) -> None:
    """Rows of column-sharded chunks into the columns of a row-sharded destination (4 -> 2,
    ``Shard(1)`` -> ``Shard(0)``): each item is one range of its file, read by ``preadv`` calls
    with a buffer per destination row (up to 1024 rows a call), no temporary of the item, and
    exactly the bytes needed."""
    import tracemalloc

    from torch.distributed.checkpoint.planner import LoadPlan

    full = np.random.default_rng(4).standard_normal((1024, 1024)).astype(np.float32)
    prefix = tmp_path / "ck"
    _sliced(prefix, full, [((0, 1024), (k * 256, (k + 1) * 256)) for k in range(4)])
    reader = TFBundleReader(prefix, max_workers=1)
    md = reader.read_metadata()
    items = read_items_for_chunks("w", md.state_dict_metadata["w"], [
        ChunkStorageMetadata(offsets=torch.Size([512, 0]), sizes=torch.Size([512, 1024]))])
    assert len(items) == 4
    dest = torch.zeros(512, 1024)
    calls: List[int] = []
    real = os.preadv

    def counted(fd: int, buffers: Any, at: int, *rest: Any) -> int:
        got = real(fd, buffers, at, *rest)
        calls.append(got)
        return got

    os.preadv = counted  # type: ignore[assignment]
    tracemalloc.start()
    try:
        reader.read_data(LoadPlan(items), _RegionPlanner(dest)).wait()  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.preadv = real  # type: ignore[assignment]
        reader.close()
    assert np.array_equal(dest.numpy(), full[512:])
    assert calls == [512 * 256 * 4] * 4  # one call per item
    assert peak < 256 << 10  # a temporary of one item would be 512 KiB


def test_rows_halves_load_through_few_calls_and_count_their_bytes(tmp_path: Path) -> None:
    """Half of every row of a stored chunk (4 -> 2, ``Shard(0)`` -> ``Shard(1)``): exactly those bytes
    are read (through io_uring where available, counted in ``ring_bytes``), the values exact."""
    from torch.distributed.checkpoint.planner import LoadPlan

    from shardckpt.storage import uring

    w = torch.randn(1024, 2048)
    prefix = tmp_path / "ck"
    dcp.save({"w": w}, storage_writer=TFBundleWriter(prefix))
    reader = TFBundleReader(prefix, max_workers=1, map_reads=False)  # read calls (maps: the test above)
    md = reader.read_metadata()
    items = read_items_for_chunks("w", md.state_dict_metadata["w"], [
        ChunkStorageMetadata(offsets=torch.Size([0, 1024]), sizes=torch.Size([1024, 1024]))])
    dest = torch.zeros(1024, 1024)
    with open("/proc/self/io") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    reader.read_data(LoadPlan(items), _RegionPlanner(dest)).wait()  # type: ignore[arg-type]
    with open("/proc/self/io") as f:
        counted = next(int(line.split()[1]) for line in f if line.startswith("rchar:")) - before
    reader.close()
    assert torch.equal(dest, w[:, 1024:])
    if uring.available():
        assert reader.ring_bytes == 1024 * 1024 * 4
    else:
        assert reader.ring_bytes == 0 and counted >= 1024 * 1024 * 4
    assert counted + reader.ring_bytes < 1024 * 1024 * 4 * 1.1
