"""Object stores: a write whose reply is lost is reported truthfully (issue 16, defect 6).

The reply of a request is dropped after the server applied it (a botocore ``after-call``
hook raises ``ConnectionClosedError``, see tests/helpers/s3_faults.py). The save must
report committed exactly when our index is in the store, and clean up after itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

import shardckpt
from shardckpt.errors import StorageError
from shardckpt.storage import get_fs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from s3_faults import FaultProxy, LostReplies, configured  # noqa: E402  (tests/helpers)


def _key(path: str) -> str:
    return path.split("/", 3)[3]


def _names(directory: str) -> list:
    return get_fs(directory).listdir(directory)


def test_index_put_whose_reply_is_lost_reports_committed_and_cleans_old_objects(s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, {"a": np.arange(10.0)})
    new = {"a": np.arange(10.0) * 2, "b": np.ones(3, np.int32)}
    index_key = _key(prefix + ".index")
    with LostReplies("PutObject", lambda p: p.get("Key") == index_key, times=1) as lost:
        shardckpt.save_tensors(prefix, new)  # no error: the index is ours (the retry's 412 is explained)
    assert lost.lost == 1
    assert _names(s3dir) == ["ck.data-00000-of-00002", "ck.data-00001-of-00002", "ck.index"]  # old count gone
    with shardckpt.load_checkpoint(prefix) as reader:
        np.testing.assert_array_equal(reader.get_tensor("a"), new["a"])


def test_index_put_whose_every_reply_is_lost_still_reports_the_truth(s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    index_key = _key(prefix + ".index")
    with configured(os.environ["AWS_ENDPOINT_URL"], backoff=0.01), \
            LostReplies("PutObject", lambda p: p.get("Key") == index_key, times=100) as lost:
        shardckpt.save_tensors(prefix, {"a": np.arange(5)})  # fresh prefix: If-None-Match, landed the first time
        assert lost.lost == get_fs(prefix).retries
    with shardckpt.load_checkpoint(prefix) as reader:
        np.testing.assert_array_equal(reader.get_tensor("a"), np.arange(5))


def test_index_put_that_never_lands_reports_not_committed(s3_server: Any, s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, {"a": np.arange(10.0)})
    with FaultProxy(s3_server.endpoint, match=lambda m, p: m == "PUT" and p.split("?")[0].endswith("/ck.index")) \
            as proxy, configured(proxy.endpoint, retries=3, backoff=0.01):
        proxy.fail_next(10**9)
        with pytest.raises(StorageError, match=r"HTTP 503 ServiceUnavailable") as info:
            shardckpt.save_tensors(prefix, {"a": np.zeros(10)})
        assert "ck.index" in str(info.value) and "after 3 attempts" in str(info.value)
        assert proxy.failed == 3
    assert _names(s3dir) == ["ck.data-00000-of-00001", "ck.index"]  # this save's objects removed
    with shardckpt.load_checkpoint(prefix) as reader:
        np.testing.assert_array_equal(reader.get_tensor("a"), np.arange(10.0))


def test_data_object_whose_reply_is_lost_is_recognised_as_ours(s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    data_key = _key(prefix + ".data-00000-of-00001")
    with LostReplies("PutObject", lambda p: p.get("Key") == data_key, times=1) as lost:
        shardckpt.save_tensors(prefix, {"a": np.arange(7)})  # the retry's If-None-Match 412: the ETag is ours
    assert lost.lost == 1
    with shardckpt.load_checkpoint(prefix) as reader:
        np.testing.assert_array_equal(reader.get_tensor("a"), np.arange(7))


def test_completed_upload_whose_reply_is_lost_is_recognised_as_ours(s3dir: str) -> None:
    prefix = f"{s3dir}/big"
    big = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)  # 12 MiB: multipart
    with configured(os.environ["AWS_ENDPOINT_URL"], part_size=5 << 20, multipart_threshold=5 << 20):
        with LostReplies("CompleteMultipartUpload", times=1) as lost:
            shardckpt.save_tensors(prefix, {"big": big})
        assert lost.lost == 1
        with shardckpt.load_checkpoint(prefix) as reader:
            np.testing.assert_array_equal(reader.get_tensor("big"), big)


def test_state_file_whose_reply_is_lost_reports_success(s3dir: str) -> None:
    v = shardckpt.Variable(np.zeros(4, np.float32))
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=v), s3dir, max_to_keep=2)
    manager.save()
    v.assign(np.ones(4, np.float32))
    state_key = _key(f"{s3dir}/checkpoint")
    with configured(os.environ["AWS_ENDPOINT_URL"], backoff=0.01), \
            LostReplies("PutObject", lambda p: p.get("Key") == state_key, times=100) as lost:
        path = manager.save()  # every reply lost, yet the store holds our state file: success
        assert lost.lost == get_fs(s3dir).retries
    assert shardckpt.latest_checkpoint(s3dir) == path == f"{s3dir}/ckpt-2"
