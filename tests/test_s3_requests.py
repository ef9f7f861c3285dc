"""Object stores: what a save and a restore cost in requests, and that the shortcuts keep the protocol.

On the test S3 server (moto, behind the request-recording proxy of tests/helpers/s3_faults.py):

* a restore opens the checkpoint with one listing and one GET of the index (no HEADs: the
  listing gives every object's identity and later reads are pinned to it with If-Match),
  then reads every requested tensor with few large GETs planned across tensors; so do
  ``Checkpoint.restore`` (object-graph and name-based), ``restore_v2``, a resharded DTensor
  restore, ``shardckpt.jax.restore`` and a DCP load through the torch reader; opening a
  checkpoint by path sends no HEAD;
* a column-resharded restore fetches the bytes it needs in few GETs (the gaps follow the
  cost model: free requests fetch exactly the needed bytes);
* reads of an object replaced since the checkpoint was opened fail, prefetched or not;
* a save to a fresh prefix sends, besides its data objects, two listings before and one
  after the uploads and the index PUT; the check before the commit still refuses a data
  object that was deleted or replaced meanwhile (nothing is committed).
"""

from __future__ import annotations

import os
import sys
from typing import Any, List

import numpy as np
import pytest
import s3fs  # noqa: F401 - the optional extra; the test extra installs it (missing = failure, not a skip)

import shardckpt
from shardckpt.errors import AbortedError, CheckpointReplacedError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.fsspec_fs import FsspecFileSystem
from shardckpt.storage.location import Location
from shardckpt.storage.registry import mounted
from shardckpt.storage.wrappers import FileSystemWrapper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from s3_faults import FaultProxy, configured, s3_fs  # noqa: E402  (tests/helpers)


def _kinds(requests: List[str]) -> List[str]:
    """Each recorded request as ``HEAD``, ``LIST``, ``LIST-UPLOADS``, ``GET index``, ``GET data``, ``PUT data``..."""
    out = []
    for r in requests:
        method, path = r.split(" ", 1)
        if "list-type=2" in path:
            out.append("LIST")
        elif "uploads" in path and method == "GET":
            out.append("LIST-UPLOADS")
        else:
            what = "index" if path.split("?")[0].endswith(".index") else "data" if ".data-" in path else path
            out.append(f"{method} {what}")
    return out


def _tensors(count: int, each: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"t{i:02d}": rng.standard_normal(each).astype(np.float32) for i in range(count)}


def test_full_restore_is_one_listing_one_index_get_and_one_get_per_data_object(s3_server: Any, s3dir: str) -> None:
    tensors = _tensors(64, 4096)  # 64 tensors of 16 KiB in 4 data objects of 256 KiB
    prefix = f"{s3dir}/ck"
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        shardckpt.save_tensors(prefix, tensors, shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(256 << 10)))
        proxy.requests.clear()
        out = shardckpt.restore_tensors(prefix, list(tensors), max_workers=4)
        kinds = _kinds(proxy.requests)
    for got, key in zip(out, tensors):
        np.testing.assert_array_equal(got, tensors[key])
    assert sorted(kinds) == ["GET data"] * 4 + ["GET index", "LIST"], proxy.requests


def _module(values: dict) -> Any:
    model = shardckpt.Module()
    model.tensors = [shardckpt.Variable(v) for v in values.values()]
    return model


