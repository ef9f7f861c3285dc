"""The save's collective rounds (``saving/rounds.py``) and the typed messages they carry, over real
(spawned) client processes: every client gets the verdict, or every client fails with the same error."""

from __future__ import annotations

import json
import multiprocessing
from typing import Any, Dict, List

import pytest

from shardckpt.distributed.single import SingleProcessCoordinator
from shardckpt.saving.commit.base import Setup, Written
from shardckpt.saving.messages import Hello, Parts, Pieces, Problem, Verdict
from shardckpt.saving.rounds import Json, Outcome, Rounds

SIZE = 3


def _error(exc: BaseException) -> Dict[str, Any]:
    cause = exc.__cause__
    return {"type": type(exc).__name__, "message": str(exc),
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}


def _client(group: Any, rank: int, out: Any) -> None:
    from shardckpt.distributed.local import LocalProcessCoordinator

    rounds = Rounds(LocalProcessCoordinator(group, rank, timeout=60), root=1)
    report: Dict[str, Any] = {"rank": rank}
    # all-gather of typed messages: each client's, decoded, in rank order
    got = rounds.all_gather(Pieces(rank, f"table{rank}", None if rank else "digest"))
    report["all_gather"] = [(p.shards, p.pieces, p.held) for p in got]

    # decide: the root judges every client's message; everyone gets its verdict
    verdict = rounds.decide(Pieces(rank + 1, "t"), lambda ps: Verdict(None, tuple(p.shards for p in ps)), Verdict,
                            "judging failed")
    report["verdict"] = list(verdict.counts or ())

    # a judge that raises fails every client alike (none is left waiting for a verdict)
    def bad_judge(ps: List[Pieces]) -> Problem:
        raise ValueError(f"cannot judge {len(ps)} messages")

    undone: List[str] = []
    try:
        with rounds.undoing(lambda: undone.append("undo")):
            rounds.decide(Pieces(rank, "t"), bad_judge, Problem, "judging failed")
    except Exception as exc:  # noqa: BLE001 - reported
        report["bad_judge"] = _error(exc)
    report["undone"] = undone

    # agree: one client's step fails -> every client raises the same error naming it, chained to its own
    def step() -> Parts:
        if rank == 2:
            raise OSError("disk full on rank two")
        return Parts((Written(10 * rank, part=f"p{rank}"),))

    try:
        rounds.agree(Outcome.of(step), Parts, barrier="written")
    except Exception as exc:  # noqa: BLE001 - reported
        report["agree_failed"] = _error(exc)
    parts = rounds.agree(Outcome(Parts((Written(rank),))), Parts, barrier="written again")
    report["agreed"] = [[w.bytes for w in p.written] for p in parts]

    # announce: what the root alone did, on every client; its failure fails everyone alike
    shared = rounds.announce(Outcome(Json({"latest": 7})) if rounds.is_root else None, Json, "root failed")
    report["announced"] = shared.value
    try:
        rounds.announce(Outcome.failed(KeyError("state")) if rounds.is_root else None, Json, "root failed")
    except Exception as exc:  # noqa: BLE001 - reported
        report["announce_failed"] = _error(exc)
    out.put(report)


def test_rounds_over_processes() -> None:
    from shardckpt.distributed.local import local_group

    ctx = multiprocessing.get_context("spawn")
    group = local_group(SIZE, ctx)
    out = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(group, r, out)) for r in range(SIZE)]
    for p in procs:
        p.start()
    reports = {r["rank"]: r for r in (out.get(timeout=180) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, r in reports.items():
        assert r["all_gather"] == [(0, "table0", "digest"), (1, "table1", None), (2, "table2", None)], r
        assert r["verdict"] == [1, 2, 3], r
        assert r["bad_judge"] == {"type": "CoordinationError", "message": "judging failed: ValueError: cannot judge 3 "
                                  "messages", "cause": "ValueError: cannot judge 3 messages" if rank == 1 else None}, r
        assert r["undone"] == (["undo"] if rank == 1 else []), r
        failed = r["agree_failed"]
        assert failed["type"] == "CoordinationError", failed
        assert failed["message"] == "1 of 3 clients failed: rank 2: OSError: disk full on rank two", failed
        assert failed["cause"] == ("OSError: disk full on rank two" if rank == 2 else None), failed
        assert r["agreed"] == [[0], [1], [2]], r
        assert r["announced"] == {"latest": 7}, r
        assert r["announce_failed"]["message"] == "root failed: KeyError: 'state'", r
        assert r["announce_failed"]["cause"] == ("KeyError: 'state'" if rank == 1 else None), r


def test_one_client_raises_its_own_error() -> None:
    """A single client's failed round raises the step's own error, not a CoordinationError."""
    rounds = Rounds(SingleProcessCoordinator(), root=0)
    undone: List[int] = []

    def write() -> Parts:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"), rounds.undoing(lambda: undone.append(1)):
        rounds.agree(Outcome.of(write), Parts)
    assert undone == [1]
    with pytest.raises(KeyError):
        rounds.announce(Outcome.failed(KeyError("x")), Json, "failed")
    assert rounds.announce(Outcome(Json(None)), Json, "failed") == Json(None)


def test_outcome_lets_interrupts_through() -> None:
    def interrupted() -> Json:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Outcome.of(interrupted)
    assert Outcome.of(lambda: Json(1)).to_json() == {"ok": True, "error": "", "value": 1}
    def fails() -> Json:
        raise OSError("no space")

    failed = Outcome.of(fails, label="after the commit: ")
    assert failed.to_json() == {"ok": False, "error": "after the commit: OSError: no space"}
    assert isinstance(failed.raised, OSError)


def test_messages_round_trip_as_json() -> None:
    """Setup, Written and the rounds' messages are typed frozen dataclasses that travel as JSON: what
    differs from the defaults only (an index-last shard's Written is the object it always was)."""
    setup = Setup(2, avoid=(3, 5), has_index=True, index_etag="e1")
    assert json.loads(json.dumps(setup.to_json())) == {"first_shard_id": 2, "avoid": [3, 5], "has_index": True,
                                                       "index_etag": "e1"}
    assert Setup.from_json(json.loads(json.dumps(setup.to_json()))) == setup
    assert Setup(temp="/ckpt/x_temp_1").to_json() == {"temp": "/ckpt/x_temp_1"}
    written = Written(4096, entries="eJw=", etag="abc")
    assert written.to_json() == {"bytes": 4096, "entries": "eJw=", "etag": "abc"}
    reused = Written(0, reused=100, how="link", source="/old.data-00000-of-00001", file={"age": 1},
                     pieces=[["k", "", "h", None, None, None]], part="/t/part", index_entries="x")
    assert Written.from_json(json.loads(json.dumps(reused.to_json()))) == reused
    hello = Hello(("/ckpt/x", 3), Outcome(setup), 2)
    assert Hello.from_json(json.loads(json.dumps(hello.to_json()))) == hello
    refused = Hello(("/ckpt/x", 3), Outcome.failed(OSError("read-only")))
    assert Hello.from_json(json.loads(json.dumps(refused.to_json()))) == refused
    assert Verdict(None).to_json() == {}
    verdict = Verdict("gap", counts=(1, 2), held_from=(0,))
    assert Verdict.from_json(json.loads(json.dumps(verdict.to_json()))) == verdict
    assert Pieces(1, "t", "d").to_json() == {"shards": 1, "pieces": "t", "held": "d"}  # what bench_scale counts
    with pytest.raises(AttributeError):
        written.bytes = 1  # type: ignore[misc]  # frozen
