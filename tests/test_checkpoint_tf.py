"""Object-based checkpoints against real TensorFlow 2.21 (issue "object-based checkpoints", must-shows 1-3).

1. TensorFlow restores what shardckpt saves: a nested ``Module`` tree (list, nested dict,
   shared variables, plain arrays, six dtypes), optimizer slots and non-slot variables
   (TF1 Adam layout) and ``save_counter``, restored by ``tf.train.Checkpoint`` into an
   equivalent ``tf.Module`` tree and ``tf.compat.v1.train.AdamOptimizer``.
2. shardckpt restores what TensorFlow saves: fixtures 04 (nested graph, ``save``), 05 (v1
   Adam slots, restore-on-create), 08 (TF1 ``Saver``, by name) and a SavedModel.
3. ``CheckpointManager`` parity: the same sequences run by ``tf.train.CheckpointManager``
   and ours in sibling directories, and each library continuing the other's directory.

TF facts these tests rely on (verified against TF 2.21 while writing them):

* ``AdamOptimizer._create_slots(var_list)`` after ``Checkpoint.restore`` fills ``beta1_power``,
  ``beta2_power`` and the m/v slots from the checkpoint (restore-on-create), without changing
  any value. TF's zeros slot of a string variable is ``b""``, of a bool one ``False``.
* ``tf.train.Checkpoint(root=m, extra=v)`` records a child ``root`` of node 0 pointing at node
  0 itself; shardckpt does not (it creates no key, and restore ignores it either way).
* ``tf.train.Checkpoint.restore`` accepts a SavedModel directory but not a checkpoint
  directory; ``read`` accepts neither. A SavedModel's object graph has extra nodes without
  values (the ``tf.function``, its trace, ``signatures``). TF's ``restore(sm_dir)`` then fails
  both ``assert_existing_objects_matched`` and ``assert_consumed``, because they count the
  ``save_counter`` that ``restore`` creates (``read`` of ``variables/variables`` passes);
  shardckpt ignores a ``save_counter`` the checkpoint does not hold (intentional difference).
* TF's ``NameBasedSaverStatus`` treats ``save_counter`` as optional, and its
  ``assert_consumed`` does not require every checkpoint key to be used (shardckpt's does:
  stricter, not tested here).
* With ``experimental_skip_slot_variables`` TF leaves the slots at their initial values and
  both ``assert_existing_objects_matched`` and ``assert_consumed`` pass.
* ``CheckpointManager``: a fresh manager's ``last_preserved_timestamp`` is its construction time
  minus 1 s; a state file without timestamps and without ``last_preserved_timestamp`` (as
  ``Checkpoint.save`` writes) leaves the listed checkpoints unmanaged: never deleted, not in
  ``manager.checkpoints``.

Known, intentional differences (not required here): shardckpt updates the state file before
the user's write callbacks and deletes old checkpoints after writing it (TF: callbacks, then
state, sweep, state again); a prefix saved again gets a different data-file count (padding,
see test_saving.py), so file lists are compared per prefix, not per data-file name.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import ml_dtypes
import numpy as np
import pytest
from google.protobuf import text_format
from tf_oracle.tensorfile import read_tensors

import shardckpt
from shardckpt import CheckpointOptions, Module, Optimizer, Variable
from shardckpt.checkpoint.graph import OBJECT_GRAPH_KEY
from shardckpt.format.protos.checkpoint_state_pb2 import CheckpointState
from shardckpt.format.protos.trackable_object_graph_pb2 import TrackableObjectGraph

BF16 = ml_dtypes.bfloat16


def tf_run(tf_oracle: Any, code: str, **params: Any) -> Any:
    """Run ``code`` in the TF oracle with ``P`` bound to ``params`` (passed as JSON)."""
    return tf_oracle.exec(f"P = json.loads({json.dumps(params)!r})\n{code}")


def _array(value: object) -> np.ndarray:
    """A reader's value as an array: scalars come back as NumPy scalars and ``bytes``, as from TF's reader."""
    if isinstance(value, bytes):
        out = np.empty((), dtype=object)
        out[()] = value
        return out
    return np.asarray(value)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got, want = _array(got), _array(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.dtype == object:
        assert got.dtype == object, f"{what}: dtype {got.dtype} != string"
        assert [bytes(x) for x in got.ravel()] == [bytes(x) for x in want.ravel()], what
    else:
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
        assert got.tobytes() == want.tobytes(), f"{what}: {got!r} != {want!r}"


def graph_of(prefix: str) -> TrackableObjectGraph:
    proto = TrackableObjectGraph()
    proto.ParseFromString(shardckpt.load_variable(prefix, OBJECT_GRAPH_KEY))  # a scalar string: bytes
    return proto


def graph_shape(proto: TrackableObjectGraph) -> List[Any]:
    """The graph without ``full_name`` (variable names are free to differ)."""
    return [([(c.local_name, c.node_id) for c in n.children],
             [(a.name, a.checkpoint_key) for a in n.attributes],
             [(s.original_variable_node_id, s.slot_name, s.slot_variable_node_id) for s in n.slot_variables],
             n.has_checkpoint_values.value)
            for n in proto.nodes]


# ---------------------------------------------------------------------------------------------
# 1. TensorFlow restores what shardckpt saves
# ---------------------------------------------------------------------------------------------

class V1Adam(Optimizer):
    """Slots m and v per variable, non-slot beta1_power / beta2_power: the TF1 Adam layout."""

    def __init__(self) -> None:
        super().__init__()
        self.beta1_power = Variable(np.float32(0.9) ** 3, name="beta1_power")
        self.beta2_power = Variable(np.float32(0.999) ** 3, name="beta2_power")


def _values(rng: np.random.Generator, generation: int) -> Dict[str, np.ndarray]:
    """Logical name -> value; every value depends on ``generation``."""
    g = generation
    return {
        "encoder.kernel": rng.standard_normal((3, 4)).astype(np.float32),
        "encoder.bias": np.array([1.0 / 3 + g, -0.0, np.inf, 5e-324], np.float64),
        "layers.0.w": np.array([[np.iinfo(np.int64).min, -1, 0], [1, g, np.iinfo(np.int64).max]], np.int64),
        "layers.1.w": np.array([1.5 + g, -0.0, np.inf, -np.inf, 3.0e38], BF16),
        "layers.2.w": rng.standard_normal((2,)).astype(np.float32),
        "config.flags": np.array([[True, False, bool(g % 2)]]),
        "config.nested.names": np.array([b"gen%d" % g, b"", b"\x00\xff\xfe", "\u00e9t\u00e9".encode()], object),
        "config.nested.scale": np.array(0.25 * (g + 1), np.float32),
        "plain": np.array([7, -8, 9 + g], np.int32),
        "config.nested.table": np.arange(6, dtype=np.float64).reshape(2, 3) * (g + 1),
    }


_VARIABLE_NAMES = ["encoder.kernel", "encoder.bias", "layers.0.w", "layers.1.w", "layers.2.w", "config.flags",
                   "config.nested.names", "config.nested.scale"]


def _build_tree(vals: Dict[str, np.ndarray]) -> Dict[str, Any]:
    m = Module()
    m.encoder = Module()
    m.encoder.kernel = Variable(vals["encoder.kernel"], name="encoder/kernel")
    m.encoder.bias = Variable(vals["encoder.bias"], name="encoder/bias")
    m.layers = [Module(), Module()]
    m.layers[0].w = Variable(vals["layers.0.w"], name="l0")
    m.layers[1].w = Variable(vals["layers.1.w"], name="l1")
    m.layers.append(Module())  # added after the list was assigned
    m.layers[2].w = Variable(vals["layers.2.w"], name="l2")
    m.head = Module()
    m.head.tied = m.encoder.kernel  # same depth as encoder/kernel: the first BFS path wins
    m.config = {"flags": Variable(vals["config.flags"]),
                "nested": {"names": [Variable(vals["config.nested.names"], name="names")],
                           "scale": Variable(vals["config.nested.scale"])}}
    m.config["alias"] = m.layers[0].w  # shorter than model/layers/0/w
    m.plain = vals["plain"].copy()  # a plain numpy array
    m.config["nested"]["table"] = vals["config.nested.table"].copy()
    variables = {
        "encoder.kernel": m.encoder.kernel, "encoder.bias": m.encoder.bias, "layers.0.w": m.layers[0].w,
        "layers.1.w": m.layers[1].w, "layers.2.w": m.layers[2].w, "config.flags": m.config["flags"],
        "config.nested.names": m.config["nested"]["names"][0], "config.nested.scale": m.config["nested"]["scale"],
    }
    assert {id(v) for v in m.variables} == {id(v) for v in variables.values()}
    opt = V1Adam()
    for var in variables.values():
        base = var.numpy()
        if base.dtype == object:
            opt.add_slot(var, "m", np.array([b"m:" + bytes(x) for x in base.ravel()], object).reshape(base.shape))
            opt.add_slot(var, "v", np.full(base.shape, b"", object))  # see test_string_slot_default_zeros
        elif base.dtype == bool:
            opt.add_slot(var, "m", ~base)
            opt.add_slot(var, "v")
        else:
            opt.add_slot(var, "m", (base.astype(np.float64) / 2 + 1).astype(base.dtype) if base.dtype != np.int64
                         else base // 2 + 1)
            opt.add_slot(var, "v")
    return {"model": m, "opt": opt, "variables": variables}


def _snapshot(tree: Dict[str, Any], ckpt: shardckpt.Checkpoint) -> Dict[str, np.ndarray]:
    """What a restore must reproduce: logical name -> value, slots, non-slot variables, counter."""
    m, opt = tree["model"], tree["opt"]
    out = {name: var.numpy() for name, var in tree["variables"].items()}
    out["plain"] = m.plain.copy()
    out["config.nested.table"] = m.config["nested"]["table"].copy()
    for name, var in tree["variables"].items():
        out[f"slot.m.{name}"] = opt.get_slot(var, "m").numpy()
        out[f"slot.v.{name}"] = opt.get_slot(var, "v").numpy()
    out["beta1_power"] = opt.beta1_power.numpy()
    out["beta2_power"] = opt.beta2_power.numpy()
    out["save_counter"] = ckpt.save_counter.numpy()
    return out


# The equivalent tree in TensorFlow: same attribute names and order, same shapes and dtypes,
# other initial values. `V` maps the logical names to the tf.Variables.
TF_TREE = r"""
def _tf_tree(spec):
    def var(name):
        shape, dtype = spec[name]
        init = np.full(shape, "x", object) if dtype == "string" else np.ones(shape, dtype="float64")
        return tf.Variable(tf.cast(tf.constant(init), dtype) if dtype != "string" else init)
    m = tf.Module()
    m.encoder = tf.Module()
    m.encoder.kernel = var("encoder.kernel")
    m.encoder.bias = var("encoder.bias")
    m.layers = [tf.Module(), tf.Module()]
    m.layers[0].w = var("layers.0.w")
    m.layers[1].w = var("layers.1.w")
    m.layers.append(tf.Module())
    m.layers[2].w = var("layers.2.w")
    m.head = tf.Module()
    m.head.tied = m.encoder.kernel
    m.config = {"flags": var("config.flags"),
                "nested": {"names": [var("config.nested.names")], "scale": var("config.nested.scale")}}
    m.config["alias"] = m.layers[0].w
    m.plain = var("plain")
    m.config["nested"]["table"] = var("config.nested.table")
    V = {"encoder.kernel": m.encoder.kernel, "encoder.bias": m.encoder.bias, "layers.0.w": m.layers[0].w,
         "layers.1.w": m.layers[1].w, "layers.2.w": m.layers[2].w, "config.flags": m.config["flags"],
         "config.nested.names": m.config["nested"]["names"][0], "config.nested.scale": m.config["nested"]["scale"],
         "plain": m.plain, "config.nested.table": m.config["nested"]["table"]}
    return m, V

