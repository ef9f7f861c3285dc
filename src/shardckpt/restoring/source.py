"""Where a restore's pieces come from: the :class:`PieceSource` interface, and
:class:`BundleSource`, the checkpoint's own files (on local disk or an object store).

A source answers two kinds of question. **Metadata**, while a front door plans: the
stored keys, each tensor's dtype, shape and stored pieces, and small values read whole at
once (an object graph, a nesting entry). **Bytes**, while the engine (:mod:`.engine`)
runs a :class:`~.plan.RestorePlan`, in this order::

    announce(reads)            every read of the call, once, before any is made (object
                               stores fetch the byte ranges in few large requests, ahead)
    with reading(defer) as s:  a read session; leaving it waits for every deferred read
        read(r, s)             on the engine's threads: the bytes of one Read, into its
                               destination, verified when read whole (deferred reads: by
                               the session's end); a stored piece that several reads cut
                               across is one read of the whole piece without a session
                               (complete and verified on return), cut by the engine
        read_whole(rs, s)      whole tensors planned in one pass (the common restore)
    close()                    by whoever opened the source

A *collective* source (``collective = True``: a funnelled restore, and later a node-local
tier or a peer's memory) cannot read on demand: ``read`` records, and :meth:`finish` (every
client, in the same order) moves the bytes; the engine calls it after recording every read.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import InvalidArgumentError
from ..format.bundle_reader import BundleReader, StoredPiece
from ..format.dtypes import DType
from ..format.tensor_slice import Box
from ..storage.base import FileSystem
from ..storage.registry import get_fs
from .plan import Read

__all__ = ["PieceSource", "BundleSource", "as_source"]

KeyLike = Union[str, bytes]


class PieceSource(abc.ABC):
    """The stored tensors of one checkpoint, and the bytes of their pieces (see the module docstring).

    ``prefix`` names the checkpoint in messages and errors.
    """

    prefix: str
    collective: bool = False

    # -- metadata ------------------------------------------------------------------------------
    @abc.abstractmethod
    def keys(self, include_slices: bool = False) -> List[bytes]:
        """The stored tensors' keys, sorted."""

    @abc.abstractmethod
    def __contains__(self, key: KeyLike) -> bool:
        """Whether ``key`` is a stored tensor."""

    @abc.abstractmethod
    def dtype(self, key: KeyLike) -> DType:
        """The stored dtype of ``key`` (``NotFoundError`` when absent)."""

    @abc.abstractmethod
    def shape(self, key: KeyLike) -> Tuple[int, ...]:
        """The global shape of ``key``."""

    @abc.abstractmethod
    def value(self, key: KeyLike) -> np.ndarray:
        """The whole tensor ``key``, read and checked now (small values needed while planning)."""

    def piece_boxes(self, key: KeyLike) -> List[Box]:
        """The boxes of the stored pieces of ``key`` (one, the whole tensor, when not sliced)."""
        return [tuple((0, int(d)) for d in self.shape(key))]

    # -- bytes -----------------------------------------------------------------------------------
    def announce(self, reads: Sequence[Read]) -> None:  # noqa: B027 - a hint; sources may ignore it
        """Every read of the call, before any is made (a hint: nothing by default)."""

    @abc.abstractmethod
    def reading(self, *, defer: bool) -> ContextManager[Any]:
        """A read session; with ``defer``, leaving it waits for (and checks) every deferred read."""

    @abc.abstractmethod
    def read(self, read: Read, session: Any, *, verify: bool) -> np.ndarray:
        """Read ``read`` into its destination (allocated when ``None``); returns the destination."""

    def read_whole(self, reads: Sequence[Read], session: Any, *, verify: bool) -> List[np.ndarray]:
        """Whole-tensor reads, in order (default: one :meth:`read` each)."""
        return [self.read(r, session, verify=verify) for r in reads]

    def finish(self, error: Optional[BaseException] = None) -> None:  # noqa: B027 - collective sources only
        """Collective sources: move the recorded reads' bytes (every client, in the same order).
        ``error``: this client's planning failed (the others are told; this call then returns)."""

    def after(self, follow_up: Callable[[], None]) -> None:
        """Collective sources: run ``follow_up`` once :meth:`finish` has moved the bytes (others: now)."""
        follow_up()

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the source holds open."""

    def __enter__(self) -> "PieceSource":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class BundleSource(PieceSource):
    """A checkpoint's own files through a :class:`BundleReader` (local disk or an object store).

    ``reader``: an open reader (``owned``: closed with this source). Reads use the reader's
    region reads (only the bytes a region needs), its deferring sessions (whole entries read
    and checksummed by its helpers while the caller plans on) and its announcements.
    """

    def __init__(self, reader: BundleReader, *, owned: bool = True) -> None:
        self.reader = reader
        self.prefix = reader.prefix
        self._owned = owned

    @classmethod
    def open(cls, prefix: str, fs: Optional[FileSystem] = None, **kwargs: Any) -> "BundleSource":
        """The checkpoint at ``prefix`` (its store: ``fs``, default chosen from the path)."""
        return cls(BundleReader(prefix, fs=fs if fs is not None else get_fs(prefix), **kwargs))

    @property
    def index_path(self) -> str:
        return self.reader.index_path

    def keys(self, include_slices: bool = False) -> List[bytes]:
        return self.reader.keys(include_slices)

    def __contains__(self, key: KeyLike) -> bool:
        return key in self.reader

    def dtype(self, key: KeyLike) -> DType:
        return self.reader.dtype(key)

    def shape(self, key: KeyLike) -> Tuple[int, ...]:
        return self.reader.shape(key)

    def value(self, key: KeyLike) -> np.ndarray:
        return self.reader.read(key)

    def piece_boxes(self, key: KeyLike) -> List[Box]:
        return self.reader.piece_boxes(key)

    def piece_at(self, key: KeyLike, start: Sequence[int]) -> Optional[StoredPiece]:
        """The stored piece of ``key`` whose box starts at ``start`` (``None``: none does)."""
        return self.reader.piece_at(key, start)

    def announce(self, reads: Sequence[Read]) -> None:
        reader = self.reader
        if not reader.prefetches:
            return
        by_key = [(r.key, r.region) for r in reads if r.piece is None]
        if by_key:
            reader.prefetch(by_key)
        by_piece = [(r.piece, _local_or_whole(r)) for r in reads if r.piece is not None]
        if by_piece:
            reader.prefetch_pieces(by_piece)

    def reading(self, *, defer: bool) -> ContextManager[Any]:
        if defer:
            return self.reader.session(defer=True)
        return contextlib.nullcontext(None)

    def read(self, read: Read, session: Any, *, verify: bool) -> np.ndarray:
        if read.piece is not None:
            local = read.region if read.region is not None else tuple((0, b - a) for a, b in read.piece.box)
            return self.reader.read_piece_region(read.piece, local, read.out, verify=verify, session=session)
        return self.reader.read_region(read.key, read.region, read.out, verify=verify, session=session)

    def read_whole(self, reads: Sequence[Read], session: Any, *, verify: bool) -> List[np.ndarray]:
        if session is None:
            return super().read_whole(reads, session, verify=verify)
        return session.read_many([r.key for r in reads], [r.out for r in reads], verify=verify)

    def close(self) -> None:
        if self._owned:
            self.reader.close()


def _local_or_whole(read: Read) -> Optional[Box]:
    """A piece read's box relative to the piece, ``None`` when it is the whole piece."""
    if read.region is None:
        return None
    whole = tuple((0, b - a) for a, b in read.piece.box)
    return None if tuple(read.region) == whole else read.region


def as_source(reader: Any) -> PieceSource:
    """``reader`` as a :class:`PieceSource`: a source as it is, a :class:`BundleReader` wrapped (not owned)."""
    if isinstance(reader, PieceSource):
        return reader
    if isinstance(reader, BundleReader):
        return BundleSource(reader, owned=False)
    raise InvalidArgumentError(f"not a checkpoint reader: {type(reader).__name__} (a BundleReader or a "
                               "PieceSource)")
