"""How a failed request to an object store is told apart: retry it, "no such object", or give up.

:func:`classify` sorts an exception from fsspec / s3fs / botocore / aiohttp into
``"transient"`` (5xx, throttling, timeouts, lost connections: retried by
:mod:`.fsspec_requests`), ``"missing"`` (no such object or bucket) and ``"permanent"``
(credentials, a bad request). S3's error code and HTTP status are read from the
exception chain (:func:`s3_code`); :func:`describe_error` puts them first in messages.
No request is sent here.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Iterator, Optional, Tuple

__all__ = ["TRANSIENT", "MISSING", "PERMANENT", "PERMANENT_NAMES", "classify", "describe_error",
           "is_precondition_failed", "no_such_upload", "s3_code"]

TRANSIENT, MISSING, PERMANENT = "transient", "missing", "permanent"
TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException",
    "BandwidthLimitExceeded", "PriorRequestNotComplete", "OperationAborted",
    "500", "502", "503", "504", "429",
}
MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchUpload"}
TRANSIENT_NAMES = {
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError", "IncompleteRead", "ClientConnectorError",
    "ServerDisconnectedError", "ClientPayloadError", "ClientOSError", "ServerTimeoutError",
    "HTTPClientError", "ConnectionError", "FSTimeoutError", "ResponseParserError",
}
PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                    "NoRegionError", "ParamValidationError"}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = 0
    cur: Optional[BaseException] = exc
    while cur is not None and seen < 8:
        yield cur
        seen += 1
        cur = cur.__cause__ or cur.__context__


def s3_code(exc: BaseException) -> Tuple[Optional[str], Optional[int]]:
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            code = (resp.get("Error") or {}).get("Code")
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return (str(code) if code is not None else None), status
    return None, None


def describe_error(exc: BaseException) -> str:
    """``HTTP 503 SlowDown: OSError: ...``: the status and S3 code first (when known), then the error."""
    code, status = s3_code(exc)
    head = " ".join(x for x in ((f"HTTP {status}" if status else ""), code or "") if x)
    text = f"{type(exc).__name__}: {exc}"
    return f"{head}: {text}" if head else text


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether a conditional request was refused (HTTP 412 / ``PreconditionFailed``)."""
    code, status = s3_code(exc)
    return status == 412 or code in ("PreconditionFailed", "412", "ConditionalRequestConflict")


def no_such_upload(exc: BaseException) -> bool:
    return s3_code(exc)[0] == "NoSuchUpload"



def classify(exc: BaseException) -> str:
    """``"transient"`` (retry), ``"missing"`` (no such object or bucket) or ``"permanent"``."""
    code, status = s3_code(exc)
    if code is not None or status is not None:
        if code in TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return TRANSIENT
        if code in MISSING_CODES or status == 404:
            return MISSING
        return PERMANENT
    for e in _chain(exc):
        name = type(e).__name__
        if name in PERMANENT_NAMES:
            return PERMANENT
        if name in TRANSIENT_NAMES or isinstance(e, (ConnectionError, TimeoutError, socket.timeout,
                                                      asyncio.TimeoutError)):
            return TRANSIENT
    if isinstance(exc, FileNotFoundError):
        return MISSING
    if isinstance(exc, PermissionError):
        return PERMANENT
    if isinstance(exc, OSError) and exc.errno in (errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO)) \
            and any(s in str(exc) for s in ("503", "500", "Slow Down", "Service Unavailable", "Internal")):
        return TRANSIENT
    return PERMANENT

