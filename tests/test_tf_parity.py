"""A TensorFlow user's habits, side by side: the same scripts through TensorFlow 2.21 and shardckpt.

Each test runs a script in the TF oracle (``probe``: the exception, if any, is part of
the answer) and the same script with the import changed in this process, and compares
results, dtypes and exception classes. An exception "matches" when shardckpt raises
TF's class or a subclass of it (``InvalidArgumentError`` is a ``ValueError``).
Deliberate differences (docs/differences-from-tensorflow.md) are asserted as such.

DTensor scripts run in a second oracle whose CPU is split into 8 logical devices
(TF DTensor needs that before any other op).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
import pytest
from tf_oracle.client import TFOracle

import shardckpt
from shardckpt import dtensor


def probe_ours(code: str) -> Dict[str, Any]:
    """Run ``code`` here (``shardckpt``, ``dtensor``, ``np``, ``json``, ``os`` predefined) as the oracle's probe."""
    namespace: Dict[str, Any] = {"shardckpt": shardckpt, "dtensor": dtensor, "np": np, "json": json, "os": os}
    try:
        exec(code, namespace)
    except Exception as e:  # noqa: BLE001 - the exception is the answer
        return {"result": None, "error": {"type": type(e).__name__, "bases": [c.__name__ for c in type(e).__mro__],
                                          "message": str(e)}}
    return {"result": namespace.get("result"), "error": None}


def same_outcome(tf: Dict[str, Any], ours: Dict[str, Any], what: str = "") -> None:
    """Equal results, or exceptions of the same class (ours may be a subclass of TF's)."""
    if tf["error"] is None or ours["error"] is None:
        assert tf["error"] is None and ours["error"] is None, (what, tf, ours)
        assert tf["result"] == ours["result"], (what, tf["result"], ours["result"])
        return
    assert tf["error"]["type"] in ours["error"]["bases"], (what, tf["error"], ours["error"])


def both(tf_oracle: Any, tf_code: str, our_code: str, what: str = "") -> Any:
    tf, ours = tf_oracle.probe(tf_code), probe_ours(our_code)
    same_outcome(tf, ours, what or our_code)
    return tf, ours


class DTensorOracle:
    """A TF oracle with 8 logical CPUs; every script gets ``dtensor`` (``tf.experimental.dtensor``)."""

    IMPORT = "from tensorflow.experimental import dtensor\n"

    def __init__(self) -> None:
        self.oracle = TFOracle(logical_cpus=8)

    def probe(self, code: str) -> Dict[str, Any]:
        return self.oracle.probe(self.IMPORT + code)

    def exec(self, code: str) -> Any:
        return self.oracle.exec(self.IMPORT + code)


@pytest.fixture(scope="module")
def tf_dtensor() -> Iterator[DTensorOracle]:
    """A TF oracle with 8 logical CPUs, for DTensor scripts."""
    oracle = DTensorOracle()
    try:
        yield oracle
    finally:
        oracle.oracle.close()


# -- Python values take TF's dtypes ---------------------------------------------------------------

LITERALS = ["1.0", "3", "True", "'s'", "b'b'", "[1.0, 2.0]", "[[1, 2], [3, 4]]", "[1, 2.0]", "2**31 - 1", "2**31",
            "-2**31", "-2**31 - 1", "[1, 2**40]", "2**63", "1j", "[True, False]", "['a', 'b']",
            "np.float64(1.5)", "np.int64(3)", "np.array([1, 2], np.int16)", "np.float16(2)"]


@pytest.mark.parametrize("literal", LITERALS)
def test_variable_of_a_python_value_has_tfs_dtype(tf_oracle: TFOracle, literal: str) -> None:
    get = "result = [v.dtype.name, repr(v.numpy().tolist()) if v.dtype.name != 'string' else None]"
    tf, ours = both(tf_oracle, f"v = tf.Variable({literal})\n{get}", f"v = shardckpt.Variable({literal})\n{get}")
    if tf["error"] is None:
        assert tf["result"][0] == ours["result"][0]


