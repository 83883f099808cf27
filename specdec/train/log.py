"""``train_log.jsonl``: one JSON row per event of a training pipeline, echoed on stderr."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path


class TrainLog:
    """``train_log.jsonl``: appended, one event a line; also echoed on stderr."""

    def __init__(self, path: Path | None, quiet: bool = False, name: str = "drafter"):
        self.path, self.quiet, self.name = path, quiet, name  # path None: nothing written (data-parallel ranks other than 0)

    def __call__(self, event: str, **fields) -> dict:
        row = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "event": event,
               **fields}
        if self.path is None:
            return row
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if not self.quiet:
            print(f"[{self.name}] {event} " + " ".join(f"{k}={v}" for k, v in fields.items() if k != "detail"),
                  file=sys.stderr, flush=True)
        return row
