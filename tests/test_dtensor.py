"""DTensor in shardckpt, without TensorFlow (spec §10): meshes, layouts, DTensor values, DVariables,
``sharded_save`` and ``DTensorCheckpoint``.

What TF DTensor writes (spec §10) and what these tests hold shardckpt to:

* one slice entry per *distinct* shard; replicas are written once, by the lowest device id
  holding them (``replica_writer="balanced"``: the replicas of a tensor take turns, piece by
  piece); a fully replicated tensor is one whole entry, no slices;
* one data file per writing device (``ShardByDevicePolicy``: shards numbered in order of first
  appearance, so every slice a device writes lies in that device's file);
* a restore onto any mesh/layout reads, per client, each distinct local piece once and only the
  bytes overlapping it;
* unlike TF, one checkpoint may hold DVariables of two meshes.

Multi-client behaviour is simulated in one process: ``ThreadCoordinator`` runs each client in a
thread with a coordinator over queues and barriers (the real torch/MPI backends live elsewhere).
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np
import pytest

import shardckpt
from shardckpt import Checkpoint, Variable, get_checkpoint_state, latest_checkpoint
from shardckpt import dtensor as dt
from shardckpt.distributed import SingleProcessCoordinator
from shardckpt.distributed.coordinator import CoordinationTimeout, Coordinator, decode, encode
from shardckpt.dtensor._save import dtensor_pieces
from shardckpt.errors import InvalidArgumentError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.tensor_slice import box_volume, full_box
from shardckpt.storage.local import LocalFileSystem
from shardckpt.storage.location import Location

U = dt.UNSHARDED
Box = Tuple[Tuple[int, int], ...]

# The layouts of the brief, on the 2x4 mesh ("x", 2), ("y", 4).
LAYOUTS_24: Dict[str, List[str]] = {
    "on_x": ["x", U],        # sharded on x; partially replicated (4 replicas of each piece, along y)
    "on_y": [U, "y"],        # sharded on y; 2 replicas of each piece, along x
    "on_xy": ["x", "y"],     # sharded on both: 8 distinct pieces
    "on_yx": ["y", "x"],     # transposed
    "replicated": [U, U],    # fully replicated: one whole entry
}


def mesh24() -> dt.Mesh:
    return dt.create_mesh([("x", 2), ("y", 4)])


def values_for(names: Sequence[str], shape=(8, 16), dtype=np.float32, seed: int = 0) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, name in enumerate(names):
        if np.dtype(dtype) == np.bool_:
            out[name] = rng.integers(0, 2, shape).astype(bool)
        elif np.issubdtype(np.dtype(dtype), np.integer):
            out[name] = rng.integers(-2**40, 2**40, shape).astype(dtype)
        else:
            out[name] = (rng.standard_normal(shape) + 100 * i).astype(dtype)
    return out


def shard_of_pieces(reader: BundleReader, key: str) -> Dict[Box, Optional[int]]:
    """box -> data file of each stored piece (None marks a whole entry: it has no slice)."""
    out = {}
    for piece in reader.pieces(key):
        out[piece.box] = piece.entry.shard_id if piece.slice is not None else None
    return out


def expected_writers(items: Sequence[Tuple[str, dt.DTensor]], replica_writer: str = "lowest"
                     ) -> Tuple[Dict[Tuple[str, Box], int], Dict[int, int]]:
    """((key, box) -> writer device, writer device -> shard number by first appearance)."""
    writer: Dict[Tuple[str, Box], int] = {}
    shard_of_device: Dict[int, int] = {}
    for key, value in items:
        for index, (box, holders) in enumerate(value.layout.distinct_boxes(value.shape).items()):
            device = holders[0] if replica_writer == "lowest" else holders[index % len(holders)]
            writer[(key, box)] = device
            shard_of_device.setdefault(device, len(shard_of_device))
    return writer, shard_of_device


def assert_components_match(value: dt.DTensor, expected: np.ndarray) -> None:
    """Every local component (every replica) holds exactly its box of ``expected``."""
    assert value.shape == expected.shape
    for device, component in value.components.items():
        box = value.box(device)
        want = expected[tuple(slice(a, b) for a, b in box)]
        assert component.dtype == expected.dtype
        np.testing.assert_array_equal(component, want, err_msg=f"device {device}, box {box}")


@pytest.fixture
def bytes_read(monkeypatch) -> Dict[str, int]:
    """Counts the bytes every ``LocalFileSystem.pread_into`` reads (data files; the index uses read_bytes)."""
    counter = {"bytes": 0, "calls": 0}
    original = LocalFileSystem.pread_into

    def counting(self, fd, buf, offset, path=""):
        counter["bytes"] += memoryview(buf).nbytes
        counter["calls"] += 1
        return original(self, fd, buf, offset, path)

    monkeypatch.setattr(LocalFileSystem, "pread_into", counting)
    return counter


# ---------------------------------------------------------------------------------------------
# A coordinator of client threads: the multi-client code paths without torch or MPI.
# ---------------------------------------------------------------------------------------------
class _Group:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: List[Any] = [None] * size
        self.queues = {(s, d): queue.Queue() for s in range(size) for d in range(size)}


class ThreadCoordinator(Coordinator):
    def __init__(self, group: _Group, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    def _wait(self) -> None:
        try:
            self._group.barrier.wait()
        except threading.BrokenBarrierError:
            raise CoordinationTimeout("a client thread did not arrive") from None

    def barrier(self, name: str = "barrier", timeout: Optional[float] = None) -> None:
        self._wait()

    def all_gather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        self._group.slots[self._rank] = decode(encode(obj))
        self._wait()
        out = list(self._group.slots)
        self._wait()
        return out

    def broadcast(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        if self._rank == root:
            self._group.slots[root] = decode(encode(obj))
        self._wait()
        out = self._group.slots[root]
        self._wait()
        return out

    def send_bytes(self, data: memoryview, dst: int, tag: int = 0) -> None:
        self._group.queues[(self._rank, dst)].put(bytes(memoryview(data).cast("B")))

    def recv_bytes(self, src: int, nbytes: int, out: Optional[memoryview] = None, tag: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        data = self._group.queues[(src, self._rank)].get(timeout=60)
        assert len(data) == nbytes, (len(data), nbytes)
        if out is None:
            return memoryview(bytearray(data))
        memoryview(out).cast("B")[:nbytes] = data
        return out


def run_clients(size: int, fn: Callable[[int, Coordinator], Any]) -> List[Any]:
    """Run ``fn(rank, coordinator)`` in ``size`` client threads; re-raise the first failure."""
    group = _Group(size)
    results: List[Any] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadCoordinator(group, rank))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for rank, exc in enumerate(errors):
        if exc is not None and not isinstance(exc, CoordinationTimeout):
            raise AssertionError(f"client {rank} failed: {type(exc).__name__}: {exc}") from exc
    for exc in errors:
        if exc is not None:
            raise exc
    return results


# =============================================================================================
# Mesh
# =============================================================================================
def test_mesh_shape_coords_and_devices() -> None:
    mesh = mesh24()
    assert mesh.dim_names == ["x", "y"]
    assert mesh.shape == (2, 4) and mesh.size == 8
    assert mesh.dim_size("x") == 2 and mesh.dim_size("y") == 4
    assert mesh.coords(0) == {"x": 0, "y": 0}
    assert mesh.coords(5) == {"x": 1, "y": 1}
    assert mesh.coords(7) == {"x": 1, "y": 3}
    assert mesh.local_device_ids() == list(range(8))
    assert mesh.num_local_devices() == 8 and mesh.num_clients == 1
    assert mesh.local_devices() == [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
    assert [mesh.client_of(d) for d in range(8)] == [0] * 8
    np.testing.assert_array_equal(mesh.global_device_ids(), np.arange(8).reshape(2, 4))
    assert mesh.device_type() == "CPU"
    assert mesh == dt.create_mesh([("x", 2), ("y", 4)])
    assert mesh != dt.create_mesh([("a", 2), ("b", 4)])
    one = dt.create_mesh([("s", 1)])
    assert one.size == 1 and one.local_device_ids() == [0]
    with pytest.raises(InvalidArgumentError, match="no dimension"):
        mesh.dim_size("z")


@pytest.mark.parametrize("client", range(4))
def test_create_distributed_mesh_splits_devices_evenly(client: int) -> None:
    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)], client_id=client, num_clients=4)
    assert mesh.shape == (2, 4) and mesh.num_clients == 4
    assert mesh.local_device_ids() == [2 * client, 2 * client + 1]
    assert mesh.num_local_devices() == 2
    assert [mesh.client_of(d) for d in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(f"/task:{client}/" in name for name in mesh.local_devices())
    assert all(name.startswith("/job:worker/") for name in mesh.local_devices())
    # a 1-D mesh, and one client owning all devices
    assert dt.create_distributed_mesh([("b", 8)], client_id=client, num_clients=4).local_device_ids() == \
        [2 * client, 2 * client + 1]
    single = dt.create_distributed_mesh([("b", 8)], client_id=0, num_clients=1)
    assert single.local_device_ids() == list(range(8)) and single.num_clients == 1


def test_create_distributed_mesh_defaults_to_the_coordinator() -> None:
    mesh = dt.create_distributed_mesh([("x", 8)])  # single process: rank 0 of 1
    assert mesh.local_device_ids() == list(range(8)) and mesh.num_clients == 1


def test_distributed_mesh_local_device_names_are_the_tasks_own_devices() -> None:
    """TF (mesh_util.create_distributed_mesh) names a client's devices by their *local* index:
    client 1 of 4 holds /job:worker/replica:0/task:1/device:CPU:0 and CPU:1 (global ids 2, 3)."""
    mesh = dt.create_distributed_mesh([("x", 8)], client_id=1, num_clients=4)
    assert mesh.local_device_ids() == [2, 3]
    assert mesh.local_devices() == ["/job:worker/replica:0/task:1/device:CPU:0",
                                    "/job:worker/replica:0/task:1/device:CPU:1"]


@pytest.mark.parametrize("dims", [[("x", 0)], [("x", -2)], [("x", 2), ("x", 4)]])
def test_create_mesh_rejects_bad_dims(dims) -> None:
    with pytest.raises(InvalidArgumentError):
        dt.create_mesh(dims)


def test_mesh_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"length of devices \(2\) must be equal to total size of the mesh"):
        dt.create_mesh([("x", 2), ("y", 4)], devices=["CPU:0", "CPU:1"])
    with pytest.raises(InvalidArgumentError, match="cannot be split"):
        dt.create_distributed_mesh([("x", 8)], client_id=0, num_clients=3)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        dt.create_distributed_mesh([("x", 8)], client_id=4, num_clients=4)
    with pytest.raises(InvalidArgumentError):
        dt.create_distributed_mesh([("x", 0)], client_id=0, num_clients=1)
    with pytest.raises(InvalidArgumentError, match="permutation"):
        dt.Mesh(["x"], np.array([0, 0]), [0], ["CPU:0"])
    with pytest.raises(InvalidArgumentError, match="rank"):
        dt.Mesh(["x", "y"], np.arange(4), [0], ["CPU:0"])


# =============================================================================================
# Layout
# =============================================================================================
def test_layout_boxes_and_replicas() -> None:
    mesh = mesh24()
    shape = (8, 16)
    on_x = dt.Layout(["x", U], mesh)
    assert on_x.rank == 2 and on_x.num_shards(0) == 2 and on_x.num_shards(1) == 1
    assert on_x.local_shape(shape) == (4, 16) and on_x.global_shape((4, 16)) == shape
    assert on_x.box(0, shape) == ((0, 4), (0, 16))
    assert on_x.box(3, shape) == ((0, 4), (0, 16))
    assert on_x.box(4, shape) == ((4, 8), (0, 16))
    assert on_x.distinct_boxes(shape) == {((0, 4), (0, 16)): [0, 1, 2, 3], ((4, 8), (0, 16)): [4, 5, 6, 7]}
    on_y = dt.Layout([U, "y"], mesh)
    assert on_y.distinct_boxes(shape) == {((0, 8), (4 * j, 4 * j + 4)): [j, j + 4] for j in range(4)}
    both = dt.Layout(["x", "y"], mesh)
    assert both.box(6, shape) == ((4, 8), (8, 12))
    assert all(len(h) == 1 for h in both.distinct_boxes(shape).values()) and \
        len(both.distinct_boxes(shape)) == 8
    rep = dt.Layout.replicated(mesh, 2)
    assert rep.is_fully_replicated() and not on_x.is_fully_replicated()
    assert rep.distinct_boxes(shape) == {full_box(shape): list(range(8))}
    assert dt.Layout.batch_sharded(mesh, "y", 3).sharding_specs == ["y", U, U]
    assert dt.Layout.batch_sharded(mesh, "x", 3, axis=1).sharding_specs == [U, "x", U]
    assert dt.Layout.inner_sharded(mesh, "x", 2).sharding_specs == [U, "x"]
    assert dt.Layout(["x", U], mesh) == on_x and dt.Layout(["x", U], mesh) != on_y
    scalar = dt.Layout([], mesh)
    assert scalar.box(5, ()) == () and scalar.distinct_boxes(()) == {(): list(range(8))}


def test_layout_errors() -> None:
    mesh = mesh24()
    with pytest.raises(InvalidArgumentError, match="not a dimension"):
        dt.Layout(["z", U], mesh)
    with pytest.raises(InvalidArgumentError, match="two tensor dimensions"):
        dt.Layout(["x", "x"], mesh)
    on_y = dt.Layout([U, "y"], mesh)
    with pytest.raises(InvalidArgumentError, match="not divisible"):
        on_y.box(0, (8, 6))
    with pytest.raises(InvalidArgumentError, match="not divisible"):
        dt.from_global(np.zeros((8, 10), np.float32), on_y)
    with pytest.raises(InvalidArgumentError, match="rank"):
        dt.from_global(np.zeros((8,), np.float32), on_y)
    with pytest.raises(InvalidArgumentError, match="not divisible"):
        dt.DVariable.from_global(np.zeros((3, 4), np.float32), dt.Layout(["x", U], mesh))


# =============================================================================================
# DTensor values: pack / unpack / from_global / to_global
# =============================================================================================
@pytest.mark.parametrize("name", list(LAYOUTS_24))
def test_from_global_unpack_pack_to_global_round_trip(name: str) -> None:
    mesh = mesh24()
    layout = dt.Layout(LAYOUTS_24[name], mesh)
    full = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    value = dt.from_global(full, layout)
    assert value.shape == (8, 16) and value.dtype == np.float32 and dt.fetch_layout(value) is layout
    assert_components_match(value, full)
    components = dt.unpack(value)
    assert len(components) == 8
    assert [c.shape for c in components] == [layout.local_shape(full.shape)] * 8
    again = dt.pack(components, layout)
    assert again.shape == full.shape
    np.testing.assert_array_equal(dt.to_global(again), full)
    np.testing.assert_array_equal(dt.to_global(value, SingleProcessCoordinator()), full)
    # components are copies: neither the source nor another replica changes
    for holders in layout.distinct_boxes(full.shape).values():
        for other in holders[1:]:
            assert not np.shares_memory(again.components[holders[0]], again.components[other])
            assert not np.shares_memory(value.components[holders[0]], value.components[other])
    assert not any(np.shares_memory(c, full) for c in value.components.values())
    assert not any(np.shares_memory(a, b) for a, b in zip(components, dt.unpack(again)))


def test_pack_and_dtensor_errors() -> None:
    mesh = mesh24()
    layout = dt.Layout(["x", U], mesh)
    with pytest.raises(InvalidArgumentError, match="8 components"):
        dt.pack([np.zeros((4, 4))] * 7, layout)
    with pytest.raises(InvalidArgumentError, match="needs"):  # components of different shapes
        dt.pack([np.zeros((4, 4))] * 7 + [np.zeros((2, 4))], layout)
    with pytest.raises(InvalidArgumentError, match="dtypes"):
        dt.pack([np.zeros((4, 4), np.float32)] * 7 + [np.zeros((4, 4), np.float64)], layout)
    with pytest.raises(InvalidArgumentError, match="components for devices"):
        dt.DTensor(layout, (8, 4), {0: np.zeros((4, 4))})


def test_pack_on_a_client_of_a_distributed_mesh() -> None:
    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)], client_id=2, num_clients=4)  # devices 4, 5
    layout = dt.Layout([U, "y"], mesh)
    value = dt.pack([np.full((8, 4), 4.0), np.full((8, 4), 5.0)], layout)
    assert value.shape == (8, 16) and sorted(value.components) == [4, 5]
    assert value.box(4) == ((0, 8), (0, 4)) and value.box(5) == ((0, 8), (4, 8))
    assert value.local_pieces() == {((0, 8), (0, 4)): [4], ((0, 8), (4, 8)): [5]}
    full = np.arange(128.0).reshape(8, 16)
    local = dt.from_global(full, layout)
    assert sorted(local.components) == [4, 5]
    assert_components_match(local, full)


def test_to_global_of_a_multi_client_mesh_on_one_client_is_an_error() -> None:
    """A single client cannot gather pieces that other clients hold: ``to_global`` must say so
    (as ``sharded_save`` does), not return uninitialised memory for the missing pieces."""
    mesh = dt.create_distributed_mesh([("x", 8)], client_id=1, num_clients=4)
    value = dt.from_global(np.arange(8, dtype=np.float64) + 1000.0, dt.Layout(["x"], mesh))
    with pytest.raises(InvalidArgumentError):
        dt.to_global(value, SingleProcessCoordinator())


def test_to_global_across_four_clients() -> None:
    full = np.arange(8 * 16, dtype=np.int64).reshape(8, 16)

    def client(rank: int, coordinator: Coordinator) -> Dict[str, np.ndarray]:
        mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)], client_id=rank, num_clients=4)
        return {name: dt.to_global(dt.from_global(full, dt.Layout(spec, mesh)), coordinator)
                for name, spec in LAYOUTS_24.items()}

    for rank, gathered in enumerate(run_clients(4, client)):
        for name, value in gathered.items():
            np.testing.assert_array_equal(value, full, err_msg=f"client {rank}, layout {name}")


# =============================================================================================
# DVariable
# =============================================================================================
def test_dvariable_basics_and_assign() -> None:
    mesh = mesh24()
    layout = dt.Layout(["x", "y"], mesh)
    full = np.arange(128, dtype=np.float32).reshape(8, 16)
    var = dt.DVariable.from_global(full, layout, name="w")
    assert var.name == "w" and var.shape == (8, 16) and var.dtype.name == "float32" and var.layout == layout
    assert "DVariable" in repr(var) and "w" in repr(var)
    components = var.components()
    assert len(components) == 8 and components[0] is var.value().components[0]  # live arrays
    var.assign(dt.from_global(full * 2, layout))
    assert_components_match(var.value(), full * 2)
    with pytest.raises(ValueError, match="shape"):
        var.assign(dt.from_global(np.zeros((8, 8), np.float32), layout))
    with pytest.raises(TypeError):
        dt.DVariable(full)  # type: ignore[arg-type]
    assert dt.DVariable(dt.from_global(full, layout)).name == "Variable"


def test_dvariable_assign_with_another_layout_keeps_the_global_value() -> None:
    """Assigning a DTensor laid out differently must relayout (or refuse), never copy device by
    device: on a 2x2 mesh, [x,·] and [y,·] components have equal shapes but different rows."""
    mesh = dt.create_mesh([("x", 2), ("y", 2)])
    var = dt.DVariable.from_global(np.zeros((4, 4), np.float32), dt.Layout(["x", U], mesh))
    new = np.arange(16, dtype=np.float32).reshape(4, 4)
    try:
        var.assign(dt.from_global(new, dt.Layout(["y", U], mesh)))
    except (InvalidArgumentError, ValueError):
        return  # refusing is fine
    assert_components_match(var.value(), new)


# =============================================================================================
# sharded_save: each distinct shard once, by the lowest device
# =============================================================================================
def test_sharded_save_stores_each_distinct_shard_once_in_its_writers_file(tmp_path: Path) -> None:
    mesh = mesh24()
    values = values_for(list(LAYOUTS_24))
    items = [(name, dt.from_global(values[name], dt.Layout(spec, mesh))) for name, spec in LAYOUTS_24.items()]
    prefix = dt.sharded_save(mesh, str(tmp_path / "ck"), [n for n, _ in items], [""] * len(items),
                             [v for _, v in items])
    assert prefix == str(tmp_path / "ck")
    writer, shard_of_device = expected_writers(items)
    assert sorted(shard_of_device) == list(range(8))  # every device writes something (on_xy)
    files = sorted(os.listdir(tmp_path))
    assert files == [f"ck.data-{i:05d}-of-00008" for i in range(8)] + ["ck.index"]
    reader = BundleReader(Location.of(prefix))
    assert reader.num_shards == 8
    total_slices = 0
    for name, value in items:
        stored = shard_of_pieces(reader, name)
        distinct = value.layout.distinct_boxes(value.shape)
        assert set(stored) == set(distinct), name
        if name == "replicated":
            assert stored == {full_box(value.shape): None}  # whole entry, no slices
            assert reader.entry(name).shard_id == shard_of_device[0]  # written by device 0
        else:
            assert len(reader.entry(name).slices) == len(distinct) == len(stored)
            total_slices += len(stored)
            for box, shard in stored.items():
                assert shard == shard_of_device[writer[(name, box)]], (name, box)
                assert writer[(name, box)] == min(distinct[box])  # the lowest id holding it
        np.testing.assert_array_equal(reader.read(name), values[name])
    assert len(reader.keys(include_slices=True)) - len(reader.keys()) == total_slices == 2 + 4 + 8 + 8


def test_sharded_save_partially_replicated_writes_only_the_lowest_devices_files(tmp_path: Path) -> None:
    """Spec §10: [x,·] on 2x4 -> two slices, written by devices 0 and 4; devices writing nothing
    leave no files; a fully replicated tensor goes to device 0's file."""
    mesh = mesh24()
    values = values_for(["on_x", "replicated"])
    items = [("on_x", dt.from_global(values["on_x"], dt.Layout(["x", U], mesh))),
             ("replicated", dt.from_global(values["replicated"], dt.Layout([U, U], mesh)))]
    dt.sharded_save(mesh, str(tmp_path / "ck"), ["on_x", "replicated"], ["", ""], [v for _, v in items])
    assert sorted(os.listdir(tmp_path)) == ["ck.data-00000-of-00002", "ck.data-00001-of-00002", "ck.index"]
    reader = BundleReader(Location.of(str(tmp_path / "ck")))
    assert shard_of_pieces(reader, "on_x") == {((0, 4), (0, 16)): 0, ((4, 8), (0, 16)): 1}
    assert shard_of_pieces(reader, "replicated") == {((0, 8), (0, 16)): None}
    assert reader.entry("replicated").shard_id == 0
    pieces = dtensor_pieces("on_x", items[0][1])
    assert [p.device for p in pieces] == [mesh.device_name(0), mesh.device_name(4)]
    assert [p.slice_spec for p in pieces] == ["8 16 0,4:-", "8 16 4,4:-"] or \
        [p.slice_spec for p in pieces] == ["8 16 0,4:0,16", "8 16 4,4:0,16"]