def _tf_collect(V, opt, ckpt, names):
    out = {k: v.numpy() for k, v in V.items()}
    for k in names:
        out["slot.m." + k] = opt.get_slot(V[k], "m").numpy()
        out["slot.v." + k] = opt.get_slot(V[k], "v").numpy()
    b1, b2 = opt._get_beta_accumulators()
    out["beta1_power"], out["beta2_power"] = b1.numpy(), b2.numpy()
    out["save_counter"] = ckpt.save_counter.numpy()
    return out
"""


def _tf_spec(values: Dict[str, np.ndarray]) -> Dict[str, Any]:
    def name(a: np.ndarray) -> str:
        return "string" if a.dtype == object else str(a.dtype)

    return {k: [list(v.shape), name(v)] for k, v in values.items() if not k.startswith(("slot.", "beta", "save_"))}


@pytest.fixture(scope="module")
def shardckpt_saves(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The tree saved twice with ``Checkpoint.save`` (values change between the saves)."""
    d = tmp_path_factory.mktemp("sc_saves")
    rng = np.random.default_rng(1234)
    tree = _build_tree(_values(rng, 0))
    ckpt = shardckpt.Checkpoint(model=tree["model"], optimizer=tree["opt"])
    first = ckpt.save(str(d / "ckpt"))
    snap1 = _snapshot(tree, ckpt)
    new = _values(rng, 1)
    for name, var in tree["variables"].items():
        var.assign(new[name])
        slot = tree["opt"].get_slot(var, "v")
        if slot.dtype.name == "string":
            slot.assign(np.full(slot.shape, b"v2", object))
        else:
            slot.assign(np.ones(slot.shape, slot.array.dtype))
    tree["model"].plain[...] = new["plain"]
    tree["model"].config["nested"]["table"][...] = new["config.nested.table"]
    tree["opt"].beta1_power.assign(np.float32(0.9) ** 4)
    second = ckpt.save(str(d / "ckpt"))
    snap2 = _snapshot(tree, ckpt)
    assert (first, second) == (str(d / "ckpt-1"), str(d / "ckpt-2"))
    return {"dir": str(d), "paths": [first, second], "snaps": [snap1, snap2], "spec": _tf_spec(snap2)}


