"""DTensor checkpoints against real TensorFlow 2.21 DTensor on 8 logical CPUs (spec §10).

(a) TensorFlow reads what shardckpt writes: ``sharded_save`` and ``DTensorCheckpoint`` on a
    single-client 2x4 mesh, every layout (sharded on x, on y, on both, transposed, partially and
    fully replicated) and four dtypes, read by ``tf.train.load_checkpoint`` and restored by TF
    DTensor into DVariables with *other* layouts (mesh (a,2),(b,4) layout [b,a]; a 1-D z=8 mesh),
    through ``tf.train.Checkpoint`` and ``dtensor.DTensorCheckpoint``, and into plain variables.
(b) shardckpt restores what TensorFlow DTensor writes (``DTensorCheckpoint``, and
    ``tf.train.Checkpoint`` of DVariables) onto other meshes/layouts and plain Variables; the
    files are laid out as in spec §10's table.
(c) ``shardckpt.dtensor.sharded_save`` against ``tf.experimental.dtensor.sharded_save`` for the
    same mesh, layouts and values: same keys, slices per key and values, same files.

TensorFlow DTensor needs its 8 logical CPUs configured before any other TF op, so all TF work
runs in one fresh TF process (not the shared ``tf_oracle``), fed through npz/JSON files.

TF DTensor facts checked here (TF 2.21):

* TF numbers the data files by device id (device k's file is shard k when every device
  writes); shardckpt's ``ShardByDevicePolicy`` numbers them in order of first appearance. Both
  group the same slices into the same files, so the comparison is of the partition.
* A layout sharded only over mesh dimensions of size 1 is one whole entry in TF too; a dimension
  sharded over a size-1 mesh dimension is spelled ``0,n`` while unsharded ones are ``-``.
* ``tf.train.Checkpoint`` of DVariables puts non-DTensor values (``save_counter``, the object
  graph, plain variables) in one extra, CPU-task file; ``DTensorCheckpoint`` puts them in
  device 0's file.
* TF restores slices written with an explicit full extent (``0,4:0,16``) just as well as ``-``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Dict, FrozenSet, List, Tuple

import ml_dtypes
import numpy as np
import pytest
from tf_oracle.client import find_tf_python

from shardckpt import Checkpoint, Variable
from shardckpt import dtensor as dt
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.tensor_slice import full_box
from shardckpt.storage.location import Location

U = dt.UNSHARDED
SHAPE = (8, 16)
VALUE_KEY = "/.ATTRIBUTES/VARIABLE_VALUE"

# layouts on the 2x4 mesh (x, y); TF's DTensorCheckpoint uses the same layouts on (a, b)
LAYOUTS: Dict[str, List[str]] = {
    "on_x": ["x", U], "on_y": [U, "y"], "on_xy": ["x", "y"], "on_yx": ["y", "x"], "rep": [U, U],
}
DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16), "i64": np.dtype(np.int64),
          "bool": np.dtype(np.bool_)}
NAMES = [f"{d}_{lay}" for d in DTYPES for lay in LAYOUTS]
RENAME_AB = {"x": "a", "y": "b", U: U}


def spec_of(name: str) -> List[str]:
    return LAYOUTS[name.split("_", 1)[1]]


def dtype_of(name: str) -> np.dtype:
    return DTYPES[name.split("_", 1)[0]]


def make_values() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(2024)
    out = {}
    for name in NAMES:
        dtype = dtype_of(name)
        if dtype == np.bool_:
            out[name] = rng.integers(0, 2, SHAPE).astype(bool)
        elif dtype == np.int64:
            out[name] = rng.integers(-2**62, 2**62, SHAPE, dtype=np.int64)
        else:
            out[name] = rng.standard_normal(SHAPE).astype(dtype)
    out["plain"] = rng.standard_normal((3, 5)).astype(np.float32)
    out["two_d"] = rng.standard_normal(SHAPE).astype(np.float32)
    return out


TF_SCRIPT = r'''
import json, os, sys
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor

cfg = json.load(open(sys.argv[1]))
U = dtensor.UNSHARDED
BF16 = tf.bfloat16.as_numpy_dtype


def np_dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


raw = np.load(cfg["values"])
values = {k: (raw[k].view(BF16) if cfg["dtypes"][k] == "bfloat16" else raw[k]) for k in raw.files}
arrays, dtypes = {}, {}
results = {"listings": {}, "errors": {}, "paths": {}, "keys": {}}


def record(key, arr):
    arr = np.asarray(arr)
    dtypes[key] = arr.dtype.name
    arrays[key] = arr.view(np.uint16) if arr.dtype.name == "bfloat16" else arr


meshes = {}


def mesh_of(dims):
    key = json.dumps(dims)
    if key not in meshes:
        meshes[key] = dtensor.create_mesh([tuple(d) for d in dims], device_type="CPU")
    return meshes[key]


def box(spec, mesh, device, shape):
    coords = dict(zip(mesh.dim_names, np.unravel_index(device, mesh.shape())))
    out = []
    for s, n in zip(spec, shape):
        if s == U:
            out.append(slice(0, n))
        else:
            b = n // mesh.dim_size(s)
            i = int(coords[s])
            out.append(slice(i * b, (i + 1) * b))
    return tuple(out)


def dtensor_of(arr, spec, mesh):
    parts = [arr[box(spec, mesh, d, arr.shape)] for d in range(mesh.num_local_devices())]
    return dtensor.pack(parts, dtensor.Layout(spec, mesh))


def build(job, init):
    objs = {}
    for name, v in job["vars"].items():
        arr = init(name, v)
        if v.get("spec") is None:
            objs[name] = tf.Variable(arr)
        else:
            objs[name] = dtensor.DVariable(dtensor_of(arr, v["spec"], mesh_of(v.get("mesh", job["mesh"]))))
    return objs


for job in cfg["read"]:
    reader = tf.train.load_checkpoint(job["prefix"])
    keys = sorted(reader.get_variable_to_shape_map())
    results["keys"][job["tag"]] = keys
    for key in keys:
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            record(f"read/{job['tag']}/{key}", reader.get_tensor(key))

for job in cfg["restore"]:
    tag = job["tag"]
    objs = build(job, lambda name, v: np.zeros(v["shape"], np_dtype(v["dtype"])))
    try:
        if job["how"] == "dtensor_checkpoint":
            ckpt = dtensor.DTensorCheckpoint(mesh_of(job["mesh"]), **objs)
        else:
            ckpt = tf.train.Checkpoint(**objs)
        status = ckpt.restore(job["prefix"])
        status.assert_existing_objects_matched()
    except Exception as exc:
        results["errors"][tag] = f"{type(exc).__name__}: {exc}"
        continue
    for name, obj in objs.items():
        if isinstance(obj, dtensor.DVariable):
            for d, c in enumerate(dtensor.unpack(obj.read_value())):
                record(f"restore/{tag}/{name}/{d}", c.numpy())
        else:
            record(f"restore/{tag}/{name}", obj.numpy())

for job in cfg["write"]:
    tag, prefix = job["tag"], job["prefix"]
    try:
        objs = build(job, lambda name, v: values[v["value"]])
        if job["how"] == "checkpoint":
            path = tf.train.Checkpoint(**objs).save(prefix)
        elif job["how"] == "dtensor_checkpoint":
            path = dtensor.DTensorCheckpoint(mesh_of(job["mesh"]), **objs).save(prefix)
        else:
            names = list(objs)
            dtensor.sharded_save(mesh_of(job["mesh"]), prefix, names, [""] * len(names),
                                 [objs[n].read_value() for n in names])
            path = prefix
        results["paths"][tag] = path
    except Exception as exc:
        results["errors"][tag] = f"{type(exc).__name__}: {exc}"[:2000]
    folder = os.path.dirname(prefix)
    results["listings"][tag] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []

np.savez(cfg["out_arrays"], **arrays)
results["dtypes"] = dtypes
with open(cfg["out_json"], "w") as f:
    json.dump(results, f)
'''


class TFRun:
    """Paths and results of the one TF DTensor process of this module."""

    def __init__(self, root: Path, values: Dict[str, np.ndarray], results: dict, arrays: Dict[str, np.ndarray]):
        self.root = root
        self.values = values
        self.results = results
        self.arrays = arrays

    def array(self, key: str) -> np.ndarray:
        arr = self.arrays[key]
        return arr.view(ml_dtypes.bfloat16) if self.results["dtypes"][key] == "bfloat16" else arr

    def prefix(self, tag: str) -> str:
        assert tag not in self.results["errors"], self.results["errors"][tag]
        return self.results["paths"][tag]

    def data_files(self, tag: str) -> List[str]:
        return [f for f in self.results["listings"][tag] if ".data-" in f]


def _var(value: str, spec) -> dict:
    return {"value": value, "spec": spec}


def _target(name: str, spec, values) -> dict:
    return {"spec": spec, "shape": list(values[name].shape), "dtype": values[name].dtype.name}


@pytest.fixture(scope="module")
def tf_run(tmp_path_factory) -> TFRun:
    root = tmp_path_factory.mktemp("dtensor_tf")
    values = make_values()
    mesh = dt.create_mesh([("x", 2), ("y", 4)])

    # --- shardckpt writes (a, c) ------------------------------------------------------------
    s1 = dt.sharded_save(mesh, str(root / "sc_sharded" / "ck"), NAMES, [""] * len(NAMES),
                         [dt.from_global(values[n], dt.Layout(spec_of(n), mesh)) for n in NAMES])
    s1b = dt.sharded_save(mesh, str(root / "sc_sharded_x" / "ck"), ["f32_on_x", "f32_rep"], ["", ""],
                          [dt.from_global(values[n], dt.Layout(spec_of(n), mesh)) for n in ("f32_on_x", "f32_rep")])
    dvars = {n: dt.DVariable.from_global(values[n], dt.Layout(spec_of(n), mesh)) for n in NAMES}
    s2 = dt.DTensorCheckpoint(mesh, plain=Variable(values["plain"]), **dvars).save(str(root / "sc_dck" / "ck"))
    mesh8 = dt.create_mesh([("z", 8)])
    s3 = dt.DTensorCheckpoint(mesh, p=dt.DVariable.from_global(values["f32_on_xy"], dt.Layout(["x", "y"], mesh)),
                              q=dt.DVariable.from_global(values["f32_on_y"], dt.Layout([U, "z"], mesh8))
                              ).save(str(root / "sc_mixed" / "ck"))

    m24, mab, m8 = [["x", 2], ["y", 4]], [["a", 2], ["b", 4]], [["z", 8]]
    restore_ba = {n: _target(n, ["b", "a"], values) for n in NAMES}
    restore_z = {n: _target(n, [U, "z"], values) for n in NAMES}
    cfg = {
        "values": str(root / "values.npz"),
        "dtypes": {k: v.dtype.name for k, v in values.items()},
        "out_arrays": str(root / "tf_arrays.npz"),
        "out_json": str(root / "tf_results.json"),
        "read": [{"tag": "sharded", "prefix": s1}, {"tag": "dck", "prefix": s2}, {"tag": "mixed", "prefix": s3}],
        "restore": [
            {"tag": "ba_ckpt", "how": "checkpoint", "prefix": s2, "mesh": mab,
             "vars": {**restore_ba, "plain": _target("plain", None, values)}},
            {"tag": "z_dck", "how": "dtensor_checkpoint", "prefix": s2, "mesh": m8, "vars": restore_z},
            {"tag": "plain_vars", "how": "checkpoint", "prefix": s2, "mesh": m8,
             "vars": {n: _target(n, None, values) for n in NAMES}},
            {"tag": "mixed_z", "how": "checkpoint", "prefix": s3, "mesh": m8,
             "vars": {"p": _target("f32_on_xy", ["z", U], values), "q": _target("f32_on_y", [U, U], values)}},
        ],
        "write": [
            {"tag": "T1", "how": "checkpoint", "prefix": str(root / "tf_T1" / "ck"), "mesh": m8,
             "vars": {"s": _var("f32_on_x", ["z", U]), "r": _var("f32_rep", [U, U]), "p": _var("plain", None)}},
            {"tag": "T2", "how": "checkpoint", "prefix": str(root / "tf_T2" / "ck"), "mesh": mab,
             "vars": {"v": _var("f32_on_x", ["a", U])}},
            {"tag": "T3", "how": "dtensor_checkpoint", "prefix": str(root / "tf_T3" / "ck"), "mesh": mab,
             "vars": {n: _var(n, [RENAME_AB[s] for s in spec_of(n)]) for n in NAMES}},
            {"tag": "T4", "how": "checkpoint", "prefix": str(root / "tf_T4" / "ck"), "mesh": mab,
             "vars": {"two_d": _var("two_d", ["a", "b"])}},
            {"tag": "tf_sharded", "how": "sharded_save", "prefix": str(root / "tf_sharded" / "ck"), "mesh": m24,
             "vars": {n: _var(n, spec_of(n)) for n in NAMES}},
            {"tag": "tf_sharded_x", "how": "sharded_save", "prefix": str(root / "tf_sharded_x" / "ck"),
             "mesh": m24, "vars": {n: _var(n, spec_of(n)) for n in ("f32_on_x", "f32_rep")}},
            {"tag": "tf_mixed", "how": "checkpoint", "prefix": str(root / "tf_mixed" / "ck"), "mesh": m24,
             "vars": {"p": _var("f32_on_xy", ["x", "y"]), "q": {**_var("f32_on_y", [U, "z"]), "mesh": m8}}},
        ],
    }
    np.savez(cfg["values"], **{k: (v.view(np.uint16) if v.dtype == ml_dtypes.bfloat16 else v)
                               for k, v in values.items()})
    (root / "cfg.json").write_text(json.dumps(cfg))
    script = root / "tf_dtensor_job.py"
    script.write_text(TF_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([find_tf_python(), str(script), str(root / "cfg.json")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"TF DTensor job failed:\n{proc.stderr[-6000:]}"
    results = json.loads(Path(cfg["out_json"]).read_text())
    with np.load(cfg["out_arrays"]) as npz:
        arrays = {k: npz[k] for k in npz.files}
    run = TFRun(root, values, results, arrays)
    run.paths = {"sc_sharded": s1, "sc_sharded_x": s1b, "sc_dck": s2, "sc_mixed": s3}  # type: ignore[attr-defined]
    return run


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


def assert_tf_components(run: TFRun, tag: str, name: str, expected: np.ndarray, mesh: dt.Mesh, spec) -> None:
    """TF's unpacked component of device d is box(d) of ``expected`` (device ids match shardckpt's)."""
    layout = dt.Layout(spec, mesh)
    for d in range(mesh.size):
        box = layout.box(d, expected.shape)
        assert_bits_equal(run.array(f"restore/{tag}/{name}/{d}"), expected[tuple(slice(a, b) for a, b in box)],
                          f"{tag}/{name} device {d}")


def pieces(prefix: str) -> Dict[str, Dict[Tuple, int]]:
    """key -> {box: data file} of every stored tensor (whole entries: the full box)."""
    reader = BundleReader(Location.of(prefix))
    out = {}
    for kb in reader.keys():
        key = kb.decode()
        out[key] = {p.box: p.entry.shard_id for p in reader.pieces(kb)}
    return out


def partition(prefix: str, keys) -> FrozenSet[FrozenSet[Tuple[str, Tuple]]]:
    """Which (key, box) pieces share a data file, ignoring how the files are numbered."""
    files: Dict[int, set] = {}
    for key, boxes in pieces(prefix).items():
        if key in keys:
            for box, shard in boxes.items():
                files.setdefault(shard, set()).add((key, box))
    return frozenset(frozenset(group) for group in files.values())


# =============================================================================================
# (a) TensorFlow reads and restores what shardckpt writes
# =============================================================================================
def test_tensorflow_load_checkpoint_reads_shardckpt_dtensor_saves_exactly(tf_run: TFRun) -> None:
    values = tf_run.values
    assert tf_run.results["keys"]["sharded"] == sorted(NAMES)
    for name in NAMES:
        assert_bits_equal(tf_run.array(f"read/sharded/{name}"), values[name], f"sharded_save {name}")
        assert_bits_equal(tf_run.array(f"read/dck/{name}{VALUE_KEY}"), values[name], f"DTensorCheckpoint {name}")
    assert_bits_equal(tf_run.array(f"read/dck/plain{VALUE_KEY}"), values["plain"], "plain")
    assert int(tf_run.array(f"read/dck/save_counter{VALUE_KEY}")) == 1
    assert_bits_equal(tf_run.array(f"read/mixed/p{VALUE_KEY}"), values["f32_on_xy"], "mixed p")
    assert_bits_equal(tf_run.array(f"read/mixed/q{VALUE_KEY}"), values["f32_on_y"], "mixed q")


def test_tensorflow_dtensor_restores_shardckpt_checkpoint_onto_other_layouts(tf_run: TFRun) -> None:
    restore_errors = {k: v for k, v in tf_run.results["errors"].items() if k != "tf_mixed"}
    assert not restore_errors, restore_errors
    values = tf_run.values
    mab = dt.create_mesh([("a", 2), ("b", 4)])
    m8 = dt.create_mesh([("z", 8)])
    for name in NAMES:
        # tf.train.Checkpoint, mesh (a,2),(b,4), layout [b, a]
        assert_tf_components(tf_run, "ba_ckpt", name, values[name], mab, ["b", "a"])
        # dtensor.DTensorCheckpoint, 1-D mesh z=8, layout [., z]
        assert_tf_components(tf_run, "z_dck", name, values[name], m8, [U, "z"])
        # into plain tf.Variables
        assert_bits_equal(tf_run.array(f"restore/plain_vars/{name}"), values[name], f"plain {name}")
    assert_bits_equal(tf_run.array("restore/ba_ckpt/plain"), values["plain"], "plain variable")
    # the checkpoint mixing two meshes (which TF itself cannot write) restores in TF
    assert_tf_components(tf_run, "mixed_z", "p", values["f32_on_xy"], m8, ["z", U])
    assert_tf_components(tf_run, "mixed_z", "q", values["f32_on_y"], m8, [U, U])


# =============================================================================================
# (b) shardckpt restores what TensorFlow DTensor writes
# =============================================================================================
def test_tensorflow_dtensor_file_layout_matches_the_spec_table(tf_run: TFRun) -> None:
    assert len(tf_run.data_files("T1")) == 9   # 8 device shards + 1 CPU shard (plain, save_counter, graph)
    assert len(tf_run.data_files("T2")) == 3   # devices 0 and 4, plus the CPU shard
    assert len(tf_run.data_files("T3")) == 8   # DTensorCheckpoint: non-DTensor values in device 0's file
    assert len(tf_run.data_files("T4")) == 9
    assert len(tf_run.data_files("tf_sharded")) == 8
    assert len(tf_run.data_files("tf_sharded_x")) == 2  # devices that write nothing leave no files
    # one checkpoint cannot mix DVariables of two meshes in TF; nothing is written
    assert "must have same mesh configuration" in tf_run.results["errors"]["tf_mixed"]
    assert not tf_run.results["listings"]["tf_mixed"]
    # what TF stored: one slice per distinct shard, in the file of the lowest device holding it
    mab = dt.create_mesh([("a", 2), ("b", 4)])
    stored = pieces(tf_run.prefix("T3"))
    for name in NAMES:
        layout = dt.Layout([RENAME_AB[s] for s in spec_of(name)], mab)
        distinct = layout.distinct_boxes(SHAPE)
        got = stored[f"{name}{VALUE_KEY}"]
        assert set(got) == set(distinct), name
        if layout.is_fully_replicated():
            assert BundleReader(Location.of(tf_run.prefix("T3"))).entry(f"{name}{VALUE_KEY}").slices == []
        for box, shard in got.items():
            assert shard == distinct[box][0], (name, box)  # all 8 devices write: file k = device k
    assert stored[f"save_counter{VALUE_KEY}"] == {(): 0}


def test_shardckpt_restores_tensorflow_dtensor_checkpoints_onto_other_layouts(tf_run: TFRun) -> None:
    values = tf_run.values
    prefix = tf_run.prefix("T3")
    # onto a 1-D mesh of 4, transposed, and onto the 2x4 mesh with every layout swapped
    m4 = dt.create_mesh([("p", 4)])
    targets = {n: dt.DVariable.from_global(np.zeros(SHAPE, dtype_of(n)), dt.Layout([U, "p"], m4)) for n in NAMES}
    dt.DTensorCheckpoint(m4, **targets).restore(prefix).assert_consumed()
    m24 = dt.create_mesh([("x", 2), ("y", 4)])
    swapped = {n: dt.DVariable.from_global(np.zeros(SHAPE, dtype_of(n)), dt.Layout(
        LAYOUTS[{"on_x": "on_y", "on_y": "on_x", "on_xy": "on_yx", "on_yx": "on_xy", "rep": "on_xy"}[
            n.split("_", 1)[1]]], m24)) for n in NAMES}
    Checkpoint(**swapped).restore(prefix).assert_consumed()
    for group in (targets, swapped):
        for name, var in group.items():
            for device, component in var.value().components.items():
                box = var.value().box(device)
                assert_bits_equal(component, values[name][tuple(slice(a, b) for a, b in box)], f"{name}@{device}")
    # one client of four reads its own pieces
    remote = dt.create_distributed_mesh([("q", 8)], client_id=3, num_clients=4)
    mine = {n: dt.DVariable.from_global(np.zeros(SHAPE, dtype_of(n)), dt.Layout(["q", U], remote)) for n in NAMES}
    dt.DTensorCheckpoint(remote, **mine).restore(prefix).assert_consumed()
    for name, var in mine.items():
        assert sorted(var.value().components) == [6, 7]
        assert_bits_equal(var.components()[1], values[name][7:8], name)
    # into plain Variables
    plain = {n: Variable(np.zeros(SHAPE, dtype_of(n))) for n in NAMES}
    Checkpoint(**plain).restore(prefix).assert_consumed()
    for name, var in plain.items():
        assert_bits_equal(var.numpy(), values[name], name)


def test_shardckpt_restores_tensorflow_checkpoints_of_dvariables(tf_run: TFRun) -> None:
    values = tf_run.values
    m24 = dt.create_mesh([("x", 2), ("y", 4)])
    # T1: s [z,.] and r replicated on z=8, plain p -> onto 2x4 with other layouts, p into a DVariable
    s = dt.DVariable.from_global(np.zeros(SHAPE, np.float32), dt.Layout([U, "y"], m24))
    r = dt.DVariable.from_global(np.zeros(SHAPE, np.float32), dt.Layout(["y", "x"], m24))
    p = dt.DVariable.from_global(np.zeros((3, 5), np.float32), dt.Layout([U, U], m24))
    Checkpoint(s=s, r=r, p=p).restore(tf_run.prefix("T1")).assert_consumed()
    for var, name in ((s, "f32_on_x"), (r, "f32_rep"), (p, "plain")):
        for device, component in var.value().components.items():
            assert_bits_equal(component, values[name][tuple(slice(a, b) for a, b in var.value().box(device))], name)
    # T2 ([a,.] on 2x4: 2 slices) and T4 ([a,b]) onto a one-device mesh and plain Variables
    m1 = dt.create_mesh([("s", 1)])
    v = dt.DVariable.from_global(np.zeros(SHAPE, np.float32), dt.Layout(["s", U], m1))
    dt.DTensorCheckpoint(m1, v=v).restore(tf_run.prefix("T2")).assert_consumed()
    assert_bits_equal(v.components()[0], values["f32_on_x"], "T2")
    two_d = Variable(np.zeros(SHAPE, np.float32))
    Checkpoint(two_d=two_d).restore(tf_run.prefix("T4")).assert_consumed()
    assert_bits_equal(two_d.numpy(), values["two_d"], "T4")
    assert set(pieces(tf_run.prefix("T2"))[f"v{VALUE_KEY}"]) == {((0, 4), (0, 16)), ((4, 8), (0, 16))}
    assert len(pieces(tf_run.prefix("T4"))[f"two_d{VALUE_KEY}"]) == 8


# =============================================================================================
# (c) shardckpt's sharded_save against TF's
# =============================================================================================
@pytest.mark.parametrize("ours, theirs", [("sc_sharded", "tf_sharded"), ("sc_sharded_x", "tf_sharded_x")])
def test_sharded_save_matches_tensorflow(tf_run: TFRun, ours: str, theirs: str) -> None:
    mine, tf_prefix = tf_run.paths[ours], tf_run.prefix(theirs)  # type: ignore[attr-defined]
    ours_pieces, tf_pieces = pieces(mine), pieces(tf_prefix)
    assert sorted(ours_pieces) == sorted(tf_pieces)  # same keys
    a, b = BundleReader(Location.of(mine)), BundleReader(Location.of(tf_prefix))
    for key in tf_pieces:
        assert set(ours_pieces[key]) == set(tf_pieces[key]), key  # same slices (order may differ)
        assert bool(a.entry(key).slices) == bool(b.entry(key).slices), key  # whole entry in both or neither
        assert a.dtype(key) == b.dtype(key) and a.shape(key) == b.shape(key), key
        assert_bits_equal(a.read(key), b.read(key), key)
        assert_bits_equal(a.read(key), tf_run.values[key], key)
    assert a.num_shards == b.num_shards
    assert partition(mine, tf_pieces) == partition(tf_prefix, tf_pieces)  # the same slices share a file
    assert len([f for f in os.listdir(os.path.dirname(mine)) if ".data-" in f]) == len(tf_run.data_files(theirs))


def test_sharded_save_slice_specs_match_tensorflow(tf_run: TFRun) -> None:
    """TF writes unsharded dimensions as ``-`` (spec §6.2, §10): the slice specs, and so the
    slice keys and TensorSliceProtos in the index, should be the same as TF's."""
    a, b = BundleReader(Location.of(tf_run.paths["sc_sharded"])), BundleReader(Location.of(tf_run.prefix("tf_sharded")))  # type: ignore
    for name in NAMES:
        ours = sorted(p.slice_spec or "" for p in a.pieces(name))
        theirs = sorted(p.slice_spec or "" for p in b.pieces(name))
        assert ours == theirs, name
    assert sorted(a.keys(include_slices=True)) == sorted(b.keys(include_slices=True))


def test_dtensor_checkpoint_file_layout_matches_tensorflow(tf_run: TFRun) -> None:
    """shardckpt's DTensorCheckpoint and TF's, same tensors: same number of files, the same pieces
    grouped in the same files (non-DTensor values with device 0's pieces)."""
    ours, theirs = tf_run.paths["sc_dck"], tf_run.prefix("T3")  # type: ignore[attr-defined]
    keys = {f"{n}{VALUE_KEY}" for n in NAMES} | {f"save_counter{VALUE_KEY}"}
    assert BundleReader(Location.of(ours)).num_shards == BundleReader(Location.of(theirs)).num_shards == 8
    assert {k: set(v) for k, v in pieces(ours).items() if k in keys} == \
        {k: set(v) for k, v in pieces(theirs).items() if k in keys}
    assert partition(ours, keys) == partition(theirs, keys)
    assert full_box(()) in pieces(ours)[f"save_counter{VALUE_KEY}"]