def test_tensorflow_restores_variables_of_python_values(tf_oracle: TFOracle, tmp_path: Path) -> None:
    path = shardckpt.Checkpoint(a=shardckpt.Variable(1.0), b=shardckpt.Variable(3), c=shardckpt.Variable([1.0, 2.0]),
                                d=shardckpt.Variable(True), s=shardckpt.Variable("hi"),
                                big=shardckpt.Variable(2**40)).save(str(tmp_path / "ours" / "ckpt"))
    code = f"""
ckpt = tf.train.Checkpoint(a=tf.Variable(0.0), b=tf.Variable(0), c=tf.Variable([0.0, 0.0]), d=tf.Variable(False),
                           s=tf.Variable(""), big=tf.Variable(2**33))
ckpt.restore({path!r}).assert_consumed()
result = [ckpt.a.numpy().item(), ckpt.b.numpy().item(), ckpt.c.numpy().tolist(), bool(ckpt.d.numpy()),
          ckpt.s.numpy().decode(), ckpt.big.numpy().item(), ckpt.a.dtype.name, ckpt.b.dtype.name]
"""
    assert tf_oracle.exec(code) == [1.0, 3, [1.0, 2.0], True, "hi", 2**40, "float32", "int32"]
    # and the other way: TF's Variable(1.0), Variable(3), Variable([1.0, 2.0]) restore into ours
    tf_path = tf_oracle.exec(f"""
ckpt = tf.train.Checkpoint(a=tf.Variable(5.0), b=tf.Variable(7), c=tf.Variable([3.0, 4.0]))
result = ckpt.save({str(tmp_path / 'tf' / 'ckpt')!r})
""")
    ours = shardckpt.Checkpoint(a=shardckpt.Variable(0.0), b=shardckpt.Variable(0), c=shardckpt.Variable([0.0, 0.0]))
    ours.restore(tf_path).assert_consumed()
    assert (float(ours.a.numpy()), int(ours.b.numpy()), ours.c.numpy().tolist()) == (5.0, 7, [3.0, 4.0])


# -- Checkpoint, manager and status semantics -----------------------------------------------------------


@pytest.mark.parametrize("value", ["3", "1.5", "object()", "'text'", "[tf_or_sc.Variable(1.0)]",
                                   "{'k': tf_or_sc.Variable(1.0)}"])
def test_checkpoint_accepts_trackables_and_rejects_other_values(tf_oracle: TFOracle, value: str) -> None:
    tf_code = f"tf_or_sc = tf\nckpt = tf.train.Checkpoint(x={value})\nresult = 'ok'"
    our_code = f"tf_or_sc = shardckpt\nckpt = shardckpt.Checkpoint(x={value})\nresult = 'ok'"
    both(tf_oracle, tf_code, our_code)


def test_checkpoint_of_a_numpy_array_is_a_documented_extension(tf_oracle: TFOracle) -> None:
    tf = tf_oracle.probe("tf.train.Checkpoint(x=np.zeros(3))")
    assert tf["error"] is not None and "ValueError" in tf["error"]["bases"]
    assert probe_ours("shardckpt.Checkpoint(x=np.zeros(3)); result = 'ok'") == {"result": "ok", "error": None}


def test_restore_none_returns_the_initialization_only_status(tf_oracle: TFOracle) -> None:
    for method in ("assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match", "run_restore_ops"):
        tf, ours = both(tf_oracle, f"tf.train.Checkpoint(v=tf.Variable(1.0)).restore(None).{method}()",
                        f"shardckpt.Checkpoint(v=shardckpt.Variable(1.0)).restore(None).{method}()", method)
        assert tf["error"]["type"] == ours["error"]["type"] == "AssertionError"
        assert tf["error"]["message"] == ours["error"]["message"], method
    get = "s = ckpt.restore(None)\nresult = [s.initialize_or_restore(), s.expect_partial() is s, type(s).__name__]"
    both(tf_oracle, f"ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))\n{get}",
         f"ckpt = shardckpt.Checkpoint(v=shardckpt.Variable(1.0))\n{get}")


