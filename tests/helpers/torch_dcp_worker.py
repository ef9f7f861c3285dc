"""One process of tests/test_torch_dcp.py: PyTorch DCP with shardckpt's TFBundleWriter / TFBundleReader.

    torchrun --standalone --nproc-per-node N torch_dcp_worker.py MODE OUTDIR DATADIR
    python torch_dcp_worker.py load1 OUTDIR DATADIR          (one process, no torch.distributed)

A small transformer-like model (embedding, two blocks of attention and MLP weights
with layer norms, an output head) trained with AdamW. Its parameters are DTensors
with the placements of :func:`placements` (or plain tensors in one process); the
forward pass works on full tensors, so every layout computes the same numbers, bit
for bit, and the training after a load can be compared exactly with an
uninterrupted run.

``MODE``:

* ``save4`` (4 ranks, a 2x2 mesh; each parameter gets one of ``[Shard(0), Shard(1)]``,
  ``[Replicate(), Shard(0)]``, ``[Shard(0), Replicate()]``, ``[Replicate(), Replicate()]``):
  train :data:`STEPS_BEFORE` steps; ``dcp.save`` the model, AdamW state and plain values
  (``get_state_dict``) at ``DATADIR/sync/ck``; ``dcp.async_save`` of the same state at
  ``DATADIR/async/ck`` (thread) and ``DATADIR/process/ck`` (PROCESS checkpointer) while the
  next training step already runs; a PROCESS save of a pickle-only value to ``process/ck``
  must fail and leave it as it was, and the next PROCESS save (``process_again/ck``) works;
  a writer with a coordinator of ranks 0 and 1 only refuses to be pickled (names THREAD);
  ``no_dist=True`` saves with no coordinator given (:func:`no_dist_saves`); write the values as
  saved (``saved.npz``) and, after :data:`STEPS_AFTER` more steps, the losses and final
  parameters of this uninterrupted run (``reference.npz``); an FSDP2 ``fully_shard`` model
  (HSDP on the 2x2 mesh: ``[Replicate(), Shard(0)]``) and its AdamW state at
  ``DATADIR/fsdp/ck`` (values in ``saved_fsdp.npz``); then a bad state dict
  (an ``object()``, a ``uint16`` tensor) is refused at ``DATADIR/bad/ck``.
* ``load2`` / ``load3`` (2 / 3 ranks, 1-D meshes, other placements, uneven chunks on 3):
  a model with other initial values loads ``sync`` (default planner) and ``async``
  (``TFBundleLoadPlanner``): every value must equal ``saved.npz``; then the training goes on
  and must equal ``reference.npz``. ``load2`` also loads the TensorFlow fixture
  ``08_tf1_saver_partitioned`` into DTensors (``key_map``). Every load mode also loads the
  FSDP2 checkpoint onto its own ``fully_shard`` model (plain in one process).
* ``load1`` (one process, no torch.distributed): the same with plain tensors.
* ``kill2`` (2 ranks): ``DATADIR/kill/ck`` is saved, then saved again with other values while
  rank 1 SIGKILLs itself as soon as the save's first file appears in its temporary folder.
  Before that (:func:`mode_killproc2`), the same with ``dcp.async_save`` and the PROCESS
  checkpointer at ``DATADIR/killproc/ck``, rank 1 SIGKILLing its checkpoint process (not
  itself): both ranks' futures raise, and both load the first checkpoint, intact.

Each rank writes ``OUTDIR/rank<R>.json`` (``done`` and its checks); failures are raised.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shardckpt.torch import TFBundleLoadPlanner, TFBundleReader, TFBundleWriter

warnings.filterwarnings("ignore")
V, D, H, T, B = 32, 16, 32, 8, 4
STEPS_BEFORE, STEPS_AFTER = 3, 3
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "tf_fixtures" / "08_tf1_saver_partitioned"
RESULT: Dict[str, Any] = {}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1_w, self.ln1_b = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.q, self.k, self.v, self.o = (nn.Parameter(torch.randn(D, D) * 0.2) for _ in range(4))
        self.ln2_w, self.ln2_b = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.up, self.down = nn.Parameter(torch.randn(D, H) * 0.2), nn.Parameter(torch.randn(H, D) * 0.2)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(V, D) * 0.5)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Parameter(torch.randn(D, V) * 0.2)


def full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def loss_of(model: Tiny, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(V, (B, T), generator=g)
    y = torch.randint(V, (B, T), generator=g)
    h = full(model.emb)[x]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for blk in model.layers:
        a = F.layer_norm(h, (D,), full(blk.ln1_w), full(blk.ln1_b))
        q, k, v = a @ full(blk.q), a @ full(blk.k), a @ full(blk.v)
        att = (q @ k.transpose(1, 2) / D ** 0.5).masked_fill(mask, float("-inf")).softmax(-1)
        h = h + (att @ v) @ full(blk.o)
        m = F.layer_norm(h, (D,), full(blk.ln2_w), full(blk.ln2_b))
        h = h + F.gelu(m @ full(blk.up)) @ full(blk.down)
    return F.cross_entropy((h @ full(model.head)).reshape(-1, V), y.reshape(-1))


def train(model: Tiny, opt: torch.optim.Optimizer, first: int, steps: int) -> List[float]:
    losses = []
    for step in range(first, first + steps):
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def placements(mode: str, index: int, rank_of_param: int) -> list:
    from torch.distributed.tensor import Replicate, Shard

    if mode == "save4":
        if rank_of_param == 2:
            return [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(0), Replicate()],
                    [Replicate(), Replicate()]][index % 4]
        return [[Shard(0), Replicate()], [Replicate(), Shard(0)], [Replicate(), Replicate()]][index % 3]
    if rank_of_param == 2:
        return [[Shard(1)], [Shard(0)], [Replicate()]][index % 3]
    return [[Shard(0)], [Replicate()]][index % 2]


def build(mode: str, seed: int) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    if mode == "load1":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2) if mode == "save4" else (size,))
    for index, (name, p) in enumerate(list(model.named_parameters())):
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        dt = distribute_tensor(p.detach(), mesh, placements(mode, index, p.dim()))
        setattr(owner, name.rsplit(".", 1)[-1], nn.Parameter(dt))
    return model


def optimizer(model: Tiny) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, foreach=False)


def state(model: Tiny, opt: torch.optim.Optimizer, step: int) -> Dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": step, "note": "tiny", "sched": {"warmup": (1, 2.5)}}}


def flat_values(sd: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Every tensor of a state dict as a full NumPy array (int8 bytes for exact comparison), by dotted path."""
    out: Dict[str, Any] = {}
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_values(v, name + "."))
        elif isinstance(v, torch.Tensor):
            out[name] = full(v).detach().contiguous().view(-1).view(torch.uint8).numpy().copy()
    return out


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULT.setdefault("checks", {})[name] = ok
    if not ok:
        raise AssertionError(f"rank {rank()}: {name} failed {detail}")


