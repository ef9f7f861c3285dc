"""A node whose tier is full: the save fails on every client, says why, and commits and leaves nothing.

tests/helpers/tier_full_worker.py: two real clients as two nodes (torchrun and mpiexec); node 1's
tier is a real 3.5 MiB RAM disk (a tmpfs mounted here; mounting needs root, as the suite runs on
this project's machines): room for one step of node 1's bundle and node 0's replica, and for node
1's bundle of the next step, not for the replica that follows it. (A bundle that cannot be written
at all is tests/test_tiers.py's full-tier test, on one client.)
The second save fails on both clients with the disk's error and what the tier needs; neither
tier keeps anything of it; step 1 is restored from the tiers afterwards, exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import pytest

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "tier_full_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import run_job  # noqa: E402  (tests/helpers)
from ramdisk import ramdisk  # noqa: E402  (tests/helpers)

NPROC = 2


@pytest.fixture(scope="module", params=["torch", "mpi"])
def job(request, tmp_path_factory) -> Dict[int, Any]:
    tmp = tmp_path_factory.mktemp(f"full-{request.param}")
    with ramdisk(tmp / "data" / "tier" / "1", "3584k"):
        yield run_job(request.param, NPROC, WORKER, tmp / "out", tmp / "data", timeout=300)


def _entry(results: Dict[int, Any], rank: int, name: str) -> Dict[str, Any]:
    return results[rank]["phases"][name]  # type: ignore[no-any-return]


def test_a_save_that_fills_a_node_s_tier_fails_on_every_client_naming_the_room_it_needs(job):
    for rank in range(NPROC):
        assert _entry(job, rank, "save1")["ok"], _entry(job, rank, "save1")
        failed = _entry(job, rank, "save2")
        assert not failed["ok"] and failed["coordination"], (rank, failed)
        assert "No space left on device" in failed["message"] and "the tier is full: it keeps keep=1 steps" in \
            failed["message"] and "room for 2 x (1 + replicas=1)" in failed["message"], (rank, failed["message"])


def test_nothing_of_the_failed_step_is_left_and_the_step_before_it_restores_from_the_tiers(job):
    held = _entry(job, 0, "after")
    assert held["ok"], held
    step1 = ["ckpt-1.committed", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    expected = sorted(f"node-{owner}/{name}" for owner in ("0", "1") for name in step1)
    assert held["value"] == {"0": expected, "1": expected}, held["value"]
    for rank in range(NPROC):
        restored = _entry(job, rank, "restore")
        assert restored["ok"], restored
        assert restored["value"]["step"] == 1 and restored["value"]["mismatches"] == [], (rank, restored["value"])
        assert restored["value"]["returned"].endswith(f"tier/{rank}/node-{rank}/ckpt-1"), restored["value"]