def test_sharded_save_spells_unsharded_dims_as_tf_does(tmp_path: Path) -> None:
    """Spec §6.2/§10: DTensor writes an unsharded dimension as ``-`` (extent without length, key
    (0,-1)): ``"16 4 2k,2:-"``. shardckpt must write the same slice keys and TensorSliceProtos."""
    mesh = mesh24()
    full = np.arange(128, dtype=np.float32).reshape(8, 16)
    specs = {name: [p.slice_spec for p in dtensor_pieces(name, dt.from_global(full, dt.Layout(spec, mesh)))]
             for name, spec in LAYOUTS_24.items()}
    assert specs["on_x"] == ["8 16 0,4:-", "8 16 4,4:-"]
    assert specs["on_y"] == [f"8 16 -:{4 * j},4" for j in range(4)]
    assert specs["replicated"] == [""]
    assert sorted(specs["on_xy"]) == sorted(f"8 16 {4 * i},4:{4 * j},4" for i in range(2) for j in range(4))
    prefix = dt.sharded_save(mesh, str(tmp_path / "ck"), ["on_x"], [""],
                             [dt.from_global(full, dt.Layout(["x", U], mesh))])
    assert sorted(p.slice_spec for p in BundleReader(Location.of(prefix)).pieces("on_x")) == ["0,4:-", "4,4:-"]


