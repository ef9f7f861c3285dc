"""``CheckpointManager`` over ``shardckpt.Checkpoint(root=model)`` on four real clients (torchrun/gloo and mpiexec).

tests/helpers/manager_worker.py builds TensorFlow's DTensor-tutorial setup on every client: a
``Module`` of DVariables laid out over ``create_distributed_mesh([("x", 2), ("y", 4)])`` (and a
plain ``Variable``), ``Checkpoint(root=model)`` and ``CheckpointManager(max_to_keep=2)``, with
no coordinator passed anywhere. What is held:

* ``Checkpoint(root=model)`` saves multi-client DVariables collectively, synchronously and
  asynchronously, and restores them exactly; the legacy ``DTensorCheckpoint`` writes the
  same checkpoint (same keys, same bytes);
* after each of three saves every client reports the same manager state: ``latest_checkpoint``,
  ``checkpoints`` (the newest two), the checkpoint's number and ``save_counter``; retention
  deleted ``ckpt-1`` and the state file names ``ckpt-2``, ``ckpt-3``;
* clients whose graphs disagree (one lacks a variable it holds pieces of) fail the save together: nothing is
  committed and every manager still knows no checkpoint, its number given back;
* only client 0 (the io client) reads ``checkpoint`` state files, at construction and at each save;
* ``restore_or_initialize`` in the job that saved, and in a fresh job, restores ``ckpt-3`` on every
  client (exactly), and the fresh job's next save deletes ``ckpt-2`` in every client's view; over
  an empty folder every client runs ``init_fn``;
* ``Checkpoint(root=model)`` restores funnelled through one client (``io_device``) exactly.

torch, mpi4py and Open MPI are test dependencies: their absence fails these tests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

from shardckpt.checkpoint.state import get_checkpoint_state
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.location import Location

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "manager_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import run_job  # noqa: E402  (tests/helpers)
from manager_worker import KINDS, SAVES  # noqa: E402  (tests/helpers)

NPROC = 4
LAUNCH_TIMEOUT = 240


def _launch(backend: str, mode: str, tmp: Path, data: Path) -> Dict[int, dict]:
    out = tmp / f"{mode}-out"
    out.mkdir(parents=True, exist_ok=True)
    return run_job(backend, NPROC, WORKER, out, data, args=[mode], timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module", params=["torch", "mpi"])
def jobs(request, tmp_path_factory) -> Dict[str, Any]:
    """Per backend: a job of three saves of each kind, then a fresh job resuming them."""
    backend = request.param
    tmp = tmp_path_factory.mktemp(f"manager-{backend}")
    data = tmp / "data"
    data.mkdir()
    saves = _launch(backend, "saves", tmp, data)
    after_saves = {kind: {"indexes": _indexes(data / kind),
                          "state": get_checkpoint_state(str(data / kind)) if (data / kind).is_dir() else None}
                   for kind in KINDS}
    resume = _launch(backend, "resume", tmp, data)
    return {"backend": backend, "saves": saves, "after_saves": after_saves, "resume": resume, "data": data}


def _indexes(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".index") if folder.is_dir() else []


def _values(results: Dict[int, dict], phase: str) -> List[Any]:
    out = []
    for r, res in sorted(results.items()):
        entry = res["phases"].get(phase)
        assert entry is not None, f"rank {r} has no phase {phase!r}"
        assert entry["ok"], f"rank {r}, phase {phase}: {entry.get('type')}: {entry.get('message')}\n" \
                            f"{entry.get('traceback', '')}"
        out.append(entry.get("value"))
    return out


def _same_on_every_client(values: List[Any], phase: str) -> Any:
    assert all(v == values[0] for v in values), f"{phase}: the clients disagree: {values}"
    return values[0]


def _exact(value: Dict[str, Any]) -> bool:
    return value["plain_ok"] and not any(value["mismatches"].values())


@pytest.mark.parametrize("kind", KINDS)
def test_every_client_sees_the_same_manager_state_after_each_save(jobs, kind: str) -> None:
    data = jobs["data"] / kind
    for n in range(1, SAVES + 1):
        state = _same_on_every_client(_values(jobs["saves"], f"{kind}/save{n}"), f"{kind}/save{n}")
        assert state == {"latest": str(data / f"ckpt-{n}"),
                         "checkpoints": [str(data / f"ckpt-{k}") for k in range(max(1, n - 1), n + 1)],
                         "number": n, "save_counter": n}
    # retention: ckpt-1 deleted by the io client; the state file names the two kept
    after = jobs["after_saves"][kind]
    assert after["indexes"] == ["ckpt-2.index", "ckpt-3.index"]
    assert after["state"] is not None
    assert after["state"].model_checkpoint_path == str(data / "ckpt-3")
    assert list(after["state"].all_model_checkpoint_paths) == [str(data / "ckpt-2"), str(data / "ckpt-3")]


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_of_multiclient_dvariables_restores_exactly(jobs, kind: str) -> None:
    for r, value in enumerate(_values(jobs["saves"], f"{kind}/restore")):
        assert _exact(value), f"rank {r}: {value}"


@pytest.mark.parametrize("kind", KINDS)
def test_restore_or_initialize_after_saves_restores_on_every_client(jobs, kind: str) -> None:
    """The issue's report: in the job that saved, client 0 restored while the others ran ``init_fn``."""
    values = _values(jobs["saves"], f"{kind}/restore_or_initialize")
    want = str(jobs["data"] / kind / f"ckpt-{SAVES}")
    assert values == [{"returned": want, "initialized": False}] * NPROC


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_checkpoint_root_model_restores_funnelled_through_one_client(jobs, kind: str) -> None:
    for r, value in enumerate(_values(jobs["resume"], f"{kind}/restore_funnelled")):
        assert _exact(value), f"rank {r}: {value}"