def test_checkpoint_restore_reads_every_variable_in_one_get_per_data_object(s3_server: Any, s3dir: str) -> None:
    """Checkpoint.restore announces every variable's bytes before reading: a full restore of 64 variables is
    one listing, one GET of the index (no HEAD to resolve the path) and one GET per data object (four hold
    the variables, the fifth the object graph, read first)."""
    tensors = _tensors(64, 4096)  # 64 variables of 16 KiB in data objects of at most 256 KiB
    prefix = f"{s3dir}/ck"
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        shardckpt.Checkpoint(model=_module(tensors)).write(prefix, shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(256 << 10)))
        objects = len([n for n in s3_fs().listdir(s3dir) if ".data-" in n])
        target = _module({k: np.zeros_like(v) for k, v in tensors.items()})
        proxy.requests.clear()
        shardckpt.Checkpoint(model=target).read(prefix).assert_consumed()  # read: write's pair (no save_counter)
        kinds = _kinds(proxy.requests)
    for variable, value in zip(target.tensors, tensors.values()):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert objects == 5
    assert sorted(kinds) == ["GET data"] * objects + ["GET index", "LIST"], " ".join(kinds)


def test_name_based_restore_reads_every_variable_in_one_get_per_data_object(s3_server: Any, s3dir: str) -> None:
    """A checkpoint without an object graph (TF1 Saver names): the variables' bytes are announced too."""
    tensors = _tensors(32, 4096)
    prefix = f"{s3dir}/ck"
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        shardckpt.save_tensors(prefix, tensors, shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(128 << 10)))
        objects = len([n for n in s3_fs().listdir(s3dir) if ".data-" in n])
        model = shardckpt.Module()
        model.tensors = [shardckpt.Variable(np.zeros_like(v), name=k) for k, v in tensors.items()]
        proxy.requests.clear()
        shardckpt.Checkpoint(model=model).restore(prefix).assert_existing_objects_matched()
        kinds = _kinds(proxy.requests)
    for variable, value in zip(model.tensors, tensors.values()):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert objects == 4
    assert sorted(kinds) == ["GET data"] * objects + ["GET index", "LIST"], " ".join(kinds)


def test_resharded_dtensor_restore_announces_its_regions(s3_server: Any, s3dir: str) -> None:
    """DVariables say which regions their restore reads (``regions_to_read``): a restore onto another layout
    fetches them with the variables' data object in a few GETs, not one per region."""
    from shardckpt import dtensor as dt

    rng = np.random.default_rng(5)
    values = {f"v{i:02d}": rng.standard_normal((64, 256)).astype(np.float32) for i in range(16)}
    saved_on = dt.create_mesh([("x", 2), ("y", 4)])
    prefix = f"{s3dir}/ck"
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        dt.DTensorCheckpoint(saved_on, **{k: dt.DVariable.from_global(v, dt.Layout(["x", dt.UNSHARDED], saved_on))
                                          for k, v in values.items()}).write(prefix)
        objects = len([n for n in s3_fs().listdir(s3dir) if ".data-" in n])
        mesh = dt.create_mesh([("y", 4)])
        targets = {k: dt.DVariable.from_global(np.zeros((64, 256), np.float32), dt.Layout([dt.UNSHARDED, "y"], mesh))
                   for k in values}
        proxy.requests.clear()
        dt.DTensorCheckpoint(mesh, **targets).read(prefix).assert_consumed()
        kinds = _kinds(proxy.requests)
    for key, value in values.items():
        np.testing.assert_array_equal(dt.to_global(targets[key]), value)
    assert objects == 2  # one per row block of the saved layout (the object graph at the end of the first)
    # the graph, then every region (16 variables x 4 column blocks, each over both row blocks) in one
    # GET per data object
    assert sorted(kinds) == ["GET data"] * (1 + objects) + ["GET index", "LIST"], " ".join(kinds)


