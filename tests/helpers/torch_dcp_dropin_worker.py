"""One process of tests/test_torch_dcp_dropin.py: TFBundleWriter / TFBundleReader used as DCP's own storage.

    torchrun --standalone --nproc-per-node 4 torch_dcp_dropin_worker.py dropin4 OUTDIR DATADIR [SECTION,...]

Each section is what a ``FileSystemWriter`` user does, with the class swapped:

* ``solo``: the very first DCP call of the job is rank 0's alone (``no_dist=True``:
  ``dcp.load`` of a TensorFlow fixture, ``dcp.save``, a thread ``dcp.async_save`` and
  ``dcp.load`` of what it wrote) while ranks 1-3 wait at a barrier. Nothing collective
  may happen in it (a collective there waits for ranks 1-3 until the job's timeout).
* ``pairs``: ranks {0, 1} and {2, 3} each save their own checkpoint at once with
  ``process_group=`` their pair's group (DTensors on a mesh over the pair, and one key per
  rank), with ``dcp.save``, a thread ``dcp.async_save`` and a PROCESS one, and load them
  with the pair's group into other placements.
* ``dirs``: ``checkpoint_id`` is a directory (new, existing, with a trailing ``/``); the
  TFBundleWriter(prefix) spelling still writes a prefix; loads by directory.
* ``nesting``: ``_load_state_dict_from_keys()`` (all ranks) and ``("model")`` return the
  nested dict; ``dcp_to_torch_save`` (rank 0 alone) writes the nested dict.
* ``empty``: ``dcp.save({})`` and a ``Stateful`` whose state is ``{}``, saved and loaded.
* ``types``: non-tensor values keep their exact type (``torch.Size``, ``torch.dtype``,
  NumPy scalars and arrays, ``io.BytesIO``, ``OrderedDict``, tuples, ...); a namedtuple,
  an ``IntEnum`` and a set are refused naming their key.
* ``options``: ``thread_count=3``, ``single_file_per_rank=False``, ``sync_files=False``,
  ``per_thread_copy_ahead``, ``cache_staged_state_dict=False`` (async) and ``overwrite=False``;
  ``use_collectives=False`` on 4 ranks is refused.

Each rank writes ``OUTDIR/rank<R>.json`` (``done`` and its checks); failures are raised.
"""

from __future__ import annotations

import collections
import datetime
import enum
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch_dcp_worker import (  # the results' format of the other DCP worker
    RESULT,
    _write_result,
    check,
    rank,
    run_recorded,
)

from shardckpt.torch import TFBundleReader, TFBundleWriter

warnings.filterwarnings("ignore")
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "tf_fixtures" / "08_tf1_saver_partitioned"

def solo(data: Path) -> None:
    """Rank 0 alone, before any other DCP call of the job; the others wait at a barrier."""
    if rank() == 0:
        expected = np.load(FIXTURE / "expected.npz")
        keys = json.loads((FIXTURE / "case.json").read_text())["keys"]
        npz = {k["key"]: k.get("npz_key", k["key"]) for k in keys}
        sd = {"emb": torch.zeros(tuple(expected[npz["embedding/table"]].shape))}
        dcp.load(sd, storage_reader=TFBundleReader(str(FIXTURE / "model.ckpt-100"),
                                                   key_map={"embedding/table": "emb"}), no_dist=True)
        check("solo_load_fixture", np.array_equal(sd["emb"].numpy(), expected[npz["embedding/table"]]))
        mine = {"w": torch.arange(12.0).reshape(3, 4), "step": 5}
        dcp.save(mine, checkpoint_id=data / "solo" / "sync", storage_writer=TFBundleWriter(), no_dist=True)
        dcp.async_save({"w": mine["w"] * 2, "step": 6}, checkpoint_id=data / "solo" / "async",
                       storage_writer=TFBundleWriter(), no_dist=True).result()
        for name, factor, step in (("sync", 1, 5), ("async", 2, 6)):
            back = {"w": torch.zeros(3, 4), "step": 0}
            dcp.load(back, checkpoint_id=data / "solo" / name, storage_reader=TFBundleReader(), no_dist=True)
            check(f"solo_{name}", torch.equal(back["w"], mine["w"] * factor) and back["step"] == step, str(back))
    dist.barrier()


def pair_state(pair: int, mesh: Any, placement: Any, scale: float) -> Dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    base = torch.arange(48.0).reshape(8, 6) + 100 * pair
    return {"model": {"w": distribute_tensor(base * scale, mesh, [placement]),
                      f"own{dist.get_rank(mesh.get_group())}": torch.full((3,), float(rank()) * scale)},
            "step": pair * 10 + int(scale)}


