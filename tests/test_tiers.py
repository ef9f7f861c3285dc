"""Tiered checkpoints in one process: placement, node identity, the files of a tier, restore choices.

(Four clients as two nodes under torchrun and mpiexec: tests/test_tiers_multiclient.py.)
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import shardckpt
from shardckpt.errors import InvalidArgumentError
from shardckpt.tiers import NodeMap, node_id, replica_targets
from shardckpt.tiers.checkpoints import Tiered
from shardckpt.tiers.peer import peer_pairs
from shardckpt.tiers.restore import choose_step, replica_moves

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from ramdisk import ramdisk  # noqa: E402  (tests/helpers)


def test_replicas_go_to_the_next_nodes_never_the_node_itself():
    assert replica_targets(0, 4, 1) == [1]
    assert replica_targets(3, 4, 2) == [0, 1]
    assert replica_targets(1, 2, 5) == [0]  # fewer other nodes than replicas
    assert replica_targets(0, 1, 1) == []
    for nodes in range(1, 6):
        for i in range(nodes):
            assert i not in replica_targets(i, nodes, 3)


def test_node_id_prefers_shardckpt_node_then_group_rank(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("SHARDCKPT_NODE", "7")
    assert node_id() == "7"
    monkeypatch.delenv("SHARDCKPT_NODE")
    assert node_id() == "3"


def test_node_map_orders_numeric_ids_numerically():
    m = NodeMap(("10", "10", "2", "2"), ("2", "10"))
    assert m.leader("10") == 0 and m.leader("2") == 2
    assert m.replicas_of("2", 1) == ["10"]


def test_the_newest_step_complete_across_nodes_is_chosen():
    nodes = NodeMap(("0", "1"), ("0", "1"))
    # step 6: node 1's bundle only at node 0 (replica); step 7: node 0's bundle nowhere
    reports = {"0": {"6": ["0", "1"], "7": ["1"]}, "1": {"5": ["0", "1"], "7": ["1"]}}
    assert choose_step(reports, nodes) == (6, {"0": ["0"], "1": ["0"]})
    assert choose_step({"0": {}, "1": {}}, nodes) == (None, {})


def test_the_replicas_a_lost_node_held_are_restocked_from_another_holder():
    nodes = NodeMap(("0", "1", "2"), ("0", "1", "2"))  # replicas=2: each node's bundle on both others
    # node 1 lost its tier: its own bundle is at 2 and 0; it held replicas of 0 and 2
    reports = {"0": {"6": ["0", "1", "2"]}, "1": {}, "2": {"6": ["0", "1", "2"]}}
    step, holders = choose_step(reports, nodes)
    assert (step, holders) == (6, {"0": ["0", "2"], "1": ["0", "2"], "2": ["0", "2"]})
    assert replica_moves(reports, holders, nodes, 6, 2) == [("0", "1", "0"), ("0", "1", "2")]
    assert replica_moves(reports, holders, nodes, 6, 1) == [("0", "1", "0")]  # replicas=1: 0's goes to 1 only
    # node 0 lost its own bundle only: its replicas elsewhere are whole, so nothing to restock
    reports = {"0": {"6": ["1", "2"]}, "1": {"6": ["0", "1", "2"]}, "2": {"6": ["0", "1", "2"]}}
    step, holders = choose_step(reports, nodes)
    assert replica_moves(reports, holders, nodes, 6, 2) == []


def test_a_lost_node_s_clients_are_spread_over_every_holder_of_its_bundle():
    # nodes 0 and 2 (ranks 2 and 3) hold node 1's bundle (ranks 0 and 1): one client served by each
    nodes = NodeMap(("1", "1", "0", "2"), ("0", "1", "2"))
    assert peer_pairs(nodes, [("0", "1", "1")], {"1": ["0", "2"]}) == [(2, 0, "0", "1", "1"), (3, 1, "2", "1", "1")]
    assert peer_pairs(nodes, [("0", "1", "1")]) == [(2, 0, "0", "1", "1"), (2, 1, "0", "1", "1")]  # one holder
    # one holder of 2 clients, a lost node of 3: client k served by the holder's client k mod 2
    nodes = NodeMap(("0", "0", "1", "1", "1"), ("0", "1"))
    assert [(server, client) for server, client, *_ in peer_pairs(nodes, [("0", "1", "1")], {"1": ["0"]})] == [
        (0, 2), (1, 3), (0, 4)]
    # two lost nodes, two holders of both bundles, two clients each: every holder's client serves one client
    nodes = NodeMap(("0", "0", "1", "1", "2", "2", "3", "3"), ("0", "1", "2", "3"))
    pairs = peer_pairs(nodes, [("2", "0", "0"), ("2", "1", "1")], {"0": ["2", "3"], "1": ["2", "3"]})
    assert sorted(server for server, *_ in pairs) == [4, 5, 6, 7]
    assert [(client, source) for _, client, source, *_ in pairs] == [(0, "2"), (1, "3"), (2, "2"), (3, "3")]
    # a holder that is itself a move's target never serves
    assert {source for _, _, source, *_ in peer_pairs(nodes, [("2", "0", "0"), ("2", "1", "1")],
                                                      {"0": ["1", "2"], "1": ["2"]})} == {"2"}


def _saves(tmp_path, count=6):
    value = shardckpt.Variable(np.zeros(5, np.float32))
    tier = shardckpt.LocalTier(str(tmp_path / "tier" / "{node}"))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=3,
                                          local=tier, persist_every=5)
    paths = []
    for n in range(1, count + 1):
        value.assign(np.full(5, n, np.float32))
        paths.append(manager.save())
    manager.sync()  # a step that also persists is copied into the tier in the background
    return paths


def _restore(tmp_path):
    value = shardckpt.Variable(np.zeros(5, np.float32))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=3,
                                          local=shardckpt.LocalTier(str(tmp_path / "tier" / "{node}")),
                                          persist_every=5)
    return manager.restore_or_initialize(), value.numpy(), manager.local.last_restore


def test_local_saves_persist_every_fifth_and_restore_the_newest(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    paths = _saves(tmp_path)
    own = tmp_path / "tier" / "n0" / "node-n0"
    assert paths[4] == str(tmp_path / "persistent" / "ckpt-5")
    assert paths[5] == str(own / "ckpt-6")
    assert sorted(p.name for p in own.iterdir() if p.name.endswith(".committed")) == \
        ["ckpt-5.committed", "ckpt-6.committed"]  # keep=2
    assert shardckpt.latest_checkpoint(str(tmp_path / "persistent")).endswith("ckpt-5")
    # a tier bundle is a TF-format checkpoint
    assert np.array_equal(shardckpt.load_checkpoint(str(own / "ckpt-6")).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE"),
                          np.full(5, 6, np.float32))
    returned, value, last = _restore(tmp_path)
    assert returned == str(own / "ckpt-6") and last.step == 6 and np.array_equal(value, np.full(5, 6))


def test_an_unmarked_bundle_never_counts_and_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path)
    own = tmp_path / "tier" / "n0" / "node-n0"
    for p in list(own.iterdir()):  # what a save of step 7 killed before its marker leaves
        if p.name.startswith("ckpt-6.") and not p.name.endswith(".committed"):
            shutil.copy(p, own / p.name.replace("ckpt-6", "ckpt-7"))
    returned, value, _ = _restore(tmp_path)
    assert returned == str(own / "ckpt-6") and np.array_equal(value, np.full(5, 6))
    assert not [p for p in own.iterdir() if p.name.startswith("ckpt-7")]


def test_what_a_killed_merge_leaves_is_removed_with_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path)
    own = tmp_path / "tier" / "n0" / "node-n0"
    (own / "ckpt-7.index.tempstate2760640828696044702").write_bytes(b"x" * 1105)  # a merge of step 7 killed
    (own / "ckpt-3.index.tempstate17").write_bytes(b"x")  # an older step's, which retention (keep=2) drops
    value = shardckpt.Variable(np.zeros(5, np.float32))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=3,
                                          local=shardckpt.LocalTier(str(tmp_path / "tier" / "{node}")),
                                          persist_every=5)
    assert manager.restore_or_initialize() == str(own / "ckpt-6")
    assert not [p.name for p in own.iterdir() if p.name.startswith("ckpt-7")]  # newer than the step restored
    manager.save()
    manager.sync()
    assert sorted({p.name.split(".")[0] for p in own.iterdir()}) == ["ckpt-6", "ckpt-7"]


def test_a_damaged_bundle_does_not_count_and_passing_it_over_is_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path)
    own = tmp_path / "tier" / "n0" / "node-n0"
    with open(own / "ckpt-6.data-00000-of-00001", "ab") as f:
        f.write(b"x")  # its size no longer what the marker says
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        returned, value, last = _restore(tmp_path)
    assert returned == str(own / "ckpt-5") and last.step == 5 and np.array_equal(value, np.full(5, 5))
    assert last.newest_saved == 6
    assert "restoring local step 5: the local tiers hold a newer step, 6, that cannot be restored (no tier " \
           "holds whole node n0's bundle of step 6" in caplog.text, caplog.text


@pytest.mark.parametrize("marker", [
    b"{not json",
    b"[1, 2]",
    b'{"step": 6, "files": [1]}',
    b'{"step": 6, "files": [["ckpt-6.index", "12"]]}',
    b'{"step": 6, "files": [["../../../etc/hostname", 0]]}',
    b'{"step": 6, "files": [["ckpt-6.index", -1]]}',
    b'{"step": 7, "files": [["ckpt-6.index", 0]]}',
    b'{"step": 6, "nodes": {"n0": 1}, "files": [["ckpt-6.index", 0]]}',
    b"\xff\xfe",
    b"[" * 200_000,
    b'{"step": 6, "files": [["ckpt-6.index", 0]], "pad": "' + b"x" * (1 << 20) + b'"}',
], ids=["not-json", "not-object", "entry-not-pair", "size-not-int", "outside", "negative", "other-step",
        "nodes-not-ids", "not-utf8", "nested-too-deep", "too-large"])
def test_a_malformed_marker_never_counts_its_bundle_and_verify_names_it(tmp_path, monkeypatch, capsys, marker):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path)
    own = tmp_path / "tier" / "n0" / "node-n0"
    (own / "ckpt-6.committed").write_bytes(marker)
    assert _cli("verify", str(tmp_path / "tier" / "n0")) == 1
    out = capsys.readouterr().out
    assert f"{own / 'ckpt-6.committed'}: malformed marker (" in out and "FAILED: 1 of 2 committed bundles bad" in out
    returned, value, last = _restore(tmp_path)  # no crash, no hang: step 6 does not count
    assert returned == str(own / "ckpt-5") and last.step == 5 and np.array_equal(value, np.full(5, 5))
    assert not (own / "ckpt-6.committed").exists()  # dropped with its step, newer than the step restored


def test_a_bundle_failing_its_checksum_restores_the_persistent_step_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path)
    own = tmp_path / "tier" / "n0" / "node-n0"
    (own / "ckpt-5.committed").unlink()  # step 5 only in the persistent directory
    data = own / "ckpt-6.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0x01  # same size: the marker counts it whole; its checksum fails when read
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        returned, value, last = _restore(tmp_path)
    assert returned == str(tmp_path / "persistent" / "ckpt-5") and last.step is None
    assert np.array_equal(value, np.full(5, 5))
    assert f"restoring the persistent checkpoint {tmp_path / 'persistent' / 'ckpt-5'}: the local tiers hold a " \
           "newer step, 6, that cannot be restored (restoring local step 6 failed: rank 0: " in caplog.text
    assert "checksum" in caplog.text, caplog.text


def test_restoring_the_newest_step_saved_warns_of_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path, count=5)  # step 5: persistent, and copied into the tier
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        _, value, last = _restore(tmp_path)
    assert last.step == 5 and last.newest_saved == 5 and np.array_equal(value, np.full(5, 5))
    assert "cannot be restored" not in caplog.text, caplog.text


def test_a_wiped_tier_restores_the_persistent_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path)
    shutil.rmtree(tmp_path / "tier")
    returned, value, last = _restore(tmp_path)
    assert returned == str(tmp_path / "persistent" / "ckpt-5") and last.step is None
    assert np.array_equal(value, np.full(5, 5))


def test_a_newer_persistent_checkpoint_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path, count=5)
    own = tmp_path / "tier" / "n0" / "node-n0"
    for name in os.listdir(own):
        if name.startswith("ckpt-5"):
            os.remove(own / name)  # the tier's newest is step 4; the persistent one is 5
    returned, value, last = _restore(tmp_path)
    assert returned == str(tmp_path / "persistent" / "ckpt-5") and "newer" in last.reason
    assert np.array_equal(value, np.full(5, 5))


def test_persist_every_needs_a_local_tier(tmp_path):
    ckpt = shardckpt.Checkpoint(v=shardckpt.Variable(np.zeros(2)))
    with pytest.raises(InvalidArgumentError, match="persist_every"):
        shardckpt.CheckpointManager(ckpt, str(tmp_path), max_to_keep=1, persist_every=5)
    with pytest.raises(InvalidArgumentError, match="replicas"):
        shardckpt.LocalTier(str(tmp_path), replicas=-1)


def test_a_checkpoint_the_tiers_cannot_list_is_refused_when_the_manager_is_made(tmp_path):
    class Saves:  # saves and restores by itself, but has no tier pieces to give
        def write(self, path, options=None):
            return path

    with pytest.raises(InvalidArgumentError, match="not a Saves"):
        shardckpt.CheckpointManager(Saves(), str(tmp_path / "p"), max_to_keep=1,
                                    local=shardckpt.LocalTier(str(tmp_path / "t")))


def _cli(*argv):
    from shardckpt.cli.main import main

    return main(list(argv))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 3 MiB RAM disk, as a container's small /dev/shm is (tests/helpers/ramdisk.py)."""
    with ramdisk(tmp_path / "shm", "3m") as folder:
        yield folder


