"""A large index is not read whole: lookups go through the SSTable's index block.

``BundleReader(load_index=False)`` (what a reader does for an index over 1 MiB) reads the
footer and the index block when it opens, then one data block per lookup. Here: the
values are the same as with the whole index read, opening reads little, and hostile
tables end in a clean error at the lookup that meets the damage (or, at the latest, at
``keys()``, which reads and checks the whole index), never in wrong values.
"""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest
from test_hostile_input import EXPECTED, MEM_BUDGET, Bundle, assemble, assert_same, block_contents, expect, parse_footer

from shardckpt.errors import CheckpointReplacedError, CorruptIndexError, NotFoundError, ShardckptError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.ordered_code import encode_tensor_name_slice
from shardckpt.format.sstable import TableReader, TableWriter, read_table
from shardckpt.io import save_v2
from shardckpt.storage.local import local_fs
from shardckpt.storage.location import Location
from shardckpt.storage.wrappers import FileSystemWrapper

MISSING = [b"", b"\x00", b"a", b"f0", b"g", b"i\x00", b"zzz", b"\xff\xff"]


class CountingFS(FileSystemWrapper):
    """Local files, with the bytes read from each path counted (identities forwarded)."""

    def __init__(self) -> None:
        super().__init__(local_fs)
        self.read: Dict[str, int] = {}
        self.whole: List[str] = []

    def identity(self, path: str, handle: Optional[int] = None) -> Tuple[object, ...]:
        return local_fs.identity(path, handle)

    def pread_into(self, handle: object, buf: memoryview, offset: int, path: str = "") -> None:
        self.read[path] = self.read.get(path, 0) + len(buf)
        local_fs.pread_into(handle, buf, offset, path)  # type: ignore[arg-type]

    def read_bytes(self, path: str) -> bytes:
        self.whole.append(path)
        return local_fs.read_bytes(path)


def _many(ckdir: Path, count: int = 300) -> Tuple[str, Dict[bytes, np.ndarray]]:
    prefix = str(ckdir / "many")
    names, specs, values = [], [], []
    want: Dict[bytes, np.ndarray] = {}
    for i in range(count):
        name = f"layer_{i // 10:03d}/w{i % 10}{'/x' * (i % 4)}"
        value = np.full((4, 3), i, dtype=np.float32)
        want[name.encode()] = value
        if i % 3 == 0:  # sliced in two
            names += [name, name]
            specs += ["4 3 0,2:-", "4 3 2,2:-"]
            values += [value[:2], value[2:]]
        else:
            names.append(name)
            specs.append("")
            values.append(value)
    save_v2(prefix, names, specs, values)
    return prefix, want


def _rewrite(prefix: str, **table_kwargs: int) -> None:
    path = prefix + ".index"
    pairs = list(read_table(Path(path).read_bytes(), path))
    table = TableWriter(**table_kwargs)
    for k, v in pairs:
        table.add(k, v)
    Path(path).write_bytes(table.finish())


@pytest.mark.parametrize("block_size,restart_interval", [(64, 1), (200, 3), (1024, 16), (4096, 40),
                                                         (262144, 16)])
def test_lookups_match_the_whole_index(tmp_path: Path, block_size: int, restart_interval: int) -> None:
    prefix, want = _many(tmp_path)
    _rewrite(prefix, block_size=block_size, restart_interval=restart_interval)
    with BundleReader(Location.of(prefix), load_index=True) as eager:
        eager_keys = eager.keys(include_slices=True)
    with BundleReader(Location.of(prefix), load_index=False) as reader:
        for key in reversed(list(want)):  # by name, before anything reads the whole index
            assert key in reader
            np.testing.assert_array_equal(reader.read(key), want[key], err_msg=repr(key))
        for key in MISSING:
            assert key not in reader
        with pytest.raises(NotFoundError):
            reader.read(b"g")
        np.testing.assert_array_equal(reader.read_region(b"layer_000/w0", "1,2:-"), want[b"layer_000/w0"][1:3])
        assert reader.keys(include_slices=True) == eager_keys
    reader.close()  # a closed reader opens the index again for a lookup
    np.testing.assert_array_equal(reader.read(b"layer_029/w7/x"), want[b"layer_029/w7/x"])


