"""Power-loss crash states of a recorded save, enumerated (the method of ALICE, OSDI'14, and CrashMonkey, OSDI'18).

A save runs for real through :class:`shardckpt.storage.wrappers.RecordingFileSystem`, which
logs every operation that changes the disk. Killing a process loses nothing the kernel
already has; a power loss loses everything not yet made durable. POSIX makes durable:

* a file's data: by ``fsync`` of that file (what was written before it);
* a directory entry (create, rename, unlink, mkdir, rmdir): by ``fsync`` of its directory
  (for a rename, of the destination's directory).

For a crash after the first ``k`` operations, the disk holds the durable part of those
``k`` operations plus *any subset* of the rest: each not-yet-durable directory operation
may or may not have reached the disk (applied in log order), and each file whose latest
data is not durable holds its durable content, its full content, or a torn prefix. Every
crash point ``k`` is considered; the subsets are enumerated when they are few and sampled
(fixed seed, both extremes always included) when they are many. Distinct states are
materialised into a fresh folder and judged by the scenario's checker.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import posixpath
import random
import shutil
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

Op = Tuple[str, str, object]
Snapshot = Dict[str, bytes]  # relative path -> content ("" content for directories is not used)


def snapshot(root: str) -> Tuple[Snapshot, Set[str]]:
    """Every file (path relative to ``root`` -> bytes) and every directory under ``root``."""
    files: Snapshot = {}
    dirs: Set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            dirs.add(os.path.relpath(os.path.join(dirpath, d), root))
        for f in filenames:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                files[os.path.relpath(path, root)] = fh.read()
    return files, dirs


@dataclass
class _Replay:
    """The log replayed up to a crash point: which ops are durable, what each inode holds."""

    name_ops: List[int] = field(default_factory=list)          # indexes of directory operations
    durable_names: Set[int] = field(default_factory=set)      # those made durable by a directory fsync
    depends: Dict[int, int] = field(default_factory=dict)     # rename -> the op that put its source in place
    full: Dict[int, bytes] = field(default_factory=dict)       # inode -> content in memory
    durable: Dict[int, bytes] = field(default_factory=dict)    # inode -> content on disk for sure

    def closed(self, chosen: Set[int]) -> Set[int]:
        """``chosen`` closed under :attr:`depends`."""
        return _closed(self, chosen)


def _closed(r: "_Replay", chosen: Set[int]) -> Set[int]:
    """``chosen`` with every op a chosen rename depends on (a file cannot move before it is there:
    journaling filesystems persist directory operations in order)."""
    out = set(chosen)
    stack = list(chosen)
    while stack:
        dep = r.depends.get(stack.pop())
        if dep is not None and dep not in out:
            out.add(dep)
            stack.append(dep)
    return out


def _parents(op: Op) -> List[str]:
    """The directories whose fsync makes ``op`` durable. A rename across directories is made
    durable by an fsync of the destination's directory (journaling filesystems commit the
    whole rename in one transaction; the source's entry then goes with it)."""
    kind, path, extra = op
    target = str(extra) if kind in ("rename", "link") else path
    return [posixpath.dirname(target) or "."]


