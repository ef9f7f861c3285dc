"""TensorFlow's training-checkpoints guide, cell by cell, through TensorFlow 2.21 and through shardckpt.

The guide (tensorflow/docs, ``site/en/guide/checkpoint.ipynb``) is the first thing a TF user
runs. Its code cells are below as the guide writes them (Apache-2.0 text of the TensorFlow
authors: the data under test, not test code). Each run executes them in order, in a fresh
working directory, as a notebook would (``!ls`` goes to the shell, an expression ending a
cell is displayed), and records each cell's printed output, display and exception.

What "apart from the import line" means here: the cells are byte-identical on both sides;
only the binding of ``tf`` differs. On the TF side it is TensorFlow; on ours every
``tf.train.X`` the guide uses is ``shardckpt.X`` (the same names), ``tf.Variable`` is
``shardckpt.Variable`` and ``tf.zeros`` makes a NumPy array. The guide also trains a Keras
model on a ``tf.data`` pipeline with ``tf.GradientTape``; shardckpt has no Keras, data
pipeline or autodiff, so on BOTH sides ``tf.keras``, ``tf.data``, ``tf.GradientTape``,
``tf.range``, ``tf.reduce_mean`` and ``tf.abs`` are one small NumPy stand-in
(:data:`STAND_IN`) built on the library's own ``Module`` and ``Variable`` — so what is
compared is purely the checkpoint machinery (``Checkpoint``, ``CheckpointManager``,
``Variable``, ``Module``, lists and dicts, deferred restoration, the reader). (TF 2.21's own
Keras 3 would not run the guide either: ``save_weights`` wants a ``.weights.h5`` name and
the Dense kernel's key is ``net/l1/_kernel``.)

Both directions of restore: one library trains the first 50 steps and writes
``./tf_ckpts``; the other resumes from those files and runs the rest of the guide; its
output must be what the first library prints when it resumes from its own files.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
from tf_oracle.client import TFOracle

import shardckpt

# -- the guide's code cells, in order (the license and ``import tensorflow as tf`` cells left out) ------------------

GUIDE_CELLS: List[Tuple[str, str]] = [
    ('OEQCseyeC4Ev', r'''
class Net(tf.keras.Model):
  """A simple linear model."""

  def __init__(self):
    super(Net, self).__init__()
    self.l1 = tf.keras.layers.Dense(5)

  def call(self, x):
    return self.l1(x)
'''),
    ('utqeoDADC5ZR', r'''
net = Net()
'''),
    ('SuhmrYPEl4D_', r'''
net.save_weights('easy_checkpoint')
'''),
    ('tSNyP4IJ9nkU', r'''
def toy_dataset():
  inputs = tf.range(10.)[:, None]
  labels = inputs * 5. + tf.range(5.)[None, :]
  return tf.data.Dataset.from_tensor_slices(
    dict(x=inputs, y=labels)).repeat().batch(2)
'''),
    ('ICm1cufh_JH8', r'''
def train_step(net, example, optimizer):
  """Trains `net` on `example` using `optimizer`."""
  with tf.GradientTape() as tape:
    output = net(example['x'])
    loss = tf.reduce_mean(tf.abs(output - example['y']))
  variables = net.trainable_variables
  gradients = tape.gradient(loss, variables)
  optimizer.apply_gradients(zip(gradients, variables))
  return loss
'''),
    ('ou5qarOQOWYl', r'''
opt = tf.keras.optimizers.Adam(0.1)
dataset = toy_dataset()
iterator = iter(dataset)
ckpt = tf.train.Checkpoint(step=tf.Variable(1), optimizer=opt, net=net, iterator=iterator)
manager = tf.train.CheckpointManager(ckpt, './tf_ckpts', max_to_keep=3)
'''),
    ('BbCS5A6K1VSH', r'''
def train_and_checkpoint(net, manager):
  ckpt.restore(manager.latest_checkpoint)
  if manager.latest_checkpoint:
    print("Restored from {}".format(manager.latest_checkpoint))
  else:
    print("Initializing from scratch.")

  for _ in range(50):
    example = next(iterator)
    loss = train_step(net, example, opt)
    ckpt.step.assign_add(1)
    if int(ckpt.step) % 10 == 0:
      save_path = manager.save()
      print("Saved checkpoint for step {}: {}".format(int(ckpt.step), save_path))
      print("loss {:1.2f}".format(loss.numpy()))
'''),
    ('Ik3IBMTdPW41', r'''
train_and_checkpoint(net, manager)
'''),
    ('UjilkTOV2PBK', r'''
opt = tf.keras.optimizers.Adam(0.1)
net = Net()
dataset = toy_dataset()
iterator = iter(dataset)
ckpt = tf.train.Checkpoint(step=tf.Variable(1), optimizer=opt, net=net, iterator=iterator)
manager = tf.train.CheckpointManager(ckpt, './tf_ckpts', max_to_keep=3)

train_and_checkpoint(net, manager)
'''),
    ('3zmM0a-F5XqC', r'''
print(manager.checkpoints)  # List the three remaining checkpoints
'''),
    ('t1feej9JntV_', r'''
!ls ./tf_ckpts
'''),
    ('wmX2AuyH7TVt', r'''
to_restore = tf.Variable(tf.zeros([5]))
print(to_restore.numpy())  # All zeros
fake_layer = tf.train.Checkpoint(bias=to_restore)
fake_net = tf.train.Checkpoint(l1=fake_layer)
new_root = tf.train.Checkpoint(net=fake_net)
status = new_root.restore(tf.train.latest_checkpoint('./tf_ckpts/'))
print(to_restore.numpy())  # This gets the restored value.
'''),
    ('P9TQXl81Dq5r', r'''
status.assert_existing_objects_matched()
'''),
    ('TXYUCO3v-I72', r'''
deferred_restore = tf.Variable(tf.zeros([1, 5]))
print(deferred_restore.numpy())  # Not restored; still zeros
fake_layer.kernel = deferred_restore
print(deferred_restore.numpy())  # Restored
'''),
    ('RlRsADTezoBD', r'''
reader = tf.train.load_checkpoint('./tf_ckpts/')
shape_from_key = reader.get_variable_to_shape_map()
dtype_from_key = reader.get_variable_to_dtype_map()

sorted(shape_from_key.keys())
'''),
    ('lYhX_XWCgl92', r'''
key = 'net/l1/kernel/.ATTRIBUTES/VARIABLE_VALUE'

print("Shape:", shape_from_key[key])
print("Dtype:", dtype_from_key[key].name)
'''),
    ('cDJO3cgmecvi', r'''
reader.get_tensor(key)
'''),
    ('rfaIbDtDHAr_', r'''
save = tf.train.Checkpoint()
save.listed = [tf.Variable(1.)]
save.listed.append(tf.Variable(2.))
save.mapped = {'one': save.listed[0]}
save.mapped['two'] = save.listed[1]
save_path = save.save('./tf_list_example')

restore = tf.train.Checkpoint()
v2 = tf.Variable(0.)
assert 0. == v2.numpy()  # Not restored yet
restore.mapped = {'two': v2}
restore.restore(save_path)
assert 2. == v2.numpy()
'''),
    ('s0Uq1Hv5JCmm', r'''
restore.listed = []
print(restore.listed)  # ListWrapper([])
v1 = tf.Variable(0.)
restore.listed.append(v1)  # Restores v1, from restore() in the previous cell
assert 1. == v1.numpy()
'''),
]

FIRST_TRAINING = "Ik3IBMTdPW41"  # train_and_checkpoint(net, manager): the first 50 steps, from scratch

# -- the stand-in for Keras, tf.data and GradientTape (the same source runs on both sides) -------------------------

STAND_IN = r'''
import numpy as _np
import types as _types


def _lift(x):
    """A _Tensor for a _Tensor, a library Variable (a leaf of the gradient) or a constant."""
    if isinstance(x, _Tensor):
        return x
    if hasattr(x, "assign") and hasattr(x, "numpy"):
        return _Tensor(x.numpy(), variable=x)
    return _Tensor(x)


def _unbroadcast(grad, shape):
    """Sum ``grad`` down to ``shape`` (the reverse of NumPy broadcasting)."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, n in enumerate(shape):
        if n == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