def test_a_full_tier_fails_its_saves_loudly_says_why_and_leaves_nothing(tmp_path, monkeypatch, small_tmpfs):
    from shardckpt.distributed.coordinator import CoordinationError

    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    value = shardckpt.Variable(np.zeros(1 << 18, np.float32))  # 1 MiB: two steps fit in 3 MiB, three do not
    tier = shardckpt.LocalTier(str(small_tmpfs / "{node}"), keep=2)
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=2,
                                          local=tier, persist_every=3)
    own = small_tmpfs / "n0" / "node-n0"
    for step in (1, 2):
        value.assign(np.full(1 << 18, step, np.float32))
        assert manager.save() == str(own / f"ckpt-{step}")
    value.assign(np.full(1 << 18, 3, np.float32))
    assert manager.save() == str(tmp_path / "persistent" / "ckpt-3")  # persisted; its copy into the tier fails
    manager.sync()
    assert "No space left on device" in tier.last_save_error and "the tier is full: it keeps keep=2 steps" in \
        tier.last_save_error, tier.last_save_error
    value.assign(np.full(1 << 18, 4, np.float32))
    with pytest.raises(CoordinationError, match=r"No space left on device \(the tier is full: it keeps keep=2 steps "
                                                r"and writes the next one before it removes the oldest, so it needs "
                                                r"room for 3 x \(1 \+ replicas=1\)"):
        manager.save()
    assert sorted(p.name for p in own.iterdir()) == [f"ckpt-{s}{e}" for s in (1, 2)
                                                     for e in (".committed", ".data-00000-of-00001", ".index")]
    restored = shardckpt.Variable(np.zeros(1 << 18, np.float32))
    again = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=restored), str(tmp_path / "persistent"),
                                        max_to_keep=2, local=shardckpt.LocalTier(str(small_tmpfs / "{node}"), keep=2),
                                        persist_every=3)
    assert again.restore_or_initialize() == str(tmp_path / "persistent" / "ckpt-3")
    assert np.array_equal(restored.numpy(), np.full(1 << 18, 3, np.float32))