def test_restore_v2_reads_in_one_get_per_data_object_and_load_checkpoint_sends_no_head(
        s3_server: Any, s3dir: str) -> None:
    """restore_v2 announces every requested range (whole tensors and a region) before reading; opening a
    checkpoint by path on an object store is the reader's listing and index GET, no HEAD."""
    from shardckpt.io import restore_v2

    tensors = _tensors(32, 4096)
    prefix = f"{s3dir}/ck"
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        shardckpt.save_tensors(prefix, tensors, shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(128 << 10)))
        objects = len([n for n in s3_fs().listdir(s3dir) if ".data-" in n])
        names = list(tensors)
        specs = [""] * (len(names) - 1) + ["4096 100,200"]
        proxy.requests.clear()
        got = restore_v2(prefix, names, specs, [np.float32] * len(names))
        restored = _kinds(proxy.requests)
        proxy.requests.clear()
        with shardckpt.load_checkpoint(prefix) as reader:
            opened = _kinds(proxy.requests)
            np.testing.assert_array_equal(reader.get_tensor("t03"), tensors["t03"])
    for key, value, spec in zip(names, got, specs):
        np.testing.assert_array_equal(value, tensors[key] if not spec else tensors[key][100:300])
    assert objects == 4
    assert sorted(restored) == ["GET data"] * objects + ["GET index", "LIST"], " ".join(restored)
    assert sorted(opened) == ["GET index", "LIST"], " ".join(opened)


def test_jax_restore_reads_in_one_get_per_data_object(s3_server: Any, s3dir: str) -> None:
    """shardckpt.jax.restore announces every leaf's reads (NumPy leaves whole, each array's regions):
    one GET per data object, and the path opened without a HEAD."""
    import jax.numpy as jnp

    import shardckpt.jax as sj

    tensors = _tensors(32, 4096)
    tree = {"arrays": {k: jnp.asarray(v) for k, v in list(tensors.items())[:24]},
            "host": {k: v for k, v in list(tensors.items())[24:]}}
    prefix = f"{s3dir}/ck"
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        sj.save(prefix, tree, options=shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(128 << 10)))
        objects = len([n for n in s3_fs().listdir(s3dir) if ".data-" in n])
        target = {"arrays": {k: jnp.zeros(4096, jnp.float32) for k in tree["arrays"]},
                  "host": {k: np.zeros(4096, np.float32) for k in tree["host"]}}
        proxy.requests.clear()
        got = sj.restore(prefix, target)
        kinds = _kinds(proxy.requests)
    for group in ("arrays", "host"):
        for key, value in got[group].items():
            np.testing.assert_array_equal(np.asarray(value), tensors[key])
    assert objects == 5  # four hold the leaves, one the saved structure (not read onto a target)
    assert sorted(kinds) == ["GET data"] * 4 + ["GET index", "LIST"], " ".join(kinds)