def test_sharded_save_balanced_replica_writers_take_turns(tmp_path: Path) -> None:
    mesh = mesh24()
    values = values_for(list(LAYOUTS_24), seed=3)
    items = [(name, dt.from_global(values[name], dt.Layout(spec, mesh))) for name, spec in LAYOUTS_24.items()]
    prefix = dt.sharded_save(mesh, str(tmp_path / "ck"), [n for n, _ in items], [""] * len(items),
                             [v for _, v in items], replica_writer="balanced")
    writer, shard_of_device = expected_writers(items, "balanced")
    # the turns: [x,·] -> devices 0 and 5; [·,y] -> 0, 5, 2, 7; replicated -> device 0
    assert [writer[("on_x", b)] for b in items[0][1].layout.distinct_boxes((8, 16))] == [0, 5]
    assert [writer[("on_y", b)] for b in items[1][1].layout.distinct_boxes((8, 16))] == [0, 5, 2, 7]
    assert [p.device for p in dtensor_pieces("on_y", items[1][1], "balanced")] == \
        [mesh.device_name(d) for d in (0, 5, 2, 7)]
    reader = BundleReader(Location.of(prefix))
    for name, value in items:
        stored = shard_of_pieces(reader, name)
        assert set(stored) == set(value.layout.distinct_boxes(value.shape))
        if name != "replicated":
            for box, shard in stored.items():
                assert shard == shard_of_device[writer[(name, box)]], (name, box)
        np.testing.assert_array_equal(reader.read(name), values[name])
    with pytest.raises(InvalidArgumentError, match="replica_writer"):
        dtensor_pieces("on_x", items[0][1], "random")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int64, np.bool_, np.float16, np.uint8,
                                   np.complex64, np.int32, np.float64])
