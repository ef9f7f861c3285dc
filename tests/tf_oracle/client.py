"""Client for the TensorFlow oracle: one persistent TF subprocess speaking JSON lines.

TensorFlow lives in a separate interpreter (see :func:`find_tf_python`); tensors are
exchanged through temporary directories in the :mod:`tensorfile` format.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from .tensorfile import read_tensors, write_tensors

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["OracleDied", "OracleError", "TFOracle", "find_tf_python"]

TF_PYTHON_ENV = "SHARDCKPT_TF_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).resolve().with_name("server.py")
DEFAULT_TIMEOUT = 300.0


class OracleError(Exception):
    """An op failed inside the TF server (the server itself is still alive)."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message


class OracleDied(RuntimeError):
    """The TF server exited, timed out or produced garbage."""


def find_tf_python(repo_root: Path | None = None) -> str:
    """Return the TF interpreter: ``$SHARDCKPT_TF_PYTHON``, else ``<repo>/.venv-tf/bin/python``.

    Raises RuntimeError if neither exists: a missing oracle is a failure, never a skip.
    """
    env = os.environ.get(TF_PYTHON_ENV)
    if env:
        if not os.path.isfile(env):
            raise RuntimeError(f"{TF_PYTHON_ENV}={env!r} does not exist; point it at a Python with TensorFlow")
        return env
    candidate = (repo_root or REPO_ROOT) / ".venv-tf" / "bin" / "python"
    if candidate.is_file():
        return str(candidate)
    raise RuntimeError(
        f"TensorFlow oracle interpreter not found: {TF_PYTHON_ENV} is unset and {candidate} does not exist. "
        "Run the test command (bash scripts/test.sh), which creates .venv-tf, or set "
        f"{TF_PYTHON_ENV} to a Python that has tensorflow installed."
    )