def test_verify_and_inspect_read_a_tier_folder(tmp_path, monkeypatch, capsys):
    from shardckpt.distributed.single import SingleProcessCoordinator
    from shardckpt.tiers.save import save_to_tier

    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    tier = shardckpt.LocalTier(str(tmp_path / "tier"))
    coordinator = SingleProcessCoordinator()
    nodes = NodeMap.gather(coordinator)
    # a node bundle holds a partial set of slices: rows 0-1 of a (4, 3) tensor
    part = np.arange(6, dtype=np.float32).reshape(2, 3)
    save_to_tier(tier, 1, [("w", (4, 3), ((0, 2), (0, 3)), part)], coordinator, nodes)
    prefix = tier.prefix("n0", "n0", 1)
    assert _cli("verify", str(tmp_path / "tier")) == 0
    out = capsys.readouterr().out
    assert "step 1 node n0: committed" in out and "OK: 1 bundles verified" in out
    assert _cli("verify", prefix) == 0  # one bundle, its slices not tiling the tensor: fine in a tier
    capsys.readouterr()
    # a leftover (no marker) is listed, not read
    shutil.copy(prefix + ".index", prefix.replace("ckpt-1", "ckpt-2") + ".index")
    assert _cli("inspect", str(tmp_path / "tier" / "node-n0")) == 0
    assert "step 2 node n0: not committed (a leftover)" in capsys.readouterr().out
    data = prefix + ".data-00000-of-00001"
    raw = bytearray(open(data, "rb").read())
    raw[0] ^= 0xFF  # same size, a flipped byte: its CRC32C fails
    open(data, "wb").write(bytes(raw))
    assert _cli("verify", str(tmp_path / "tier")) == 1
    out = capsys.readouterr().out
    assert "BAD key 'w'" in out and "FAILED: 1 of 1 committed bundles bad" in out