def test_opening_reads_only_the_footer_index_block_and_one_data_block(tmp_path: Path) -> None:
    prefix, want = _many(tmp_path, 3000)
    _rewrite(prefix, block_size=4096)
    index = prefix + ".index"
    size = os.path.getsize(index)
    assert size > 100_000
    fs = CountingFS()
    with BundleReader(prefix, fs=fs) as reader:  # the default reads this one whole (under 1 MiB)
        pass
    assert fs.whole == [index]
    fs = CountingFS()
    with BundleReader(prefix, fs=fs, load_index=False) as reader:
        opened = fs.read.get(index, 0)
        assert opened <= (64 << 10) + 2 * 4096, opened  # the tail (footer, index block), the header's block
        np.testing.assert_array_equal(reader.read(b"layer_150/w0"), want[b"layer_150/w0"])
        assert fs.read[index] - opened <= 2 * (4096 + 64), fs.read[index] - opened  # one or two blocks
        assert not fs.whole


def test_a_large_index_is_opened_lazily_by_default(tmp_path: Path) -> None:
    prefix = str(tmp_path / "big")
    names = [f"v{i:06d}/{'long_name_' * 6}" for i in range(16000)]
    save_v2(prefix, names, [""] * len(names), [np.array([i], np.int32) for i in range(len(names))])
    assert os.path.getsize(prefix + ".index") > 1 << 20
    fs = CountingFS()
    with BundleReader(prefix, fs=fs) as reader:
        assert reader.read(names[7777])[0] == 7777
        assert not fs.whole and fs.read[prefix + ".index"] < 1 << 20
        assert len(reader.keys()) == len(names)


def _flipped(data: bytes, pos: int) -> bytes:
    buf = bytearray(data)
    buf[pos] ^= 1 << (pos % 8)
    return bytes(buf)


def _read_by_name(prefix: str, keys: List[bytes]) -> Dict[bytes, np.ndarray]:
    """Each key by name (lookups only), then ``keys()``: the whole index is read and checked."""
    with BundleReader(Location.of(prefix), load_index=False) as reader:
        got = {k: reader.read(k) for k in keys}
        reader.keys()
    return got


@pytest.fixture
def small_blocks(tmp_path: Path) -> Bundle:
    """The hostile-input bundle with several data blocks and restart groups."""
    bundle = Bundle(str(tmp_path / "model"))
    save_v2(bundle.prefix, ["f", "i", "s", "t", "t"], ["", "", "", "4 6 0,2:-", "4 6 2,2:-"],
            [EXPECTED[b"f"], EXPECTED[b"i"], EXPECTED[b"s"], EXPECTED[b"t"][:2], EXPECTED[b"t"][2:]])
    bundle.write_pairs(bundle.pairs(), block_size=48, restart_interval=2)
    assert_same(_read_by_name(bundle.prefix, list(EXPECTED)), EXPECTED)
    return bundle


def test_every_bit_flip_is_caught(small_blocks: Bundle) -> None:
    """Lookups return the right values or a CorruptIndexError; keys() then catches the rest."""
    data = small_blocks.index_bytes()
    info = parse_footer(data)
    ignored = (info["meta_off"], info["meta_off"] + info["meta_size"] + 5)
    for pos in range(len(data)):
        small_blocks.write_index_bytes(_flipped(data, pos))
        try:
            with BundleReader(Location.of(small_blocks.prefix), load_index=False) as reader:
                for key, value in EXPECTED.items():
                    try:
                        got = reader.read(key)
                    except (CorruptIndexError, NotFoundError) as exc:  # NotFound: a flip in a separator
                        assert small_blocks.index_path in str(exc) or small_blocks.prefix in str(exc)
                    else:
                        np.testing.assert_array_equal(got, value)
        except CorruptIndexError as exc:
            assert small_blocks.index_path in str(exc)
        unused = ignored[0] <= pos < ignored[1] or info["footer"] <= pos < info["meta_handle_end"] or \
            info["handles_end"] <= pos < len(data) - 8  # the metaindex, its handle, the padding: as in TF
        same_value = info["footer"] <= pos < info["handles_end"] and pos % 8 == 7  # a non-canonical varint
        if not unused and not same_value:
            expect((CorruptIndexError, NotFoundError),
                   lambda: _read_by_name(small_blocks.prefix, list(EXPECTED)), names=[small_blocks.index_path])


