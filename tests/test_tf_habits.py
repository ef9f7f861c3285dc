"""A TensorFlow user's habits (issue 25, "Medium"), side by side with TensorFlow 2.21.

Each test runs the same script through TF (the oracle) and through shardckpt (the
import changed) and compares what comes out: values, dtypes, orders, bytes on disk, or
the class of the exception. Deliberate differences are asserted as such and listed in
docs/differences-from-tensorflow.md.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from test_tf_parity import DTensorOracle, both, probe_ours, same_outcome, tf_dtensor  # noqa: F401 (a fixture)
from tf_oracle.client import TFOracle

import shardckpt
from shardckpt import dtensor
from shardckpt.errors import DataLossError
from shardckpt.format.protos.trackable_object_graph_pb2 import TrackableObjectGraph


def _ported(script: str) -> str:
    """A TF script with its names changed to shardckpt's (``tf.train.X`` and ``tf.X`` -> ``shardckpt.X``)."""
    return script.replace("tf.train.", "shardckpt.").replace("tf.", "shardckpt.")


def _both_ported(tf_oracle: Any, script: str, what: str = "") -> Any:
    return both(tf_oracle, script, _ported(script), what)


# -- 4. Variable is number-like ----------------------------------------------------------------------------------

NUMBER_LIKE = [
    "int(v)", "float(v)", "bool(v)", "v + 1", "1 + v", "v - 1", "2 - v", "v * 2", "v / 2", "2 / v", "v // 2",
    "v % 2", "v ** 2", "2 ** v", "-v", "abs(v)", "v < 4", "v <= 3", "v > 2", "v >= 3", "v == 3", "v != 3",
    "v & 1", "v | 4", "v ^ 1", "v.value()", "v.read_value()", "np.asarray(v)", "v.numpy()",
    "f + 1", "f * f", "f[0]", "f[0] + 1", "f == f", "np.asarray(f)", "f.numpy()", "[x for x in f]", "~b",
    "int(f)", "bool(f)", "float(tf.Variable(2.5))", "range(v)",
]


@pytest.mark.parametrize("expr", NUMBER_LIKE)
def test_variable_is_number_like_as_tf(tf_oracle: TFOracle, expr: str) -> None:
    """Same values and dtypes (TF gives tensors, shardckpt NumPy values), same exceptions."""
    script = f"""
v, f, b = tf.Variable(3), tf.Variable([1.0, 2.0]), tf.Variable(True)
r = {expr}
if isinstance(r, (bool, int, float, range)):
    result = [type(r).__name__, list(r) if isinstance(r, range) else r]
else:
    a = np.asarray([np.asarray(x) for x in r]) if isinstance(r, list) else np.asarray(r)
    result = [a.dtype.name, a.tolist()]
"""
    _both_ported(tf_oracle, script, expr)


def test_a_scalar_variables_numpy_is_a_numpy_scalar_as_tf(tf_oracle: TFOracle) -> None:
    script = """
out = []
for value in (3, 1.5, True, 2**40, "s"):
    n = tf.Variable(value).numpy()
    out.append([type(n).__name__, n.decode() if isinstance(n, bytes) else n.item()])
out.append(type(tf.Variable([1, 2]).numpy()).__name__)
result = out
"""
    tf, _ = _both_ported(tf_oracle, script)
    assert tf["result"][0] == ["int32", 3]


def test_the_guides_step_counter_idiom_runs(tf_oracle: TFOracle) -> None:
    script = """
ckpt = tf.train.Checkpoint(step=tf.Variable(1))
saved = []
for _ in range(25):
    ckpt.step.assign_add(1)
    if int(ckpt.step) % 10 == 0:
        saved.append(int(ckpt.step))
ckpt.step.assign_sub(3)
ckpt.step.assign(ckpt.step + 1)
result = [saved, int(ckpt.step), str(ckpt.step.numpy().dtype), bool(ckpt.step > 20)]
"""
    tf, _ = _both_ported(tf_oracle, script)
    assert tf["result"] == [[10, 20], 24, "int32", True]