def test_an_asynchronous_tiered_save_keeps_the_values_of_its_call(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    value = shardckpt.Variable(np.zeros(1000, np.float32))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=3,
                                          local=shardckpt.LocalTier(str(tmp_path / "tier" / "{node}")),
                                          persist_every=3)
    options = shardckpt.CheckpointOptions(enable_async=True)
    for n in range(1, 6):
        value.assign(np.full(1000, n, np.float32))
        manager.save(options=options)
        value.assign(np.full(1000, -1, np.float32))  # after the return: in no checkpoint
    manager.sync()
    target = shardckpt.Variable(np.zeros(1000, np.float32))
    again = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=target), str(tmp_path / "persistent"), max_to_keep=3,
                                        local=shardckpt.LocalTier(str(tmp_path / "tier" / "{node}")), persist_every=3)
    again.restore_or_initialize()
    assert again.local.last_restore.step == 5 and np.array_equal(target.numpy(), np.full(1000, 5, np.float32))
    persistent = shardckpt.load_checkpoint(str(tmp_path / "persistent" / "ckpt-3"))
    assert np.array_equal(persistent.get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE"), np.full(1000, 3, np.float32))


def test_under_mpiexec_clients_of_one_machine_are_one_node(tmp_path):
    """Without SHARDCKPT_NODE, MPI's shared-memory split names the node (its lowest COMM_WORLD rank)."""
    import json

    from helpers.launchers import clean_env, launch_command, run_launched

    script = tmp_path / "node.py"
    script.write_text(
        "import json, os\n"
        "from shardckpt.distributed.mpi_backend import MPICoordinator\n"
        "from shardckpt.tiers import NodeMap\n"
        "c = MPICoordinator(timeout=60)\n"
        "m = NodeMap.gather(c)\n"
        f"open(os.path.join({str(tmp_path)!r}, f'rank{{c.rank}}.json'), 'w').write(json.dumps(m.as_json()))\n"
        "c.close()\n")
    env = clean_env()
    env.pop("SHARDCKPT_NODE", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(shardckpt.__file__))),
                                         env.get("PYTHONPATH", "")])
    proc = run_launched(launch_command("mpi", 2, script), env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"nodes": ["0"], "node_of_rank": ["0", "0"]}


