"""The io client's check of every client's pieces (saving/piece_check.py) against the reference check.

``check_pieces`` (packed tables, streaming, vectorized) must give exactly the verdict and
message of ``pieces_problem`` (Python objects per piece) for any set of descriptions: random
tilings of random tensors (sliced along one axis, cut in grids, scalars, empty tensors and
slices), then broken at random (a slice dropped, repeated on another client, moved, cut
short, outside the tensor; a client's dtype, shape or key name changed).

The agreement on what every client holds, written or not (``describe_held``, ``held_digest``,
``held_representatives``, ``held_problem``), is checked on lists of 2 and 1024 clients.
"""

from __future__ import annotations

import base64
import copy
import struct
import time
import zlib
from typing import Any, Dict, List

import numpy as np
import pytest
from helpers.reference_pieces import pieces_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardckpt.errors import ShardingValidationError
from shardckpt.saving.agreement import (
    WHOLE,
    check_pieces,
    describe_held,
    held_digest,
    held_problem,
    held_representatives,
    pack_pieces,
    unpack_pieces,
)

Described = List[Dict[str, List[Any]]]


@st.composite
def tiled(draw) -> Described:
    """Each key's tensor cut into a grid of boxes, the boxes dealt to ``n`` clients."""
    n = draw(st.integers(1, 6))
    out: Described = [{} for _ in range(n)]
    layouts: List[Any] = []
    for k in range(draw(st.integers(1, 6))):
        if layouts and draw(st.booleans()):  # sliced like an earlier key (checked once)
            shape, boxes, dtype = layouts[draw(st.integers(0, len(layouts) - 1))]
        else:
            shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
            cuts = []
            for d in shape:
                inner = draw(st.lists(st.integers(0, d), max_size=3)) if draw(st.booleans()) else []
                cuts.append(sorted({0, d, *inner}) if d else [0, 0])
            boxes = [tuple(box) for box in _product([list(zip(c[:-1], c[1:])) for c in cuts])]
            dtype = draw(st.sampled_from([1, 2, 19]))
            layouts.append((shape, boxes, dtype))
        owners = [draw(st.integers(0, n - 1)) for _ in boxes] if draw(st.booleans()) else \
            [i * n // max(1, len(boxes)) for i in range(len(boxes))]
        for box, r in zip(boxes, owners):
            entry = out[r].setdefault(f"k{k}", [dtype, list(shape), []])
            entry[2].append([list(p) for p in box])
    return out


def _product(axes: List[List[Any]]) -> List[List[Any]]:
    result: List[List[Any]] = [[]]
    for axis in axes:
        result = [r + [x] for r in result for x in axis]
    return [list(r) for r in result]


@st.composite
def broken(draw) -> Described:
    described = copy.deepcopy(draw(tiled()))
    n = len(described)
    for _ in range(draw(st.integers(1, 3))):
        r = draw(st.integers(0, n - 1))
        if not described[r]:
            continue
        key = draw(st.sampled_from(sorted(described[r])))
        dtype, shape, boxes = described[r][key]
        how = draw(st.sampled_from(["drop", "repeat", "move", "short", "outside", "empty", "dtype", "shape",
                                    "rank", "rename"]))
        if how == "drop" and boxes:
            boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        elif how == "repeat" and boxes:
            target = described[draw(st.integers(0, n - 1))].setdefault(key, [dtype, list(shape), []])
            if len(target[1]) == len(shape):  # a client's boxes have its shape's rank
                target[2].append(copy.deepcopy(boxes[0]))
        elif how in ("move", "short", "outside") and boxes and shape:
            box = boxes[draw(st.integers(0, len(boxes) - 1))]
            d = draw(st.integers(0, len(shape) - 1))
            delta = draw(st.integers(1, 3))
            if how == "move":
                box[d] = [box[d][0] + delta, box[d][1] + delta]
            elif how == "short":
                box[d] = [box[d][0], box[d][1] - delta]
            else:
                box[d] = [box[d][0] - delta, box[d][1]]
        elif how == "empty":
            boxes.append([[1, 1] for _ in shape])
        elif how == "dtype":
            described[r][key][0] = dtype + 1
        elif how == "shape" and shape:
            described[r][key][1] = [shape[0] + 1] + shape[1:]
        elif how == "rank":
            described[r][key] = [dtype, shape + [1], [box + [[0, 1]] for box in boxes]]
        elif how == "rename":
            described[r][key + "x"] = described[r].pop(key)
    return described


def _same_verdict(described: Described) -> None:
    packed = [pack_pieces(d) for d in described]
    for d, p in zip(described, packed):
        assert unpack_pieces(p) == d
    assert check_pieces(packed) == pieces_problem(described), described


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiled())
def test_tilings_agree(described: Described) -> None:
    _same_verdict(described)
    assert check_pieces([pack_pieces(d) for d in described]) is None


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken())
def test_broken_tilings_get_the_reference_verdict(described: Described) -> None:
    _same_verdict(described)