def test_numpy_functions_of_a_variable_do_not_take_its_buffer() -> None:
    """Operators read the value without handing out the live buffer (incremental saves keep trusting
    the variable's version), and ``out=`` a variable counts as a write."""
    v = shardckpt.Variable(np.arange(4, dtype=np.float32))
    assert (v + 1).tolist() == [1, 2, 3, 4] and (np.float32(2) * v).tolist() == [0, 2, 4, 6]
    assert np.sum(v) == 6 and v[1:3].tolist() == [1, 2]
    assert v._token_proves_unchanged()
    before = v.version
    np.add(v, 1, out=v)
    assert v.numpy().tolist() == [1, 2, 3, 4] and v.version == before + 1


# -- 5. Module is tf.Module --------------------------------------------------------------------------------------

MODULE_SCRIPT = """
class Sub(tf.Module):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.w = tf.Variable(8.0, name="w")


class MyModel(tf.Module):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.z = tf.Variable(1.0, name="z")
        self.a = tf.Variable(2.0, name="a", trainable=False)
        with self.name_scope:
            self.inner = tf.Variable(3.0, name="inner")
        self.sub = Sub(name="first_sub")
        self.lst = [tf.Variable(4.0, name="l0"), Sub(name="second_sub"), self.z]
        self.d = {"b": tf.Variable(5.0, name="db"), "a": tf.Variable(6.0, name="da"), "n": Sub(name="in_dict")}
        self._priv = tf.Variable(7.0, name="priv")
        self.t = (tf.Variable(9.0, name="t0", trainable=False),)


def names(xs):
    return [x.name.split(":")[0] for x in xs]


class CamelCaseHTTPModel(tf.Module):
    pass


m = MyModel()
result = {
    "name": m.name, "scope": m.name_scope.name, "variables": names(m.variables),
    "trainable": names(m.trainable_variables), "non_trainable": names(m.non_trainable_variables),
    "submodules": names(m.submodules), "types": [type(m.variables).__name__, type(m.submodules).__name__],
    "default_names": [tf.Module().name, CamelCaseHTTPModel().name, Sub().name, tf.Module(name="x_1").name],
    "sub_scope": m.sub.name_scope.name, "inner": m.inner.name.split(":")[0],
    "checkpoint_is_no_module": [hasattr(tf.train.Checkpoint(), attr) for attr in ("name", "variables")],
}
"""


def test_module_surface_and_order_as_tf(tf_oracle: TFOracle) -> None:
    tf, _ = _both_ported(tf_oracle, MODULE_SCRIPT)
    assert tf["result"]["variables"][:3] == ["priv", "a", "da"]  # sorted by attribute name, dicts by key
    assert tf["result"]["submodules"] == ["in_dict", "second_sub", "first_sub"]


@pytest.mark.parametrize("name", ["'bad name'", "'1x'", "'a/b'", "''"])
def test_module_names_must_be_identifiers_as_tf(tf_oracle: TFOracle, name: str) -> None:
    _both_ported(tf_oracle, f"tf.Module(name={name})")


def test_module_name_is_read_only_and_checkpoint_takes_a_child_called_name(tf_oracle: TFOracle) -> None:
    _both_ported(tf_oracle, "m = tf.Module(name='m')\nm.name = 'other'")
    _both_ported(tf_oracle, "c = tf.train.Checkpoint(name=tf.Variable(1.0))\nresult = float(c.name.numpy())")


def test_name_scoped_variables_are_saved_as_tf_saves_them(tf_oracle: TFOracle, tmp_path: Path) -> None:
    """Variables created in a module's name scope record ``<module>/<name>`` as TF does: the files are TF's bytes."""
    script = MODULE_SCRIPT.split("def names")[0] + "path = tf.train.Checkpoint(model=MyModel()).write(PREFIX)"
    tf_oracle.exec(script.replace("PREFIX", repr(str(tmp_path / "tf" / "ck"))))
    exec(_ported(script).replace("PREFIX", repr(str(tmp_path / "ours" / "ck"))), {"shardckpt": shardckpt})
    for suffix in (".index", ".data-00000-of-00001"):
        assert (tmp_path / "ours" / f"ck{suffix}").read_bytes() == (tmp_path / "tf" / f"ck{suffix}").read_bytes()


# -- 6. DTensor helpers and DVariable.assign ----------------------------------------------------------------------