def test_restore_waits_for_a_tiered_save_in_flight(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    value = shardckpt.Variable(np.zeros(16 << 20, np.float32))  # 64 MiB: its save is still in flight below
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=3,
                                          local=shardckpt.LocalTier(str(tmp_path / "tier" / "{node}")),
                                          persist_every=10)
    options = shardckpt.CheckpointOptions(enable_async=True)
    for n in (1, 2):
        value.assign(np.full(16 << 20, n, np.float32))
        manager.save(options=options)
    value.assign(np.zeros(16 << 20, np.float32))
    assert manager.restore_or_initialize() == str(tmp_path / "tier" / "n0" / "node-n0" / "ckpt-2")
    assert manager.local.last_restore.step == 2 and value.numpy()[0] == 2 and value.numpy()[-1] == 2


def test_tensorflow_reads_a_tier_bundle(tmp_path, monkeypatch, tf_oracle):
    """A node's bundle in the tier is a TensorFlow checkpoint: real TF reads every value of it."""
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    paths = _saves(tmp_path)
    got, errors, _ = tf_oracle.load_checkpoint(paths[5])  # step 6: in the tier only
    assert errors == {}
    assert np.array_equal(np.asarray(got["v/.ATTRIBUTES/VARIABLE_VALUE"]), np.full(5, 6, np.float32))


