"""Reading objects: ranged GETs planned with a cost model, in parallel, announced ahead.

Neighbouring ranges are merged when the gap costs less to download than a request
(``read_latency`` seconds vs ``read_bandwidth`` bytes/s, :meth:`RangedReads.plan_reads`),
the requests run in parallel, and the gap bytes of a merged request are kept on the open
handle (a bounded budget, ``read_cache``) so a later request for them is served without a
GET. A reader that knows what it will read announces it (:meth:`RangedReads.prefetch`):
the ranges of every tensor of a restore are planned together into few large GETs sent
ahead of the reads, each kept until its bytes have been read (:mod:`.readahead`). A
handle pinned to a version (:mod:`.fsspec_identity`) sends ``If-Match`` with every GET.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..errors import CheckpointReplacedError, DataLossError
from .base import RunBatch
from .fsspec_errors import is_precondition_failed
from .fsspec_requests import StoreRequests
from .readahead import Blocks, plan_spans

__all__ = ["RangedReads", "ObjectReadHandle"]


class ObjectReadHandle:
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



class RangedReads(StoreRequests):
    """Ranged, planned and announced reads (part of :class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem`)."""

    def open_read(self, path: str) -> ObjectReadHandle:
        return ObjectReadHandle(path)

    def size(self, path: str) -> int:
        return int(self.call("stat", path, self.fs.size, path))

    def read_bytes(self, path: str) -> bytes:
        data = self.call("read", path, self.fs.cat_file, path)
        self._count("bytes_read", len(data))
        self._count("read_requests", 1)
        return bytes(data)

    def _ranged_get(self, handle: Any, path: str, start: int, end: int) -> Callable[[], Any]:
        """A coroutine factory: one GET of bytes ``[start, end)`` (``If-Match`` when the handle is pinned)."""
        etag = handle.etag if isinstance(handle, ObjectReadHandle) else None

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
        if isinstance(handle, ObjectReadHandle) and handle.blocks \
                and self._cache.read(handle.blocks, offset, buf, path):
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
        if not self.prefetches or not isinstance(handle, ObjectReadHandle):
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
        if isinstance(requests, RunBatch) and requests.dest_offsets is None and isinstance(handle, ObjectReadHandle) \
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
        blocks = handle.blocks if isinstance(handle, ObjectReadHandle) else None
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
