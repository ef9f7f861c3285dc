"""The ``checkpoint`` state file under every spelling of a directory, side by side with TensorFlow.

TensorFlow's guide manages ``'./tf_ckpts'``; users also write ``a/../dir``, ``dir/``,
``./x/../dir/`` and absolute paths. For each spelling, the same three saves (``max_to_keep=2``)
run in TensorFlow (through the oracle, in a folder of its own) and in shardckpt, and must give:

* the same state file (the kept paths, relative and normalized: ``ckpt-3``, never ``./dir/ckpt-3``);
* the same paths returned by ``save``, ``latest_checkpoint``, ``checkpoints`` (spelled as given),
  by a manager made again (a restart) and by ``tf.train.latest_checkpoint`` / ``list_variables``;
* the same files left (retention deleted ``ckpt-1``).

After the restart shardckpt restores the latest checkpoint and its next save deletes ``ckpt-2``;
each library reads the other's folder under the same spelling. ``Checkpoint.save`` under such a
spelling writes the state file TF writes. A state file that does not parse is ignored with a
warning (``latest_checkpoint`` is ``None``, a manager starts afresh and its save replaces the
file), as TF's; one with an empty ``model_checkpoint_path`` raises ``ValueError`` in both;
``load_checkpoint``/``list_variables`` of a folder without a checkpoint raise ``ValueError`` in both.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

import shardckpt
from shardckpt import errors

KEY = "v/.ATTRIBUTES/VARIABLE_VALUE"
SPELLINGS = ["./tf_ckpts", "a/../tf_ckpts", "tf_ckpts/", "./x/../tf_ckpts/", "ABS"]

_TF_MANAGER = """
old = os.getcwd()
os.chdir(P["root"])
try:
    v = tf.Variable(0.0)
    ck = tf.train.Checkpoint(v=v)
    m = tf.train.CheckpointManager(ck, P["spelling"], max_to_keep=2)
    saves = []
    for i in range(3):
        v.assign(float(i + 1))
        saves.append(m.save())
    again = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0.0)), P["spelling"], max_to_keep=2)
    folder = os.path.normpath(P["spelling"])
    result = {"saves": saves, "latest": m.latest_checkpoint, "checkpoints": m.checkpoints,
              "state": open(os.path.join(folder, "checkpoint")).read(),
              "again_latest": again.latest_checkpoint, "again_checkpoints": again.checkpoints,
              "tf_latest": tf.train.latest_checkpoint(P["spelling"]),
              "listed": [name for name, _ in tf.train.list_variables(P["spelling"])],
              "files": sorted(os.listdir(folder))}
finally:
    os.chdir(old)
"""

_TF_READ = """
old = os.getcwd()
os.chdir(P["root"])
try:
    latest = tf.train.latest_checkpoint(P["spelling"])
    result = {"latest": latest, "v": float(tf.train.load_checkpoint(P["spelling"]).get_tensor(P["key"]))}
finally:
    os.chdir(old)
