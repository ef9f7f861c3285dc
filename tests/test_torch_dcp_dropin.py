"""TFBundleWriter / TFBundleReader as a drop-in for DCP's FileSystemWriter / FileSystemReader (issue 26).

One 4-rank ``torchrun`` launch of tests/helpers/torch_dcp_dropin_worker.py (gloo, CPU); each
test checks one section of it (the worker's docstring says what each does), then what is on
disk. One-process cases of the same behaviour follow.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_torch_dcp import assert_done, launch

from shardckpt.errors import InvalidArgumentError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.location import Location
from shardckpt.torch import TFBundleReader, TFBundleWriter

HERE = Path(__file__).resolve().parent
WORKER = HERE / "helpers" / "torch_dcp_dropin_worker.py"
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


@pytest.fixture(scope="module")
def dropin(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The ``dropin4`` launch: its data folder and each rank's checks."""
    tmp = tmp_path_factory.mktemp("torch_dcp_dropin")
    data = tmp / "data"
    rc, results, tail = launch("dropin4", 4, data, tmp, worker=WORKER)
    return {"data": data, "rc": rc, "results": results, "tail": tail}


def _checks(dropin: Dict[str, Any], prefix: str, ranks: Any = range(4)) -> Dict[int, Dict[str, bool]]:
    """Each rank's checks named ``prefix*``; the launch must have got past them."""
    results = dropin["results"]
    for r in ranks:
        res = results[r]
        got = {k: v for k, v in res.get("checks", {}).items() if k.startswith(prefix)}
        assert got and all(got.values()), (r, prefix, res.get("fatal", ""), dropin["tail"][-3000:])
    return {r: results[r]["checks"] for r in ranks}


def test_launch_completes(dropin: Dict[str, Any]) -> None:
    assert_done(dropin["rc"], dropin["results"], dropin["tail"])


def test_no_dist_on_one_rank_does_nothing_collective(dropin: Dict[str, Any]) -> None:
    """Rank 0 alone saves and loads (``no_dist=True``) as the job's first DCP call; ranks 1-3 at a barrier."""
    checks = _checks(dropin, "solo_", ranks=[0])
    assert set(k for k in checks[0] if k.startswith("solo_")) == {"solo_load_fixture", "solo_sync", "solo_async"}
    for name in ("sync", "async"):
        assert sorted(p.name for p in (dropin["data"] / "solo" / name).iterdir()) == [
            "checkpoint", "ckpt.data-00000-of-00001", "ckpt.index"]


def test_process_group_pairs_save_and_load_their_own(dropin: Dict[str, Any]) -> None:
    """Ranks {0,1} and {2,3} with ``process_group=`` their pair: sync, thread and PROCESS saves, two loads each."""
    checks = _checks(dropin, "pairs_")
    assert all(len([k for k in c if k.startswith("pairs_")]) == 6 for c in checks.values())
    for how in ("sync", "async", "process"):
        for pair in (0, 1):
            folder = dropin["data"] / "pairs" / how / f"pair{pair}"
            assert sorted(p.name for p in folder.iterdir()) == [
                "checkpoint", "ckpt.data-00000-of-00002", "ckpt.data-00001-of-00002", "ckpt.index"], folder
            with BundleReader(Location.of(str(folder / "ckpt"))) as reader:
                keys = {k.decode() for k in reader.keys()}
                assert keys == {"_DCP_NESTING", "model.w", "model.own0", "model.own1", "step"}
                w = reader.read(b"model.w")
            scale = {"sync": 1, "async": 2, "process": 3}[how]
            assert np.array_equal(w, (np.arange(48.0, dtype=np.float32).reshape(8, 6) + 100 * pair) * scale)


def test_checkpoint_id_is_a_directory(dropin: Dict[str, Any], tf_oracle: Any) -> None:
    """``checkpoint_id`` -> the bundle inside the directory, with the state file TensorFlow follows."""
    _checks(dropin, "dir_")
    _checks(dropin, "prefix_still_a_prefix")
    dirs = dropin["data"] / "dirs"
    assert sorted(p.name for p in dirs.iterdir()) == ["existing", "new"] + [
        f"pre.data-0000{i}-of-00004" for i in range(4)] + ["pre.index", "slash"]
    for name in ("new/step-100", "existing", "slash"):
        folder = dirs / name
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoint"] + [
            f"ckpt.data-0000{i}-of-00004" for i in range(4)] + ["ckpt.index"]
        got, errors, dtypes = tf_oracle.load_checkpoint(folder)  # tf.train.load_checkpoint(directory)
        assert not errors and np.array_equal(got["model.w"], np.arange(64.0, dtype=np.float32).reshape(8, 8))


