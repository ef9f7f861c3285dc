"""A lost node's clients read its bundle from every node holding a replica at once (``replicas=2``).

tests/helpers/tier_spread_worker.py: four real clients as three simulated nodes (node 1 has two
clients, nodes 0 and 2 one each), every node's bundle on both other nodes. Node 1's tier is
wiped; its two clients restore step 2 exactly, one served by node 0's client and one by node 2's
(each holder sends one client's share, not one holder both), nothing persistent exists, and
node 1's tier is whole again afterwards. With ``replicas=1`` node 2's one client serves both of
node 1's clients, at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import pytest

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "tier_spread_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import run_job  # noqa: E402  (tests/helpers)

NPROC = 4


@pytest.fixture(scope="module", params=["torch", "mpi"])
def job(request, tmp_path_factory) -> Dict[int, Any]:
    tmp = tmp_path_factory.mktemp(f"spread-{request.param}")
    return run_job(request.param, NPROC, WORKER, tmp / "out", tmp / "data", timeout=300)


def _phase(results: Dict[int, Any], rank: int, name: str) -> Any:
    entry = results[rank]["phases"][name]
    assert entry["ok"], f"rank {rank} {name}: {entry.get('type')}: {entry.get('message')}\n{entry.get('traceback')}"
    return entry["value"]


def test_the_lost_node_s_clients_read_from_both_holders_at_once(job):
    got = {rank: _phase(job, rank, "recover") for rank in range(NPROC)}
    for rank, value in got.items():
        assert value["step"] == 2 and value["returned"] is not None, value
        assert value["mismatches"] == [] and value["plain"] == [2.0, 2.0, 2.0], (rank, value)
    # node 1's clients (ranks 0, 1) received; node 0's (rank 2) and node 2's (rank 3) each served one of them
    assert got[0]["bytes_received"] > 0 and got[1]["bytes_received"] > 0, got
    assert got[2]["bytes_sent"] > 0 and got[3]["bytes_sent"] > 0, got
    assert got[2]["bytes_received"] == got[3]["bytes_received"] == 0, got
    assert got[2]["bytes_sent"] + got[3]["bytes_sent"] == got[0]["bytes_received"] + got[1]["bytes_received"]
    # node 1's tier holds its own bundle again, and the replicas of nodes 0 and 2 it held
    assert got[0]["node1_tier"] == ["node-0", "node-1", "node-2"], got[0]


def test_one_holder_client_serves_both_clients_of_the_lost_node(job):
    got = {rank: _phase(job, rank, "one_server") for rank in range(NPROC)}
    for rank, value in got.items():
        assert value["step"] == 2 and value["mismatches"] == [] and value["plain"] == [2.0, 2.0, 2.0], (rank, value)
    assert got[0]["bytes_received"] > 0 and got[1]["bytes_received"] > 0, got
    assert got[2]["bytes_sent"] == 0 and got[3]["bytes_sent"] == got[0]["bytes_received"] + got[1]["bytes_received"]
    assert got[0]["node1_tier"] == ["node-0", "node-1"], got[0]  # its own bundle, and node 0's replica