def test_sharded_save_values_read_back_exactly(tmp_path: Path, dtype) -> None:
    mesh = mesh24()
    values = values_for(list(LAYOUTS_24), dtype=dtype, seed=7)
    items = [(name, dt.from_global(values[name], dt.Layout(spec, mesh))) for name, spec in LAYOUTS_24.items()]
    items.append(("vector", dt.from_global(values["on_x"][0], dt.Layout(["y"], mesh))))
    items.append(("scalar", dt.from_global(values["on_x"][0, 0], dt.Layout([], mesh))))
    items.append(("plain", values["on_y"] + 1 if dtype != np.bool_ else ~values["on_y"]))  # not a DTensor
    prefix = dt.sharded_save(mesh, str(tmp_path / "ck"), [n for n, _ in items], [""] * len(items),
                             [v for _, v in items])
    reader = shardckpt.load_checkpoint(prefix)
    assert reader.get_variable_to_dtype_map()["on_xy"] == np.dtype(dtype)
    for name, value in items:
        expected = dt.to_global(value) if isinstance(value, dt.DTensor) else value
        got = reader.get_tensor(name)
        assert got.dtype == np.dtype(dtype) and got.shape == expected.shape, name
        assert got.tobytes() == np.ascontiguousarray(expected).tobytes(), name  # bit-exact (NaN-safe)
    raw = BundleReader(Location.of(prefix))
    assert raw.entry("plain").shard_id == 0 and not raw.entry("plain").slices  # io device: device 0's file


