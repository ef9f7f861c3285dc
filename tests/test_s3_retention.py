"""Object stores: a retention deletion that a kill cuts short is finished by the next save (issue 24, section 3).

``CheckpointManager`` records a save in this order (``checkpoint/manager.py``): an empty
``<old>.deleting`` marker per checkpoint beyond ``max_to_keep``, the ``checkpoint`` state file
(which stops naming them), the deletions (index first), the markers' removal. A process
killed after the state file and before a deletion leaves a checkpoint no state file names;
the marker makes the next save of a manager in that folder delete it. The kill here is a
real SIGKILL of a writer process at exactly that moment: an HTTP proxy in front of the test
S3 server (tests/helpers/s3_faults.py) kills the writer when its first request to delete the
old checkpoint's index arrives, and never forwards that request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

import shardckpt
from shardckpt.storage import get_fs

HELPERS = Path(__file__).resolve().parent / "helpers"
WRITER = HELPERS / "local_race_writer.py"  # its ``manager`` mode saves ckpt-1, ckpt-2, ... with max_to_keep=2
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

import local_race_writer  # noqa: E402  (tests/helpers)
from launchers import clean_env  # noqa: E402
from s3_faults import FaultProxy  # noqa: E402


def _objects(directory: str) -> Dict[str, str]:
    """name -> ETag of every object in the folder."""
    details = get_fs(directory).list_details(directory)  # type: ignore[attr-defined]
    return {name: str(info.get("etag")) for name, info in details.items()}


def _is_delete_of(name: str):  # type: ignore[no-untyped-def]
    def match(method: str, path: str) -> bool:
        return method == "DELETE" and path.split("?")[0].endswith("/" + name)
    return match


def _save(directory: str, number: int, max_to_keep: int = 2) -> None:
    model = shardckpt.Module()
    for name, value in local_race_writer.values(9, number).items():
        setattr(model, name, shardckpt.Variable(value, name=name))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), directory, max_to_keep=max_to_keep)
    manager.save(checkpoint_number=number)


def test_a_manager_killed_between_the_state_file_and_its_deletions_on_s3_has_them_finished_by_the_next_save(
        s3_server: Any, s3dir: str) -> None:
    killed: List[str] = []
    with FaultProxy(s3_server.endpoint, match=_is_delete_of("ckpt-1.index"), reset=True) as proxy:
        env = {**clean_env(), **s3_server.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        proc = subprocess.Popen([sys.executable, str(WRITER), "manager", s3dir, "1", "5"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

        def kill(method: str, path: str) -> None:  # the writer dies before its DELETE reaches the store
            killed.append(f"{method} {path}")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

        proxy.before_fail = kill
        proxy.fail_next(1)
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL and len(killed) == 1, (proc.returncode, out, err)
    assert out.split("\n")[:3] == ["READY", "SAVED 1 1", "SAVED 1 2"], out
    state = shardckpt.get_checkpoint_state(s3dir)
    assert state is not None and [p.rsplit("/", 1)[1] for p in state.all_model_checkpoint_paths] == \
        ["ckpt-2", "ckpt-3"], state
    before = _objects(s3dir)
    assert "ckpt-1.index" in before, "the kill came too late: ckpt-1 is already deleted"
    kept = {n: e for n, e in before.items() if n.startswith(("ckpt-2.", "ckpt-3."))}

    _save(s3dir, 4, max_to_keep=3)  # a new process's manager, in that folder
    after = _objects(s3dir)
    assert not [n for n in after if n.startswith("ckpt-1.") or n.endswith(".deleting")], sorted(after)
    assert {n: e for n, e in after.items() if n.startswith(("ckpt-2.", "ckpt-3."))} == kept
    assert shardckpt.latest_checkpoint(s3dir) == s3dir + "/ckpt-4"


def test_a_deletion_marker_of_a_checkpoint_named_again_on_s3_removes_only_the_marker(s3dir: str) -> None:
    _save(s3dir, 1)
    get_fs(s3dir).write_atomic(s3dir + "/ckpt-1.deleting", b"")  # a dead manager's, before ckpt-1 was saved again
    model = shardckpt.Module()
    model.v = shardckpt.Variable(np.arange(3.0))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), s3dir, max_to_keep=2)
    manager.save(checkpoint_number=2)
    assert sorted(n for n in _objects(s3dir) if not n.startswith("ckpt-2.")) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
