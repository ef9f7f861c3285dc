"""Object stores through fsspec: ``s3://`` (s3fs), ``gs://`` (gcsfs), ``memory://`` (tests).

Needs the optional extra ``shardckpt[s3]`` (fsspec, s3fs). What differs from a disk:

* No rename. ``supports_rename`` is False: the engine writes each data object in
  place under its final name and commits by writing the ``.index`` object last
  (one PUT, atomic). ``rename`` exists (copy + delete) for the raw ``merge`` op only.
* Writes stream: on S3 a data object larger than ``multipart_threshold`` (64 MiB)
  is a multipart upload whose parts (``part_size`` bytes, filled straight from the
  tensors) are uploaded while the next part fills, up to ``max_concurrency`` parts in
  flight per store; a smaller one is buffered and sent with one PUT (fewer requests;
  shards upload in parallel anyway). No more than the threshold is ever buffered.
  The object appears only when the upload completes (``close``); ``discard`` aborts it.
  Other fsspec stores use their own file objects.
* Conditional writes (S3): :meth:`FsspecFileSystem.create_exclusive` opens an object
  that is created only if no object has that name (``If-None-Match: *`` on the PUT or
  on CompleteMultipartUpload); :meth:`FsspecFileSystem.put` takes ``if_match`` (an
  ETag) / ``if_none_match``. A lost race is an :class:`~shardckpt.errors.AbortedError`.
  The index-last committer builds its winner rule on these.
* Ambiguous failures are resolved, never guessed: when a write's request may have
  landed although its reply was lost (a timeout, a reset connection, a 5xx, or a
  retry refused with 412 / NoSuchUpload because the first attempt did land), the
  object is read back (ETag first, then the bytes) and the write is reported done
  exactly when the store holds our bytes (``write_atomic`` / ``put``, completed uploads).
* Reads are ranged GETs planned with a cost model (:meth:`FsspecFileSystem.pread_batch`):
  neighbouring ranges are merged when the gap costs less to download than a request
  (``read_latency`` seconds vs ``read_bandwidth`` bytes/s), the requests run in
  parallel, and the gap bytes of a merged request are kept on the open handle (a
  bounded budget, ``read_cache``) so a later request for them is served without a GET.
  A reader that knows what it will read announces it (:meth:`FsspecFileSystem.prefetch`):
  the ranges of every tensor of a restore are planned together into few large GETs
  sent ahead of the reads, each kept until its bytes have been read
  (:mod:`shardckpt.storage.readahead`).
* Pinned reads (S3): a read handle can be held to one version of its object
  (:meth:`FsspecFileSystem.pin`, with the identity a listing or HEAD gave): every GET
  through it carries ``If-Match: <ETag>``, so a replaced object fails the read with
  :class:`~shardckpt.errors.CheckpointReplacedError` instead of mixing versions, and
  the handle's identity is known without asking again. :meth:`FsspecFileSystem.list_identities`
  gives the identity of every object of a checkpoint with one listing.
* Retries: one layer only. Every request is retried here on transient errors (5xx,
  throttling, timeouts, lost connections) with exponential backoff and jitter,
  ``retries`` attempts in all; botocore's retries are off and aiohttp's silent
  resend of a request on a reset keep-alive connection is disabled, so "after 4
  attempts" means 4 requests. Permanent errors (credentials, missing bucket or
  object) raise at once as :class:`~shardckpt.errors.StorageError` /
  :class:`~shardckpt.errors.NotFoundError` naming the object, the HTTP status and the
  S3 error code.
* A missing bucket is never "no such file": a negative ``exists``/``isfile``/``isdir``/
  ``listdir`` answer is checked against the bucket (once per bucket), so a mistyped
  bucket or an unreachable store raises instead of looking like "no checkpoint yet".
* Stale multipart uploads (of a killed save) are listed and aborted by the next save
  (:meth:`FsspecFileSystem.list_uploads`, ``abort_upload``) once older than
  ``stale_after`` seconds (default one hour), so a live writer's upload is never hit.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import posixpath
import random
import re
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import (
    AbortedError,
    CheckpointReplacedError,
    DataLossError,
    NotFoundError,
    ShardckptError,
    StorageError,
    UnsupportedError,
)
from ..runtime import adopt_event_loop
from .base import FileSystem, RunBatch, posix_dirname, split_scheme
from .readahead import BlockCache, Blocks, plan_spans

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


def describe_error(exc: BaseException) -> str:
    """``HTTP 503 SlowDown: OSError: ...``: the status and S3 code first (when known), then the error."""
    code, status = _s3_code(exc)
    head = " ".join(x for x in ((f"HTTP {status}" if status else ""), code or "") if x)
    text = f"{type(exc).__name__}: {exc}"
    return f"{head}: {text}" if head else text


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether a conditional request was refused (HTTP 412 / ``PreconditionFailed``)."""
    code, status = _s3_code(exc)
    return status == 412 or code in ("PreconditionFailed", "412", "ConditionalRequestConflict")


