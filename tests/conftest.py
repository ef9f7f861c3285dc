"""Shared fixtures.

``tf_oracle`` is one TensorFlow subprocess for the whole test session. A missing TF
interpreter is an error, never a skip: :func:`tf_oracle.client.find_tf_python`
raises a RuntimeError that says how to get one (``SHARDCKPT_TF_PYTHON`` or
``.venv-tf``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tf_oracle.client import TFOracle


@pytest.fixture(scope="session")
def tf_oracle() -> Iterator[TFOracle]:
    """One TF oracle server shared by every test of the run; closed at the end."""
    oracle = TFOracle()  # raises (fails the test) when the TF interpreter is missing
    try:
        yield oracle
    finally:
        oracle.close()


@pytest.fixture(scope="session")
def tf_fixtures_dir() -> Path:
    """``tests/data/tf_fixtures``: checkpoints written by TensorFlow 2.21, with expected values."""
    return Path(__file__).parent / "data" / "tf_fixtures"


# -- object stores: a real S3-protocol server (moto's standalone server) on loopback --------


class S3Server:
    """A running moto server: ``endpoint``, the ``bucket`` made for the session, ``env`` for clients."""

    def __init__(self, endpoint: str, bucket: str, env: dict) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.env = env

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join((self.bucket,) + parts)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """Start ``python -m moto.server`` on a free loopback port, create a bucket, point S3 clients at it.

    Clients are configured the way users configure them: the standard AWS variables
    (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...) in ``os.environ``, inherited by
    client subprocesses.
    """
    import os
    import subprocess

    from helpers.s3_moto import client_env, start_moto

    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc, endpoint = start_moto(log)
    env = client_env(endpoint)
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        import shardckpt.storage as storage

        storage.reset()
        bucket = "shardckpt-test"
        storage.get_fs("s3://" + bucket).fs.mkdir(bucket)
        yield S3Server(endpoint, bucket, env)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            import shardckpt.storage as storage

            storage.reset()
        except Exception:
            pass
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def s3dir(s3_server: "S3Server", request: pytest.FixtureRequest) -> str:
    """A fresh 'folder' in the session's bucket, named after the test module."""
    import uuid

    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return s3_server.url(f"{module}-{uuid.uuid4().hex[:12]}")


# -- process state: a new runtime per test -------------------------------------------------


@pytest.fixture
def fresh_runtime() -> Iterator[object]:
    """A new, empty process runtime (:func:`shardckpt.runtime.reset`) for the test, and another after it.

    Coordinators, savers, stagers, scrubbers and save numbers made by the test are then its
    own: none leaks into the next test, none of an earlier test's is reused. Registrations
    (stagers and holders by type) are kept, as imports make them only once.
    """
    from shardckpt import runtime

    yield runtime.reset()
    runtime.reset()
