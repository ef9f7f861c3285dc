"""Where bytes go: the local POSIX filesystem and object stores through fsspec, behind one interface.

:class:`FileSystem` is the interface (its docstring gives the roles), and
:class:`ObjectStore` what object stores add to it (conditional writes, ETags, uploads,
listings by prefix, pinned reads); :func:`get_fs` picks the store from a path's scheme and :class:`Location` holds a
resolved ``(fs, prefix)``; :func:`configure` sets a store's options (endpoint,
credentials, retries).
"""

from .base import FileSystem, is_local_path, normalize, split_scheme
from .local import LocalFileSystem, local_fs
from .location import Location
from .object_store import ObjectStore
from .registry import configure, get_fs, reset

__all__ = ["FileSystem", "ObjectStore", "LocalFileSystem", "Location", "local_fs", "get_fs", "configure",
           "split_scheme", "is_local_path", "normalize", "reset"]