class _Tensor:
    """A float32 NumPy value that remembers how it was computed: just enough reverse mode for the guide."""

    def __init__(self, value, parents=(), variable=None):
        self.value = _np.asarray(value, _np.float32)
        self.parents = parents  # ((parent tensor, vector-Jacobian product), ...)
        self.variable = variable

    def numpy(self):
        return self.value[()] if self.value.ndim == 0 else self.value.copy()

    def __getitem__(self, index):
        def back(g):
            out = _np.zeros_like(self.value)
            out[index] += g
            return out
        return _Tensor(self.value[index], ((self, back),))

    def __add__(self, other):
        a, b = self, _lift(other)
        return _Tensor(a.value + b.value, ((a, lambda g: _unbroadcast(g, a.value.shape)),
                                           (b, lambda g: _unbroadcast(g, b.value.shape))))

    __radd__ = __add__

    def __sub__(self, other):
        a, b = self, _lift(other)
        return _Tensor(a.value - b.value, ((a, lambda g: _unbroadcast(g, a.value.shape)),
                                           (b, lambda g: -_unbroadcast(g, b.value.shape))))

    def __mul__(self, factor):
        factor = _np.float32(factor)
        return _Tensor(self.value * factor, ((self, lambda g: g * factor),))

    __rmul__ = __mul__


