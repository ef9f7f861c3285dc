"""``LocalTier``: a node-local folder of checkpoints, and what is on disk in it.

One tier folder per node (a RAM disk such as ``/dev/shm/<run>`` or a local NVMe; a
``{node}`` in the path is replaced by the node id, so one machine can simulate several
nodes). In it, for node ids ``K`` (this node's own, and the nodes it holds replicas of)
and steps ``N``::

    node-K/ckpt-N_parts/part-R.index, .data-*   while step N is written: client R's pieces
    node-K/ckpt-N.index, ckpt-N.data-I-of-M     node K's bundle of step N: a TF-format bundle
                                                of every piece node K's clients hold (each
                                                distinct piece once per node, replicated
                                                copies included) and the whole values and
                                                object graph, so those clients restore from
                                                it alone
    node-K/ckpt-N.committed                     the marker (JSON: step, node, the job's nodes,
                                                every file of the bundle with its size): the
                                                bundle counts only while it is there

A bundle without its marker is a leftover (a save that died, a replica that did not
arrive whole); the next save of that step, the tier's retention and a restore's
repopulation remove it, marker first. Markers are written (``write_atomic``: a temporary
name, fsync, rename, fsync of the folder) only after every client agreed that every bundle
and every replica of the step is in place (:mod:`.save`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..errors import InvalidArgumentError
from ..storage.local import LocalFileSystem

__all__ = ["LocalTier", "MARKER", "NAME"]

NAME = "ckpt"
MARKER = ".committed"
#: a bundle's index and data files, with what a merge killed before its renames leaves of them
#: (``.tempstate<digits>``: saving/commit/rename.py)
_DATA_SUFFIX = r"(?:\.index|\.data-\d+-of-\d+)(?:\.tempstate\d+)?"
_BUNDLE_FILE = re.compile(r"^" + NAME + r"-(\d+)(" + _DATA_SUFFIX + "|" + re.escape(MARKER) + r"|_parts)$")


@dataclass
class LocalTier:
    """A node-local checkpoint tier: every ``CheckpointManager.save`` writes here (and to ``replicas``
    other nodes); only every ``persist_every``-th goes to the persistent directory.

    Args:
      directory: this node's tier folder (local to the node: ``/dev/shm/<run>``, a local NVMe
        path); ``{node}`` in it is replaced by the node id.
      replicas: how many other nodes hold a copy of each node's bundle (fewer when the job has
        fewer other nodes): the placement of :func:`~shardckpt.tiers.nodes.replica_targets`.
      keep: how many of the newest local steps each node keeps (at least 1; every node deletes
        older steps only after every node committed the new one).
      chunk_bytes: bytes of one message of a transfer between nodes (a receiver holds two such
        buffers per lane: it writes one while it receives the other; a sender sends its files'
        mapped pages).
    """

    directory: str
    replicas: int = 1
    keep: int = 2
    chunk_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        self.directory = os.fspath(self.directory)
        if "://" in self.directory:
            raise InvalidArgumentError(f"a LocalTier is a node-local folder, got {self.directory!r}")
        if self.replicas < 0 or self.keep < 1 or self.chunk_bytes < 1:
            raise InvalidArgumentError(f"LocalTier needs replicas >= 0, keep >= 1 and chunk_bytes >= 1, got "
                                       f"replicas={self.replicas}, keep={self.keep}, chunk_bytes={self.chunk_bytes}")
        #: what the last restore through this tier did (see :class:`~shardckpt.tiers.restore.TierRestore`)
        self.last_restore: Optional[Any] = None
        #: why the background copy of the last persisted step into the tiers failed (``None``: it did not)
        self.last_save_error: Optional[str] = None

    def root(self, node: str) -> str:
        """The tier folder of ``node`` (``directory`` with ``{node}`` replaced)."""
        return os.path.abspath(self.directory.replace("{node}", node))

    def folder(self, node: str, owner: str) -> str:
        """Where ``node`` keeps the bundles of node ``owner`` (its own when ``owner == node``)."""
        return os.path.join(self.root(node), f"node-{owner}")

    def prefix(self, node: str, owner: str, step: int) -> str:
        """The prefix of ``owner``'s bundle of ``step`` in ``node``'s tier."""
        return os.path.join(self.folder(node, owner), f"{NAME}-{int(step)}")

    # -- what is committed ---------------------------------------------------------------------
    def committed(self, node: str) -> Dict[int, List[str]]:
        """Step -> the owners whose bundles of that step ``node``'s tier holds whole (marker present and
        every file it names there with its size)."""
        out: Dict[int, List[str]] = {}
        root = self.root(node)
        if not os.path.isdir(root):
            return out
        for sub in sorted(os.listdir(root)):
            if not sub.startswith("node-"):
                continue
            owner = sub[len("node-"):]
            for name in os.listdir(os.path.join(root, sub)):
                m = _BUNDLE_FILE.match(name)
                if m is None or m.group(2) != MARKER:
                    continue
                step = int(m.group(1))
                info = read_marker(self.prefix(node, owner, step))
                if info is not None and _whole(self.prefix(node, owner, step), info):
                    out.setdefault(step, []).append(owner)
        return out

    def newest_marked(self, node: str) -> Optional[int]:
        """The newest step of which ``node``'s tier has any marker (a save committed it there), whole or not."""
        newest: Optional[int] = None
        root = self.root(node)
        for sub in os.listdir(root) if os.path.isdir(root) else []:
            folder = os.path.join(root, sub)
            if sub.startswith("node-") and os.path.isdir(folder):
                for m in map(_BUNDLE_FILE.match, os.listdir(folder)):
                    if m is not None and m.group(2) == MARKER:
                        newest = max(int(m.group(1)), -1 if newest is None else newest)
        return newest

    def steps_on_disk(self, node: str) -> Dict[str, List[int]]:
        """Owner -> every step with any file (committed or not) in ``node``'s tier."""
        out: Dict[str, List[int]] = {}
        root = self.root(node)
        if not os.path.isdir(root):
            return out
        for sub in os.listdir(root):
            if sub.startswith("node-") and os.path.isdir(os.path.join(root, sub)):
                steps = {int(m.group(1)) for m in map(_BUNDLE_FILE.match, os.listdir(os.path.join(root, sub))) if m}
                out[sub[len("node-"):]] = sorted(steps)
        return out