def pairs(data: Path) -> None:
    """Ranks {0, 1} and {2, 3}, each pair its own checkpoint, with ``process_group=`` its group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    pair = rank() // 2
    pg = groups[pair]
    mesh = DeviceMesh.from_group(pg, "cpu")
    for how, scale in (("sync", 1.0), ("async", 2.0), ("process", 3.0)):
        sd = pair_state(pair, mesh, Shard(0), scale)
        target = data / "pairs" / how / f"pair{pair}"
        if how == "sync":
            dcp.save(sd, checkpoint_id=target, storage_writer=TFBundleWriter(), process_group=pg)
        elif how == "async":
            dcp.async_save(sd, checkpoint_id=target, storage_writer=TFBundleWriter(), process_group=pg).result()
        else:
            dcp.async_save(sd, checkpoint_id=target, storage_writer=TFBundleWriter(), process_group=pg,
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        for placement in (Shard(1), Replicate()):
            back = pair_state(pair, mesh, placement, 0.0)
            back["step"] = -1
            dcp.load(back, checkpoint_id=target, storage_reader=TFBundleReader(), process_group=pg)
            want = pair_state(pair, mesh, Shard(0), scale)
            check(f"pairs_{how}_{placement}",
                  torch.equal(back["model"]["w"].full_tensor(), want["model"]["w"].full_tensor())
                  and all(torch.equal(back["model"][k], want["model"][k]) for k in back["model"] if k != "w")
                  and back["step"] == want["step"], str(back))
    dist.barrier()


def directories(data: Path) -> None:
    """``checkpoint_id`` directories (new, existing, ``dir/``), the prefix spelling, loads by directory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(64.0).reshape(8, 8)
    if rank() == 0:
        (data / "dirs" / "existing").mkdir(parents=True)
    dist.barrier()
    for name in ("new/step-100", "existing", "slash/"):
        sd = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}, "step": 100}
        dcp.save(sd, checkpoint_id=str(data / "dirs" / name), storage_writer=TFBundleWriter())
        back = {"model": {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(1)])}, "step": 0}
        dcp.load(back, checkpoint_id=str(data / "dirs" / name), storage_reader=TFBundleReader())
        check(f"dir_{name}", torch.equal(back["model"]["w"].full_tensor(), full) and back["step"] == 100)
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=TFBundleWriter(data / "dirs" / "pre"))
    back = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(1)])}
    dcp.load(back, storage_reader=TFBundleReader(data / "dirs" / "pre"))
    check("prefix_still_a_prefix", torch.equal(back["w"].full_tensor(), full))
    dist.barrier()


