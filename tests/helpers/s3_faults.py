"""Fault injection against the test S3 server: an HTTP proxy that answers chosen requests with an error
(or resets the connection), store configuration for a block, and lost replies at the botocore layer.

Used by tests/test_object_store.py and tests/test_s3_*.py (imported with tests/helpers on sys.path).
"""

from __future__ import annotations

import http.client
import http.server
import threading
from typing import Any, Callable, List, Optional

from shardckpt.storage import configure, get_fs
from shardckpt.storage.fsspec_fs import FsspecFileSystem


class FaultProxy:
    """An HTTP proxy in front of the S3 server that answers some requests with an error."""

    def __init__(self, upstream: str, status: int = 503, code: str = "ServiceUnavailable",
                 match: Optional[Callable[[str, str], bool]] = None, reset: bool = False,
                 before_fail: Optional[Callable[[str, str], None]] = None) -> None:
        host, port = upstream.replace("http://", "").split(":")
        self.upstream = (host, int(port))
        self.status = status
        self.code = code
        self.match = match or (lambda method, path: True)
        self.reset = reset  # fail by closing the connection without a reply (a reset)
        #: called with (method, path) of each failed request before it is answered (e.g. to SIGKILL the
        #: client process right then: the request is never applied, and the client never learns more)
        self.before_fail = before_fail
        self.requests: List[str] = []  # "METHOD path" of every request seen
        self.remaining = 0
        self.failed = 0
        self.passed = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    body = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            break
                        body += self.rfile.read(size)
                        self.rfile.readline()
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.requests.append(f"{self.command} {self.path}")
                    fail = proxy.remaining > 0 and proxy.match(self.command, self.path)
                    if fail:
                        proxy.remaining -= 1
                        proxy.failed += 1
                    else:
                        proxy.passed += 1
                if fail and proxy.before_fail is not None:
                    proxy.before_fail(self.command, self.path)
                if fail and proxy.reset:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if fail:
                    payload = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{proxy.code}</Code>"
                               f"<Message>injected by the test proxy</Message></Error>").encode()
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("connection", "transfer-encoding", "content-length", "expect")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def fail_next(self, n: int) -> None:
        with self.lock:
            self.remaining = n

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


class configured:
    """Point ``s3://`` at ``endpoint`` (with shardckpt's own options) for a block."""

    def __init__(self, endpoint: str, **options: Any) -> None:
        self.endpoint = endpoint
        self.options = options

    def __enter__(self) -> None:
        configure("s3", endpoint_url=self.endpoint, **self.options)

    def __exit__(self, *_: Any) -> None:
        configure("s3")


class LostReplies:
    """Make the store's client lose the reply of chosen S3 operations: the request reaches the server and
    is applied, then the client raises ``ConnectionClosedError`` as if the connection dropped.

    ``operation``: botocore's name (``"PutObject"``, ``"CompleteMultipartUpload"``); ``match``: a
    predicate on the request's parameters (e.g. the key); ``times``: how many replies to lose.
    """

    def __init__(self, operation: str, match: Callable[[dict], bool] = lambda params: True,
                 times: int = 1) -> None:
        self.operation = operation
        self.match = match
        self.remaining = times
        self.lost = 0
        self.lock = threading.Lock()
        self.client: Any = None

    def _handler(self, http_response: Any = None, parsed: Any = None, model: Any = None, context: Any = None,
                 **kwargs: Any) -> None:
        params = (context or {}).get("shardckpt_params", {})
        with self.lock:
            if self.remaining <= 0 or not self.match(params):
                return
            self.remaining -= 1
            self.lost += 1
        from botocore.exceptions import ConnectionClosedError

        raise ConnectionClosedError(endpoint_url="lost reply (injected by the test)")

    def _remember(self, params: Any = None, context: Any = None, **kwargs: Any) -> None:
        if context is not None and isinstance(params, dict):
            context["shardckpt_params"] = dict(params)

    def __enter__(self) -> "LostReplies":
        store = get_fs("s3://x/y")
        s3 = store.fs  # the s3fs filesystem
        s3.connect()
        self.client = s3.s3
        events = self.client.meta.events
        events.register(f"before-parameter-build.s3.{self.operation}", self._remember)
        events.register(f"after-call.s3.{self.operation}", self._handler)
        return self

    def __exit__(self, *_: Any) -> None:
        events = self.client.meta.events
        events.unregister(f"after-call.s3.{self.operation}", self._handler)
        events.unregister(f"before-parameter-build.s3.{self.operation}", self._remember)


def s3_fs() -> FsspecFileSystem:
    """The S3 filesystem the library uses for ``s3://`` paths (its statistics and settings)."""
    fs = get_fs("s3://x/y")
    assert isinstance(fs, FsspecFileSystem)
    return fs
