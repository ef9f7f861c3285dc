"""The funnelled reader in one process (the io client alone): chunking, planning over stored pieces,
checksums of pieces read in chunks, recorded reads filled by ``finish``. The multi-client protocol
is tested with real processes in tests/test_funnel_restore.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardckpt.distributed.single import SingleProcessCoordinator
from shardckpt.errors import DataLossError, InvalidArgumentError, NotFoundError, UnsupportedError
from shardckpt.format.tensor_slice import box_volume
from shardckpt.io import save_v2
from shardckpt.restoring.funnel import FunnelledReader, chunk_boxes, run_funnelled

W = np.arange(40 * 30, dtype=np.float32).reshape(40, 30)
S = np.array([b"a", b"", b"\xff\x00"], dtype=object)


def _flat(box, shape):
    idx = np.arange(int(np.prod(shape))).reshape(shape)
    return idx[tuple(slice(a, b) for a, b in box)].reshape(-1)


@pytest.mark.parametrize("shape,budget", [((40, 30), 4 * 30 * 7), ((40, 30), 4 * 10), ((40, 30), 3),
                                          ((5, 6, 7), 4 * 13), ((), 1), ((0, 4), 8), ((9,), 4 * 2)])
def test_chunk_boxes_cut_a_box_into_consecutive_runs(shape, budget) -> None:
    box = tuple((1, d) if d > 2 else (0, d) for d in shape)
    chunks = chunk_boxes(box, 4, budget)
    assert all(box_volume(c) * 4 <= budget or box_volume(c) <= 1 for c in chunks)
    order = np.concatenate([_flat(c, shape) for c in chunks]) if chunks else np.array([])
    np.testing.assert_array_equal(order, _flat(box, shape))  # C order, each element once


def _bundle(tmp_path: Path) -> str:
    prefix = str(tmp_path / "b")
    save_v2(prefix, ["w", "w", "s", "v"], ["40 30 0,20:-", "40 30 20,20:-", "", ""], [W[:20], W[20:], S, W[0]])
    return prefix


@pytest.mark.parametrize("budget", [4, 100, 4 * 30 * 5, 1 << 20])
def test_recorded_reads_are_filled_by_finish(tmp_path: Path, budget: int) -> None:
    reader = FunnelledReader(_bundle(tmp_path), SingleProcessCoordinator(), 0, budget=budget)
    assert b"w" in reader and "nope" not in reader and reader.shape("w") == (40, 30)
    outs = [reader.read_region("w", ((5, 35), (3, 4))), reader.read_region("w", "10,20:0,30"), reader.read("s"),
            reader.read_region("v", None, out=np.zeros(30, np.float32))]
    replica = np.zeros((30, 1), np.float32)
    reader.read_region("w", ((5, 35), (3, 4)), out=replica)
    reader.finish()
    np.testing.assert_array_equal(outs[0], W[5:35, 3:4])
    np.testing.assert_array_equal(outs[1], W[10:30])
    assert list(outs[2]) == list(S)
    np.testing.assert_array_equal(outs[3], W[0])
    np.testing.assert_array_equal(replica, W[5:35, 3:4])
    with pytest.raises(UnsupportedError):
        reader.read_region("w")


def test_bad_requests_are_refused_while_planning(tmp_path: Path) -> None:
    reader = FunnelledReader(_bundle(tmp_path), SingleProcessCoordinator(), 0)
    with pytest.raises(NotFoundError):
        reader.read_region("nope")
    with pytest.raises(InvalidArgumentError):
        reader.read_region("w", ((0, 41), (0, 30)))
    with pytest.raises(InvalidArgumentError):
        reader.read_region("w", None, out=np.zeros((40, 30), np.float64))
    with pytest.raises(NotFoundError):
        run_funnelled(reader, lambda r: r.read_region("missing"))


@pytest.mark.parametrize("budget", [64, 1 << 20])
def test_a_corrupt_piece_is_caught_whole_or_in_chunks(tmp_path: Path, budget: int) -> None:
    prefix = _bundle(tmp_path)
    data = Path(prefix + ".data-00000-of-00001")
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x10  # inside the first slice of "w"
    data.write_bytes(bytes(raw))
    reader = FunnelledReader(prefix, SingleProcessCoordinator(), 0, budget=budget)
    reader.read_region("w")
    with pytest.raises(DataLossError, match="checksum"):
        reader.finish()


def test_the_io_client_errors_at_open(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        FunnelledReader(str(tmp_path / "none"), SingleProcessCoordinator(), 0)
    with pytest.raises(InvalidArgumentError):
        FunnelledReader(str(tmp_path / "none"), SingleProcessCoordinator(), 1)