KEYS = [f"model/layer_{i // 16}/w{i % 16}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(200)]


def _fsdp(n: int, rows: int = 2) -> Described:
    return [{k: [1, [rows * n, 4 + i % 3], [[[rows * r, rows * (r + 1)], [0, 4 + i % 3]]]] for i, k in enumerate(KEYS)}
            for r in range(n)]


def _grid(n: int) -> Described:  # every tensor cut in n/2 x 2 blocks
    return [{k: [1, [n, 8], [[[r // 2 * 2, r // 2 * 2 + 2], [r % 2 * 4, r % 2 * 4 + 4]]]] for k in KEYS}
            for r in range(n)]


@pytest.mark.parametrize("layout", [_fsdp, _grid])
def test_many_clients_one_odd_one_out(layout) -> None:
    described = layout(64)
    _same_verdict(described)
    odd = copy.deepcopy(described)
    odd[37][KEYS[5]][2][0][0][1] += 1  # client 37's slice of one key reaches into client 38's
    _same_verdict(odd)
    message = check_pieces([pack_pieces(d) for d in odd])
    assert message is not None and "[37" in message and KEYS[5] in message, message
    odd = copy.deepcopy(described)
    odd[3][KEYS[7]][0] = 2
    assert "rank(s) [3] save it as" in (check_pieces([pack_pieces(d) for d in odd]) or "")


def test_an_undecodable_table_names_its_client() -> None:
    packed = [pack_pieces(d) for d in _fsdp(3)]
    for bad in (packed[1][:-8], "not base64!", pack_pieces({})[:4] + "AAAA"):
        with pytest.raises(ShardingValidationError, match="client 1's piece descriptions do not decode"):
            check_pieces([packed[0], bad, packed[2]])
    raw = base64.b64decode(pack_pieces({"w": [1, [4], [[[0, 2]]]], "x": [1, [4], [[[2, 4]]]]}))
    _, count, size = struct.unpack_from("<4sII", raw)
    keys = zlib.compress(struct.pack("<II", 1, 1) + b"ww")  # the same key twice
    twice = base64.b64encode(raw[:4] + struct.pack("<II", count, len(keys)) + keys + raw[12 + size:]).decode()
    with pytest.raises(ShardingValidationError, match="client 1's piece descriptions name key 'w' twice"):
        check_pieces([packed[0], twice])
    with pytest.raises(ShardingValidationError, match="not a mapping"):
        pack_pieces([])  # type: ignore[arg-type]
    with pytest.raises(ShardingValidationError, match="start, stop"):
        pack_pieces({"w": [1, [4, 4], [[[0, 4]]]]})


def test_the_check_is_linear_and_quick() -> None:
    """256 clients x 200 keys (51 200 pieces): the check takes well under the reference's time."""
    packed = [pack_pieces(d) for d in _fsdp(256)]
    t0 = time.perf_counter()
    assert check_pieces(packed) is None
    fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert pieces_problem([unpack_pieces(p) for p in packed]) is None
    reference = time.perf_counter() - t0
    assert fast < reference / 3, (fast, reference)
    assert np.isfinite(fast)


# -- what every client holds, written or not (issue 24, section 1) ------------------------------------------------


def _two_client_views(specs: List[str]) -> List[Any]:
    """The DTensor ``b`` (4 x 6, ``specs`` over a mesh x=2, y=2 of 2 clients) as client 0 and client 1 hold it."""
    from shardckpt import dtensor as dt

    ids = np.arange(4).reshape(2, 2)
    client_of = {0: 0, 1: 0, 2: 1, 3: 1}
    views = []
    for rank in (0, 1):
        local = [d for d in range(4) if client_of[d] == rank]
        mesh = dt.Mesh(["x", "y"], ids, local, [f"/job:worker/replica:0/task:{rank}/device:CPU:{i}" for i in (0, 1)],
                       client_of=client_of)
        views.append(dt.from_global(np.arange(24, dtype=np.float32).reshape(4, 6), dt.Layout(specs, mesh)))
    return views


def _held(rank_lists: List[Any]) -> Any:
    """Every client's digest and the io client's verdict, as the engine runs it."""
    digests = [held_digest(h) for h in rank_lists]
    ask = held_representatives(digests)
    return ask, (held_problem(digests, {r: rank_lists[r] for r in ask}) if ask is not None else None)


def test_clients_describe_one_variable_alike_whatever_devices_they_hold() -> None:
    for specs in (["unsharded", "unsharded"], ["x", "unsharded"], ["unsharded", "y"]):
        zero, one = _two_client_views(specs)
        held = [describe_held([("b", zero), ("step", np.int64(3))]), describe_held([("step", np.int64(3)), ("b", one)])]
        assert held[0] == held[1], held  # sorted by name; the mesh digest ignores which devices are local
        assert held[0][0][:4] == ["b", "float32", [4, 6], ",".join(specs)] and held[0][0][4].startswith("x=2,y=2 #")
        assert held[0][1] == ["step", "int64", [], WHOLE, ""]
        assert _held(held) == (None, None)
    replicated, sharded = _two_client_views(["unsharded", "unsharded"])[0], _two_client_views(["x", "unsharded"])[1]
    ask, problem = _held([describe_held([("b", replicated)]), describe_held([("b", sharded)])])
    assert ask == [0, 1]
    assert problem is not None and "variable 'b': rank(s) [1] hold it as float32[4, 6], layout [x,unsharded]" in problem


@pytest.mark.parametrize("case,expected", [
    ("only0", ["variable 'b' (float32[4], layout [unsharded] on mesh x=2 #0) is held by rank(s) [0] but not by "
               "rank(s) [1]"]),
    ("only1", ["variable 'b' (float32[4], layout [unsharded] on mesh x=2 #0) is held by rank(s) [1] but not by "
               "rank(s) [0]"]),
    ("renamed", ["variable 'b' (float32[4], layout [unsharded] on mesh x=2 #0) is held by rank(s) [0] but not by "
                 "rank(s) [1]", "variable 'b2' (float32[4], layout [unsharded] on mesh x=2 #0) is held by rank(s) [1] "
                 "but not by rank(s) [0]"]),
    ("dtype", ["variable 'b': rank(s) [1] hold it as float64[4], layout [unsharded] on mesh x=2 #0, rank(s) [0] as "
               "float32[4]"]),
    ("mesh", ["variable 'b': rank(s) [1] hold it as float32[4], layout [unsharded] on mesh x=4 #1, rank(s) [0] as "
              "float32[4], layout [unsharded] on mesh x=2 #0"]),
])
def test_two_clients_that_hold_a_replicated_variable_differently_are_named_with_it(case: str, expected: List[str]
                                                                                    ) -> None:
    w = ["w", "float32", [8], "x", "x=2 #0"]
    b = ["b", "float32", [4], "unsharded", "x=2 #0"]
    other = {"only0": [w], "only1": [w, b], "renamed": [["b2"] + b[1:], w], "dtype": [b[:1] + ["float64"] + b[2:], w],
             "mesh": [b[:4] + ["x=4 #1"], w]}[case]
    mine = [w] if case == "only1" else [b, w]
    ask, problem = _held([mine, other])
    assert ask == [0, 1] and problem is not None
    assert problem.startswith("clients disagree on the variables they hold: ")
    for text in expected:
        assert text in problem, problem
    assert "'w'" not in problem  # the variable they agree on is not named


def test_one_odd_client_of_1024_is_named_and_only_one_list_a_digest_travels() -> None:
    keys = [["k%05d" % i, "float32", [2048, 4], "x,unsharded", "x=1024 #ab"] for i in range(2000)]
    odd = [k for k in keys if k[0] != "k00042"]
    lists = [odd if r == 513 else keys for r in range(1024)]
    digests = [held_digest(h) for h in lists]
    assert len(set(digests)) == 2 and all(len(d or "") == 32 for d in digests)
    ask = held_representatives(digests)
    assert ask == [0, 513]  # one client of each digest sends its list
    t0 = time.perf_counter()
    problem = held_problem(digests, {r: lists[r] for r in ask})
    assert time.perf_counter() - t0 < 2.0  # linear in the lists sent, not in clients x entries
    assert problem == ("clients disagree on the variables they hold: variable 'k00042' (float32[2048, 4], layout "
                       "[x,unsharded] on mesh x=1024 #ab) is held by rank(s) [0-512, 514-1023] but not by rank(s) "
                       "[513]")


def test_a_client_that_lists_nothing_is_named_and_problems_are_capped() -> None:
    digests = [held_digest([["a", "float32", [1], WHOLE, ""]]), held_digest(None)]
    assert held_representatives(digests) == [0, 1]
    problem = held_problem(digests, {0: [["a", "float32", [1], WHOLE, ""]], 1: None})
    assert problem == "clients disagree on the variables they hold: rank(s) [1] did not list what they hold"
    many = [[f"v{i}", "float32", [1], WHOLE, ""] for i in range(20)]
    digests = [held_digest(many), held_digest([])]
    problem = held_problem(digests, {0: many, 1: []}) or ""
    assert problem.count("is held by rank(s) [0] but not by rank(s) [1]") == 8, problem
    twice = [["a", "float32", [1], WHOLE, ""], ["a", "float32", [1], WHOLE, ""]]
    digests = [held_digest(twice[:1]), held_digest(twice)]
    assert held_problem(digests, {0: twice[:1], 1: twice}) == \
        "clients disagree on the variables they hold: the lists of rank(s) [0], rank(s) [1] differ"
