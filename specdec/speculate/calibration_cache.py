"""Start-up calibration kept on disk: the step-cost tables of one (target, speculator, engine shape, device).

Measuring the tables costs seconds on a GPU and most of a short job on a CPU (`specdec generate` with n-gram
took 11 s against 3.7 s plain on 2 cores), and they change only with what the key names: the target's and the
drafter's configs and dtype, the engine's shape settings, the speculator, the device and the software. So the
first run measures them and writes them to $SPECDEC_CACHE_DIR/calibration (default ~/.cache/specdec); a later
run with the same key reads them. SPECDEC_CALIBRATION_CACHE=off measures every time. The served steps
still correct the tables as they run (the goodput estimate, goodput.py), so a cache from a noisier day is
soon outvoted.

A file that cannot be read or parsed is measured over and rewritten: the cache can only cost a measurement.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from specdec.speculate.step_costs import StepCostTable

VERSION = 1  # bump when what calibrate() measures changes


def cache_enabled() -> bool:
    return os.environ.get("SPECDEC_CALIBRATION_CACHE", "on").lower() not in ("off", "0", "false", "no")


def cache_root() -> Path:
    """$SPECDEC_CACHE_DIR, default ~/.cache/specdec: what specdec keeps between runs."""
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec")


def cache_dir() -> Path:
    return cache_root() / "calibration"


def calibration_key(engine, spec, candidates: list[int]) -> str:
    """sha256 of everything the tables depend on (see the module's note)."""
    config = dataclasses.asdict(engine.config)
    for volatile in ("kv_cache_tokens", "gpu_memory_utilization", "shared_kv_bytes_per_token"):
        config.pop(volatile, None)  # sizes of the cache, not of the steps timed
    drafter = getattr(spec, "runner", None)
    material = {
        "version": VERSION,
        "torch": torch.__version__,
        "device": _device_name(engine.device),
        "target": repr(engine.model.config),
        "dtype": str(engine.model.lm_head.weight.dtype),
        "engine": config,
        "graph_context": engine.graph_context_bound,
        "attention": engine.attention_backend,
        "speculator": spec.name,
        "drafter": repr(getattr(getattr(drafter, "model", None), "config", None)),
        "head": repr(getattr(getattr(spec, "head", None), "config", None)),
        "candidates": list(candidates),
        "verify_tokens": [spec.tree_nodes(k) for k in candidates],  # a tree's verify steps feed more drafts
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def load_tables(key: str):
    """(target, draft or None, verify {k: table}) from the cache, or None."""
    path = cache_dir() / f"{key}.json"
    try:
        raw = json.loads(path.read_text())
        target = _table(raw["target"])
        draft = _table(raw["draft"]) if raw["draft"] is not None else None
        verify = {int(k): _table(points) for k, points in raw["verify"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return target, draft, verify


def save_tables(key: str, target: StepCostTable, draft: StepCostTable | None,
                verify: dict[int, StepCostTable]) -> None:
    """Write the tables atomically (a reader never sees half a file); a cache that cannot be written is skipped."""
    raw = {"target": _points(target), "draft": _points(draft) if draft is not None else None,
           "verify": {str(k): _points(t) for k, t in verify.items()}}
    write_json_atomically(cache_dir() / f"{key}.json", raw)


def write_json_atomically(path: Path, raw) -> None:
    """Write raw as JSON so that a reader never sees half a file; a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(raw, f)
        os.replace(f.name, path)
    except OSError:
        pass


def _points(table: StepCostTable) -> dict[str, float]:
    return {str(t): s for t, s in zip(table.tokens, table.seconds)}


def _table(points: dict[str, float]) -> StepCostTable:
    table = StepCostTable({int(t): float(s) for t, s in points.items()})
    if not table.tokens or any(not s > 0 for s in table.seconds):
        raise ValueError("empty or non-positive table")
    return table


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} cc{torch.cuda.get_device_capability(device)}"
    return f"{device.type} {platform.machine()} {platform.processor()} threads={torch.get_num_threads()}"