def test_tensorflow_restores_a_shardckpt_object_graph_with_slots(tf_oracle: Any, shardckpt_saves: Dict[str, Any],
                                                                  tmp_path: Path) -> None:
    s = shardckpt_saves
    code = TF_TREE + r"""
res = {}
res["latest"] = tf.train.latest_checkpoint(P["dir"])
for i, path in enumerate([res["latest"], P["first"]]):
    m, V = _tf_tree(P["spec"])
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    ckpt = tf.train.Checkpoint(model=m, optimizer=opt)
    status = ckpt.restore(path)
    status.assert_existing_objects_matched()  # no slots yet: every existing object matched
    try:
        status.assert_consumed()
        res["consumed_before_slots"] = True
    except AssertionError:
        res["consumed_before_slots"] = False  # beta powers and slots are still waiting
    opt._create_slots([V[k] for k in P["names"]])  # restore-on-create of slots and beta powers
    status.assert_consumed()
    write_tensors(P["out"] + str(i), _tf_collect(V, opt, ckpt, P["names"]))
    if i == 0:
        res["resaved"] = ckpt.write(P["resave"])  # TF's own save of the restored tree
result = res
"""
    res = tf_run(tf_oracle, code, dir=s["dir"], first=s["paths"][0], spec=s["spec"], names=_VARIABLE_NAMES,
                 out=str(tmp_path / "restored"), resave=str(tmp_path / "tf_resave" / "ckpt"))
    assert res["latest"] == s["paths"][1]
    assert res["consumed_before_slots"] is False
    for i, snap in enumerate(reversed(s["snaps"])):
        got = {name: arr for name, arr, _ in read_tensors(tmp_path / f"restored{i}")}
        assert sorted(got) == sorted(snap)
        for name, want in snap.items():
            assert_bits_equal(got[name], want, f"ckpt-{2 - i} {name}")
    # TF saving the tree it restored gives our keys, our values and our object graph (names aside)
    ours, tf_prefix = s["paths"][1], res["resaved"]
    with shardckpt.load_checkpoint(ours) as a, shardckpt.load_checkpoint(tf_prefix) as b:
        keys = sorted(a.get_variable_to_shape_map())
        assert keys == sorted(b.get_variable_to_shape_map())
        for key in keys:
            if key != OBJECT_GRAPH_KEY:
                assert_bits_equal(b.get_tensor(key), a.get_tensor(key), key)
    assert graph_shape(graph_of(tf_prefix)) == graph_shape(graph_of(ours))
    assert "model/head/tied/.ATTRIBUTES/VARIABLE_VALUE" not in keys  # stored once, as model/encoder/kernel
    assert "model/config/alias/.ATTRIBUTES/VARIABLE_VALUE" in keys  # shorter than model/layers/0/w


def test_tensorflow_reads_the_same_keys_and_values(tf_oracle: Any, shardckpt_saves: Dict[str, Any]) -> None:
    prefix = shardckpt_saves["paths"][1]
    tensors, errors, dtypes = tf_oracle.load_checkpoint(prefix)
    assert errors == {}
    with shardckpt.load_checkpoint(shardckpt_saves["dir"]) as reader:
        assert reader.prefix == prefix
        ours = reader.get_variable_to_tf_dtype_map()
        assert sorted(tensors) == sorted(ours)
        assert {k: d.name for k, d in ours.items()} == dtypes
        for key in ours:
            assert_bits_equal(tensors[key], reader.get_tensor(key), key)
    assert sorted(os.listdir(shardckpt_saves["dir"])) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    state = tf_run(tf_oracle, "s = tf.train.get_checkpoint_state(P['d'])\n"
                   "result = [s.model_checkpoint_path, list(s.all_model_checkpoint_paths)]", d=shardckpt_saves["dir"])
    assert state == [prefix, [prefix]]  # as Checkpoint.save: only the newest path is listed


def test_root_form_and_write_are_read_by_tensorflow(tf_oracle: Any, tmp_path: Path) -> None:
    m = Module()
    m.a = Variable(np.array([1.5, -2.5], np.float32))
    m.d = {"z": Variable(np.int64(7)), "we.ird/name": Variable(np.array([b"s"], object))}
    m.arr = np.array([[1, 2]], np.int16)
    extra = Variable(np.float64(3.25))
    ckpt = shardckpt.Checkpoint(root=m, extra=extra)
    prefix = ckpt.write(str(tmp_path / "w" / "ck"))
    assert prefix == str(tmp_path / "w" / "ck")
    assert sorted(os.listdir(tmp_path / "w")) == ["ck.data-00000-of-00001", "ck.index"]  # no state file
    keys = sorted(k for k, _ in shardckpt.list_variables(prefix))
    assert keys == ["_CHECKPOINTABLE_OBJECT_GRAPH", "a/.ATTRIBUTES/VARIABLE_VALUE", "arr/.ATTRIBUTES/VARIABLE_VALUE",
                    "d/we..ird.Sname/.ATTRIBUTES/VARIABLE_VALUE", "d/z/.ATTRIBUTES/VARIABLE_VALUE",
                    "extra/.ATTRIBUTES/VARIABLE_VALUE"]  # no save_counter
    code = r"""
m = tf.Module()
m.a = tf.Variable(tf.zeros([2]))
m.d = {"z": tf.Variable(tf.constant(0, tf.int64)), "we.ird/name": tf.Variable(["?"])}
m.arr = tf.Variable(tf.zeros([1, 2], tf.int16))
extra = tf.Variable(tf.constant(0.0, tf.float64))
ckpt = tf.train.Checkpoint(root=m, extra=extra)
ckpt.read(P["prefix"]).assert_consumed()
own = ckpt.write(P["tfprefix"])
result = {"a": m.a.numpy().tolist(), "z": int(m.d["z"].numpy()), "s": [x.decode() for x in m.d["we.ird/name"].numpy()],
          "arr": m.arr.numpy().tolist(), "extra": float(extra.numpy()),
          "keys": sorted(k for k, _ in tf.train.list_variables(own)), "own": own}
"""
    res = tf_run(tf_oracle, code, prefix=prefix, tfprefix=str(tmp_path / "tf" / "ck"))
    assert res["a"] == [1.5, -2.5] and res["z"] == 7 and res["s"] == ["s"] and res["arr"] == [[1, 2]]
    assert res["extra"] == 3.25
    assert res["keys"] == keys  # TF names the same keys
    # the root-form graph is TF's, the root's self-edge included: node 0 child "root" -> node 0
    ours, theirs = graph_of(prefix), graph_of(res["own"])
    assert [(c.local_name, c.node_id) for c in theirs.nodes[0].children if c.local_name == "root"] == [("root", 0)]
    assert [(c.local_name, c.node_id) for c in ours.nodes[0].children] == \
        [(c.local_name, c.node_id) for c in theirs.nodes[0].children]


# ---------------------------------------------------------------------------------------------
# 2. shardckpt restores what TensorFlow saves
# ---------------------------------------------------------------------------------------------

def _zeros(shape: Any, dtype: Any) -> Variable:
    return Variable(np.zeros(shape, dtype))