def test_loads_without_target_keep_the_nesting(dropin: Dict[str, Any]) -> None:
    _checks(dropin, "nesting_all")
    _checks(dropin, "nesting_model")
    _checks(dropin, "nesting_no_dist", ranks=[0])


def test_empty_saves(dropin: Dict[str, Any]) -> None:
    _checks(dropin, "empty_")
    for name in ("plain", "stateful"):
        with BundleReader(Location.of(str(dropin["data"] / "empty" / name / "ckpt"))) as reader:
            assert [k.decode() for k in reader.keys()] == ["_DCP_NESTING"]


def test_values_keep_their_type_or_are_refused(dropin: Dict[str, Any]) -> None:
    checks = _checks(dropin, "type_")
    assert len([k for k in checks[0] if k.startswith("type_")]) == 12
    _checks(dropin, "refused_")


def test_filesystem_writer_options(dropin: Dict[str, Any]) -> None:
    _checks(dropin, "option_")
    options = dropin["data"] / "options"
    # thread_count=3: up to 3 data files a rank (4 tensors of 4 chunks: 3 files on each of the 4 ranks)
    assert len(list((options / "threads").glob("ckpt.data-*"))) == 12
    # single_file_per_rank=False: one data file per key of each rank (4 keys x 4 ranks; rank 0 also the nesting)
    assert len(list((options / "per_key").glob("ckpt.data-*"))) == 17


# -- one process ------------------------------------------------------------------------------------------

def test_one_process_directory_nesting_empty_and_types(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder = tmp_path / "step-1"
    sd = {"model": {"w": torch.arange(4.0)}, "meta": {"size": torch.Size([4]), "io": io.BytesIO(b"xy")}}
    dcp.save(sd, checkpoint_id=folder, storage_writer=TFBundleWriter())
    assert (folder / "checkpoint").read_text().startswith('model_checkpoint_path: "ckpt"')
    nested = _load_state_dict_from_keys("model", checkpoint_id=folder, storage_reader=TFBundleReader())
    assert set(nested) == {"model"} and torch.equal(nested["model"]["w"], torch.arange(4.0))
    back = {"model": {"w": torch.zeros(4)}, "meta": {"size": None, "io": None}}
    dcp.load(back, storage_reader=TFBundleReader(folder))  # a directory given to the constructor
    assert type(back["meta"]["size"]) is torch.Size and back["meta"]["io"].getvalue() == b"xy"
    dcp.save({}, checkpoint_id=tmp_path / "empty", storage_writer=TFBundleWriter())
    dcp.load({}, checkpoint_id=tmp_path / "empty", storage_reader=TFBundleReader())


def test_writer_options_refused_where_they_cannot_apply() -> None:
    from shardckpt import CheckpointOptions, MaxShardSizePolicy

    with pytest.raises(InvalidArgumentError, match="thread_count"):
        TFBundleWriter(thread_count=0)
    with pytest.raises(InvalidArgumentError, match="sharding_callback"):
        TFBundleWriter(thread_count=2, options=CheckpointOptions(sharding_callback=MaxShardSizePolicy(1 << 20)))
    with pytest.raises(InvalidArgumentError, match="per_thread_copy_ahead"):
        TFBundleWriter(per_thread_copy_ahead=-1)


def test_overwrite_false_raises_as_dcp_does(tmp_path: Path) -> None:
    """DCP's own tests (e2e ``test_overwrite``) look for "Checkpoint already exists" in the
    CheckpointException of a refused save: the swapped-in writer says it the same way."""
    from torch.distributed.checkpoint.api import CheckpointException

    dcp.save({"random": torch.randn(10)}, checkpoint_id=tmp_path, storage_writer=TFBundleWriter())
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as refused:
        dcp.save({"random": torch.randn(10)}, storage_writer=TFBundleWriter(tmp_path, overwrite=False))
    assert str(tmp_path) in str(refused.value) and "overwrite=False" in str(refused.value)
