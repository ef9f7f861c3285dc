"""``ObjectStore``: what an object store adds to :class:`~shardckpt.storage.base.FileSystem`.

An object store (S3, GCS, ``memory://``) has no rename and no folders: an object
appears whole when its upload completes, and writers are ordered by *conditional*
requests instead of locks. The index-last committer
(:mod:`shardckpt.saving.commit.index_last`) is typed against this interface and chosen
for every store that is one (:func:`shardckpt.saving.commit.committer_for`); readers
(:class:`~shardckpt.format.bundle_reader.BundleReader`) use its listings and pinned
reads. Code asks ``isinstance(fs, ObjectStore)``, never ``getattr``: what a store can
do is its type. :class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem` implements it;
:class:`~shardckpt.storage.wrappers.ObjectStoreWrapper` forwards every member.

Roles (who calls what), beside :class:`FileSystem`'s:

* **Writers** (the index-last committer's shard writers): ``create_exclusive`` ->
  ``write_all`` ... -> ``close`` -> ``written_etag`` (where ``conditional_writes``);
  ``open_write`` otherwise.
* **Committer** (the io client of an index-last save): ``list_details`` (the folder,
  once, at prepare), ``list_uploads`` / ``upload_activity`` / ``abort_upload`` (a dead
  save's multipart uploads), ``list_identities`` / ``head_etag`` (the check that every
  data object is still ours), ``put`` (the index: **the commit**), ``remove_many``
  (the previous checkpoint's objects), ``remove_if`` (a failed save's own objects).
* **Readers**: ``list_and_read`` (one round trip: the checkpoint's listing and the
  index's first bytes), ``list_identities``, ``pin`` (reads held to one version).

Identities are tuples ``(size, tag)``, the tag an ETag, version or generation; two
equal identities name the same bytes. Errors are :mod:`shardckpt.errors` naming the
object: a refused condition is :class:`~shardckpt.errors.AbortedError`, a missing
object :class:`~shardckpt.errors.NotFoundError`, anything else after the retries
:class:`~shardckpt.errors.StorageError`.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypedDict

from .base import FileSystem, Identity, ReadHandle, WriteHandle

__all__ = ["ObjectStore", "ObjectInfo", "PendingUpload", "ListedIndex"]


class ObjectInfo(TypedDict):
    """One object of a listing (:meth:`ObjectStore.list_details`)."""

    #: bytes (``None`` where the store does not say)
    size: Optional[int]
    #: the ETag as the store spells it (quotes included), ``None`` where the store has none
    etag: Optional[str]
    #: last modification, POSIX seconds (``None`` where the store does not say)
    mtime: Optional[float]


class PendingUpload(NamedTuple):
    """An incomplete multipart upload (:meth:`ObjectStore.list_uploads`)."""

    #: the full path of the object it would create
    path: str
    upload_id: str
    #: when it was started, POSIX seconds (0.0 when unknown)
    started: float


#: what :meth:`ObjectStore.list_and_read` returns: the listing, and the first bytes of the
#: object with the identity of the version they come from (``None``: no such object)
ListedIndex = Tuple[Dict[str, Identity], Optional[Tuple[bytes, Identity]]]


class ObjectStore(FileSystem):
    """A :class:`FileSystem` without rename whose objects appear whole (see the module docstring)."""

    #: object stores have no atomic rename: they get the index-last committer
    supports_rename = False
    #: whether conditional requests work here (``If-None-Match: *`` / ``If-Match`` on PUT, on
    #: completing an upload and on DELETE; S3). Without them, :meth:`put`'s conditions,
    #: :meth:`create_exclusive` and :meth:`remove_if` raise :class:`~shardckpt.errors.UnsupportedError`
    #: and concurrent saves to one prefix are not ordered.
    conditional_writes: bool = False
    #: uncommitted data objects and multipart uploads younger than this (seconds) may be a live
    #: writer's: committers never remove them
    stale_after: float = 3600.0

    # -- writers ---------------------------------------------------------------
    @abc.abstractmethod
    def put(self, path: str, data: bytes, *, if_match: Optional[str] = None, if_none_match: bool = False) -> str:
        """[committer] Write the whole object ``path`` with one request; return its ETag (``""`` where
        the store has none). Readers see the old object or the new one, never a mix.

        ``if_none_match``: only if no object has this name; ``if_match``: only if the
        object's ETag is this one. A refused condition raises
        :class:`~shardckpt.errors.AbortedError` (the index-last commit's winner rule). A
        reply lost in flight is resolved by reading the object back: the call returns
        exactly when the store holds ``data``.
        """

    @abc.abstractmethod
    def create_exclusive(self, path: str) -> WriteHandle:
        """[writer] Like :meth:`open_write`, but the object is created only if no object has its name.

        ``close`` raises :class:`~shardckpt.errors.AbortedError` when another writer created
        the name first (nothing of ours is published then); :meth:`written_etag` gives the
        created object's ETag. Only where :attr:`conditional_writes`.
        """

    @abc.abstractmethod
    def written_etag(self, handle: WriteHandle) -> Optional[str]:
        """[writer] The ETag of the object a write handle created, once closed (``None``: unknown)."""

    @abc.abstractmethod
    def head_etag(self, path: str) -> Optional[str]:
        """[committer] The object's current ETag (one metadata request); ``None`` when there is no such object."""

    @abc.abstractmethod
    def remove_if(self, path: str, etag: str) -> bool:
        """[committer] Delete the object only while its ETag is ``etag`` (what this save wrote: a writer
        that lost a name never deletes the winner's object); whether it was deleted. Only where
        :attr:`conditional_writes`."""

    def remove_many(self, paths: Sequence[str]) -> None:
        """[committer] Remove objects, missing ones being fine; stores that delete in bulk send few
        requests (S3: one per 1,000 keys). Default: one :meth:`remove` each."""
        for path in paths:
            self.remove(path)

    @abc.abstractmethod
    def list_details(self, path: str) -> Dict[str, ObjectInfo]:
        """[committer] The objects directly under the folder ``path``: name -> :class:`ObjectInfo`
        (one listing request per 1,000 objects on S3). A missing bucket raises
        :class:`~shardckpt.errors.NotFoundError`; an empty folder is ``{}``."""

    # -- a dead save's multipart uploads ----------------------------------------------
    def list_uploads(self, path: str) -> List[PendingUpload]:
        """[committer] Incomplete multipart uploads of objects directly under the folder ``path``.
        Default: none (stores without multipart uploads)."""
        return []

    def upload_activity(self, path: str, upload_id: str) -> float:
        """[committer] When the upload last made progress (its newest part), POSIX seconds; 0.0 without
        parts. A long upload still sending parts is live whatever its start time."""
        return 0.0

    def abort_upload(self, path: str, upload_id: str) -> None:
        """[committer] Abort one incomplete multipart upload of ``path`` (gone already is fine)."""
        return None

    # -- readers ---------------------------------------------------------------
    @abc.abstractmethod
    def list_identities(self, prefix: str) -> Optional[Dict[str, Identity]]:
        """[reader, committer] The identity of every object whose path starts with ``prefix`` (the
        folder's direct members only): e.g. ``<prefix>.`` lists a checkpoint's index and data
        objects in one request per 1,000, however full the folder. ``None`` where the store
        cannot list by prefix. An object written after the listing began may be missing."""

    @abc.abstractmethod
    def list_and_read(self, prefix: str, path: str, limit: int) -> Optional[ListedIndex]:
        """[reader] :meth:`list_identities` of ``prefix`` and the first ``limit`` bytes of ``path`` with
        the identity of the version they come from, in one round trip (both requests at once).

        The bytes are all of the object when it is at most ``limit`` bytes (the identity's
        size says); ``None`` for them when there is no such object. ``None`` as a whole where
        the store cannot (the reader then asks :meth:`identity`).
        """

    @abc.abstractmethod
    def pin(self, handle: ReadHandle, identity: Any) -> bool:
        """[reader] Hold every later read through ``handle`` to the object version ``identity`` (from
        :meth:`identity`, :meth:`identities` or :meth:`list_identities`); whether it is pinned.

        A pinned handle's reads fail with :class:`~shardckpt.errors.CheckpointReplacedError`
        once the object is replaced (never a mix of versions), and its :meth:`identity` costs
        no request. Where the store cannot pin (False) readers check identities instead.
        """