DTENSOR_HELPERS = """
mesh = dtensor.create_mesh([('x', 2), ('y', 4)], devices=['CPU:%d' % i for i in range(8)])
lay = dtensor.Layout(['x', 'unsharded', 'y'], mesh)
out = [list(lay.shape), dtensor.Layout(['unsharded'], dtensor.create_mesh([('z', 8)], device_type='CPU')).shape]
for dims in ([0], [1], [0, 2], [2, 0], [5], [-1], 1, [0, 1, 2]):
    out.append(lay.delete(dims).to_string())
out.append(mesh.local_device_locations())
out.append([mesh.device_location(i) for i in (0, 5, 7)])
out.append(mesh.num_local_devices())
devices = ['CPU:%d' % i for i in range(8)]
out.append([mesh == dtensor.create_mesh([('x', 2), ('y', 4)], devices=devices),
            mesh == dtensor.create_mesh([('x', 2), ('y', 4)], devices=devices, mesh_name='other'),
            mesh == dtensor.create_mesh([('a', 2), ('b', 4)], devices=devices)])  # a mesh's name counts
out.append([dtensor.job_name(), dtensor.num_local_devices('CPU'), dtensor.num_local_devices('cpu'),
            [str(d.to_string() if hasattr(d, 'to_string') else d) for d in dtensor.local_devices('CPU')],
            [str(d.to_string() if hasattr(d, 'to_string') else d) for d in dtensor.local_devices('CPU', 0)]])
result = out
"""


def test_dtensor_helpers_of_tfs_tutorial(tf_dtensor: DTensorOracle) -> None:  # noqa: F811
    """``Layout.shape`` (the mesh's), ``Layout.delete``, device locations and the client's devices as TF.

    TF counts the logical devices configured (8 here); shardckpt has no devices, so the count is the
    default mesh's (a documented difference): our script runs inside ``default_mesh(mesh)``.
    """
    tf = tf_dtensor.probe(DTENSOR_HELPERS)
    ours_script = DTENSOR_HELPERS.replace("out.append([dtensor.job_name()", "with dtensor.default_mesh(mesh):\n"
                                          "    out.append([dtensor.job_name()")
    ours = probe_ours(ours_script)
    same_outcome(tf, ours)
    assert tf["result"][0] == [2, 4] and tf["result"][-1][1] == 8 and tf["result"][-2] == [True, False, False]
    for call in ("result = dtensor.num_local_devices('XPU')", "dtensor.local_devices('XPU')"):
        both(tf_dtensor, call, call)
    assert dtensor.num_local_devices("CPU") == 1 and dtensor.num_local_devices("GPU") == 0  # TF with none set up


ASSIGN_CASES = {
    "replicated, same mesh": "make(tf_ones, dtensor.Layout.replicated(mesh, 2), (4, 4))",
    "same layout": "make(tf_ones, lay, (4, 4))",
    "another layout, same mesh": "make(tf_ones, dtensor.Layout(['unsharded', 'y'], mesh), (4, 4))",
    "an equal mesh made again": "make(tf_ones, dtensor.Layout.replicated(same, 2), (4, 4))",
    "another mesh name": "make(tf_ones, dtensor.Layout.replicated(named, 2), (4, 4))",
    "other dimension names": "make(tf_ones, dtensor.Layout.replicated(renamed, 2), (4, 4))",
    "wrong shape": "make(tf_ones, dtensor.Layout.replicated(mesh, 2), (2, 2))",
    "wrong dtype": "make(tf_ones_int, dtensor.Layout.replicated(mesh, 2), (4, 4))",
    "a DVariable": "dtensor.DVariable(make(tf_ones, lay, (4, 4)))",
}
ASSIGN_SCRIPT = """
devices = ['CPU:%d' % i for i in range(8)]
mesh = dtensor.create_mesh([('x', 2), ('y', 4)], devices=devices)
same = dtensor.create_mesh([('x', 2), ('y', 4)], devices=devices)
named = dtensor.create_mesh([('x', 2), ('y', 4)], devices=devices, mesh_name='other')
renamed = dtensor.create_mesh([('a', 2), ('b', 4)], devices=devices)
lay = dtensor.Layout(['x', 'unsharded'], mesh)
{prelude}
v = dtensor.DVariable(make(tf_zeros, lay, (4, 4)))
try:
    v.assign({value})
    r = v.read_value()
    result = ['accepted', dtensor.fetch_layout(r) == lay, [float(np.asarray(c).sum()) for c in dtensor.unpack(r)]]
except Exception as e:
    result = ['refused', type(e).__name__]
"""
TF_PRELUDE = """
tf_ones, tf_zeros, tf_ones_int = tf.ones, tf.zeros, lambda shape: tf.ones(shape, tf.int32)
def make(fn, layout, shape):
    return dtensor.call_with_layout(fn, layout, list(shape))
"""
OUR_PRELUDE = """
tf_ones, tf_zeros, tf_ones_int = np.ones, np.zeros, lambda shape: np.ones(shape, np.int32)
def make(fn, layout, shape):
    return dtensor.from_global(np.asarray(fn(shape), np.float32 if fn is not tf_ones_int else np.int32), layout)
"""


