"""Writing objects: streamed multipart uploads (S3), fsspec's own file objects elsewhere.

On S3 an object larger than ``multipart_threshold`` is a multipart upload whose parts
(``part_size`` bytes, filled straight from the tensors) are uploaded while the next part
fills, up to ``max_concurrency`` parts in flight per store; a smaller one is buffered
and sent with one PUT. No more than the threshold is ever buffered. The object appears
only when the upload completes (``close``); ``discard`` aborts it. An *exclusive*
upload (:meth:`Uploads.create_exclusive`) is completed with ``If-None-Match: *``: it
never replaces another writer's object. Incomplete uploads of a killed save are listed
and aborted by the next save (:meth:`Uploads.list_uploads`, ``upload_activity``,
``abort_upload``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Tuple

from ..errors import NotFoundError
from .fsspec_conditional import ConditionalWrites, md5_etag, multipart_etag
from .object_store import PendingUpload

__all__ = ["Uploads", "Upload", "FileWriter"]

_log = logging.getLogger("shardckpt")


class Upload:
    """One S3 object written as a streamed multipart upload (a single PUT when small).

    ``exclusive``: the object is created only if no object has its name (``If-None-Match: *``);
    a lost race raises :class:`~shardckpt.errors.AbortedError`. ``etag`` is set once complete.
    """

    def __init__(self, owner: "Uploads", path: str, exclusive: bool = False) -> None:
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
                    lambda: owner.holds_etag(self.path, md5_etag(body)))  # MD5 only when in doubt
                etag = resp.get("ETag") if isinstance(resp, dict) else None
                self.etag = str(etag) if etag else md5_etag(body)
                owner.count_write(len(body))
            else:
                if self.buf:
                    self._send_part()
                parts = []
                for number, fut in self.futures:
                    parts.append({"PartNumber": number, "ETag": fut.result()["ETag"]})
                expected = multipart_etag([p["ETag"] for p in parts])
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


class FileWriter:
    """Writes through the store's own fsspec file object (stores other than S3)."""

    def __init__(self, owner: "Uploads", path: str) -> None:
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



class Uploads(ConditionalWrites):
    """Opening uploads, cleaning up incomplete ones (part of :class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem`)."""

    def open_write(self, path: str) -> Any:
        if self._is_s3():
            return Upload(self, path)
        return FileWriter(self, path)

    def create_exclusive(self, path: str) -> Any:
        """Like :meth:`open_write`, but the object is created only if none has this name.

        Closing the handle raises :class:`~shardckpt.errors.AbortedError` when another
        writer created the name first; ``handle.etag`` is the object's ETag once closed.
        """
        if not self._is_s3():
            raise self.unsupported("conditional writes", path)
        return Upload(self, path, exclusive=True)

    def written_etag(self, handle: Any) -> Optional[str]:
        """The ETag of the object ``handle`` created, once closed (``None`` for other stores' writers)."""
        etag = handle.etag if isinstance(handle, Upload) else None
        return str(etag) if etag else None

    def list_uploads(self, path: str) -> List[PendingUpload]:
        """Incomplete multipart uploads of objects directly under ``path`` (none on stores other than S3)."""
        if not self._is_s3():
            return []
        bucket, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        found: List[PendingUpload] = []
        kwargs: Dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            resp = self.call("list uploads", path, self.fs.call_s3, "list_multipart_uploads", **kwargs)
            for u in resp.get("Uploads") or []:
                name = u["Key"][len(prefix):]
                if "/" in name:
                    continue
                started = u.get("Initiated")
                found.append(PendingUpload(f"{self.protocol}://{bucket}/{u['Key']}", u["UploadId"],
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
