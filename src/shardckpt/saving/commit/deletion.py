"""Deleting committed checkpoints: the one way, on every store, through ``FileSystem``.

A checkpoint ``<prefix>`` is deleted index first (from that moment it is no checkpoint:
readers and ``latest_checkpoint`` stop finding it), then its data files, then its
incremental sidecar (``<prefix>.hashes.json``). A deletion cut short leaves data files
no index uses, which the next save's clean-up removes (:mod:`.leftovers`). Incremental
saves link data files into newer checkpoints (or copy them): removing this checkpoint's
names never removes bytes a newer checkpoint uses.

Retention (``CheckpointManager``) marks what it is about to delete: an empty
``<prefix>.deleting`` object / file (:func:`mark_deleting`) is written before the state
file stops naming the checkpoint and removed once it is deleted (:func:`delete_marked`).
A marker that is left means the process died in between; :func:`finish_deletions`
(run by the next save) deletes its checkpoint unless the state file names it again.
The same on local disks and object stores. :func:`clean_directory` cleans a manager's
folder: what dead saves left, and complete checkpoints the state file never named.
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Sequence, Set

from ...format.naming import index_filename
from ...storage.base import FileSystem
from ...storage.location import Location
from ...storage.object_store import ObjectStore
from ..incremental import sidecar_filename
from .leftovers import clean_leftovers, committed_num_shards, data_files, scan_in_place, sibling_names

__all__ = ["DELETING", "delete_checkpoint", "mark_deleting", "delete_marked", "finish_deletions", "clean_directory"]

#: Suffix of the marker ``<prefix>.deleting`` that stands while a retention deletion of ``<prefix>`` runs.
DELETING = ".deleting"


def delete_checkpoint(location: Location, counts: Optional[Iterable[int]] = None) -> None:
    """Remove the checkpoint at ``location``: its index first, then its data files, then its sidecar.

    ``counts``: remove only the data files of these shard counts (``-of-N``; e.g. the
    count its index named); ``None``: every data file of the prefix in its folder.
    Missing files are fine.
    """
    fs = location.fs
    fs.remove(index_filename(location.prefix))
    wanted = None if counts is None else set(counts)
    for path, count in data_files(location, sibling_names(location)).items():
        if wanted is None or count in wanted:
            fs.remove(path)
    fs.remove(sidecar_filename(location.prefix))


def mark_deleting(fs: FileSystem, prefixes: Sequence[str]) -> None:
    """Write the ``<prefix>.deleting`` marker of each checkpoint about to be deleted (before the state
    file stops naming them)."""
    for prefix in prefixes:
        fs.close(fs.open_write(prefix + DELETING))


def delete_marked(fs: FileSystem, prefixes: Sequence[str]) -> None:
    """Delete each checkpoint of ``prefixes`` (:func:`delete_checkpoint`), then its marker."""
    for prefix in prefixes:
        delete_checkpoint(Location(fs, prefix))
        fs.remove(prefix + DELETING)


def finish_deletions(fs: FileSystem, directory: str, base: str, tracked: Set[str]) -> None:
    """Finish the retention deletions a dead process began: the ``<base>-<N>.deleting`` markers left in
    ``directory``. Each one's checkpoint is deleted unless ``tracked`` (the prefixes the state file
    names) holds it again (a later save reused the number: then only the marker goes)."""
    pattern = re.compile(re.escape(base) + r"-\d+" + re.escape(DELETING))
    for name in fs.listdir(directory):
        if pattern.fullmatch(name):
            prefix = fs.join(directory, name[:-len(DELETING)])
            if prefix not in tracked:
                delete_checkpoint(Location(fs, prefix))
            fs.remove(fs.join(directory, name))


def clean_directory(fs: FileSystem, directory: str, base: str, tracked: List[str], *,
                    remove_untracked: bool = True, state_file: Optional[str] = None) -> List[str]:
    """Remove what dead saves of the checkpoints ``<directory>/<base>-<N>`` left (a manager's folder).

    ``<state_file>.tempstate<digits>`` files (a state-file write that died before its rename;
    every state-file writer of this library writes it under ``fs.exclusive(directory)``, so
    none is live while the caller holds that lock). For every ``<base>-<N>`` prefix: temporary
    folders no live save claims, ``.tempstate`` files and
    data files no committed index uses (:func:`clean_leftovers`); and a *complete*
    checkpoint that the state file never named (``tracked``: the prefixes it names) when
    it is older than the newest tracked one — a save that died between its commit and the
    state file update (unless ``remove_untracked`` is False: a manager that preserves a
    checkpoint every N hours drops those from the state file, and they cannot be told
    apart). Newer untracked checkpoints are left alone (a live save may be about to name
    them). Call it under ``fs.exclusive(directory)``; returns the removed paths.
    """
    pattern = re.compile(re.escape(base) + r"-(\d+)(?:_temp_|\.index|\.data-)")
    state_temp = re.compile(re.escape(state_file) + r"\.tempstate\d+") if state_file else None
    numbers = set()
    removed: List[str] = []
    for name in fs.listdir(directory) if fs.isdir(directory) else []:
        m = pattern.match(name)
        if m:
            numbers.add(int(m.group(1)))
        elif state_temp is not None and state_temp.fullmatch(name):
            fs.remove(fs.join(directory, name))
            removed.append(fs.join(directory, name))
    tracked_numbers = []
    for prefix in tracked:
        m = re.fullmatch(re.escape(base) + r"-(\d+)", fs.basename(prefix))
        if m:
            tracked_numbers.append(int(m.group(1)))
    newest = max(tracked_numbers, default=-1)
    for n in sorted(numbers):
        location = Location(fs, fs.join(directory, f"{base}-{n}"))
        if isinstance(fs, ObjectStore):  # a live writer's objects are never removed (the age rule of scan_in_place)
            removed += scan_in_place(location).removed
        else:
            removed += clean_leftovers(location)
        if remove_untracked and n < newest and n not in tracked_numbers \
                and fs.exists(index_filename(location.prefix)):
            count = committed_num_shards(location)
            delete_checkpoint(location, [count] if count > 0 else [])
            removed.append(index_filename(location.prefix))
    return removed