@pytest.mark.parametrize("case", sorted(ASSIGN_CASES))
def test_dvariable_assign_accepts_and_refuses_what_tf_does(tf_dtensor: DTensorOracle,  # noqa: F811
                                                           case: str) -> None:
    tf = tf_dtensor.exec(ASSIGN_SCRIPT.format(prelude=TF_PRELUDE, value=ASSIGN_CASES[case]))
    ours = probe_ours(ASSIGN_SCRIPT.format(prelude=OUR_PRELUDE, value=ASSIGN_CASES[case]))["result"]
    assert tf[0] == ours[0], (case, tf, ours)
    if tf[0] == "accepted":
        assert tf == ours == ["accepted", True, [8.0] * 8], case  # the variable keeps its layout
    elif tf[1] in ("ValueError", "InvalidArgumentError"):
        assert ours[1] == "InvalidArgumentError", (case, tf, ours)  # ValueError, TF's class for these


# -- 7. no warning for values deferred restoration fills later ----------------------------------------------------

def test_no_unrestored_warning_for_values_restored_later(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = shardckpt.Module()
    source.a, source.b = shardckpt.Variable(1.0), shardckpt.Variable([1.0, 2.0])
    path = shardckpt.Checkpoint(model=source).save(str(tmp_path / "ck"))
    caplog.set_level(logging.WARNING, logger="shardckpt")

    def reported() -> List[str]:  # about this checkpoint (gc may also finish restores of earlier tests)
        return [r.getMessage() for r in caplog.records if "not restored" in r.getMessage() and path in r.getMessage()]

    target = shardckpt.Module()
    target.a = shardckpt.Variable(0.0)
    shardckpt.Checkpoint(model=target).restore(path)  # the status is dropped at once (the guide's habit)
    gc.collect()
    target.b = shardckpt.Variable([0.0, 0.0])  # deferred restoration fills it
    gc.collect()
    assert target.b.numpy().tolist() == [1.0, 2.0]
    assert not reported()
    # a value nothing ever takes is still reported, once the restore can no longer fill it
    lonely = shardckpt.Module()
    shardckpt.Checkpoint(model=lonely).restore(path)
    gc.collect()
    assert not reported()  # still waiting for model/a and model/b
    del lonely
    gc.collect()
    assert len(reported()) == 1 and "model/a/.ATTRIBUTES" in reported()[0] and "model/b/.ATTRIBUTES" in reported()[0]
    # expect_partial() silences it, as before
    quiet = shardckpt.Module()
    shardckpt.Checkpoint(model=quiet).restore(path).expect_partial()
    del quiet
    gc.collect()
    assert len(reported()) == 1


# -- 8. namedtuples, the root self-edge, save_counter, directories -------------------------------------------------

WRITE_SCRIPT = """
NT = collections.namedtuple("NT", ["first", "second"])
m = tf.Module()
m.v = tf.Variable([1.0, 2.0])
m.pair = NT(tf.Variable(3), tf.Variable(4.5))
cases = {{"nt": tf.train.Checkpoint(nt=NT(tf.Variable(1.0), tf.Variable(2.0))),
          "root": tf.train.Checkpoint(root=m),
          "root_extra": tf.train.Checkpoint(root=m, extra=tf.Variable(3.0), more=[tf.Variable(5)])}}
result = {{name: c.write(os.path.join({d!r}, name)) for name, c in cases.items()}}
"""


def test_namedtuples_and_root_form_are_tfs_bytes(tf_oracle: TFOracle, tmp_path: Path) -> None:
    tf_paths = tf_oracle.exec("import collections\n" + WRITE_SCRIPT.format(d=str(tmp_path / "tf")))
    namespace: Dict[str, Any] = {"shardckpt": shardckpt, "collections": collections, "os": os}
    exec(_ported(WRITE_SCRIPT).format(d=str(tmp_path / "ours")), namespace)
    for name, tf_path in tf_paths.items():
        ours = namespace["result"][name]
        for suffix in (".index", ".data-00000-of-00001"):
            assert Path(ours + suffix).read_bytes() == Path(tf_path + suffix).read_bytes(), (name, suffix)
    keys = [k for k, _ in shardckpt.list_variables(namespace["result"]["nt"])]
    assert "nt/first/.ATTRIBUTES/VARIABLE_VALUE" in keys and "nt/0/.ATTRIBUTES/VARIABLE_VALUE" not in keys
    graph = TrackableObjectGraph()
    graph.ParseFromString(shardckpt.load_variable(namespace["result"]["root"], "_CHECKPOINTABLE_OBJECT_GRAPH"))
    assert ("root", 0) in [(c.local_name, c.node_id) for c in graph.nodes[0].children]
    # a namedtuple restores from TF's file by field name (and the index aliases point at the same values)
    NT = collections.namedtuple("NT", ["first", "second"])
    target = shardckpt.Checkpoint(nt=NT(shardckpt.Variable(0.0), shardckpt.Variable(0.0)))
    target.read(tf_paths["nt"]).assert_consumed()
    assert [float(v) for v in target.nt] == [1.0, 2.0]


SAVE_COUNTER_SCRIPT = """
p = tf.train.Checkpoint(v=tf.Variable(1.0)).write({p!r})
out = []
for method in ("assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match"):
    status = tf.train.Checkpoint(v=tf.Variable(0.0)).restore(p)
    try:
        getattr(status, method)()
        out.append("passes")
    except AssertionError as e:
        out.append("save_counter" in str(e))
status = tf.train.Checkpoint(v=tf.Variable(0.0)).read(p)
status.assert_consumed()
result = out
"""


def test_assert_consumed_fails_on_a_missing_save_counter_as_tf(tf_oracle: TFOracle, tmp_path: Path) -> None:
    tf, _ = both(tf_oracle, SAVE_COUNTER_SCRIPT.format(p=str(tmp_path / "tf")),
                 _ported(SAVE_COUNTER_SCRIPT).format(p=str(tmp_path / "ours")))
    assert tf["result"] == [True, True, "passes"]


@pytest.mark.parametrize("method", ["restore", "read"])
@pytest.mark.parametrize("spelling", ["{d}", "{d}/", "{d}/.", "{d}/sub/.."])
def test_a_directory_passed_to_restore_raises_as_tf(tf_oracle: TFOracle, tmp_path: Path, method: str,
                                                    spelling: str) -> None:
    script = """
tf.train.Checkpoint(v=tf.Variable(1.0)).save(os.path.join({d!r}, "ckpt"))
os.makedirs(os.path.join({d!r}, "sub"), exist_ok=True)
tf.train.Checkpoint(v=tf.Variable(0.0)).{method}({path!r})
"""
    tf_dir, our_dir = str(tmp_path / "tf"), str(tmp_path / "ours")
    tf, ours = both(tf_oracle, script.format(d=tf_dir, method=method, path=spelling.format(d=tf_dir)),
                    _ported(script).format(d=our_dir, method=method, path=spelling.format(d=our_dir)))
    assert tf["error"]["type"] == ours["error"]["type"] == "DataLossError"
    assert isinstance(DataLossError("x"), ValueError)


# -- 9. checkpoints_iterator, debug_string, the clock that went back ------------------------------------------------

ITERATOR_SCRIPT = """
d = {d!r}
tf.train.Checkpoint(v=tf.Variable(1.0)).save(os.path.join(d, "ckpt"))
calls = []
def timeout_fn():
    calls.append(len(calls))
    return len(calls) == 2
started = time.time()
seen = [os.path.basename(p) for p in tf.train.checkpoints_iterator(d, timeout=1.5, timeout_fn=timeout_fn)]
waited = time.time() - started
quick = [os.path.basename(p) for p in tf.train.checkpoints_iterator(d, timeout=0.5)]
empty = list(tf.train.checkpoints_iterator(os.path.join(d, "nothing"), timeout=0.2))
result = [seen, calls, 0.9 <= waited < 1.9, quick, empty]
"""


def test_checkpoints_iterator_times_out_and_asks_timeout_fn_as_tf(tf_oracle: TFOracle, tmp_path: Path) -> None:
    """TF asks ``timeout_fn`` after every round, a yielded checkpoint included (here: after ckpt-1, then
    after one wait of 1 s: polls are 1 s apart and none sleeps past the 1.5 s timeout)."""
    tf, ours = both(tf_oracle, "import time\n" + ITERATOR_SCRIPT.format(d=str(tmp_path / "tf")),
                    "import time\n" + _ported(ITERATOR_SCRIPT).format(d=str(tmp_path / "ours")))
    assert tf["result"] == [["ckpt-1"], [0, 1], True, ["ckpt-1"], []]


def test_checkpoints_iterator_yields_each_new_checkpoint(tmp_path: Path) -> None:
    ckpt = shardckpt.Checkpoint(v=shardckpt.Variable(0))
    seen: List[str] = []
    done = threading.Event()

    def evaluate() -> None:
        for path in shardckpt.checkpoints_iterator(str(tmp_path), timeout=4, min_interval_secs=0.2):
            seen.append(os.path.basename(path))
            if len(seen) == 3:
                break
        done.set()

    thread = threading.Thread(target=evaluate)
    thread.start()
    for step in range(3):
        ckpt.v.assign(step)
        ckpt.save(str(tmp_path / "ckpt"))
        deadline = time.time() + 10  # the next save only once the evaluator saw this one
        while len(seen) <= step and time.time() < deadline and not done.is_set():
            time.sleep(0.05)
    thread.join(20)
    assert seen == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_debug_string_is_tfs(tf_oracle: TFOracle, tf_fixtures_dir: Path, tmp_path: Path) -> None:
    script = f"""
c = tf.train.Checkpoint(a=tf.Variable([[1.0, 2.0, 3.0]]), b=tf.Variable(3), s=tf.Variable("x"),
                        h=tf.Variable(np.zeros(2, np.float16)), d=tf.Variable(np.zeros((2, 1))),
                        i=tf.Variable(np.zeros(3, np.int64)), u=tf.Variable(np.zeros(1, np.uint8)))
p = c.write({str(tmp_path / "ck")!r})
fixture = tf.train.latest_checkpoint({str(tf_fixtures_dir / "08_tf1_saver_partitioned")!r})
result = [tf.train.load_checkpoint(path).debug_string().decode("latin-1") for path in (p, fixture)]
"""
    theirs = tf_oracle.exec(script)
    paths = [str(tmp_path / "ck"), shardckpt.latest_checkpoint(str(tf_fixtures_dir / "08_tf1_saver_partitioned"))]
    ours = [shardckpt.load_checkpoint(p).debug_string() for p in paths]
    assert all(isinstance(b, bytes) for b in ours)
    assert [b.decode("latin-1") for b in ours] == theirs  # slice entries of partitioned tensors included
    assert "(DT_HALF) [2]\n" in theirs[0] and "(DT_DOUBLE) [2,1]\n" in theirs[0]


def test_the_manager_logs_a_clock_that_went_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TF logs "time.time() returned a value N seconds behind the last preserved checkpoint timestamp." and
    takes the current time as the last preserved one (so old checkpoints are not deleted early)."""
    ckpt = shardckpt.Checkpoint(v=shardckpt.Variable(1.0))
    manager = shardckpt.CheckpointManager(ckpt, str(tmp_path), max_to_keep=1, keep_checkpoint_every_n_hours=1)
    manager.save()
    text = (tmp_path / "checkpoint").read_text()  # the state file (text format): its timestamp moved ahead
    future = time.time() + 3600
    lines = [line for line in text.splitlines() if not line.startswith("last_preserved_timestamp")]
    (tmp_path / "checkpoint").write_text("\n".join(lines + [f"last_preserved_timestamp: {future}"]) + "\n")
    caplog.set_level(logging.WARNING, logger="shardckpt")
    again = shardckpt.CheckpointManager(ckpt, str(tmp_path), max_to_keep=1, keep_checkpoint_every_n_hours=1)
    warned = [r.getMessage() for r in caplog.records if "behind the last preserved checkpoint timestamp" in
              r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("time.time() returned a value ")
    seconds = float(warned[0].split("returned a value ")[1].split(" seconds")[0])
    assert 3590 < seconds <= 3600
    assert again._last_preserved_timestamp <= time.time()
