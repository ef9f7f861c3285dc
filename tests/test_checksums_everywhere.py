"""Every read of a whole entry compares its CRC32C with the index's (issue 24, section 5).

One byte of one entry's bytes is flipped in its data file (or data object on the test S3
server); every read path that reads whole entries must then raise ``DataLossError`` naming
the key and the file, never return the flipped value:

* the front doors on an object store: ``restore_tensors``, ``Checkpoint.restore``,
  ``shardckpt.jax.restore`` and a DCP load through ``TFBundleReader``;
* each place a comparison is made (``format/bundle_reader.py``, ``format/whole_reads.py``,
  ``restoring/funnel.py``, ``format/strings.py``), reached through the read paths that
  lead there: a local read through the read pump (in a session, and alone), a read of one unit
  alone, the store-sized units of object stores (in a session and alone), a guided read (a huge-page
  map of the file), reads with run maps or io_uring switched on (which serve only parts of
  entries: whole entries under them still go through the pump), a funnelled restore (whole,
  and in chunks), and string entries.

Each comparison was switched off once by hand; these cases failed (all others passed):

* ``EntryRead.mismatch`` (``whole_reads.py``: the read pump, local files): ``local-session-pump``,
  ``local-pump-alone``, ``maps-on``, ``io-uring-on``, ``funnelled-whole`` and the guided case;
* ``WholeEntries.check_read`` (``read_session.py``) (one request alone; an object store's entries up to its request size
  outside a session): ``local-one-unit``, the object store's ``alone-large``/``alone-small``, and
  ``shardckpt.jax.restore`` from S3;
* ``EntryJob.finish`` (an object store's entries in a session): ``restore_tensors``,
  ``Checkpoint.restore`` and the DCP load from S3, and the object store's ``session`` case;
* ``funnel_restore._Check`` (a piece funnelled in chunks): ``funnelled-chunks``;
* ``strings.decode_strings``: ``local-strings`` and the object store's ``strings``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Dict

import numpy as np
import pytest

import shardckpt
from shardckpt.distributed.single import SingleProcessCoordinator
from shardckpt.errors import DataLossError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.restoring.funnel import FunnelledReader
from shardckpt.storage import get_fs, guided, uring
from shardckpt.storage.local import LocalFileSystem
from shardckpt.storage.location import Location

MIB = 1 << 20
LARGE = 3 * MIB // 4  # float32 elements: a 3 MiB entry, read in several units / pump spans
SMALL = 1024  # a 4 KiB entry, read in one request


def _values() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(24)
    return {"w": rng.standard_normal(LARGE).astype(np.float32), "b": rng.standard_normal(SMALL).astype(np.float32),
            "s": np.array([b"alpha", b"", b"gamma" * 40], dtype=object)}


def _flip(prefix: str, key: str, fs: Any = None) -> str:
    """Flip one byte in the middle of ``key``'s stored bytes; return the data file's path."""
    fs = fs or get_fs(prefix)
    with BundleReader(prefix, fs=fs) as reader:
        entry = reader.entry(key)
        path = reader.data_path(entry.shard_id)
        at = int(entry.offset) + int(entry.size) // 2 + 3
    data = bytearray(fs.read_bytes(path))
    data[at] ^= 0x10
    fs.write_atomic(path, bytes(data))
    return path


def _names(exc: DataLossError, key: str, path: str) -> None:
    message = str(exc)
    assert "checksum does not match" in message, message
    assert f"key '{key}'" in message and path in message, message
    assert exc.path == path


def _saved(where: str, key: str) -> str:
    prefix = f"{where}/ck"
    shardckpt.save_tensors(prefix, _values())
    return prefix


# -- the front doors, on the test S3 server ----------------------------------------------------

@pytest.mark.parametrize("key", ["w", "b"], ids=["large", "small"])
def test_restore_tensors_from_s3_refuses_a_flipped_byte(s3dir: str, key: str) -> None:
    prefix = _saved(s3dir, key)
    path = _flip(prefix, key)
    with pytest.raises(DataLossError) as caught:
        shardckpt.restore_tensors(prefix, ["w", "b"])
    _names(caught.value, key, path)


@pytest.mark.parametrize("name", ["w", "b"], ids=["large", "small"])
def test_checkpoint_restore_from_s3_refuses_a_flipped_byte(s3dir: str, name: str) -> None:
    values = _values()
    model = shardckpt.Module()
    model.w = shardckpt.Variable(values["w"])
    model.b = shardckpt.Variable(values["b"])
    prefix = f"{s3dir}/ck"
    shardckpt.Checkpoint(model=model).write(prefix)
    key = f"model/{name}/.ATTRIBUTES/VARIABLE_VALUE"
    path = _flip(prefix, key)
    target = shardckpt.Module()
    target.w = shardckpt.Variable(np.zeros_like(values["w"]))
    target.b = shardckpt.Variable(np.zeros_like(values["b"]))
    with pytest.raises(DataLossError) as caught:
        shardckpt.Checkpoint(model=target).restore(prefix)
    _names(caught.value, key, path)


@pytest.mark.parametrize("name", ["w", "b"], ids=["large", "small"])
def test_jax_restore_from_s3_refuses_a_flipped_byte(s3dir: str, name: str) -> None:
    import jax.numpy as jnp

    import shardckpt.jax as sj

    values = _values()
    prefix = f"{s3dir}/ck"
    sj.save(prefix, {"w": jnp.asarray(values["w"]), "b": values["b"]})
    with BundleReader(Location.of(prefix)) as reader:
        key = next(k.decode() for k in reader.keys() if k.decode().split("/")[-1] == name
                   or k.decode().startswith(name + "/") or k.decode() == name)
    path = _flip(prefix, key)
    with pytest.raises(DataLossError) as caught:
        sj.restore(prefix, {"w": jnp.zeros(LARGE, jnp.float32), "b": np.zeros(SMALL, np.float32)})
    _names(caught.value, key, path)


def _dcp_error(prefix: str, **reader_options: Any) -> DataLossError:
    """A DCP load of ``w`` and ``b``: the DataLossError it raised (DCP may wrap it in its CheckpointException)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardckpt.torch import TFBundleReader

    state = {"w": torch.zeros(LARGE), "b": torch.zeros(SMALL)}
    with pytest.raises(BaseException) as caught:
        dcp.load(state, storage_reader=TFBundleReader(prefix, **reader_options), no_dist=True)
    exc: Any = caught.value
    if not isinstance(exc, DataLossError):  # torch's CheckpointException: rank -> (exception, traceback)
        found = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
        found = [f for f in found if isinstance(f, DataLossError)]
        assert found, repr(exc)
        exc = found[0]
    return exc


