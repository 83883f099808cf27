"""``weights.sha256.json``: the sha256 of each weight file of an exported checkpoint, checked at load; and the
commit of the source that made a record (`source_commit`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from specdec.errors import ModelLoadError

SHA256_FILE = "weights.sha256.json"


def file_sha256(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_weights_sha256(model_dir: Path | str) -> dict[str, str]:
    """Record the sha256 of every ``*.safetensors`` file of ``model_dir``; returns {file name: hex}."""
    model_dir = Path(model_dir)
    record = {p.name: file_sha256(p) for p in sorted(model_dir.glob("*.safetensors"))}
    (model_dir / SHA256_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def check_weights_sha256(model_dir: Path | str) -> str:
    """Compare the weight files with ``weights.sha256.json``: raises ``ModelLoadError`` on any mismatch
    (or a listed file missing); returns a one-line account (also when there is no record to check)."""
    model_dir = Path(model_dir)
    path = model_dir / SHA256_FILE
    if not path.is_file():
        return f"{model_dir}: no {SHA256_FILE}, weights not checked"
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not JSON ({exc})") from exc
    for name, expected in record.items():
        weights = model_dir / name
        if not weights.is_file():
            raise ModelLoadError(f"{model_dir}: {name} is listed in {SHA256_FILE} but missing")
        actual = file_sha256(weights)
        if actual != expected:
            raise ModelLoadError(f"{weights}: sha256 {actual} does not match {expected} recorded in {SHA256_FILE}: "
                                 "refusing to serve weights other than those exported")
    return f"{model_dir}: sha256 of {len(record)} weight file(s) match {SHA256_FILE}"


def source_commit() -> str | None:
    """specdec's commit: SPECDEC_COMMIT (a copy without git history, as on the GPU machine), else git where the
    package is a checkout, else None."""
    if os.environ.get("SPECDEC_COMMIT"):
        return os.environ["SPECDEC_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).resolve().parent).strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None