def _fixture04_tree() -> Dict[str, Any]:
    m = Module()
    m.encoder = Module()
    l0, l1 = Module(), Module()
    l0.kernel, l0.bias = _zeros((4, 3), np.float32), _zeros((3,), np.float32)
    l1.kernel, l1.bias = _zeros((3, 2), np.float32), _zeros((2,), np.float32)
    m.encoder.layers = [l0, l1]
    m.encoder.norm = Module()
    m.encoder.norm.scale, m.encoder.norm.offset = _zeros((2,), np.float32), _zeros((2,), np.float32)
    m.head = Module()
    m.head.kernel, m.head.bias = _zeros((2, 1), np.float32), _zeros((1,), np.float32)
    m.embeddings = [_zeros((5, 2), np.int64), _zeros((), np.float64)]
    m.config = {"nested": {"deep": [_zeros((), np.int32)]}, "rate": _zeros((), np.float32)}
    m.shared_kernel = l0.kernel
    step = _zeros((), np.int64)
    key = "/.ATTRIBUTES/VARIABLE_VALUE"
    by_key = {
        "model/config/nested/deep/0": m.config["nested"]["deep"][0], "model/config/rate": m.config["rate"],
        "model/embeddings/0": m.embeddings[0], "model/embeddings/1": m.embeddings[1],
        "model/encoder/layers/0/bias": l0.bias, "model/encoder/layers/1/bias": l1.bias,
        "model/encoder/layers/1/kernel": l1.kernel, "model/encoder/norm/offset": m.encoder.norm.offset,
        "model/encoder/norm/scale": m.encoder.norm.scale, "model/head/bias": m.head.bias,
        "model/head/kernel": m.head.kernel, "model/shared_kernel": l0.kernel, "step": step,
    }
    return {"model": m, "step": step, "by_key": {k + key: v for k, v in by_key.items()}}


@pytest.mark.parametrize("target", ["ckpt-1", "ckpt-2", "."])
def test_restores_tensorflow_nested_graph_fixture(tf_fixtures_dir: Path, target: str) -> None:
    case_dir = tf_fixtures_dir / "04_nested_object_graph_save"
    case = json.loads((case_dir / "case.json").read_text())
    prefix = "ckpt-2" if target == "." else target
    info = case if prefix == case["prefix"] else case["additional_checkpoints"][0]
    assert info["prefix"] == prefix
    expected = np.load(case_dir / info["expected_npz"], allow_pickle=False)
    tree = _fixture04_tree()
    ckpt = shardckpt.Checkpoint(model=tree["model"], step=tree["step"])
    path = shardckpt.latest_checkpoint(str(case_dir)) if target == "." else str(case_dir / target)
    status = ckpt.restore(path)
    status.assert_consumed()
    status.assert_existing_objects_matched()
    status.assert_nontrivial_match()
    value_keys = [k["key"] for k in info["keys"] if not k.get("object_graph")]
    assert sorted([*tree["by_key"], "save_counter/.ATTRIBUTES/VARIABLE_VALUE"]) == sorted(value_keys)
    for key, var in tree["by_key"].items():
        assert_bits_equal(var.numpy(), expected[key], key)
    assert int(ckpt.save_counter.numpy()) == int(expected["save_counter/.ATTRIBUTES/VARIABLE_VALUE"])
    assert int(ckpt.save_counter.numpy()) == int(prefix[-1])
    assert tree["model"].encoder.layers[0].kernel is tree["model"].shared_kernel


def test_restores_tensorflow_fixture_into_objects_created_later(tf_fixtures_dir: Path) -> None:
    """Deferred restoration: children attached after ``restore`` get their values when attached."""
    case_dir = tf_fixtures_dir / "04_nested_object_graph_save"
    expected = np.load(case_dir / "expected.npz", allow_pickle=False)
    full = _fixture04_tree()
    m = Module()
    ckpt = shardckpt.Checkpoint(model=m, step=full["step"])
    status = ckpt.restore(str(case_dir / "ckpt-2"))
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError):
        status.assert_consumed()
    src = full["model"]
    for name in ("encoder", "head", "embeddings", "config", "shared_kernel"):
        setattr(m, name, getattr(src, name))
    status.assert_consumed()
    for key, var in full["by_key"].items():
        assert_bits_equal(var.numpy(), expected[key], key)


class FixtureAdam(Optimizer):
    def __init__(self) -> None:
        super().__init__()
        self.beta1_power = _zeros((), np.float32)
        self.beta2_power = _zeros((), np.float32)


def _fixture05() -> Dict[str, Any]:
    m = Module()
    m.w = _zeros((3, 2), np.float32)
    m.b = _zeros((2,), np.float32)
    opt = FixtureAdam()
    return {"model": m, "opt": opt, "ckpt": shardckpt.Checkpoint(model=m, optimizer=opt)}


def test_restores_tensorflow_v1_adam_slots_on_create(tf_fixtures_dir: Path) -> None:
    case_dir = tf_fixtures_dir / "05_optimizer_slots_v1_adam"
    case = json.loads((case_dir / "case.json").read_text())
    assert "AdamOptimizer" in case["writer"]["api"] and "write" in case["writer"]["api"]
    expected = np.load(case_dir / "expected.npz", allow_pickle=False)
    f = _fixture05()
    m, opt = f["model"], f["opt"]
    status = f["ckpt"].read(str(case_dir / "ckpt"))  # write() checkpoint: read(), as in TF
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="OPTIMIZER_SLOT"):
        status.assert_consumed()  # the slots do not exist yet
    for var in (m.w, m.b):
        for slot in ("m", "v"):
            opt.add_slot(var, slot)  # zeros, then filled from the checkpoint
    status.assert_consumed()
    live = {"model/w": m.w, "model/b": m.b, "optimizer/beta1_power": opt.beta1_power,
            "optimizer/beta2_power": opt.beta2_power}
    for path, var in list(live.items())[:2]:
        for slot in ("m", "v"):
            live[f"{path}/.OPTIMIZER_SLOT/optimizer/{slot}"] = opt.get_slot(var, slot)
    assert sorted(k + "/.ATTRIBUTES/VARIABLE_VALUE" for k in live) == sorted(expected.files)
    for path, var in live.items():
        key = path + "/.ATTRIBUTES/VARIABLE_VALUE"
        assert_bits_equal(var.numpy(), expected[key], key)
    assert not np.array_equal(opt.get_slot(m.w, "v").numpy(), np.zeros((3, 2), np.float32))


@pytest.mark.parametrize("slots_first", [False, True], ids=["slots_after", "slots_before"])
def test_skip_slot_variables_leaves_slots_alone(tf_fixtures_dir: Path, slots_first: bool) -> None:
    """TF: slots keep their initial values; assert_existing_objects_matched and assert_consumed pass.

    Fails (bug): CheckpointLoadStatus.assert_existing_objects_matched counts the live slot
    variables as unmatched even with skip_slot_variables.
    """
    case_dir = tf_fixtures_dir / "05_optimizer_slots_v1_adam"
    expected = np.load(case_dir / "expected.npz", allow_pickle=False)
    f = _fixture05()
    m, opt = f["model"], f["opt"]

    def make_slots() -> None:
        for var in (m.w, m.b):
            opt.add_slot(var, "m", np.full(var.shape, 5.0, np.float32))
            opt.add_slot(var, "v")

    if slots_first:
        make_slots()
    status = f["ckpt"].read(str(case_dir / "ckpt"), options=CheckpointOptions(skip_slot_variables=True))
    if not slots_first:
        make_slots()
    for var in (m.w, m.b):
        assert (opt.get_slot(var, "m").numpy() == 5.0).all()
        assert (opt.get_slot(var, "v").numpy() == 0.0).all()
    assert_bits_equal(m.w.numpy(), expected["model/w/.ATTRIBUTES/VARIABLE_VALUE"], "w")
    assert_bits_equal(opt.beta2_power.numpy(), expected["optimizer/beta2_power/.ATTRIBUTES/VARIABLE_VALUE"], "b2")
    status.assert_existing_objects_matched()
    status.assert_consumed()


