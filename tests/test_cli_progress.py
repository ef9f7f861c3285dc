"""Progress bars of ``shardckpt verify`` and ``inspect``: drawn on a terminal, never elsewhere.

The command line runs as a real process. Off a terminal (stderr a pipe) stderr stays
empty and stdout holds only the report; with stderr on a pseudo-terminal a ``rich`` bar
(terminal control sequences) is drawn there while stdout, a pipe, gets the very same
report; ``--json`` draws nothing even on a terminal; ``SHARDCKPT_PROGRESS`` forces the
bar on (``always``) or off (``never``).
"""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

import shardckpt
from shardckpt.cli.progress import PROGRESS_ENV, progress_bar

ESC = b"\x1b["


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("progress") / "model.ckpt")
    shardckpt.save_tensors(path, {f"layer_{i}/kernel": rng.standard_normal((128, 256)).astype(np.float32)
                                  for i in range(8)})
    return path


def _env(progress: Optional[str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PROGRESS_ENV}
    env["TERM"] = "xterm-256color"
    if progress is not None:
        env[PROGRESS_ENV] = progress
    return env


def _cli(*args: str) -> List[str]:
    return [sys.executable, "-m", "shardckpt.cli.main", *args]


def run_piped(*args: str, progress: Optional[str] = None) -> "subprocess.CompletedProcess[bytes]":
    return subprocess.run(_cli(*args), capture_output=True, timeout=120, env=_env(progress))


def run_on_terminal(*args: str, progress: Optional[str] = None) -> Tuple[int, bytes, bytes]:
    """Run the command line with stderr on a pseudo-terminal: (exit status, stdout, what the terminal got)."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(_cli(*args), stdout=subprocess.PIPE, stderr=follower, env=_env(progress))
        os.close(follower)
        follower = -1
        terminal = b""
        deadline = time.monotonic() + 120
        exited = False
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                if exited:  # one more wait after the exit was seen: nothing left to drain
                    break
                exited = proc.poll() is not None
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not chunk:
                break
            terminal += chunk
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.stdout.close()
        return proc.wait(timeout=120), out, terminal
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_off_a_terminal_only_the_report_is_printed(prefix: str, command: str) -> None:
    text = run_piped(command, prefix)
    assert text.returncode == 0 and text.stderr == b""
    assert ESC not in text.stdout
    assert (b"OK: 8 tensors" if command == "verify" else b"tensors: 8") in text.stdout
    as_json = run_piped(command, prefix, "--json")
    assert as_json.returncode == 0 and as_json.stderr == b""
    report = json.loads(as_json.stdout)
    assert report["ok"] if command == "verify" else report["num_tensors"] == 8


@pytest.mark.parametrize("command,description", [("verify", b"verify"), ("inspect", b"inspect")])
def test_on_a_terminal_a_bar_is_drawn_on_stderr_and_stdout_is_unchanged(prefix: str, command: str,
                                                                        description: bytes) -> None:
    status, out, terminal = run_on_terminal(command, prefix)
    assert status == 0
    assert description in terminal and ESC in terminal  # a live bar, drawn with control sequences
    assert out == run_piped(command, prefix).stdout  # the report itself is the same as off a terminal
    status, out, terminal = run_on_terminal(command, prefix, "--json")
    assert status == 0 and terminal == b"" and json.loads(out)  # --json: no bar, even on a terminal


def test_the_switch_forces_the_bar_on_or_off(prefix: str) -> None:
    forced = run_piped("verify", prefix, progress="always")
    assert forced.returncode == 0 and b"verify" in forced.stderr and ESC in forced.stderr
    assert forced.stdout == run_piped("verify", prefix).stdout
    status, _, terminal = run_on_terminal("verify", prefix, progress="never")
    assert status == 0 and terminal == b""


def test_items_unit_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``unit='items'``: counts, not bytes; plain lines name the items; forced bars show ``done/total``."""
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    lines = io.StringIO()
    with progress_bar("inspect", 2, stream=lines, lines=True, unit="items") as advance:
        advance("a", 1)
        advance("b", 1)
    assert lines.getvalue().splitlines() == ["inspect: a", "inspect: b"]
    monkeypatch.setenv(PROGRESS_ENV, "always")
    drawn = io.StringIO()
    with progress_bar("inspect", None, stream=drawn, unit="items") as advance:
        advance.set_total(2)  # type: ignore[attr-defined]
        advance("a", 1)
        advance("b", 1)
    assert "inspect" in drawn.getvalue() and "\x1b[" in drawn.getvalue()
    with pytest.raises(ValueError, match="unit"):
        with progress_bar("inspect", None, unit="tensors"):
            pass


def test_bars_count_bytes_in_binary_units_as_the_results_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "always")
    drawn = io.StringIO()
    with progress_bar("convert", 3 << 20, stream=drawn) as advance:
        advance("a", 3 << 20)
        time.sleep(0.2)
    text = drawn.getvalue()
    assert "MiB" in text and " MB" not in text and "MB/s" not in text, text


_NO_RICH = r"""
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "rich" or name.startswith("rich."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
from shardckpt.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_always_without_rich_says_to_install_the_cli_extra(prefix: str) -> None:
    done = subprocess.run([sys.executable, "-c", _NO_RICH, "verify", prefix], capture_output=True, timeout=120,
                          env=_env("always"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.decode().count("pip install '.[cli]'") == 1, done.stderr
    assert done.stdout == run_piped("verify", prefix).stdout


@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "diff", "demo"])
def test_help_is_plain_text_without_restructuredtext_markup(command: str) -> None:
    done = subprocess.run(_cli(command, "--help"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "``" not in done.stdout and ":func:" not in done.stdout and ":mod:" not in done.stdout, done.stdout


def test_checkpoint_options_repr_shows_every_option() -> None:
    text = repr(shardckpt.CheckpointOptions(timeout=12.5, async_staging_bytes=1 << 20, funnel_inflight_bytes=7))
    for part in ("timeout=12.5", "async_staging_bytes=1048576", "funnel_inflight_bytes=7", "trust_versions=False",
                 "io_device=None", "enable_async=False", "incremental=False"):
        assert part in text, text