def test_a_persistent_step_is_copied_into_the_tier_behind_it_and_a_failed_copy_never_fails_it(tmp_path, monkeypatch,
                                                                                                caplog):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    value = shardckpt.Variable(np.zeros(5, np.float32))
    tier = shardckpt.LocalTier(str(tmp_path / "tier" / "{node}"))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=3,
                                          local=tier, persist_every=2)
    own = tmp_path / "tier" / "n0" / "node-n0"
    value.assign(np.full(5, 1, np.float32))
    manager.save()
    value.assign(np.full(5, 2, np.float32))
    assert manager.save() == str(tmp_path / "persistent" / "ckpt-2")  # committed when it returns
    value.assign(np.full(5, -1, np.float32))  # the tier copy has the values of the call, not these
    manager.sync()
    assert (own / "ckpt-2.committed").exists() and tier.last_save_error is None
    assert np.array_equal(shardckpt.load_checkpoint(str(own / "ckpt-2")).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE"),
                          np.full(5, 2, np.float32))
    # the tier cannot take step 4: the persistent step 4 still commits, nothing is raised, the failure is told
    (own / "ckpt-4.index").mkdir()
    value.assign(np.full(5, 3, np.float32))
    manager.save()
    value.assign(np.full(5, 4, np.float32))
    with caplog.at_level("WARNING", logger="shardckpt"):
        assert manager.save() == str(tmp_path / "persistent" / "ckpt-4")
        manager.sync()
    assert "ckpt-4.index" in (tier.last_save_error or "") and "step 4" in tier.last_save_error
    assert any("local tiers failed" in r.getMessage() for r in caplog.records)
    assert manager.checkpoint.save_counter.numpy() == 4 and not (own / "ckpt-4.committed").exists()
    (own / "ckpt-4.index").rmdir()
    returned, restored, last = _restore_every(tmp_path, 2)
    assert returned == str(tmp_path / "persistent" / "ckpt-4") and "newer" in last.reason
    assert np.array_equal(restored, np.full(5, 4))
    value.assign(np.full(5, 5, np.float32))
    assert manager.save() == str(own / "ckpt-5")  # the next save goes on as usual
    returned, restored, last = _restore_every(tmp_path, 2)
    assert returned == str(own / "ckpt-5") and last.step == 5 and np.array_equal(restored, np.full(5, 5))


def test_a_persisted_step_is_read_back_into_the_tier_behind_it_not_copied_beside_its_save(tmp_path, monkeypatch):
    """A persistent step costs what a save without a tier costs: no host copy of the values runs beside its
    save (on 2 cores it took CPU and memory bandwidth from the save); its tier copy reads the committed step
    back behind it. A persistent folder in an object store is not read back (a download): copied on the host."""
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    copied = []
    host_copy = Tiered._stage
    monkeypatch.setattr(Tiered, "_stage", lambda self, pieces: copied.append(len(pieces)) or host_copy(self, pieces))
    for kind, persistent in (("local", str(tmp_path / "persistent")),
                             ("object store", f"memory://shardckpt-{uuid.uuid4().hex[:8]}/persistent")):
        copied.clear()
        value = shardckpt.Variable(np.zeros(5, np.float32))
        tier = shardckpt.LocalTier(str(tmp_path / kind / "{node}"), keep=2)
        manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), persistent, max_to_keep=2, local=tier,
                                              persist_every=2)
        for n in (1, 2, 3, 4):
            value.assign(np.full(5, n, np.float32))
            manager.save()
            value.assign(np.full(5, -n, np.float32))  # after the call: never in any copy
        manager.sync()
        assert (copied != []) == (kind == "object store"), kind
        assert tier.last_save_error is None
        own = tmp_path / kind / "n0" / "node-n0"
        for step in (3, 4):  # a tier-only step and a persisted one, read back from the persistent step 4
            assert np.array_equal(shardckpt.load_checkpoint(str(own / f"ckpt-{step}"))
                                  .get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE"), np.full(5, step, np.float32)), kind


def _restore_every(tmp_path, persist_every):
    value = shardckpt.Variable(np.zeros(5, np.float32))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), str(tmp_path / "persistent"), max_to_keep=3,
                                          local=shardckpt.LocalTier(str(tmp_path / "tier" / "{node}")),
                                          persist_every=persist_every)
    return manager.restore_or_initialize(), value.numpy(), manager.local.last_restore