_TF1_VARIABLES = {"dense/bias": ((3,), np.float32), "dense/kernel": ((4, 3), np.float32),
                  "embedding/table": ((10, 4), np.float32), "global_step": ((), np.int64),
                  "lookup/ids": ((7, 2), np.int32), "stats/counts": ((6,), np.int64)}


def _fixture08() -> Dict[str, Any]:
    variables = {n: Variable(np.zeros(s, d), name=n) for n, (s, d) in _TF1_VARIABLES.items()}
    holder = Module()
    holder.vars = list(variables.values())
    return {"variables": variables, "ckpt": shardckpt.Checkpoint(model=holder)}


def test_restores_tf1_saver_checkpoint_by_name(tf_fixtures_dir: Path) -> None:
    case_dir = tf_fixtures_dir / "08_tf1_saver_partitioned"
    expected = np.load(case_dir / "expected.npz", allow_pickle=False)
    f = _fixture08()
    status = f["ckpt"].read(str(case_dir / "model.ckpt-100"))  # no save_counter: see the next test
    assert type(status).__name__ == "NameBasedSaverStatus"
    status.assert_consumed()
    status.assert_existing_objects_matched()
    status.assert_nontrivial_match()
    for name, var in f["variables"].items():
        assert_bits_equal(var.numpy(), expected[name], name)  # partitioned ones assembled to full shape
    # a variable whose name is not in the checkpoint is reported
    holder = Module()
    holder.vars = [Variable(np.zeros(3, np.float32), name="dense/bias"), Variable(1.0, name="not_there")]
    status = shardckpt.Checkpoint(model=holder).read(str(case_dir / "model.ckpt-100"))
    with pytest.raises(AssertionError, match="not_there"):
        status.assert_existing_objects_matched()


def test_restore_of_tf1_saver_checkpoint_treats_save_counter_as_optional(tf_fixtures_dir: Path) -> None:
    """TF: ``Checkpoint.restore`` adds save_counter to the name-based status' optional objects, so
    ``assert_consumed`` passes (verified with fixture 08 in TF 2.21; save_counter stays 0).

    Fails (bug): restore() creates save_counter, NameBasedSaverStatus looks it up by name
    and reports "variables not found by name ...: 'save_counter'".
    """
    f = _fixture08()
    status = f["ckpt"].restore(shardckpt.latest_checkpoint(str(tf_fixtures_dir / "08_tf1_saver_partitioned")))
    assert int(f["ckpt"].save_counter.numpy()) == 0
    status.assert_existing_objects_matched()
    status.assert_consumed()


def test_restores_a_tensorflow_saved_model(tf_oracle: Any, tmp_path: Path) -> None:
    code = r"""
class M(tf.Module):
    def __init__(self):
        self.w = tf.Variable([1.5, -2.0, 3.25])
        self.n = tf.Variable(tf.constant(42, tf.int64))
        self.sub = tf.Module()
        self.sub.s = tf.Variable([b"a", b"\x00b"])
        self.sub.h = tf.Variable(tf.constant([[0.5, -1.0]], tf.bfloat16))

    @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
    def f(self, x):
        return x * self.w

tf.saved_model.save(M(), P["dir"])
ckpt = tf.train.Checkpoint(w=tf.Variable(tf.zeros([3])), n=tf.Variable(tf.constant(0, tf.int64)),
                           sub=tf.Module())
ckpt.sub.s = tf.Variable(["", ""])
ckpt.sub.h = tf.Variable(tf.zeros([1, 2], tf.bfloat16))
status = ckpt.restore(P["dir"])  # a SavedModel directory is accepted by restore()
outcome = {}
for check in ("assert_existing_objects_matched", "assert_consumed"):
    try:
        getattr(status, check)()
        outcome[check] = "passes"
    except AssertionError as e:
        outcome[check] = str(e)
ckpt2 = tf.train.Checkpoint(w=tf.Variable(tf.zeros([3])), n=tf.Variable(tf.constant(0, tf.int64)), sub=tf.Module())
ckpt2.sub.s = tf.Variable(["", ""])
ckpt2.sub.h = tf.Variable(tf.zeros([1, 2], tf.bfloat16))
ckpt2.read(os.path.join(P["dir"], "variables", "variables")).assert_consumed()  # read() makes no save_counter
result = {"tf": outcome, "files": sorted(os.listdir(P["dir"])), "w": ckpt.w.numpy().tolist()}
"""
    sm = tmp_path / "sm"
    res = tf_run(tf_oracle, code, dir=str(sm))
    assert "saved_model.pb" in res["files"] and "variables" in res["files"]
    assert res["w"] == [1.5, -2.0, 3.25]
    # TF: restore() made a save_counter the SavedModel lacks, and both checks count it
    assert all("save_counter" in outcome for outcome in res["tf"].values()), res["tf"]
    # the SavedModel's object graph has nodes without values (the function, its trace, signatures)
    proto = graph_of(str(sm / "variables" / "variables"))
    assert "f" in [c.local_name for c in proto.nodes[0].children]
    assert "signatures" in [c.local_name for c in proto.nodes[0].children]
    valueless = [i for i, n in enumerate(proto.nodes) if not n.attributes and not n.children]
    assert valueless  # e.g. the trace and the serving signature
    sub = Module()
    sub.s = Variable(np.array([b"", b""], object))
    sub.h = Variable(np.zeros((1, 2), BF16))
    w, n = Variable(np.zeros(3, np.float32)), Variable(np.int64(0))
    ckpt = shardckpt.Checkpoint(w=w, n=n, sub=sub)
    status = ckpt.restore(str(sm))  # the directory: variables/variables
    for check in (status.assert_consumed, status.assert_existing_objects_matched):
        with pytest.raises(AssertionError, match="save_counter"):  # as TF's: the SavedModel has no save_counter
            check()
    status.assert_nontrivial_match()
    again = shardckpt.Checkpoint(w=Variable(np.zeros(3, np.float32)), n=Variable(np.int64(0)), sub=sub)
    again.read(str(sm / "variables" / "variables")).assert_consumed()  # nodes without values need no object
    assert w.numpy().tolist() == [1.5, -2.0, 3.25] and int(n.numpy()) == 42
    assert sub.s.numpy().tolist() == [b"a", b"\x00b"]
    assert_bits_equal(sub.h.numpy(), np.array([[0.5, -1.0]], BF16), "h")
    listed = dict(shardckpt.list_variables(str(sm)))
    assert listed == {"_CHECKPOINTABLE_OBJECT_GRAPH": [], "n/.ATTRIBUTES/VARIABLE_VALUE": [],
                      "sub/h/.ATTRIBUTES/VARIABLE_VALUE": [1, 2], "sub/s/.ATTRIBUTES/VARIABLE_VALUE": [2],
                      "w/.ATTRIBUTES/VARIABLE_VALUE": [3]}
    with shardckpt.load_checkpoint(str(sm)) as reader:
        assert reader.prefix == str(sm / "variables" / "variables")


