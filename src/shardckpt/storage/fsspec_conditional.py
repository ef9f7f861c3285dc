"""Conditional writes on object stores: whole-object PUTs with ``If-None-Match`` / ``If-Match``,
conditional deletes, and telling whether the store holds our bytes.

The index-last committer's winner rule is built on these (see
:mod:`shardckpt.saving.commit.index_last`): the index PUT is conditional on the index
seen at prepare, data objects are created exclusively (:mod:`.fsspec_uploads`), and a
save removes only objects that still carry its own ETags. A write whose reply was lost
is resolved by reading the object back (:meth:`~.fsspec_requests.StoreRequests.write_call`
with :meth:`ConditionalWrites.holds_bytes` / ``holds_etag``): reported done exactly when
the store holds our bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Optional, Sequence

from ..errors import AbortedError, NotFoundError
from .fsspec_requests import StoreRequests

__all__ = ["ConditionalWrites", "md5_etag", "multipart_etag", "same_etag"]


def md5_etag(data: Any) -> str:
    return '"' + hashlib.md5(data).hexdigest() + '"'


def multipart_etag(part_etags: Sequence[str]) -> str:
    digest = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in part_etags)).hexdigest()
    return f'"{digest}-{len(part_etags)}"'


def same_etag(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and a.strip('"') == b.strip('"')




class ConditionalWrites(StoreRequests):
    """The conditional requests of :class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem`."""

    def head_etag(self, path: str) -> Optional[str]:
        """The object's ETag, ``None`` when there is no such object (S3)."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            resp = self.call("stat", path, self.fs.call_s3, "head_object", Bucket=bucket, Key=key)
        except NotFoundError:
            return None
        return str(resp.get("ETag"))

    def holds_etag(self, path: str, expected: str) -> Optional[str]:
        """``expected`` when the object at ``path`` has that ETag, else ``None``."""
        etag = self.head_etag(path)
        return etag if same_etag(etag, expected) else None

    def holds_bytes(self, path: str, data: bytes) -> Optional[str]:
        """The object's ETag (``""`` where stores have none) when it holds exactly ``data``, else ``None``."""
        if self._is_s3():
            etag = self.holds_etag(path, md5_etag(data))
            if etag is not None:
                return etag
        try:
            stored = self.call("read", path, self.fs.cat_file, path)
        except NotFoundError:
            return None
        if bytes(stored) != bytes(data):
            return None
        return (self.head_etag(path) or "") if self._is_s3() else ""

    def put(self, path: str, data: bytes, *, if_match: Optional[str] = None, if_none_match: bool = False) -> str:
        """Write a whole object with one PUT; its ETag (``""`` on stores without ETags).

        ``if_none_match``: only if no object has this name. ``if_match``: only if the
        object's ETag is this one. Either refused: :class:`~shardckpt.errors.AbortedError`
        (unless the object holds our bytes because an earlier attempt landed).
        Ambiguous failures are resolved by reading the object back (see :meth:`write_call`).
        """
        data = bytes(data)
        if self._is_s3():
            bucket, key, _ = self.fs.split_path(path)
            cond: Dict[str, str] = {}
            if if_none_match:
                cond["IfNoneMatch"] = "*"
            if if_match is not None:
                cond["IfMatch"] = if_match
            resp = self.write_call("write", path, lambda: self.fs.call_s3(
                "put_object", Bucket=bucket, Key=key, Body=data, **cond), lambda: self.holds_bytes(path, data))
            self.count_write(len(data))
            return str(resp.get("ETag") or md5_etag(data))
        if if_match is not None or if_none_match:
            raise self.unsupported("conditional writes", path)
        self.write_call("write", path, lambda: self.fs.pipe_file(path, data), lambda: self.holds_bytes(path, data))
        self.count_write(len(data))
        return ""

    def remove_if(self, path: str, etag: str) -> bool:
        """Delete the object only if its ETag is ``etag`` (what we wrote); whether it was deleted."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.call("delete", path, self.fs.call_s3, "delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        except (NotFoundError, AbortedError):
            return False
        return True