def marker_path(prefix: str) -> str:
    return prefix + MARKER


def read_marker(prefix: str) -> Optional[Dict[str, Any]]:
    """The marker of the bundle at ``prefix`` (``None``: none, unreadable or malformed: the bundle does not count)."""
    info, _ = load_marker(prefix)
    return info


def load_marker(prefix: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(marker, None)`` for a well-formed marker of the bundle at ``prefix``; ``(None, None)`` when it has
    none; ``(None, what is wrong)`` when its marker cannot be read or is malformed (not JSON, or not
    naming the bundle's own files, each once, with sizes, the step, and the nodes as text): a damaged
    or hostile marker never makes a bundle count, nor names a file outside it."""
    path = marker_path(prefix)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MARKER_LIMIT + 1)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path}: cannot read the marker ({exc.strerror or exc})"
    try:
        if len(raw) > _MARKER_LIMIT:
            raise ValueError(f"larger than {_MARKER_LIMIT} bytes")
        info = json.loads(raw.decode("utf-8"))
        _check_marker(os.path.basename(prefix), info)
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deep to decode
        return None, f"{path}: malformed marker ({str(exc)[:200]})"
    return info, None


_MARKER_LIMIT = 1 << 20  # bytes: a marker names a bundle's few files


def _check_marker(base: str, info: Any) -> None:
    """Raise ``ValueError`` unless ``info`` is a marker of the bundle ``base`` (see :func:`load_marker`)."""
    if not isinstance(info, dict):
        raise ValueError("not a JSON object")
    files = info.get("files")
    if not isinstance(files, list) or not files:
        raise ValueError("no list of files")
    own = re.compile(re.escape(base) + r"(\.index|\.data-\d+-of-\d+)")
    names = set()
    for item in files:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and type(item[1]) is int and item[1] >= 0):
            raise ValueError(f"a file entry is not [name, size]: {str(item)[:80]}")
        if not own.fullmatch(item[0]) or item[0] in names:
            raise ValueError(f"{item[0][:80]!r} is not a file of {base}, or is named twice")
        names.add(item[0])
    step = info.get("step")
    if step is not None and (type(step) is not int or f"{NAME}-{step}" != base):
        raise ValueError(f"step {str(step)[:40]} is not the bundle's")
    nodes = info.get("nodes")
    if nodes is not None and not (isinstance(nodes, list) and all(isinstance(n, str) for n in nodes)):
        raise ValueError("the nodes are not a list of ids")


def _whole(prefix: str, info: Dict[str, Any]) -> bool:
    folder = os.path.dirname(prefix)
    for name, size in info["files"]:
        try:
            if os.path.getsize(os.path.join(folder, str(name))) != int(size):
                return False
        except OSError:
            return False
    return True


def bundle_files(prefix: str) -> List[Tuple[str, int]]:
    """The files of the bundle at ``prefix``: its data files (sorted), then its index; with sizes."""
    folder, base = os.path.split(prefix)
    data = sorted(n for n in os.listdir(folder) if re.fullmatch(re.escape(base) + r"\.data-\d+-of-\d+", n))
    names = data + [base + ".index"]
    return [(n, os.path.getsize(os.path.join(folder, n))) for n in names]


def write_marker(prefix: str, info: Dict[str, Any]) -> None:
    """Commit the bundle at ``prefix``: its marker, durably (temporary name, fsync, rename, folder fsync)."""
    path = marker_path(prefix)
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "wb") as f:
        f.write(json.dumps(info, sort_keys=True).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(folder: str) -> None:
    """Make ``folder``'s entries durable (errors: :class:`~shardckpt.errors.StorageError`, an ``OSError``)."""
    LocalFileSystem().fsync_dir(folder)


def remove_bundle(prefix: str, parts: bool = True) -> None:
    """Remove the bundle at ``prefix``: its marker first (it stops counting), then its index, its data files,
    what a killed merge or marker write left of it (``.tempstate<digits>``, ``.committed.tmp-<digits>``) and
    (``parts``) its parts folder."""
    import shutil

    folder, base = os.path.split(prefix)
    if not os.path.isdir(folder):
        return
    for name in [base + MARKER, base + ".index"] + sorted(os.listdir(folder)):
        if name == base + MARKER or name == base + ".index" or re.fullmatch(
                re.escape(base) + "(" + _DATA_SUFFIX + r"|\.committed\.tmp-\d+)", name):
            try:
                os.remove(os.path.join(folder, name))
            except FileNotFoundError:
                pass
    if parts:
        shutil.rmtree(prefix + "_parts", ignore_errors=True)


def retain(tier: LocalTier, node: str, keep_steps: List[int]) -> None:
    """Remove from ``node``'s tier every bundle (any owner, committed or not) of a step older than the
    newest of ``keep_steps`` and not in it."""
    if not keep_steps:
        return
    newest = max(keep_steps)
    for owner, steps in tier.steps_on_disk(node).items():
        for step in steps:
            if step < newest and step not in keep_steps:
                remove_bundle(tier.prefix(node, owner, step))
