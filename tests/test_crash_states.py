"""Power-loss crash states, enumerated (issue 16): in every state a power loss can leave, the
latest checkpoint restores exactly one fully committed save.

Each scenario runs a real save through ``RecordingFileSystem``; tests/helpers/crash_states.py
builds every state POSIX allows after a power loss at every point of the log (durable
operations plus any subset of the not-yet-durable ones, torn file contents included;
sampled with a fixed seed where the subsets are too many) and each distinct state is
materialised and judged: the prefix or the ``checkpoint`` state file must lead to a
checkpoint whose every value equals one whole committed generation — never an error,
never a mix. The number of states checked per scenario is printed (``-s`` shows it) and
must be substantial.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import pytest

import shardckpt
from shardckpt import CheckpointOptions, MaxShardSizePolicy
from shardckpt.storage.local import local_fs
from shardckpt.storage.registry import mounted
from shardckpt.storage.wrappers import RecordingFileSystem

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from crash_states import check_all, snapshot  # noqa: E402  (tests/helpers)

Values = Dict[str, np.ndarray]


def _tensors(generation: int) -> Values:
    rng = np.random.default_rng(generation)
    return {f"t{i}": rng.standard_normal(2048 + 512 * i).astype(np.float32) for i in range(3)}


def _read_all(prefix: str) -> Values:
    with shardckpt.load_checkpoint(prefix) as reader:
        return {k: np.asarray(reader.get_tensor(k)) for k in reader.get_variable_to_shape_map()}


def _bytes(v: np.ndarray) -> bytes:
    return repr(v.tolist()).encode() if v.dtype == object else v.tobytes()


def _same(a: Values, b: Values) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and _bytes(a[k]) == _bytes(b[k]) for k in a)


def _judge_values(values: Values, generations: List[Values], where: str) -> Optional[str]:
    if any(_same(values, g) for g in generations):
        return None
    return f"{where} holds values of no committed save (keys {sorted(values)[:6]})"


def _prefix_judge(name: str, generations: List[Values], allow_none: bool) -> Callable[[str], Optional[str]]:
    def judge(folder: str) -> Optional[str]:
        prefix = os.path.join(folder, name)
        if not os.path.exists(prefix + ".index"):
            return None if allow_none else "the previous checkpoint's index is gone"
        try:
            return _judge_values(_read_all(prefix), generations, prefix)
        except Exception as exc:  # a crash state must never make the latest checkpoint unreadable
            return f"{type(exc).__name__}: {exc}"
    return judge


def _latest_judge(generations: List[Values], allow_none: bool) -> Callable[[str], Optional[str]]:
    def judge(folder: str) -> Optional[str]:
        try:
            latest = shardckpt.latest_checkpoint(folder)
            if latest is None:
                return None if allow_none else "latest_checkpoint found nothing"
            return _judge_values(_read_all(latest), generations, latest)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return judge


def _run(tmp_path: Path, work: Callable[[], None], judge: Callable[[str], Optional[str]], label: str,
         min_states: int) -> None:
    folder = str(tmp_path / "ck")
    initial = snapshot(folder)
    recorder = RecordingFileSystem(local_fs)
    with mounted(recorder):
        work()
    assert judge(folder) is None, "the save itself did not leave a good checkpoint"
    checked, problems = check_all(folder, recorder.ops, initial, str(tmp_path / "state"), judge)
    print(f"\n{label}: {len(recorder.ops)} operations recorded, {checked} distinct crash states checked")
    assert not problems, f"{len(problems)} bad crash states of {checked}, e.g.:\n" + "\n".join(problems[:5])
    assert checked >= min_states, f"only {checked} crash states: the enumeration is too thin"


def test_first_save_to_a_new_prefix(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    prefix = str(tmp_path / "ck" / "model")
    _run(tmp_path, lambda: shardckpt.save_tensors(prefix, _tensors(1)),
         _prefix_judge("model", [_tensors(1)], allow_none=True), "single save", 20)


@pytest.mark.parametrize("shards", [1, 3], ids=["other-shard-count", "same-shard-count"])
def test_sharded_save_over_the_same_prefix(tmp_path: Path, shards: int) -> None:
    (tmp_path / "ck").mkdir()
    prefix = str(tmp_path / "ck" / "model")
    three = CheckpointOptions(sharding_callback=MaxShardSizePolicy(12 << 10))
    shardckpt.save_tensors(prefix, _tensors(0), three if shards == 3 else None)
    _run(tmp_path, lambda: shardckpt.save_tensors(prefix, _tensors(1), three),
         _prefix_judge("model", [_tensors(0), _tensors(1)], allow_none=False), f"overwrite ({shards} -> 3 shards)",
         40)


def _manager(folder: str, generation: int) -> tuple:
    model = shardckpt.Module()
    for k, v in _tensors(generation).items():
        setattr(model, k, shardckpt.Variable(v))
    ckpt = shardckpt.Checkpoint(model=model)
    return ckpt, shardckpt.CheckpointManager(ckpt, folder, max_to_keep=1), model


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_manager_save_with_retention_deletion(tmp_path: Path, asynchronous: bool) -> None:
    folder = str(tmp_path / "ck")
    ckpt, manager, model = _manager(folder, 0)
    first = manager.save()
    old = _read_all(first)
    for k, v in _tensors(1).items():
        getattr(model, k).assign(v)
    options = CheckpointOptions(enable_async=True) if asynchronous else None

    def work() -> None:
        manager.save(options=options)
        ckpt.sync()

    def new_values() -> Values:
        return _read_all(shardckpt.latest_checkpoint(folder))

    # the new generation's exact values (save counter included) are known only after the save
    _run_with_late_judge(tmp_path, work, lambda: _latest_judge([old, new_values()], allow_none=False),
                         "manager save (max_to_keep=1)" + (" async" if asynchronous else ""), 40)


def _run_with_late_judge(tmp_path: Path, work: Callable[[], None],
                         make_judge: Callable[[], Callable[[str], Optional[str]]], label: str, min_states: int) -> None:
    folder = str(tmp_path / "ck")
    initial = snapshot(folder)
    recorder = RecordingFileSystem(local_fs)
    with mounted(recorder):
        work()
    judge = make_judge()
    assert judge(folder) is None, "the save itself did not leave a good checkpoint"
    checked, problems = check_all(folder, recorder.ops, initial, str(tmp_path / "state"), judge)
    print(f"\n{label}: {len(recorder.ops)} operations recorded, {checked} distinct crash states checked")
    assert not problems, f"{len(problems)} bad crash states of {checked}, e.g.:\n" + "\n".join(problems[:5])
    assert checked >= min_states, f"only {checked} crash states: the enumeration is too thin"


def _two_clients_save(prefix: str, generation: int, out: Path) -> List[list]:
    """Run the two-client save; return the merged log: the io client's preparation, then the other
    client's operations, then the rest of the io client's (its shard writes and the commit)."""
    import json
    import multiprocessing

    from crash_clients import client

    from shardckpt.distributed.local import local_group

    ctx = multiprocessing.get_context("spawn")
    group = local_group(2, ctx)
    out.mkdir(exist_ok=True)
    procs = [ctx.Process(target=client, args=(group, r, prefix, generation, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"client exited with {p.exitcode}"
    logs = [[(k, p_, bytes.fromhex(e) if k == "write" else e) for k, p_, e in json.loads((out / f"rank{r}.json")
                                                                                        .read_text())]
            for r in range(2)]
    io, other = logs
    first_write = next(i for i, op in enumerate(io) if op[0] == "create")
    return io[:first_write] + other + io[first_write:]


def test_multi_client_save_over_the_previous_checkpoint(tmp_path: Path) -> None:
    """Two client processes, a log each, merged in an order the protocol allows."""
    import crash_clients

    (tmp_path / "ck").mkdir()
    prefix = str(tmp_path / "ck" / "model")
    _two_clients_save(prefix, 0, tmp_path / "logs0")
    folder = str(tmp_path / "ck")
    initial = snapshot(folder)
    ops = _two_clients_save(prefix, 1, tmp_path / "logs1")
    generations = [crash_clients.values(0), crash_clients.values(1)]
    judge = _prefix_judge("model", generations, allow_none=False)
    assert judge(folder) is None
    checked, problems = check_all(folder, ops, initial, str(tmp_path / "state"), judge)
    print(f"\nmulti-client save (2 clients): {len(ops)} operations recorded, {checked} distinct crash states checked")
    assert not problems, f"{len(problems)} bad crash states of {checked}, e.g.:\n" + "\n".join(problems[:5])
    assert checked >= 40


def _incremental_manager(folder: str, values: Values) -> tuple:
    model = shardckpt.Module()
    for k, v in values.items():
        setattr(model, k, shardckpt.Variable(v))
    ckpt = shardckpt.Checkpoint(model=model)
    return ckpt, shardckpt.CheckpointManager(ckpt, folder, max_to_keep=1, incremental=True), model


def test_incremental_manager_save_deleting_the_checkpoint_it_linked_from(tmp_path: Path) -> None:
    """An incremental manager save (issue 14) hard-links the unchanged data files of the previous
    checkpoint, commits, and then retention (``max_to_keep=1``) deletes that previous checkpoint,
    whose files now have a second name. In every crash state the latest checkpoint restores one
    whole generation, and the next incremental save from that state (a restarted job: restore, one
    value changed, save) reads back exactly."""
    folder = str(tmp_path / "ck")
    sharded = CheckpointOptions(sharding_callback=MaxShardSizePolicy(12 << 10))
    gen = [_tensors(0)]
    ckpt, manager, model = _incremental_manager(folder, gen[0])
    manager.save(options=sharded)
    for g in (1, 2):  # the second save settles the layout (t1 alone in its file), the third is recorded
        gen.append(dict(gen[-1], t1=gen[-1]["t1"] + 1))
        model.t1.assign(gen[-1]["t1"])
        if g == 1:
            manager.save(options=sharded)
    old = _read_all(shardckpt.latest_checkpoint(folder))
    next_values = dict(gen[-1], t0=gen[-1]["t0"] - 1)

    def work() -> None:
        manager.save(options=sharded)

    def make_judge() -> Callable[[str], Optional[str]]:
        latest = _latest_judge([old, _read_all(shardckpt.latest_checkpoint(folder))], allow_none=False)

        def judge(state: str) -> Optional[str]:
            problem = latest(state)
            if problem is not None:
                return problem
            try:
                ckpt2, manager2, model2 = _incremental_manager(state, gen[0])
                manager2.restore_or_initialize()
                for k, v in next_values.items():
                    getattr(model2, k).assign(v)
                manager2.save(options=sharded)
                got = _read_all(shardckpt.latest_checkpoint(state))
                want = {f"model/{k}/.ATTRIBUTES/VARIABLE_VALUE": v for k, v in next_values.items()}
                if not all(np.array_equal(got[k], want[k]) for k in want):
                    return "the next incremental save does not read back exactly"
            except Exception as exc:
                return f"the next incremental save failed: {type(exc).__name__}: {exc}"
            return None
        return judge

    initial = snapshot(folder)
    recorder = RecordingFileSystem(local_fs)
    with mounted(recorder):
        work()
    kinds = [op[0] for op in recorder.ops]
    assert "link" in kinds and "remove" in kinds, "the save linked nothing or retention deleted nothing"
    judge = make_judge()
    assert judge(str(tmp_path / "probe")) is not None  # an empty folder has no latest checkpoint
    probe = str(tmp_path / "probe")  # nor is a latest checkpoint missing a linked data file whole
    shutil.copytree(folder, probe, dirs_exist_ok=True)
    latest = os.path.basename(shardckpt.latest_checkpoint(probe) or "")
    data = sorted(n for n in os.listdir(probe) if n.startswith(latest + ".data-"))
    assert len(data) >= 2, data
    os.remove(os.path.join(probe, data[0]))
    assert judge(probe) is not None
    # each state's judge runs a whole save: a few states per crash point keep this within seconds
    checked, problems = check_all(folder, recorder.ops, initial, str(tmp_path / "state"), judge, max_per_point=4)
    print(f"\nincremental manager save (max_to_keep=1, links): {len(recorder.ops)} operations recorded, "
          f"{checked} distinct crash states checked")
    assert not problems, f"{len(problems)} bad crash states of {checked}, e.g.:\n" + "\n".join(problems[:5])
    assert checked >= 60, f"only {checked} crash states: the enumeration is too thin"
