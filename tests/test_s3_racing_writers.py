"""Object stores: two writers saving to one prefix at once (issue 16, defect 5).

Threads and processes race on the test S3 server, with equal and with different shard
counts, on a fresh prefix and over an existing checkpoint. The rule under test (the
docstring of shardckpt.saving.commit.index_last): the prefix always holds one whole
checkpoint (never a mix, never unreadable); a save that reports success is what the prefix
held when it returned, unless a later save won; every losing save fails with AbortedError.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Dict, List

import pytest

from shardckpt.storage import get_fs
from shardckpt.storage.registry import mounted
from shardckpt.storage.wrappers import FileSystemWrapper

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
sys.path.insert(0, HELPERS)
import s3_race_writer as rw  # noqa: E402  (tests/helpers)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _judge(results: List[Dict[str, Any]], read: Any, before: Any) -> int:
    """Check one round; return how many saves lost."""
    for r in results:
        assert r["ok"] or r["error"] == "AbortedError", r
    winners = [r["fill"] for r in results if r["ok"]]
    assert read is None or isinstance(read, int), f"the prefix does not hold one whole checkpoint: {read} ({results})"
    if winners:
        assert read in winners, (read, results)
    else:
        assert read == before, (read, before, results)
    return sum(not r["ok"] for r in results)


def _only_committed_objects(prefix: str) -> None:
    fs = get_fs(prefix)
    directory, base = prefix.rsplit("/", 1)
    names = fs.listdir(directory)
    counts = {n.split("-of-")[1] for n in names if n.startswith(base + ".data-")}
    assert len(counts) == 1 and base + ".index" in names, names  # the losers removed their own objects


class _Timeline(FileSystemWrapper):
    """The store, recording per thread when a save listed the prefix's folder (where it learns the index
    it must replace) and when its index PUT ran, and whether that PUT succeeded."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.events: Dict[int, Dict[str, Any]] = {}
        self.guard = threading.Lock()

    def _mine(self) -> Dict[str, Any]:
        with self.guard:
            return self.events.setdefault(threading.get_ident(), {})

    def list_details(self, path: str) -> Any:
        t0 = time.monotonic()
        got = self.inner.list_details(path)  # type: ignore[attr-defined]
        self._mine().setdefault("listed", (t0, time.monotonic()))  # the first: the save's setup
        return got

    def _index_write(self, path: str, call: Any) -> Any:
        if not path.endswith(".index"):
            return call()
        t0 = time.monotonic()
        try:
            result = call()
        except BaseException:
            self._mine()["put"] = (t0, time.monotonic(), False)
            raise
        self._mine()["put"] = (t0, time.monotonic(), True)
        return result

    def put(self, path: str, data: bytes, **conditions: Any) -> str:
        return self._index_write(path, lambda: self.inner.put(path, data, **conditions))  # type: ignore[attr-defined]

    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        self._index_write(path, lambda: self.inner.write_atomic(path, data, fsync=fsync))


def _none_won_over_a_later_commit(events: List[Dict[str, Any]], results: List[Dict[str, Any]]) -> None:
    """No save reports success once another save committed after it started: two saves that both
    committed, each having listed the folder (learning the index it replaces) before the other's index
    PUT began, are refused: whichever committed second replaced an index committed after it listed."""
    for e, r in zip(events, results):
        if r["ok"]:  # a save that reports success listed the folder and its index PUT succeeded
            assert "listed" in e and "put" in e and e["put"][2], (e, r)
    if all(r["ok"] for r in results):
        a, b = events
        assert not (a["listed"][1] <= b["put"][0] and b["listed"][1] <= a["put"][0]), \
            f"both saves reported success though each listed the prefix before the other committed: {events}"


@pytest.mark.parametrize("shards", [(65536, 65536), (65536, 131072)], ids=["same-count", "different-counts"])
def test_threads_racing_on_one_prefix_leave_one_whole_checkpoint(s3_server: Any, shards: tuple) -> None:
    prefix = s3_server.url(f"race-{uuid.uuid4().hex[:8]}", "ck")
    before: Any = None
    losses = 0
    timeline = _Timeline(get_fs(prefix))
    with mounted(timeline, "s3"):
        for r in range(6):
            timeline.events.clear()
            losses, before = _round(prefix, shards, r, timeline, losses, before)
    assert losses >= 1  # the writers did overlap (each round starts both at once)


def _round(prefix: str, shards: tuple, r: int, timeline: _Timeline, losses: int, before: Any) -> tuple:
    """One round: both writers save at once; judged directly and by what the prefix holds after."""
    barrier = threading.Barrier(2)
    results: List[Dict[str, Any]] = [{}, {}]

    def run(w: int, r: int, barrier: threading.Barrier, results: List[Dict[str, Any]]) -> None:
        barrier.wait()
        results[w] = rw.save(prefix, (r + 1) * 10 + w, shards[w])

    threads = [threading.Thread(target=run, args=(w, r, barrier, results)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    events = [timeline.events.get(t.ident or 0, {}) for t in threads]
    _none_won_over_a_later_commit(events, results)
    read = rw.read_fill(prefix)
    losses += _judge(results, read, before)
    if read is None:  # nobody has won yet: nothing committed, and the losers left nothing
        assert get_fs(prefix).listdir(prefix.rsplit("/", 1)[0]) == []
    else:
        _only_committed_objects(prefix)
    before = read
    return losses, before


def test_processes_racing_on_one_prefix_leave_one_whole_checkpoint(s3_server: Any, tmp_path: Any) -> None:
    prefix = s3_server.url(f"race-p-{uuid.uuid4().hex[:8]}", "ck")
    rounds = 4
    start = time.time() + 8.0  # both interpreters are up and warmed by then
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for w, shard_bytes in enumerate((65536, 65536)):  # equal shard counts: the same object names
        out = tmp_path / f"writer-{w}.jsonl"
        procs.append((subprocess.Popen([sys.executable, os.path.join(HELPERS, "s3_race_writer.py"), prefix, str(w),
                                        str(rounds), str(start), str(shard_bytes), str(out)], env=env,
                                       stderr=subprocess.PIPE, text=True), out))
    for p, _ in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    lines = [[json.loads(x) for x in out.read_text().splitlines()] for _, out in procs]
    before: Any = None
    losses = 0
    for r in range(rounds):
        results = [lines[0][r], lines[1][r]]
        reads = {results[0]["read"], results[1]["read"]}
        assert len(reads) == 1 and all(x["seconds"] < rw.ROUND_SECONDS * 0.8 for x in results), results
        read = reads.pop()
        losses += _judge(results, read, before)
        before = read
    names = get_fs(prefix).listdir(prefix.rsplit("/", 1)[0])
    counts = {n.split("-of-")[1] for n in names if n.startswith("ck.data-")}
    assert len(counts) == 1 and "ck.index" in names, names  # the losers removed their own objects
    assert losses >= 1
