"""The process runtime owns every piece of process-wide state (issue 27), and the process's lifetime.

* Every piece of state (the process-wide coordinator, the keyed cache of coordinators —
  JAX's world, torch groups, background clones —, save numbers, the default saver, torch's
  stager, the scrubber, the default checksum context, the registrations) is the runtime's:
  the rooms' accessors return what the runtime holds, and a reset gives new ones
  (registrations excepted).
* A value is made once under concurrency, outside the lock (a slow maker does not stall
  other keys); a failed maker leaves nothing; a value anchored on an object ends with it.
* A forked child starts with new state (registrations kept) and does not finalize what
  its parent made.
* At interpreter exit a :class:`~shardckpt.runtime.ThreadPool` still runs work handed to
  it by a non-daemon thread (a background save), where a plain ``ThreadPoolExecutor``
  refuses it; a pool shut down by its owner still refuses. An async save to an object
  store still in flight when the script ends commits, although its HTTP client looks
  names up on its event loop's default executor.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from helpers.forking import fork_and_check

import shardckpt
from shardckpt import runtime as rt
from shardckpt.distributed import SingleProcessCoordinator, get_coordinator, set_coordinator
from shardckpt.distributed.select import current_coordinator
from shardckpt.format import crc
from shardckpt.saving import agreement, staging
from shardckpt.saving.context import BACKGROUND, default_context, default_saver
from shardckpt.saving.scrub import default_scrubber


def _state() -> Dict[str, Any]:
    """Every piece of process state, through the accessors the rooms use."""
    from shardckpt.torch._staging import default_stager

    coordinator = get_coordinator()
    return {
        "coordinator": coordinator,
        "background": default_context().background(coordinator),
        "saver": default_saver(),
        "stager": default_stager(),
        "scrubber": default_scrubber(),
        "checksums": crc.default_context(),
    }


class _Registered:
    pass


def test_every_piece_of_state_is_the_runtimes_and_a_reset_makes_new_ones(fresh_runtime: rt.Runtime) -> None:
    staging.register_stager(_Registered, lambda value, out: out.fill(7))
    before = _state()
    assert _state() == before  # made once, then kept
    assert rt.runtime() is fresh_runtime
    assert fresh_runtime.peek(BACKGROUND, anchor=before["coordinator"]) is before["background"]
    assert current_coordinator() is before["coordinator"]
    assert [agreement.save_identity(before["coordinator"], "p")[1] for _ in range(3)] == [1, 2, 3]

    after_reset = rt.reset()
    assert after_reset is not fresh_runtime and rt.runtime() is after_reset
    assert current_coordinator() is None  # nothing is made by looking
    after = _state()
    for name, value in after.items():
        assert value is not before[name], f"{name}: the reset runtime still holds the old one"
    assert _state() == after
    assert agreement.save_identity(after["coordinator"], "p") == ["p", 1]
    assert agreement.save_identity(before["coordinator"], "p") == ["p", 1]  # numbers are the runtime's too
    out = np.zeros(3, np.float32)
    staging.stage_value(_Registered(), out)  # registrations outlive a reset: imports make them once
    assert out.tolist() == [7, 7, 7]


def test_jax_and_torch_coordinators_are_kept_in_the_one_keyed_cache(fresh_runtime: rt.Runtime) -> None:
    import jax

    from shardckpt.jax import default_coordinator
    from shardckpt.jax._save import JAX_WORLD
    from shardckpt.torch._call import DcpCall, coordinator_for

    jax_coordinator = default_coordinator()
    assert default_coordinator() is jax_coordinator
    assert fresh_runtime.peek((JAX_WORLD, jax.process_count())) is jax_coordinator
    assert isinstance(coordinator_for(DcpCall(False)), SingleProcessCoordinator)  # not distributed: nothing kept
    rt.reset()
    assert default_coordinator() is not jax_coordinator


def test_set_coordinator_replaces_and_forgets(fresh_runtime: rt.Runtime) -> None:
    mine = SingleProcessCoordinator()
    set_coordinator(mine)
    assert get_coordinator() is mine and current_coordinator() is mine
    set_coordinator(None)
    assert current_coordinator() is None
    made = get_coordinator()
    assert made is not mine and get_coordinator() is made
    assert get_coordinator("single") is not made  # a named backend makes a new one, kept from now on
    assert current_coordinator() is not made


def test_a_value_is_made_once_and_a_slow_maker_stalls_no_other_key() -> None:
    runtime = rt.Runtime()
    calls: List[int] = []
    release = threading.Event()

    def slow() -> str:
        calls.append(1)
        assert release.wait(30)
        return "slow"

    got: List[str] = []
    threads = [threading.Thread(target=lambda: got.append(runtime.keep("a", slow))) for _ in range(8)]
    for t in threads:
        t.start()
    while not calls:
        time.sleep(0.001)
    # "a" is being made (outside the lock): another key is made and read meanwhile
    assert runtime.keep("b", lambda: "quick") == "quick"
    assert runtime.peek("a") is None
    release.set()
    for t in threads:
        t.join(30)
    assert got == ["slow"] * 8 and len(calls) == 1


def test_a_failed_make_leaves_nothing_and_a_maker_may_not_ask_for_its_own_key() -> None:
    runtime = rt.Runtime()

    def fails() -> int:
        raise OSError("no")

    with pytest.raises(OSError):
        runtime.keep("k", fails)
    assert runtime.peek("k") is None
    assert runtime.keep("k", lambda: 5) == 5
    with pytest.raises(RuntimeError, match="while this thread is making it"):
        runtime.keep("loop", lambda: runtime.keep("loop", lambda: 0))
    assert runtime.keep("loop", lambda: 1) == 1


def test_a_value_anchored_on_an_object_ends_with_it() -> None:
    runtime = rt.Runtime()

    class Anchor:
        pass

    class Value:
        pass

    anchor = Anchor()
    value = runtime.keep("clone", Value, anchor=anchor)
    assert runtime.keep("clone", Value, anchor=anchor) is value
    assert runtime.count("n", anchor=anchor) == 1 and runtime.count("n", anchor=anchor) == 2
    gone = weakref.ref(value)
    del anchor, value
    gc.collect()
    assert gone() is None


# -- fork: the child starts with new state ----------------------------------------------------

_PARENT: Dict[str, int] = {}


def _parent_makes_state(folder: str) -> None:
    staging.register_stager(_Registered, lambda value, out: out.fill(3))
    shardckpt.save_tensors(folder + "/parent", {"x": np.arange(4.0)}, options=shardckpt.CheckpointOptions(
        enable_async=True))
    default_saver().wait()
    _PARENT.update({name: id(value) for name, value in _state().items()})
    _PARENT["runtime"] = id(rt.runtime())


def _child_has_new_state(folder: str) -> int:
    if id(rt.runtime()) == _PARENT["runtime"] or current_coordinator() is not None:
        return 2
    if any(id(value) == _PARENT[name] for name, value in _state().items()):
        return 3
    out = np.zeros(2, np.float32)
    staging.stage_value(_Registered(), out)
    if out.tolist() != [3, 3]:
        return 4  # the registrations were lost
    shardckpt.save_tensors(folder + "/child", {"x": np.arange(5.0)}, options=shardckpt.CheckpointOptions(
        enable_async=True))
    default_saver().wait()
    with shardckpt.load_checkpoint(folder + "/child") as reader:
        return 0 if np.array_equal(reader.get_tensor("x"), np.arange(5.0)) else 5


def test_a_forked_child_starts_with_new_state_and_keeps_the_registrations(tmp_path: Path) -> None:
    code = fork_and_check(_parent_makes_state, _child_has_new_state, str(tmp_path))
    assert code != 124, "the forked child hung"
    assert code == 0


# -- exit: a ThreadPool runs work a non-daemon thread hands it while the interpreter shuts down -----

_AT_EXIT = """
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, {src!r})
from shardckpt.runtime import ThreadPool

