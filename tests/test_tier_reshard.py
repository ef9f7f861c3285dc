"""A restore onto another layout reads the tiers: three real clients, each a simulated node of its own.

tests/helpers/tier_reshard_worker.py saves a row-sharded ``DVariable`` twice into local tiers only
(``replicas=1``: each node holds its own bundle and one neighbour's, never all three) and restores
it sharded by columns, which needs pieces every node saved: each node gets the bundle it lacks,
then every client restores step 2 exactly from a merged view of the three (tiers/merged.py), with
nothing persistent to fall back on. The saved layout again restores from each node's own bundle.
With node 1's tier wiped, the columns again restore step 2 from the tiers (node 1 gets all three).
Then a job of two clients (node 2 gone) restores that step 2 from the tiers of nodes 0 and 1, which
hold every bundle of it between them, and its own next save restores from its own bundles.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import pytest

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "tier_reshard_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import run_job  # noqa: E402  (tests/helpers)

NPROC = 3


@pytest.fixture(scope="module", params=["torch", "mpi"])
def job(request, tmp_path_factory) -> Dict[str, Any]:
    tmp = tmp_path_factory.mktemp(f"reshard-{request.param}")
    results = run_job(request.param, NPROC, WORKER, tmp / "out", tmp / "data", timeout=300)
    shrunk = run_job(request.param, NPROC - 1, WORKER, tmp / "out-shrunk", tmp / "data", args=["shrink"],
                     timeout=300)  # node 2 gone: the next job runs on nodes 0 and 1
    return {"results": results, "shrunk": shrunk, "data": tmp / "data"}


def _phase(job: Dict[str, Any], rank: int, name: str) -> Dict[str, Any]:
    entry = job["results"][rank]["phases"][name]
    assert entry["ok"], f"rank {rank} {name}: {entry.get('type')}: {entry.get('message')}\n{entry.get('traceback')}"
    return entry["value"]  # type: ignore[no-any-return]


def test_another_layout_gathers_the_missing_bundle_and_restores_step_2_from_the_tiers(job):
    for rank in range(NPROC):
        assert _phase(job, rank, "save2").endswith("ckpt-2")
        got = _phase(job, rank, "restore_columns")
        assert got["step"] == 2, got
        assert got["mismatches"] == [] and got["plain"] == [2.0, 2.0, 2.0], got
        assert got["bytes_received"] > 0, got  # each node got the bundle it lacked
        assert got["tier"] == ["node-0", "node-1", "node-2"], got  # every bundle here now; no view left behind
    moved = [_phase(job, rank, "restore_columns") for rank in range(NPROC)]
    assert sum(g["bytes_sent"] for g in moved) == sum(g["bytes_received"] for g in moved)
    assert not (job["data"] / "persistent").exists() or not any(
        p.name.startswith("ckpt-") for p in (job["data"] / "persistent").iterdir())


def test_a_lost_node_and_another_layout_together_restore_step_2_from_the_tiers(job):
    got = [_phase(job, rank, "restore_columns_lost") for rank in range(NPROC)]
    for value in got:
        assert value["step"] == 2, value
        assert value["mismatches"] == [] and value["plain"] == [2.0, 2.0, 2.0], value
        assert value["tier"] == ["node-0", "node-1", "node-2"], value
    assert got[1]["bytes_received"] > 0, got[1]  # node 1 lost everything: it got all three bundles
    assert sum(g["bytes_sent"] for g in got) == sum(g["bytes_received"] for g in got)


def test_the_saved_layout_reads_each_node_s_own_bundle(job):
    for rank in range(NPROC):
        got = _phase(job, rank, "restore_rows")
        assert got["step"] == 2 and got["mismatches"] == [], got
        assert got["bytes_received"] == 0 and got["bytes_sent"] == 0, got


def test_a_job_on_fewer_nodes_restores_the_step_the_larger_job_saved_from_the_tiers(job):
    got = {rank: job["shrunk"][rank]["phases"]["restore_shrunk"] for rank in range(NPROC - 1)}
    for entry in got.values():
        assert entry["ok"], entry
        value = entry["value"]
        assert value["step"] == 2 and value["mismatches"] == [] and value["plain"] == [2.0, 2.0, 2.0], value
        assert value["bytes_received"] > 0, value  # node 0 lacked node 1's bundle, node 1 lacked node 2's
        assert value["tier"] == ["node-0", "node-1", "node-2"], value
    for rank in range(NPROC - 1):
        entry = job["shrunk"][rank]["phases"]["restore_own"]
        assert entry["ok"], entry
        assert entry["value"]["step"] == 3 and entry["value"]["mismatches"] == [], entry
        assert entry["value"]["bytes_received"] == 0, entry  # this job's own bundles
