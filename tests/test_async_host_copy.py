"""An async save returns only once its host copy is done (issue 24, section 5).

``enable_async`` saves copy every value to host buffers on the calling thread and write in the
background; the caller may change its values as soon as the save returns. Here every value is
of a type whose registered stager (``shardckpt.saving.staging.register_stager``) is slow and
records when each copy ends: every copy must have ended before the save returned, whatever the
byte budget (``async_staging_bytes``: the snapshot streams, copying the next value once the
writer released earlier ones); and values changed right after the return never reach the
checkpoint.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

import shardckpt
from shardckpt.saving import async_save
from shardckpt.saving.async_save import AsyncSaver
from shardckpt.saving.staging import register_stager

ITEM = 64 << 10  # bytes per value
COUNT = 6
COPY_SECONDS = 0.05


class SlowHostValue:
    """A value whose copy to the host takes a while (as a device transfer does)."""

    copies_ended: List[float] = []
    lock = threading.Lock()

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape, self.dtype = array.shape, array.dtype

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.array


def _stage(value: SlowHostValue, out: np.ndarray) -> None:
    half = out.size // 2
    flat = out.reshape(-1)
    np.copyto(flat[:half], value.array.reshape(-1)[:half])
    time.sleep(COPY_SECONDS)  # the transfer is under way: a save that returned now would let the caller race it
    np.copyto(flat[half:], value.array.reshape(-1)[half:])
    with SlowHostValue.lock:
        SlowHostValue.copies_ended.append(time.monotonic())


register_stager(SlowHostValue, _stage)


def _values(generation: int) -> Dict[str, np.ndarray]:
    return {f"w{i}": np.full(ITEM // 4, generation * 100 + i, np.float32) for i in range(COUNT)}


@pytest.mark.parametrize("writer", ["after-the-copy", "beside-the-copy"])
@pytest.mark.parametrize("budget", [None, 2 * ITEM], ids=["whole-snapshot", "streamed-budget"])
def test_an_async_save_returns_only_after_every_host_copy_ended(tmp_path: Path, budget: Optional[int], writer: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # where cores are few the writer starts after the copy, else beside it (a budget: always beside): both here
    monkeypatch.setattr(async_save, "OVERLAP_MIN_CORES", 1 << 20 if writer == "after-the-copy" else 0)
    old = _values(1)
    live = {k: SlowHostValue(v.copy()) for k, v in old.items()}
    options = shardckpt.CheckpointOptions(enable_async=True, async_staging_bytes=budget)
    saver = AsyncSaver(budget)
    SlowHostValue.copies_ended.clear()
    prefix = str(tmp_path / "ck")
    shardckpt.save_tensors(prefix, live, options, saver=saver)
    returned = time.monotonic()
    ended = list(SlowHostValue.copies_ended)
    for value in live.values():  # the caller goes on training at once
        value.array[...] = -1.0
    saver.wait()
    assert len(ended) == COUNT, f"{len(ended)} of {COUNT} host copies had ended when the save returned"
    assert max(ended) <= returned
    assert len(SlowHostValue.copies_ended) == COUNT  # nothing was copied after the return either
    with shardckpt.load_checkpoint(prefix) as reader:
        for name, value in old.items():
            np.testing.assert_array_equal(reader.get_tensor(name), value)