class CrashStates:
    """The crash states of ``ops`` recorded under ``root``, starting from ``initial`` (all durable)."""

    def __init__(self, root: str, ops: List[Op], initial: Tuple[Snapshot, Set[str]]) -> None:
        self.root = os.path.abspath(root)
        self.ops = [(k, self._rel(p), self._rel(str(e)) if k in ("rename", "link") else e) for k, p, e in ops]
        self.initial_files, self.initial_dirs = initial

    def _rel(self, path: str) -> str:
        return os.path.relpath(os.path.abspath(path), self.root)

    # -- replay --------------------------------------------------------------------------------
    def _inode_at_create(self) -> Dict[int, int]:
        return {i: 1_000_000 + i for i, (k, _, _) in enumerate(self.ops) if k == "create"}

    def _replay(self, k: int) -> _Replay:
        r = _Replay()
        names: Dict[str, int] = {p: n for n, p in enumerate(sorted(self.initial_files))}
        for n, p in enumerate(sorted(self.initial_files)):
            r.full[n] = r.durable[n] = self.initial_files[p]
        inode_of_create = self._inode_at_create()
        dir_synced_at: Dict[str, int] = {}
        binder: Dict[str, int] = {}  # path -> the op that bound it (create or rename)
        for i, (kind, path, extra) in enumerate(self.ops[:k]):
            if kind == "create":
                binder[path] = i
                ino = inode_of_create[i]
                names[path] = ino
                r.full[ino] = b""
                r.durable[ino] = b""
                r.name_ops.append(i)
            elif kind == "write":
                ino = names[path]
                r.full[ino] = r.full[ino] + bytes(extra)  # type: ignore[arg-type]
            elif kind == "fsync":
                if path in names:
                    ino = names[path]
                    r.durable[ino] = r.full[ino]
            elif kind == "rename":
                if path in binder:
                    r.depends[i] = binder.pop(path)
                binder[str(extra)] = i
                if path in names:
                    names[str(extra)] = names.pop(path)
                r.name_ops.append(i)
            elif kind == "link":  # a second name for the file at path (its data already durable or not)
                if path in binder:
                    r.depends[i] = binder[path]
                binder[str(extra)] = i
                if path in names:
                    names[str(extra)] = names[path]
                r.name_ops.append(i)
            elif kind == "remove":
                binder.pop(path, None)
                names.pop(path, None)
                r.name_ops.append(i)
            elif kind == "remove_tree":
                for p in [p for p in names if p == path or p.startswith(path + os.sep)]:
                    del names[p]
                r.name_ops.append(i)
            elif kind == "mkdir":
                r.name_ops.append(i)
            elif kind == "fsync_dir":
                dir_synced_at[path] = i
            else:
                raise AssertionError(f"unknown op {kind}")
        for i in r.name_ops:
            if all(dir_synced_at.get(d, -1) > i for d in _parents(self.ops[i])):
                r.durable_names.add(i)
        r.durable_names = r.closed(r.durable_names)
        return r

    def _materialise(self, r: _Replay, chosen: Set[int], data_choice: Dict[int, int]) -> Snapshot:
        """The files on disk when the name ops in ``chosen`` persisted and each inode's content is
        durable (0), full (1) or torn (2: durable + half of what followed)."""
        names: Dict[str, int] = {p: n for n, p in enumerate(sorted(self.initial_files))}
        inode_of_create = self._inode_at_create()
        for i in r.name_ops:
            if i not in chosen:
                continue
            kind, path, extra = self.ops[i]
            if kind == "create":
                names[path] = inode_of_create[i]
            elif kind == "rename":
                if path in names:
                    names[str(extra)] = names.pop(path)
            elif kind == "link":
                if path in names:
                    names[str(extra)] = names[path]
            elif kind == "remove":
                names.pop(path, None)
            elif kind == "remove_tree":
                for p in [p for p in names if p == path or p.startswith(path + os.sep)]:
                    del names[p]
        files: Snapshot = {}
        for path, ino in names.items():
            full, durable = r.full.get(ino, b""), r.durable.get(ino, b"")
            choice = data_choice.get(ino, 0)
            if choice == 1 or full == durable:
                files[path] = full
            elif choice == 2 and full.startswith(durable):
                files[path] = full[:len(durable) + (len(full) - len(durable)) // 2]
            else:
                files[path] = durable
        return files

    # -- enumeration ---------------------------------------------------------------------------
    def states(self, *, max_per_point: int = 64, seed: int = 0) -> Iterator[Tuple[int, Snapshot]]:
        """``(crash point, files)`` for every crash point, distinct states only."""
        rng = random.Random(seed)
        seen: Set[str] = set()
        for k in range(len(self.ops) + 1):
            r = self._replay(k)
            loose = [i for i in r.name_ops if i not in r.durable_names]
            torn = sorted(ino for ino in r.full if r.full[ino] != r.durable[ino])
            combos: List[Tuple[Set[int], Dict[int, int]]] = []
            space = (2 ** len(loose)) * (3 ** len(torn))
            if space <= max_per_point:
                for bits in itertools.product((0, 1), repeat=len(loose)):
                    for data in itertools.product((0, 1, 2), repeat=len(torn)):
                        combos.append(({i for i, b in zip(loose, bits) if b} | r.durable_names,
                                       dict(zip(torn, data))))
            else:
                combos.append((set(r.name_ops), {ino: 1 for ino in torn}))      # everything reached the disk
                combos.append((set(r.durable_names), {}))                      # only what was made durable
                for _ in range(max_per_point - 2):
                    combos.append(({i for i in loose if rng.random() < 0.5} | r.durable_names,
                                   {ino: rng.randrange(3) for ino in torn}))
            for chosen, data in combos:
                files = self._materialise(r, r.closed(chosen), data)
                digest = hashlib.sha256(repr(sorted((p, hashlib.sha256(c).digest())
                                                    for p, c in files.items())).encode()).hexdigest()
                if digest in seen:
                    continue
                seen.add(digest)
                yield k, files


def write_state(files: Snapshot, dirs: Set[str], target: str) -> None:
    """Materialise ``files`` (and the initial directories) under a fresh ``target``."""
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for d in sorted(dirs):
        os.makedirs(os.path.join(target, d), exist_ok=True)
    for path, content in files.items():
        full = os.path.join(target, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(content)


def check_all(root: str, ops: List[Op], initial: Tuple[Snapshot, Set[str]], scratch: str,
              judge: Callable[[str], Optional[str]], *, max_per_point: int = 64) -> Tuple[int, List[str]]:
    """Judge every distinct crash state; return how many were checked and the problems found."""
    states = CrashStates(root, ops, initial)
    checked, problems = 0, []
    for k, files in states.states(max_per_point=max_per_point):
        write_state(files, states.initial_dirs, scratch)
        checked += 1
        problem = judge(scratch)
        if problem is not None:
            last = states.ops[k - 1] if k else None
            problems.append(f"crash after op {k} ({last[0] + ' ' + last[1] if last else 'none'}): {problem}; "
                            f"files: {sorted(files)}")
    return checked, problems
