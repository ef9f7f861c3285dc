"""Object-based checkpoints (``shardckpt.Checkpoint`` and friends), pure shardckpt.

Covers the ``tf.train.Checkpoint`` front door without TensorFlow (the TF comparison
tests live elsewhere): ``Variable`` and ``Module`` tracking, keys and the object graph
(spec §9), ``save``/``write``/``restore``/``read`` and the ``checkpoint`` state file
(§1.2-1.3), restore matching and load-status assertions (§9.5), clear errors that
leave every object unchanged, registered savers (§9.6), name-based (TF1) restores,
``CheckpointOptions`` (§11) and ``CheckpointManager``.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List
from uuid import uuid4

import ml_dtypes
import numpy as np
import pytest

import shardckpt
from shardckpt import (
    Checkpoint,
    CheckpointManager,
    CheckpointOptions,
    MaxShardSizePolicy,
    Module,
    Optimizer,
    ShardByTaskPolicy,
    ShardingCallback,
    Trackable,
    Variable,
    get_checkpoint_state,
    io,
    latest_checkpoint,
    register_checkpoint_saver,
)
from shardckpt.checkpoint import manager as manager_module
from shardckpt.checkpoint.graph import walk
from shardckpt.checkpoint.restore import CheckpointLoadStatus, InitializationOnlyStatus, NameBasedSaverStatus
from shardckpt.errors import CorruptIndexError, DataLossError, InvalidArgumentError, NotFoundError, ShardckptError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from shardckpt.format.sstable import TableWriter, read_table
from shardckpt.storage.location import Location

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
ATTR = "/.ATTRIBUTES/VARIABLE_VALUE"
COUNTER_KEY = "save_counter" + ATTR


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def vkey(path: str) -> str:
    return path + ATTR


def read_graph(prefix: str) -> TrackableObjectGraph:
    with BundleReader(Location.of(prefix)) as reader:
        graph = TrackableObjectGraph()
        graph.ParseFromString(reader.read(GRAPH_KEY).item())
        return graph


def stored_keys(prefix: str) -> List[str]:
    with BundleReader(Location.of(prefix)) as reader:
        return sorted(k.decode() for k in reader.keys())


def stored(prefix: str, key: str) -> np.ndarray:
    with BundleReader(Location.of(prefix)) as reader:
        return reader.read(key)


def children(graph: TrackableObjectGraph, node_id: int = 0) -> List[str]:
    return [c.local_name for c in graph.nodes[node_id].children]


def child_id(graph: TrackableObjectGraph, node_id: int, name: str) -> int:
    for ref in graph.nodes[node_id].children:
        if ref.local_name == name:
            return ref.node_id
    raise KeyError(name)


def snapshot(*roots: Trackable) -> Dict[str, np.ndarray]:
    """A copy of every array reachable from ``roots`` (variables and plain arrays), by path."""
    out: Dict[str, np.ndarray] = {}
    for i, root in enumerate(roots):
        for obj, path in walk(root):
            array = getattr(obj, "array", None)
            if isinstance(array, np.ndarray):
                out[f"{i}:{'/'.join(path)}"] = array.copy()
    for obj in roots:
        if isinstance(obj, Checkpoint) and obj._save_counter is not None:
            out["save_counter"] = obj._save_counter.numpy()
    return out


def assert_unchanged(before: Dict[str, np.ndarray], after: Dict[str, np.ndarray]) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert np.array_equal(before[name], after[name]), name


def files(directory: Path) -> List[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


class Adam(Optimizer):
    """An optimizer with ``m`` and ``v`` slots (like ``tf.compat.v1.train.AdamOptimizer``)."""

    def make_slots(self, variable: Variable, fill: float = 0.0) -> None:
        self.add_slot(variable, "m", np.full(variable.shape, fill, variable.array.dtype))
        self.add_slot(variable, "v", np.full(variable.shape, fill + 1, variable.array.dtype))


class Boom(ShardingCallback):
    """A sharding callback that fails before anything is written."""

    @property
    def description(self) -> str:
        return "boom"

    def __call__(self, shardable_tensors: Any) -> Any:
        raise RuntimeError("boom: sharding failed")


class FailWhileWriting(ShardingCallback):
    """One shard whose first value raises when the writer asks for its bytes (validation passes)."""

    @property
    def description(self) -> str:
        return "fails while writing"

    def __call__(self, shardable_tensors: Any) -> Any:
        shard = ShardByTaskPolicy()(shardable_tensors)[0]
        key = next(k for k in shard if k != GRAPH_KEY)
        value = np.asarray(shard[key][""])
        calls = [0]

        def lazy() -> np.ndarray:
            calls[0] += 1
            if calls[0] > 1:  # the first call is validation, the second the writer
                raise OSError("disk on fire")
            return value

        shard[key][""] = lazy
        return [shard]


def small_model(scale: float = 1.0) -> Module:
    m = Module()
    m.dense = Module()
    m.dense.kernel = Variable(np.arange(6, dtype=np.float32).reshape(2, 3) * scale, name="dense/kernel")
    m.dense.bias = Variable(np.full(3, 0.5 * scale, np.float32), name="dense/bias")
    m.step = Variable(np.int64(7 * scale), name="step")
    return m


# ---------------------------------------------------------------------------
# Variable
# ---------------------------------------------------------------------------

def test_variable_numpy_is_a_copy_and_array_is_live() -> None:
    v = Variable([1.0, 2.0, 3.0])
    copy = v.numpy()
    copy[0] = 99
    assert v.numpy()[0] == 1.0
    live = v.array
    live[1] = 42
    assert v.numpy()[1] == 42
    assert v.array is live
    v.assign([7.0, 8.0, 9.0])
    assert v.array is live and list(live) == [7.0, 8.0, 9.0]


def test_variable_assign_is_in_place_and_checks_shape() -> None:
    v = Variable(np.zeros((2, 2), np.float32), name="w")
    live = v.array
    assert v.assign(np.ones((2, 2))) is v
    assert v.array is live and live.dtype == np.float32 and live.sum() == 4
    v.assign_add(1)
    assert live.sum() == 8
    with pytest.raises(InvalidArgumentError, match=r"shape \[3\].*'w'.*\[2, 2\]"):
        v.assign(np.ones(3))
    assert live.sum() == 8  # unchanged by the failed assign


def test_variable_dtype_shape_name() -> None:
    v = Variable(np.zeros((3, 4)), dtype="float32", name="layer/w")
    assert v.shape == (3, 4)
    assert v.dtype.name == "float32" and v.dtype.enum == 1
    assert v.array.dtype == np.float32
    assert v.name == "layer/w"
    assert Variable(1).name == "Variable"
    assert Variable(np.int64(3)).dtype.name == "int64"
    assert Variable(lambda: np.ones(2)).shape == (2,)  # initial value may be a callable
    assert Variable(np.ones(2), trainable=False).trainable is False


def test_string_variable_roundtrip(tmp_path: Path) -> None:
    v = Variable(["hello", "wörld", ""], name="vocab")
    assert v.dtype.name == "string"
    ckpt = Checkpoint(vocab=v)
    path = ckpt.write(str(tmp_path / "s"))
    with BundleReader(Location.of(path)) as reader:
        assert reader.dtype(vkey("vocab")).name == "string"
        assert list(reader.read(vkey("vocab"))) == [b"hello", "wörld".encode(), b""]
    target = Variable(["x", "y", "z"], name="vocab")
    live = target.array
    Checkpoint(vocab=target).read(path).assert_consumed()
    assert target.array is live
    assert list(target.numpy()) == [b"hello", "wörld".encode(), b""]


def test_bfloat16_variable_roundtrip(tmp_path: Path) -> None:
    v = Variable([1.5, -2.25, 3.0], dtype="bfloat16")
    assert v.dtype.name == "bfloat16" and v.array.dtype == ml_dtypes.bfloat16
    path = Checkpoint(v=v).write(str(tmp_path / "b"))
    with BundleReader(Location.of(path)) as reader:
        assert reader.dtype(vkey("v")).name == "bfloat16"
    target = Variable(np.zeros(3), dtype=ml_dtypes.bfloat16)
    Checkpoint(v=target).read(path).assert_consumed()
    assert target.array.dtype == ml_dtypes.bfloat16
    assert target.numpy().astype(np.float32).tolist() == [1.5, -2.25, 3.0]


# ---------------------------------------------------------------------------
# Module tracking
# ---------------------------------------------------------------------------

def test_attribute_order_reassignment_and_deletion(tmp_path: Path) -> None:
    m = Module()
    m.b = Variable(1.0)
    m.a = Variable(2.0)
    m.c = Variable(3.0)
    assert list(m._trackable_children()) == ["b", "a", "c"]  # first assignment order, not sorted
    m.b = Variable(10.0)  # reassignment keeps its place
    assert list(m._trackable_children()) == ["b", "a", "c"]
    del m.a
    assert list(m._trackable_children()) == ["b", "c"]
    m.a = Variable(20.0)  # comes back at the end
    assert list(m._trackable_children()) == ["b", "c", "a"]
    path = Checkpoint(model=m).write(str(tmp_path / "o"))
    graph = read_graph(path)
    assert children(graph, child_id(graph, 0, "model")) == ["b", "c", "a"]
    assert float(stored(path, vkey("model/b"))) == 10.0


def test_lists_and_dicts_are_tracked_with_later_mutations(tmp_path: Path) -> None:
    m = Module()
    m.lst = []
    m.dct = {}
    assert type(m.lst).__name__ == "TrackedList" and type(m.dct).__name__ == "TrackedDict"
    assert isinstance(m.lst, list) and isinstance(m.dct, dict)
    m.lst.append(Variable(1.0))
    m.lst.extend([Variable(2.0), Variable(3.0)])
    m.lst[1] = Variable(20.0)  # setitem replaces the child
    m.dct["x"] = Variable(4.0)
    m.dct.update(y=Variable(5.0))
    m.dct.setdefault("z", Variable(6.0))
    m.nested = {"inner": [Variable(7.0)]}  # nested containers are wrapped too
    m.nested["inner"].append(Variable(8.0))
    path = Checkpoint(model=m).write(str(tmp_path / "c"))
    values = {k: float(stored(path, k)) for k in stored_keys(path) if k != GRAPH_KEY}
    assert values == {
        vkey("model/lst/0"): 1.0, vkey("model/lst/1"): 20.0, vkey("model/lst/2"): 3.0,
        vkey("model/dct/x"): 4.0, vkey("model/dct/y"): 5.0, vkey("model/dct/z"): 6.0,
        vkey("model/nested/inner/0"): 7.0, vkey("model/nested/inner/1"): 8.0,
    }


def test_tuples_are_tracked(tmp_path: Path) -> None:
    m = Module()
    m.pair = (Variable(1.0), "not trackable", Variable(2.0))
    path = Checkpoint(model=m).write(str(tmp_path / "t"))
    assert stored_keys(path) == [GRAPH_KEY, vkey("model/pair/0"), vkey("model/pair/2")]
    target = Module()
    target.pair = (Variable(0.0), "x", Variable(0.0))
    Checkpoint(model=target).read(path).assert_consumed()
    assert [float(target.pair[0].numpy()), float(target.pair[2].numpy())] == [1.0, 2.0]


def test_non_string_dict_keys_are_a_clear_error_at_save(tmp_path: Path) -> None:
    m = Module()
    m.table = {1: Variable(1.0)}  # assignment itself is fine
    ckpt = Checkpoint(model=m)
    with pytest.raises(InvalidArgumentError, match="dict keys must be strings"):
        ckpt.save(str(tmp_path / "d" / "ck"))
    assert int(ckpt.save_counter.numpy()) == 0  # the number was not used up
    assert not any(p.name.endswith(".index") for p in tmp_path.rglob("*"))
    assert not (tmp_path / "d" / "checkpoint").exists()


def test_non_trackable_attributes_are_ignored(tmp_path: Path) -> None:
    m = Module()
    m.count = 3
    m.label = "text"
    m.fn = len
    m.none = None
    m.v = Variable(1.0)
    assert list(m._trackable_children()) == ["v"]
    path = Checkpoint(model=m).write(str(tmp_path / "n"))
    assert stored_keys(path) == [GRAPH_KEY, vkey("model/v")]


def test_private_attributes_are_tracked_like_tf(tmp_path: Path) -> None:
    """tf.Module / AutoTrackable track every attribute, '_'-prefixed ones included: Keras
    checkpoints are keyed ``optimizer/_variables/N`` (spec §9.3). A Module that silently
    skips ``self._w`` loses that value at save and cannot read such TF checkpoints."""
    m = Module()
    m._w = Variable(np.float32(3.0))
    path = Checkpoint(model=m).write(str(tmp_path / "p"))
    assert vkey("model/_w") in stored_keys(path)


def test_plain_numpy_arrays_are_saved_and_restored_in_place(tmp_path: Path) -> None:
    m = Module()
    m.arr = np.arange(4, dtype=np.float64)
    m.lst = [np.ones((2, 2), np.int32)]
    path = Checkpoint(model=m).write(str(tmp_path / "a"))
    assert stored_keys(path) == [GRAPH_KEY, vkey("model/arr"), vkey("model/lst/0")]

    target = Module()
    target.arr = np.zeros(4)
    target.lst = [np.zeros((2, 2), np.int32)]
    arr, elem = target.arr, target.lst[0]
    Checkpoint(model=target).read(path).assert_consumed()
    assert target.arr is arr and target.lst[0] is elem  # same objects, filled in place
    assert arr.tolist() == [0.0, 1.0, 2.0, 3.0] and elem.sum() == 4


def test_read_only_array_restore_is_a_clear_error(tmp_path: Path) -> None:
    m = Module()
    m.arr = np.arange(3.0)
    path = Checkpoint(model=m).write(str(tmp_path / "ro"))
    target = Module()
    target.arr = np.zeros(3)
    target.arr.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        Checkpoint(model=target).read(path)
    assert target.arr.sum() == 0


def test_shared_object_saved_once_under_shortest_path_and_restored_into_both(tmp_path: Path) -> None:
    def build(shared: Variable) -> Module:
        m = Module()
        m.a = Module()
        m.a.deep = Module()
        m.a.deep.v = shared  # assigned first, but deeper
        m.z = shared  # the shortest (BFS) path
        return m

    src = build(Variable(np.array([1.0, 2.0]), name="shared"))
    path = Checkpoint(model=src).write(str(tmp_path / "s"))
    keys = stored_keys(path)
    assert keys == [GRAPH_KEY, vkey("model/z")]  # stored once, under the shorter path
    graph = read_graph(path)
    model = child_id(graph, 0, "model")
    deep = child_id(graph, child_id(graph, model, "a"), "deep")
    assert child_id(graph, deep, "v") == child_id(graph, model, "z")  # one node, two references

    target = build(Variable(np.zeros(2), name="other name"))
    Checkpoint(model=target).read(path).assert_consumed()
    assert target.z is target.a.deep.v
    assert target.a.deep.v.numpy().tolist() == [1.0, 2.0]


def test_module_variables() -> None:
    m = Module()
    v1, v2, v3 = Variable(1.0), Variable(2.0), Variable(3.0)
    m.inner = Module()
    m.inner.v = v3
    m.v = v1
    m.lst = [v2, v1]  # v1 again: listed once
    m.arr = np.zeros(2)  # plain arrays are not Variables
    # TF's order: attributes sorted by name (arr, inner, lst, v), then the submodules' variables
    assert m.variables == (v2, v1, v3)
    assert Module().variables == ()


# ---------------------------------------------------------------------------
# keys and the object graph
# ---------------------------------------------------------------------------

def test_key_escaping(tmp_path: Path) -> None:
    m = Module()
    m.dct = {"a/b.c": Variable(1.0)}
    path = Checkpoint(**{"we.ird/name": Variable(2.0), "model": m}).write(str(tmp_path / "e"))
    assert stored_keys(path) == [GRAPH_KEY, vkey("model/dct/a.Sb..c"), vkey("we..ird.Sname")]
    graph = read_graph(path)
    assert children(graph) == ["model", "we.ird/name"]  # local names are stored unescaped
    target = Module()
    target.dct = {"a/b.c": Variable(0.0)}
    weird = Variable(0.0)
    Checkpoint(**{"we.ird/name": weird, "model": target}).read(path).assert_consumed()
    assert float(weird.numpy()) == 2.0 and float(target.dct["a/b.c"].numpy()) == 1.0


def test_serialized_tensor_fields(tmp_path: Path) -> None:
    m = small_model()
    path = Checkpoint(model=m).write(str(tmp_path / "f"))
    graph = read_graph(path)
    dense = child_id(graph, child_id(graph, 0, "model"), "dense")
    kernel = graph.nodes[child_id(graph, dense, "kernel")]
    assert [(a.name, a.full_name, a.checkpoint_key) for a in kernel.attributes] == [
        ("VARIABLE_VALUE", "dense/kernel", vkey("model/dense/kernel"))]


def test_optimizer_slot_keys_and_references(tmp_path: Path) -> None:
    v = Variable(np.ones(3, np.float32), name="v")
    w = Variable(np.ones(2, np.float32), name="w")
    opt = Adam()
    opt.make_slots(v, 1.0)
    opt.make_slots(w, 5.0)
    path = Checkpoint(opt=opt, v=v, w=w).write(str(tmp_path / "slots"))
    keys = stored_keys(path)
    for var in ("v", "w"):
        for slot in ("m", "v"):
            assert vkey(f"{var}/.OPTIMIZER_SLOT/opt/{slot}") in keys
    assert stored(path, vkey("w/.OPTIMIZER_SLOT/opt/v")).tolist() == [6.0, 6.0]
    graph = read_graph(path)
    assert children(graph) == ["opt", "v", "w"]
    refs = [(r.original_variable_node_id, r.slot_name, r.slot_variable_node_id)
            for r in graph.nodes[1].slot_variables]
    # slot nodes come after every ordinary node: per slot name, then per variable
    assert refs == [(2, "m", 4), (3, "m", 5), (2, "v", 6), (3, "v", 7)]
    assert len(graph.nodes) == 8
    assert graph.nodes[4].attributes[0].checkpoint_key == vkey("v/.OPTIMIZER_SLOT/opt/m")
    assert not graph.nodes[4].children


def test_slot_name_escaping(tmp_path: Path) -> None:
    v = Variable(np.ones(2), name="v")
    opt = Optimizer()
    opt.add_slot(v, "mo/men.tum")
    path = Checkpoint(my_opt=opt, v=v).write(str(tmp_path / "esc"))
    assert vkey("v/.OPTIMIZER_SLOT/my_opt/mo.Smen..tum") in stored_keys(path)


def test_node_order_is_bfs_and_has_checkpoint_values_on_every_node(tmp_path: Path) -> None:
    m = Module()
    m.empty = Module()  # no values below it
    m.sub = Module()
    m.sub.v = Variable(1.0)
    m.lst = []  # an empty container
    ckpt = Checkpoint(model=m, a=Variable(2.0))
    path = ckpt.save(str(tmp_path / "bfs"))
    graph = read_graph(path)
    # root, then its children (sorted kwargs, save_counter last), then grandchildren...
    assert children(graph) == ["a", "model", "save_counter"]
    assert [c.node_id for c in graph.nodes[0].children] == [1, 2, 3]
    assert children(graph, 2) == ["empty", "sub", "lst"]
    assert [c.node_id for c in graph.nodes[2].children] == [4, 5, 6]
    assert children(graph, 5) == ["v"] and graph.nodes[5].children[0].node_id == 7
    assert len(graph.nodes) == 8
    for node in graph.nodes:
        assert node.HasField("has_checkpoint_values")
    has = [n.has_checkpoint_values.value for n in graph.nodes]
    #         root  a     model save_counter empty  sub   lst    v
    assert has == [True, True, True, True, False, True, False, True]


def test_object_graph_is_last_in_its_data_file_and_data_follows_bfs(tmp_path: Path) -> None:
    m = Module()
    m.zz = Variable(np.ones(4, np.float32))  # key-sorted it would come after 'model/aa'
    m.aa = Variable(np.ones(8, np.float32))
    ckpt = Checkpoint(model=m, b=Variable(np.int32(3)), a=Variable(np.ones(2)))
    path = ckpt.save(str(tmp_path / "order"))
    with BundleReader(Location.of(path)) as reader:
        assert reader.num_shards == 1
        entries = {k.decode(): reader.entry(k) for k in reader.keys()}
        bfs = [vkey("a"), vkey("b"), COUNTER_KEY, vkey("model/zz"), vkey("model/aa"), GRAPH_KEY]
        assert sorted(entries) == sorted(bfs)
        offsets = [entries[k].offset for k in bfs]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
        graph_entry = entries[GRAPH_KEY]
        assert graph_entry.offset + graph_entry.size == os.path.getsize(reader.data_path(0))


# ---------------------------------------------------------------------------
# Checkpoint: save / write / restore / read
# ---------------------------------------------------------------------------

def test_save_numbering_and_state_file_lists_only_newest(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    prefix = str(tmp_path / "run" / "nested" / "ck")  # parents are created
    assert ckpt.save(prefix) == prefix + "-1"
    assert ckpt.save(prefix) == prefix + "-2"
    assert int(ckpt.save_counter.numpy()) == 2
    assert int(stored(prefix + "-2", COUNTER_KEY)) == 2
    state_file = tmp_path / "run" / "nested" / "checkpoint"
    assert state_file.read_text() == 'model_checkpoint_path: "ck-2"\nall_model_checkpoint_paths: "ck-2"\n'
    state = get_checkpoint_state(str(state_file.parent))
    assert state.model_checkpoint_path == prefix + "-2"
    assert list(state.all_model_checkpoint_paths) == [prefix + "-2"]
    assert not state.all_model_checkpoint_timestamps  # only CheckpointManager writes them
    assert latest_checkpoint(str(state_file.parent)) == prefix + "-2"
    assert os.path.exists(prefix + "-1.index")  # Checkpoint.save never deletes


def test_write_has_no_counter_and_no_state_file(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    prefix = str(tmp_path / "w" / "exact")
    assert ckpt.write(prefix) == prefix
    assert ckpt._save_counter is None  # not created
    assert stored_keys(prefix) == [GRAPH_KEY, vkey("v")]
    assert files(tmp_path / "w") == ["exact.data-00000-of-00001", "exact.index"]
    # once the counter exists, write() saves it but does not increment it
    ckpt.save(str(tmp_path / "w" / "s"))
    state_before = (tmp_path / "w" / "checkpoint").read_bytes()
    ckpt.write(prefix)
    assert int(stored(prefix, COUNTER_KEY)) == 1 and int(ckpt.save_counter.numpy()) == 1
    assert (tmp_path / "w" / "checkpoint").read_bytes() == state_before


def test_read_vs_restore_and_save_counter(tmp_path: Path) -> None:
    src = Checkpoint(v=Variable(5.0))
    src.save(str(tmp_path / "ck"))
    path = src.save(str(tmp_path / "ck"))

    # restore(): creates save_counter and restores it
    target = Checkpoint(v=Variable(0.0))
    target.restore(path).assert_consumed()
    assert int(target.save_counter.numpy()) == 2 and float(target.v.numpy()) == 5.0
    assert target.save(str(tmp_path / "ck")) == str(tmp_path / "ck") + "-3"

    # read(): no save_counter is created
    reader_side = Checkpoint(v=Variable(0.0))
    status = reader_side.read(path)
    assert reader_side._save_counter is None and float(reader_side.v.numpy()) == 5.0
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="save_counter"):
        status.assert_consumed()  # the checkpoint's counter matched nothing
    status.expect_partial()

    # a write()-checkpoint read back with read() is fully consumed
    written = Checkpoint(v=Variable(9.0)).write(str(tmp_path / "plain"))
    fresh = Checkpoint(v=Variable(0.0))
    fresh.read(written).assert_consumed()
    # restore() of a checkpoint without save_counter: the counter matched nothing, and the asserts say so (TF)
    again = Checkpoint(v=Variable(0.0))
    status = again.restore(written)
    assert int(again.save_counter.numpy()) == 0 and float(again.v.numpy()) == 9.0
    for check in (status.assert_consumed, status.assert_existing_objects_matched):
        with pytest.raises(AssertionError, match="save_counter"):
            check()
    status.assert_nontrivial_match()


def test_restore_none_returns_initialization_only_status() -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    status = ckpt.restore(None)
    assert isinstance(status, InitializationOnlyStatus)
    for check in (status.assert_consumed, status.assert_existing_objects_matched, status.assert_nontrivial_match):
        with pytest.raises(AssertionError):
            check()
    assert status.expect_partial() is status
    with pytest.raises(AssertionError, match="no restore ops"):  # as TF's InitializationOnlyStatus
        status.run_restore_ops()
    status.initialize_or_restore()
    assert float(ckpt.v.numpy()) == 1.0


def test_restore_from_directory(tmp_path: Path) -> None:
    src = Checkpoint(v=Variable(1.0))
    src.save(str(tmp_path / "ck"))
    src.v.assign(2.0)
    src.save(str(tmp_path / "ck"))
    target = Checkpoint(v=Variable(0.0))
    for method in (target.restore, target.read):  # TF takes prefixes only: a directory is a DataLossError
        with pytest.raises(DataLossError, match="directory"):
            method(str(tmp_path))
    assert float(target.v.numpy()) == 0.0
    target.restore(shardckpt.latest_checkpoint(str(tmp_path))).assert_consumed()
    assert float(target.v.numpy()) == 2.0 and int(target.save_counter.numpy()) == 2
    # reading by path (load_checkpoint and friends) still resolves a directory to its latest checkpoint
    assert shardckpt.checkpoint.reader.resolve_prefix(str(tmp_path)) == str(tmp_path / "ck-2")


def test_restore_with_root_form(tmp_path: Path) -> None:
    model = small_model()
    opt = Adam()
    opt.make_slots(model.dense.kernel, 3.0)
    ckpt = Checkpoint(root=model, optimizer=opt)
    path = ckpt.save(str(tmp_path / "r"))
    graph = read_graph(path)
    # root's own children first (TF also records a child 'root' pointing at node 0 itself: ignored here)
    own = [c.local_name for c in graph.nodes[0].children if c.node_id != 0]
    assert own == ["dense", "step", "optimizer", "save_counter"]
    keys = stored_keys(path)
    assert vkey("dense/kernel") in keys and COUNTER_KEY in keys
    assert vkey("dense/kernel/.OPTIMIZER_SLOT/optimizer/m") in keys

    target = small_model(scale=0.0)
    topt = Adam()
    topt.make_slots(target.dense.kernel, 0.0)
    tckpt = Checkpoint(root=target, optimizer=topt)
    tckpt.restore(path).assert_consumed()
    assert np.array_equal(target.dense.kernel.numpy(), model.dense.kernel.numpy())
    assert int(target.step.numpy()) == 7
    assert topt.get_slot(target.dense.kernel, "m").numpy().tolist() == [[3.0] * 3] * 2
    assert int(tckpt.save_counter.numpy()) == 1
    with pytest.raises(InvalidArgumentError):
        Checkpoint(root=42)


def test_kwargs_sorted_and_save_counter_last(tmp_path: Path) -> None:
    ckpt = Checkpoint(zeta=Variable(1.0), alpha=Variable(2.0), mid=Module())
    path = ckpt.save(str(tmp_path / "k"))
    assert children(read_graph(path)) == ["alpha", "mid", "zeta", "save_counter"]
    with pytest.raises(InvalidArgumentError, match="expecting x to be a trackable object"):
        Checkpoint(x=3)
    with pytest.raises(InvalidArgumentError, match="save_counter"):
        Checkpoint(save_counter=Variable(0))


@pytest.mark.parametrize("failure", [Boom, FailWhileWriting])
def test_failed_save_does_not_consume_a_number(tmp_path: Path, failure: type) -> None:
    ckpt = Checkpoint(v=Variable(np.ones(3)))
    prefix = str(tmp_path / "ck")
    with pytest.raises((RuntimeError, OSError, ShardckptError)):
        ckpt.save(prefix, options=CheckpointOptions(sharding_callback=failure()))
    assert int(ckpt.save_counter.numpy()) == 0
    assert files(tmp_path) == []  # no files, no temp folder, no state file
    assert ckpt.save(prefix) == prefix + "-1"
    assert int(stored(prefix + "-1", COUNTER_KEY)) == 1
    with pytest.raises((RuntimeError, OSError, ShardckptError)):
        ckpt.save(prefix, options=CheckpointOptions(sharding_callback=failure()))
    assert int(ckpt.save_counter.numpy()) == 1
    assert files(tmp_path) == ["checkpoint", "ck-1.data-00000-of-00001", "ck-1.index"]
    assert latest_checkpoint(str(tmp_path)) == prefix + "-1"
    assert ckpt.save(prefix) == prefix + "-2"


def test_write_callbacks_run_after_commit_in_order(tmp_path: Path) -> None:
    seen: List[Any] = []

    def with_path(path: str) -> str:
        state = get_checkpoint_state(str(tmp_path))
        seen.append(("one", path, os.path.exists(path + ".index"), state and state.model_checkpoint_path))
        return "ignored"

    def without_args() -> None:
        seen.append(("zero", latest_checkpoint(str(tmp_path))))

    options = CheckpointOptions(write_callbacks=[with_path, without_args])
    ckpt = Checkpoint(v=Variable(1.0))
    p1 = ckpt.save(str(tmp_path / "ck"), options=options)
    # save(): committed and the state file already names the new checkpoint
    assert seen == [("one", p1, True, p1), ("zero", p1)]
    seen.clear()
    p2 = ckpt.write(str(tmp_path / "plain"), options=options)
    # write(): committed; the state file is untouched (still names ck-1)
    assert seen == [("one", p2, True, p1), ("zero", p1)]
    # TF's experimental_ spelling; callbacks with two required arguments are refused
    assert CheckpointOptions(experimental_write_callbacks=[without_args]).write_callbacks == [without_args]
    with pytest.raises(InvalidArgumentError):
        CheckpointOptions(write_callbacks=[lambda a, b: None])


def test_max_shard_size_policy_slices_and_restores(tmp_path: Path) -> None:
    m = Module()
    m.big = Variable(np.arange(1000, dtype=np.float32).reshape(100, 10), name="big")
    m.small = Variable(np.arange(5, dtype=np.int32), name="small")
    options = CheckpointOptions(sharding_callback=MaxShardSizePolicy(1000))
    ckpt = Checkpoint(model=m)
    path = ckpt.save(str(tmp_path / "ck"), options=options)
    with BundleReader(Location.of(path)) as reader:
        assert reader.num_shards > 1
        big = reader.entry(vkey("model/big"))
        assert len(big.slices) > 1  # stored as slices
        assert [d.size for d in big.shape.dim] == [100, 10]
        assert len({p.entry.shard_id for p in reader.pieces(vkey("model/big"))}) > 1
    target = Module()
    target.big = Variable(np.zeros((100, 10), np.float32))
    target.small = Variable(np.zeros(5, np.int32))
    live = target.big.array
    Checkpoint(model=target).restore(path).assert_consumed()
    assert target.big.array is live
    assert np.array_equal(live, m.big.numpy()) and target.small.numpy().tolist() == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------
# restore matching
# ---------------------------------------------------------------------------

def _rich_source(tmp_path: Path) -> str:
    m = Module()
    m.child = Module()
    m.child.w = Variable(np.array([1.0, 2.0]))
    m.v = Variable(np.float32(3.0))
    m.lst = [Variable(10.0), Variable(11.0)]
    m.dct = {"k": Variable(np.int64(12))}
    return Checkpoint(model=m).save(str(tmp_path / "rich"))


def test_deferred_restoration_on_attach(tmp_path: Path) -> None:
    path = _rich_source(tmp_path)
    m = Module()
    ckpt = Checkpoint(model=m)
    status = ckpt.restore(path)  # nothing exists yet below 'model'
    with pytest.raises(AssertionError):
        status.assert_consumed()
    status.assert_existing_objects_matched()  # everything that exists got its value

    m.v = Variable(np.float32(0.0))
    assert float(m.v.numpy()) == 3.0  # restored when attached
    child = Module()
    child.w = Variable(np.zeros(2))
    m.child = child  # a whole subtree
    assert child.w.numpy().tolist() == [1.0, 2.0]
    m.lst = []
    m.lst.append(Variable(0.0))
    assert float(m.lst[0].numpy()) == 10.0  # list element restored on append
    m.lst.append(Variable(0.0))
    assert float(m.lst[1].numpy()) == 11.0
    m.dct = {}
    m.dct["k"] = Variable(np.int64(0))
    assert int(m.dct["k"].numpy()) == 12  # dict entry restored on setitem
    status.assert_consumed()


def test_deferred_restoration_on_list_iadd(tmp_path: Path) -> None:
    """``lst += [...]`` extends the list (TF's ListWrapper.__iadd__ is extend -> append):
    its elements are tracked and restored on attach like appended ones."""
    path = _rich_source(tmp_path)
    m = Module()
    status = Checkpoint(model=m).restore(path)
    m.lst = []
    m.lst += [Variable(0.0), Variable(0.0)]
    assert [float(v.numpy()) for v in m.lst] == [10.0, 11.0]
    status.expect_partial()


def test_deferred_restoration_of_nested_module_built_after_attach(tmp_path: Path) -> None:
    path = _rich_source(tmp_path)
    m = Module()
    status = Checkpoint(model=m).restore(path)
    m.child = Module()  # attached empty; its variable comes later
    m.child.w = Variable(np.zeros(2))
    assert m.child.w.numpy().tolist() == [1.0, 2.0]
    status.expect_partial()


def test_deferred_restoration_survives_dropping_the_status(tmp_path: Path) -> None:
    """``ckpt.restore(path)`` with the status discarded (the common TF idiom, e.g. before a
    Keras model is built) must still restore objects attached later: TF's deferred
    dependencies hold the restore coordinator strongly."""
    path = _rich_source(tmp_path)
    m = Module()
    ckpt = Checkpoint(model=m)
    ckpt.restore(path).expect_partial()  # status not kept
    gc.collect()
    m.v = Variable(np.float32(0.0))
    assert float(m.v.numpy()) == 3.0


def test_deferred_slot_restoration_via_add_slot(tmp_path: Path) -> None:
    v = Variable(np.ones(3, np.float32), name="v")
    opt = Adam()
    opt.make_slots(v, 4.0)
    path = Checkpoint(opt=opt, v=v).save(str(tmp_path / "s"))

    tv = Variable(np.zeros(3, np.float32), name="v")
    topt = Adam()
    status = Checkpoint(opt=topt, v=tv).restore(path)
    assert tv.numpy().tolist() == [1.0] * 3
    with pytest.raises(AssertionError, match="OPTIMIZER_SLOT"):
        status.assert_consumed()
    slot = topt.add_slot(tv, "m")  # created (zeros) -> filled from the checkpoint
    assert slot.numpy().tolist() == [4.0] * 3
    assert topt.add_slot(tv, "v", np.zeros(3, np.float32)).numpy().tolist() == [5.0] * 3
    status.assert_consumed()


def test_deferred_slot_restoration_when_variable_attached_after_optimizer(tmp_path: Path) -> None:
    """TF keys pending slot restorations by the variable's node: when the variable is bound
    later than the optimizer, slots created afterwards still get their values."""
    v = Variable(np.ones(2, np.float32), name="v")
    opt = Adam()
    opt.make_slots(v, 4.0)
    path = Checkpoint(opt=opt, v=v).save(str(tmp_path / "s"))

    topt = Adam()
    ckpt = Checkpoint(opt=topt)
    status = ckpt.restore(path)
    tv = Variable(np.zeros(2, np.float32), name="v")
    ckpt.v = tv  # deferred: the variable arrives after the optimizer was matched
    assert tv.numpy().tolist() == [1.0, 1.0]
    assert topt.add_slot(tv, "m").numpy().tolist() == [4.0, 4.0]
    status.expect_partial()


def test_assert_consumed_semantics(tmp_path: Path) -> None:
    src = Checkpoint(a=Variable(1.0), b=Variable(2.0))
    path = src.write(str(tmp_path / "ab"))

    exact = Checkpoint(a=Variable(0.0), b=Variable(0.0)).read(path)
    assert isinstance(exact, CheckpointLoadStatus)
    assert exact.assert_consumed() is exact
    exact.assert_existing_objects_matched().assert_nontrivial_match()

    # checkpoint has a value nothing matches: consumed fails, existing objects are fine
    partial = Checkpoint(a=Variable(0.0)).read(path)
    with pytest.raises(AssertionError, match=r"'b/\.ATTRIBUTES/VARIABLE_VALUE'"):
        partial.assert_consumed()
    partial.assert_existing_objects_matched()
    partial.assert_nontrivial_match()
    partial.expect_partial()

    # a live object the checkpoint lacks: both consumed and existing-objects fail
    extra = Checkpoint(a=Variable(0.0), b=Variable(0.0), c=Variable(0.0)).read(path)
    with pytest.raises(AssertionError, match="'c/"):
        extra.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="'c/"):
        extra.assert_consumed()
    extra.assert_nontrivial_match()

    # nothing but the root matched
    disjoint = Checkpoint(x=Variable(0.0), y=Variable(0.0)).read(path)
    with pytest.raises(AssertionError):
        disjoint.assert_nontrivial_match()
    with pytest.raises(AssertionError):
        disjoint.assert_existing_objects_matched()
    disjoint.expect_partial()


def test_variable_names_do_not_matter_paths_do(tmp_path: Path) -> None:
    path = Checkpoint(a=Variable(1.0, name="one")).write(str(tmp_path / "n"))
    renamed = Variable(0.0, name="completely different")
    Checkpoint(a=renamed).read(path).assert_consumed()
    assert float(renamed.numpy()) == 1.0
    moved = Variable(0.0, name="one")
    status = Checkpoint(b=moved).read(path)
    assert float(moved.numpy()) == 0.0
    with pytest.raises(AssertionError):
        status.assert_nontrivial_match()
    status.expect_partial()


def test_unmatched_warning_logged_once_and_silenced_by_expect_partial(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    src = Checkpoint(**{name: Variable(float(i)) for i, name in enumerate("abcdefg")})
    path = src.write(str(tmp_path / "many"))

    gc.collect()  # statuses left in cycles by earlier tests warn now, not below

    def ours() -> List[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno >= logging.WARNING and path in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        status = Checkpoint(a=Variable(0.0)).read(path)
        del status
        gc.collect()
    warnings = ours()
    assert len(warnings) == 1  # one warning for six unmatched values, not one per value
    text = warnings[0].getMessage()
    assert "6 value(s)" in text and vkey("b") in text and path in text and "expect_partial" in text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        status = Checkpoint(a=Variable(0.0)).read(path).expect_partial()
        del status
        gc.collect()
        full = Checkpoint(**{name: Variable(0.0) for name in "abcdefg"}).read(path)
        del full  # everything matched: nothing to warn about
        gc.collect()
    assert not ours()


def test_skip_slot_variables(tmp_path: Path) -> None:
    v = Variable(np.ones(2, np.float32), name="v")
    opt = Adam()
    opt.make_slots(v, 4.0)
    options = CheckpointOptions(skip_slot_variables=True)
    assert CheckpointOptions(experimental_skip_slot_variables=True).skip_slot_variables
    path = Checkpoint(opt=opt, v=v).save(str(tmp_path / "s"), options=options)
    assert vkey("v/.OPTIMIZER_SLOT/opt/m") in stored_keys(path)  # saving still writes slots

    tv = Variable(np.zeros(2, np.float32), name="v")
    topt = Adam()
    status = Checkpoint(opt=topt, v=tv).restore(path, options=options)
    assert tv.numpy().tolist() == [1.0, 1.0]
    status.assert_consumed()  # slot nodes are left out
    assert topt.add_slot(tv, "m").numpy().tolist() == [0.0, 0.0]  # and not restored later


def test_skip_slot_variables_ignores_existing_live_slots(tmp_path: Path) -> None:
    """TF lists live objects without their slot variables when skipping them
    (``list_objects(..., skip_slot_variables)``), so existing slots do not fail the asserts."""
    v = Variable(np.ones(2, np.float32), name="v")
    opt = Adam()
    opt.make_slots(v, 4.0)
    path = Checkpoint(opt=opt, v=v).save(str(tmp_path / "s"))
    tv = Variable(np.zeros(2, np.float32), name="v")
    topt = Adam()
    topt.make_slots(tv, 0.0)
    status = Checkpoint(opt=topt, v=tv).restore(path, options=CheckpointOptions(skip_slot_variables=True))
    assert topt.get_slot(tv, "m").numpy().tolist() == [0.0, 0.0]
    status.assert_existing_objects_matched()
    status.assert_consumed()


# ---------------------------------------------------------------------------
# errors: clear, naming the file/key, and nothing changed
# ---------------------------------------------------------------------------

def _target_tree() -> Checkpoint:
    model = small_model(scale=0.0)
    model.extra = Variable(np.full(4, -1.0))
    model.arr = np.full(3, -2.0)
    opt = Adam()
    opt.make_slots(model.dense.kernel, -3.0)
    return Checkpoint(model=model, opt=opt)


def _source_path(tmp_path: Path) -> str:
    model = small_model()
    model.extra = Variable(np.arange(4.0))
    model.arr = np.arange(3.0)
    opt = Adam()
    opt.make_slots(model.dense.kernel, 9.0)
    return Checkpoint(model=model, opt=opt).save(str(tmp_path / "src" / "ck"))


def _expect_failed_restore(target: Checkpoint, path: str, error: type, *needles: str) -> ShardckptError:
    before = snapshot(target.model, target.opt)
    with pytest.raises(error) as info:
        target.restore(path)
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    assert isinstance(info.value, ShardckptError)
    assert_unchanged(before, snapshot(target.model, target.opt))
    return info.value


def test_wrong_shape_is_a_clear_error_and_changes_nothing(tmp_path: Path) -> None:
    path = _source_path(tmp_path)
    target = _target_tree()
    target.model.extra = Variable(np.full(5, -1.0))  # saved with 4 elements; last in BFS order
    err = _expect_failed_restore(target, path, InvalidArgumentError, path, vkey("model/extra"), "[4]", "[5]")
    assert err.key == vkey("model/extra")


def test_wrong_dtype_is_a_clear_error_and_changes_nothing(tmp_path: Path) -> None:
    path = _source_path(tmp_path)
    target = _target_tree()
    target.model.step = Variable(np.int32(0))  # saved as int64
    _expect_failed_restore(target, path, InvalidArgumentError, path, vkey("model/step"), "int64", "int32")


def test_missing_checkpoint_is_not_found(tmp_path: Path) -> None:
    target = _target_tree()
    before = snapshot(target.model, target.opt)
    with pytest.raises(NotFoundError, match="nope"):
        target.restore(str(tmp_path / "nope-1"))
    with pytest.raises(DataLossError) as info:
        target.read(str(tmp_path))  # a directory (TF: "Unable to open table file ...: Is a directory")
    assert str(tmp_path) in str(info.value)
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "gone-3"\n')
    with pytest.raises(NotFoundError):
        target.restore(shardckpt.latest_checkpoint(str(tmp_path)) or str(tmp_path / "gone-3"))
    assert_unchanged(before, snapshot(target.model, target.opt))
    assert isinstance(NotFoundError("x"), FileNotFoundError)


def test_object_graph_referencing_a_missing_key(tmp_path: Path) -> None:
    path = _source_path(tmp_path)
    missing = vkey("model/dense/bias").encode()
    index = Path(path + ".index")
    pairs = [(k, v) for k, v in read_table(index.read_bytes()) if k != missing]
    table = TableWriter()
    for k, v in pairs:
        table.add(k, v)
    index.write_bytes(table.finish())
    assert missing.decode() not in stored_keys(path)
    _expect_failed_restore(_target_tree(), path, NotFoundError, path, missing.decode())


def _rewrite_graph(path: str, out: str, graph_bytes: bytes) -> None:
    """Write ``out`` with every tensor of ``path`` except the object graph, plus ``graph_bytes``."""
    with BundleReader(Location.of(path)) as reader:
        names = [k.decode() for k in reader.keys() if k.decode() != GRAPH_KEY]
        values = [reader.read(k) for k in names]
    io.save_v2(out, names + [GRAPH_KEY], [""] * (len(names) + 1),
               values + [np.array(graph_bytes, dtype=object)])


def test_corrupt_object_graph(tmp_path: Path) -> None:
    path = _source_path(tmp_path)
    bad = str(tmp_path / "bad")
    _rewrite_graph(path, bad, b"\xff\xff\xff\xff garbage \x07\x00")
    err = _expect_failed_restore(_target_tree(), bad, CorruptIndexError, bad, GRAPH_KEY)
    assert "object graph" in str(err)
    # a non-scalar object graph
    with BundleReader(Location.of(path)) as reader:
        names = [k.decode() for k in reader.keys() if k.decode() != GRAPH_KEY]
        values = [reader.read(k) for k in names]
        graph = reader.read(GRAPH_KEY).item()
    vec = str(tmp_path / "vec")
    io.save_v2(vec, names + [GRAPH_KEY], [""] * (len(names) + 1),
               values + [np.array([graph, graph], dtype=object)])
    _expect_failed_restore(_target_tree(), vec, CorruptIndexError, vec, GRAPH_KEY)


@pytest.mark.parametrize("where", ["child", "slot_variable", "original_variable"])
def test_object_graph_with_node_id_out_of_range(tmp_path: Path, where: str) -> None:
    path = _source_path(tmp_path)
    graph = read_graph(path)
    n = len(graph.nodes)
    if where == "child":
        graph.nodes[child_id(graph, 0, "model")].children[1].node_id = n + 5
    else:
        opt = graph.nodes[child_id(graph, 0, "opt")]
        ref = opt.slot_variables[0]
        if where == "slot_variable":
            ref.slot_variable_node_id = n
        else:
            ref.original_variable_node_id = -1
    bad = str(tmp_path / "oob")
    _rewrite_graph(path, bad, graph.SerializeToString())
    _expect_failed_restore(_target_tree(), bad, CorruptIndexError, bad, GRAPH_KEY, "node")


def test_failed_restore_leaves_nothing_pending(tmp_path: Path) -> None:
    """After a failed restore, attaching a missing child later must not restore from it."""
    path = _source_path(tmp_path)
    target = _target_tree()
    target.model.step = Variable(np.int32(0))  # wrong dtype: the restore fails
    del target.model.extra
    with pytest.raises(InvalidArgumentError):
        target.restore(path)
    target.model.extra = Variable(np.full(4, -1.0))
    assert target.model.extra.numpy().tolist() == [-1.0] * 4


# ---------------------------------------------------------------------------
# registered savers
# ---------------------------------------------------------------------------

class Special(Trackable):
    """A trackable saved by a registered saver (no attributes of its own)."""

    def __init__(self, value: Any) -> None:
        self.value = np.asarray(value, dtype=np.float32)


def _register(kind: type, calls: List[Any], fail: bool = False) -> str:
    package, name = "Test", "S" + uuid4().hex[:12]

    def save_fn(trackables: Dict[str, Any], file_prefix: str) -> List[str]:
        calls.append(("save", dict(trackables), file_prefix))
        if fail:
            # write something first, so that a cleanup must remove it
            io.save_v2(file_prefix, ["junk"], [""], [np.zeros(1)])
            raise RuntimeError("registered save failed")
        names = [f"{path}/special" for path in trackables]
        io.save_v2(file_prefix, names, [""] * len(names), [t.value for t in trackables.values()])
        return [file_prefix]

    def restore_fn(trackables: Dict[str, Any], merged_prefix: str) -> None:
        calls.append(("restore", dict(trackables), merged_prefix))
        for path, obj in trackables.items():
            obj.value[...] = io.restore_v2(merged_prefix, [f"{path}/special"], [""], ["float32"])[0]

    register_checkpoint_saver(package, name, predicate=lambda x: isinstance(x, kind),
                              save_fn=save_fn, restore_fn=restore_fn)
    return f"{package}.{name}"


def test_registered_saver_save_and_restore(tmp_path: Path) -> None:
    class Mine(Special):
        pass

    calls: List[Any] = []
    full_name = _register(Mine, calls)
    s = Mine([1.0, 2.0])
    m = Module()
    m.s2 = Mine([3.0])
    ckpt = Checkpoint(s=s, model=m, v=Variable(5.0))
    path = ckpt.save(str(tmp_path / "ck"))

    assert len(calls) == 1 and calls[0][0] == "save"
    assert calls[0][1] == {"s": s, "model/s2": m.s2}  # one call with every object, by path
    graph = read_graph(path)
    for node_id in (child_id(graph, 0, "s"), child_id(graph, child_id(graph, 0, "model"), "s2")):
        node = graph.nodes[node_id]
        assert node.registered_saver.name == full_name
        assert not node.attributes
        assert node.has_checkpoint_values.value
    assert graph.nodes[child_id(graph, 0, "s")].registered_saver.object_name == "s"
    with BundleReader(Location.of(path)) as reader:
        assert reader.num_shards == 2
        assert reader.entry("s/special").shard_id == 0  # merged first
        assert reader.entry("model/s2/special").shard_id == 0
        assert reader.entry(vkey("v")).shard_id == 1
        assert reader.entry(GRAPH_KEY).shard_id == 1
    assert files(tmp_path) == ["checkpoint", "ck-1.data-00000-of-00002", "ck-1.data-00001-of-00002",
                               "ck-1.index"]

    ts, tm = Mine([0.0, 0.0]), Module()
    tm.s2 = Mine([0.0])
    target = Checkpoint(s=ts, model=tm, v=Variable(0.0))
    target.restore(path).assert_consumed()
    restore_calls = [c for c in calls if c[0] == "restore"]
    assert len(restore_calls) == 1
    assert restore_calls[0][1] == {"s": ts, "model/s2": tm.s2} and restore_calls[0][2] == path
    assert ts.value.tolist() == [1.0, 2.0] and tm.s2.value.tolist() == [3.0]
    assert float(target.v.numpy()) == 5.0


def test_registered_saver_name_rules() -> None:
    with pytest.raises(InvalidArgumentError):
        register_checkpoint_saver("Pkg", "a.b", predicate=lambda x: False, save_fn=None, restore_fn=None)
    name = "N" + uuid4().hex[:10]
    register_checkpoint_saver("Pkg", name, predicate=lambda x: False, save_fn=None, restore_fn=None)
    with pytest.raises(shardckpt.errors.AlreadyExistsError):
        register_checkpoint_saver("Pkg", name, predicate=lambda x: False, save_fn=None, restore_fn=None)


def test_registered_saver_failure_leaves_no_checkpoint_and_no_temp_files(tmp_path: Path) -> None:
    class Failing(Special):
        pass

    calls: List[Any] = []
    _register(Failing, calls, fail=True)
    ckpt = Checkpoint(f=Failing([1.0]), v=Variable(1.0))
    with pytest.raises(RuntimeError, match="registered save failed"):
        ckpt.save(str(tmp_path / "ck"))
    assert calls and calls[0][0] == "save"
    assert files(tmp_path) == []  # no index, no data, no temp folder, no state file
    assert int(ckpt.save_counter.numpy()) == 0


# ---------------------------------------------------------------------------
# name-based (TF1 Saver) checkpoints
# ---------------------------------------------------------------------------

def _name_based(tmp_path: Path, extra: bool = False) -> str:
    prefix = str(tmp_path / "model.ckpt")
    names = ["layer/a", "b"] + (["global_step"] if extra else [])
    values = [np.arange(3, dtype=np.float32), np.int32(7)] + ([np.int64(100)] if extra else [])
    io.save_v2(prefix, names, [""] * len(names), values)
    return prefix


def test_name_based_restore_matches_by_variable_name(tmp_path: Path) -> None:
    prefix = _name_based(tmp_path)
    a = Variable(np.zeros(3, np.float32), name="layer/a:0")  # ':0' is ignored, as TF does
    b = Variable(np.int32(0), name="b")
    m = Module()
    m.some_other_path = a  # object paths do not matter, names do
    status = Checkpoint(model=m, bee=b).restore(prefix)
    assert isinstance(status, NameBasedSaverStatus)
    assert a.numpy().tolist() == [0.0, 1.0, 2.0] and int(b.numpy()) == 7
    status.assert_nontrivial_match()
    # save_counter is created by restore() but is optional (TF: add_to_optionally_restored)
    status.assert_existing_objects_matched()
    status.assert_consumed()


def test_name_based_assert_consumed_ignores_unused_checkpoint_values(tmp_path: Path) -> None:
    """TF's NameBasedSaverStatus.assert_consumed only checks that the Python objects were
    restored; checkpoint values no object asked for (``global_step``) are no error."""
    prefix = _name_based(tmp_path, extra=True)
    a = Variable(np.zeros(3, np.float32), name="layer/a")
    b = Variable(np.int32(0), name="b")
    status = Checkpoint(a=a, b=b).read(prefix)
    assert isinstance(status, NameBasedSaverStatus)
    status.assert_existing_objects_matched()
    status.assert_consumed()


def test_name_based_missing_variable_fails_the_asserts(tmp_path: Path) -> None:
    prefix = _name_based(tmp_path)
    a = Variable(np.zeros(3, np.float32), name="layer/a")
    c = Variable(np.zeros(2), name="c")
    status = Checkpoint(a=a, c=c).read(prefix)
    assert a.numpy().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(AssertionError, match="'c'"):
        status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="'c'"):
        status.assert_consumed()
    assert status.expect_partial() is status
    none = Checkpoint(c=Variable(np.zeros(2), name="c")).read(prefix)
    with pytest.raises(AssertionError):
        none.assert_nontrivial_match()


def test_name_based_wrong_shape_changes_nothing(tmp_path: Path) -> None:
    prefix = _name_based(tmp_path)
    b = Variable(np.int32(0), name="b")
    a = Variable(np.zeros(4, np.float32), name="layer/a")
    with pytest.raises(InvalidArgumentError, match="layer/a") as info:
        Checkpoint(b=b, z=a).read(prefix)
    assert prefix in str(info.value)
    assert int(b.numpy()) == 0 and a.numpy().tolist() == [0.0] * 4


# ---------------------------------------------------------------------------
# CheckpointManager
# ---------------------------------------------------------------------------

class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock(1_000_000.0)
    monkeypatch.setattr(manager_module, "time", SimpleNamespace(time=c.time))
    return c


def _exists(prefix: str) -> bool:
    return os.path.exists(prefix + ".index") and os.path.exists(prefix + ".data-00000-of-00001")


def test_manager_saves_deletes_and_records_state(tmp_path: Path, clock: Clock) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    assert manager.directory == str(tmp_path) and manager.checkpoint is ckpt
    paths = []
    for i in range(3):
        clock.now += 10
        ckpt.v.assign(float(i))
        paths.append(manager.save())
    assert paths == [str(tmp_path / f"ckpt-{n}") for n in (1, 2, 3)]
    assert not os.path.exists(paths[0] + ".index") and not os.path.exists(paths[0] + ".data-00000-of-00001")
    assert _exists(paths[1]) and _exists(paths[2])
    assert manager.checkpoints == paths[1:]
    assert manager.latest_checkpoint == paths[2] == latest_checkpoint(str(tmp_path))
    state = get_checkpoint_state(str(tmp_path))
    assert state.model_checkpoint_path == paths[2]
    assert list(state.all_model_checkpoint_paths) == paths[1:]
    assert list(state.all_model_checkpoint_timestamps) == [1_000_020.0, 1_000_030.0]
    assert 1_000_000.0 - 1 <= state.last_preserved_timestamp <= 1_000_000.0  # TF: creation time (- 1 s)
    text = (tmp_path / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-3"' in text  # relative paths, as TF writes them
    assert text.count("all_model_checkpoint_timestamps") == 2


def test_manager_deletes_only_after_the_new_checkpoint_committed(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=Variable(np.ones(2)))
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    first, second = manager.save(), manager.save()
    state_before = (tmp_path / "checkpoint").read_bytes()

    for failure in (Boom, FailWhileWriting):
        with pytest.raises((RuntimeError, OSError, ShardckptError)):
            manager.save(options=CheckpointOptions(sharding_callback=failure()))
        assert _exists(first) and _exists(second)  # nothing deleted
        assert (tmp_path / "checkpoint").read_bytes() == state_before
        assert manager.checkpoints == [first, second] and manager.latest_checkpoint == second
        assert int(ckpt.save_counter.numpy()) == 2
        assert sorted(files(tmp_path)) == sorted(["checkpoint"] + [os.path.basename(p) + s for p in (first, second)
                                                                  for s in (".index", ".data-00000-of-00001")])

    # during a successful save the oldest checkpoint survives until the commit
    observed: List[Any] = []

    class Watching(ShardingCallback):
        @property
        def description(self) -> str:
            return "watching"

        def __call__(self, shardable_tensors: Any) -> Any:
            observed.append(("during", _exists(first)))
            return ShardByTaskPolicy()(shardable_tensors)

    options = CheckpointOptions(sharding_callback=Watching(),
                                write_callbacks=[lambda p: observed.append(("after", _exists(first), p))])
    third = manager.save(options=options)
    assert third == str(tmp_path / "ckpt-3")
    assert observed == [("during", True), ("after", False, third)]
    assert manager.checkpoints == [second, third]


def test_manager_write_callbacks_see_the_updated_state(tmp_path: Path) -> None:
    seen: List[Any] = []
    ckpt = Checkpoint(v=Variable(1.0))
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=1)
    options = CheckpointOptions(write_callbacks=[
        lambda: seen.append(latest_checkpoint(str(tmp_path))),
        lambda path: seen.append(path)])
    p1 = manager.save(options=options)
    assert seen == [p1, p1]


def test_manager_keep_checkpoint_every_n_hours(tmp_path: Path, clock: Clock) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    clock.now = 1000.0
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=2, keep_checkpoint_every_n_hours=1)
    saves = {}
    for n, t in [(1, 1000.0 + 1.5 * 3600), (2, 6500.0), (3, 6600.0), (4, 6700.0)]:
        clock.now = t
        saves[n] = manager.save()
    # ckpt-1 was more than an hour after the last preserved time: kept on disk, no longer managed
    assert _exists(saves[1])
    assert not os.path.exists(saves[2] + ".index")  # within the hour: deleted
    assert _exists(saves[3]) and _exists(saves[4])
    assert manager.checkpoints == [saves[3], saves[4]]
    state = get_checkpoint_state(str(tmp_path))
    assert state.last_preserved_timestamp == 1000.0 + 1.5 * 3600
    assert list(state.all_model_checkpoint_paths) == [saves[3], saves[4]]


def test_manager_checkpoint_interval_and_step_counter(tmp_path: Path) -> None:
    step = Variable(np.int64(0))
    ckpt = Checkpoint(step=step)
    with pytest.raises(InvalidArgumentError):
        CheckpointManager(ckpt, str(tmp_path), 3, checkpoint_interval=5)  # needs a step counter
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=None, step_counter=step, checkpoint_interval=5)
    assert manager.checkpoint_interval == 5
    assert manager.save() == str(tmp_path / "ckpt-1")  # the first save always happens
    assert manager.save() is None  # same step
    step.assign(4)
    assert manager.save() is None  # 4 < 0 + 5
    assert manager.save(check_interval=False) == str(tmp_path / "ckpt-2")
    assert manager.save(check_interval=False) is None  # same step even without the interval check
    step.assign(8)
    assert manager.save() is None  # 8 < 4 + 5
    step.assign(9)
    assert manager.save() == str(tmp_path / "ckpt-3")
    assert int(ckpt.save_counter.numpy()) == 3  # skipped saves do not count


def test_manager_checkpoint_number(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=None)
    assert manager.save(checkpoint_number=100) == str(tmp_path / "ckpt-100")
    assert int(ckpt.save_counter.numpy()) == 1  # still incremented
    assert int(stored(str(tmp_path / "ckpt-100"), COUNTER_KEY)) == 1
    assert manager.save(checkpoint_number=Variable(np.int64(200))) == str(tmp_path / "ckpt-200")
    assert manager.save() == str(tmp_path / "ckpt-3")
    named = CheckpointManager(Checkpoint(v=Variable(1.0)), str(tmp_path / "other"), 5, checkpoint_name="model")
    assert named.save() == str(tmp_path / "other" / "model-1")


def test_manager_continues_after_checkpoint_save(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    ckpt.save(str(tmp_path / "ckpt"))
    ckpt.save(str(tmp_path / "ckpt"))
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=5)
    assert manager.save() == str(tmp_path / "ckpt-3")


def test_manager_restore_or_initialize(tmp_path: Path) -> None:
    initialized: List[int] = []
    v = Variable(np.arange(3.0))
    ckpt = Checkpoint(v=v)
    manager = CheckpointManager(ckpt, str(tmp_path), 5, init_fn=lambda: initialized.append(1))
    assert manager.restore_or_initialize() is None
    assert initialized == [1]
    manager.save()
    saved = manager.save()

    tv = Variable(np.zeros(3))
    tckpt = Checkpoint(v=tv)
    again = CheckpointManager(tckpt, str(tmp_path), 5, init_fn=lambda: initialized.append(2))
    assert again.restore_or_initialize() == saved
    assert initialized == [1]  # init_fn not run when restoring
    assert tv.numpy().tolist() == [0.0, 1.0, 2.0]
    assert int(tckpt.save_counter.numpy()) == 2
    assert again.save() == str(tmp_path / "ckpt-3")


def test_new_manager_recovers_the_list(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    first = CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
    paths = [first.save() for _ in range(3)]
    second = CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
    assert second.checkpoints == paths
    assert second.latest_checkpoint == paths[-1]
    p4 = second.save()  # the counter lives in the checkpoint object: continues at 4
    assert p4 == str(tmp_path / "ckpt-4")
    assert not os.path.exists(paths[0] + ".index")  # the recovered list is managed
    assert second.checkpoints == paths[1:] + [p4]


def test_manager_does_not_manage_checkpoints_without_timestamps(tmp_path: Path, clock: Clock) -> None:
    """TF recovers only paths whose timestamp is newer than ``last_preserved_timestamp``. A
    state file written by ``Checkpoint.save`` (no timestamps, no last_preserved_timestamp)
    gives an empty ``checkpoints`` list, so the manager never deletes those files."""
    ckpt = Checkpoint(v=Variable(1.0))
    ckpt.save(str(tmp_path / "ckpt"))
    older = ckpt.save(str(tmp_path / "ckpt"))
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=1)
    assert manager.latest_checkpoint == older
    assert manager.checkpoints == []
    clock.now += 1
    manager.save()
    clock.now += 1
    manager.save()
    assert _exists(older)  # not managed, never deleted


def test_manager_max_to_keep_none_keeps_all_and_zero_is_rejected(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=Variable(1.0))
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=None)
    paths = [manager.save() for _ in range(4)]
    assert all(_exists(p) for p in paths)
    assert manager.checkpoints == paths
    assert list(get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths) == paths
    for bad in (0, -1):
        with pytest.raises(InvalidArgumentError, match="max_to_keep"):
            CheckpointManager(ckpt, str(tmp_path / "x"), max_to_keep=bad)
    assert isinstance(InvalidArgumentError("x"), ValueError)


# -- TF's habits (issue 15) -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, dtype", [(1.0, "float32"), (3, "int32"), (True, "bool"), ("s", "string"),
                                          ([1.0, 2.0], "float32"), ([[1, 2], [3, 4]], "int32"), ([1, 2.0], "float32"),
                                          (2**31, "int64"), ([1, 2**40], "int64"), (1j, "complex128"),
                                          (np.float64(1.0), "float64"), (np.int64(3), "int64"),
                                          (np.zeros(2, np.int16), "int16")])
def test_variable_takes_tfs_dtype_for_python_values(value: Any, dtype: str) -> None:
    assert Variable(value).dtype.name == dtype


def test_variable_rejects_ints_outside_int64() -> None:
    with pytest.raises(ValueError, match="out-of-range"):
        Variable(2**63)


def test_manager_sync_and_last_checkpoint_step(tmp_path: Path) -> None:
    step = Variable(np.int64(12))
    manager = CheckpointManager(Checkpoint(step=step), str(tmp_path), 2, step_counter=step, checkpoint_interval=5,
                                last_checkpoint_step=10)
    assert manager.last_checkpoint_step == 10 and manager.save() is None
    step.assign(15)
    assert manager.save() is not None and manager.last_checkpoint_step == 15
    assert manager.sync() is None
    with pytest.raises(TypeError):
        CheckpointManager(Checkpoint(), str(tmp_path / "x"))  # type: ignore[call-arg]  # max_to_keep is required


def test_reader_returns_scalars_as_numpy_scalars(tmp_path: Path) -> None:
    path = Checkpoint(f=Variable(1.5), s=Variable("text"), v=Variable([1, 2])).save(str(tmp_path / "c"))
    reader = shardckpt.load_checkpoint(path)
    f = reader.get_tensor("f/.ATTRIBUTES/VARIABLE_VALUE")
    assert type(f) is np.float32 and f == 1.5
    assert reader.get_tensor("s/.ATTRIBUTES/VARIABLE_VALUE") == b"text"
    assert type(reader.get_tensor("save_counter/.ATTRIBUTES/VARIABLE_VALUE")) is np.int64
    assert isinstance(reader.get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE"), np.ndarray)
    assert shardckpt.load_variable(path, "f/.ATTRIBUTES/VARIABLE_VALUE:0") == np.float32(1.5)