def test_restore_statuses_share_one_base() -> None:
    from shardckpt.checkpoint.restore import (
        CheckpointLoadStatus,
        InitializationOnlyStatus,
        LoadStatus,
        NameBasedSaverStatus,
    )

    for status in (CheckpointLoadStatus, InitializationOnlyStatus, NameBasedSaverStatus):
        assert issubclass(status, LoadStatus)
        assert "run_restore_ops" not in vars(status) or status is InitializationOnlyStatus


def test_manager_needs_max_to_keep(tf_oracle: TFOracle, tmp_path: Path) -> None:
    for args in ("", ", max_to_keep=0", ", max_to_keep=-1"):
        both(tf_oracle, f"tf.train.CheckpointManager(tf.train.Checkpoint(), {str(tmp_path / 'a')!r}{args})",
             f"shardckpt.CheckpointManager(shardckpt.Checkpoint(), {str(tmp_path / 'b')!r}{args})", args)


def test_manager_sync_and_last_checkpoint_step(tf_oracle: TFOracle, tmp_path: Path) -> None:
    script = """
step = {m}.Variable(np.int64(12))
manager = {mgr}({ckpt}(step=step), {d!r}, max_to_keep=3, step_counter=step, checkpoint_interval=5,
                last_checkpoint_step=10)
out = [manager.save() is None]
step.assign(15)
out.append(os.path.basename(manager.save()))
out.append(manager.sync())
step.assign(17)
out.append(manager.save() is None)
result = out
"""
    tf, ours = both(tf_oracle,
                    script.format(m="tf", mgr="tf.train.CheckpointManager", ckpt="tf.train.Checkpoint",
                                  d=str(tmp_path / "tf")),
                    script.format(m="shardckpt", mgr="shardckpt.CheckpointManager", ckpt="shardckpt.Checkpoint",
                                  d=str(tmp_path / "ours")))
    assert tf["result"] == [True, "ckpt-1", None, True]
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(), str(tmp_path / "x"), 1,
                                          step_counter=np.int64(3), checkpoint_interval=2, last_checkpoint_step=1)
    assert manager.last_checkpoint_step == 1  # readable here (a documented extension)


