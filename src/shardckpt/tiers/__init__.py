"""Tiered checkpoints: every save to a node-local tier with replicas on other nodes, every N-th also
to the persistent directory; a lost node's bundles recovered from its peers.

::

    tier = shardckpt.LocalTier("/dev/shm/run1", replicas=1, keep=2)
    manager = shardckpt.CheckpointManager(ckpt, "s3://bucket/run1", max_to_keep=3,
                                          local=tier, persist_every=100)
    manager.save()                   # node tier + replicas; every 100th also persistent
    manager.restore_or_initialize()  # newest step complete across the tiers, or persistent

Modules: :mod:`.nodes` (node identity, placement), :mod:`.tier` (``LocalTier``, the files),
:mod:`.transfer` (bundles between nodes), :mod:`.save` and :mod:`.restore` (the protocols),
:mod:`.checkpoints` (what the manager calls).
"""

from .nodes import NODE_ENV, NodeMap, node_id, replica_targets
from .restore import TierRestore
from .save import TierSave
from .tier import LocalTier

__all__ = ["LocalTier", "NodeMap", "node_id", "replica_targets", "NODE_ENV", "TierRestore", "TierSave"]
