"""The ``checkpoint`` state file: which checkpoint in a directory is the latest.

A text-format ``CheckpointState`` protobuf, as TensorFlow writes it::

    model_checkpoint_path: "ckpt-2"
    all_model_checkpoint_paths: "ckpt-1"
    all_model_checkpoint_paths: "ckpt-2"

Relative paths are relative to the directory holding the file. As TensorFlow's
manager and ``Checkpoint.save`` write them, paths are stored relative to the
directory and normalized, whichever way the directory is spelled (``./dir``,
``a/../dir``, ``dir/``, absolute): ``ckpt-2``, never ``./dir/ckpt-2``. Reading joins a
relative path to the directory as spelled (``./dir/ckpt-2``), as TensorFlow does, and
takes absolute paths as they are. The file is always replaced atomically: written to
a temporary name, then renamed, or on an object store written directly (one PUT,
which is atomic).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

from google.protobuf import text_format

from ..errors import DataLossError
from ..format.naming import index_filename
from ..format.protos.checkpoint_state_pb2 import CheckpointState
from ..storage.base import is_local_path, normalize
from ..storage.registry import get_fs

__all__ = ["CheckpointState", "get_checkpoint_state", "latest_checkpoint", "update_checkpoint_state",
           "STATE_FILENAME", "clean_path"]

STATE_FILENAME = "checkpoint"
_log = logging.getLogger("shardckpt")


def clean_path(path: str) -> str:
    """The path file operations use: a local path cleaned lexically, as TensorFlow's file system cleans
    it (``./d/`` is ``d``; ``a/../d`` is ``d``, even where ``a`` does not exist); other paths as they are."""
    path = normalize(os.fspath(path))
    return os.path.normpath(path) if path and is_local_path(path) else path


def _absolute(directory: str, path: str) -> str:
    if is_local_path(directory):
        return path if os.path.isabs(path) else os.path.join(directory, path)
    fs = get_fs(directory)
    return path if fs.isabs(path) else fs.join(directory, path)


def get_checkpoint_state(checkpoint_dir: str, latest_filename: Optional[str] = None) -> Optional[CheckpointState]:
    """Parse ``<checkpoint_dir>/checkpoint``; ``None`` when there is no such file.

    Relative paths in the result are joined with ``checkpoint_dir``, spelled as given.
    As in TensorFlow, a file that does not parse is logged and ignored (``None``), and
    one with an empty ``model_checkpoint_path`` raises (:class:`~shardckpt.errors.DataLossError`,
    a ``ValueError`` as TensorFlow's).
    """
    checkpoint_dir = normalize(checkpoint_dir)
    fs = get_fs(checkpoint_dir)
    path = fs.join(clean_path(checkpoint_dir), latest_filename or STATE_FILENAME)
    if not fs.isfile(path):
        return None
    raw = fs.read_bytes(path)
    state = CheckpointState()
    try:
        text_format.Parse(raw.decode("utf-8"), state)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        _log.warning("%s: the checkpoint state file does not parse (%s): ignored", path, exc)
        return None
    if not state.model_checkpoint_path:
        raise DataLossError("invalid checkpoint state file: model_checkpoint_path is empty", path=path)
    state.model_checkpoint_path = _absolute(checkpoint_dir, state.model_checkpoint_path)
    paths = [_absolute(checkpoint_dir, p) for p in state.all_model_checkpoint_paths]
    del state.all_model_checkpoint_paths[:]
    state.all_model_checkpoint_paths.extend(paths)
    return state


def latest_checkpoint(checkpoint_dir: str, latest_filename: Optional[str] = None) -> Optional[str]:
    """The prefix of the newest checkpoint in ``checkpoint_dir``, or ``None``.

    Like ``tf.train.latest_checkpoint``: the state file names it, and it counts
    only if its ``.index`` (or, for TF1 V1 checkpoints, the file itself) exists.
    """
    state = get_checkpoint_state(checkpoint_dir, latest_filename)
    if state is None:
        return None
    prefix = state.model_checkpoint_path
    fs = get_fs(prefix)
    found = clean_path(prefix)
    if fs.exists(index_filename(found)) or fs.isfile(found):
        return prefix
    _log.warning("checkpoint state file in %s names %s, which does not exist", checkpoint_dir, prefix)
    return None


def update_checkpoint_state(checkpoint_dir: str, model_checkpoint_path: str,
                            all_model_checkpoint_paths: Optional[Sequence[str]] = None,
                            all_model_checkpoint_timestamps: Optional[Sequence[float]] = None,
                            last_preserved_timestamp: Optional[float] = None,
                            latest_filename: Optional[str] = None, *, fsync: bool = True) -> None:
    """Atomically rewrite the state file. Paths inside ``checkpoint_dir`` are stored relative."""

    checkpoint_dir = normalize(checkpoint_dir)
    fs = get_fs(checkpoint_dir)
    local = is_local_path(checkpoint_dir)

    def rel(p: str) -> str:
        p = normalize(p)
        if not local:
            return fs.basename(p) if fs.normpath(fs.dirname(p)) == fs.normpath(checkpoint_dir) else p
        # TensorFlow (relative paths saved): an absolute path, or any path under a relative directory,
        # is stored relative to the directory (normalized); a relative path under an absolute directory
        # is stored as it is (read back, it is joined to the directory).
        if os.path.isabs(p) or not os.path.isabs(checkpoint_dir):
            return os.path.relpath(p, checkpoint_dir)
        return p

    paths = [rel(p) for p in (all_model_checkpoint_paths or [])]
    latest = rel(model_checkpoint_path)
    checkpoint_dir = clean_path(checkpoint_dir)
    if not paths or paths[-1] != latest:
        paths = [p for p in paths if p != latest] + [latest]
    state = CheckpointState(model_checkpoint_path=latest, all_model_checkpoint_paths=paths)
    if all_model_checkpoint_timestamps is not None:
        state.all_model_checkpoint_timestamps.extend(all_model_checkpoint_timestamps)
    if last_preserved_timestamp is not None:
        state.last_preserved_timestamp = last_preserved_timestamp
    fs.makedirs(checkpoint_dir)
    path = fs.join(checkpoint_dir, latest_filename or STATE_FILENAME)
    fs.write_atomic(path, text_format.MessageToString(state).encode("utf-8"), fsync=fsync)
    if fsync:
        fs.fsync_dir(checkpoint_dir)
