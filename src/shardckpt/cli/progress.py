"""Progress reporting for long CLI operations (convert, diff, verify, inspect).

:func:`progress_bar` is a context manager giving a callback ``advance(name, nbytes)``.
When stderr is a terminal (and ``rich`` is installed, the ``[cli]`` extra) it draws a
``rich`` progress bar on stderr with bytes done, throughput and time left; otherwise
(a pipe, a log file, CI, ``--json``) it prints nothing, or with ``lines=True`` one
plain ``name: N bytes`` line per item on stderr, so stdout stays machine-readable.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Optional, TextIO

__all__ = ["progress_bar", "Advance", "use_rich"]

Advance = Callable[[str, int], None]


def use_rich(stream: Optional[TextIO] = None) -> bool:
    """Whether a live bar can be drawn: ``stream`` (default stderr) is a TTY and rich imports."""
    stream = stream or sys.stderr
    try:
        if not stream.isatty():
            return False
        import rich.progress  # noqa: F401
    except (ImportError, AttributeError, ValueError):
        return False
    return True


@contextlib.contextmanager
def progress_bar(description: str, total_bytes: Optional[int], *, enabled: bool = True,
                 lines: bool = False, stream: Optional[TextIO] = None) -> Iterator[Advance]:
    """Yield ``advance(name, nbytes)``; see the module docstring for what is shown where.

    ``advance.set_total(nbytes)``, where present, sets the total once it is known
    (:func:`shardckpt.convert.convert` and :func:`~shardckpt.convert.diff` call it).
    """
    stream = stream or sys.stderr
    if enabled and use_rich(stream):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[item]}", style="dim"))
        with Progress(*columns, console=Console(file=stream), transient=True) as bar:
            task = bar.add_task(description, total=total_bytes, item="")

            def advance(name: str, nbytes: int) -> None:
                bar.update(task, advance=nbytes, item=name[-60:])

            def set_total(nbytes: int) -> None:
                bar.update(task, total=nbytes)

            advance.set_total = set_total  # type: ignore[attr-defined]
            yield advance
        return

    def plain(name: str, nbytes: int) -> None:
        if enabled and lines:
            print(f"{description}: {name}: {nbytes} bytes", file=stream, flush=True)

    yield plain