# ---------------------------------------------------------------------------------------------
# 3. CheckpointManager parity
# ---------------------------------------------------------------------------------------------

def _manager_scenarios(Checkpoint: Any, Manager: Any, Variable: Any, base: str, old_state: str) -> Dict[str, Any]:
    """Run by TensorFlow (its classes) and by shardckpt (ours): same code, sibling directories.

    Self-contained: its source is sent to the TF oracle.
    """
    import os
    import time

    import numpy as np

    def files(d: str) -> List[str]:
        return sorted(os.listdir(d))

    def state(d: str) -> Optional[str]:
        p = os.path.join(d, "checkpoint")
        if not os.path.exists(p):
            return None
        with open(p) as f:
            return f.read()

    def b(p: Optional[str]) -> Optional[str]:
        return None if p is None else os.path.basename(p)

    def obs(m: Any, ret: Optional[str]) -> Dict[str, Any]:
        return {"ret": b(ret), "checkpoints": [b(p) for p in m.checkpoints], "latest": b(m.latest_checkpoint),
                "files": files(m.directory), "state": state(m.directory)}

    def new(d: str, **kw: Any) -> Any:
        v = Variable(np.float32(0.0))
        ck = Checkpoint(v=v)
        return v, ck, Manager(ck, os.path.join(base, d), **kw)

    out: Dict[str, Any] = {}
    v, ck, m = new("keep2", max_to_keep=2)
    rec = []
    for i in range(5):
        v.assign(np.float32(i))
        rec.append(obs(m, m.save()))
    out["keep2"] = rec

    v, ck, m = new("keep_all", max_to_keep=None)
    out["keep_all"] = [obs(m, m.save()) for _ in range(4)]

    v, ck, m = new("number", max_to_keep=3)
    out["number"] = [obs(m, m.save(checkpoint_number=n)) for n in (10, None, 7, 10, None)]
    out["number_counter"] = int(np.asarray(ck.save_counter.numpy()))

    step = Variable(np.int64(0))
    ck = Checkpoint(v=Variable(np.float32(0.0)), step=step)
    m = Manager(ck, os.path.join(base, "interval"), max_to_keep=None, step_counter=step, checkpoint_interval=3)
    rec = []
    for s, force in [(0, False), (0, False), (1, False), (2, False), (3, False), (3, True), (4, True), (5, False),
                     (7, False), (8, False)]:
        step.assign(np.int64(s))
        rec.append([s, force, obs(m, m.save(check_interval=not force))])
    out["interval"] = rec

    # keep_checkpoint_every_n_hours over old checkpoints listed by a pre-written state file
    d = os.path.join(base, "hours")
    os.makedirs(d)
    ck = Checkpoint(v=Variable(np.float32(0.0)))
    for n in (1, 2, 3):
        ck.write(os.path.join(d, "ckpt-%d" % n))
    with open(os.path.join(d, "checkpoint"), "w") as f:
        f.write(old_state)
    m = Manager(ck, d, max_to_keep=1, keep_checkpoint_every_n_hours=1.0)
    out["hours"] = [obs(m, None)] + [obs(m, m.save(checkpoint_number=n)) for n in (10, 11, 12)]

    # a tiny interval (3.6 ms) and sleeps: each checkpoint rotated out is preserved
    v, ck, m = new("tiny_hours", max_to_keep=1, keep_checkpoint_every_n_hours=1e-6)
    rec = []
    for _ in range(3):
        time.sleep(0.02)
        rec.append(obs(m, m.save()))
    out["tiny_hours"] = rec

    # 0.36 s: a quick second save rotates out ckpt-1, which is preserved only if the fresh manager's
    # last_preserved_timestamp is a second in the past (TF)
    v, ck, m = new("fresh_hours", max_to_keep=1, keep_checkpoint_every_n_hours=1e-4)
    out["fresh_hours"] = [obs(m, m.save()), obs(m, m.save())]

    calls: List[int] = []
    v, ck, m = new("roi", max_to_keep=2, init_fn=lambda: calls.append(1))
    first = m.restore_or_initialize()
    v.assign(np.float32(42.0))
    m.save()
    v2 = Variable(np.float32(-1.0))
    ck2 = Checkpoint(v=v2)
    calls2: List[int] = []
    m2 = Manager(ck2, os.path.join(base, "roi"), max_to_keep=2, init_fn=lambda: calls2.append(1))
    second = m2.restore_or_initialize()
    out["roi"] = {"first": first, "calls": len(calls), "second": b(second), "calls2": len(calls2),
                  "restored": float(np.asarray(v2.numpy())), "counter": int(np.asarray(ck2.save_counter.numpy())),
                  "next": b(m2.save()), "obs": obs(m2, None)}

    # a directory written by Checkpoint.save (no timestamps), then managed
    d = os.path.join(base, "after_save")
    ck = Checkpoint(v=Variable(np.float32(0.0)))
    ck.save(os.path.join(d, "ckpt"))
    ck.save(os.path.join(d, "ckpt"))
    m = Manager(ck, d, max_to_keep=1)
    out["after_save"] = [obs(m, None), obs(m, m.save()), obs(m, m.save())]
    return out


def _manager_make(Checkpoint: Any, Manager: Any, Variable: Any, d: str) -> None:
    """A managed directory: max_to_keep=2, three saves (ckpt-2 and ckpt-3 kept), v == 3."""
    import numpy as np

    v = Variable(np.float32(0.0))
    m = Manager(Checkpoint(v=v), d, max_to_keep=2)
    for i in (1, 2, 3):
        v.assign(np.float32(i))
        m.save()


def _manager_continue(Checkpoint: Any, Manager: Any, Variable: Any, d: str) -> Dict[str, Any]:
    """Continue a managed directory: restore, then two saves with max_to_keep=2."""
    import os

    import numpy as np

    def state() -> str:
        with open(os.path.join(d, "checkpoint")) as f:
            return f.read()

    v = Variable(np.float32(-1.0))
    ck = Checkpoint(v=v)
    before = state()
    m = Manager(ck, d, max_to_keep=2)
    out: Dict[str, Any] = {"state_before": before, "checkpoints_before": [os.path.basename(p) for p in m.checkpoints],
                           "restored_from": os.path.basename(m.restore_or_initialize()),
                           "value": float(np.asarray(v.numpy())), "counter": int(np.asarray(ck.save_counter.numpy()))}
    out["saves"] = [os.path.basename(m.save())]
    out["state_mid"] = state()
    out["saves"].append(os.path.basename(m.save()))
    out["checkpoints"] = [os.path.basename(p) for p in m.checkpoints]
    out["files"] = sorted(os.listdir(d))
    out["state"] = state()
    return out


