"""The one exception family of shardckpt.

Every error the library raises on purpose derives from :class:`ShardckptError`.
The subclasses follow TensorFlow's status codes where TensorFlow has one, so a
TensorFlow user recognises them (``DataLossError`` for a checksum mismatch,
``NotFoundError`` for a missing key or file, ...). They also derive from the
matching Python built-in (``KeyError``, ``ValueError``, ``FileNotFoundError``)
so that generic handlers keep working.

Messages name the file, the key and what was expected, e.g.::

    DataLossError: /ckpt/model.data-00000-of-00001: key 'dense/kernel':
    checksum does not match (stored 0x1a2b3c4d, computed 0x5e6f7a8b)
"""

from __future__ import annotations

import os

__all__ = [
    "ShardckptError",
    "DataLossError",
    "CorruptIndexError",
    "CheckpointReplacedError",
    "NotFoundError",
    "NoCheckpointError",
    "InvalidArgumentError",
    "UnsupportedError",
    "AlreadyExistsError",
    "ShardingValidationError",
    "StorageError",
    "AsyncSaveError",
    "AbortedError",
    "MissingExtraError",
    "describe",
]


def describe(path: "str | os.PathLike[str] | None" = None, key: "str | bytes | None" = None,
             slice_spec: "str | None" = None) -> str:
    """Return the ``"<file>: key '<key>' slice <spec>: "`` prefix used by error messages."""
    parts = []
    if path is not None:
        parts.append(os.fspath(path))
    if key is not None:
        if isinstance(key, bytes):
            key = key.decode("utf-8", "backslashreplace")
        parts.append(f"key {key!r}" + (f" slice {slice_spec}" if slice_spec else ""))
    return ": ".join(parts) + (": " if parts else "")


class ShardckptError(Exception):
    """Base class of every error raised by shardckpt.

    ``path``, ``key``, ``slice_spec`` (when known) and the bare ``message`` are kept
    as attributes so tools can report them without parsing the text.
    """

    def __init__(self, message: str, *, path: "str | os.PathLike[str] | None" = None,
                 key: "str | bytes | None" = None, slice_spec: "str | None" = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.key = key
        self.slice_spec = slice_spec
        self.message = message
        super().__init__(describe(path, key, slice_spec) + message)

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class DataLossError(ShardckptError, ValueError):
    """Stored bytes do not match their checksum, or a file is truncated.

    TensorFlow reports the same conditions as ``DataLoss``.
    """


class CorruptIndexError(DataLossError):
    """The ``.index`` file is not a valid tensor-bundle index."""


class CheckpointReplacedError(DataLossError):
    """A file of the checkpoint a reader opened was replaced (or changed) while the reader was open.

    The reader never returns bytes of another checkpoint: it raises this instead.
    Open the checkpoint again to read what is there now.
    """


class NotFoundError(ShardckptError, KeyError, FileNotFoundError):
    """A checkpoint, a data file or a key does not exist."""


class NoCheckpointError(NotFoundError, ValueError):
    """A directory holds no checkpoint to read: no ``checkpoint`` state file naming an existing one
    (TensorFlow's ``load_checkpoint`` raises ``ValueError`` there)."""


class InvalidArgumentError(ShardckptError, ValueError):
    """A caller passed a value that cannot be honoured (bad slice spec, wrong dtype...)."""


class UnsupportedError(ShardckptError, NotImplementedError):
    """The input is valid TensorFlow data that this build cannot handle."""


class AlreadyExistsError(ShardckptError, ValueError):
    """A key is written twice (in one bundle, or across bundles being merged)."""


class ShardingValidationError(ShardckptError, ValueError):
    """A sharding callback returned shards that do not describe the saved tensors."""


class StorageError(ShardckptError, OSError):
    """An operating-system error while reading or writing checkpoint files (disk full, permissions...)."""


class AsyncSaveError(ShardckptError, RuntimeError):
    """A background (``enable_async``) save failed; ``__cause__`` is the original error."""


class AbortedError(StorageError):
    """A concurrent writer won: another save created the same object or committed the same prefix first.

    TensorFlow reports concurrency conflicts as ``Aborted``. Nothing of this save was
    committed; what is at the prefix is the other save's checkpoint (or the previous one).
    """


class MissingExtraError(ShardckptError, ImportError):
    """A part of shardckpt needs an optional dependency that is not installed.

    The message names the extra that installs it (``pip install '.[torch]'`` from a
    checkout of shardckpt); see :func:`shardckpt._extras.require`.
    """