def _no_such_upload(exc: BaseException) -> bool:
    return _s3_code(exc)[0] == "NoSuchUpload"


def _md5_etag(data: Any) -> str:
    return '"' + hashlib.md5(data).hexdigest() + '"'


def _multipart_etag(part_etags: Sequence[str]) -> str:
    digest = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in part_etags)).hexdigest()
    return f'"{digest}-{len(part_etags)}"'


def _same_etag(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and a.strip('"') == b.strip('"')


def _no_resend_session_cls() -> Any:
    """aiobotocore's HTTP session with aiohttp's resend-on-reset switched off (one retry layer: ours)."""
    try:
        from aiobotocore.httpsession import AIOHTTPSession  # type: ignore[import-untyped]
    except ImportError:
        return None
    if not hasattr(AIOHTTPSession, "_get_session"):
        return None

    class NoResendSession(AIOHTTPSession):  # type: ignore[misc]
        async def _get_session(self, proxy_url: Any) -> Any:
            session = await super()._get_session(proxy_url)
            session._retry_connection = False  # aiohttp would resend once on a reset keep-alive connection
            return session

    return NoResendSession


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


#: an S3 ETag: the MD5 of the bytes, or of the parts' MD5s and a part count (only those are pinned)
_S3_ETAG = re.compile(r"[0-9a-fA-F]{32}(-[0-9]+)?")


class _ReadHandle:
    """An open object: its path, its blocks (:mod:`.readahead`) and the version it is pinned to.

    ``pinned``: the identity every read is held to (``etag`` is sent as ``If-Match``),
    ``None`` when not pinned.
    """

    __slots__ = ("path", "blocks", "pinned", "etag")

    def __init__(self, path: str) -> None:
        self.path = path
        self.blocks = Blocks(self)
        self.pinned: Optional[Tuple[Any, ...]] = None
        self.etag: Optional[str] = None


class _Upload:
    """One S3 object written as a streamed multipart upload (a single PUT when small).

    ``exclusive``: the object is created only if no object has its name (``If-None-Match: *``);
    a lost race raises :class:`~shardckpt.errors.AbortedError`. ``etag`` is set once complete.
    """

    def __init__(self, owner: "FsspecFileSystem", path: str, exclusive: bool = False) -> None:
        self.owner = owner
        self.path = path
        self.exclusive = exclusive
        self.bucket, self.key, _ = owner.fs.split_path(path)
        self.part_size = owner.part_size
        #: up to this many bytes the object is one PUT; past it, a multipart upload of ``part_size`` parts
        self.threshold = max(owner.multipart_threshold, self.part_size)
        self.buf = bytearray()  # grows as data arrives (no zero-filled part-size allocation up front)
        self.upload_id: Optional[str] = None
        self.futures: List[Tuple[int, "Future[Any]"]] = []
        self.error: Optional[BaseException] = None
        self.done = False
        self.etag: Optional[str] = None

    def write(self, data: memoryview) -> None:
        if self.error is not None:
            raise self.error
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        pos, total = 0, len(data)
        while pos < total:
            if self.upload_id is None:  # still one PUT's worth
                room = self.threshold - len(self.buf)
                if room == 0:  # more bytes past the threshold: a multipart upload from here on
                    self._start_multipart()
                    continue
                take = min(room, total - pos)
                self.buf += data[pos:pos + take]
                pos += take
                continue
            take = min(self.part_size - len(self.buf), total - pos)
            self.buf += data[pos:pos + take]
            pos += take
            if len(self.buf) == self.part_size:
                self._send_part()

    def _start_multipart(self) -> None:
        """Cut the buffered bytes into parts and send them (the upload is created with the first)."""
        buffered, self.buf = self.buf, bytearray()
        if len(buffered) == self.part_size:
            self.buf = buffered
            self._send_part()
            return
        view = memoryview(buffered)
        try:
            for start in range(0, len(buffered), self.part_size):
                self.buf = bytearray(view[start:start + self.part_size])
                if len(self.buf) == self.part_size:
                    self._send_part()
        finally:
            view.release()

    def _send_part(self) -> None:
        owner = self.owner
        if self.upload_id is None:
            resp = owner.call("start upload", self.path, owner.fs.call_s3, "create_multipart_upload",
                              Bucket=self.bucket, Key=self.key)
            self.upload_id = resp["UploadId"]
        body = self.buf
        number = len(self.futures) + 1
        owner.inflight.acquire()
        fut = owner.submit("upload part", self.path, lambda: owner.fs._call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number,
            Body=body))
        fut.add_done_callback(lambda _f: owner.inflight.release())
        owner.count_write(len(body))
        self.futures.append((number, fut))
        self.buf = bytearray()
        # surface a failed part early
        for _, f in self.futures:
            if f.done() and f.exception() is not None:
                self.error = f.exception()
                raise self.error  # type: ignore[misc]

    def close(self) -> None:
        if self.done:
            return
        owner = self.owner
        cond = {"IfNoneMatch": "*"} if self.exclusive else {}
        try:
            if self.error is not None:
                raise self.error
            if self.upload_id is None:  # small object: one PUT
                body = self.buf
                resp = owner.write_call("write", self.path, lambda: owner.fs.call_s3(
                    "put_object", Bucket=self.bucket, Key=self.key, Body=body, **cond),
                    lambda: owner.holds_etag(self.path, _md5_etag(body)))  # MD5 only when in doubt
                etag = resp.get("ETag") if isinstance(resp, dict) else None
                self.etag = str(etag) if etag else _md5_etag(body)
                owner.count_write(len(body))
            else:
                if self.buf:
                    self._send_part()
                parts = []
                for number, fut in self.futures:
                    parts.append({"PartNumber": number, "ETag": fut.result()["ETag"]})
                expected = _multipart_etag([p["ETag"] for p in parts])
                resp = owner.write_call("complete upload", self.path, lambda: owner.fs.call_s3(
                    "complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts}, **cond),
                    lambda: owner.holds_etag(self.path, expected))
                self.etag = resp.get("ETag", expected) if isinstance(resp, dict) else expected
                self.upload_id = None  # completed: nothing to abort
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
                self.owner.call("abort upload", self.path, self.owner.fs.call_s3, "abort_multipart_upload",
                                Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
            except Exception as exc:  # best effort: the next save aborts what remains (stale uploads)
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
            session_cls = _no_resend_session_cls()
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

    def _is_s3(self) -> bool:
        return hasattr(self.fs, "call_s3") and hasattr(self.fs, "split_path")

    # -- retries and errors ----------------------------------------------------
    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * (2 ** attempt)) * (0.5 + random.random() / 2)

    def error(self, exc: BaseException, path: str, action: str, attempts: int = 1) -> Exception:
        kind = classify(exc)
        code, status = _s3_code(exc)
        detail = describe_error(exc)
        if is_precondition_failed(exc):
            return AbortedError(f"{action}: another writer got there first (a concurrent save to this prefix?) "
                                f"({detail})", path=path)
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
            except ShardckptError:
                raise
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
            except ShardckptError:
                raise
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

    def write_call(self, action: str, path: str, fn: Callable[[], Any],
                   landed: Callable[[], Optional[str]]) -> Any:
        """A write request with retries whose outcome is told truthfully.

        After an attempt that may have reached the store (a transient error: the
        reply may be what was lost), a refusal that our own earlier attempt would
        explain (412 on a conditional write, ``NoSuchUpload`` on completing an upload),
        or the last failed attempt, ``landed()`` checks the store: it returns the
        object's ETag when the store holds our bytes (the write is reported done:
        ``{"ETag": etag}``), else ``None`` and the error is raised. A conditional write
        refused on its first attempt is an :class:`~shardckpt.errors.AbortedError`.
        """
        attempt = 0
        maybe_landed = False
        while True:
            try:
                return fn()
            except Exception as exc:
                refused = is_precondition_failed(exc) or _no_such_upload(exc)
                transient = classify(exc) == _TRANSIENT and not refused
                if transient and attempt + 1 < self.retries:
                    maybe_landed = True
                    self._count("retries", 1)
                    _log.info("%s %s: transient error (%s), retrying", action, path, describe_error(exc))
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                if maybe_landed or transient:
                    try:
                        etag = landed()
                    except Exception as check:  # cannot tell: report the original failure, with this
                        _log.warning("%s %s: could not check whether the write landed: %s", action, path, check)
                        etag = None
                    if etag is not None:
                        _log.info("%s %s: the reply was lost but the object holds our bytes", action, path)
                        return {"ETag": etag}
                raise self.error(exc, path, action, attempt + 1) from exc

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
        return etag if _same_etag(etag, expected) else None

    def holds_bytes(self, path: str, data: bytes) -> Optional[str]:
        """The object's ETag (``""`` where stores have none) when it holds exactly ``data``, else ``None``."""
        if self._is_s3():
            etag = self.holds_etag(path, _md5_etag(data))
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
            return str(resp.get("ETag") or _md5_etag(data))
        if if_match is not None or if_none_match:
            raise self.unsupported("conditional writes", path)
        self.write_call("write", path, lambda: self.fs.pipe_file(path, data), lambda: self.holds_bytes(path, data))
        self.count_write(len(data))
        return ""

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

        One metadata request (HEAD); a missing object is a :class:`NotFoundError`. For a
        read handle pinned to a version (:meth:`pin`) no request: its reads can only
        return that version's bytes (or fail), so that is the identity of what it reads.
        """
        if isinstance(handle, _ReadHandle) and handle.pinned is not None:
            return handle.pinned
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
                found[f"{self.protocol}://{bucket}/{obj['Key']}"] = self._identity_of_info(
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
            if _s3_code(exc)[0] != "InvalidRange":
                raise
            info = await self.fs._info(path, refresh=True)  # an empty object has no byte 0
            return b"", self._identity_of_info(info)
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
        return data, self._identity_of_info({"size": total, "ETag": resp.get("ETag")})

    def pin(self, handle: Any, identity: Any) -> bool:
        """Hold every later read through ``handle`` to the object version ``identity`` (from
        :meth:`identity`, :meth:`identities` or :meth:`list_identities`); whether it is pinned.

        S3 only, and only for an S3 ETag: each GET carries ``If-Match``, and a replaced
        object fails the read with :class:`~shardckpt.errors.CheckpointReplacedError`.
        Elsewhere nothing is pinned (False): callers check identities as before.
        """
        if not (self._is_s3() and isinstance(handle, _ReadHandle)) or not identity or len(identity) < 2:
            return False
        tag = identity[1]
        if not isinstance(tag, str) or not _S3_ETAG.fullmatch(tag):
            return False
        handle.pinned = tuple(identity)
        handle.etag = f'"{tag}"'
        return True

    def read_bytes(self, path: str) -> bytes:
        data = self.call("read", path, self.fs.cat_file, path)
        self._count("bytes_read", len(data))
        self._count("read_requests", 1)
        return bytes(data)

    def _ranged_get(self, handle: Any, path: str, start: int, end: int) -> Callable[[], Any]:
        """A coroutine factory: one GET of bytes ``[start, end)`` (``If-Match`` when the handle is pinned)."""
        etag = handle.etag if isinstance(handle, _ReadHandle) else None

        async def get() -> Any:
            if etag is None:
                data = await self.fs._cat_file(path, start=start, end=end)
            else:
                data = await self._get_pinned(path, start, end, etag)
            self._count("bytes_read", len(data))
            self._count("read_requests", 1)
            return data
        return get

    async def _get_pinned(self, path: str, start: int, end: int, etag: str) -> bytes:
        bucket, key, _ = self.fs.split_path(path)
        try:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                          IfMatch=etag, **(getattr(self.fs, "req_kw", None) or {}))
        except Exception as exc:
            if is_precondition_failed(exc):
                raise CheckpointReplacedError(f"checkpoint was replaced while open: the object is no longer the "
                                              f"version opened (ETag {etag}; open the checkpoint again to read "
                                              "what is there now)", path=path) from None
            raise
        body = resp["Body"]
        try:
            return bytes(await body.read())
        finally:
            body.close()

    def _fetch_block(self, handle: Any, start: int, end: int) -> "Future[Any]":
        return self.submit("read", handle.path, self._ranged_get(handle, handle.path, start, end))

    def _get(self, handle: Any, path: str, start: int, view: memoryview) -> None:
        if getattr(self.fs, "async_impl", False):
            data = self.submit("read", path, self._ranged_get(handle, path, start, start + len(view))).result()
            if len(data) != len(view):
                raise DataLossError(f"unexpected end of object at offset {start + len(data)} "
                                    f"(wanted {len(view) - len(data)} more bytes)", path=path)
            view[:] = data
            return
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
        if isinstance(handle, _ReadHandle) and handle.blocks and self._cache.read(handle.blocks, offset, buf, path):
            self._count("cache_hits", 1)
            return
        step = self.read_part_size
        if n <= step:
            self._get(handle, path, offset, buf)
            return
        self.pread_batch(handle, [(offset + a, buf[a:a + step]) for a in range(0, n, step)], path)

    def gap_limit(self) -> int:
        """Bytes of gap worth downloading rather than sending another request (the cost model)."""
        return int(self.read_latency * self.read_bandwidth)

    def read_cap(self) -> int:
        """The largest merged GET: ``read_part_size`` or four gap limits, whichever is larger (a long
        span is split into requests that run in parallel, each worth several requests' cost in bytes)."""
        return max(self.read_part_size, 4 * self.gap_limit())

    def plan_reads(self, requests: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, List[int]]]:
        """Group ranges ``(offset, length)`` into GETs: ``(start, end, indices of the ranges served)``.

        Ranges are sorted; a range joins the current GET when the gap to it costs less
        to download than a request (:meth:`gap_limit`) and the GET stays within
        :meth:`read_cap`.
        """
        order = sorted((i for i, r in enumerate(requests) if r[1] > 0), key=lambda i: requests[i][0])
        limit = self.gap_limit()
        cap = self.read_cap()
        groups: List[Tuple[int, int, List[int]]] = []
        for i in order:
            off, n = requests[i]
            if groups:
                start, end, members = groups[-1]
                gap = off - end
                if gap <= limit and max(end, off + n) - start <= cap:
                    groups[-1] = (start, max(end, off + n), members + [i])
                    continue
            groups.append((off, off + n, [i]))
        return groups

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` does anything here (stores with concurrent requests and a read budget)."""
        return bool(getattr(self.fs, "async_impl", False)) and self.read_cache > 0

    def prefetch(self, handle: Any, starts: Any, ends: Any, path: str = "") -> int:
        """Announce reads: bytes ``[starts[i], ends[i])`` of the object will be read soon, by any thread.

        They are planned together with the cost model (:func:`~shardckpt.storage.readahead.plan_spans`:
        gaps cheaper than a request are fetched, spans cut at :meth:`read_cap`) and fetched
        in parallel ahead of the reads, within the ``read_cache`` budget; each block is kept
        until its announced bytes have been read (or the handle is closed). A read of
        other bytes goes to the store as usual. Returns the number of GETs planned.
        """
        if not self.prefetches or not isinstance(handle, _ReadHandle):
            return 0
        return self._cache.announce(handle.blocks, plan_spans(starts, ends, self.gap_limit(), self.read_cap()))

    def pread_batch(self, handle: Any, requests: Sequence[Tuple[int, memoryview]], path: str = "") -> None:
        """Fill every ``(offset, buffer)`` of ``requests`` with few GETs, in parallel.

        Requests inside blocks (announced reads, or kept gap bytes) are served from them.
        The others are planned (:meth:`plan_reads`): neighbouring ranges share one GET
        when the gap between them costs less to download than a request; every GET is
        sent at once (the connection pool bounds how many run). A GET that fetched gap
        bytes is kept on the handle (within the ``read_cache`` budget, dropped on close):
        a later request inside it — e.g. the other column block of the same rows — is
        served from it, and one still in flight is waited for rather than sent twice.
        """
        path = path or handle.path
        if isinstance(requests, RunBatch) and requests.dest_offsets is None and isinstance(handle, _ReadHandle) \
                and handle.blocks:
            rest = self._cache.read_runs(handle.blocks, requests.offsets, requests.run_bytes, requests.dest, path)
            self._count("cache_hits", len(requests) - len(rest))
            if len(rest) == 0:
                return
            requests = [requests[int(i)] for i in rest]
        views = [(o, b.cast("B") if b.format != "B" or b.ndim != 1 else b) for o, b in requests if len(b)]
        todo: List[Tuple[int, memoryview]] = []
        hits: List[Tuple[int, memoryview, Any]] = []
        parallel = getattr(self.fs, "async_impl", False)
        blocks = handle.blocks if isinstance(handle, _ReadHandle) else None
        futures: List[Tuple[int, int, List[int], "Future[Any]"]] = []
        with self._cache.lock:  # look up, plan and register at once: a concurrent batch waits for our GETs
            for off, b in views:
                found = self._cache.covering(blocks, off, len(b)) if blocks else None
                if found is None:
                    todo.append((off, b))
                else:
                    hits.append((off, b, found))
            groups = self.plan_reads([(o, len(b)) for o, b in todo])
            if groups and parallel:
                for start, end, members in groups:
                    fut = self.submit("read", path, self._ranged_get(handle, path, start, end))
                    useful = sum(len(todo[i][1]) for i in members)
                    if useful < end - start and blocks is not None:  # gap bytes fetched: keep for a later request
                        self._cache.keep(blocks, start, end, fut)
                    futures.append((start, end, members, fut))

        def scatter(start: int, end: int, members: List[int], data: bytes) -> None:
            if len(data) != end - start:
                raise DataLossError(f"unexpected end of object at offset {start + len(data)} "
                                    f"(wanted {end - start - len(data)} more bytes)", path=path)
            mv = memoryview(data)
            for i in members:
                o, b = todo[i]
                b[:] = mv[o - start:o - start + len(b)]

        if not parallel:
            for start, end, members in groups:
                data = self.call("read", path, self.fs.cat_file, path, start=start, end=end)
                self._count("bytes_read", len(data))
                self._count("read_requests", 1)
                scatter(start, end, members, data)
        error: Optional[BaseException] = None
        for start, end, members, fut in futures:
            try:
                data = fut.result()
                if error is None:
                    scatter(start, end, members, data)
            except BaseException as exc:
                error = error or exc
        for off, b, found in hits:
            try:
                assert blocks is not None
                self._cache.fill(blocks, found, off, b, path)
                self._count("cache_hits", 1)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    # -- writing -----------------------------------------------------------------
    def open_write(self, path: str) -> Any:
        if self._is_s3():
            return _Upload(self, path)
        return _FileWriter(self, path)

    def create_exclusive(self, path: str) -> Any:
        """Like :meth:`open_write`, but the object is created only if none has this name.

        Closing the handle raises :class:`~shardckpt.errors.AbortedError` when another
        writer created the name first; ``handle.etag`` is the object's ETag once closed.
        """
        if not self._is_s3():
            raise self.unsupported("conditional writes", path)
        return _Upload(self, path, exclusive=True)

    def remove_if(self, path: str, etag: str) -> bool:
        """Delete the object only if its ETag is ``etag`` (what we wrote); whether it was deleted."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.call("delete", path, self.fs.call_s3, "delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        except (NotFoundError, AbortedError):
            return False
        return True

    def list_details(self, path: str) -> Dict[str, Dict[str, Any]]:
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
            out: Dict[str, Dict[str, Any]] = {}
            for e in entries:
                if e.get("type") != "directory":
                    modified = e.get("LastModified") or e.get("mtime") or e.get("updated") or e.get("created")
                    mtime = modified.timestamp() if hasattr(modified, "timestamp") else None
                    out[posixpath.basename(e["name"].rstrip("/"))] = {"size": e.get("size"), "etag": e.get("ETag"),
                                                                      "mtime": mtime}
            return out
        bucket, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        found: Dict[str, Dict[str, Any]] = {}
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

    def list_uploads(self, path: str) -> List[Tuple[str, str, float]]:
        """Incomplete multipart uploads of objects directly under ``path``: ``(object path, upload id, started)``."""
        if not self._is_s3():
            return []
        bucket, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        found: List[Tuple[str, str, float]] = []
        kwargs: Dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            resp = self.call("list uploads", path, self.fs.call_s3, "list_multipart_uploads", **kwargs)
            for u in resp.get("Uploads") or []:
                name = u["Key"][len(prefix):]
                if "/" in name:
                    continue
                started = u.get("Initiated")
                found.append((f"{self.protocol}://{bucket}/{u['Key']}", u["UploadId"],
                              started.timestamp() if hasattr(started, "timestamp") else 0.0))
            if not resp.get("IsTruncated"):
                return found
            kwargs["KeyMarker"] = resp.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = resp.get("NextUploadIdMarker")

    def upload_activity(self, path: str, upload_id: str) -> float:
        """When the upload last made progress: its newest part's time (0.0 without parts); POSIX seconds."""
        bucket, key, _ = self.fs.split_path(path)
        latest = 0.0
        kwargs: Dict[str, Any] = {"Bucket": bucket, "Key": key, "UploadId": upload_id}
        while True:
            try:
                resp = self.call("list parts", path, self.fs.call_s3, "list_parts", **kwargs)
            except NotFoundError:
                return latest
            for part in resp.get("Parts") or []:
                when = part.get("LastModified")
                if hasattr(when, "timestamp"):
                    latest = max(latest, when.timestamp())
            if not resp.get("IsTruncated"):
                return latest
            kwargs["PartNumberMarker"] = resp.get("NextPartNumberMarker")

    def abort_upload(self, path: str, upload_id: str) -> None:
        """Abort one incomplete multipart upload (gone already is fine)."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.call("abort upload", path, self.fs.call_s3, "abort_multipart_upload", Bucket=bucket, Key=key,
                      UploadId=upload_id)
        except NotFoundError:
            pass

    def write_all(self, handle: Any, buf: memoryview, path: str = "") -> None:
        handle.write(buf)

    def fsync(self, handle: Any, path: str = "") -> None:
        """Nothing to do: an object is durable once its upload completes (``close``)."""

    def close(self, handle: Any) -> None:
        """Complete the upload; the object appears now (raises if it cannot)."""
        if isinstance(handle, _ReadHandle):
            self._cache.drop(handle.blocks)
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

    def _check_bucket(self, path: str) -> None:
        """Raise :class:`~shardckpt.errors.NotFoundError` when the bucket of ``path`` does not exist.

        A negative answer ("no such object", an empty listing) is only trusted once the
        bucket is known to exist (checked once per bucket; an unreachable store raises
        :class:`~shardckpt.errors.StorageError` after the retries).
        """
        if not self._is_s3():
            return
        bucket = self.fs.split_path(path)[0]
        if not bucket or bucket in self._buckets_seen:
            return
        try:
            self.call("check bucket", path, self.fs.call_s3, "head_bucket", Bucket=bucket)
        except NotFoundError:
            raise NotFoundError(f"bucket does not exist: {bucket!r}", path=path) from None
        except StorageError as exc:
            if _s3_code(exc.__cause__ or exc)[1] != 403:
                raise  # unreachable, throttled past the retries, ...
            # 403: credentials that may read objects but not the bucket itself; the bucket exists
        self._buckets_seen.add(bucket)

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

    def unsupported(self, what: str, path: str) -> UnsupportedError:
        return UnsupportedError(f"{what} is not supported on {self.protocol}://", path=path)