def _old_state(base_time: float) -> str:
    """ckpt-1..3 saved 10, 9.5 and 9.2 hours ago; last preserved 20 hours ago."""
    lines = ['model_checkpoint_path: "ckpt-3"'] + [f'all_model_checkpoint_paths: "ckpt-{n}"' for n in (1, 2, 3)]
    lines += [f"all_model_checkpoint_timestamps: {base_time - h * 3600.0!r}" for h in (10.0, 9.5, 9.2)]
    lines.append(f"last_preserved_timestamp: {base_time - 20 * 3600.0!r}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def manager_runs(tf_oracle: Any, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    base = tmp_path_factory.mktemp("managers")
    old_state = _old_state(round(time.time(), 3))
    lib = (shardckpt.Checkpoint, shardckpt.CheckpointManager, shardckpt.Variable)
    for name in ("sc_made_for_tf", "sc_made_for_sc"):
        _manager_make(*lib, str(base / name))
    src = "\n".join(inspect.getsource(f) for f in (_manager_scenarios, _manager_make, _manager_continue))
    code = "from typing import Any, Dict, List, Optional\n" + src + r"""
lib = (tf.train.Checkpoint, tf.train.CheckpointManager, tf.Variable)
res = {"scenarios": _manager_scenarios(*lib, P["base"] + "/tf", P["old_state"])}
for name in ("tf_made_for_tf", "tf_made_for_sc"):
    _manager_make(*lib, P["base"] + "/" + name)
res["tf_continues_tf"] = _manager_continue(*lib, P["base"] + "/tf_made_for_tf")
res["tf_continues_sc"] = _manager_continue(*lib, P["base"] + "/sc_made_for_tf")
result = res
"""
    tf_res = tf_run(tf_oracle, code, base=str(base), old_state=old_state)
    return {
        "old_state": old_state,
        "tf": tf_res["scenarios"],
        "sc": _manager_scenarios(*lib, str(base / "sc"), old_state),
        "continued": {"tf_continues_tf": tf_res["tf_continues_tf"], "tf_continues_sc": tf_res["tf_continues_sc"],
                      "sc_continues_tf": _manager_continue(*lib, str(base / "tf_made_for_sc")),
                      "sc_continues_sc": _manager_continue(*lib, str(base / "sc_made_for_sc"))},
    }


def parse_state(text: Optional[str]) -> Optional[CheckpointState]:
    if text is None:
        return None
    state = CheckpointState()
    text_format.Parse(text, state)
    return state


def _prefixes(files: List[str]) -> List[str]:
    """Checkpoint prefixes present (with their .index) plus other files; data-file counts aside."""
    out = set()
    for f in files:
        if f.endswith(".index"):
            out.add(f[: -len(".index")])
        elif ".data-" not in f:
            out.add(f)
    data = {f.split(".data-")[0] for f in files if ".data-" in f}
    assert data <= out, f"data files without an index: {sorted(data - out)}"
    return sorted(out)


def _comparable(o: Dict[str, Any]) -> Dict[str, Any]:
    """An observation without its timestamps (compared separately) and data-file names."""
    state = parse_state(o["state"])
    out = {k: o[k] for k in ("ret", "checkpoints", "latest")}
    out["files"] = _prefixes(o["files"])
    if state is not None:
        out["state"] = {"model": state.model_checkpoint_path, "all": list(state.all_model_checkpoint_paths),
                        "n_timestamps": len(state.all_model_checkpoint_timestamps),
                        "has_last_preserved": state.last_preserved_timestamp != 0}
    return out


def _check_timestamps(o: Dict[str, Any]) -> CheckpointState:
    state = parse_state(o["state"])
    assert state is not None
    stamps = list(state.all_model_checkpoint_timestamps)
    assert stamps == sorted(stamps) and len(stamps) == len(state.all_model_checkpoint_paths)
    if stamps and state.last_preserved_timestamp:
        assert state.last_preserved_timestamp <= stamps[0]
    return state


@pytest.mark.parametrize("scenario", ["keep2", "keep_all", "number", "interval", "hours", "tiny_hours", "roi"])
def test_manager_matches_tensorflow(manager_runs: Dict[str, Any], scenario: str) -> None:
    tf_obs, sc_obs = manager_runs["tf"][scenario], manager_runs["sc"][scenario]
    if scenario == "interval":
        assert [o[:2] for o in tf_obs] == [o[:2] for o in sc_obs]
        tf_obs, sc_obs = [o[2] for o in tf_obs], [o[2] for o in sc_obs]
    if scenario == "roi":
        assert {k: v for k, v in tf_obs.items() if k != "obs"} == {k: v for k, v in sc_obs.items() if k != "obs"}
        tf_obs, sc_obs = [tf_obs["obs"]], [sc_obs["obs"]]
    for lib_obs in (tf_obs, sc_obs):
        for o in lib_obs:
            if o["state"] is not None:
                _check_timestamps(o)
    assert [_comparable(o) for o in sc_obs] == [_comparable(o) for o in tf_obs]


def test_manager_sequences_are_as_expected(manager_runs: Dict[str, Any]) -> None:
    """The behaviour both libraries agree on, spelled out (checked on shardckpt's run)."""
    sc = manager_runs["sc"]
    last = _comparable(sc["keep2"][-1])
    assert last["files"] == ["checkpoint", "ckpt-4", "ckpt-5"]
    assert last["state"] == {"model": "ckpt-5", "all": ["ckpt-4", "ckpt-5"], "n_timestamps": 2,
                             "has_last_preserved": True}
    assert [o["ret"] for o in sc["keep2"]] == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4", "ckpt-5"]
    assert _comparable(sc["keep_all"][-1])["checkpoints"] == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]
    # checkpoint_number: used as given, the counter still counts; a re-used number moves to the end
    assert [o["ret"] for o in sc["number"]] == ["ckpt-10", "ckpt-2", "ckpt-7", "ckpt-10", "ckpt-5"]
    assert sc["number"][-1]["checkpoints"] == ["ckpt-7", "ckpt-10", "ckpt-5"]
    assert sc["number_counter"] == 5
    # interval 3: steps 0 (saved), 0 (same step), 1, 2 (too soon), 3 (saved), 3 forced (same step: no),
    # 4 forced (saved), 5 (too soon), 7 (saved), 8 (too soon)
    assert [o[2]["ret"] for o in sc["interval"]] == [
        "ckpt-1", None, None, None, "ckpt-2", None, "ckpt-3", None, "ckpt-4", None]
    roi = sc["roi"]
    assert (roi["first"], roi["calls"], roi["second"], roi["calls2"]) == (None, 1, "ckpt-1", 0)
    assert (roi["restored"], roi["counter"], roi["next"]) == (42.0, 1, "ckpt-2")


