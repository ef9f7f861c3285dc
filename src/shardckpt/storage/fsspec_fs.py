"""Object stores through fsspec: ``s3://`` (s3fs), ``gs://`` (gcsfs), ``memory://`` (tests).

Needs the optional extra ``shardckpt[s3]`` (fsspec, s3fs). :class:`FsspecFileSystem`
implements :class:`~shardckpt.storage.object_store.ObjectStore` (see there for the
contract of each member and which role calls it); it is assembled from one module per
concern:

* :mod:`.fsspec_requests` — retries in one layer (ours: botocore's are off, aiohttp's
  silent resend too), errors mapped to :mod:`shardckpt.errors`, request counters, the
  bucket check (a negative ``exists``/``isfile``/``isdir``/``listdir`` answer is
  trusted only once the bucket is known to exist, so a mistyped bucket raises instead
  of looking like "no checkpoint yet"); :mod:`.fsspec_errors` sorts failures into
  transient / missing / permanent;
* :mod:`.fsspec_uploads` — streamed multipart uploads (S3: one PUT up to
  ``multipart_threshold``), exclusive creates, stale uploads of a killed save listed
  and aborted once idle for ``stale_after``;
* :mod:`.fsspec_conditional` — whole-object PUTs with ``If-None-Match`` / ``If-Match``,
  conditional deletes, lost replies resolved by reading the object back (the write is
  reported done exactly when the store holds our bytes);
* :mod:`.fsspec_reads` — ranged GETs planned with a cost model, gap bytes kept on the
  handle, announced reads fetched ahead (:mod:`.readahead`);
* :mod:`.fsspec_identity` — identities, listings by prefix, reads pinned to one version
  (``If-Match``: a replaced object fails the read instead of mixing versions).

This module keeps the rest: construction from a scheme and options, names (no rename:
``rename`` copies then deletes, for the raw ``merge`` op only; ``supports_rename`` is
False, so saves commit index-last), listings and path arithmetic.
"""

from __future__ import annotations

import posixpath
import random
import threading
from typing import Any, Dict, List, Sequence

from ..errors import NotFoundError, StorageError
from ..runtime import adopt_event_loop
from .base import posix_dirname, split_scheme
from .fsspec_errors import classify, describe_error, is_precondition_failed
from .fsspec_identity import Identities
from .fsspec_reads import ObjectReadHandle, RangedReads
from .fsspec_requests import no_resend_session_cls
from .fsspec_uploads import Uploads
from .object_store import ObjectInfo, ObjectStore
from .readahead import BlockCache

__all__ = ["FsspecFileSystem", "classify", "describe_error", "is_precondition_failed"]


