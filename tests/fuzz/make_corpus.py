"""Write the seed corpora under ``corpus/<harness>/`` from the library's own writers (run once; seeds are committed).

``python tests/fuzz/make_corpus.py`` replaces the seeds with freshly written ones (``regression-*``
seeds, inputs that once found a bug, are kept).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import _common
import numpy as np


def _put(name: str, data: bytes) -> None:
    folder = os.path.join(_common.CORPUS, name)
    os.makedirs(folder, exist_ok=True)
    _common.write(os.path.join(folder, hashlib.sha1(data).hexdigest()[:16]), data)


def _bundles(tmp: str) -> list:
    from shardckpt.format.bundle_writer import BundleWriter
    from shardckpt.io import save_v2
    from shardckpt.storage.location import Location

    out = []
    p = os.path.join(tmp, "a")
    save_v2(p, ["f", "i", "s", "t", "t"], ["", "", "", "4 6 0,2:-", "4 6 2,2:-"],
            [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, -2, 2 ** 40], np.int64),
             np.array([b"x", b"yy", b""], dtype=object), np.ones((2, 6), np.float32), np.zeros((2, 6), np.float32)])
    out.append(p)
    p = os.path.join(tmp, "b")
    with BundleWriter(Location.of(p), big_endian=True) as w:
        w.add("h", np.arange(6, dtype=np.float16).reshape(2, 3))
        w.add("b", np.array([True, False]))
        w.add("c", np.array([1 + 2j], np.complex64))
        w.add("scalar", np.float64(3.5))
        w.add("empty", np.zeros((0, 3), np.int32))
    out.append(p)
    p = os.path.join(tmp, "c")
    with BundleWriter(Location.of(p)) as w:
        w.add_slice("m", (4, 6), "-:0,3", np.ones((4, 3), np.int16))
        w.add_slice("m", (4, 6), "-:3,3", np.zeros((4, 3), np.int16))
        for i in range(40):  # several index blocks
            w.add(f"layer_{i:02d}/kernel", np.full((2, 2), i, np.uint8))
    out.append(p)
    return out


def _converters(tmp: str, prefix: str) -> None:
    """Seeds for the safetensors, npz and HF-folder readers, written by the converters (and NumPy)."""
    from shardckpt.convert import convert
    from shardckpt.convert.hf import INDEX_NAME

    values = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, -2], np.int64),
              "h": np.ones((2, 0), np.float16), "s": np.float64(2.5), "u": np.array([True, False])}
    st = os.path.join(tmp, "x.safetensors")
    convert(prefix, st, dst_format="safetensors")
    _put("safetensors", open(st, "rb").read())
    convert(prefix, st, dst_format="safetensors", strings="metadata")  # a string tensor in __metadata__
    _put("safetensors", open(st, "rb").read())
    for name, writer in (("plain.npz", np.savez), ("deflated.npz", np.savez_compressed)):
        path = os.path.join(tmp, name)
        writer(path, **values)
        _put("npz", open(path, "rb").read())
    npz = os.path.join(tmp, "conv.npz")
    convert(prefix, npz, dst_format="npz")
    _put("npz", open(npz, "rb").read())
    hf = os.path.join(tmp, "hf")
    convert(prefix, hf, dst_format="hf", max_shard_size=1 << 30)
    shards = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    index_bytes = open(os.path.join(hf, INDEX_NAME), "rb").read()
    _put("hf_index", _common.pack_files(index_bytes, open(os.path.join(hf, shards[0]), "rb").read()))
    header = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    header += b" " * (-len(header) % 8)
    _put("hf_index", _common.pack_files(b'{"metadata": {"total_size": 8, "x": [1]}, "weight_map": '
                                        b'{"a": "model-00001-of-00001.safetensors"}}',
                                        len(header).to_bytes(8, "little") + header + b"\0" * 8))


def main() -> None:
    import shardckpt
    from shardckpt.checkpoint.state import update_checkpoint_state

    for name in ("sstable", "bundle", "object_graph", "state_file", "safetensors", "npz", "hf_index"):
        folder = os.path.join(_common.CORPUS, name)
        for seed in os.listdir(folder) if os.path.isdir(folder) else []:
            if not seed.startswith("regression-"):  # what fuzzing found stays
                os.remove(os.path.join(folder, seed))
    tmp = tempfile.mkdtemp()
    try:
        for prefix in _bundles(tmp):
            index = open(prefix + ".index", "rb").read()
            data = open(prefix + ".data-00000-of-00001", "rb").read()
            _put("sstable", index)
            _put("bundle", _common.pack_files(index, data))
        conv = os.path.join(tmp, "conv")
        os.makedirs(conv)
        _converters(conv, _bundles(conv)[0])
        from shardckpt.format.bundle_reader import BundleReader
        from shardckpt.storage.location import Location

        for extra in ({}, {"w": shardckpt.Variable(np.ones((2, 2), np.float32))}):
            ck = shardckpt.Checkpoint(v=shardckpt.Variable(np.arange(3, dtype=np.float32)), **extra)
            prefix = ck.write(os.path.join(tmp, f"ck{len(extra)}"))
            with BundleReader(Location.of(prefix)) as reader:
                _put("object_graph", reader.read("_CHECKPOINTABLE_OBJECT_GRAPH").item())
        state_dir = os.path.join(tmp, "state")
        os.makedirs(state_dir)
        update_checkpoint_state(state_dir, "ckpt-3", ["ckpt-1", "ckpt-2", "ckpt-3"])
        _put("state_file", open(os.path.join(state_dir, "checkpoint"), "rb").read())
        _put("state_file", b'model_checkpoint_path: "/abs/ckpt-9"\nall_model_checkpoint_timestamps: 1.5\n'
                           b'last_preserved_timestamp: 2.0\n')
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