def test_a_merged_view_reads_every_node_s_pieces_once_and_links_instead_of_copying(tmp_path):
    """Two nodes' bundles of one step: each holds its own rows of a sliced tensor, the same replicated
    slice and the same whole value; the view reads all of it, each shared entry from the first bundle."""
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.format.bundle_writer import BundleWriter
    from shardckpt.storage.location import Location
    from shardckpt.tiers.merged import merged_view, remove_view

    tier = shardckpt.LocalTier(str(tmp_path / "tier" / "{node}"))
    full = np.arange(32, dtype=np.float32).reshape(4, 8)
    for owner, rows in (("0", "0,2"), ("1", "2,2")):
        writer = BundleWriter(Location.of(tier.prefix("0", owner, 6)))
        writer.add_slice("t", (4, 8), f"{rows}:-", full[int(rows[0]):int(rows[0]) + 2])
        writer.add_slice("r", (2, 3), "-:0,2", np.full((2, 2), 7, np.int32))  # saved by both nodes
        writer.add("w", np.full(3, int(owner) + 1.0))  # whole: node 0's wins
        writer.finish()
    view = merged_view(tier, "0", ["0", "1"], 6, rank=3)
    assert os.path.dirname(view) == str(tmp_path / "tier" / "0" / ".merged-6-3")
    reader = BundleReader(Location.of(view))
    try:
        assert np.array_equal(reader.read("t"), full)
        assert np.array_equal(reader.read_region("r", ((0, 2), (0, 2))), np.full((2, 2), 7, np.int32))
        assert np.array_equal(reader.read("w"), np.full(3, 1.0))
        assert len(reader.piece_boxes("r")) == 1  # the replicated slice once, not twice
    finally:
        reader.close()
    linked = sorted(p for p in os.listdir(os.path.dirname(view)) if ".data-" in p)
    assert linked == ["ckpt-6.data-00000-of-00002", "ckpt-6.data-00001-of-00002"]
    assert os.stat(os.path.join(os.path.dirname(view), linked[0])).st_nlink == 2  # a link, not a copy
    remove_view(view)
    assert not os.path.exists(os.path.dirname(view))
    assert tier.committed("0") == {}  # a view never counts as a bundle


def test_missing_from_names_what_a_bundle_does_not_hold_from_its_index(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_NODE", "n0")
    _saves(tmp_path, count=1)
    prefix = str(tmp_path / "tier" / "n0" / "node-n0" / "ckpt-1")
    same = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=shardckpt.Variable(np.zeros(5, np.float32))),
                                       str(tmp_path / "p2"), max_to_keep=1,
                                       local=shardckpt.LocalTier(str(tmp_path / "t2")), persist_every=5)
    assert same._tiered.missing_from(prefix) is None
    more = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=shardckpt.Variable(np.zeros(5, np.float32)),
                                                            u=shardckpt.Variable(np.zeros(2, np.float32))),
                                       str(tmp_path / "p3"), max_to_keep=1,
                                       local=shardckpt.LocalTier(str(tmp_path / "t3")), persist_every=5)
    assert more._tiered.missing_from(prefix) == "u/.ATTRIBUTES/VARIABLE_VALUE"


def test_a_merged_view_of_a_truncated_index_fails_with_an_error_naming_the_file(tmp_path):
    from shardckpt.errors import ShardckptError
    from shardckpt.format.bundle_writer import BundleWriter
    from shardckpt.storage.location import Location
    from shardckpt.tiers.merged import merged_view

    tier = shardckpt.LocalTier(str(tmp_path / "tier" / "{node}"))
    for owner in ("0", "1"):
        writer = BundleWriter(Location.of(tier.prefix("0", owner, 6)))
        writer.add(f"w{owner}", np.arange(4.0))
        writer.finish()
    index = tier.prefix("0", "1", 6) + ".index"
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) // 2)
    with pytest.raises(ShardckptError) as caught:
        merged_view(tier, "0", ["0", "1"], 6, rank=0)
    assert index in str(caught.value), caught.value