def _matmul(a, b):
    a, b = _lift(a), _lift(b)
    return _Tensor(a.value @ b.value, ((a, lambda g: g @ b.value.T), (b, lambda g: a.value.T @ g)))


def _abs(x):
    x = _lift(x)
    return _Tensor(_np.abs(x.value), ((x, lambda g: g * _np.sign(x.value)),))


def _reduce_mean(x):
    x = _lift(x)
    return _Tensor(x.value.mean(), ((x, lambda g: _np.full(x.value.shape, g / x.value.size, _np.float32)),))


def _range(n):
    return _Tensor(_np.arange(n, dtype=_np.float32))


class _GradientTape:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def gradient(self, target, variables):
        order, seen = [], set()

        def visit(node):  # depth first: every node after the nodes computed from it
            if id(node) in seen:
                return
            seen.add(id(node))
            for parent, _ in node.parents:
                visit(parent)
            order.append(node)

        visit(target)
        grads = {id(target): _np.ones_like(target.value)}
        by_variable = {}
        for node in reversed(order):
            g = grads.get(id(node))
            if g is None:
                continue
            if node.variable is not None:
                by_variable[id(node.variable)] = by_variable.get(id(node.variable), 0) + g
            for parent, back in node.parents:
                grads[id(parent)] = grads.get(id(parent), 0) + back(g)
        return [by_variable.get(id(v)) for v in variables]


