"""Object stores through fsspec: ``s3://`` (s3fs), ``gs://`` (gcsfs), ``memory://`` (tests).

Needs the optional extra ``shardckpt[s3]`` (fsspec, s3fs). What differs from a disk:

* No rename. ``supports_rename`` is False: the engine writes each data object in
  place under its final name and commits by writing the ``.index`` object last
  (one PUT, atomic). ``rename`` exists (copy + delete) for the raw ``merge`` op only.
* Writes stream: on S3 a data object is a multipart upload whose parts
  (``part_size`` bytes, filled straight from the tensors) are uploaded while the
  next part fills, up to ``max_concurrency`` parts in flight per store; nothing
  buffers a whole object. The object appears only when the upload completes
  (``close``); ``discard`` aborts it. Other fsspec stores use their own file objects.
* Reads are ranged GETs of just the requested bytes, large ones split in parallel
  ranges; :meth:`pread_batch` coalesces nearby small ranges.
* Every request is retried on transient errors (5xx, throttling, timeouts, lost
  connections) with exponential backoff and jitter, ``retries`` attempts in all;
  permanent errors (credentials, missing bucket or object) raise at once as
  :class:`~shardckpt.errors.StorageError` / :class:`~shardckpt.errors.NotFoundError`
  naming the object. The store's client does no retrying of its own (that would
  multiply the attempts) unless its options say otherwise.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import posixpath
import random
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import DataLossError, NotFoundError, StorageError, UnsupportedError
from .base import FileSystem, posix_dirname, split_scheme

__all__ = ["FsspecFileSystem"]

_log = logging.getLogger("shardckpt")

_TRANSIENT, _MISSING, _PERMANENT = "transient", "missing", "permanent"
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException",
    "BandwidthLimitExceeded", "PriorRequestNotComplete", "OperationAborted",
    "500", "502", "503", "504", "429",
}
_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchUpload"}
_TRANSIENT_NAMES = {
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError", "IncompleteRead", "ClientConnectorError",
    "ServerDisconnectedError", "ClientPayloadError", "ClientOSError", "ServerTimeoutError",
    "HTTPClientError", "ConnectionError", "FSTimeoutError", "ResponseParserError",
}
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                    "NoRegionError", "ParamValidationError"}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = 0
    cur: Optional[BaseException] = exc
    while cur is not None and seen < 8:
        yield cur
        seen += 1
        cur = cur.__cause__ or cur.__context__


def _s3_code(exc: BaseException) -> Tuple[Optional[str], Optional[int]]:
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            code = (resp.get("Error") or {}).get("Code")
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return (str(code) if code is not None else None), status
    return None, None


def classify(exc: BaseException) -> str:
    """``"transient"`` (retry), ``"missing"`` (no such object or bucket) or ``"permanent"``."""
    code, status = _s3_code(exc)
    if code is not None or status is not None:
        if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return _TRANSIENT
        if code in _MISSING_CODES or status == 404:
            return _MISSING
        return _PERMANENT
    for e in _chain(exc):
        name = type(e).__name__
        if name in _PERMANENT_NAMES:
            return _PERMANENT
        if name in _TRANSIENT_NAMES or isinstance(e, (ConnectionError, TimeoutError, socket.timeout,
                                                      asyncio.TimeoutError)):
            return _TRANSIENT
    if isinstance(exc, FileNotFoundError):
        return _MISSING
    if isinstance(exc, PermissionError):
        return _PERMANENT
    if isinstance(exc, OSError) and exc.errno in (errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO)) \
            and any(s in str(exc) for s in ("503", "500", "Slow Down", "Service Unavailable", "Internal")):
        return _TRANSIENT
    return _PERMANENT


class _ReadHandle:
    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path


class _Upload:
    """One S3 object written as a streamed multipart upload (a single PUT when small)."""

    def __init__(self, owner: "FsspecFileSystem", path: str) -> None:
        self.owner = owner
        self.path = path
        self.bucket, self.key, _ = owner.fs.split_path(path)
        self.part_size = owner.part_size
        self.buf = bytearray(self.part_size)
        self.fill = 0
        self.upload_id: Optional[str] = None
        self.futures: List[Tuple[int, "Future[Any]"]] = []
        self.error: Optional[BaseException] = None
        self.done = False

    def write(self, data: memoryview) -> None:
        if self.error is not None:
            raise self.error
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        pos, total = 0, len(data)
        while pos < total:
            take = min(self.part_size - self.fill, total - pos)
            self.buf[self.fill:self.fill + take] = data[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == self.part_size:
                self._send_part()

    def _send_part(self) -> None:
        owner = self.owner
        if self.upload_id is None:
            resp = owner.call("start upload", self.path, owner.fs.call_s3, "create_multipart_upload",
                              Bucket=self.bucket, Key=self.key)
            self.upload_id = resp["UploadId"]
        body = self.buf
        if self.fill < len(body):
            del body[self.fill:]  # shrink in place: the last part
        number = len(self.futures) + 1
        owner.inflight.acquire()
        fut = owner.submit("upload part", self.path, lambda: owner.fs._call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number,
            Body=body))
        fut.add_done_callback(lambda _f: owner.inflight.release())
        owner.count_write(len(body))
        self.futures.append((number, fut))
        self.buf = bytearray(self.part_size)
        self.fill = 0
        # surface a failed part early
        for _, f in self.futures:
            if f.done() and f.exception() is not None:
                self.error = f.exception()
                raise self.error  # type: ignore[misc]

    def close(self) -> None:
        if self.done:
            return
        owner = self.owner
        try:
            if self.error is not None:
                raise self.error
            if self.upload_id is None:  # small object: one PUT
                body = self.buf
                del body[self.fill:]  # shrinks in place, no copy
                owner.call("write", self.path, owner.fs.call_s3, "put_object", Bucket=self.bucket,
                           Key=self.key, Body=body)
                owner.count_write(len(body))
            else:
                if self.fill:
                    self._send_part()
                parts = []
                for number, fut in self.futures:
                    parts.append({"PartNumber": number, "ETag": fut.result()["ETag"]})
                owner.call("complete upload", self.path, owner.fs.call_s3, "complete_multipart_upload",
                           Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                           MultipartUpload={"Parts": parts})
            self.done = True
        except BaseException as exc:
            self.error = exc
            self.discard()
            raise
        finally:
            self.buf = bytearray()

    def discard(self) -> None:
        if self.done:
            return
        self.done = True
        for _, fut in self.futures:
            try:
                fut.result()
            except BaseException:
                pass
        if self.upload_id is not None:
            try:
                self.owner.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                      UploadId=self.upload_id)
            except Exception as exc:  # best effort: a lifecycle rule cleans what remains
                _log.warning("could not abort the upload of %s: %s", self.path, exc)
        self.buf = bytearray()


class _FileWriter:
    """Writes through the store's own fsspec file object (stores other than S3)."""

    def __init__(self, owner: "FsspecFileSystem", path: str) -> None:
        self.owner = owner
        self.path = path
        self.f = owner.call("create", path, owner.fs.open, path, "wb", block_size=owner.part_size)
        self.done = False

    def write(self, data: memoryview) -> None:
        try:
            self.f.write(data)
        except Exception as exc:
            raise self.owner.error(exc, self.path, "write") from exc
        self.owner.count_write(len(data))

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.f.close()
        except Exception as exc:
            raise self.owner.error(exc, self.path, "write") from exc

    def discard(self) -> None:
        if self.done:
            return
        self.done = True
        discard = getattr(self.f, "discard", None)
        if discard is not None:
            try:
                discard()
            except Exception:
                pass