class FsspecFileSystem(Uploads, Identities, RangedReads, ObjectStore):
    """A :class:`FileSystem` over one fsspec filesystem instance; paths are full URLs.

    Options (``shardckpt.storage.configure("s3", ...)``): ``retries`` (attempts per
    request, 6), ``backoff``/``max_backoff`` (seconds, 0.2/10), ``part_size`` (upload part,
    32 MiB), ``multipart_threshold`` (objects up to this size are one PUT, 64 MiB; as s3fs
    and boto3 do, a multipart upload only pays off for large objects), ``read_part_size``
    (8 MiB), ``max_concurrency`` (parts in flight, 16),
    ``read_latency``/``read_bandwidth`` (the read cost model, 0.02 s / 100 MB/s),
    ``read_cache`` (bytes of merged reads kept on open handles, 256 MiB; 0: none),
    ``stale_after`` (seconds after which uncommitted objects and idle multipart uploads
    count as a dead save's, 3600).
    """

    supports_rename = False

    def __init__(self, fs: Any, protocol: str, *, retries: int = 6, backoff: float = 0.2,
                 max_backoff: float = 10.0, part_size: int = 32 << 20, read_part_size: int = 8 << 20,
                 max_concurrency: int = 16, read_latency: float = 0.02, read_bandwidth: float = 100e6,
                 read_cache: int = 256 << 20, stale_after: float = 3600.0,
                 multipart_threshold: int = 64 << 20) -> None:
        self.fs = fs
        adopt_event_loop(getattr(fs, "loop", None))  # blocking calls of its loop run at interpreter exit too
        self.protocol = protocol
        self.retries = max(1, int(retries))
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.part_size = max(5 << 20, int(part_size)) if self._is_s3() else int(part_size)
        self.read_part_size = int(read_part_size)
        self.multipart_threshold = int(multipart_threshold)
        self.read_step = max(self.read_part_size * max_concurrency, 64 << 20)
        self.max_concurrency = max(1, int(max_concurrency))
        self.inflight = threading.BoundedSemaphore(self.max_concurrency)
        #: cost model of a ranged read: a request costs ``read_latency`` s, a byte ``1 / read_bandwidth`` s
        self.read_latency = float(read_latency)
        self.read_bandwidth = float(read_bandwidth)
        self.read_cache = int(read_cache)
        #: multipart uploads and uncommitted data objects younger than this are a live writer's (seconds)
        self.stale_after = float(stale_after)
        #: conditional writes (If-None-Match / If-Match) are available (S3)
        self.conditional_writes = self._is_s3()
        self._buckets_seen: set = set()
        self._cache = BlockCache(self.read_cache, self._fetch_block)  # the blocks of every open handle
        self._stats_lock = threading.Lock()
        self.stats: Dict[str, int] = {"bytes_read": 0, "read_requests": 0, "bytes_written": 0, "retries": 0,
                                      "cache_hits": 0, "server_copies": 0}

    # -- construction ------------------------------------------------------
    @classmethod
    def for_scheme(cls, scheme: str, options: Dict[str, Any]) -> "FsspecFileSystem":
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise StorageError(f"{scheme}:// paths need fsspec: pip install 'shardckpt[s3]'") from None
        own = {k: options.pop(k) for k in ("retries", "backoff", "max_backoff", "part_size", "read_part_size",
                                           "max_concurrency", "read_latency", "read_bandwidth", "read_cache",
                                           "stale_after", "multipart_threshold") if k in options}
        if scheme in ("s3", "s3a"):
            endpoint = options.pop("endpoint_url", None)
            if endpoint is not None:
                options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
            options.setdefault("use_listings_cache", False)
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})  # retrying is ours (see above)
            config.setdefault("max_pool_connections", 64)  # many ranged GETs in flight
            session_cls = no_resend_session_cls()
            if session_cls is not None:
                config.setdefault("http_session_cls", session_cls)
            options["config_kwargs"] = config
            options.setdefault("skip_instance_cache", True)
        try:
            fs = fsspec.filesystem(scheme, **options)
        except ImportError as exc:
            raise StorageError(f"{scheme}:// paths need the fsspec backend for {scheme!r} "
                               f"(for s3: pip install 'shardckpt[s3]'): {exc}") from None
        except ValueError as exc:
            raise StorageError(f"no fsspec filesystem for {scheme}://: {exc}") from None
        if scheme in ("s3", "s3a") and hasattr(fs, "retries"):
            fs.retries = 1
        return cls(fs, scheme, **own)


    def close(self, handle: Any) -> None:
        """Complete the upload; the object appears now (raises if it cannot)."""
        if isinstance(handle, ObjectReadHandle):
            self._cache.drop(handle.blocks)
            return
        handle.close()

    def discard(self, handle: Any) -> None:
        if isinstance(handle, ObjectReadHandle):
            return
        handle.discard()

    def fsync_dir(self, path: str) -> None:
        pass

    def temp_name(self, path: str) -> str:
        return f"{path}.tempstate{random.getrandbits(63)}"

    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        """One PUT: the object appears whole or not at all.

        When a reply is lost, the object is read back: the write counts as done
        exactly when the store holds ``data`` (see :meth:`write_call`).
        """
        self.put(path, data)

    def copy_file(self, src: str, dst: str, *, fsync: bool = False) -> str:
        """A server-side copy (S3 ``CopyObject``, multipart ``UploadPartCopy`` for large objects): no byte
        of it passes through this process."""
        self.call("copy", src, self.fs.copy, src, dst)
        self._count("server_copies", 1)
        return "server-copy"

    # -- names -------------------------------------------------------------------

    # -- names -------------------------------------------------------------------
    def rename(self, src: str, dst: str) -> None:
        """Copy, then delete (not atomic; the engine never relies on it for object stores)."""
        self.call("copy", src, self.fs.copy, src, dst)
        self.remove(src)

    def remove(self, path: str) -> None:
        try:
            self.call("delete", path, self.fs.rm_file, path)
        except NotFoundError:
            pass

    def remove_many(self, paths: Sequence[str]) -> None:
        """Remove objects (missing ones are fine): on S3 one ``DeleteObjects`` request per 1,000 keys of
        a bucket (retried: deleting is idempotent), elsewhere one by one."""
        if not self._is_s3() or len(paths) <= 1:
            for path in paths:
                self.remove(path)
            return
        by_bucket: Dict[str, List[str]] = {}
        for path in paths:
            bucket, key, _ = self.fs.split_path(path)
            by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for at in range(0, len(keys), 1000):
                chunk = keys[at:at + 1000]
                where = f"{self.protocol}://{bucket}/{chunk[0]}"
                resp = self.call("delete", where, self.fs.call_s3, "delete_objects", Bucket=bucket,
                                 Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
                errors = [e for e in resp.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise StorageError(f"delete failed for {len(errors)} object(s): {first.get('Code')}: "
                                       f"{first.get('Message')}", path=f"{self.protocol}://{bucket}/{first.get('Key')}")

    def remove_tree(self, path: str) -> None:
        try:
            if self.call("list", path, self.fs.exists, path):
                self.call("delete", path, self.fs.rm, path, recursive=True)
        except NotFoundError:
            pass

    def rmdir_if_empty(self, path: str) -> bool:
        return not self.listdir(path) if self.isdir(path) else True

    def list_details(self, path: str) -> Dict[str, ObjectInfo]:
        """The objects directly under ``path``: name -> ``{"size", "etag", "mtime"}`` (mtime: POSIX seconds).

        On S3 one ``ListObjectsV2`` request per 1,000 objects (s3fs's ``ls`` may add more).
        """
        if not self._is_s3():
            try:
                entries = self.call("list", path, self._ls_detail, path)
            except NotFoundError:
                entries = []
            if not entries:
                self._check_bucket(path)
            out: Dict[str, ObjectInfo] = {}
            for e in entries:
                if e.get("type") != "directory":
                    modified = e.get("LastModified") or e.get("mtime") or e.get("updated") or e.get("created")
                    mtime = modified.timestamp() if hasattr(modified, "timestamp") else None
                    out[posixpath.basename(e["name"].rstrip("/"))] = {"size": e.get("size"), "etag": e.get("ETag"),
                                                                      "mtime": mtime}
            return out
        bucket, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        found: Dict[str, ObjectInfo] = {}
        kwargs: Dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        while True:
            try:
                resp = self.call("list", path, self.fs.call_s3, "list_objects_v2", **kwargs)
            except NotFoundError:
                self._check_bucket(path)
                raise
            self._buckets_seen.add(bucket)  # a listing answered: the bucket exists
            for obj in resp.get("Contents") or []:
                name = obj["Key"][len(prefix):]
                if name and "/" not in name:
                    modified = obj.get("LastModified")
                    found[name] = {"size": obj.get("Size"), "etag": obj.get("ETag"),
                                   "mtime": modified.timestamp() if hasattr(modified, "timestamp") else None}
            if not resp.get("IsTruncated"):
                return found
            kwargs["ContinuationToken"] = resp.get("NextContinuationToken")

    def _ls_detail(self, path: str) -> List[Dict[str, Any]]:
        try:
            return self.fs.ls(path, detail=True, refresh=True)
        except TypeError:  # stores without ``refresh``
            return self.fs.ls(path, detail=True)

    def exists(self, path: str) -> bool:
        found = bool(self.call("stat", path, self.fs.exists, path))
        if not found:
            self._check_bucket(path)
        return found

    def isdir(self, path: str) -> bool:
        _, rest = split_scheme(path)
        if "/" not in rest.strip("/"):
            self._check_bucket(path)
            return True  # a bucket that exists
        found = bool(self.call("stat", path, self.fs.isdir, path))
        if not found:
            self._check_bucket(path)
        return found

    def isfile(self, path: str) -> bool:
        found = bool(self.call("stat", path, self.fs.isfile, path))
        if not found:
            self._check_bucket(path)
        return found

    def makedirs(self, path: str) -> None:
        """Object stores have no folders: nothing to create."""

    def listdir(self, path: str) -> List[str]:
        try:
            names = self.call("list", path, self._ls, path)
        except NotFoundError:
            names = []
        if not names:
            self._check_bucket(path)
        return sorted({posixpath.basename(n.rstrip("/")) for n in names})

    def _ls(self, path: str) -> List[str]:
        try:
            return self.fs.ls(path, detail=False, refresh=True)
        except TypeError:  # stores without ``refresh``
            return self.fs.ls(path, detail=False)

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def dirname(self, path: str) -> str:
        return posix_dirname(path)

    def basename(self, path: str) -> str:
        return posixpath.basename(path)

    def isabs(self, path: str) -> bool:
        return split_scheme(path)[0] != "" or path.startswith("/")

    def normpath(self, path: str) -> str:
        scheme, rest = split_scheme(path)
        if not scheme:
            return posixpath.normpath(path)
        return f"{scheme}://{posixpath.normpath(rest)}" if rest else path
