"""What a person watching a judge run sees: the phase, and per batch its requests and tokens/s so far."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LINE_EVERY_S = 30.0  # without a terminal (a log file), how often a running batch reports


class Reporter:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.console = Console(stderr=True, quiet=quiet)

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def batch(self, label: str, total: int) -> "BatchProgress":
        return BatchProgress(self, label, total)


class BatchProgress:
    """A progress bar for one batch of requests: `with reporter.batch(...) as bar: bar.advance(tokens)`."""

    def __init__(self, reporter: Reporter, label: str, total: int):
        self.reporter = reporter
        self.label = label
        self.total = total
        self.done = 0
        self.tokens = 0
        self.start = self.last_line = time.perf_counter()
        self.lines = not reporter.quiet and not reporter.console.is_terminal  # a log: a line now and then
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[speed]}"), TimeElapsedColumn(),
                                 console=reporter.console, transient=True,
                                 disable=reporter.quiet or not reporter.console.is_terminal)
        self.task = self.progress.add_task(label, total=total, speed="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def advance(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.perf_counter()
        speed = self.tokens / max(now - self.start, 1e-9)
        self.progress.update(self.task, advance=1, speed=f"{speed:8.1f} tok/s")
        if self.lines and now - self.last_line >= LINE_EVERY_S:
            self.last_line = now
            self.reporter.say(f"{self.label}: {self.done}/{self.total} requests, {speed:.1f} tok/s so far")
