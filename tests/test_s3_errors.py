"""Object stores: one retry layer, errors that keep the HTTP status and S3 code, and a missing bucket or
an unreachable store never read as "no checkpoint yet" (issue 16, defects 8 and 9)."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

import numpy as np
import pytest

import shardckpt
from shardckpt.errors import NotFoundError, StorageError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from s3_faults import FaultProxy, configured  # noqa: E402  (tests/helpers)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_resets_are_retried_by_one_layer_only(s3_server: Any) -> None:
    prefix = s3_server.url(f"reset-{uuid.uuid4().hex[:8]}", "ck")
    shardckpt.save_tensors(prefix, {"a": np.arange(4.0)})
    with FaultProxy(s3_server.endpoint, reset=True, match=lambda m, p: m == "GET" and ".data-" in p) as proxy, \
            configured(proxy.endpoint, retries=4, backoff=0.01):
        with shardckpt.load_checkpoint(prefix) as reader:  # index fetched; keep-alive connections now warm
            proxy.fail_next(10**9)
            with pytest.raises(StorageError, match="after 4 attempts") as info:
                reader.get_tensor("a")
        assert "ck.data-00000-of-00001" in str(info.value)
        gets = [r for r in proxy.requests if r.startswith("GET") and ".data-" in r]
        assert len(gets) == proxy.failed == 4, proxy.requests  # aiohttp's own resend would make it 8


def test_a_503_keeps_its_status_and_code_in_the_message(s3_server: Any) -> None:
    prefix = s3_server.url(f"slow-{uuid.uuid4().hex[:8]}", "ck")
    shardckpt.save_tensors(prefix, {"a": np.arange(4.0)})
    with FaultProxy(s3_server.endpoint, status=503, code="SlowDown",
                    match=lambda m, p: m == "GET" and ".data-" in p) as proxy, \
            configured(proxy.endpoint, retries=2, backoff=0.01):
        with shardckpt.load_checkpoint(prefix) as reader:
            proxy.fail_next(10**9)
            with pytest.raises(StorageError, match=r"after 2 attempts: HTTP 503 SlowDown"):
                reader.get_tensor("a")


def test_latest_checkpoint_in_a_missing_bucket_is_not_found_not_none(s3_server: Any) -> None:
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(NotFoundError, match="bucket does not exist"):
        shardckpt.latest_checkpoint(missing)
    v = shardckpt.Variable(np.zeros(3, np.float32))
    with pytest.raises(NotFoundError, match="bucket does not exist"):
        manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=v), missing, max_to_keep=1,
                                              init_fn=lambda: pytest.fail("started from scratch"))
        manager.restore_or_initialize()
    # an existing bucket with nothing in it: "no checkpoint yet" is the true answer
    assert shardckpt.latest_checkpoint(s3_server.url(f"empty-{uuid.uuid4().hex[:8]}")) is None


def test_latest_checkpoint_on_an_unreachable_store_is_a_storage_error(s3_server: Any) -> None:
    with configured(f"http://127.0.0.1:{_free_port()}", retries=2, backoff=0.01):
        with pytest.raises(StorageError) as info:
            shardckpt.latest_checkpoint(s3_server.url("run"))
        assert not isinstance(info.value, NotFoundError)
        assert "after 2 attempts" in str(info.value)