pool = ThreadPool(2)
closed = ThreadPool(1)
closed.shutdown()
plain = ThreadPoolExecutor(2)
assert pool.submit(lambda: 1).result() == 1 and plain.submit(lambda: 1).result() == 1

def background():
    while threading.main_thread().is_alive():  # the main thread has ended: the interpreter shuts down
        time.sleep(0.01)
    try:
        plain.submit(print, "plain ran")
    except RuntimeError as exc:
        print("plain refused:", exc)
    print("pool:", sum(pool.map(lambda x: x * x, range(10))))
    with ThreadPool(4) as new:
        print("new pool:", new.submit(lambda: "ran").result())
    try:
        closed.submit(print, "closed ran")
    except RuntimeError:
        print("closed refused")

threading.Thread(target=background).start()
"""


def test_a_thread_pool_still_runs_work_while_the_interpreter_shuts_down(tmp_path: Path) -> None:
    script = tmp_path / "at_exit.py"
    script.write_text(textwrap.dedent(_AT_EXIT.format(src=str(Path(rt.__file__).parents[1]))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("plain refused:"), proc.stdout  # what concurrent.futures does at exit
    assert lines[1:] == ["pool: 285", "new pool: ran", "closed refused"], proc.stdout


_S3_EXIT = """
import sys
import numpy as np
import shardckpt
state = {f"t{i}": np.full((256, 1024), i, np.float32) for i in range(16)}
shardckpt.save_tensors(sys.argv[1], state, options=shardckpt.CheckpointOptions(enable_async=True))
print("RETURNED", flush=True)
"""


def test_an_async_save_to_an_object_store_in_flight_at_exit_commits(tmp_path: Path, s3dir: str) -> None:
    """The script ends right after the call; the background save's first requests come after that. Through
    ``localhost`` the HTTP client looks the name up on its event loop's default executor, which
    ``concurrent.futures`` would refuse by then."""
    script = tmp_path / "s3_exit.py"
    script.write_text(_S3_EXIT)
    env = dict(os.environ, PYTHONPATH=str(Path(rt.__file__).parents[1]))
    env["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL"].replace("127.0.0.1", "localhost")
    proc = subprocess.run([sys.executable, str(script), s3dir + "/ck"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0 and "RETURNED" in proc.stdout, proc.stderr[-3000:]
    assert "failed" not in proc.stderr, proc.stderr[-3000:]
    with shardckpt.load_checkpoint(s3dir + "/ck") as reader:
        np.testing.assert_array_equal(reader.get_tensor("t15"), np.full((256, 1024), 15, np.float32))
