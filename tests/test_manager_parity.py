"""``CheckpointManager`` side by side with TensorFlow 2.21: the single-client behaviours that TF's own
manager tests check (retention, keeping every N hours, a clock that went back, numbering, prefixes,
restore_or_initialize, pathlib directories, save intervals), as scenarios run by both libraries.

Each scenario is one script; a prelude binds the names it uses to TF's or to shardckpt's
(``Checkpoint``, ``CheckpointManager``, ``Variable``, ``get_checkpoint_state``,
``latest_checkpoint``) and gives it ``exists(prefix)`` (is the checkpoint's index there),
``clock``, a controllable ``time.time()`` of the manager's module (TF's tests patch that
module's ``time`` too), and ``capture_warnings`` (the warnings the manager logs). The scripts
record names, flags and timestamps; both libraries must record the same. The multi-client
behaviours are tested with several processes elsewhere (the manager's multi-client tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest
from test_tf_parity import probe_ours
from tf_oracle.client import TFOracle

COMMON = """
import os
import pathlib
import time as _real_time
from unittest import mock


def exists(prefix):
    return os.path.exists(str(prefix) + ".index")


def base(path):
    return None if path is None else os.path.basename(str(path))


class _Clock:
    '''What the manager's module sees as ``time``: ``time()`` is ``now``; the rest is the real module.'''

    def __init__(self, now):
        self.now = now

    def time(self):
        return self.now

    def __getattr__(self, name):
        return getattr(_real_time, name)


def clock(now):
    fake = _Clock(now)
    return fake, mock.patch.object(manager_module, "time", fake)
"""

TF_PRELUDE = """
from tensorflow.python.checkpoint import checkpoint_management as manager_module
from tensorflow.python.platform import tf_logging


def capture_warnings():
    logged = []
    return logged, mock.patch.object(tf_logging, "warning", lambda msg, *args: logged.append(msg % args))
Checkpoint, CheckpointManager, Variable = tf.train.Checkpoint, tf.train.CheckpointManager, tf.Variable
get_checkpoint_state, latest_checkpoint = tf.train.get_checkpoint_state, tf.train.latest_checkpoint
"""

OUR_PRELUDE = """
import contextlib
import logging
import shardckpt
import shardckpt.checkpoint.manager as manager_module


@contextlib.contextmanager
def _handler(logged):
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("shardckpt")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def capture_warnings():
    logged = []
    return logged, _handler(logged)
Checkpoint, CheckpointManager, Variable = shardckpt.Checkpoint, shardckpt.CheckpointManager, shardckpt.Variable
get_checkpoint_state, latest_checkpoint = shardckpt.get_checkpoint_state, shardckpt.latest_checkpoint
"""

SCENARIOS: Dict[str, str] = {}

SCENARIOS["deletion"] = """
manager = CheckpointManager(Checkpoint(), D, max_to_keep=3)
paths = [manager.save() for _ in range(4)]
result = [[base(p) for p in paths], [exists(p) for p in paths], [base(p) for p in manager.checkpoints]]
"""

SCENARIOS["keep_all_then_three"] = """
checkpoint = Checkpoint()
manager = CheckpointManager(checkpoint, D, max_to_keep=None)
paths = [manager.save() for _ in range(3)]
out = [[exists(p) for p in paths], base(manager.latest_checkpoint), [base(p) for p in manager.checkpoints]]
del manager
manager = CheckpointManager(checkpoint, D, max_to_keep=None)  # a new manager knows them all
paths.append(manager.save())
out.append([base(p) for p in manager.checkpoints])
del manager
manager = CheckpointManager(checkpoint, D, max_to_keep=3)  # nothing deleted before the next save
out.append([base(p) for p in manager.checkpoints])
out.append([exists(p) for p in paths])
paths.append(manager.save())
out += [[base(p) for p in manager.checkpoints], [exists(p) for p in paths]]
result = out
"""

SCENARIOS["keep_every_n_hours_across_managers"] = """
checkpoint = Checkpoint()
fake, patch = clock(3.0)
out = []
with patch:
    first = CheckpointManager(checkpoint, D, max_to_keep=2)
    fake.now = 10000.0
    first.save()
    fake.now = 10000.0 + 3610.0
    first.save()
    state = get_checkpoint_state(D)
    out += [list(state.all_model_checkpoint_timestamps), [base(p) for p in first.checkpoints],
            base(first.latest_checkpoint)]
    del first
    second = CheckpointManager(checkpoint, D, max_to_keep=2, keep_checkpoint_every_n_hours=1.5)
    out += [[base(p) for p in second.checkpoints], base(second.latest_checkpoint)]
    for step in (0.2, 0.5, 0.5):
        fake.now += 3600.0 * step
        second.save()
        state = get_checkpoint_state(D)
        out.append([[base(p) for p in second.checkpoints], state.last_preserved_timestamp,
                    [exists(os.path.join(D, f"ckpt-{i}")) for i in range(1, 6)]])
    del second
    third = CheckpointManager(checkpoint, D, max_to_keep=2, keep_checkpoint_every_n_hours=1.5)
    out.append(base(third.latest_checkpoint))
    fake.now += 10.0
    third.save()
    state = get_checkpoint_state(D)
    out.append([state.last_preserved_timestamp, [base(p) for p in third.checkpoints],
                [exists(os.path.join(D, f"ckpt-{i}")) for i in range(1, 7)]])