def test_sharded_save_argument_errors(tmp_path: Path) -> None:
    mesh = mesh24()
    value = dt.from_global(np.zeros((8, 16), np.float32), dt.Layout(["x", U], mesh))
    with pytest.raises(InvalidArgumentError, match="shape_and_slices"):
        dt.sharded_save(mesh, str(tmp_path / "a"), ["v"], ["8 16 0,4:-"], [value])
    with pytest.raises(InvalidArgumentError, match="same length"):
        dt.sharded_save(mesh, str(tmp_path / "b"), ["v", "w"], [""], [value])
    remote = dt.from_global(np.zeros(8, np.float32), dt.Layout(["x"], dt.create_distributed_mesh(
        [("x", 8)], client_id=0, num_clients=4)))
    with pytest.raises(InvalidArgumentError, match="clients"):
        dt.sharded_save(mesh, str(tmp_path / "c"), ["v"], [""], [remote])
    assert not any(name.startswith(("a.", "b.", "c.")) for name in os.listdir(tmp_path))


def test_sharded_save_across_four_clients(tmp_path: Path) -> None:
    """Four clients of a 2x4 mesh (devices 2k, 2k+1 each) save together: every distinct shard is
    stored once, written by the client of its lowest holder, one file per writing device."""
    values = values_for(list(LAYOUTS_24), seed=11)
    prefix = str(tmp_path / "multi")

    def client(rank: int, coordinator: Coordinator) -> List[Tuple[str, str]]:
        mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)], client_id=rank, num_clients=4)
        tensors = [dt.from_global(values[name], dt.Layout(spec, mesh)) for name, spec in LAYOUTS_24.items()]
        dt.sharded_save(mesh, prefix, list(LAYOUTS_24), [""] * len(tensors), tensors, coordinator=coordinator)
        return [(p.checkpoint_key, p.device) for name, t in zip(LAYOUTS_24, tensors) for p in dtensor_pieces(name, t)]

    written = run_clients(4, client)
    mesh0 = mesh24()
    reader = BundleReader(Location.of(prefix))
    assert reader.num_shards == 8  # one file per device: every device is the lowest holder of some piece
    file_of_device: Dict[int, int] = {}
    for name, spec in LAYOUTS_24.items():
        distinct = dt.Layout(spec, mesh0).distinct_boxes((8, 16))
        stored = shard_of_pieces(reader, name)
        assert set(stored) == set(distinct)
        for box, shard in stored.items():
            if shard is not None:
                assert file_of_device.setdefault(min(distinct[box]), shard) == shard
        np.testing.assert_array_equal(reader.read(name), values[name])
    assert len(set(file_of_device.values())) == len(file_of_device) == 8
    # client r writes the pieces whose lowest holder is one of its devices (2r, 2r+1) only
    for rank, pieces in enumerate(written):
        assert all(f"/task:{rank}/" in device for _, device in pieces)
    assert [len(p) for p in written] == [8, 6, 5, 4]  # 2 + 4 + 8 + 8 + 1 pieces in all
    assert [key for key, _ in written[1]] == ["on_y"] * 2 + ["on_xy"] * 2 + ["on_yx"] * 2
    assert [key for key, _ in written[2]] == ["on_x"] + ["on_xy"] * 2 + ["on_yx"] * 2


# =============================================================================================
# DTensorCheckpoint: restore onto other layouts and meshes
# =============================================================================================
def _save_dtensor_checkpoint(path: Path, values: Dict[str, np.ndarray], layouts=LAYOUTS_24) -> str:
    mesh = mesh24()
    variables = {name: dt.DVariable.from_global(values[name], dt.Layout(spec, mesh), name=name)
                 for name, spec in layouts.items()}
    return dt.DTensorCheckpoint(mesh, **variables).save(str(path / "ck"))


def test_restore_onto_a_transposed_layout_on_another_mesh(tmp_path: Path) -> None:
    values = values_for(list(LAYOUTS_24), shape=(8, 16), dtype=np.float32, seed=1)
    prefix = _save_dtensor_checkpoint(tmp_path, values)
    mesh4 = dt.create_mesh([("a", 4)])
    for dest_spec in ([U, "a"], ["a", U], [U, U]):
        targets = {name: dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout(dest_spec, mesh4))
                   for name in LAYOUTS_24}
        status = dt.DTensorCheckpoint(mesh4, **targets).restore(prefix)
        status.assert_consumed()
        for name, var in targets.items():
            assert_components_match(var.value(), values[name])
            np.testing.assert_array_equal(dt.to_global(var.value()), values[name])


def test_restore_onto_a_one_device_mesh_and_into_plain_variables(tmp_path: Path) -> None:
    values = values_for(list(LAYOUTS_24), dtype=np.int64, seed=2)
    prefix = _save_dtensor_checkpoint(tmp_path, values)
    mesh1 = dt.create_mesh([("s", 1)])
    for spec in ([U, U], ["s", U], [U, "s"]):
        targets = {name: dt.DVariable.from_global(np.zeros((8, 16), np.int64), dt.Layout(spec, mesh1))
                   for name in LAYOUTS_24}
        dt.DTensorCheckpoint(mesh1, **targets).restore(prefix).assert_consumed()
        for name, var in targets.items():
            np.testing.assert_array_equal(var.components()[0], values[name])
    plain = {name: Variable(np.zeros((8, 16), np.int64)) for name in LAYOUTS_24}
    Checkpoint(**plain).restore(prefix).assert_consumed()
    for name, var in plain.items():
        np.testing.assert_array_equal(var.numpy(), values[name])


def test_plain_checkpoint_restores_into_dvariables(tmp_path: Path) -> None:
    values = values_for(list(LAYOUTS_24), dtype=ml_dtypes.bfloat16, seed=4)
    prefix = Checkpoint(**{n: Variable(v) for n, v in values.items()}).save(str(tmp_path / "plain"))
    mesh = mesh24()
    targets = {name: dt.DVariable.from_global(np.zeros((8, 16), ml_dtypes.bfloat16), dt.Layout(spec, mesh))
               for name, spec in LAYOUTS_24.items()}
    dt.DTensorCheckpoint(mesh, **targets).restore(prefix).assert_consumed()
    for name, var in targets.items():
        assert_components_match(var.value(), values[name])
    # a plain Checkpoint holding DVariables restores them as well (the graph is the same)
    again = {name: dt.DVariable.from_global(np.zeros((8, 16), ml_dtypes.bfloat16),
                                            dt.Layout(["y", "x"], mesh)) for name in LAYOUTS_24}
    Checkpoint(**again).restore(prefix).assert_consumed()
    for name, var in again.items():
        assert_components_match(var.value(), values[name])


def test_plain_checkpoint_saves_dvariables(tmp_path: Path) -> None:
    """``tf.train.Checkpoint`` works directly with DVariables (spec §10); shardckpt's
    ``Checkpoint`` (single client) should save a DVariable's value, not fail while writing."""
    mesh = mesh24()
    full = np.arange(128, dtype=np.float32).reshape(8, 16)
    prefix = Checkpoint(v=dt.DVariable.from_global(full, dt.Layout(["x", U], mesh))).save(str(tmp_path / "ck"))
    np.testing.assert_array_equal(shardckpt.load_variable(prefix, "v/.ATTRIBUTES/VARIABLE_VALUE"), full)


