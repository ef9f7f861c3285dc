"""Tiered checkpoints on four real clients as two simulated nodes (torchrun/gloo and mpiexec).

tests/helpers/tiers_worker.py sets ``SHARDCKPT_NODE=rank // 2`` and saves DVariables of every
layout on a 2x4 mesh (and a plain ``Variable``) through ``CheckpointManager(local=LocalTier(...,
replicas=1, keep=2), persist_every=5)``, six times. What is held (the issue's Tests section):

* every save goes to both nodes' tiers, each node's bundle with one replica on the other node;
  only save 5 goes to the persistent directory;
* nothing wiped: every client restores step 6 exactly, with no byte sent between clients
  point-to-point and no file of the persistent directory opened;
* node 1's tier wiped: every client restores step 6 exactly (it exists only in the tiers); node 1's
  bundle comes from node 0's replica (node 0's two clients send, on a lane each, what node 1's two
  clients receive), and
  no file of the persistent directory is opened; node 1's tier is repopulated behind the restore:
  its own bundle and the replica it held of node 0's;
* node 0's tier wiped next, with no save in between: step 6 again, node 0's bundle from that
  restocked replica;
* a replica transfer failing (node 1 cannot write node 0's replica of step 7) fails the save on
  every client, commits nothing (no marker, no file of step 7 left) and gives the number back;
  step 6 is restored afterwards;
* both tiers wiped: every client restores the persistent step 5 exactly, never a mix;
* asynchronous tiered saves (values clobbered right after each return) commit what was saved:
  step 7 is restored exactly from the tiers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import pytest

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "tiers_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import run_job  # noqa: E402  (tests/helpers)

NPROC = 4
LAUNCH_TIMEOUT = 300


@pytest.fixture(scope="module", params=["torch", "mpi"])
def job(request, tmp_path_factory) -> Dict[str, Any]:
    tmp = tmp_path_factory.mktemp(f"tiers-{request.param}")
    return {"results": run_job(request.param, NPROC, WORKER, tmp / "out", tmp / "data", timeout=LAUNCH_TIMEOUT),
            "data": tmp / "data"}


def _phase(job: Dict[str, Any], rank: int, name: str) -> Dict[str, Any]:
    entry = job["results"][rank]["phases"][name]
    assert entry["ok"], f"rank {rank} {name}: {entry.get('type')}: {entry.get('message')}\n{entry.get('traceback')}"
    return entry["value"]  # type: ignore[no-any-return]


def _exact(value: Dict[str, Any]) -> None:
    assert value["plain_ok"] and not any(value["mismatches"].values()), value


def test_every_save_goes_to_the_tiers_and_every_fifth_to_the_persistent_directory(job):
    data = job["data"]
    for rank in range(NPROC):
        node = rank // 2
        for n in range(1, 7):
            path = _phase(job, rank, f"save{n}")
            if n == 5:
                assert path == str(data / "persistent" / "ckpt-5")
            else:
                assert path == str(data / "tier" / str(node) / f"node-{node}" / f"ckpt-{n}")
    assert sorted(p.name for p in (data / "persistent").iterdir() if p.name.startswith("ckpt-")) == \
        ["ckpt-5.data-00000-of-00008", "ckpt-5.data-00001-of-00008", "ckpt-5.data-00002-of-00008",
         "ckpt-5.data-00003-of-00008", "ckpt-5.data-00004-of-00008", "ckpt-5.data-00005-of-00008",
         "ckpt-5.data-00006-of-00008", "ckpt-5.data-00007-of-00008", "ckpt-5.index"]
    files = _phase(job, 0, "files_after_saves")
    for node in ("0", "1"):
        for owner in ("0", "1"):  # own bundle and the other node's replica, the newest keep=2 steps
            names = files[f"{node}/node-{owner}"]
            assert [n for n in names if n.endswith(".committed")] == ["ckpt-5.committed", "ckpt-6.committed"]
            assert not [n for n in names if n.startswith(("ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"))], names


def test_nothing_wiped_restores_step_6_without_cross_node_bytes(job):
    for rank in range(NPROC):
        got = _phase(job, rank, "restore_nothing_wiped")
        _exact(got)
        assert got["step"] == 6 and got["save_counter"] == 6
        assert got["sent"] == 0 and got["bytes_received"] == 0, got
        assert got["persistent_opens"] == 0 and got["persistent_bytes"] == 0, got


def test_another_layout_restores_step_6_from_both_nodes_bundles_without_persistent_reads(job):
    for rank in range(NPROC):
        got = _phase(job, rank, "restore_other_layout")
        _exact(got)
        assert got["step"] == 6 and got["save_counter"] == 6, got
        assert got["persistent_opens"] == 0 and got["persistent_bytes"] == 0, got
        assert got["sent"] == 0 and got["bytes_received"] == 0, got  # each node holds both bundles already
    files = _phase(job, 0, "restore_other_layout")["files"]
    assert not [folder for folder in files if ".merged-" in folder], files  # the views are gone after the restore


def test_node_1_wiped_restores_step_6_from_the_replica_without_persistent_reads(job):
    got = {rank: _phase(job, rank, "restore_node1_wiped") for rank in range(NPROC)}
    for value in got.values():
        _exact(value)
        assert value["step"] == 6 and value["save_counter"] == 6
        assert value["persistent_opens"] == 0 and value["persistent_bytes"] == 0, value
    # node 1's clients restored straight from node 0's replica, each from its own server (client 0 serves
    # client 2, client 1 serves client 3): the bytes flow one way; node 1 sends only its requests
    assert got[0]["bytes_sent"] > 0 and got[1]["bytes_sent"] > 0, got
    assert got[2]["bytes_received"] == got[0]["bytes_sent"] and got[3]["bytes_received"] == got[1]["bytes_sent"], got
    assert 0 < got[2]["sent"] < 4096 and 0 < got[3]["sent"] < 4096, got
    assert got[0]["bytes_received"] == got[1]["bytes_received"] == 0
    # the lost bundle's files moved node 0 -> node 1 behind the restore, on the lanes
    assert got[0]["sent_behind"] > 0 and got[1]["sent_behind"] > 0, got
    assert got[2]["sent_behind"] == got[3]["sent_behind"] == 0, got
    assert all(value["error_behind"] is None for value in got.values()), got
    files = _phase(job, 0, "files_after_repopulation")
    assert "ckpt-6.committed" in files["1/node-1"]  # node 1 holds its own bundle again, repopulated behind
    assert "ckpt-6.committed" in files["1/node-0"]  # and the replica it held of node 0's, restocked behind


def test_a_second_node_lost_before_the_next_save_restores_step_6_from_the_restocked_replica(job):
    got = {rank: _phase(job, rank, "restore_node0_wiped_next") for rank in range(NPROC)}
    for value in got.values():
        _exact(value)
        assert value["step"] == 6 and value["save_counter"] == 6, value
        assert value["persistent_opens"] == 0 and value["persistent_bytes"] == 0, value
        assert value["error_behind"] is None, value
    # node 0's clients restored from the replica node 1 got back after the first loss
    assert got[0]["bytes_received"] == got[2]["bytes_sent"] > 0, got
    assert got[1]["bytes_received"] == got[3]["bytes_sent"] > 0, got
    assert got[2]["sent_behind"] > 0 and got[0]["sent_behind"] == got[1]["sent_behind"] == 0, got
    files = _phase(job, 0, "files_after_second_loss")
    for folder in ("0/node-0", "0/node-1", "1/node-0", "1/node-1"):
        assert "ckpt-6.committed" in files[folder], (folder, files)


def test_a_failed_replica_transfer_fails_the_save_everywhere_and_commits_nothing(job):
    for rank in range(NPROC):
        entry = job["results"][rank]["phases"]["replica_fault"]
        assert not entry["ok"] and entry["coordination"], entry
        assert "rank 2" in entry["message"] and "ckpt-7.index" in entry["message"], entry["message"]
        assert _phase(job, rank, "after_fault")["save_counter"] == 6
    files = _phase(job, 0, "after_fault")["files"]
    for folder, names in files.items():
        assert not [n for n in names if n.startswith("ckpt-7")], (folder, names)
    for rank in range(NPROC):
        value = _phase(job, rank, "restore_after_fault")
        _exact(value)
        assert value["step"] == 6


def test_nodes_that_lost_their_own_bundles_swap_replicas_first_then_restore_step_7_locally(job):
    got = {rank: _phase(job, rank, "restore_own_bundles_lost") for rank in range(NPROC)}
    for value in got.values():
        _exact(value)
        assert value["step"] == 7 and value["persistent_opens"] == 0, value
        assert value["bytes_sent"] > 0 and value["bytes_received"] > 0, value  # every client on a lane, both ways
        assert value["sent_behind"] == 0, value  # repopulated before the restore, not behind it
    files = _phase(job, 0, "files_after_own_bundles_lost")
    assert "ckpt-7.committed" in files["0/node-0"] and "ckpt-7.committed" in files["1/node-1"]


def test_a_damaged_replica_read_by_the_lost_node_makes_every_client_restore_the_persistent_step(job):
    for rank in range(NPROC):
        got = _phase(job, rank, "restore_damaged_replica")
        _exact(got)  # generation 5 everywhere: never node 0 at step 6 and node 1 at step 5
        assert got["step"] is None and got["returned"] == str(job["data"] / "persistent" / "ckpt-5"), got
        assert got["save_counter"] == 5
        assert "checksum does not match" in got["reason"] and "node-1/ckpt-7.data-" in got["reason"], got["reason"]
        assert got["sent_behind"] == 0  # nothing repopulated from a damaged replica


def test_both_wiped_restores_the_persistent_step_5(job):
    for rank in range(NPROC):
        got = _phase(job, rank, "restore_both_wiped")
        _exact(got)
        assert got["step"] is None and got["returned"] == str(job["data"] / "persistent" / "ckpt-5")
        assert got["save_counter"] == 5


def test_asynchronous_tiered_saves_commit_what_was_saved(job):
    for rank in range(NPROC):
        node = rank // 2
        for n in (6, 7):
            assert _phase(job, rank, f"async_save{n}") == str(job["data"] / "tier" / str(node) / f"node-{node}"
                                                               / f"ckpt-{n}")
        _phase(job, rank, "async_sync")
        got = _phase(job, rank, "restore_after_async")
        _exact(got)
        assert got["step"] == 7 and got["save_counter"] == 7 and got["persistent_opens"] == 0