def nesting(data: Path) -> None:
    """Loads without a target rebuild the nesting (``planner_data``)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, _load_state_dict_from_keys
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    where = data / "nesting"
    mesh = init_device_mesh("cpu", (4,))
    sd = {"model": {"w": distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)])}, "step": 100}
    dcp.save(sd, checkpoint_id=where, storage_writer=TFBundleWriter())
    everything = _load_state_dict_from_keys(checkpoint_id=str(where), storage_reader=TFBundleReader())
    check("nesting_all", set(everything) == {"model", "step"} and set(everything["model"]) == {"w"}
          and torch.equal(everything["model"]["w"], torch.arange(64.0).reshape(8, 8)) and everything["step"] == 100,
          str(everything))
    model = _load_state_dict_from_keys("model", checkpoint_id=str(where), storage_reader=TFBundleReader())
    check("nesting_model", set(model) == {"model"} and set(model["model"]) == {"w"}, str(model))
    if rank() == 0:  # what dcp_to_torch_save does (its reader is FileSystemReader), on rank 0 alone
        alone: Dict[str, Any] = {}
        _load_state_dict(alone, storage_reader=TFBundleReader(where), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
        check("nesting_no_dist", set(alone) == {"model", "step"} and set(alone["model"]) == {"w"}, str(alone))
    dist.barrier()


class Empty(Stateful):
    def __init__(self) -> None:
        self.loaded: Any = None

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.loaded = state_dict


def empty(data: Path) -> None:
    """``dcp.save({})`` and a Stateful whose state is ``{}``: written, and loaded."""
    dcp.save({}, checkpoint_id=data / "empty" / "plain", storage_writer=TFBundleWriter())
    back: Dict[str, Any] = {}
    dcp.load(back, checkpoint_id=data / "empty" / "plain", storage_reader=TFBundleReader())
    check("empty_plain", back == {})
    dcp.save({"app": Empty()}, checkpoint_id=data / "empty" / "stateful", storage_writer=TFBundleWriter())
    app = Empty()
    dcp.load({"app": app}, checkpoint_id=data / "empty" / "stateful", storage_reader=TFBundleReader())
    check("empty_stateful", app.loaded == {}, str(app.loaded))
    dist.barrier()


Point = collections.namedtuple("Point", "x y")


class Level(enum.IntEnum):
    LOW = 1


def typed_values() -> Dict[str, Any]:
    return {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "f64": np.float64(0.1), "i32": np.int32(-7),
            "b": np.bool_(True), "array": np.arange(6, dtype=np.uint16).reshape(2, 3), "text": np.array(["a", "bc"]),
            "bytesio": io.BytesIO(b"\x00\x80raw"), "tuple": (1, (2.5, "x")), "bytes": b"\xff\x00",
            "nan": float("nan"), "none": None}


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue()
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def types(data: Path) -> None:
    """Values keep their exact type; what has no faithful encoding is refused naming its key."""
    values = typed_values()
    dcp.save({"objects": values, "w": torch.ones(2)}, checkpoint_id=data / "types" / "ok",
             storage_writer=TFBundleWriter())
    back = {"objects": {k: None for k in values}, "w": torch.zeros(2)}
    dcp.load(back, checkpoint_id=data / "types" / "ok", storage_reader=TFBundleReader())
    for key, value in values.items():
        check(f"type_{key}", same(value, back["objects"][key]), f"{value!r} -> {back['objects'][key]!r}")
    for key, bad in (("point", Point(1, 2)), ("level", Level.LOW), ("set", {1, 2})):
        try:
            dcp.save({"w": torch.ones(2), key: bad}, checkpoint_id=data / "types" / "bad",
                     storage_writer=TFBundleWriter())
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            check(f"refused_{key}", f"'{key}'" in str(exc) and "pickle" in str(exc), str(exc)[-400:])
        else:
            check(f"refused_{key}", False, "saved")
    dist.barrier()
    check("refused_nothing_written", not (data / "types" / "bad").exists())


def options(data: Path) -> None:
    """FileSystemWriter's options, with their meaning for a tensor bundle."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    sd = {f"t{i}": distribute_tensor(torch.arange(32.0).reshape(8, 4) + i, mesh, [Shard(0)]) for i in range(4)}
    for name, writer in (("threads", TFBundleWriter(thread_count=3, sync_files=False, per_thread_copy_ahead=0)),
                         ("per_key", TFBundleWriter(single_file_per_rank=False))):
        dcp.save(sd, checkpoint_id=data / "options" / name, storage_writer=writer)
        back = {k: distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)]) for k in sd}
        dcp.load(back, checkpoint_id=data / "options" / name, storage_reader=TFBundleReader())
        check(f"option_{name}", all(torch.equal(back[k].full_tensor(), sd[k].full_tensor()) for k in sd))
    from shardckpt.torch import release_staging_buffers
    from shardckpt.torch._staging import default_stager

    release_staging_buffers()  # earlier async saves' buffers
    uncached = TFBundleWriter(cache_staged_state_dict=False)
    dcp.async_save(sd, checkpoint_id=data / "options" / "uncached", storage_writer=uncached).result()
    check("option_uncached_keeps_nothing", not default_stager()._buffers)
    dcp.async_save(sd, checkpoint_id=data / "options" / "cached", storage_writer=TFBundleWriter()).result()
    check("option_cached_keeps_buffers", len(default_stager()._buffers) == 4)
    try:
        dcp.save(sd, checkpoint_id=data / "options" / "threads", storage_writer=TFBundleWriter(overwrite=False))
    except BaseException as exc:
        check("option_overwrite_false", "overwrite=False" in str(exc), str(exc)[-400:])
    else:
        check("option_overwrite_false", False, "overwritten")
    try:  # each rank would write its own items as the whole checkpoint: refused on every rank, nothing written
        dcp.save(sd, checkpoint_id=data / "options" / "uncoordinated", storage_writer=TFBundleWriter(),
                 use_collectives=False)
    except BaseException as exc:
        check("option_use_collectives_false_refused", "use_collectives=False" in str(exc), str(exc)[-400:])
    else:
        check("option_use_collectives_false_refused", False, "saved")
    dist.barrier()
    check("option_use_collectives_false_nothing", not (data / "options" / "uncoordinated").exists())


def main() -> None:
    mode, data = sys.argv[1], Path(sys.argv[3])
    Path(sys.argv[2]).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    # a collective that should not happen must fail the test quickly, not after 10 minutes
    os.environ.setdefault("SHARDCKPT_TIMEOUT", "60")
    dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    RESULT.update(rank=rank(), size=dist.get_world_size())

    def body() -> None:
        if mode != "dropin4":
            raise SystemExit(f"unknown mode {mode}")
        chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else None  # sections by name; default: all
        for section in (solo, pairs, directories, nesting, empty, types, options):
            if chosen is not None and section.__name__ not in chosen:
                continue
            section(data)
            RESULT.setdefault("sections", []).append(section.__name__)
            _write_result()
    run_recorded(body)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # DCP's PROCESS checkpointer's process is a daemon: no waiting on it at exit


if __name__ == "__main__":
    main()