def test_checkpoint_root_model_writes_what_dtensor_checkpoint_writes(jobs) -> None:
    """``Checkpoint(root=model)`` and the legacy ``DTensorCheckpoint``: the same keys, slices and bytes."""
    for kind in ("sync", "async"):
        with BundleReader(Location.of(str(jobs["data"] / kind / "ckpt-3"))) as new, \
                BundleReader(Location.of(str(jobs["data"] / "legacy" / "ckpt-3"))) as legacy:
            assert sorted(new.keys()) == sorted(legacy.keys())
            for key in legacy.keys():
                assert np.array_equal(new.read(key), legacy.read(key)), key


def test_only_the_io_client_reads_the_state_file(jobs) -> None:
    for job in ("saves", "resume"):
        for r, res in jobs[job].items():
            reads = res.get("state_reads", {})
            if r == 0:
                assert any(k.endswith("/construct") for k in reads), reads  # the io client did read it
            else:
                assert reads == {}, f"{job}: client {r} read state files: {reads}"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_fresh_job_restores_on_every_client(jobs, kind: str) -> None:
    data = jobs["data"] / kind
    values = _values(jobs["resume"], f"{kind}/restore_or_initialize")
    for r, value in enumerate(values):
        assert value["returned"] == str(data / f"ckpt-{SAVES}") and not value["initialized"], f"rank {r}: {value}"
        assert _exact(value), f"rank {r}: {value}"
        assert value["save_counter"] == SAVES
    state = _same_on_every_client(_values(jobs["resume"], f"{kind}/save_again"), f"{kind}/save_again")
    assert state == {"latest": str(data / "ckpt-4"), "checkpoints": [str(data / "ckpt-3"), str(data / "ckpt-4")],
                     "number": 4, "save_counter": 4}
    assert _indexes(data) == ["ckpt-3.index", "ckpt-4.index"]


def test_job_without_checkpoint_initializes_on_every_client(jobs) -> None:
    for r, value in enumerate(_values(jobs["resume"], "empty/restore_or_initialize")):
        assert value["returned"] is None and value["initialized"] and value["latest"] is None, f"rank {r}: {value}"
    state = _same_on_every_client(_values(jobs["resume"], "empty/save_again"), "empty/save_again")
    assert state["latest"] == str(jobs["data"] / "empty" / "ckpt-1") and state["save_counter"] == 1


def test_disagreeing_graphs_fail_the_save_on_every_client(jobs) -> None:
    for r, res in sorted(jobs["saves"].items()):
        entry = res["phases"]["disagree/save"]
        assert not entry["ok"] and entry["coordination"], f"rank {r}: {entry}"
        assert "on_xy" in entry["message"], f"rank {r}: {entry['message']}"
    state = _same_on_every_client(_values(jobs["saves"], "disagree/after"), "disagree/after")
    assert state == {"latest": None, "checkpoints": [], "number": None, "save_counter": 0}
    assert _indexes(jobs["data"] / "disagree") == []
