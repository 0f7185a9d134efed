"""The progress of ``python -m jaxdist.data prepare``: bytes read, as a bar or as lines."""

from __future__ import annotations

import sys

from jaxdist.units import size


class Progress:
    """Bytes read: a rich bar when stderr is a terminal, else a plain line per ~10%."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.done, self.enabled = total_bytes, 0, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

            columns = (BarColumn(bar_width=30), DownloadColumn(), TimeRemainingColumn())
            self.bar = Progress(*columns, console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("prepare", total=total_bytes)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def advance(self, nbytes: int) -> None:
        tenths_before = 10 * self.done // max(self.total, 1)
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
        elif self.enabled and 10 * self.done // max(self.total, 1) > tenths_before:
            read = f"{size(self.done)} of {size(self.total)}"
            print(f"prepare: {read} read", file=sys.stderr, flush=True)
