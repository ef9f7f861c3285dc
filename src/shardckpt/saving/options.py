"""``CheckpointOptions``: how a save or restore runs (``tf.train.CheckpointOptions``)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import InvalidArgumentError
from ..sharding.callback import ShardingCallback

__all__ = ["CheckpointOptions"]

WriteCallback = Callable[..., Any]


def _arity(fn: WriteCallback) -> int:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # builtins without signatures: assume one argument
        return 1
    return len(params)


class CheckpointOptions:
    """Options for saving and restoring, with TensorFlow's names.

    Args:
      io_device: the task (a device string such as ``"/job:worker/task:0/device:CPU:0"``)
        that merges the shards, commits the checkpoint and writes the state file; in a
        multi-client save all bytes are then funnelled to it, so it alone touches the
        filesystem. ``None``: client 0, and every client writes its own shards. On a
        multi-client restore (``DTensorCheckpoint.restore``/``read``, ``name_based_restore``,
        ``restore_tensors`` with a coordinator) it alone reads, and sends every other
        client its pieces; the restore is then collective.
      enable_async: snapshot the values into host buffers, return, and write, commit,
        update the state file and run the callbacks in the background.
      write_callbacks: callables run in order after each save has committed, each
        given the save path when it takes one argument.
      sharding_callback: a :class:`~shardckpt.sharding.ShardingCallback`
        (default :class:`~shardckpt.sharding.ShardByTaskPolicy`).
      incremental: values unchanged since the previous checkpoint are not written again:
        the data files holding them are hard-linked (local disks; reflinked or copied where
        links fail) or copied server-side (object stores) into the new checkpoint, which
        stays complete on its own (see :mod:`shardckpt.saving.incremental`).
      trust_versions: with ``incremental``, a :class:`~shardckpt.Variable` whose version
        did not move since the previous save (in this process) is taken as unchanged
        without hashing its bytes even when it handed out its live buffer (``.array``,
        ``np.asarray``); direct writes into it must then call ``mark_changed()``.
        Default: only variables that never handed out their buffer are trusted, every
        other value is hashed (xxh3-128).
      skip_slot_variables: on restore, ignore optimizer slot variables.
      async_staging_bytes: with ``enable_async``, hold at most this many bytes of staged
        copies: the snapshot then streams (the call returns once the last value is copied).
      funnel_inflight_bytes: in a funnelled multi-client restore (``io_device`` set), the most
        bytes the io client holds read but not yet sent (also the largest message); ``None``:
        64 MiB.
      timeout: seconds each collective step of a multi-client save may wait for the
        other clients (a client that does not arrive is named in the error). ``None``:
        the coordinator's timeout (``get_coordinator(timeout=)``, else the
        ``SHARDCKPT_TIMEOUT`` environment variable, else 600 s). This option wins over both.

    TensorFlow's ``experimental_`` spellings are accepted as aliases, and are
    readable as attributes.
    """

    def __init__(self, io_device: Optional[str] = None, enable_async: bool = False,
                 write_callbacks: Optional[Sequence[WriteCallback]] = None,
                 sharding_callback: Optional[ShardingCallback] = None,
                 skip_slot_variables: bool = False, *, async_staging_bytes: Optional[int] = None,
                 timeout: Optional[float] = None, incremental: bool = False, trust_versions: bool = False,
                 funnel_inflight_bytes: Optional[int] = None,
                 experimental_io_device: Optional[str] = None,
                 experimental_enable_async_checkpoint: bool = False,
                 experimental_write_callbacks: Optional[Sequence[WriteCallback]] = None,
                 experimental_sharding_callback: Optional[ShardingCallback] = None,
                 experimental_skip_slot_variables: bool = False) -> None:
        def pick(name: str, short: Any, long: Any) -> Any:
            if short is not None and long is not None and short != long:
                raise InvalidArgumentError(f"{name} and experimental_{name} disagree")
            return short if short is not None else long

        self.io_device: Optional[str] = pick("io_device", io_device, experimental_io_device)
        self.enable_async = bool(enable_async or experimental_enable_async_checkpoint)
        callbacks = pick("write_callbacks", write_callbacks, experimental_write_callbacks)
        self.write_callbacks: List[WriteCallback] = list(callbacks or [])
        for cb in self.write_callbacks:
            if not callable(cb) or _arity(cb) > 1:
                raise InvalidArgumentError(f"write callback {cb!r} must be callable with 0 or 1 argument")
        self.sharding_callback: Optional[ShardingCallback] = pick(
            "sharding_callback", sharding_callback, experimental_sharding_callback)
        if self.sharding_callback is not None and not isinstance(self.sharding_callback, ShardingCallback):
            raise InvalidArgumentError("sharding_callback must be a shardckpt.ShardingCallback, got "
                                       f"{type(self.sharding_callback).__name__}")
        self.skip_slot_variables = bool(skip_slot_variables or experimental_skip_slot_variables)
        if async_staging_bytes is not None and int(async_staging_bytes) <= 0:
            raise InvalidArgumentError(f"async_staging_bytes must be positive, got {async_staging_bytes}")
        self.async_staging_bytes = None if async_staging_bytes is None else int(async_staging_bytes)
        if timeout is not None and not float(timeout) > 0:
            raise InvalidArgumentError(f"timeout must be positive seconds, got {timeout!r}")
        self.timeout: Optional[float] = None if timeout is None else float(timeout)
        self.incremental = bool(incremental)
        self.trust_versions = bool(trust_versions)
        if funnel_inflight_bytes is not None and int(funnel_inflight_bytes) <= 0:
            raise InvalidArgumentError(f"funnel_inflight_bytes must be positive, got {funnel_inflight_bytes}")
        self.funnel_inflight_bytes = None if funnel_inflight_bytes is None else int(funnel_inflight_bytes)

    # TensorFlow's attribute spellings
    experimental_io_device = property(lambda self: self.io_device, doc="TensorFlow's name of ``io_device``.")
    experimental_enable_async_checkpoint = property(lambda self: self.enable_async,
                                                    doc="TensorFlow's name of ``enable_async``.")
    experimental_write_callbacks = property(lambda self: self.write_callbacks,
                                            doc="TensorFlow's name of ``write_callbacks``.")
    experimental_sharding_callback = property(lambda self: self.sharding_callback,
                                              doc="TensorFlow's name of ``sharding_callback``.")
    experimental_skip_slot_variables = property(lambda self: self.skip_slot_variables,
                                                doc="TensorFlow's name of ``skip_slot_variables``.")

    def run_write_callbacks(self, save_path: str) -> None:
        """Run the write callbacks in order (with ``save_path`` when a callback takes an argument)."""
        for cb in self.write_callbacks:
            if _arity(cb) == 1:
                cb(save_path)
            else:
                cb()

    def _values(self) -> Dict[str, Any]:
        """Every option by its keyword, in the constructor's order."""
        return dict(io_device=self.io_device, enable_async=self.enable_async,
                    write_callbacks=self.write_callbacks, sharding_callback=self.sharding_callback,
                    skip_slot_variables=self.skip_slot_variables, async_staging_bytes=self.async_staging_bytes,
                    timeout=self.timeout, incremental=self.incremental, trust_versions=self.trust_versions,
                    funnel_inflight_bytes=self.funnel_inflight_bytes)

    def replace(self, **changes: Any) -> "CheckpointOptions":
        """A copy with some options changed."""
        values = self._values()
        values.update(changes)
        return CheckpointOptions(**values)

    def __repr__(self) -> str:
        """Every option, ``timeout`` and the staging and funnel budgets included."""
        return "CheckpointOptions(" + ", ".join(f"{k}={v!r}" for k, v in self._values().items()) + ")"
