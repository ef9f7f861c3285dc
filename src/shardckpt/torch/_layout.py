"""Where a DCP checkpoint lies: a ``checkpoint_id`` is a directory, a writer's or reader's ``path`` a prefix.

In DCP a ``checkpoint_id`` names a directory. shardckpt writes the tensor bundle
inside it under the prefix :data:`PREFIX_NAME` and, once the index is committed, the
``checkpoint`` state file (TensorFlow's ``CheckpointState``) naming it, so the
directory is what ``tf.train.load_checkpoint(dir)`` / ``tf.train.latest_checkpoint(dir)``
and ``shardckpt inspect dir`` open::

    /ckpt/step-100/ckpt.index
    /ckpt/step-100/ckpt.data-00000-of-00004 ... ckpt.data-00003-of-00004
    /ckpt/step-100/checkpoint          model_checkpoint_path: "ckpt"

``TFBundleWriter(path)`` keeps TensorFlow's prefix meaning (``path.index`` beside
it), except where ``path`` is an existing directory or ends with ``/``: then it is a
checkpoint directory as above (``FileSystemWriter(dir)`` callers switch by changing
the class only). A reader resolves any of them: a prefix whose ``.index`` exists, a
directory's state file, the directory's :data:`PREFIX_NAME` (a save that died between
its index and its state file), or a SavedModel's ``variables/variables``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from ..checkpoint.reader import resolve_prefix
from ..checkpoint.state import update_checkpoint_state
from ..errors import NotFoundError
from ..format.naming import index_filename
from ..storage.base import is_local_path, normalize
from ..storage.registry import get_fs

__all__ = ["PREFIX_NAME", "writer_target", "reader_prefix", "write_state_file"]

PREFIX_NAME = "ckpt"


def _is_directory(path: str) -> bool:
    if path.endswith("/") or path.endswith(os.sep):
        return True
    return is_local_path(path) and os.path.isdir(path)


def writer_target(path: Any, *, directory: bool) -> Tuple[str, Optional[str]]:
    """``(prefix, directory)`` a writer saves to: ``directory`` (a ``checkpoint_id``) or a directory
    ``path`` -> the prefix inside it and that directory (for the state file); else ``(path, None)``."""
    text = os.fspath(path)
    if directory or _is_directory(text):
        folder = normalize(text.rstrip("/") or "/")
        return get_fs(folder).join(folder, PREFIX_NAME), folder
    return text, None


def reader_prefix(path: Any) -> str:
    """The prefix of the checkpoint ``path`` names (see the module docstring)."""
    text = normalize(os.fspath(path))
    try:
        return resolve_prefix(text)
    except NotFoundError:
        fs = get_fs(text)
        inside = fs.join(text.rstrip("/"), PREFIX_NAME)
        if fs.exists(index_filename(inside)):
            return inside
        raise


def write_state_file(folder: str, prefix: str, *, fsync: bool) -> None:
    """The directory's ``checkpoint`` state file, naming ``prefix`` (atomically replaced)."""
    update_checkpoint_state(folder, prefix, [prefix], fsync=fsync)