result = out
"""

SCENARIOS["continue_from_unmanaged"] = """
prefix = os.path.join(D, "unusual_prefix")
checkpoint = Checkpoint()
unmanaged = [checkpoint.save(prefix), checkpoint.save(prefix)]
checkpoint = Checkpoint()
manager = CheckpointManager(checkpoint, D, max_to_keep=2)
out = [base(manager.latest_checkpoint), [base(p) for p in manager.checkpoints]]
checkpoint.restore(manager.latest_checkpoint).run_restore_ops()
out.append(int(checkpoint.save_counter.numpy()))
managed = []
for _ in range(3):
    managed.append(manager.save())
    out.append([base(p) for p in manager.checkpoints])
out.append([exists(p) for p in unmanaged + managed])
result = out
"""

SCENARIOS["clock_went_back"] = """
checkpoint = Checkpoint()
fake, patch = clock(10000.0)
out = []
with patch:
    first = CheckpointManager(checkpoint, D, max_to_keep=1, keep_checkpoint_every_n_hours=1.0)
    paths = [first.save()]
    fake.now += 3600.0
    paths.append(first.save())
    fake.now += 3600.0
    paths.append(first.save())
    out += [[exists(p) for p in paths], [base(p) for p in first.checkpoints],
            get_checkpoint_state(D).last_preserved_timestamp]
    fake.now = 5000.0  # the clock goes back: a warning says so
    del first
    logged, capturing = capture_warnings()
    with capturing:
        second = CheckpointManager(checkpoint, D, max_to_keep=1)
    out += [base(second.latest_checkpoint), [base(p) for p in second.checkpoints],
            [m for m in logged if "behind the last preserved checkpoint timestamp" in m]]
    for _ in range(2):  # what existed is never deleted; the new ones are managed
        fake.now += 10.0
        paths.append(second.save())
        out.append([[exists(p) for p in paths], base(second.latest_checkpoint),
                    [base(p) for p in second.checkpoints]])
    state = get_checkpoint_state(D)
    out += [state.last_preserved_timestamp, list(state.all_model_checkpoint_timestamps)]
result = out
"""

SCENARIOS["custom_numbering"] = """
step = Variable(0, dtype="int64")
checkpoint = Checkpoint(step=step)
manager = CheckpointManager(checkpoint, D, max_to_keep=2)
names = []
for _ in range(5):
    names.append(base(manager.save(checkpoint_number=step)))
    step.assign_add(2)
out = [names, int(checkpoint.save_counter.numpy())]
last = manager.save(checkpoint_number=32)
state = get_checkpoint_state(D)
out += [base(last), last == manager.latest_checkpoint, last == latest_checkpoint(D),
        [base(p) for p in state.all_model_checkpoint_paths]]