def test_restore_errors_change_nothing(tmp_path: Path) -> None:
    values = values_for(list(LAYOUTS_24), seed=5)
    prefix = _save_dtensor_checkpoint(tmp_path, values)
    mesh = mesh24()
    wrong_shape = dt.DVariable.from_global(np.zeros((8, 8), np.float32), dt.Layout(["x", U], mesh))
    with pytest.raises(InvalidArgumentError, match="shape"):
        dt.DTensorCheckpoint(mesh, on_x=wrong_shape).restore(prefix)
    assert not wrong_shape.components()[0].any()
    wrong_dtype = dt.DVariable.from_global(np.zeros((8, 16), np.float64), dt.Layout(["x", U], mesh))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        dt.DTensorCheckpoint(mesh, on_x=wrong_dtype).restore(prefix)
    assert not wrong_dtype.components()[0].any()


def _bytes_of_local_pieces(value: dt.DTensor) -> int:
    return sum(box_volume(box) for box in value.local_pieces()) * value.dtype.itemsize


def test_resharded_restore_reads_only_the_destinations_distinct_local_pieces(tmp_path: Path, bytes_read) -> None:
    # [64, 8192] float32 (2 MiB): destination pieces 64 x 1024 give runs of 4 KiB
    shape = (64, 8192)
    sources = {"on_x": ["x", U], "on_y": [U, "y"], "on_xy": ["x", "y"], "on_yx": ["y", "x"], "replicated": [U, U]}
    values = values_for(list(sources), shape=shape, seed=6)
    prefix = _save_dtensor_checkpoint(tmp_path, values, sources)

    def restore(mesh: dt.Mesh, spec: List[str]) -> None:
        for name in sources:
            var = dt.DVariable.from_global(np.zeros(shape, np.float32), dt.Layout(spec, mesh))
            bytes_read["bytes"] = 0
            dt.DTensorCheckpoint(mesh, **{name: var}).restore(prefix).expect_partial()
            need = _bytes_of_local_pieces(var.value())
            assert need <= bytes_read["bytes"] <= 1.1 * need, (mesh, spec, name, bytes_read["bytes"], need)
            assert_components_match(var.value(), values[name])

    restore(dt.create_mesh([("a", 4)]), [U, "a"])          # columns: runs of 4 KiB across row slices
    restore(dt.create_mesh([("a", 4)]), ["a", U])          # rows
    restore(dt.create_mesh([("a", 2), ("b", 4)]), ["b", "a"])
    restore(dt.create_mesh([("a", 8)]), [U, U])            # 8 replicas: the tensor is read once
    restore(dt.create_mesh([("s", 1)]), [U, U])
    for client in (0, 3):                                  # one client of four reads only its own pieces
        restore(dt.create_distributed_mesh([("a", 8)], client_id=client, num_clients=4), [U, "a"])
        restore(dt.create_distributed_mesh([("a", 2), ("b", 4)], client_id=client, num_clients=4), [U, "a"])
        restore(dt.create_distributed_mesh([("a", 2), ("b", 4)], client_id=client, num_clients=4), ["b", U])


# =============================================================================================
# DTensorCheckpoint: numbering, state file, write/read, status
# =============================================================================================
def test_dtensor_checkpoint_save_numbering_state_file_write_and_read(tmp_path: Path) -> None:
    mesh = mesh24()
    values = values_for(["a", "b"], seed=8)
    a = dt.DVariable.from_global(values["a"], dt.Layout(["x", "y"], mesh))
    b = dt.DVariable.from_global(values["b"], dt.Layout([U, U], mesh))
    step = Variable(np.int64(7))
    ckpt = dt.DTensorCheckpoint(mesh, a=a, b=b, step=step)
    assert ckpt.mesh is mesh
    first = ckpt.save(str(tmp_path / "ck"))
    assert first == str(tmp_path / "ck-1")
    a.assign(dt.from_global(values["a"] + 1, a.layout))
    second = ckpt.save(str(tmp_path / "ck"))
    assert second == str(tmp_path / "ck-2") and int(ckpt.save_counter.numpy()) == 2
    assert latest_checkpoint(str(tmp_path)) == second
    state = get_checkpoint_state(str(tmp_path))
    assert state.model_checkpoint_path == second
    assert list(state.all_model_checkpoint_paths) == [second]  # as tf.train.Checkpoint.save: the last only
    written = ckpt.write(str(tmp_path / "exact"))
    assert written == str(tmp_path / "exact") and int(ckpt.save_counter.numpy()) == 2
    assert latest_checkpoint(str(tmp_path)) == second  # write() leaves the state file alone
    # layout of the files: 8 data files (a[x,y] writes from every device; b and step in device 0's)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ck-1.")) == \
        [f"ck-1.data-{i:05d}-of-00008" for i in range(8)] + ["ck-1.index"]
    reader = BundleReader(Location.of(first))
    assert reader.entry("b/.ATTRIBUTES/VARIABLE_VALUE").shard_id == 0
    assert reader.entry("step/.ATTRIBUTES/VARIABLE_VALUE").shard_id == 0
    assert reader.entry("_CHECKPOINTABLE_OBJECT_GRAPH").shard_id == 0
    assert reader.entry("save_counter/.ATTRIBUTES/VARIABLE_VALUE").shard_id == 0

    mesh4 = dt.create_mesh([("a", 4)])
    ra = dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout(["a", U], mesh4))
    rb = dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout([U, "a"], mesh4))
    rstep = Variable(np.int64(0))
    restored = dt.DTensorCheckpoint(mesh4, a=ra, b=rb, step=rstep)
    restored.restore(first).assert_consumed()
    assert_components_match(ra.value(), values["a"])
    assert_components_match(rb.value(), values["b"])
    assert int(rstep.numpy()) == 7 and int(restored.save_counter.numpy()) == 1
    restored.restore(latest_checkpoint(str(tmp_path))).assert_consumed()  # the latest checkpoint (ck-2)
    assert_components_match(ra.value(), values["a"] + 1)
    ra.assign(dt.from_global(np.zeros((8, 16), np.float32), ra.layout))
    fresh = dt.DTensorCheckpoint(mesh4, a=ra, b=rb, step=rstep)
    fresh.read(written).assert_existing_objects_matched()  # save_counter stays unmatched: read() makes none
    assert fresh._save_counter is None
    assert_components_match(ra.value(), values["a"] + 1)


def test_dtensor_checkpoint_rejects_a_mesh_of_more_clients_than_are_saving(tmp_path: Path) -> None:
    """As ``sharded_save`` does: a DVariable on a 4-client mesh saved by a single client must fail
    before anything is committed, not commit a checkpoint holding 2 of its 8 slices."""
    mesh = dt.create_distributed_mesh([("x", 8)], client_id=0, num_clients=4)
    var = dt.DVariable.from_global(np.arange(8, dtype=np.float32), dt.Layout(["x"], mesh))
    with pytest.raises(InvalidArgumentError, match="clients"):
        dt.DTensorCheckpoint(mesh, v=var, coordinator=SingleProcessCoordinator()).save(str(tmp_path / "ck"))
    assert latest_checkpoint(str(tmp_path)) is None
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".index")]


