"""The restore engine (``shardckpt.restoring``) on real checkpoints: one plan of mixed reads, the
streaming budget, deferred checks before any value is used, follow-ups of collective sources,
failures raised with nothing left running."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest

from shardckpt.distributed.single import SingleProcessCoordinator
from shardckpt.errors import DataLossError, InvalidArgumentError, NotFoundError
from shardckpt.io import save_v2
from shardckpt.restoring import (
    BundleSource,
    FunnelledSource,
    Read,
    ReadGroup,
    RestorePlan,
    collective_call,
    read_one,
    run,
)

W = np.arange(40 * 30, dtype=np.float32).reshape(40, 30)
V = np.arange(1000, dtype=np.int64)
S = np.array([b"a", b"", b"\xff\x00"], dtype=object)


def _bundle(tmp_path: Path) -> str:
    prefix = str(tmp_path / "b")
    save_v2(prefix, ["w", "w", "v", "s"], ["40 30 0,20:-", "40 30 20,20:-", "", ""], [W[:20], W[20:], V, S])
    return prefix


def _flip_last_byte_of(prefix: str) -> None:
    data = prefix + ".data-00000-of-00001"
    raw = bytearray(Path(data).read_bytes())
    raw[-1] ^= 0xFF
    Path(data).write_bytes(bytes(raw))


@pytest.mark.parametrize("workers", [1, 4])
def test_one_plan_of_mixed_reads(tmp_path: Path, workers: int) -> None:
    with BundleSource.open(_bundle(tmp_path)) as source:
        into = np.zeros(1000, np.int64)
        copies: List[np.ndarray] = []
        piece = source.piece_at("w", (20, 0))
        assert piece is not None
        reads = [Read("v", None, into),                                   # whole, into a given array
                 Read("w"),                                               # whole sliced tensor, allocated
                 Read("w", ((5, 35), (3, 4))),                            # a region across both slices
                 Read("w", ((2, 4), (0, 30)), piece=piece),               # rows 22-23, by stored piece
                 Read("s"),                                               # strings
                 Read("v", ((10, 20),), then=lambda a: copies.append(a.copy()))]
        done: List[Any] = []
        plan = RestorePlan.of(source, reads[:2] + [ReadGroup(tuple(reads[2:]), done.append)], workers=workers)
        values = run(plan)
    assert values[0] is into
    np.testing.assert_array_equal(into, V)
    np.testing.assert_array_equal(values[1], W)
    np.testing.assert_array_equal(values[2], W[5:35, 3:4])
    np.testing.assert_array_equal(values[3], W[22:24])
    assert list(values[4]) == list(S)
    np.testing.assert_array_equal(copies[0], V[10:20])
    assert len(done) == 1 and len(done[0]) == 4  # the group's values, once


def test_a_plan_is_checked_when_it_is_made(tmp_path: Path) -> None:
    with BundleSource.open(_bundle(tmp_path)) as source:
        with pytest.raises(InvalidArgumentError, match="at least one reading thread"):
            RestorePlan.of(source, [Read("v")], workers=0)
        with pytest.raises(InvalidArgumentError, match="budget must be positive"):
            RestorePlan.of(source, [Read("v")], budget=0)


class _CountingSource(BundleSource):
    """A real bundle whose reads are counted: the bytes held by groups not yet done, at most."""

    def __init__(self, prefix: str) -> None:
        super().__init__(BundleSource.open(prefix).reader)
        self.lock = threading.Lock()
        self.held = 0
        self.most = 0

    def read(self, read: Read, session: Any, *, verify: bool) -> np.ndarray:
        value = super().read(read, session, verify=verify)
        with self.lock:
            self.held += value.nbytes
            self.most = max(self.most, self.held)
        return value

    def release(self, values: List[np.ndarray]) -> None:
        with self.lock:
            self.held -= sum(v.nbytes for v in values)


@pytest.mark.parametrize("budget", [1, 4 * 30 * 10, 4 * 30 * 25, 1 << 30])
def test_a_streaming_plan_holds_at_most_its_budget(tmp_path: Path, budget: int) -> None:
    source = _CountingSource(_bundle(tmp_path))
    rows = [((r, r + 5), (0, 30)) for r in range(0, 40, 5)]  # 8 groups of 600 bytes
    built: List[np.ndarray] = []

    def done(values: List[np.ndarray]) -> None:
        built.append(values[0].copy())
        source.release(values)

    groups = [ReadGroup((Read("w", box),), done, 4 * 30 * 5) for box in rows]
    with source:
        assert run(RestorePlan.of(source, groups, workers=3, budget=budget, defer=False)) == []  # values went to done
    np.testing.assert_array_equal(np.concatenate(built), W)  # in order
    assert source.most <= max(budget, 4 * 30 * 5)  # a group larger than the budget is read alone


def test_a_damaged_entry_fails_the_plan_before_any_group_is_done(tmp_path: Path) -> None:
    prefix = _bundle(tmp_path)
    _flip_last_byte_of(prefix)  # inside the last entry written: the strings
    done: List[Any] = []
    with BundleSource.open(prefix) as source:
        plan = RestorePlan.of(source, [ReadGroup((Read("v"), Read("s")), done.append)])
        with pytest.raises(DataLossError):
            run(plan)
    assert done == []


def test_a_failing_read_on_the_pool_is_raised_and_nothing_keeps_running(tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    with BundleSource.open(_bundle(tmp_path)) as source:
        reads = [Read("w", ((0, 5), (0, 30)))] * 3 + [Read("nope", ((0, 1),))]
        with pytest.raises(NotFoundError):
            run(RestorePlan.of(source, reads, workers=4))
    assert not {t.name for t in threading.enumerate() if t.name.startswith("shardckpt-read")} - before


def test_a_collective_source_follows_reads_up_when_its_call_ends(tmp_path: Path) -> None:
    source = FunnelledSource(_bundle(tmp_path), SingleProcessCoordinator(), 0, budget=256)
    events: List[str] = []
    with collective_call(source):
        values = run(RestorePlan.of(source, [
            ReadGroup((Read("w", ((3, 33), (0, 30)), then=lambda a: events.append("then")),),
                      lambda vs: events.append("done"))]))
        assert events == []  # recorded only
    assert events == ["then", "done"]
    np.testing.assert_array_equal(values[0], W[3:33])


def test_a_failure_while_planning_a_collective_call_is_raised(tmp_path: Path) -> None:
    source = FunnelledSource(_bundle(tmp_path), SingleProcessCoordinator(), 0)
    with pytest.raises(NotFoundError):
        with collective_call(source):
            run(RestorePlan.of(source, [Read("w")]))
            source.dtype("missing")  # the front door's planning fails after a read was recorded


def test_read_one(tmp_path: Path) -> None:
    with BundleSource.open(_bundle(tmp_path)) as source:
        np.testing.assert_array_equal(read_one(source, Read("w", ((0, 2), (0, 30)))), W[:2])