result = out
"""

SCENARIOS["custom_prefix_and_pathlib"] = """
checkpoint = Checkpoint(v=Variable(0.0))
named = CheckpointManager(checkpoint, D, max_to_keep=2, checkpoint_name="ckpt_name")
out = [base(named.save(checkpoint_number=5))]
out.append(base(CheckpointManager(checkpoint, D, max_to_keep=2).save(checkpoint_number=5)))
folder = pathlib.Path(D) / "fspath"
manager = CheckpointManager(checkpoint, folder, max_to_keep=2, checkpoint_name="ckpt_name")
saved = manager.save()
out += [saved == str(folder / "ckpt_name-1"), manager.restore_or_initialize() == str(folder / "ckpt_name-1"),
        latest_checkpoint(folder) == str(folder / "ckpt_name-1"), type(saved).__name__]
result = out
"""

SCENARIOS["restore_or_initialize"] = """
init_v = Variable(2.0)
init_path = Checkpoint(v=init_v).save(os.path.join(D, "init"))
v = Variable(1.0)
checkpoint = Checkpoint(v=v)
manager = CheckpointManager(checkpoint, os.path.join(D, "ckpt"), max_to_keep=None,
                            init_fn=lambda: checkpoint.restore(init_path).run_restore_ops())
out = [manager.restore_or_initialize(), float(v.numpy())]
v.assign(5.0)
manager.save()
v.assign(0.0)
out += [base(manager.restore_or_initialize()), float(v.numpy())]
result = out
"""

SCENARIOS["checkpoint_interval"] = """
step = Variable(0)
manager = CheckpointManager(Checkpoint(v=Variable(1.0)), D, max_to_keep=None, step_counter=step,
                            checkpoint_interval=2)
out = [base(manager.save(check_interval=True))]
for _ in range(2):
    step.assign_add(1)
    out.append(base(manager.save(check_interval=True)))
out.append(base(manager.save(check_interval=True)))  # the same step again
step.assign_add(1)
out += [base(manager.save(check_interval=True)), base(manager.save(check_interval=False))]
result = out
"""

SCENARIOS["checkpoint_interval_from_last_step"] = """
step = Variable(1)
manager = CheckpointManager(Checkpoint(v=Variable(1.0)), D, max_to_keep=None, step_counter=step,
                            checkpoint_interval=2, last_checkpoint_step=1)
out = [base(manager.save(check_interval=True))]
for _ in range(2):
    step.assign_add(1)
    out.append(base(manager.save(check_interval=True)))
result = out
"""

SCENARIOS["checkpoint_interval_after_restore"] = """
step = Variable(0)
checkpoint = Checkpoint(v=Variable(1.0))
checkpoint.save(os.path.join(D, "ckpt"))
manager = CheckpointManager(checkpoint, D, max_to_keep=None, step_counter=step, checkpoint_interval=2)
result = [base(manager.restore_or_initialize()), base(manager.save())]
"""


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_manager_scenario_as_tf(tf_oracle: TFOracle, tmp_path: Path, scenario: str) -> None:
    script = SCENARIOS[scenario]
    theirs = tf_oracle.probe(COMMON + TF_PRELUDE + f"D = {str(tmp_path / 'tf')!r}\n" + script)
    ours = probe_ours(COMMON + OUR_PRELUDE + f"D = {str(tmp_path / 'ours')!r}\n" + script)
    assert theirs["error"] is None, theirs["error"]
    assert ours == theirs, (scenario, ours, theirs)
    _check_what_tf_does(scenario, theirs["result"])


def _check_what_tf_does(scenario: str, result: Any) -> None:
    """A few facts of TF's answers, so that a scenario that goes wrong on both sides is noticed too."""
    if scenario == "deletion":
        assert result[1] == [False, True, True, True]
    elif scenario == "keep_every_n_hours_across_managers":
        assert result[-1] == [13610.0 + 3600 * 0.7, ["ckpt-5", "ckpt-6"], [True, False, False, True, True, True]]
    elif scenario == "clock_went_back":
        assert result[3:5] == ["ckpt-3", []] and result[-2:] == [5000.0, [5020.0]]
        assert result[5] == ["time.time() returned a value 8600.000000 seconds behind the last preserved checkpoint "
                             "timestamp."]
    elif scenario == "custom_numbering":
        assert result[0] == ["ckpt-0", "ckpt-2", "ckpt-4", "ckpt-6", "ckpt-8"] and result[1] == 5
    elif scenario == "checkpoint_interval":
        assert result == ["ckpt-1", None, "ckpt-2", None, None, "ckpt-3"]
    elif scenario == "checkpoint_interval_after_restore":
        assert result == ["ckpt-1", None]