def test_dcp_load_reads_every_chunk_in_one_get_per_data_object(s3_server: Any, s3dir: str) -> None:
    """The torch reader announces every read item's bytes: a DCP load is one GET per data object."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardckpt.torch import TFBundleReader

    tensors = _tensors(32, 4096)
    prefix = f"{s3dir}/ck"
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        shardckpt.save_tensors(prefix, tensors, shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(128 << 10)))
        objects = len([n for n in s3_fs().listdir(s3dir) if ".data-" in n])
        state = {k: torch.zeros(4096) for k in tensors}
        proxy.requests.clear()
        dcp.load(state, storage_reader=TFBundleReader(prefix), no_dist=True)
        kinds = _kinds(proxy.requests)
    for key, value in tensors.items():
        np.testing.assert_array_equal(state[key].numpy(), value)
    assert objects == 4
    assert sorted(kinds) == ["GET data"] * objects + ["GET index", "LIST"], " ".join(kinds)


def test_large_objects_are_read_in_parallel_parts_of_the_read_cap(s3_server: Any, s3dir: str) -> None:
    tensors = _tensors(8, 256 << 10)  # 8 MiB in one data object, read in parts of 1 MiB
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, tensors)
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint, read_part_size=1 << 20,
                                                              read_latency=0.001, read_bandwidth=100e6):
        fs = s3_fs()
        fs.reset_stats()
        proxy.requests.clear()
        out = shardckpt.restore_tensors(prefix, list(tensors))
        kinds = _kinds(proxy.requests)
        assert fs.stats["bytes_read"] - fs.size(prefix + ".index") == 8 << 20, fs.stats
    for got, key in zip(out, tensors):
        np.testing.assert_array_equal(got, tensors[key])
    assert kinds.count("GET data") == 8 and "HEAD data" not in kinds, proxy.requests


@pytest.mark.parametrize("latency", [0.02, 0.0], ids=["default-cost", "free-requests"])
def test_column_resharded_restore_fetches_what_it_needs_in_few_gets(s3dir: str, latency: float) -> None:
    full = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
    pieces = [shardckpt.ShardableTensor.from_value(
        "w", full[r * 64:(r + 1) * 64], slice_spec=f"256 512 {r * 64},64:-",
        device=f"/job:w/task:{r}/device:CPU:0") for r in range(4)]
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, pieces)
    halves = [shardckpt.RestoreRequest("w", "0,256:0,256"), shardckpt.RestoreRequest("w", "0,256:256,256")]
    with configured(None, read_latency=latency):
        fs = s3_fs()
        index = fs.size(prefix + ".index")
        for reqs, expect in ((halves, full), (halves[:1], full[:, :256])):
            fs.reset_stats()
            parts = shardckpt.restore_tensors(prefix, reqs)
            np.testing.assert_array_equal(np.concatenate(parts, axis=1), expect)
            fetched = fs.stats["bytes_read"] - index
            requests = fs.stats["read_requests"] - 1
            if len(reqs) == 2 or latency == 0.0:  # every byte needed, or requests cost nothing: exactly them
                assert fetched == expect.nbytes, fs.stats
            else:  # 1 KiB gaps cost less than a request: whole rows, still one GET per data object
                assert fetched <= 2 * expect.nbytes, fs.stats
            if latency > 0 or len(reqs) == 2:
                assert requests <= 4, fs.stats  # one per data object (each 128 KiB, under the read cap)
            else:
                assert requests == 256, fs.stats  # free requests: one per row, no byte more


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetched", "direct"])
def test_reads_of_an_object_replaced_since_the_open_fail(s3dir: str, prefetch: bool) -> None:
    values = _tensors(4, 4096)
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, values)
    fs = s3_fs()
    data = f"{prefix}.data-00000-of-00001"
    with BundleReader(Location.of(prefix)) as reader:
        original = fs.fs.cat_file(data)
        fs.fs.pipe_file(data, bytes(reversed(original)))  # same size, other bytes: another version
        if prefetch:
            reader.prefetch([("t00", None), ("t01", "0,100")])
        with pytest.raises(CheckpointReplacedError, match="replaced while open"):
            reader.read("t00")
        with pytest.raises(CheckpointReplacedError, match="replaced while open"):
            reader.read_region("t01", "0,100", verify=False)


def test_save_to_a_fresh_prefix_sends_no_heads(s3_server: Any, s3dir: str) -> None:
    tensors = _tensors(16, 4096)
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        shardckpt.save_tensors(f"{s3dir}/ck", tensors, shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(64 << 10)))
        kinds = _kinds(proxy.requests)
    # before: the folder and its multipart uploads listed; after the uploads: the data objects
    # listed (the check before the commit), then the index
    assert sorted(kinds) == sorted(["LIST", "LIST-UPLOADS"] + ["PUT data"] * 4 + ["LIST", "PUT index"]), kinds
    assert kinds[-1] == "PUT index", kinds


class _Meddler(FileSystemWrapper):
    """The store, with another party deleting or replacing one data object of the save (not of the
    committed checkpoint, whose count is 1) just before the commit's check."""

    def __init__(self, inner: FsspecFileSystem, action: str) -> None:
        super().__init__(inner)
        self.action = action
        self.victim = ""

    def list_identities(self, prefix: str) -> Any:
        inner: Any = self.inner
        if prefix.endswith(".data-") and not self.victim:
            self.victim = sorted(p for p in inner.list_identities(prefix) if not p.endswith("-of-00001"))[0]
            if self.action == "deleted":
                inner.fs.rm_file(self.victim)
            else:
                inner.fs.pipe_file(self.victim, b"another writer's bytes")
        return inner.list_identities(prefix)


