"""Moving a node's bundle between nodes of unequal size (tiers/transfer.py), on three real clients.

tests/helpers/tier_lanes_worker.py runs under torchrun (gloo) and mpiexec: clients 0 and 1 are
node ``a``, client 2 node ``b``, so every move has one lane and all of a bundle's files go
over it; a sender whose file was cut short after it was listed sends zeros in its place and
reports, and its receiver still gets every promised byte (no client waits for bytes that never
come). A client of node ``b`` reads node ``a``'s bundle straight from client 0 (tiers/peer.py):
what is not in the bundle is refused and named, values come back exact, a flipped byte fails its
checksum.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import pytest

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "tier_lanes_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import run_job  # noqa: E402  (tests/helpers)

NPROC = 3


@pytest.fixture(scope="module", params=["torch", "mpi"])
def job(request, tmp_path_factory) -> Dict[int, Any]:
    tmp = tmp_path_factory.mktemp(f"lanes-{request.param}")
    return run_job(request.param, NPROC, WORKER, tmp / "out", tmp / "data")


def _value(results: Dict[int, Any], rank: int, name: str) -> Dict[str, Any]:
    entry = results[rank]["phases"][name]
    assert entry["ok"], entry
    return entry["value"]


def test_a_bundle_moves_whole_over_the_one_lane_of_unequal_nodes(job):
    assert job[0]["nodes"] == {"nodes": ["a", "b"], "node_of_rank": ["a", "a", "b"]}
    sender, idle, receiver = (_value(job, r, "a_to_b") for r in range(3))
    assert len(sender["source"]) == 4  # three data files and the index
    assert receiver["received_files"] == sender["source"]  # byte for byte
    total = sum(size for size, _ in sender["source"].values())
    assert sender["sent"] == receiver["received"] == total
    assert idle["sent"] == idle["received"] == 0 and not (sender["error"] or receiver["error"] or idle["error"])
    back = _value(job, 0, "b_to_a")
    assert back["received_files"] == sender["source"] and _value(job, 2, "b_to_a")["sent"] == total


def test_a_sender_that_cannot_read_sends_zeros_and_reports_and_its_receiver_never_waits(job):
    sender, receiver = _value(job, 0, "sender_fault"), _value(job, 2, "sender_fault")
    assert "holds 1000 bytes" in sender["error"] and ".data-00001-of-00003" in sender["error"], sender
    assert receiver["error"] is None
    promised = _value(job, 2, "a_to_b")["received"]
    assert sender["sent"] == receiver["received"] == promised  # every promised byte arrived
    name = [n for n in receiver["received_files"] if ".data-00001-" in n][0]
    assert receiver["received_files"][name][0] == _value(job, 2, "a_to_b")["received_files"][name][0]


def test_a_peer_serves_a_bundle_to_a_restore_refusing_what_is_not_in_it(job):
    server, client = _value(job, 0, "peer"), _value(job, 2, "peer")
    kind, message = client["past_the_end"]
    assert kind == "StorageError" and "rank 0 could not serve it" in message and ".data-00000-of-00003" in message
    assert server["error"] is not None and "asked for" in server["error"]  # its first error, not raised
    piece, cut = client["values"]
    assert piece == [2.0]  # the whole stored piece (row 1), fetched when the call ended
    assert cut == [[1.0] * 4, [2.0] * 4, [3.0] * 4]  # a region cutting every piece, served at once
    assert client["whole"] == [[1.0] * 5, [2.0] * 5, [3.0] * 5]
    assert server["sent"] == client["received"] > 50000 * 4
    assert server["streaming"] == 1  # told once that a request's bulk streams (a piece of 200000 bytes > 64 KiB)


def test_a_damaged_replica_fails_its_checksum_when_read_from_a_peer(job):
    client = _value(job, 2, "peer_damaged")
    kind, message = client["failed"]
    assert kind == "DataLossError" and "checksum does not match" in message, message
    assert ".data-00002-of-00003" in message and "'w'" in message and "slice 2,1:0,50000" in message, message
    assert "asked for" in _value(job, 0, "peer_damaged")["error"]  # the server saw only the request past the end
