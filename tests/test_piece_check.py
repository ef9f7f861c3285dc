"""The io client's check of every client's pieces (saving/piece_check.py) against the reference check.

``check_pieces`` (packed tables, streaming, vectorized) must give exactly the verdict and
message of ``pieces_problem`` (Python objects per piece) for any set of descriptions: random
tilings of random tensors (sliced along one axis, cut in grids, scalars, empty tensors and
slices), then broken at random (a slice dropped, repeated on another client, moved, cut
short, outside the tensor; a client's dtype, shape or key name changed).
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
from shardckpt.saving.agreement import check_pieces, pack_pieces, unpack_pieces

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
