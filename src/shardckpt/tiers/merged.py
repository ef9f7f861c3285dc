"""One checkpoint of a step from every node's bundle a tier holds: what a restore onto another layout reads.

A node's bundle of step ``S`` holds the pieces its clients saved (each distinct piece once)
and the whole values and the object graph; a restore in the layout of the save reads its
own node's bundle alone. A restore onto another mesh or layout may need pieces that other
nodes saved. Once the node's tier holds every node's bundle of ``S`` (its own and the
replicas it holds; :mod:`.restore` moves over what it lacks), :func:`merged_view` makes one
TF-format checkpoint of them, in a folder of its own beside the node folders::

    <tier root>/.merged-<step>-<rank>/ckpt-<step>.data-<i>-of-<n>   hard links to the bundles' data files
                                                                   (symbolic ones where the file
                                                                   system has none)
    <tier root>/.merged-<step>-<rank>/ckpt-<step>.index             the bundles' entries, merged

Nothing is copied: the data files are linked (the same file system), and the merged index
is the bundles' entries with their ``shard_id`` renumbered (:func:`~shardckpt.format.merge.plan_merge`).
Bundles are taken in the order given (the node's own first). What two bundles both hold
(the whole values, the object graph, a replicated piece saved on both nodes) is taken from
the first: a later bundle's entry whose key was seen is dropped, and of a sliced tensor's
full entry only the slices not seen yet are kept. Each client makes its own view (its rank
in the name) and removes it when its restore ends (:func:`remove_view`); a view that a killed
client left (its links keep the data files' memory) is removed by the node's leader at the next
restore's report round, before any client of the node makes one (:func:`stale_views`).
Nothing of a view ever counts as a bundle: the tier's listings only look into ``node-*``
folders.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Iterator, List, Sequence, Set, Tuple

from ..format.merge import MergeInput, plan_merge, read_index
from ..format.naming import data_filename, index_filename
from ..format.protos import tensor_bundle_pb2 as pb
from ..storage.local import LocalFileSystem
from .tier import NAME, LocalTier

__all__ = ["merged_view", "remove_view", "stale_views", "VIEW_PREFIX"]

#: The folder name of a merged view starts so (hidden; never a ``node-*`` folder)
VIEW_PREFIX = ".merged-"


def _deduplicated(prefixes: Sequence[str]) -> Iterator[MergeInput]:
    """Each bundle's header and entries, less what an earlier bundle holds (see the module docstring).
    An entry is parsed only when a later bundle holds its key too."""
    fs = LocalFileSystem()
    first: Dict[bytes, bytes] = {}  # key -> the entry taken
    slices: Dict[bytes, Set[bytes]] = {}  # key of a sliced tensor held twice -> its slices taken so far
    for prefix in prefixes:
        header, items = read_index(prefix, fs)
        kept: List[Tuple[bytes, bytes]] = []
        for key, value in items:
            taken = first.get(key)
            if taken is None:
                first[key] = value
                kept.append((key, value))
                continue
            if key not in slices:
                slices[key] = {s.SerializeToString() for s in pb.BundleEntryProto.FromString(taken).slices}
            if not slices[key]:
                continue  # held whole (or as this very slice) by an earlier bundle
            entry = pb.BundleEntryProto.FromString(value)
            fresh = [s for s in entry.slices if s.SerializeToString() not in slices[key]]
            if not fresh:
                continue
            slices[key].update(s.SerializeToString() for s in fresh)
            del entry.slices[:]
            entry.slices.extend(fresh)
            kept.append((key, entry.SerializeToString()))
        yield prefix, header, kept


def merged_view(tier: LocalTier, node: str, owners: Sequence[str], step: int, rank: int) -> str:
    """A checkpoint of ``owners``' bundles of ``step`` in ``node``'s tier, merged (the first owner's entries
    win); returns its prefix. Remove it with :func:`remove_view` once read."""
    folder = os.path.join(tier.root(node), f"{VIEW_PREFIX}{int(step)}-{int(rank)}")
    shutil.rmtree(folder, ignore_errors=True)  # what a killed restore of this rank left
    os.makedirs(folder)
    plan = plan_merge(_deduplicated([tier.prefix(node, owner, step) for owner in owners]))
    prefix = os.path.join(folder, f"{NAME}-{int(step)}")
    for i, source in enumerate(plan.sources):
        target = data_filename(prefix, i, plan.count)
        try:
            os.link(source, target)
        except OSError:  # a file system without hard links: a symbolic link reads the same
            os.symlink(os.path.abspath(source), target)
    with open(index_filename(prefix), "wb") as f:
        f.write(plan.index(plan.count))
    return prefix


def remove_view(prefix: str) -> None:
    """Remove the view at ``prefix`` (its folder; the bundles it linked stay)."""
    shutil.rmtree(os.path.dirname(prefix), ignore_errors=True)


def stale_views(tier: LocalTier, node: str) -> List[str]:
    """The merged views in ``node``'s tier (folders; none is in use outside a restore's step 5b)."""
    root = tier.root(node)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, name) for name in sorted(os.listdir(root)) if name.startswith(VIEW_PREFIX)]