def make_stand_in(lib):
    """Keras' Model, Dense and Adam, and tf.data's Dataset, over ``lib``'s Module and Variable."""

    class Model(lib.Module):
        def __call__(self, *args):
            return self.call(*args)

        def save_weights(self, filepath):
            lib.train.Checkpoint(root=self).write(filepath)

    class Dense(lib.Module):
        def __init__(self, units):
            super().__init__()
            self.units = units

        def __call__(self, x):
            x = _lift(x)
            if "kernel" not in vars(self):  # built at the first call, as Keras builds its layers
                n = x.value.shape[-1] * self.units
                self.kernel = lib.Variable(_np.linspace(-1.0, 1.0, n, dtype=_np.float32).reshape(-1, self.units))
                self.bias = lib.Variable(_np.zeros(self.units, _np.float32))
            return _matmul(x, self.kernel) + self.bias

    class Adam(lib.Module):
        def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
            super().__init__()
            self.hyper = [float(learning_rate), beta_1, beta_2, epsilon]
            self.iterations = lib.Variable(_np.int64(0))
            self.m = []
            self.v = []

        def apply_gradients(self, grads_and_vars):
            pairs = list(grads_and_vars)
            if not self.m:  # slots made at the first step (restored then, if a restore waits for them)
                for _, var in pairs:
                    self.m.append(lib.Variable(_np.zeros_like(var.numpy())))
                    self.v.append(lib.Variable(_np.zeros_like(var.numpy())))
            lr, b1, b2, eps = self.hyper
            self.iterations.assign_add(1)
            t = int(self.iterations)
            rate = _np.float32(lr * _np.sqrt(1 - b2 ** t) / (1 - b1 ** t))
            for (g, var), m, v in zip(pairs, self.m, self.v):
                m_new = _np.float32(b1) * m.numpy() + _np.float32(1 - b1) * g
                v_new = _np.float32(b2) * v.numpy() + _np.float32(1 - b2) * g * g
                m.assign(m_new.astype(_np.float32))
                v.assign(v_new.astype(_np.float32))
                var.assign((var.numpy() - rate * m_new / (_np.sqrt(v_new) + _np.float32(eps))).astype(_np.float32))

    class Iterator(lib.Module):
        def __init__(self, dataset):
            super().__init__()
            self.dataset = dataset
            self.position = lib.Variable(_np.int64(0))  # what a checkpoint of the iterator keeps

        def __iter__(self):
            return self

        def __next__(self):
            return self.dataset.element(int(self.position.numpy()), self.position)

    class Dataset:
        def __init__(self, columns, repeat=False, batch=None):
            self.columns, self.repeated, self.batch_size = columns, repeat, batch

        @staticmethod
        def from_tensor_slices(columns):
            return Dataset({k: _lift(v).value for k, v in columns.items()})

        def repeat(self):
            return Dataset(self.columns, True, self.batch_size)

        def batch(self, n):
            return Dataset(self.columns, self.repeated, n)

        def __iter__(self):
            return Iterator(self)

        def element(self, index, position):
            rows = len(next(iter(self.columns.values())))
            size = self.batch_size or 1
            picked = [(index * size + i) % rows if self.repeated else index * size + i for i in range(size)]
            if picked[-1] >= rows:
                raise StopIteration
            position.assign_add(1)
            return {k: _Tensor(v[picked] if self.batch_size else v[picked[0]]) for k, v in self.columns.items()}

    return {
        "keras": _types.SimpleNamespace(Model=Model, layers=_types.SimpleNamespace(Dense=Dense),
                                        optimizers=_types.SimpleNamespace(Adam=Adam)),
        "data": _types.SimpleNamespace(Dataset=Dataset), "GradientTape": _GradientTape, "range": _range,
        "reduce_mean": _reduce_mean, "abs": _abs,
    }


class GuideTF:
    """The ``tf`` the cells see: the stand-in's names, else the library's."""

    def __init__(self, lib):
        self._lib = lib
        self._stand_in = make_stand_in(lib)

    def __getattr__(self, name):
        return self._stand_in[name] if name in self._stand_in else getattr(self._lib, name)
'''

# -- running cells as a notebook does (the same source runs on both sides) -----------------------------------------

RUNNER = r'''
import ast as _ast
import contextlib as _contextlib
import io as _io
import os as _os
import subprocess as _subprocess

import numpy as _np


def _display(value):
    if value is None:
        return None
    if isinstance(value, (_np.ndarray, _np.generic, list, tuple, dict, str, int, float, bool)):
        return repr(value)
    return "<" + type(value).__name__ + ">"  # objects print their address: compared by class


def _run_cell(source, namespace):
    lines = source.strip("\n").splitlines()
    if lines and all(line.startswith("!") for line in lines):  # a shell line, as IPython runs it
        for line in lines:
            done = _subprocess.run(line[1:], shell=True, capture_output=True, text=True, check=True)
            print(done.stdout, end="")
        return None
    tree = _ast.parse(source)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
    body = tree.body[:-1] if last is not None else tree.body
    exec(compile(_ast.Module(body=body, type_ignores=[]), "<guide>", "exec"), namespace)
    if last is not None:
        return _display(eval(compile(_ast.Expression(last.value), "<guide>", "eval"), namespace))
    return None


def run_guide(tf, cells, directory):
    """Run ``cells`` in ``directory``; each cell's stdout, display and exception ("Class: message")."""
    namespace = {"tf": tf, "__name__": "__guide__"}
    here = _os.getcwd()
    _os.chdir(directory)
    outputs = []
    try:
        for cell_id, source in cells:
            printed, display, error = _io.StringIO(), None, None
            with _contextlib.redirect_stdout(printed):
                try:
                    display = _run_cell(source, namespace)
                except Exception as e:
                    error = type(e).__name__ + ": " + str(e)
            outputs.append({"id": cell_id, "stdout": printed.getvalue(), "display": display, "error": error})
    finally:
        _os.chdir(here)
    return outputs