def test_dtensor_checkpoint_status_assertions(tmp_path: Path) -> None:
    mesh = mesh24()
    values = values_for(["a", "b"], seed=9)
    dt.DTensorCheckpoint(mesh, a=dt.DVariable.from_global(values["a"], dt.Layout(["x", U], mesh)),
                         b=dt.DVariable.from_global(values["b"], dt.Layout([U, "y"], mesh))
                         ).write(str(tmp_path / "ck"))
    only_a = dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout([U, "y"], mesh))
    status = dt.DTensorCheckpoint(mesh, a=only_a).read(str(tmp_path / "ck"))
    with pytest.raises(AssertionError):
        status.assert_consumed()  # b is in the checkpoint but nothing took it
    status.assert_existing_objects_matched()
    assert_components_match(only_a.value(), values["a"])
    extra = dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout([U, "y"], mesh))
    status = dt.DTensorCheckpoint(mesh, a=only_a, c=extra).read(str(tmp_path / "ck"))
    with pytest.raises(AssertionError):
        status.assert_existing_objects_matched()  # c has no value in the checkpoint
    status.expect_partial()


def test_dtensor_checkpoint_mixes_dvariables_of_two_meshes(tmp_path: Path) -> None:
    """TF cannot save DVariables of two meshes in one checkpoint (spec §10); shardckpt can."""
    mesh_a = mesh24()
    mesh_b = dt.create_mesh([("z", 8)])
    values = values_for(["p", "q", "r"], seed=10)
    p = dt.DVariable.from_global(values["p"], dt.Layout(["x", "y"], mesh_a))
    q = dt.DVariable.from_global(values["q"], dt.Layout([U, "z"], mesh_b))
    r = dt.DVariable.from_global(values["r"], dt.Layout(["z", U], mesh_b))
    prefix = dt.DTensorCheckpoint(mesh_a, p=p, q=q, r=r).save(str(tmp_path / "ck"))
    reader = BundleReader(Location.of(prefix))
    for name, var in (("p", p), ("q", q), ("r", r)):
        key = f"{name}/.ATTRIBUTES/VARIABLE_VALUE"
        assert set(shard_of_pieces(reader, key)) == set(var.layout.distinct_boxes(var.shape))
        np.testing.assert_array_equal(reader.read(key), values[name])
    # a device's pieces share one file, whichever mesh they came from
    assert reader.num_shards == 8
    # restore crosswise: p onto mesh_b, q and r onto mesh_a
    tp = dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout(["z", U], mesh_b))
    tq = dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout(["y", "x"], mesh_a))
    tr = dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout([U, U], mesh_a))
    dt.DTensorCheckpoint(mesh_b, p=tp, q=tq, r=tr).restore(prefix).assert_consumed()
    for name, var in (("p", tp), ("q", tq), ("r", tr)):
        assert_components_match(var.value(), values[name])
    # and sharded_save takes tensors of several meshes too
    dt.sharded_save(mesh_a, str(tmp_path / "raw"), ["p", "q"], ["", ""], [p.value(), q.value()])
    raw = BundleReader(Location.of(str(tmp_path / "raw")))
    np.testing.assert_array_equal(raw.read("q"), values["q"])


def test_dtensor_checkpoint_across_four_clients(tmp_path: Path) -> None:
    """Four clients save one DTensorCheckpoint together and each restores its own pieces of it
    onto another layout; only the io client (0) commits and writes the ``checkpoint`` file."""
    values = values_for(list(LAYOUTS_24), seed=12)

    def client(rank: int, coordinator: Coordinator) -> Dict[str, List[np.ndarray]]:
        mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)], client_id=rank, num_clients=4)
        variables = {name: dt.DVariable.from_global(values[name], dt.Layout(spec, mesh))
                     for name, spec in LAYOUTS_24.items()}
        ckpt = dt.DTensorCheckpoint(mesh, coordinator=coordinator, **variables)
        path = ckpt.save(str(tmp_path / "ck"))
        assert path == str(tmp_path / "ck-1")
        dest = dt.create_distributed_mesh([("a", 8)], client_id=rank, num_clients=4)
        targets = {name: dt.DVariable.from_global(np.zeros((8, 16), np.float32), dt.Layout([U, "a"], dest))
                   for name in LAYOUTS_24}
        dt.DTensorCheckpoint(dest, coordinator=coordinator, **targets).restore(path).assert_consumed()
        for name, var in targets.items():
            assert sorted(var.value().components) == [2 * rank, 2 * rank + 1]
            assert_components_match(var.value(), values[name])
        return {name: dt.to_global(var.value(), coordinator) for name, var in targets.items()}

    for gathered in run_clients(4, client):
        for name, value in gathered.items():
            np.testing.assert_array_equal(value, values[name])
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "ck-1")
    reader = BundleReader(Location.of(str(tmp_path / "ck-1")))
    for name, spec in LAYOUTS_24.items():
        key = f"{name}/.ATTRIBUTES/VARIABLE_VALUE"
        assert set(shard_of_pieces(reader, key)) == set(dt.Layout(spec, mesh24()).distinct_boxes((8, 16)))


# -- the rest of TF's DTensor API (issue 15) and DVariables wherever DTensors go (issue 10) ---------------


def test_to_global_and_every_dtensor_function_take_a_dvariable() -> None:
    mesh = mesh24()
    full = np.arange(128, dtype=np.float32).reshape(8, 16)
    var = dt.DVariable.from_global(full, dt.Layout(["x", "y"], mesh), name="w")
    np.testing.assert_array_equal(dt.to_global(var), full)  # was: TypeError 'shardckpt.float32'
    assert dt.fetch_layout(var) == var.layout and dt.is_dtensor(var) and not dt.is_dtensor(full)
    assert [c is d for c, d in zip(dt.unpack(var), var.components())] == [True] * 8
    moved = dt.relayout(var, dt.Layout([U, "x"], mesh))
    assert moved.layout.sharding_specs == [U, "x"]
    np.testing.assert_array_equal(dt.to_global(moved), full)
    np.testing.assert_array_equal(dt.copy_to_mesh(var, dt.Layout([U, U], dt.create_mesh([("z", 2)]))).numpy(), full)