def test_failed_save_gives_its_number_back_a_documented_difference(tf_oracle: TFOracle, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    script = """
ckpt = {ckpt}(v={m}.Variable(1.0))
try:
    ckpt.save({p!r})
    raised = None
except Exception as e:
    raised = type(e).__name__
result = [raised is not None, int(ckpt.save_counter.numpy())]
"""
    tf = tf_oracle.exec(script.format(ckpt="tf.train.Checkpoint", m="tf", p=str(blocker / "ckpt")))
    ours = probe_ours(script.format(ckpt="shardckpt.Checkpoint", m="shardckpt", p=str(blocker / "ckpt")))["result"]
    assert tf == [True, 1]  # TF keeps the number it used up
    assert ours == [True, 0]  # shardckpt gives it back


def test_reader_returns_numpy_scalars_for_scalars(tf_oracle: TFOracle, tmp_path: Path) -> None:
    prefix = str(tmp_path / "scalars")
    shardckpt.io.save_v2(prefix, ["f", "i", "s", "v"], [""] * 4,
                         [np.float32(1.5), np.int64(7), np.array(b"abc", dtype=object), np.arange(3, dtype=np.int32)])
    get = "r = {lib}.load_checkpoint({p!r})\n" \
          "result = [[type(r.get_tensor(k)).__name__, str(getattr(r.get_tensor(k), 'dtype', ''))] for k in 'fisv']"
    both(tf_oracle, get.format(lib="tf.train", p=prefix), get.format(lib="shardckpt", p=prefix))
    assert probe_ours(get.format(lib="shardckpt", p=prefix))["result"] == \
        [["float32", "float32"], ["int64", "int64"], ["bytes", ""], ["ndarray", "int32"]]


# -- a sharding callback written for TF ports by changing the import ----------------------------------------

# TF's documentation of tf.train.experimental.ShardingCallback, with its two typos fixed
# (``set_default`` -> ``setdefault``; ``tensor_save_spec.tensor`` -> ``tensor``, the public field).
POLICIES = """
class AllInOnePolicy({base}):
  @property
  def description(self):
    return "Place all tensors in a single shard."

  def __call__(self, shardable_tensors):
    tensors = {{}}
    for shardable_tensor in shardable_tensors:
      tensor = shardable_tensor.tensor
      checkpoint_key = shardable_tensor.checkpoint_key
      slice_spec = shardable_tensor.slice_spec

      tensors.setdefault(checkpoint_key, {{}})[slice_spec] = tensor
    return [tensors]


class FieldReader({base}):
  # one shard per tensor; records the fields a TF callback reads
  seen = []

  @property
  def description(self):
    return "One tensor per shard."

  def __call__(self, shardable_tensors):
    shards = []
    for st in shardable_tensors:
      FieldReader.seen.append([st.checkpoint_key, st.dtype.name, st.dtype.size, st.shape.rank,
                               st.shape.num_elements(), st.shape.as_list(), st.device.job, st.device.task,
                               st.device.device_type, st.device.device_index, st.slice_spec,
                               st.name == st.checkpoint_key or bool(st.name)])
      shards.append({{st.checkpoint_key: {{st.slice_spec: st.tensor}}}})
    return shards


def run(policy, directory):
  ckpt = {ckpt}(w={m}.Variable(np.arange(12, dtype=np.float32).reshape(3, 4)), n={m}.Variable(np.int64(5)))
  path = ckpt.write(os.path.join(directory, "ckpt"),
                    options={options}(experimental_sharding_callback=policy))
  return sorted(f for f in os.listdir(directory) if ".data-" in f), path
"""


def test_a_sharding_callback_from_tfs_docs_ports_by_changing_the_import(tf_oracle: TFOracle, tmp_path: Path) -> None:
    tf_src = POLICIES.format(base="tf.train.experimental.ShardingCallback", ckpt="tf.train.Checkpoint", m="tf",
                             options="tf.train.CheckpointOptions")
    our_src = POLICIES.format(base="shardckpt.ShardingCallback", ckpt="shardckpt.Checkpoint", m="shardckpt",
                              options="shardckpt.CheckpointOptions")
    run = """
files_one, _ = run(AllInOnePolicy(), {a!r})
files_many, path = run(FieldReader(), {b!r})
result = [files_one, files_many, sorted(FieldReader.seen), path]
"""
    tf = tf_oracle.probe(tf_src + run.format(a=str(tmp_path / "tf1"), b=str(tmp_path / "tf2")))
    ours = probe_ours(our_src + run.format(a=str(tmp_path / "o1"), b=str(tmp_path / "o2")))
    assert tf["error"] is None and ours["error"] is None, (tf, ours)
    assert tf["result"][:3] == ours["result"][:3]
    assert tf["result"][0] == ["ckpt.data-00000-of-00001"] and len(tf["result"][1]) == 3
    # each side reads the other's
    got = tf_oracle.exec(f"r = tf.train.load_checkpoint({ours['result'][3]!r})\n"
                         "result = r.get_tensor('w/.ATTRIBUTES/VARIABLE_VALUE').tolist()")
    assert got == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
    assert shardckpt.load_checkpoint(tf["result"][3]).get_tensor("n/.ATTRIBUTES/VARIABLE_VALUE") == 5


def test_max_shard_size_partitioner_as_tf(tf_oracle: TFOracle) -> None:
    code = """
P = {cls}
parts = P.MaxShardSizePartitioner()
result = [P(16).description, callable(parts.get_shards), P(16).max_shard_size]
"""
    both(tf_oracle,
         "from tensorflow.python.checkpoint.sharding.sharding_policies import MaxShardSizePolicy\n"
         + code.format(cls="MaxShardSizePolicy"),
         code.format(cls="shardckpt.MaxShardSizePolicy"))


# -- DTensor ----------------------------------------------------------------------------------------------

MESH_SCRIPTS = {
    "create_mesh_dict": "m = dtensor.create_mesh({'x': 2, 'y': 4}, device_type='CPU')",
    "create_mesh_named": "m = dtensor.create_mesh([('x', 8)], mesh_name='m8', device_type='CPU')",
    "create_mesh_devices": "m = dtensor.create_mesh([('x', 2), ('y', 2)], devices=['CPU:%d' % i for i in range(4)])",
    "mesh_of_client_1": "m = dtensor.Mesh(['x', 'y'], np.arange(8).reshape(2, 4), [4, 5, 6, 7], "
                        "['/job:worker/replica:0/task:1/device:CPU:%d' % i for i in range(4)], mesh_name='mm')",
    "mesh_with_global_devices": "m = dtensor.Mesh(['x'], np.arange(4), [0, 1], "
                                "['/job:worker/replica:0/task:0/device:CPU:%d' % i for i in range(2)], "
                                "global_devices=['/job:worker/replica:0/task:%d/device:CPU:%d' % (i // 2, i % 2) "
                                "for i in range(4)])",
}
LAYOUT_SPECS = [["x", "unsharded"], ["unsharded", "y"], [], ["y", "x"], ["unsharded", "unsharded"]]


@pytest.mark.parametrize("name", sorted(MESH_SCRIPTS))
def test_mesh_and_layout_strings_are_tfs(tf_dtensor: DTensorOracle, name: str) -> None:
    specs = [s for s in LAYOUT_SPECS if all(d in ("unsharded", "x", "y") for d in s)]
    get = f"""
out = [m.to_string(), str(m), repr(m), m.local_device_ids() if callable(m.local_device_ids) else None]
for specs in {specs!r}:
    if all(d == 'unsharded' or d in m.dim_names for d in specs):
        lay = dtensor.Layout(specs, m)
        out.append([lay.to_string(), str(lay), repr(lay)])
result = [list(map(lambda v: list(v) if isinstance(v, (list, tuple)) else v, out))]
"""
    tf = tf_dtensor.probe(MESH_SCRIPTS[name] + get)
    ours = probe_ours(MESH_SCRIPTS[name] + get)
    same_outcome(tf, ours, name)
    # strings cross: ours parse in TF and give the same string back, and the other way
    mesh_str = tf["result"][0][0]
    back = tf_dtensor.exec(f"result = dtensor.Mesh.from_string({ours['result'][0][0]!r}).to_string()")
    assert back == mesh_str == dtensor.Mesh.from_string(mesh_str).to_string()
    for entry in tf["result"][0][4:]:
        assert dtensor.Layout.from_string(entry[0]).to_string() == entry[0]


def test_bad_mesh_and_layout_strings_are_value_errors(tf_dtensor: DTensorOracle) -> None:
    for bad in ("garbage", "|x=2|0,1|0,1", "sharding_specs:x, mesh:garbage"):
        kind = "Layout" if bad.startswith("sharding") else "Mesh"
        tf = tf_dtensor.probe(f"dtensor.{kind}.from_string({bad!r})")
        ours = probe_ours(f"dtensor.{kind}.from_string({bad!r})")
        same_outcome(tf, ours, bad)
        assert tf["error"]["type"] == "ValueError"


def test_create_mesh_errors_match(tf_dtensor: DTensorOracle) -> None:
    for args in ("[('x', 3)], devices=['CPU:0', 'CPU:1']", "{'x': 2}, device_type='CPU', use_xla_spmd=True"):
        both(tf_dtensor, f"dtensor.create_mesh({args})", f"dtensor.create_mesh({args})", args)


def test_client_functions_and_namespace(tf_dtensor: DTensorOracle) -> None:
    code = """
m = dtensor.create_mesh([('x', 8)], device_type='CPU')
with dtensor.default_mesh(m) as inner:
    pass
result = [dtensor.num_clients(), dtensor.client_id(), dtensor.barrier(m, 'b', 10000), hasattr(dtensor, 'save'),
          hasattr(dtensor, 'api'), hasattr(dtensor, 'mesh')]
"""
    tf, ours = both(tf_dtensor, code, code)
    assert tf["result"] == [1, 0, None, False, False, False]
    both(tf_dtensor, "dtensor.save('x')", "dtensor.save('x')")  # AttributeError in both, not "module not callable"
    public = set(tf_dtensor.exec("result = [n for n in dir(dtensor) if not n.startswith('_')]"))
    extras = {"DTensor", "from_global", "to_global", "get_default_mesh", "sharded_save"} - public
    assert set(dtensor.__all__) - public <= extras, set(dtensor.__all__) - public


DVARIABLE = """
mesh = dtensor.create_mesh([('x', 2), ('y', 4)], device_type='CPU')
layout = dtensor.Layout(['x', 'y'], mesh)
x = np.arange(32, dtype=np.float32).reshape(4, 8)
def full(t):  # TF's numpy() needs a replicated DTensor
    return dtensor.relayout(t, dtensor.Layout.replicated(mesh, len(t.shape))).numpy().tolist()
{make}
v = dtensor.DVariable(t)
out = [full(v), full(v.read_value()), full(v.value())]
v.assign_add(t)
out.append(full(v.read_value()))
v.assign_sub(t)
v.assign_sub(t)
out.append(full(v.read_value()))
v.assign(t)
out.append(full(v.read_value()))
out.append(dtensor.fetch_layout(v).to_string())
out.append([list(c.shape) for c in dtensor.unpack(v.read_value())])
out.append([dtensor.is_dtensor(t), dtensor.is_dtensor(v), dtensor.is_dtensor(x)])
r = dtensor.relayout(t, dtensor.Layout(['unsharded', 'x'], mesh))
out.append([dtensor.fetch_layout(r).to_string(), full(r), [np.asarray(c).tolist() for c in dtensor.unpack(r)]])
result = out
"""


def test_dvariable_reads_assigns_and_relayouts_as_tf(tf_dtensor: DTensorOracle) -> None:
    tf_make = "t = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(x), dtensor.Layout.replicated(mesh, 2)), layout)"
    tf, ours = both(tf_dtensor, DVARIABLE.format(make=tf_make),
                    DVARIABLE.format(make="t = dtensor.copy_to_mesh(x, layout)"))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert tf["result"][3] == (2 * x).tolist() and tf["result"][4] == (0 * x).tolist()
    # unpack of a DVariable: TF wants a tensor; here every DTensor function takes a DVariable
    for call in ("dtensor.unpack(v)",):
        script = DVARIABLE.split("def full")[0] + "{make}\nv = dtensor.DVariable(t)\n" + call
        assert tf_dtensor.probe(script.format(make=tf_make))["error"]["type"] == "TypeError"
        assert probe_ours(script.format(make="t = dtensor.copy_to_mesh(x, layout)"))["error"] is None
    # numpy() of a sharded DVariable: TF cannot; shardckpt gives the global value on one client (documented)
    tf_numpy = tf_dtensor.probe(DVARIABLE.split("def full")[0] + tf_make + "\nresult = dtensor.DVariable(t).numpy()")
    assert tf_numpy["error"]["type"] == "UnimplementedError"
    mesh = dtensor.create_mesh([("x", 2), ("y", 4)])
    var = dtensor.DVariable(dtensor.copy_to_mesh(x, dtensor.Layout(["x", "y"], mesh)))
    assert var.numpy().tolist() == x.tolist() and dtensor.to_global(var).tolist() == x.tolist()


def test_name_based_save_and_restore_cross_both_ways(tf_dtensor: DTensorOracle, tmp_path: Path) -> None:
    values = {"a": np.arange(32, dtype=np.float32).reshape(4, 8), "b": np.arange(16, dtype=np.int64).reshape(8, 2)}
    mesh = dtensor.create_mesh([("x", 2), ("y", 4)])
    a = dtensor.DVariable(dtensor.copy_to_mesh(values["a"], dtensor.Layout(["x", "y"], mesh)))
    b = dtensor.copy_to_mesh(values["b"], dtensor.Layout(["y", "unsharded"], mesh))
    ours_prefix = str(tmp_path / "ours")
    dtensor.name_based_save(mesh, ours_prefix, {"a": a, "b": b})
    code = """
mesh = dtensor.create_mesh([('x', 2), ('y', 4)], device_type='CPU')
def like(shape, dtype, specs):
    return dtensor.relayout(dtensor.copy_to_mesh(tf.zeros(shape, dtype), dtensor.Layout.replicated(mesh, 2)),
                            dtensor.Layout(specs, mesh))
got = dtensor.name_based_restore(mesh, {prefix!r}, {{'a': like((4, 8), tf.float32, ['unsharded', 'x']),
                                                     'b': like((8, 2), tf.int64, ['x', 'unsharded'])}})
rep = dtensor.Layout.replicated(mesh, 2)
result = {{k: dtensor.relayout(v, rep).numpy().tolist() for k, v in got.items()}}
"""
    assert tf_dtensor.exec(code.format(prefix=ours_prefix)) == {k: v.tolist() for k, v in values.items()}
    tf_prefix = str(tmp_path / "tf")
    tf_dtensor.exec(f"""
mesh = dtensor.create_mesh([('x', 2), ('y', 4)], device_type='CPU')
rep = dtensor.Layout.replicated(mesh, 2)
a = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(np.arange(32, dtype=np.float32).reshape(4, 8)), rep),
                     dtensor.Layout(['y', 'x'], mesh))
b = dtensor.copy_to_mesh(tf.constant(np.arange(16, dtype=np.int64).reshape(8, 2)), rep)
dtensor.name_based_save(mesh, {tf_prefix!r}, {{'a': a, 'b': b}})
""")
    mesh1 = dtensor.create_mesh([("z", 4)])  # another mesh: ours is not limited to one
    got = dtensor.name_based_restore(mesh, tf_prefix, {
        "a": dtensor.copy_to_mesh(np.zeros((4, 8), np.float32), dtensor.Layout(["unsharded", "z"], mesh1)),
        "b": a_like_b(mesh)})
    assert {k: v.numpy().tolist() for k, v in got.items()} == {k: v.tolist() for k, v in values.items()}


def a_like_b(mesh: dtensor.Mesh) -> Optional[dtensor.DTensor]:
    return dtensor.copy_to_mesh(np.zeros((8, 2), np.int64), dtensor.Layout(["x", "unsharded"], mesh))


def test_layout_and_mesh_protos_cross(tf_dtensor: DTensorOracle) -> None:
    mesh = dtensor.create_distributed_mesh([("x", 2), ("y", 4)], client_id=1, num_clients=2, mesh_name="m")
    layout = dtensor.Layout(["y", "unsharded"], mesh)
    layout_hex, mesh_hex = layout.as_proto().SerializeToString().hex(), mesh.as_proto().SerializeToString().hex()
    theirs = tf_dtensor.exec(f"""
from tensorflow.dtensor.proto import layout_pb2
lay = dtensor.Layout.from_proto(layout_pb2.LayoutProto.FromString(bytes.fromhex({layout_hex!r})))
mesh = dtensor.Mesh.from_proto(layout_pb2.MeshProto.FromString(bytes.fromhex({mesh_hex!r})))
result = [lay.to_string(), mesh.to_string(), lay.as_proto().SerializeToString().hex()]
""")
    assert theirs[:2] == [layout.to_string(), mesh.to_string()]
    from shardckpt.dtensor._proto import LayoutProto

    assert dtensor.Layout.from_proto(LayoutProto.FromString(bytes.fromhex(theirs[2]))) == layout