@pytest.mark.parametrize("action", ["deleted", "replaced"])
def test_commit_refuses_a_data_object_deleted_or_replaced_before_it(s3dir: str, action: str) -> None:
    prefix = f"{s3dir}/ck"
    old = _tensors(4, 1024, seed=1)
    shardckpt.save_tensors(prefix, old)
    meddler = _Meddler(s3_fs(), action)
    with mounted(meddler, "s3"):
        with pytest.raises(AbortedError, match="is gone" if action == "deleted" else "was replaced"):
            shardckpt.save_tensors(prefix, _tensors(4, 1024, seed=2), shardckpt.CheckpointOptions(
                sharding_callback=shardckpt.MaxShardSizePolicy(8 << 10)))
    assert meddler.victim.endswith("-of-00002")
    with shardckpt.load_checkpoint(prefix) as reader:  # the previous checkpoint, whole
        for key, value in old.items():
            np.testing.assert_array_equal(reader.get_tensor(key), value)


@pytest.mark.parametrize("part", [8 << 20, 20_000], ids=["one-block", "blocks-cut-inside-runs"])
def test_prefetched_region_restores_of_3d_pieces_return_the_right_values(s3dir: str, part: int) -> None:
    full = np.arange(6 * 40 * 48, dtype=np.float64).reshape(6, 40, 48)
    pieces = [shardckpt.ShardableTensor.from_value(
        "v", full[:, :, c * 16:(c + 1) * 16], slice_spec=f"6 40 48 -:-:{c * 16},16",
        device=f"/job:w/task:{c}/device:CPU:0") for c in range(3)]
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, pieces)
    regions = ["1,4:3,30:0,48", "0,6:0,40:5,20", "2,1:-:-", "-:7,9:30,18", "1,4:3,30:5,20", "0,6:0,40:0,48"]
    # latency 0.2 ms at 100 MB/s: a 20 kB gap limit, so blocks of ``part`` bytes (cut inside runs when small)
    with configured(None, read_part_size=part, read_latency=0.0002, read_bandwidth=100e6):
        fs = s3_fs()
        fs.reset_stats()
        got = shardckpt.restore_tensors(prefix, [shardckpt.RestoreRequest("v", r) for r in regions])
        assert fs.stats["cache_hits"] > 0, fs.stats
    for region, value in zip(regions, got):
        box = tuple(slice(int(a), int(a) + int(n)) if a != "-" else slice(None)
                    for a, n in ((p.split(",") + ["0"])[:2] if p != "-" else ("-", "0") for p in region.split(":")))
        np.testing.assert_array_equal(value, full[box])


def test_overwrite_removes_the_previous_data_objects_with_one_request(s3_server: Any, s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    policy = shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(64 << 10))
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint):
        shardckpt.save_tensors(prefix, _tensors(16, 4096, seed=1), policy)
        proxy.requests.clear()
        new = _tensors(16, 4096, seed=2)
        shardckpt.save_tensors(prefix, new, policy)
        kinds = _kinds(proxy.requests)
    deletes = [k for k in kinds if k.startswith("POST") and "delete" in k]
    assert len(deletes) == 1 and "HEAD data" not in kinds and "DELETE data" not in kinds, kinds
    assert kinds.count("PUT data") == 5, kinds  # 4 shards of count 5 (4 is the committed one's) + 1 padding
    assert kinds.index("PUT index") < kinds.index(deletes[0]), kinds
    assert sorted(n for n in s3_fs().listdir(s3dir)) == [f"ck.data-0000{i}-of-00005" for i in range(5)] + ["ck.index"]
    with shardckpt.load_checkpoint(prefix) as reader:
        for key, value in new.items():
            np.testing.assert_array_equal(reader.get_tensor(key), value)