def mode_save4(data: Path) -> None:
    model = build("save4", 0)
    opt = optimizer(model)
    train(model, opt, 0, STEPS_BEFORE)
    sd = state(model, opt, STEPS_BEFORE)
    dcp.save(sd, storage_writer=TFBundleWriter(data / "sync" / "ck"))
    saved = flat_values(sd)
    # the PROCESS checkpointer: the writer is pickled to DCP's checkpoint process (one per rank)
    in_process = dcp.async_save(sd, storage_writer=TFBundleWriter(data / "process" / "ck"),
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    # async: a separate gloo group for DCP's own collectives (training uses the default one)
    pg = dist.new_group(backend="gloo")
    writer = TFBundleWriter(data / "async" / "ck")
    future = dcp.async_save(sd, storage_writer=writer, process_group=pg)
    losses = train(model, opt, STEPS_BEFORE, 1)  # changes every value while both saves run
    future.result()
    in_process.result()
    process_failure_and_again(data)
    losses += train(model, opt, STEPS_BEFORE + 1, STEPS_AFTER - 1)
    final = flat_values({"model": get_state_dict(model, opt)[0]})
    if rank() == 0:
        np.savez(data / "saved.npz", **saved)
        np.savez(data / "reference.npz", losses=np.array(losses, dtype=np.float64), **final)
    dist.barrier()
    no_dist_saves(data)
    fsdp_save(data)
    # a bad state dict: refused on every rank, nothing written
    for what, bad in (("object", {"w": torch.zeros(4), "o": object()}),
                      ("uint16", {"w": torch.zeros(4), "u": torch.zeros(3, dtype=torch.uint16)})):
        try:
            dcp.save(bad, storage_writer=TFBundleWriter(data / "bad" / "ck"))
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            text = str(exc)
            key = "'o'" if what == "object" else "'u'"
            check(f"bad_{what}_refused", key in text and ("pickle" in text or "uint16" in text), text[-500:])
        else:
            check(f"bad_{what}_refused", False, "no error")
    dist.barrier()
    check("bad_nothing_written", not glob.glob(str(data / "bad" / "*")), str(os.listdir(data)))


def process_failure_and_again(data: Path) -> None:
    """A PROCESS save that fails (a pickle-only value) leaves ``process/ck`` as it was; the next one works."""
    bad = {"w": torch.zeros(4), "o": object()}
    try:
        dcp.async_save(bad, storage_writer=TFBundleWriter(data / "process" / "ck"),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    except BaseException as exc:
        check("process_bad_refused", "'o'" in str(exc) and "pickle" in str(exc), str(exc)[-500:])
    else:
        check("process_bad_refused", False, "no error")
    again = {"w": torch.arange(10.0), "step": 7}
    dcp.async_save(again, storage_writer=TFBundleWriter(data / "process_again" / "ck"),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    back = {"w": torch.zeros(10), "step": 0}
    dcp.load(back, storage_reader=TFBundleReader(data / "process_again" / "ck"))
    check("process_again", torch.equal(back["w"], again["w"]) and back["step"] == 7, str(back))
    # a coordinator of some ranks only cannot travel to a checkpoint process: a clear error, before the save
    import pickle

    from shardckpt.distributed.torch_backend import TorchCoordinator

    pair = dist.new_group([0, 1], backend="gloo")
    if rank() < 2:
        writer = TFBundleWriter(data / "process_pair" / "ck", coordinator=TorchCoordinator(group=pair))
        try:
            pickle.dumps(writer)  # in memory, as DCP's PROCESS checkpointer does
        except Exception as exc:
            check("process_pair_refused", "THREAD" in str(exc) and "torch coordinator of 2 ranks" in str(exc),
                  str(exc))
        else:
            check("process_pair_refused", False, "pickled")


def no_dist_saves(data: Path) -> None:
    """``no_dist=True`` inside the 4-rank job, with no coordinator given: each save is one process's own.

    Rank 0 alone saves (``dcp.save`` and a thread ``dcp.async_save``) while the others wait at a
    barrier (a collective save would wait for them forever); then every rank saves its own values
    to its own prefix at once. Every checkpoint is read back with ``no_dist`` loads.
    """
    me = rank()
    if me == 0:
        solo = {"w": torch.arange(12.0).reshape(3, 4), "step": 5}
        dcp.save(solo, storage_writer=TFBundleWriter(data / "nodist" / "solo"), no_dist=True)
        dcp.async_save({"w": solo["w"] * 2, "step": 6}, storage_writer=TFBundleWriter(data / "nodist" / "solo_async"),
                       no_dist=True).result()
        for name, factor, step in (("solo", 1, 5), ("solo_async", 2, 6)):
            back = {"w": torch.zeros(3, 4), "step": 0}
            dcp.load(back, storage_reader=TFBundleReader(data / "nodist" / name), no_dist=True)
            check(f"no_dist_{name}", torch.equal(back["w"], solo["w"] * factor) and back["step"] == step, str(back))
    dist.barrier()
    mine = {"w": torch.full((5,), float(me)), "rank": me}
    dcp.save(mine, storage_writer=TFBundleWriter(data / "nodist" / f"rank{me}"), no_dist=True)
    back = {"w": torch.zeros(5), "rank": -1}
    dcp.load(back, storage_reader=TFBundleReader(data / "nodist" / f"rank{me}"), no_dist=True)
    check("no_dist_each_rank", torch.equal(back["w"], mine["w"]) and back["rank"] == me, str(back))
    dist.barrier()


def fsdp_model(mode: str, seed: int) -> Tiny:
    """The model wrapped by FSDP2's ``fully_shard``: HSDP on the 2x2 mesh, plain FSDP on 1-D meshes."""
    torch.manual_seed(seed)
    model = Tiny()
    if mode == "load1":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    size = dist.get_world_size()
    if mode == "save4":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (size,))
    for blk in model.layers:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_save(data: Path) -> None:
    """FSDP2 (HSDP, ``[Replicate(), Shard(0)]``) model + AdamW state after two steps, at ``DATADIR/fsdp/ck``."""
    model = fsdp_model("save4", 5)
    opt = optimizer(model)
    train(model, opt, 0, 2)
    sd = state(model, opt, 2)
    dcp.save(sd, storage_writer=TFBundleWriter(data / "fsdp" / "ck"))
    values = flat_values(sd)
    if rank() == 0:
        np.savez(data / "saved_fsdp.npz", **values)


def fsdp_load(mode: str, data: Path) -> None:
    saved = dict(np.load(data / "saved_fsdp.npz"))
    model = fsdp_model(mode, 9)
    opt = optimizer(model)
    sd = state(model, opt, -1)
    dcp.load(sd, storage_reader=TFBundleReader(data / "fsdp" / "ck"))
    got = flat_values(sd)
    check("fsdp_values", set(got) == set(saved) and all(np.array_equal(got[k], saved[k]) for k in saved),
          str(set(got) ^ set(saved)))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    after = flat_values({"model": get_state_dict(model, opt)[0]})
    check("fsdp_set", all(np.array_equal(v, saved[k]) for k, v in after.items()))


def load_and_continue(mode: str, data: Path) -> None:
    saved = dict(np.load(data / "saved.npz"))
    reference = dict(np.load(data / "reference.npz"))
    for which, planner in (("sync", None), ("async", TFBundleLoadPlanner())):
        model = build(mode, 7)  # other initial values, other layouts
        opt = optimizer(model)
        sd = state(model, opt, -1)
        dcp.load(sd, storage_reader=TFBundleReader(data / which / "ck"), planner=planner)
        got = flat_values(sd)
        check(f"{which}_keys", set(got) == set(saved), str(set(got) ^ set(saved)))
        check(f"{which}_values", all(np.array_equal(got[k], saved[k]) for k in saved),
              str([k for k in saved if not np.array_equal(got[k], saved[k])]))
        check(f"{which}_extra", sd["extra"] == {"step": STEPS_BEFORE, "note": "tiny", "sched": {"warmup": (1, 2.5)}},
              str(sd["extra"]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        losses = train(model, opt, STEPS_BEFORE, STEPS_AFTER)
        check(f"{which}_losses", np.array_equal(np.array(losses, dtype=np.float64), reference["losses"]),
              f"{losses} vs {reference['losses']}")
        final = flat_values({"model": get_state_dict(model, opt)[0]})
        check(f"{which}_continues", all(np.array_equal(final[k], reference[k]) for k in final))


def load_fixture_dtensors() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    expected = np.load(FIXTURE / "expected.npz")
    keys = json.loads((FIXTURE / "case.json").read_text())["keys"]
    npz_name = {k["key"]: k.get("npz_key", k["key"]) for k in keys}
    names = {"embedding/table": "embed.weight", "dense/kernel": "dense.weight"}
    sd = {fqn: distribute_tensor(torch.zeros(tuple(expected[npz_name[key]].shape)), mesh, [Shard(1)])
          for key, fqn in names.items()}
    dcp.load(sd, storage_reader=TFBundleReader(str(FIXTURE / "model.ckpt-100"), key_map=names))
    for key, fqn in names.items():
        check(f"fixture_{fqn}", np.array_equal(sd[fqn].full_tensor().numpy(), expected[npz_name[key]]))


def mode_kill2(data: Path) -> None:
    mode_killproc2(data)
    prefix = data / "kill" / "ck"
    first = {"w": torch.arange(1 << 20, dtype=torch.float32) + 1000, "step": 1}  # the same on every rank
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    big = torch.arange(1 << 23, dtype=torch.float32)
    dcp.save({"big": distribute_tensor(big, mesh, [Shard(0)]), **first}, storage_writer=TFBundleWriter(prefix))
    RESULT["first_saved"] = True
    dist.barrier()
    if rank() == 1:
        def watch() -> None:
            while True:
                if glob.glob(str(prefix) + "_temp_*/*"):
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.0005)
        threading.Thread(target=watch, daemon=True).start()
    _write_result()
    dcp.save({"big": distribute_tensor(big * 2, mesh, [Shard(0)]), "w": first["w"] * 2, "step": 2},
             storage_writer=TFBundleWriter(prefix))
    RESULT["second_saved"] = True  # never reached: rank 1 died, rank 0 waits in a collective until ended


def mode_killproc2(data: Path) -> None:
    """PROCESS checkpointer: rank 1 SIGKILLs its checkpoint process mid-save; the previous checkpoint stays."""
    import multiprocessing

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardckpt import CheckpointOptions

    prefix = data / "killproc" / "ck"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    big = torch.arange(1 << 23, dtype=torch.float32)
    options = CheckpointOptions(timeout=20)
    dcp.async_save({"big": distribute_tensor(big, mesh, [Shard(0)]), "step": 1},
                   storage_writer=TFBundleWriter(prefix, options=options),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    dist.barrier()
    if rank() == 1:
        (child,) = multiprocessing.active_children()  # DCP's checkpoint process

        def watch() -> None:
            while not glob.glob(str(prefix) + "_temp_*/*"):
                time.sleep(0.0005)
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            RESULT["killed_mid_save"] = True  # its first file was in the temporary folder
        threading.Thread(target=watch, daemon=True).start()
    try:
        dcp.async_save({"big": distribute_tensor(big * 2, mesh, [Shard(0)]), "step": 2},
                       storage_writer=TFBundleWriter(prefix, options=options),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    except BaseException as exc:
        RESULT["second_error"] = f"{type(exc).__name__}: {exc}"[-2000:]
        check("second_failed", True)
    else:
        check("second_failed", False, "the save with a killed checkpoint process succeeded")
    dist.barrier()
    back = {"big": distribute_tensor(torch.zeros(1 << 23), mesh, [Shard(0)]), "step": 0}
    dcp.load(back, storage_reader=TFBundleReader(prefix))
    check("previous_intact", torch.equal(back["big"].full_tensor(), big) and back["step"] == 1)


def _write_result() -> None:
    out = Path(sys.argv[2])
    (out / f"rank{rank()}.json").write_text(json.dumps(RESULT))


def run_recorded(body: Callable[[], None]) -> None:
    """Run ``body``; ``done`` or ``fatal`` (its traceback) go into the rank's result file, written in any case."""
    try:
        body()
        RESULT["done"] = True
    except BaseException:
        RESULT["fatal"] = traceback.format_exc()
        raise
    finally:
        _write_result()


def main() -> None:
    mode, data = sys.argv[1], Path(sys.argv[3])
    Path(sys.argv[2]).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if mode != "load1":
        dist.init_process_group(backend="gloo")
    RESULT.update(rank=rank(), size=dist.get_world_size() if dist.is_initialized() else 1)

    def body() -> None:
        if mode == "save4":
            mode_save4(data)
        elif mode in ("load1", "load2", "load3"):
            load_and_continue(mode, data)
            fsdp_load(mode, data)
            if mode == "load2":
                load_fixture_dtensors()
        elif mode == "kill2":
            mode_kill2(data)
        else:
            raise SystemExit(f"unknown mode {mode}")
    run_recorded(body)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