'''


def _our_tf() -> Any:
    """Our side of the import line: ``tf.train.X`` is ``shardckpt.X``; values are NumPy."""
    ours = types.SimpleNamespace(train=shardckpt, Variable=shardckpt.Variable, Module=shardckpt.Module,
                                 zeros=lambda shape, dtype=np.float32: np.zeros(shape, dtype))
    namespace: Dict[str, Any] = {}
    exec(STAND_IN, namespace)
    return namespace["GuideTF"](ours)


def run_ours(cells: List[Tuple[str, str]], directory: Path) -> List[Dict[str, Any]]:
    namespace: Dict[str, Any] = {}
    exec(RUNNER, namespace)
    directory.mkdir(parents=True, exist_ok=True)
    return namespace["run_guide"](_our_tf(), cells, str(directory))  # type: ignore[no-any-return]


def run_tf(oracle: TFOracle, cells: List[Tuple[str, str]], directory: Path) -> List[Dict[str, Any]]:
    directory.mkdir(parents=True, exist_ok=True)
    code = (STAND_IN + RUNNER + f"\nresult = run_guide(GuideTF(tf), json.loads({json.dumps(cells)!r}), "
            f"{str(directory)!r})\n")
    return oracle.exec(code)  # type: ignore[no-any-return]


def _by_id(outputs: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {o["id"]: o for o in outputs}


def _assert_same_cells(tf: List[Dict[str, Any]], ours: List[Dict[str, Any]], what: str) -> None:
    assert [o["id"] for o in tf] == [o["id"] for o in ours]
    for theirs, mine in zip(tf, ours):
        assert theirs["error"] is None, (what, theirs["id"], theirs["error"])  # the guide runs in TF
        assert mine == theirs, (what, theirs["id"], mine, theirs)


@pytest.fixture(scope="module")
def guide_runs(tf_oracle: TFOracle, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The whole guide through each library, each in its own fresh working directory."""
    root = tmp_path_factory.mktemp("guide")
    return {"tf": run_tf(tf_oracle, GUIDE_CELLS, root / "tf"), "ours": run_ours(GUIDE_CELLS, root / "ours")}


def test_every_cell_prints_what_tensorflow_prints(guide_runs: Dict[str, Any]) -> None:
    _assert_same_cells(guide_runs["tf"], guide_runs["ours"], "the whole guide")
    tf = _by_id(guide_runs["tf"])
    # the run is the guide's: fresh start, five saves, resumed from ckpt-5, three checkpoints kept
    assert tf[FIRST_TRAINING]["stdout"].startswith("Initializing from scratch.\nSaved checkpoint for step 10: "
                                                   "./tf_ckpts/ckpt-1\n")
    assert tf["UjilkTOV2PBK"]["stdout"].startswith("Restored from ./tf_ckpts/ckpt-5\n")
    assert tf["3zmM0a-F5XqC"]["stdout"] == "['./tf_ckpts/ckpt-8', './tf_ckpts/ckpt-9', './tf_ckpts/ckpt-10']\n"
    assert "ListWrapper([])" in tf["s0Uq1Hv5JCmm"]["stdout"]


def _split_at_first_training() -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
    ids = [cell_id for cell_id, _ in GUIDE_CELLS]
    cut = ids.index(FIRST_TRAINING) + 1
    return GUIDE_CELLS[:cut], [c for c in GUIDE_CELLS if c[0] != FIRST_TRAINING]


@pytest.mark.parametrize("writer", ["tf", "ours"])
def test_the_other_library_resumes_the_guides_checkpoints(tf_oracle: TFOracle, tmp_path: Path,
                                                          guide_runs: Dict[str, Any], writer: str) -> None:
    """One library trains the first 50 steps; the other resumes from its ``./tf_ckpts`` and runs the
    rest of the guide, printing what the resuming library prints after its own first training."""
    first, rest = _split_at_first_training()
    reader = "ours" if writer == "tf" else "tf"
    run = {"tf": lambda cells: run_tf(tf_oracle, cells, tmp_path), "ours": lambda cells: run_ours(cells, tmp_path)}
    written = run[writer](first)
    assert all(o["error"] is None for o in written), written
    resumed = run[reader](rest)
    expected = [o for o in guide_runs[reader] if o["id"] != FIRST_TRAINING]
    _assert_same_cells(expected, resumed, f"{reader} resuming {writer}'s checkpoints")