class FsspecFileSystem(FileSystem):
    """A :class:`FileSystem` over one fsspec filesystem instance; paths are full URLs."""

    supports_rename = False

    def __init__(self, fs: Any, protocol: str, *, retries: int = 6, backoff: float = 0.2,
                 max_backoff: float = 10.0, part_size: int = 32 << 20, read_part_size: int = 8 << 20,
                 max_concurrency: int = 16) -> None:
        self.fs = fs
        self.protocol = protocol
        self.retries = max(1, int(retries))
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.part_size = max(5 << 20, int(part_size)) if self._is_s3() else int(part_size)
        self.read_part_size = int(read_part_size)
        self.read_step = max(self.read_part_size * max_concurrency, 64 << 20)
        self.max_concurrency = max(1, int(max_concurrency))
        self.inflight = threading.BoundedSemaphore(self.max_concurrency)
        self._stats_lock = threading.Lock()
        self.stats: Dict[str, int] = {"bytes_read": 0, "read_requests": 0, "bytes_written": 0, "retries": 0}

    # -- construction ------------------------------------------------------
    @classmethod
    def for_scheme(cls, scheme: str, options: Dict[str, Any]) -> "FsspecFileSystem":
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise StorageError(f"{scheme}:// paths need fsspec: pip install 'shardckpt[s3]'") from None
        own = {k: options.pop(k) for k in ("retries", "backoff", "max_backoff", "part_size", "read_part_size",
                                           "max_concurrency") if k in options}
        if scheme in ("s3", "s3a"):
            endpoint = options.pop("endpoint_url", None)
            if endpoint is not None:
                options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
            options.setdefault("use_listings_cache", False)
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})  # retrying is ours (see above)
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

    def _is_s3(self) -> bool:
        return hasattr(self.fs, "call_s3") and hasattr(self.fs, "split_path")

    # -- retries and errors ----------------------------------------------------
    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * (2 ** attempt)) * (0.5 + random.random() / 2)

    def error(self, exc: BaseException, path: str, action: str, attempts: int = 1) -> Exception:
        kind = classify(exc)
        code, status = _s3_code(exc)
        detail = f"{type(exc).__name__}: {exc}"
        if kind == _MISSING:
            what = "bucket does not exist" if code == "NoSuchBucket" else "no such object"
            return NotFoundError(f"{action}: {what} ({detail})", path=path)
        if isinstance(exc, PermissionError) or code in ("AccessDenied", "InvalidAccessKeyId",
                                                        "SignatureDoesNotMatch", "ExpiredToken") \
                or type(exc).__name__ in _PERMANENT_NAMES:
            return StorageError(f"{action} failed: access denied, check the credentials ({detail})", path=path)
        if kind == _TRANSIENT:
            return StorageError(f"{action} failed after {attempts} attempts: {detail}", path=path)
        return StorageError(f"{action} failed: {detail}", path=path)

    def call(self, action: str, path: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with retries on transient errors; errors become ``shardckpt.errors``."""
        attempt = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if classify(exc) == _TRANSIENT and attempt + 1 < self.retries:
                    self._count("retries", 1)
                    _log.info("%s %s: transient error (%s), retrying", action, path, exc)
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self.error(exc, path, action, attempt + 1) from exc

    async def _acall(self, action: str, path: str, make: Callable[[], Any]) -> Any:
        attempt = 0
        while True:
            try:
                return await make()
            except Exception as exc:
                if classify(exc) == _TRANSIENT and attempt + 1 < self.retries:
                    self._count("retries", 1)
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self.error(exc, path, action, attempt + 1) from exc

    def submit(self, action: str, path: str, make: Callable[[], Any]) -> "Future[Any]":
        """Run the coroutine ``make()`` (with retries) on the store's event loop; a future."""
        return asyncio.run_coroutine_threadsafe(self._acall(action, path, make), self.fs.loop)

    def _count(self, name: str, n: int) -> None:
        with self._stats_lock:
            self.stats[name] += n

    def count_write(self, n: int) -> None:
        self._count("bytes_written", n)

    def reset_stats(self) -> None:
        with self._stats_lock:
            for k in self.stats:
                self.stats[k] = 0

    # -- reading -------------------------------------------------------------
    def open_read(self, path: str) -> _ReadHandle:
        return _ReadHandle(path)

    def size(self, path: str) -> int:
        return int(self.call("stat", path, self.fs.size, path))

    @staticmethod
    def _identity_of_info(info: Dict[str, Any]) -> Tuple[Any, ...]:
        tag = None
        for field in ("ETag", "etag", "VersionId", "generation", "md5Hash", "LastModified", "mtime", "created"):
            value = info.get(field)
            if value is not None:
                if hasattr(value, "timestamp"):  # listings and HEADs may spell times differently
                    value = float(value.timestamp())
                tag = str(value).strip('"')
                break
        return (int(info.get("size") or 0), tag)

    def identity(self, path: str, handle: Any = None) -> Tuple[Any, ...]:
        """What identifies the object's current contents: size and ETag (or version / generation / mtime).

        One metadata request (HEAD); a missing object is a :class:`NotFoundError`.
        """
        try:
            self.fs.invalidate_cache(path)
        except Exception:
            pass
        return self._identity_of_info(self.call("stat", path, self.fs.info, path))

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
                    out[p] = self._identity_of_info(info)
                    continue
                try:  # not in the listing: ask the object itself before calling it missing
                    out[p] = self.identity(p)
                except NotFoundError:
                    out[p] = None
        return out

    def read_bytes(self, path: str) -> bytes:
        data = self.call("read", path, self.fs.cat_file, path)
        self._count("bytes_read", len(data))
        self._count("read_requests", 1)
        return bytes(data)

    def _get(self, path: str, start: int, view: memoryview) -> None:
        data = self.call("read", path, self.fs.cat_file, path, start=start, end=start + len(view))
        self._fill(path, start, view, data)

    def _fill(self, path: str, start: int, view: memoryview, data: bytes) -> None:
        self._count("bytes_read", len(data))
        self._count("read_requests", 1)
        if len(data) != len(view):
            raise DataLossError(f"unexpected end of object at offset {start + len(data)} "
                                f"(wanted {len(view) - len(data)} more bytes)", path=path)
        view[:] = data

    def pread_into(self, handle: Any, buf: memoryview, offset: int, path: str = "") -> None:
        """Fill ``buf`` from ``offset`` with ranged GETs (in parallel when large)."""
        path = path or handle.path
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        n = len(buf)
        if n == 0:
            return
        step = self.read_part_size
        if n <= step:
            self._get(path, offset, buf)
            return
        self.pread_batch(handle, [(offset + a, buf[a:a + step]) for a in range(0, n, step)], path)

    def pread_batch(self, handle: Any, requests: Sequence[Tuple[int, memoryview]], path: str = "",
                    max_gap: int = 256 << 10) -> None:
        """Fill every ``(offset, buffer)`` of ``requests``: nearby ranges share one GET, GETs run in parallel.

        Two ranges are fetched together when the gap between them is at most
        ``max_gap`` and at most a tenth of the useful bytes so far, so the bytes
        fetched stay within 1.1x of those asked for.
        """
        path = path or handle.path
        reqs = sorted(((o, b.cast("B") if b.format != "B" or b.ndim != 1 else b) for o, b in requests
                       if len(b)), key=lambda r: r[0])
        groups: List[List[Tuple[int, memoryview]]] = []
        useful = 0
        for off, b in reqs:
            if groups:
                last = groups[-1]
                end = last[-1][0] + len(last[-1][1])
                start0 = last[0][0]
                gap = off - end
                if 0 <= gap <= max_gap and gap * 10 <= useful and off + len(b) - start0 <= self.read_part_size:
                    last.append((off, b))
                    useful += len(b)
                    continue
            groups.append([(off, b)])
            useful = len(b)

        def scatter(group: List[Tuple[int, memoryview]], data: bytes) -> None:
            base = group[0][0]
            end = group[-1][0] + len(group[-1][1])
            self._count("bytes_read", len(data))
            self._count("read_requests", 1)
            if len(data) != end - base:
                raise DataLossError(f"unexpected end of object at offset {base + len(data)}", path=path)
            mv = memoryview(data)
            for o, b in group:
                b[:] = mv[o - base:o - base + len(b)]

        if len(groups) == 1 or not getattr(self.fs, "async_impl", False):
            for g in groups:
                end = g[-1][0] + len(g[-1][1])
                scatter(g, self.call("read", path, self.fs.cat_file, path, start=g[0][0], end=end))
            return
        def getter(start: int, end: int) -> Callable[[], Any]:
            return lambda: self.fs._cat_file(path, start=start, end=end)

        futures = []
        for g in groups:
            end = g[-1][0] + len(g[-1][1])
            futures.append((g, self.submit("read", path, getter(g[0][0], end))))
        error: Optional[BaseException] = None
        for g, fut in futures:
            try:
                data = fut.result()
                if error is None:
                    scatter(g, data)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    # -- writing -----------------------------------------------------------------
    def open_write(self, path: str) -> Any:
        if self._is_s3():
            return _Upload(self, path)
        return _FileWriter(self, path)

    def write_all(self, handle: Any, buf: memoryview, path: str = "") -> None:
        handle.write(buf)

    def fsync(self, handle: Any, path: str = "") -> None:
        """Nothing to do: an object is durable once its upload completes (``close``)."""

    def close(self, handle: Any) -> None:
        """Complete the upload; the object appears now (raises if it cannot)."""
        if isinstance(handle, _ReadHandle):
            return
        handle.close()

    def discard(self, handle: Any) -> None:
        if isinstance(handle, _ReadHandle):
            return
        handle.discard()

    def fsync_dir(self, path: str) -> None:
        pass

    def temp_name(self, path: str) -> str:
        return f"{path}.tempstate{random.getrandbits(63)}"

    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        """One PUT: the object appears whole or not at all."""
        self.call("write", path, self.fs.pipe_file, path, bytes(data))
        self.count_write(len(data))

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

    def remove_tree(self, path: str) -> None:
        try:
            if self.call("list", path, self.fs.exists, path):
                self.call("delete", path, self.fs.rm, path, recursive=True)
        except NotFoundError:
            pass

    def rmdir_if_empty(self, path: str) -> bool:
        return not self.listdir(path) if self.isdir(path) else True

    def exists(self, path: str) -> bool:
        return bool(self.call("stat", path, self.fs.exists, path))

    def isdir(self, path: str) -> bool:
        _, rest = split_scheme(path)
        if "/" not in rest.strip("/"):
            return bool(self.call("stat", path, self.fs.exists, path))  # a bucket
        return bool(self.call("stat", path, self.fs.isdir, path))

    def isfile(self, path: str) -> bool:
        return bool(self.call("stat", path, self.fs.isfile, path))

    def makedirs(self, path: str) -> None:
        """Object stores have no folders: nothing to create."""

    def listdir(self, path: str) -> List[str]:
        try:
            names = self.call("list", path, self._ls, path)
        except NotFoundError:
            return []
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

    def unsupported(self, what: str, path: str) -> UnsupportedError:
        return UnsupportedError(f"{what} is not supported on {self.protocol}://", path=path)
