"""Large entries placed half a page from where load destinations start (``page_phase``).

shardckpt's own saves to local files (the rename committer) start every numeric entry of
at least ``PHASE_MIN_BYTES`` at ``PAGE_PHASE`` bytes past a 4 KiB boundary of its data
file, zero bytes before it; smaller entries stay packed, TF-compatible ``BundleWriter``
use (``page_phase=None``) and incremental saves stay packed. Readers (ours, TensorFlow's,
``dcp.load`` through ``TFBundleReader``) go by each entry's offset and see the same values;
a flipped byte in a placed entry is still a DataLossError naming the key and the file,
and the gap bytes are named by no entry.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from helpers.files import flip_byte as _flip

import shardckpt
from shardckpt import CheckpointOptions
from shardckpt.cli.main import main as cli_main
from shardckpt.errors import DataLossError, InvalidArgumentError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.bundle_writer import PAGE_PHASE, PHASE_MIN_BYTES, BundleWriter
from shardckpt.storage.location import Location

DATA = ".data-00000-of-00001"


def _state() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {  # saved in key order: small ones between large ones, sizes that leave odd ends
        "a_small": rng.standard_normal(1000).astype(np.float32),
        "b_large": rng.standard_normal(PHASE_MIN_BYTES // 4 + 3).astype(np.float32),
        "c_tiny": np.arange(7, dtype=np.int16),
        "d_large": rng.standard_normal((300, 1000)).astype(np.float64),
        "e_just_below": rng.integers(0, 255, PHASE_MIN_BYTES - 1, dtype=np.uint8),
        "f_large": rng.standard_normal(PHASE_MIN_BYTES // 2).astype(np.float16),
        "g_text": np.array([b"hello", b"world"], dtype=object),
    }


def _layout(prefix: str) -> List[tuple]:
    with BundleReader(Location.of(prefix)) as reader:
        return sorted((int(reader.entry(k).offset), int(reader.entry(k).size), k.decode()) for k in reader.keys())


def test_large_entries_start_at_the_page_phase_and_read_back_exactly(tmp_path: Path, tf_oracle) -> None:
    state = _state()
    prefix = str(tmp_path / "ck")
    shardckpt.save_tensors(prefix, state)
    layout = _layout(prefix)
    end = 0
    for offset, size, key in layout:
        if key in ("b_large", "d_large", "f_large"):
            assert size >= PHASE_MIN_BYTES and offset % 4096 == PAGE_PHASE, (key, offset)
            assert 0 <= offset - end < 4096, key  # at most one page of zeros before it
        else:
            assert offset == end, key  # small entries stay packed after the previous one
        end = offset + size
    gaps = [(e0 + s0, o1) for (e0, s0, _), (o1, _, _) in zip(layout, layout[1:]) if o1 > e0 + s0]
    assert gaps, "the large entries needed padding"
    data = Path(prefix + DATA).read_bytes()
    assert all(data[a:b] == bytes(b - a) for a, b in gaps)  # zero bytes, named by no entry
    with shardckpt.load_checkpoint(prefix) as reader:
        for key, value in state.items():
            got = reader.get_tensor(key)
            if value.dtype == object:
                assert list(got) == list(value), key
            else:
                assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), key
    tensors, errors, _ = tf_oracle.load_checkpoint(prefix)  # TensorFlow reads every entry by its offset
    assert not errors
    for key, value in state.items():
        if value.dtype == object:
            assert list(tensors[key].reshape(-1)) == list(value), key
        else:
            assert tensors[key].tobytes() == value.tobytes(), key
    assert cli_main(["verify", prefix]) == 0
    gap_start, _ = gaps[0]
    _flip(prefix + DATA, gap_start)  # a gap byte belongs to no entry: nothing to detect
    assert cli_main(["verify", prefix]) == 0
    with BundleReader(Location.of(prefix)) as reader:
        entry = reader.entry("d_large")
    _flip(prefix + DATA, int(entry.offset) + int(entry.size) // 2)
    with BundleReader(Location.of(prefix)) as reader:
        with pytest.raises(DataLossError, match="checksum does not match") as caught:
            reader.read("d_large")
    assert "d_large" in str(caught.value) and caught.value.path.endswith(DATA)


def test_tensorflow_compatible_writer_and_incremental_saves_stay_packed(tmp_path: Path) -> None:
    state = _state()
    plain = str(tmp_path / "plain")
    with BundleWriter(Location.of(plain)) as writer:  # TF's layout: entries back to back in the order added
        for key in sorted(state):
            writer.add(key, state[key])
    incremental = str(tmp_path / "inc")
    shardckpt.save_tensors(incremental, state, CheckpointOptions(incremental=True))
    for prefix in (plain, incremental):
        end = 0
        for offset, size, key in _layout(prefix):
            assert offset == end, (prefix, key)
            end = offset + size
    with pytest.raises(InvalidArgumentError, match="page_phase"):
        BundleWriter(Location.of(str(tmp_path / "bad")), page_phase=4096)


def test_dcp_load_of_placed_chunks_into_torch_tensors(tmp_path: Path) -> None:
    """A torch state dict saved through TFBundleWriter (one process): its large chunks are placed at
    the phase, a load into existing tensors is exact, and a flipped byte names the key and file."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardckpt.torch import TFBundleReader, TFBundleWriter

    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.randn(700, 1024, generator=g), "small": torch.randn(10, generator=g),
          "half": torch.randn(600, 1000, generator=g).to(torch.bfloat16), "step": 3}
    prefix = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(sd, storage_writer=TFBundleWriter(prefix), no_dist=True)
        layout = {key: (offset, size) for offset, size, key in _layout(str(prefix))}
        assert layout["big"][0] % 4096 == PAGE_PHASE and layout["half"][0] % 4096 == PAGE_PHASE
        target = {"big": torch.zeros(700, 1024), "small": torch.zeros(10),
                  "half": torch.zeros(600, 1000, dtype=torch.bfloat16), "step": 0}
        dcp.load(target, storage_reader=TFBundleReader(prefix), no_dist=True)
        for key in ("big", "small", "half"):
            assert torch.equal(target[key], sd[key]), key
        assert target["step"] == 3
        data_file = str(prefix) + DATA
        _flip(data_file, layout["half"][0] + 12345)
        with pytest.raises(CheckpointException) as caught:  # DCP's wrapper of a rank's failure
            dcp.load(target, storage_reader=TFBundleReader(prefix), no_dist=True)
    message = str(caught.value)
    assert "checksum does not match" in message and "'half'" in message and data_file in message
