"""Resumable runs: the checkpoint directory and the run's recorded identity."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class RunMismatchError(ValueError):
    """``--out`` holds a run with other data or models than asked for."""


class Checkpoint:
    """``OUT/checkpoint/``: ``state.pt`` (model + optimizer tensors, loadable with ``weights_only``) and
    ``meta.json`` (step, tokens, QAT on/off, batch order, history)."""

    def __init__(self, directory: Path):
        self.dir = directory

    def exists(self) -> bool:
        return (self.dir / "meta.json").is_file() and (self.dir / "state.pt").is_file()

    def meta(self) -> dict:
        return json.loads((self.dir / "meta.json").read_text())

    def save(self, model, optimizer, meta: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, self.dir / "state.pt")
        (self.dir / "meta.json.tmp").write_text(json.dumps(meta))
        os.replace(self.dir / "meta.json.tmp", self.dir / "meta.json")

    def restore(self, model, optimizer) -> None:
        state = torch.load(self.dir / "state.pt", map_location=next(model.parameters()).device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _shown(value) -> str:
    text = "none" if value is None else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_run_identity(run) -> None:
    """Record the run's settings (``run.identity()``) in ``run.out``/run.json; refuse to resume a run made with
    other data or models."""
    path = Path(run.out) / "run.json"
    identity = run.identity()
    if path.is_file():
        recorded = json.loads(path.read_text())
        diff = sorted(k for k in identity.keys() | recorded.keys() if recorded.get(k) != identity.get(k))
        if diff:
            # e.g. "corpus_windows (the run's: none, now: 100000)"; a setting a run left at its default is absent
            settings = "; ".join(f"{k} (the run's: {_shown(recorded.get(k))}, now: {_shown(identity.get(k))})"
                                 for k in diff)
            raise RunMismatchError(f"{run.out} holds a run with other settings: {settings} (see {path}): use a "
                                   "new --out, or the run's settings to resume it")
    else:
        path.write_text(json.dumps(identity, indent=1) + "\n")
