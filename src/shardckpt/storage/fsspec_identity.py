"""Which version of an object a reader holds: identities, listings and pinned reads.

An identity is ``(size, tag)``: the tag an ETag (or version, generation, mtime on
other fsspec stores). A reader learns the identities of a checkpoint's objects with one
listing (:meth:`Identities.list_identities`; with the index's first bytes in the same
round trip, :meth:`Identities.list_and_read`) and pins its handles to them
(:meth:`Identities.pin`, S3): every GET then carries ``If-Match: <ETag>``, so a replaced
object fails the read with :class:`~shardckpt.errors.CheckpointReplacedError` instead of
mixing versions, and the handle's identity is known without asking again.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import NotFoundError
from .base import Identity, posix_dirname
from .fsspec_errors import s3_code
from .fsspec_reads import ObjectReadHandle
from .fsspec_requests import StoreRequests

__all__ = ["Identities", "identity_of_info"]

#: an S3 ETag: the MD5 of the bytes, or of the parts' MD5s and a part count (only those are pinned)
_S3_ETAG = re.compile(r"[0-9a-fA-F]{32}(-[0-9]+)?")



def identity_of_info(info: Dict[str, Any]) -> Identity:
    """The identity in an fsspec info dict or a listing entry: ``(size, tag)``."""
    tag = None
    for field in ("ETag", "etag", "VersionId", "generation", "md5Hash", "LastModified", "mtime", "created"):
        value = info.get(field)
        if value is not None:
            if hasattr(value, "timestamp"):  # listings and HEADs may spell times differently
                value = float(value.timestamp())
            tag = str(value).strip('"')
            break
    return (int(info.get("size") or 0), tag)


class Identities(StoreRequests):
    """Identities, listings by prefix and pinning (part of :class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem`)."""

    def identity(self, path: str, handle: Any = None) -> Tuple[Any, ...]:
        """What identifies the object's current contents: size and ETag (or version / generation / mtime).

        One metadata request (HEAD); a missing object is a :class:`NotFoundError`. For a
        read handle pinned to a version (:meth:`pin`) no request: its reads can only
        return that version's bytes (or fail), so that is the identity of what it reads.
        """
        if isinstance(handle, ObjectReadHandle) and handle.pinned is not None:
            return handle.pinned
        try:
            self.fs.invalidate_cache(path)
        except Exception:
            pass
        return identity_of_info(self.call("stat", path, self.fs.info, path))

    def identities(self, paths: Sequence[str]) -> Dict[str, Optional[Tuple[Any, ...]]]:
        """:meth:`identity` of many objects (``None``: missing) with one listing per folder."""
        out: Dict[str, Optional[Tuple[Any, ...]]] = {}
        by_dir: Dict[str, List[str]] = {}
        for p in paths:
            by_dir.setdefault(posix_dirname(p), []).append(p)
        for folder, members in by_dir.items():
            try:
                self.fs.invalidate_cache(folder)
            except Exception:
                pass
            try:
                listing = self.call("list", folder, self.fs.ls, folder, detail=True)
            except NotFoundError:
                listing = []
            infos = {}
            for info in listing:
                infos[str(info.get("name", "")).split("://", 1)[-1].strip("/")] = info
            for p in members:
                info = infos.get(p.split("://", 1)[-1].strip("/"))
                if info is not None and info.get("type") != "directory":
                    out[p] = identity_of_info(info)
                    continue
                try:  # not in the listing: ask the object itself before calling it missing
                    out[p] = self.identity(p)
                except NotFoundError:
                    out[p] = None
        return out

    def list_identities(self, prefix: str) -> Optional[Dict[str, Tuple[Any, ...]]]:
        """The :meth:`identity` of every object whose path starts with ``prefix`` (not in subfolders).

        S3: one ``ListObjectsV2`` request per 1,000 objects (e.g. ``<prefix>.`` lists a
        checkpoint's index and data objects, however full its folder). ``None`` on other
        stores. An object written after the listing began may be missing from it.
        """
        if not self._is_s3():
            return None
        try:
            return self.submit("list", prefix, lambda: self._alist_identities(prefix)).result()  # type: ignore[no-any-return]
        except NotFoundError:
            self._check_bucket(prefix)
            raise

    def list_and_read(self, prefix: str, path: str, limit: int) -> Optional[
            Tuple[Dict[str, Tuple[Any, ...]], Optional[Tuple[bytes, Tuple[Any, ...]]]]]:
        """:meth:`list_identities` of ``prefix`` and the first ``limit`` bytes of ``path`` with the
        identity of the version they come from, in one round trip (both requests at once).

        The bytes are all of the object when it is at most ``limit`` bytes (the identity's
        size says). ``None`` for them when there is no such object. ``None`` on stores
        other than S3.
        """
        if not self._is_s3():
            return None
        listing = self.submit("list", prefix, lambda: self._alist_identities(prefix))
        head = self.submit("read", path, lambda: self._aread_start(path, limit))
        try:
            first = head.result()
        except NotFoundError:
            first = None
        try:
            return listing.result(), first
        except NotFoundError:
            self._check_bucket(prefix)
            raise

    async def _alist_identities(self, prefix: str) -> Dict[str, Tuple[Any, ...]]:
        bucket, key, _ = self.fs.split_path(prefix)
        found: Dict[str, Tuple[Any, ...]] = {}
        kwargs: Dict[str, Any] = {"Bucket": bucket, "Prefix": key, "Delimiter": "/"}
        while True:
            resp = await self.fs._call_s3("list_objects_v2", **kwargs)
            self._buckets_seen.add(bucket)
            for obj in resp.get("Contents") or []:
                found[f"{self.protocol}://{bucket}/{obj['Key']}"] = identity_of_info(
                    {"size": obj.get("Size"), "ETag": obj.get("ETag")})
            if not resp.get("IsTruncated"):
                return found
            kwargs["ContinuationToken"] = resp.get("NextContinuationToken")

    async def _aread_start(self, path: str, limit: int) -> Tuple[bytes, Tuple[Any, ...]]:
        bucket, key, _ = self.fs.split_path(path)
        try:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{max(1, limit) - 1}",
                                          **(getattr(self.fs, "req_kw", None) or {}))
        except Exception as exc:
            if s3_code(exc)[0] != "InvalidRange":
                raise
            info = await self.fs._info(path, refresh=True)  # an empty object has no byte 0
            return b"", identity_of_info(info)
        body = resp["Body"]
        try:
            data = bytes(await body.read())
        finally:
            body.close()
        total = len(data)
        content_range = str(resp.get("ContentRange") or "")
        if "/" in content_range and content_range.rsplit("/", 1)[1].isdigit():
            total = int(content_range.rsplit("/", 1)[1])
        self._count("bytes_read", len(data))
        self._count("read_requests", 1)
        return data, identity_of_info({"size": total, "ETag": resp.get("ETag")})

    def pin(self, handle: Any, identity: Any) -> bool:
        """Hold every later read through ``handle`` to the object version ``identity`` (from
        :meth:`identity`, :meth:`identities` or :meth:`list_identities`); whether it is pinned.

        S3 only, and only for an S3 ETag: each GET carries ``If-Match``, and a replaced
        object fails the read with :class:`~shardckpt.errors.CheckpointReplacedError`.
        Elsewhere nothing is pinned (False): callers check identities as before.
        """
        if not (self._is_s3() and isinstance(handle, ObjectReadHandle)) or not identity or len(identity) < 2:
            return False
        tag = identity[1]
        if not isinstance(tag, str) or not _S3_ETAG.fullmatch(tag):
            return False
        handle.pinned = tuple(identity)
        handle.etag = f'"{tag}"'
        return True