@pytest.mark.parametrize("key", ["w", "b"], ids=["large", "small"])
def test_dcp_load_from_s3_refuses_a_flipped_byte(s3dir: str, key: str) -> None:
    prefix = _saved(s3dir, key)
    path = _flip(prefix, key)
    _names(_dcp_error(prefix), key, path)


# -- every comparison, through every read path that reaches it --------------------------------

def _local_session(prefix: str) -> None:
    shardckpt.restore_tensors(prefix, ["w", "b", "s"])


def _reader_read(key: str, fs: Any = None) -> Callable[[str], None]:
    def read(prefix: str) -> None:
        with BundleReader(Location.of(prefix, fs)) as reader:
            reader.read(key)
    return read


def _with_fs(fs: LocalFileSystem) -> Callable[[str], None]:
    def read(prefix: str) -> None:
        with BundleReader(prefix, fs=fs) as reader:
            shardckpt.restore_tensors(prefix, ["w", "b", "s"], reader=reader)
    return read


def _funnelled(budget: int, key: str) -> Callable[[str], None]:
    def read(prefix: str) -> None:
        reader = FunnelledReader(prefix, SingleProcessCoordinator(), 0, budget=budget)
        reader.read_region(key)
        reader.finish()
    return read


# (case, key flipped, the read): each comparison is reached by at least one case
PATHS: Dict[str, Any] = {
    "local-session-pump": ("w", _local_session),  # EntryRead.mismatch via WholeEntries.check_entry (session)
    "local-pump-alone": ("w", _reader_read("w")),  # EntryRead.mismatch via check_entry (a pump of its own)
    "local-one-unit": ("b", _reader_read("b")),  # WholeEntries.check_read
    "local-strings": ("s", _reader_read("s")),  # strings.decode_strings
    "maps-on": ("w", _with_fs(LocalFileSystem(map_runs=True))),
    "io-uring-on": ("w", _with_fs(LocalFileSystem(map_runs=False, ring_runs=True))),
    "funnelled-whole": ("w", _funnelled(64 * MIB, "w")),  # funnel_restore._Check
    "funnelled-chunks": ("w", _funnelled(64 << 10, "w")),
}


@pytest.mark.parametrize("case", sorted(PATHS))
def test_every_local_read_path_refuses_a_flipped_byte(tmp_path: Path, case: str) -> None:
    key, read = PATHS[case]
    if case == "io-uring-on" and not uring.available():
        warnings.warn("io_uring is not available here: the io-uring-on case read with preadv instead", stacklevel=1)
    prefix = _saved(str(tmp_path), key)
    shardckpt.restore_tensors(prefix, ["w", "b", "s"])  # intact: reads fine
    path = _flip(prefix, key)
    with pytest.raises(DataLossError) as caught:
        read(prefix)
    _names(caught.value, key, path)


@pytest.mark.parametrize("case", ["session", "alone-large", "alone-small", "strings"])
def test_every_object_store_read_path_refuses_a_flipped_byte(s3dir: str, case: str) -> None:
    """Object stores read whole entries in units of their request size (``EntryJob``), or one small read."""
    key = {"session": "w", "alone-large": "w", "alone-small": "b", "strings": "s"}[case]
    prefix = _saved(s3dir, key)
    assert get_fs(prefix).read_step is not None  # the unit path
    path = _flip(prefix, key)
    with pytest.raises(DataLossError) as caught:
        if case == "session":
            shardckpt.restore_tensors(prefix, ["w", "b"])
        else:
            _reader_read(key)(prefix)
    _names(caught.value, key, path)


def test_a_guided_read_refuses_a_flipped_byte(tmp_path: Path) -> None:
    """A partial restore that leaves gaps in a file is read through a guide (a huge-page map of the file,
    :mod:`shardckpt.storage.guided`) where the platform has them; its whole entries are compared too."""
    rng = np.random.default_rng(1)
    values = {f"t{i}": rng.standard_normal(MIB).astype(np.float32) for i in range(6)}  # 4 MiB each
    prefix = str(tmp_path / "ck")
    shardckpt.save_tensors(prefix, values)
    path = _flip(prefix, "t2")
    fs = LocalFileSystem()
    before = fs.guided_bytes
    with BundleReader(prefix, fs=fs) as reader:
        with pytest.raises(DataLossError) as caught:
            shardckpt.restore_tensors(prefix, ["t0", "t2", "t4"], reader=reader)  # gaps: t1, t3, t5
    _names(caught.value, "t2", path)
    if not guided.available():
        warnings.warn("no transparent huge pages here: the guided case read through the descriptor", stacklevel=1)
    elif fs.guided_bytes == before:
        warnings.warn(f"this file system ({tmp_path}) gets no guides (no large page-cache pages): the "
                      "guided case read through the descriptor instead", stacklevel=1)
