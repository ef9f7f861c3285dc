"""Requests to an object store, retried in one layer: ours.

Every request goes through :meth:`StoreRequests.call` (or :meth:`~StoreRequests.submit`
for coroutines on fsspec's event loop): transient errors (:mod:`.fsspec_errors`) are
retried with exponential backoff and jitter, ``retries`` attempts in all; botocore's
retries are off and aiohttp's silent resend on a reset keep-alive connection is
disabled (:func:`no_resend_session_cls`), so "after 4 attempts" means 4 requests.
Errors leave as :mod:`shardckpt.errors` naming the object, the HTTP status and the S3
code. Writes go through :meth:`~StoreRequests.write_call`, which resolves an ambiguous
failure by asking the store whether our bytes landed. The request counters
(``stats``) and the bucket check (a negative answer is trusted only once the bucket is
known to exist) live here too: every concern of the store builds on this class.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Set

from ..errors import AbortedError, NotFoundError, ShardckptError, StorageError, UnsupportedError
from .fsspec_errors import (
    MISSING,
    PERMANENT_NAMES,
    TRANSIENT,
    classify,
    describe_error,
    is_precondition_failed,
    no_such_upload,
    s3_code,
)

if TYPE_CHECKING:
    from .readahead import BlockCache

__all__ = ["StoreRequests", "no_resend_session_cls"]

_log = logging.getLogger("shardckpt")


def no_resend_session_cls() -> Any:
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



class StoreRequests:
    """Retried requests, error mapping and counters of one fsspec filesystem (the base of the store's parts).

    The attributes are set by :class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem`.
    """

    #: the fsspec filesystem instance
    fs: Any
    protocol: str
    retries: int
    backoff: float
    max_backoff: float
    part_size: int
    read_part_size: int
    multipart_threshold: int
    max_concurrency: int
    inflight: threading.BoundedSemaphore
    read_latency: float
    read_bandwidth: float
    read_cache: int
    stats: Dict[str, int]
    _stats_lock: threading.Lock
    _buckets_seen: Set[str]
    _cache: "BlockCache"

    def _is_s3(self) -> bool:
        return hasattr(self.fs, "call_s3") and hasattr(self.fs, "split_path")

    # -- retries and errors ----------------------------------------------------

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * (2 ** attempt)) * (0.5 + random.random() / 2)

    def error(self, exc: BaseException, path: str, action: str, attempts: int = 1) -> Exception:
        kind = classify(exc)
        code, status = s3_code(exc)
        detail = describe_error(exc)
        if is_precondition_failed(exc):
            return AbortedError(f"{action}: another writer got there first (a concurrent save to this prefix?) "
                                f"({detail})", path=path)
        if kind == MISSING:
            what = "bucket does not exist" if code == "NoSuchBucket" else "no such object"
            return NotFoundError(f"{action}: {what} ({detail})", path=path)
        if isinstance(exc, PermissionError) or code in ("AccessDenied", "InvalidAccessKeyId",
                                                        "SignatureDoesNotMatch", "ExpiredToken") \
                or type(exc).__name__ in PERMANENT_NAMES:
            return StorageError(f"{action} failed: access denied, check the credentials ({detail})", path=path)
        if kind == TRANSIENT:
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
                if classify(exc) == TRANSIENT and attempt + 1 < self.retries:
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
                if classify(exc) == TRANSIENT and attempt + 1 < self.retries:
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
                refused = is_precondition_failed(exc) or no_such_upload(exc)
                transient = classify(exc) == TRANSIENT and not refused
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
            if s3_code(exc.__cause__ or exc)[1] != 403:
                raise  # unreachable, throttled past the retries, ...
            # 403: credentials that may read objects but not the bucket itself; the bucket exists
        self._buckets_seen.add(bucket)

    def unsupported(self, what: str, path: str) -> UnsupportedError:
        return UnsupportedError(f"{what} is not supported on {self.protocol}://", path=path)
