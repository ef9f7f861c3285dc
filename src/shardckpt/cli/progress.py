"""Progress reporting for long CLI operations (convert, diff, verify, inspect).

:func:`progress_bar` is a context manager giving a callback ``advance(name, amount)``.
When stderr is a terminal (and ``rich`` is installed, the ``[cli]`` extra) it draws a
transient ``rich`` progress bar on stderr (bytes done, throughput and time left; or
items done out of the total with ``unit="items"``), erased when the operation ends;
otherwise (a pipe, a log file, CI, ``--json``) it prints nothing, or with
``lines=True`` one plain ``description: name: N bytes`` line per item on stderr. The bar
is never on stdout, so what a command prints there stays machine-readable.

The ``SHARDCKPT_PROGRESS`` environment variable overrides the terminal check:
``never`` draws no bar even on a terminal, ``always`` draws one (with terminal control
sequences) whatever stderr is; ``auto`` (the default, also for unknown values) draws
one only on a terminal. ``--json`` always turns the bar off. ``always`` without ``rich``
prints one line on stderr saying to install the ``[cli]`` extra, then nothing more.

Sizes and speeds use binary units (KiB, MiB, GiB), as every result the commands print.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator, Optional, TextIO

from .._extras import install_hint
from ._text import human_size

__all__ = ["progress_bar", "Advance", "use_rich", "progress_mode", "PROGRESS_ENV"]

Advance = Callable[[str, int], None]

#: The environment variable holding ``auto`` / ``always`` / ``never``.
PROGRESS_ENV = "SHARDCKPT_PROGRESS"


def progress_mode() -> str:
    """``auto``, ``always`` or ``never``, from :data:`PROGRESS_ENV` (``auto`` when unset or unknown)."""
    value = os.environ.get(PROGRESS_ENV, "").strip().lower()
    return value if value in ("always", "never") else "auto"


_TOLD_NO_RICH = False


def use_rich(stream: Optional[TextIO] = None) -> bool:
    """Whether a live bar is drawn on ``stream`` (default stderr): see the module docstring."""
    global _TOLD_NO_RICH
    stream = stream or sys.stderr
    mode = progress_mode()
    if mode == "never":
        return False
    try:
        if mode == "auto" and not stream.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        if mode == "always" and not _TOLD_NO_RICH:
            _TOLD_NO_RICH = True
            print(f"{PROGRESS_ENV}=always draws no bar: progress bars need rich ({install_hint('cli')})",
                  file=stream, flush=True)
        return False
    return True


@contextlib.contextmanager
def progress_bar(description: str, total: Optional[int], *, enabled: bool = True, lines: bool = False,
                 stream: Optional[TextIO] = None, unit: str = "bytes") -> Iterator[Advance]:
    """Yield ``advance(name, amount)``; see the module docstring for what is shown where.

    ``unit`` is ``"bytes"`` (``amount`` is a byte count) or ``"items"`` (a count of
    things, e.g. tensors). ``advance.set_total(n)``, where present, sets the total once
    it is known (:func:`shardckpt.convert.convert` and :func:`~shardckpt.convert.diff` call it).
    """
    if unit not in ("bytes", "items"):
        raise ValueError(f"unit must be 'bytes' or 'items', got {unit!r}")
    stream = stream or sys.stderr
    if enabled and use_rich(stream):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        class BinarySpeedColumn(ProgressColumn):
            """Throughput in binary units (``MiB/s``), as the commands' results print sizes."""

            def render(self, task: Any) -> Any:
                from rich.text import Text

                speed = task.finished_speed or task.speed
                return Text("?" if speed is None else f"{human_size(int(speed))}/s", style="progress.data.speed")

        amounts: tuple[ProgressColumn, ...] = ((DownloadColumn(binary_units=True), BinarySpeedColumn())
                                               if unit == "bytes" else (MofNCompleteColumn(),))
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), *amounts, TimeRemainingColumn(),
                   TextColumn("{task.fields[item]}", style="dim"))
        console = Console(file=stream, force_terminal=True if progress_mode() == "always" else None)
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(description, total=total, item="")

            def advance(name: str, amount: int) -> None:
                bar.update(task, advance=amount, item=name[-60:])

            def set_total(amount: int) -> None:
                bar.update(task, total=amount)

            advance.set_total = set_total  # type: ignore[attr-defined]
            yield advance
        return

    def plain(name: str, amount: int) -> None:
        if enabled and lines:
            print(f"{description}: {name}" + (f": {amount} bytes" if unit == "bytes" else ""), file=stream,
                  flush=True)

    yield plain