"""


def tf_run(tf_oracle: Any, code: str, **params: Any) -> Any:
    return tf_oracle.exec(f"P = json.loads({json.dumps(params)!r})\n{code}")


def _spelled(spelling: str, root: Path) -> str:
    return str(root / "tf_ckpts") if spelling == "ABS" else spelling


def _paths_of(state_text: str) -> List[str]:
    """The path lines of a state file (timestamps differ from run to run)."""
    return [line for line in state_text.splitlines() if "timestamp" not in line]


def _shardckpt_manager(spelling: str) -> Dict[str, Any]:
    """What TF's side of _TF_MANAGER records, from shardckpt (in the current directory)."""
    v = shardckpt.Variable(np.float32(0.0))
    m = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=v), spelling, max_to_keep=2)
    saves = []
    for i in range(3):
        v.assign(np.float32(i + 1))
        saves.append(m.save())
    again = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=shardckpt.Variable(np.float32(0.0))), spelling,
                                        max_to_keep=2)
    folder = os.path.normpath(spelling)
    return {"saves": saves, "latest": m.latest_checkpoint, "checkpoints": m.checkpoints,
            "state": Path(folder, "checkpoint").read_text(),
            "again_latest": again.latest_checkpoint, "again_checkpoints": again.checkpoints,
            "tf_latest": shardckpt.latest_checkpoint(spelling),
            "listed": [name for name, _ in shardckpt.list_variables(spelling)],
            "files": sorted(os.listdir(folder))}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_manager_state_file_and_paths_match_tensorflow(tf_oracle, tmp_path: Path, monkeypatch, spelling: str) -> None:
    tf_root, sc_root = tmp_path / "tf", tmp_path / "sc"
    tf_root.mkdir()
    sc_root.mkdir()
    theirs = tf_run(tf_oracle, _TF_MANAGER, root=str(tf_root), spelling=_spelled(spelling, tf_root))
    monkeypatch.chdir(sc_root)
    ours = _shardckpt_manager(_spelled(spelling, sc_root))
    if spelling == "ABS":  # the folders differ: compare with the root taken out
        theirs = json.loads(json.dumps(theirs).replace(str(tf_root), "ROOT"))
        ours = json.loads(json.dumps(ours).replace(str(sc_root), "ROOT"))
    assert _paths_of(ours.pop("state")) == _paths_of(theirs.pop("state"))
    assert ours == theirs
    assert not (sc_root / "x").exists() and not (sc_root / "a").exists()  # cleaned lexically, as TF


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_spelled_folder_resumes_after_restart(tf_oracle, tmp_path: Path, monkeypatch, spelling: str) -> None:
    monkeypatch.chdir(tmp_path)
    spelled = _spelled(spelling, tmp_path)
    folder = tmp_path / "tf_ckpts"
    _shardckpt_manager(spelled)  # the first job: ckpt-2 and ckpt-3 kept
    # TensorFlow reads what shardckpt wrote, under the same spelling
    theirs = tf_run(tf_oracle, _TF_READ, root=str(tmp_path), spelling=spelled, key=KEY)
    assert theirs == {"latest": os.path.join(spelled, "ckpt-3"), "v": 3.0}
    # the second job: restore_or_initialize restores ckpt-3; its save deletes ckpt-2
    v = shardckpt.Variable(np.float32(0.0))
    init = []
    m = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=v), spelled, max_to_keep=2,
                                    init_fn=lambda: init.append(1))
    assert m.restore_or_initialize() == os.path.join(spelled, "ckpt-3")
    assert float(v.numpy()) == 3.0 and init == []
    v.assign(np.float32(4.0))
    assert m.save() == os.path.join(spelled, "ckpt-4")
    assert m.checkpoints == [os.path.join(spelled, "ckpt-3"), os.path.join(spelled, "ckpt-4")]
    assert sorted(p.name for p in folder.glob("*.index")) == ["ckpt-3.index", "ckpt-4.index"]
    assert _paths_of((folder / "checkpoint").read_text()) == [
        'model_checkpoint_path: "ckpt-4"', 'all_model_checkpoint_paths: "ckpt-3"',
        'all_model_checkpoint_paths: "ckpt-4"']
    assert shardckpt.load_checkpoint(spelled).get_tensor(KEY) == np.float32(4.0)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_shardckpt_reads_tensorflows_spelled_folder(tf_oracle, tmp_path: Path, monkeypatch, spelling: str) -> None:
    spelled = _spelled(spelling, tmp_path)
    theirs = tf_run(tf_oracle, _TF_MANAGER, root=str(tmp_path), spelling=spelled)
    monkeypatch.chdir(tmp_path)
    assert shardckpt.latest_checkpoint(spelled) == theirs["tf_latest"]
    assert shardckpt.load_checkpoint(spelled).get_tensor(KEY) == np.float32(3.0)
    assert [name for name, _ in shardckpt.list_variables(spelled)] == theirs["listed"]
    m = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=shardckpt.Variable(np.float32(0.0))), spelled,
                                    max_to_keep=2)
    assert (m.latest_checkpoint, m.checkpoints) == (theirs["latest"], theirs["checkpoints"])