def test_every_truncation_is_caught(small_blocks: Bundle) -> None:
    data = small_blocks.index_bytes()
    for cut in range(len(data)):
        small_blocks.write_index_bytes(data[:cut])
        expect((CorruptIndexError, NotFoundError), lambda: _read_by_name(small_blocks.prefix, list(EXPECTED)),
               names=[small_blocks.index_path])


@pytest.mark.parametrize("layout", ["one_group", "across_groups", "across_blocks"])
def test_keys_out_of_order(small_blocks: Bundle, layout: str) -> None:
    pairs = small_blocks.pairs()  # "", slices..., f, i, s, t
    keyed = dict(pairs)
    bad = pairs[:3] + [(b"i", keyed[b"i"]), (b"f", keyed[b"f"]), (b"s", keyed[b"s"]), (b"t", keyed[b"t"])]
    if layout == "one_group":
        blocks = [block_contents(bad, restart_interval=16)]
    elif layout == "across_groups":
        blocks = [block_contents(bad, restart_interval=4)]  # "i" ends a group, "f" starts the next
    else:
        blocks = [bad[:4], bad[4:]]
    small_blocks.write_index_bytes(assemble(blocks))
    for key in [b"f", b"i", b"s", b"t"]:  # each lookup alone: a clean error or the right value
        try:
            np.testing.assert_array_equal(_read_by_name_only(small_blocks.prefix, key), EXPECTED[key])
        except (CorruptIndexError, NotFoundError) as exc:
            assert small_blocks.prefix in str(exc)
    expect(CorruptIndexError, lambda: _read_by_name(small_blocks.prefix, [b"t"]), names=[small_blocks.index_path])


def _read_by_name_only(prefix: str, key: bytes) -> np.ndarray:
    with BundleReader(Location.of(prefix), load_index=False) as reader:
        return reader.read(key)


def test_restart_points_that_lie(small_blocks: Bundle) -> None:
    pairs = small_blocks.pairs()
    good = bytearray(block_contents(pairs, restart_interval=2))
    count = int.from_bytes(good[-4:], "little")
    for i in range(1, count):
        for delta in (-1, 1, 3):
            bad = bytearray(good)
            at = len(bad) - 4 - 4 * count + 4 * i
            bad[at:at + 4] = (int.from_bytes(bad[at:at + 4], "little") + delta).to_bytes(4, "little")
            small_blocks.write_index_bytes(assemble([bytes(bad)]))
            expect((CorruptIndexError, NotFoundError), lambda: _read_by_name(small_blocks.prefix, list(EXPECTED)),
                   names=[small_blocks.prefix])