class TFOracle:
    """A persistent TensorFlow subprocess answering checkpoint requests.

    Use as a context manager, or call :meth:`close`. Not re-entrant; calls are serialised.
    """

    def __init__(self, tf_python: str | None = None, timeout: float = DEFAULT_TIMEOUT, logical_cpus: int = 0) -> None:
        """Start the server; ``logical_cpus > 1`` splits its CPU into that many logical devices (for DTensor)."""
        tf_python = tf_python or find_tf_python()
        self.timeout = timeout
        self._tmp = Path(tempfile.mkdtemp(prefix="shardckpt-tf-oracle-"))
        self._log_path = self._tmp / "server.stderr.log"
        self._log: IO[bytes] = open(self._log_path, "wb")  # noqa: SIM115  lives as long as the server
        self._lock = threading.Lock()
        self._lines: queue.Queue[str | None] = queue.Queue()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1", PYTHONUNBUFFERED="1",
                   SHARDCKPT_TF_LOGICAL_CPUS=str(logical_cpus))
        self._proc = subprocess.Popen(
            [tf_python, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            encoding="utf-8",
            env=env,
        )
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        try:
            self.tf_version: str = self.request({"op": "ping"})["tf_version"]
        except BaseException:
            self.close()
            raise

    # -- transport ---------------------------------------------------------------------------

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the server is gone

    def _stderr_tail(self, limit: int = 4000) -> str:
        self._log.flush()
        try:
            return self._log_path.read_text(encoding="utf-8", errors="replace")[-limit:]
        except OSError:
            return "<no stderr log>"

    def _die(self, why: str) -> OracleDied:
        self._proc.kill()
        self._proc.wait()
        return OracleDied(f"TF oracle {why} (exit code {self._proc.returncode}); stderr tail:\n{self._stderr_tail()}")

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the reply; raise OracleError if the op failed."""
        with self._lock:
            if self._proc.poll() is not None:
                raise self._die("is not running")
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps(req) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise self._die("closed its input") from None
            try:
                line = self._lines.get(timeout=self.timeout)
            except queue.Empty:
                raise self._die(f"timed out after {self.timeout}s on op {req.get('op')!r}") from None
            if line is None:
                raise self._die(f"died during op {req.get('op')!r}")
            try:
                reply: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                raise self._die(f"sent a non-JSON line {line[:200]!r}") from None
        if not reply.get("ok"):
            raise OracleError(reply.get("error_type", "?"), reply.get("error", ""))
        return reply

    def _exchange_dir(self) -> str:
        return tempfile.mkdtemp(dir=self._tmp)

    # -- ops ---------------------------------------------------------------------------------

    def save_v2(
        self, prefix: str | os.PathLike[str], names: Sequence[str], slices: Sequence[str], arrays: Sequence[Any]
    ) -> None:
        """Write a bundle with ``tf.raw_ops.SaveV2`` (names may repeat with different slices)."""
        if not len(names) == len(slices) == len(arrays):
            raise ValueError("names, slices and arrays must have the same length")
        d = self._exchange_dir()
        try:
            write_tensors(d, list(zip(names, arrays, slices, strict=True)))
            self.request({"op": "save_v2", "prefix": os.fspath(prefix), "tensors_dir": d})
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def load_checkpoint(
        self, path: str | os.PathLike[str]
    ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
        """Read every key via ``tf.train.load_checkpoint``.

        Returns ``(tensors, errors, dtypes)``: arrays of the keys TF could read, error messages
        of the keys it could not, and the TF dtype name of every key.
        """
        d = self._exchange_dir()
        try:
            reply = self.request({"op": "load_checkpoint", "path": os.fspath(path), "out_dir": d})
            tensors = {name: arr for name, arr, _ in read_tensors(d)}
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return tensors, reply["errors"], reply["dtypes"]

    def restore_v2(
        self, prefix: str | os.PathLike[str], names: Sequence[str], slices: Sequence[str], dtypes: Sequence[str]
    ) -> list[np.ndarray]:
        """Read tensors (or slices) with ``tf.raw_ops.RestoreV2``; ``dtypes`` are TF dtype names."""
        d = self._exchange_dir()
        try:
            self.request(
                {
                    "op": "restore_v2",
                    "prefix": os.fspath(prefix),
                    "names": list(names),
                    "slices": list(slices),
                    "dtypes": list(dtypes),
                    "out_dir": d,
                }
            )
            return [arr for _, arr, _ in read_tensors(d)]
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def merge_v2(
        self,
        prefixes: Sequence[str | os.PathLike[str]],
        dest: str | os.PathLike[str],
        delete_old_dirs: bool = True,
        allow_missing_files: bool = False,
    ) -> None:
        """Merge per-shard bundles with ``tf.raw_ops.MergeV2Checkpoints``."""
        self.request(
            {
                "op": "merge_v2",
                "prefixes": [os.fspath(p) for p in prefixes],
                "dest": os.fspath(dest),
                "delete_old_dirs": delete_old_dirs,
                "allow_missing_files": allow_missing_files,
            }
        )

    def exec(self, code: str) -> Any:
        """Exec ``code`` in the server (``tf``, ``np``, ``json``, ``os``, ``write_tensors``,
        ``read_tensors`` predefined) and return its JSON-serialisable ``result`` variable."""
        return self.request({"op": "exec", "code": code})["result"]

    def probe(self, code: str) -> dict[str, Any]:
        """Exec ``code`` in the server; return ``{"result": ..., "error": None}`` or, when it raised,
        ``{"result": None, "error": {"type", "bases", "message"}}`` (the exception is an answer, not a failure)."""
        reply = self.request({"op": "probe", "code": code})
        return {"result": reply["result"], "error": reply["error"]}

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the server and remove the exchange directory. Idempotent."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass  # broken pipe while flushing to a dead server
        self._pump_thread.join(timeout=5)
        if self._proc.stdout is not None and not self._pump_thread.is_alive():
            self._proc.stdout.close()
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
