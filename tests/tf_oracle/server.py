"""TensorFlow oracle server: run under the TF interpreter, speaks JSON lines on stdin/stdout.

Each request is one JSON object per line; each reply is one JSON line, either
``{"ok": true, ...}`` or ``{"ok": false, "error_type": ..., "error": ...}``.
File descriptor 1 is redirected to stderr before TensorFlow is imported, so nothing
but replies can ever reach the real stdout.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

# Keep the real stdout for replies; everything else written to fd 1 goes to stderr.
_REPLY = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from tensorfile import read_tensors, tf_name, write_tensors  # the script's directory is on sys.path

# DTensor needs its logical CPUs configured before any other TF op: a server started with
# SHARDCKPT_TF_LOGICAL_CPUS=N splits the CPU into N logical devices at start-up.
_LOGICAL_CPUS = int(os.environ.get("SHARDCKPT_TF_LOGICAL_CPUS", "0") or 0)
if _LOGICAL_CPUS > 1:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * _LOGICAL_CPUS
    )

Request = dict[str, Any]


def _to_tensor(arr: np.ndarray, dtype_name: str) -> tf.Tensor:
    return tf.constant(arr, dtype=tf.dtypes.as_dtype(dtype_name))


def _to_numpy(value: Any, dtype: tf.DType) -> np.ndarray:
    """Convert a TF tensor / reader result to an ndarray (scalar strings come back as bytes)."""
    if isinstance(value, tf.Tensor):
        value = value.numpy()
    if dtype == tf.string:
        return np.asarray(value, dtype=object)
    return np.asarray(value)


def op_save_v2(req: Request) -> Request:
    entries = read_tensors(req["tensors_dir"])
    tf.raw_ops.SaveV2(
        prefix=req["prefix"],
        tensor_names=[name for name, _, _ in entries],
        shape_and_slices=[spec for _, _, spec in entries],
        tensors=[_to_tensor(arr, tf_name(arr.dtype)) for _, arr, _ in entries],
    )
    return {}


def op_load_checkpoint(req: Request) -> Request:
    reader = tf.train.load_checkpoint(req["path"])
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    tensors: dict[str, np.ndarray] = {}
    errors: dict[str, str] = {}
    for key in sorted(shapes):
        try:
            tensors[key] = _to_numpy(reader.get_tensor(key), dtypes[key])
        except Exception as e:  # noqa: BLE001  TF cannot reassemble some sliced dtypes
            errors[key] = f"{type(e).__name__}: {e}"
    write_tensors(req["out_dir"], tensors)
    return {
        "errors": errors,
        "dtypes": {k: d.name for k, d in dtypes.items()},
        "shapes": {k: list(s) for k, s in shapes.items()},
    }


def op_restore_v2(req: Request) -> Request:
    dtypes = [tf.dtypes.as_dtype(d) for d in req["dtypes"]]
    results = tf.raw_ops.RestoreV2(
        prefix=req["prefix"],
        tensor_names=req["names"],
        shape_and_slices=req["slices"],
        dtypes=dtypes,
    )
    write_tensors(
        req["out_dir"],
        [(n, _to_numpy(t, d), s) for n, t, d, s in zip(req["names"], results, dtypes, req["slices"], strict=True)],
    )
    return {}


def op_merge_v2(req: Request) -> Request:
    tf.raw_ops.MergeV2Checkpoints(
        checkpoint_prefixes=req["prefixes"],
        destination_prefix=req["dest"],
        delete_old_dirs=req.get("delete_old_dirs", True),
        allow_missing_files=req.get("allow_missing_files", False),
    )
    return {}


def op_exec(req: Request) -> Request:
    namespace: dict[str, Any] = {
        "tf": tf,
        "np": np,
        "json": json,
        "os": os,
        "write_tensors": write_tensors,
        "read_tensors": read_tensors,
    }
    exec(req["code"], namespace)  # noqa: S102  trusted test code
    return {"result": namespace.get("result")}


def op_probe(req: Request) -> Request:
    """Like ``exec``, but an exception is part of the answer: ``{"result": ..., "error": null}`` or
    ``{"result": null, "error": {"type": name, "bases": [names of its classes, most derived first],
    "message": str}}`` — so tests can compare exception classes with shardckpt's."""
    namespace: dict[str, Any] = {"tf": tf, "np": np, "json": json, "os": os}
    try:
        exec(req["code"], namespace)  # noqa: S102  trusted test code
    except Exception as e:  # noqa: BLE001  the exception is the answer
        return {"result": None,
                "error": {"type": type(e).__name__, "bases": [c.__name__ for c in type(e).__mro__],
                          "message": str(e)}}
    return {"result": namespace.get("result"), "error": None}


def op_ping(req: Request) -> Request:
    return {"tf_version": tf.__version__}


OPS: dict[str, Callable[[Request], Request]] = {
    "save_v2": op_save_v2,
    "load_checkpoint": op_load_checkpoint,
    "restore_v2": op_restore_v2,
    "merge_v2": op_merge_v2,
    "exec": op_exec,
    "probe": op_probe,
    "ping": op_ping,
}


def handle(line: str) -> tuple[str, bool]:
    """Run one request line; return the JSON reply line and whether to stop. Never raises."""
    try:
        req = json.loads(line)
        op = req["op"]
        if op == "quit":
            return json.dumps({"ok": True}), True
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}")
        return json.dumps({"ok": True, **OPS[op](req)}), False
    except Exception as e:  # noqa: BLE001  any failure becomes an error reply
        traceback.print_exc(file=sys.stderr)
        return json.dumps({"ok": False, "error_type": type(e).__name__, "error": str(e)}), False


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        reply, stop = handle(line)
        _REPLY.write(reply + "\n")
        _REPLY.flush()
        if stop:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
