"""Read-ahead for object stores: announced byte ranges fetched in few large requests, kept until read.

A reader that knows which byte ranges of an object it is about to read (a restore: every
stored piece of every requested tensor) announces them (:meth:`BlockCache.announce`). The
ranges are planned into *blocks* with the store's cost model (:func:`plan_spans`):
neighbouring ranges share a block when the gap between them costs less to download than
a request, and a block holds at most ``cap`` bytes, so a long span still splits into
requests that run in parallel. Blocks are fetched ahead of the reads, as many at a time
as the memory budget allows; the others wait, in order, taken round-robin over the open
objects as budget frees up. A read whose bytes all lie in blocks waits for them (a block
still waiting is fetched at once) and copies its bytes out; any other read goes to the
store as before. Every block counts the announced bytes not yet read from it and is
dropped as soon as they have all been read: what is held is the budget plus the blocks
readers are consuming right now.

Blocks also keep the gap bytes of a merged request that nobody announced
(:meth:`BlockCache.keep`): a later read inside them is served without a request. Those
are dropped first when the budget is needed (oldest first), and never wait.

In memory at each moment, per open object: its blocks (fetched, in flight, or waiting to
be fetched; only the first two count against the budget). :meth:`BlockCache.drop` (the
object is closed) forgets all of them. A failed fetch is forgotten too; the reads that
waited for it raise its error. Nothing here decides what bytes are *right*: blocks are
fetched by the store's own request function (which pins an object version where the
store can), so a read served from a block sees what a direct read at fetch time would
have seen.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataLossError

__all__ = ["Block", "Blocks", "BlockCache", "plan_spans"]


def plan_spans(starts: Any, ends: Any, gap: int, cap: int) -> List[Tuple[int, int, int]]:
    """Blocks ``(start, end, needed bytes)`` that cover the ranges ``[starts[i], ends[i])``.

    Ranges may overlap and come in any order. Neighbours share a block when the gap
    between them is at most ``gap`` bytes; a block is at most ``cap`` bytes (a longer
    span is cut into nearly equal blocks). ``needed``: bytes of the block that some
    range covers (the rest is gap fetched because a request costs more). Vectorized:
    a million ranges plan in milliseconds.
    """
    s = np.asarray(starts, dtype=np.int64).reshape(-1)
    e = np.asarray(ends, dtype=np.int64).reshape(-1)
    keep = e > s
    if not keep.all():
        s, e = s[keep], e[keep]
    if len(s) == 0:
        return []
    cap = max(1, int(cap))
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = np.maximum.accumulate(e[order])  # running end: overlapping ranges fold together
    fresh = np.empty(len(s), dtype=bool)
    fresh[0] = True
    fresh[1:] = s[1:] > e[:-1]
    first = np.flatnonzero(fresh)
    us = s[first]  # the disjoint union of the ranges
    ue = e[np.append(first[1:], len(s)) - 1]
    split = np.empty(len(us), dtype=bool)
    split[0] = True
    split[1:] = us[1:] - ue[:-1] > int(gap)
    gfirst = np.flatnonzero(split)
    gs = us[gfirst]  # groups: union pieces closer than the gap limit
    ge = ue[np.append(gfirst[1:], len(us)) - 1]
    length = ge - gs
    counts = -(-length // cap)
    which = np.repeat(np.arange(len(gs)), counts)
    j = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    bstart = gs[which] + length[which] * j // counts[which]
    bend = gs[which] + length[which] * (j + 1) // counts[which]
    cum = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(ue - us)])

    def covered(x: np.ndarray) -> np.ndarray:  # union bytes below x
        i = np.searchsorted(us, x, side="right") - 1
        inside = np.minimum(x - us[np.maximum(i, 0)], (ue - us)[np.maximum(i, 0)])
        return np.where(i >= 0, cum[np.maximum(i, 0)] + inside, 0)

    need = covered(bend) - covered(bstart)
    return list(zip(bstart.tolist(), bend.tolist(), need.tolist()))


class Block:
    """Bytes ``[start, end)`` of one object, fetched by one request.

    ``future``: the request's bytes (``None`` while the block waits to be fetched).
    ``pending``: announced bytes not yet read from it (the block is dropped when none is
    left); ``None`` for a block kept only for its gap bytes.
    """

    __slots__ = ("start", "end", "future", "pending")

    def __init__(self, start: int, end: int, future: "Optional[Future[Any]]", pending: Optional[int]) -> None:
        self.start = start
        self.end = end
        self.future = future
        self.pending = pending


class Blocks:
    """The blocks of one open object (held by its read handle), sorted by start."""

    __slots__ = ("handle", "starts", "items", "queued", "held")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.starts: List[int] = []
        self.items: List[Block] = []
        self.queued: Deque[Block] = deque()
        self.held = 0  # bytes of fetched and in-flight blocks

    def __bool__(self) -> bool:
        return bool(self.items)


class BlockCache:
    """Blocks of every open object of one store, within ``budget`` bytes (see the module docstring).

    ``fetch(handle, start, end)`` sends one request for those bytes and returns its future.
    """

    def __init__(self, budget: int, fetch: "Callable[[Any, int, int], Future[Any]]") -> None:
        self.budget = int(budget)
        self._fetch = fetch
        self._lock = threading.RLock()
        #: held by callers that look blocks up and add their own requests as one step
        self.lock = self._lock
        self._held = 0
        self._loose: "OrderedDict[int, Tuple[Blocks, Block]]" = OrderedDict()  # kept for gap bytes, oldest first
        self._waiting: Deque[Blocks] = deque()  # objects with blocks waiting to be fetched

    @property
    def held(self) -> int:
        """Bytes of fetched and in-flight blocks."""
        return self._held

    # -- adding ------------------------------------------------------------
    def announce(self, blocks: Blocks, spans: Sequence[Tuple[int, int, int]]) -> int:
        """Plan to fetch ``spans`` (``(start, end, needed)`` from :func:`plan_spans`); blocks added.

        A span that blocks already hold is skipped. Returns how many blocks were added.
        """
        added = 0
        with self._lock:
            for start, end, needed in spans:
                if needed <= 0 or self._covering(blocks, start, end - start) is not None:
                    continue
                block = Block(start, end, None, needed)
                self._insert(blocks, block)
                blocks.queued.append(block)
                added += 1
            if added and blocks not in self._waiting:
                self._waiting.append(blocks)
            self._pump()
        return added

    def keep(self, blocks: Blocks, start: int, end: int, future: "Future[Any]") -> None:
        """Keep the bytes of a request in flight for later reads inside them (within the budget)."""
        size = end - start
        if self.budget <= 0 or size > self.budget:
            return
        with self._lock:
            if not self._make_room(size):
                return
            block = Block(start, end, future, None)
            self._insert(blocks, block)
            self._loose[id(block)] = (blocks, block)
            self._hold(blocks, block)

    # -- reading -----------------------------------------------------------
    def read(self, blocks: Blocks, offset: int, view: memoryview, path: str) -> bool:
        """Fill ``view`` (bytes from ``offset``) from blocks when they hold all of it; whether they did.

        Waits for blocks in flight (and fetches waiting ones now); see :meth:`fill`.
        """
        found = self.covering(blocks, offset, len(view))
        if found is None:
            return False
        self.fill(blocks, found, offset, view, path)
        return True

    def fill(self, blocks: Blocks, found: List[Block], offset: int, view: memoryview, path: str) -> None:
        """Copy ``view``'s bytes out of ``found`` (from :meth:`covering`), waiting for them; count them read.

        Raises the error of a failed fetch, or :class:`~shardckpt.errors.DataLossError`
        when the object ended before a block did.
        """
        n = len(view)
        try:
            for block in found:
                assert block.future is not None
                data = block.future.result()
                lo, hi = max(offset, block.start), min(offset + n, block.end)
                if len(data) < hi - block.start:
                    raise DataLossError(f"unexpected end of object at offset {block.start + len(data)} "
                                        f"(wanted {hi - block.start - len(data)} more bytes)", path=path)
                view[lo - offset:hi - offset] = memoryview(data)[lo - block.start:hi - block.start]
        finally:
            self._consumed(blocks, found, offset, n)

    def read_runs(self, blocks: Blocks, offsets: Any, run_bytes: int, dest: memoryview, path: str) -> np.ndarray:
        """Serve in bulk the runs that lie inside a block: run ``i`` (``offsets`` ascending) goes to
        ``dest[i * run_bytes:(i + 1) * run_bytes]``. Returns the indices of the runs not served.

        A block's runs are copied with one strided copy when evenly spaced (the rows of a
        column block), else one slice each; errors as in :meth:`fill`.
        """
        offsets = np.asarray(offsets, dtype=np.int64)
        count = len(offsets)
        if count == 0 or run_bytes <= 0 or not blocks:
            return np.arange(count)
        ends = offsets + run_bytes
        served = np.zeros(count, dtype=bool)
        groups: List[Tuple[Block, int, int]] = []
        with self._lock:
            for block in list(blocks.items):
                i0 = int(np.searchsorted(offsets, block.start, side="left"))
                i1 = int(np.searchsorted(ends, block.end, side="right"))
                if i1 <= i0 or served[i0:i1].any():
                    continue
                served[i0:i1] = True
                groups.append((block, i0, i1))
                if block.future is None:
                    self._start(blocks, block)
        out = np.frombuffer(dest, dtype=np.uint8, count=count * run_bytes).reshape(count, run_bytes)
        try:
            for block, i0, i1 in groups:
                assert block.future is not None
                data = np.frombuffer(block.future.result(), dtype=np.uint8)
                if len(data) < int(ends[i1 - 1]) - block.start:
                    raise DataLossError(f"unexpected end of object at offset {block.start + len(data)} "
                                        f"(wanted {int(ends[i1 - 1]) - block.start - len(data)} more bytes)",
                                        path=path)
                at = offsets[i0:i1] - block.start
                step = int(at[1] - at[0]) if i1 - i0 > 1 else run_bytes
                if i1 - i0 == 1 or bool((np.diff(at) == step).all()):
                    first = int(at[0])
                    out[i0:i1] = np.lib.stride_tricks.as_strided(data[first:], shape=(i1 - i0, run_bytes),
                                                                 strides=(step, 1), writeable=False)
                else:
                    for k, o in enumerate(at.tolist()):
                        out[i0 + k] = data[o:o + run_bytes]
        finally:
            with self._lock:
                freed = False
                for block, i0, i1 in groups:
                    if block.pending is None:
                        continue
                    block.pending -= (i1 - i0) * run_bytes
                    if block.pending <= 0:
                        self._remove(blocks, block)
                        freed = True
                if freed:
                    self._pump()
        return np.flatnonzero(~served)

    def covering(self, blocks: Blocks, offset: int, n: int) -> Optional[List[Block]]:
        """The blocks that together hold ``[offset, offset + n)`` (waiting ones are fetched now), or ``None``."""
        with self._lock:
            found = self._covering(blocks, offset, n)
            if found is not None:
                for block in found:
                    if block.future is None:
                        self._start(blocks, block)
            return found

    def drop(self, blocks: Blocks) -> None:
        """Forget every block of the object (it is closed); fetches in flight for announced reads are cancelled."""
        with self._lock:
            for block in blocks.items:
                if block.future is not None:
                    self._held -= block.end - block.start
                    if block.pending is not None and not block.future.done():
                        block.future.cancel()
                self._loose.pop(id(block), None)
            blocks.items, blocks.starts, blocks.held = [], [], 0
            blocks.queued.clear()
            if blocks in self._waiting:
                self._waiting.remove(blocks)
            self._pump()

    # -- inside the lock -----------------------------------------------------
    def _covering(self, blocks: Blocks, offset: int, n: int) -> Optional[List[Block]]:
        found: List[Block] = []
        at, stop = offset, offset + n
        starts, items = blocks.starts, blocks.items
        while at < stop:
            i = bisect_right(starts, at) - 1
            hit = None
            for k in range(i, max(-1, i - 4), -1):  # blocks may overlap: look a few back
                if items[k].start <= at < items[k].end:
                    hit = items[k]
                    break
            if hit is None:
                return None
            found.append(hit)
            at = hit.end
        return found

    def _insert(self, blocks: Blocks, block: Block) -> None:
        k = bisect_right(blocks.starts, block.start)
        blocks.starts.insert(k, block.start)
        blocks.items.insert(k, block)

    def _remove(self, blocks: Blocks, block: Block) -> None:
        k = bisect_right(blocks.starts, block.start) - 1
        while k >= 0 and blocks.items[k] is not block:
            k -= 1
        if k < 0:
            return
        del blocks.starts[k]
        del blocks.items[k]
        if block.future is not None:
            blocks.held -= block.end - block.start
            self._held -= block.end - block.start
        self._loose.pop(id(block), None)
        try:
            blocks.queued.remove(block)
        except ValueError:
            pass

    def _hold(self, blocks: Blocks, block: Block) -> None:
        blocks.held += block.end - block.start
        self._held += block.end - block.start
        assert block.future is not None
        block.future.add_done_callback(lambda f: self._forget_failed(blocks, block, f))

    def _start(self, blocks: Blocks, block: Block) -> None:
        try:
            blocks.queued.remove(block)
        except ValueError:
            pass
        block.future = self._fetch(blocks.handle, block.start, block.end)
        self._hold(blocks, block)

    def _forget_failed(self, blocks: Blocks, block: Block, future: "Future[Any]") -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                self._remove(blocks, block)
                self._pump()

    def _consumed(self, blocks: Blocks, found: List[Block], offset: int, n: int) -> None:
        with self._lock:
            freed = False
            for block in found:
                if block.pending is None:
                    if id(block) in self._loose:  # read again: dropped last
                        self._loose.move_to_end(id(block))
                    continue
                block.pending -= min(offset + n, block.end) - max(offset, block.start)
                if block.pending <= 0:
                    self._remove(blocks, block)
                    freed = True
            if freed:
                self._pump()

    def _make_room(self, size: int) -> bool:
        while self._held + size > self.budget and self._loose:
            _, (owner, block) = next(iter(self._loose.items()))
            self._remove(owner, block)
        return self._held + size <= self.budget

    def _pump(self) -> None:
        """Fetch waiting blocks, round-robin over the objects, while the budget allows (always one)."""
        while self._waiting:
            blocks = self._waiting[0]
            if not blocks.queued:
                self._waiting.popleft()
                continue
            block = blocks.queued[0]
            size = block.end - block.start
            if not self._make_room(size) and self._held > 0:
                return
            self._start(blocks, block)
            self._waiting.rotate(-1)
