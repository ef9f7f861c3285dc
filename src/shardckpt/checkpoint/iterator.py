"""Waiting for checkpoints as an evaluator does: ``checkpoints_iterator`` (``tf.train.checkpoints_iterator``).

The protocol reads only the directory's ``checkpoint`` state file: every poll asks
:func:`~shardckpt.checkpoint.state.latest_checkpoint` for the newest checkpoint it
names, and a path different from the one yielded last is new. Checkpoints written
and superseded between two polls are never seen (only the latest is yielded), as in
TensorFlow. Nothing is written.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Optional

from .state import latest_checkpoint

__all__ = ["checkpoints_iterator", "wait_for_new_checkpoint"]

_log = logging.getLogger("shardckpt")

#: Seconds between two polls of the state file.
POLL_SECONDS = 1.0


def wait_for_new_checkpoint(checkpoint_dir: str, last_checkpoint: Optional[str] = None,
                            seconds_to_sleep: float = POLL_SECONDS, timeout: Optional[float] = None
                            ) -> Optional[str]:
    """The latest checkpoint of ``checkpoint_dir`` once it is not ``last_checkpoint``, polling every
    ``seconds_to_sleep``; ``None`` when ``timeout`` seconds pass first (no poll sleeps past the deadline)."""
    _log.info("waiting for a new checkpoint in %s", checkpoint_dir)
    deadline = None if timeout is None else time.time() + timeout
    while True:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None and path != last_checkpoint:
            _log.info("found new checkpoint %s", path)
            return path
        if deadline is not None and time.time() + seconds_to_sleep > deadline:
            return None
        time.sleep(seconds_to_sleep)


def checkpoints_iterator(checkpoint_dir: str, min_interval_secs: float = 0, timeout: Optional[float] = None,
                         timeout_fn: Optional[Callable[[], bool]] = None) -> Iterator[str]:
    """Yield each new latest checkpoint of ``checkpoint_dir`` as it appears (TF's ``checkpoints_iterator``).

    ``min_interval_secs``: at least this long between the start of one yield and the next.
    ``timeout``: the longest wait for a new checkpoint. Without ``timeout_fn`` the iterator
    ends when a wait times out. With it, ``timeout_fn()`` is asked after every round (a
    yielded checkpoint or a wait that timed out, as TF asks it) and the iterator ends
    when it returns true.
    """
    last: Optional[str] = None
    while True:
        path = wait_for_new_checkpoint(checkpoint_dir, last, timeout=timeout)
        if path is not None:
            started = time.time()
            last = path
            yield path
            left = started + min_interval_secs - time.time()
            if left > 0:
                time.sleep(left)
        elif timeout_fn is None:
            _log.info("timed out waiting for a checkpoint in %s", checkpoint_dir)
            return
        if timeout_fn is not None and timeout_fn():
            _log.info("no new checkpoints will come to %s (timeout_fn)", checkpoint_dir)
            return