@pytest.mark.parametrize("prefix", ["./d/ck", "e/../d/ck", "d/./ck"])
def test_checkpoint_save_state_file_matches_tensorflow(tf_oracle, tmp_path: Path, monkeypatch, prefix: str) -> None:
    code = """
old = os.getcwd()
os.chdir(P["root"])
try:
    path = tf.train.Checkpoint(v=tf.Variable(1.0)).save(P["prefix"])
    result = {"path": path, "state": open(os.path.join("d", "checkpoint")).read(),
              "latest": tf.train.latest_checkpoint(os.path.dirname(P["prefix"]))}
finally:
    os.chdir(old)
"""
    (tmp_path / "tf").mkdir()
    (tmp_path / "sc").mkdir()
    theirs = tf_run(tf_oracle, code, root=str(tmp_path / "tf"), prefix=prefix)
    monkeypatch.chdir(tmp_path / "sc")
    path = shardckpt.Checkpoint(v=shardckpt.Variable(np.float32(1.0))).save(prefix)
    ours = {"path": path, "state": (tmp_path / "sc" / "d" / "checkpoint").read_text(),
            "latest": shardckpt.latest_checkpoint(os.path.dirname(prefix))}
    assert ours == theirs


def test_unparsable_state_file_is_ignored_as_tensorflow_does(tf_oracle, tmp_path: Path, caplog) -> None:
    code = """
d = P["dir"]
v = tf.Variable(1.0)
m = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), d, max_to_keep=2)
result = {"latest": tf.train.latest_checkpoint(d), "state": tf.train.get_checkpoint_state(d) is None,
          "manager": [m.latest_checkpoint, m.checkpoints, m.restore_or_initialize()],
          "saved": os.path.basename(m.save()), "file": open(os.path.join(d, "checkpoint")).read().splitlines()[0]}
"""
    garbage = "this is { not a state file\n"
    for side in ("tf", "sc"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "checkpoint").write_text(garbage)
    theirs = tf_run(tf_oracle, code, dir=str(tmp_path / "tf"))
    d = str(tmp_path / "sc")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        latest = shardckpt.latest_checkpoint(d)
    assert any("checkpoint" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)
    m = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=shardckpt.Variable(np.float32(1.0))), d, max_to_keep=2)
    ours = {"latest": latest, "state": shardckpt.checkpoint.state.get_checkpoint_state(d) is None,
            "manager": [m.latest_checkpoint, m.checkpoints, m.restore_or_initialize()],
            "saved": os.path.basename(m.save()), "file": (tmp_path / "sc" / "checkpoint").read_text().splitlines()[0]}
    assert ours == theirs == {"latest": None, "state": True, "manager": [None, [], None], "saved": "ckpt-1",
                              "file": 'model_checkpoint_path: "ckpt-1"'}


def test_empty_model_checkpoint_path_raises_value_error_as_tensorflow(tf_oracle, tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_text('all_model_checkpoint_paths: "ckpt-1"\n')
    theirs = tf_oracle.probe(f"tf.train.latest_checkpoint({str(tmp_path)!r})")["error"]
    assert theirs is not None and "ValueError" in theirs["bases"]
    with pytest.raises(ValueError, match="model_checkpoint_path"):
        shardckpt.latest_checkpoint(str(tmp_path))


@pytest.mark.parametrize("call", ["load_checkpoint", "list_variables"])
def test_folder_without_checkpoint_raises_value_error_as_tensorflow(tf_oracle, tmp_path: Path, call: str) -> None:
    theirs = tf_oracle.probe(f"tf.train.{call}({str(tmp_path)!r})")["error"]
    assert theirs is not None and theirs["type"] == "ValueError"
    with pytest.raises(ValueError) as info:
        getattr(shardckpt, call)(str(tmp_path))
    assert isinstance(info.value, errors.NoCheckpointError) and isinstance(info.value, errors.NotFoundError)
    assert str(tmp_path) in str(info.value)