def test_manager_keep_every_n_hours_preserves_by_timestamp(manager_runs: Dict[str, Any]) -> None:
    """Old ckpt-1..3 (10, 9.5, 9.2 h ago, last preserved 20 h ago), keep one per hour, max_to_keep=1."""
    old = parse_state(manager_runs["old_state"])
    assert old is not None
    for lib in ("tf", "sc"):
        start, s10, s11, s12 = manager_runs[lib]["hours"]
        assert start["checkpoints"] == ["ckpt-1", "ckpt-2", "ckpt-3"]
        # ckpt-1 is kept (an hour after the last preserved one); 2 and 3 are not an hour after ckpt-1
        assert _prefixes(s10["files"]) == ["checkpoint", "ckpt-1", "ckpt-10"]
        st10 = _check_timestamps(s10)
        assert list(st10.all_model_checkpoint_paths) == ["ckpt-10"]
        assert st10.last_preserved_timestamp == old.all_model_checkpoint_timestamps[0]
        # ckpt-10 is more than an hour after ckpt-1: preserved when rotated out; ckpt-11 is not
        st11 = _check_timestamps(s11)
        assert _prefixes(s11["files"]) == ["checkpoint", "ckpt-1", "ckpt-10", "ckpt-11"]
        assert st11.last_preserved_timestamp == st10.all_model_checkpoint_timestamps[0]
        assert _prefixes(s12["files"]) == ["checkpoint", "ckpt-1", "ckpt-10", "ckpt-12"]
        assert _check_timestamps(s12).last_preserved_timestamp == st11.last_preserved_timestamp
        # tiny interval: every rotated-out checkpoint preserved, last_preserved = its timestamp
        tiny = manager_runs[lib]["tiny_hours"]
        assert _prefixes(tiny[-1]["files"]) == ["checkpoint", "ckpt-1", "ckpt-2", "ckpt-3"]
        for prev, cur in zip(tiny, tiny[1:]):
            assert (_check_timestamps(cur).last_preserved_timestamp
                    == _check_timestamps(prev).all_model_checkpoint_timestamps[-1])


def test_fresh_manager_last_preserved_timestamp_is_a_second_early(manager_runs: Dict[str, Any]) -> None:
    """TF starts a manager without a state file at ``last_preserved_timestamp = now - 1`` (a guard
    against quickly re-created managers), so with keep_checkpoint_every_n_hours=1e-4 (0.36 s)
    a ckpt-1 rotated out at once is preserved.

    Fails (bug): shardckpt starts at ``now``, and deletes ckpt-1.
    """
    tf_first = _check_timestamps(manager_runs["tf"]["keep2"][0])
    assert tf_first.all_model_checkpoint_timestamps[0] - tf_first.last_preserved_timestamp >= 1.0
    tf_fresh, sc_fresh = manager_runs["tf"]["fresh_hours"], manager_runs["sc"]["fresh_hours"]
    assert _prefixes(tf_fresh[-1]["files"]) == ["checkpoint", "ckpt-1", "ckpt-2"]
    assert [_comparable(o) for o in sc_fresh] == [_comparable(o) for o in tf_fresh]
    sc_first = _check_timestamps(manager_runs["sc"]["keep2"][0])
    assert sc_first.all_model_checkpoint_timestamps[0] - sc_first.last_preserved_timestamp >= 1.0


def test_manager_leaves_checkpoints_of_checkpoint_save_alone(manager_runs: Dict[str, Any]) -> None:
    """TF: a state file without timestamps or last_preserved_timestamp (``Checkpoint.save``'s)
    gives a manager nothing to manage: ckpt-1/ckpt-2 stay, ``checkpoints`` starts empty, the
    manager continues at ckpt-3 and writes no last_preserved_timestamp.

    Fails (bug): shardckpt adopts ckpt-2 (stamped "now") and deletes it on the next save.
    """
    tf_obs = manager_runs["tf"]["after_save"]
    assert tf_obs[0]["checkpoints"] == [] and tf_obs[0]["latest"] == "ckpt-2"
    assert _prefixes(tf_obs[-1]["files"]) == ["checkpoint", "ckpt-1", "ckpt-2", "ckpt-4"]
    assert [_comparable(o) for o in manager_runs["sc"]["after_save"]] == [_comparable(o) for o in tf_obs]


@pytest.mark.parametrize("run", ["tf_continues_tf", "tf_continues_sc", "sc_continues_tf", "sc_continues_sc"])
def test_manager_continues_the_other_librarys_directory(manager_runs: Dict[str, Any], run: str) -> None:
    r = manager_runs["continued"][run]
    before = parse_state(r["state_before"])
    after = parse_state(r["state"])
    assert before is not None and after is not None
    assert list(before.all_model_checkpoint_paths) == ["ckpt-2", "ckpt-3"]
    assert len(before.all_model_checkpoint_timestamps) == 2 and before.last_preserved_timestamp > 0
    assert r["checkpoints_before"] == ["ckpt-2", "ckpt-3"]
    assert (r["restored_from"], r["value"], r["counter"]) == ("ckpt-3", 3.0, 3)
    assert r["saves"] == ["ckpt-4", "ckpt-5"]  # numbering continues from the restored save_counter
    assert r["checkpoints"] == ["ckpt-4", "ckpt-5"]
    assert _prefixes(r["files"]) == ["checkpoint", "ckpt-4", "ckpt-5"]  # ckpt-2 and ckpt-3 deleted
    assert after.model_checkpoint_path == "ckpt-5"
    assert list(after.all_model_checkpoint_paths) == ["ckpt-4", "ckpt-5"]
    stamps = list(after.all_model_checkpoint_timestamps)
    assert len(stamps) == 2 and stamps[0] < stamps[1] and stamps[0] > before.all_model_checkpoint_timestamps[1]
    assert after.last_preserved_timestamp == before.last_preserved_timestamp  # carried over


def test_manager_keeps_the_others_timestamps_while_they_are_listed(manager_runs: Dict[str, Any]) -> None:
    """After one continuing save, ckpt-3 is still listed with the timestamp the other library wrote."""
    for run, r in manager_runs["continued"].items():
        before, mid = parse_state(r["state_before"]), parse_state(r["state_mid"])
        assert before is not None and mid is not None
        assert list(mid.all_model_checkpoint_paths) == ["ckpt-3", "ckpt-4"], run
        assert mid.all_model_checkpoint_timestamps[0] == before.all_model_checkpoint_timestamps[1], run
        assert mid.all_model_checkpoint_timestamps[1] > mid.all_model_checkpoint_timestamps[0], run


def test_string_slot_default_zeros(tmp_path: Path, tf_oracle: Any) -> None:
    """TF's zeros slot of a string variable is ``b""`` (``_zeros_slot``), and it saves.

    Fails (bug): ``Optimizer.add_slot``'s default ``np.zeros_like`` of an object array is an
    array of int 0, which the bundle writer rejects ("string tensor element of type int").
    """
    res = tf_run(tf_oracle, r"""
v = tf.Variable([b"a", b"b"])
opt = tf.compat.v1.train.AdamOptimizer(0.1)
opt._create_slots([v])
result = [x.decode() for x in opt.get_slot(v, "m").numpy()]
""")
    assert res == ["", ""]
    m = Module()
    m.s = Variable(np.array([b"a", b"b"], object))
    opt = Optimizer()
    slot = opt.add_slot(m.s, "m")
    assert slot.numpy().tolist() == [b"", b""]
    shardckpt.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "ck"))