def test_prefix_compression_bomb_in_one_lookup(small_blocks: Bundle) -> None:
    from test_hostile_input import varint
    buf = bytearray(block_contents([small_blocks.pairs()[0]]))[:-8]
    key_len = 0
    for _ in range(20_000):
        buf += varint(key_len) + varint(1) + varint(0) + b"a"
        key_len += 1
    buf += (0).to_bytes(4, "little") + (1).to_bytes(4, "little")
    small_blocks.write_index_bytes(assemble([bytes(buf)]))
    tracemalloc.start()
    start = time.monotonic()
    try:
        with BundleReader(Location.of(small_blocks.prefix), load_index=False) as reader:
            assert b"a" * 300 not in reader
    except CorruptIndexError as exc:
        assert small_blocks.index_path in str(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - start < 5
    assert peak < 2 * MEM_BUDGET, f"{peak / 2**20:.0f} MiB"


def test_index_rewritten_in_place_after_opening(small_blocks: Bundle) -> None:
    data = small_blocks.index_bytes()
    reader = BundleReader(Location.of(small_blocks.prefix), load_index=False)
    try:
        with open(small_blocks.index_path, "r+b") as f:  # same inode, new contents and mtime
            f.write(bytes(len(data) - 48))
        os.utime(small_blocks.index_path, ns=(time.time_ns(), time.time_ns() + 10 ** 9))
        expect(CheckpointReplacedError, lambda: reader.read(b"t"), names=[small_blocks.index_path])
    finally:
        reader.close()


def test_index_replaced_by_rename_after_opening_keeps_reading_the_opened_one(small_blocks: Bundle) -> None:
    reader = BundleReader(Location.of(small_blocks.prefix), load_index=False)
    try:
        other = small_blocks.index_path + ".new"
        Path(other).write_bytes(TableWriter().finish())
        os.replace(other, small_blocks.index_path)
        np.testing.assert_array_equal(reader.read(b"t"), EXPECTED[b"t"])  # the open file is the old one
    finally:
        reader.close()


def test_table_reader_alone() -> None:
    table = TableWriter(block_size=100, restart_interval=3)
    pairs = [(f"k{i:05d}".encode(), bytes([i % 256]) * (i % 7)) for i in range(2000)]
    for k, v in pairs:
        table.add(k, v)
    data = table.finish()
    reads: List[Tuple[int, int]] = []

    def read(offset: int, size: int) -> bytes:
        reads.append((offset, size))
        return data[offset:offset + size]

    reader = TableReader(read, len(data), "<t>", cache_bytes=1000)
    assert reader.num_blocks > 100 and len(reads) == 1
    for k, v in pairs[::-7]:
        assert reader.get(k) == v
    for k in [b"", b"k", b"k00000\x00", b"k01999\x00", b"z"]:
        assert reader.get(k) is None
    with pytest.raises(ShardckptError):
        TableReader(read, len(data) - 1, "<t>")


def test_lookups_on_an_object_store() -> None:
    """fsspec's memory:// store: ranged reads of the index, its identity (size, ETag-like) checked."""
    prefix = "memory://lazy-index-test/ck/model"
    names = [f"v{i:04d}" for i in range(400)]
    save_v2(prefix, names, [""] * len(names), [np.full((3,), i, np.int64) for i in range(len(names))])
    _rewrite_store(prefix)
    with BundleReader(Location.of(prefix), load_index=False) as reader:
        for i in (0, 123, 399):
            np.testing.assert_array_equal(reader.read(names[i]), np.full((3,), i, np.int64))
        assert b"v0400" not in reader
        assert len(reader.keys()) == len(names)


def _rewrite_store(prefix: str) -> None:
    from shardckpt.storage.registry import get_fs

    fs = get_fs(prefix)
    path = prefix + ".index"
    pairs = list(read_table(fs.read_bytes(path), path))
    table = TableWriter(block_size=512)
    for k, v in pairs:
        table.add(k, v)
    fs.write_atomic(path, table.finish())


def test_a_region_read_looks_up_only_the_slices_it_overlaps(tmp_path: Path) -> None:
    """One client's rows of a tensor sliced 200 ways: a few blocks of the index, not all of them."""
    prefix = str(tmp_path / "sliced")
    full = np.arange(400 * 3, dtype=np.float32).reshape(400, 3)
    save_v2(prefix, ["w"] * 200, [f"400 3 {2 * i},2:-" for i in range(200)],
            [full[2 * i:2 * i + 2] for i in range(200)])
    _rewrite(prefix, block_size=256)
    index = prefix + ".index"
    fs = CountingFS()
    with BundleReader(prefix, fs=fs, load_index=False) as reader:
        opened = fs.read[index]
        np.testing.assert_array_equal(reader.read_region("w", ((100, 104), (0, 3))), full[100:104])
        # the block of the entry (its 200 slice specs: ~2 KiB) and the one or two of the slices read
        assert fs.read[index] - opened <= 4096, fs.read[index] - opened
        np.testing.assert_array_equal(reader.read("w"), full)  # all 200 slices
    bundle = Bundle(prefix)
    bundle.drop(encode_tensor_name_slice(b"w", [(398, 2), (0, -1)]))  # the last slice's entry is gone
    with BundleReader(Location.of(prefix), load_index=False) as reader:
        np.testing.assert_array_equal(reader.read_region("w", ((0, 2), (0, 3))), full[:2])
        with pytest.raises(CorruptIndexError, match="398,2"):
            reader.read("w")
