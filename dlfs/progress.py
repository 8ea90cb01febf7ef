"""Progress bars for long admin work (populate, verify), only on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class Advance(Protocol):
    def __call__(self, nbytes: int) -> None: ...


@contextmanager
def byte_progress(description: str, total: int, enabled: bool | None = None) -> Iterator[Advance]:
    """Yield a callable advancing a byte-count bar on stderr (a no-op off a terminal)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda nbytes: None
        return
    # markup=False: a source path may hold [brackets], which are not rich markup.
    columns = (TextColumn("{task.description}", markup=False), BarColumn(),
               DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)