def test_dvariable_read_assign_and_numpy() -> None:
    mesh = mesh24()
    full = np.arange(128, dtype=np.float32).reshape(8, 16)
    t = dt.from_global(full, dt.Layout(["x", "y"], mesh))
    var = dt.DVariable(t)
    assert var.value() is not t  # copied, as TF
    var.assign_add(t)
    var.assign_add(1.0)  # a scalar broadcast
    np.testing.assert_array_equal(var.numpy(), 2 * full + 1)
    snapshot = var.read_value()
    var.assign_sub(full)  # a global NumPy value
    np.testing.assert_array_equal(var.numpy(), full + 1)
    np.testing.assert_array_equal(snapshot.numpy(), 2 * full + 1)  # read_value is a copy
    var.assign(np.zeros_like(full))
    assert not var.numpy().any() and var.value().components[0] is var.components()[0]
    var.assign(dt.from_global(full, dt.Layout([U, "x"], mesh)))  # another layout, same mesh: as TF, relaid out
    assert var.layout == dt.Layout(["x", "y"], mesh)
    np.testing.assert_array_equal(var.numpy(), full)
    with pytest.raises(InvalidArgumentError, match="shape"):
        var.assign_add(np.zeros((2, 2), np.float32))
    remote = dt.create_distributed_mesh([("x", 8)], client_id=1, num_clients=4)
    with pytest.raises(InvalidArgumentError, match="to_global"):
        dt.DVariable.from_global(np.zeros(8, np.float32), dt.Layout(["x"], remote)).numpy()
    with pytest.raises(TypeError, match="DTensor"):
        dt.DVariable(np.zeros(3))
    assert dt.DVariable(full, layout=dt.Layout([U, U], mesh)).numpy().tolist() == full.tolist()


def test_relayout_and_to_global_of_dvariables_across_clients() -> None:
    full = np.arange(64, dtype=np.int64).reshape(8, 8)

    def client(rank: int, coordinator: Coordinator) -> List[Any]:
        mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)], client_id=rank, num_clients=4)
        var = dt.DVariable.from_global(full, dt.Layout(["x", "y"], mesh))
        moved = dt.relayout(var, dt.Layout(["y", U], mesh), coordinator=coordinator)
        return [dt.to_global(var, coordinator).tolist(), dt.to_global(moved, coordinator).tolist(),
                [c.shape for c in dt.unpack(moved)]]

    for gathered, moved, shapes in run_clients(4, client):
        assert gathered == full.tolist() and moved == full.tolist() and shapes == [(2, 8), (2, 8)]


def test_mesh_strings_round_trip_for_every_kind_of_mesh() -> None:
    meshes = [mesh24(), dt.create_mesh({"a": 4}, mesh_name="named"),
              dt.create_mesh([("x", 2)], devices=["GPU:0", "/device:GPU:1"]),
              dt.create_distributed_mesh([("x", 2), ("y", 4)], client_id=3, num_clients=4),
              dt.create_distributed_mesh([("x", 4)], local_devices=["CPU:0", "CPU:1"], client_id=1, num_clients=2)]
    for mesh in meshes:
        again = dt.Mesh.from_string(mesh.to_string())
        assert again == mesh and again.to_string() == mesh.to_string() and str(mesh) == repr(mesh)
        assert again.local_device_ids() == mesh.local_device_ids() and again.local_devices() == mesh.local_devices()
        layout = dt.Layout([mesh.dim_names[0]] + [U] * 1, mesh)
        assert dt.Layout.from_string(layout.to_string()) == layout
    assert meshes[2].device_type() == "GPU" and meshes[2].local_devices()[1].endswith("/device:GPU:1")
    assert meshes[4].local_devices() == ["/job:worker/replica:0/task:1/device:CPU:0",
                                         "/job:worker/replica:0/task:1/device:CPU:1"]
    assert meshes[4].local_device_ids() == [2, 3]
    with pytest.raises(InvalidArgumentError):
        dt.create_distributed_mesh([("x", 4)], local_devices=["CPU:0"], num_local_devices=2, client_id=0,
                                   num_clients=4)


def test_name_based_save_and_restore_on_several_meshes(tmp_path: Path) -> None:
    a_mesh, b_mesh = mesh24(), dt.create_mesh([("z", 4)])
    a = dt.DVariable.from_global(np.arange(128, dtype=np.float32).reshape(8, 16), dt.Layout(["x", "y"], a_mesh))
    b = dt.from_global(np.arange(8, dtype=np.int32), dt.Layout(["z"], b_mesh))
    prefix = str(tmp_path / "nb")
    dt.name_based_save(a_mesh, prefix, {"a": a, "b": b})
    like_a = dt.from_global(np.zeros((8, 16), np.float32), dt.Layout([U, "z"], b_mesh))
    like_b = dt.from_global(np.zeros(8, np.int32), dt.Layout([U], a_mesh))
    got = dt.name_based_restore(a_mesh, prefix, {"b": like_b, "a": like_a})
    assert list(got) == ["b", "a"] and got["a"].layout == like_a.layout
    np.testing.assert_array_equal(got["a"].numpy(), a.numpy())
    np.testing.assert_array_equal(got["b"].numpy(), np.arange(8, dtype=np.int32))
    assert not like_a.components[0].any()  # new values; the templates are untouched
    with pytest.raises(InvalidArgumentError, match="float32"):
        dt.name_based_restore(a_mesh, prefix, {"a": dt.from_global(np.zeros((8, 16)), dt.Layout([U, U], a_mesh))})
    with pytest.raises(shardckpt.errors.NotFoundError):
        dt.name_based_restore(a_mesh, prefix, {"nope": like_a})
    with pytest.raises(InvalidArgumentError, match="DTensor or DVariable"):
        dt.name_based_restore(a_mesh, prefix, {"a": np.zeros((8, 16), np.float32)})


def test_default_mesh_barrier_and_clients(tmp_path: Path) -> None:
    mesh = mesh24()
    assert dt.get_default_mesh() is None and dt.num_clients() == 1 and dt.client_id() == 0
    with dt.default_mesh(mesh):
        assert dt.get_default_mesh() is mesh
        ckpt = dt.DTensorCheckpoint(v=dt.DVariable.from_global(np.ones(8, np.float32), dt.Layout(["y"], mesh)))
        assert ckpt.mesh is mesh
    assert dt.get_default_mesh() is None
    with pytest.raises(InvalidArgumentError, match="needs a mesh"):
        dt.DTensorCheckpoint()
    assert dt.barrier(mesh, "here", timeout_in_ms=1000) is None
    with pytest.raises(InvalidArgumentError, match="clients"):
        dt.barrier(dt.create_distributed_mesh([("x", 8)], client_id=0, num_clients=4))


def test_dtensor_namespace_is_the_public_api() -> None:
    import shardckpt.dtensor._proto  # noqa: F401 - a lazily imported private module stays private

    names = {n for n in vars(dt) if not n.startswith("_")}
    assert names == set(dt.__all__)
    assert not hasattr(dt, "save") and not hasattr(dt, "api") and not hasattr(dt, "mesh")
    from shardckpt.dtensor._api import relayout  # the private modules stay importable by path

    assert relayout is dt.relayout


def test_sharded_save_takes_dvariables(tmp_path: Path) -> None:
    mesh = mesh24()
    var = dt.DVariable.from_global(np.arange(128, dtype=np.float32).reshape(8, 16), dt.Layout(["x", "y"], mesh))
    dt.sharded_save(mesh, str(tmp_path / "s"), ["v"], [""], [var])
    np.testing.assert_array_equal(shardckpt.load_checkpoint(str(tmp_path / "s")).get_tensor("v"), var.numpy())
