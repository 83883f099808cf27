"""`specdec train drafter` data parallel: two gloo ranks under torchrun on CPU end with the same drafter as one
process trained on the same global batches (the ranks split each global batch; the losses are normalised by
the global batch's token counts, so the averaged gradients are the global batch's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.judge.engines import free_port
from specdec.train import drafter as pipeline
from tests.checkpoints import save_tiny
from tests.test_train_drafter import _texts, _write_jsonl


def _argv(base: Path, out: Path, **changes) -> list[str]:
    options = {"--target": base / "target", "--base": base / "base", "--prompts": base / "prompts.jsonl",
               "--out": out, "--heldout": base / "heldout.jsonl", "--max-new-tokens": 12, "--gen-batch-size": 8,
               "--max-steps": 4, "--batch-size": 8, "--seq-len": 40, "--lr": 3e-3, "--warmup-steps": 1,
               "--device": "cpu", "--formats": "bf16", "--eval-every": 100, "--checkpoint-every": 100,
               "--topk-kl": 4, "--kl-weight": 0.5, **changes}
    return [str(x) for key, value in options.items() for x in (key, value)] + ["--no-verify"]


def test_two_ranks_train_the_same_drafter_as_one(tmp_path):
    save_tiny(tmp_path / "target", seed=0)
    save_tiny(tmp_path / "base", seed=1)
    _write_jsonl(tmp_path / "heldout.jsonl", [{"id": f"h{i}", "prompt": t} for i, t in enumerate(_texts(2, 7))])
    _write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"t{i}", "prompt": t} for i, t in enumerate(_texts(16, 3))])
    two, one = tmp_path / "world2", tmp_path / "world1"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "specdec.train.drafter"]
    done = subprocess.run(command + _argv(tmp_path, two), env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    events = [json.loads(line) for line in (two / "train_log.jsonl").read_text().splitlines()]  # rank 0's only
    assert sum(e["event"] == "continuations" for e in events) == 1 and (two / "export" / "bf16").is_dir()
    assert len(list((two / "continuations").glob("shard-*.topk.npz"))) == 2

    one.mkdir()  # the same continuations: one process, the same global batches
    shutil.copytree(two / "continuations", one / "continuations")
    shutil.copy(two / "heldout.jsonl", one / "heldout.jsonl")
    assert pipeline.main(_argv(tmp_path, one)) == 0
    weights = [torch.load(out / "checkpoint" / "state.pt", weights_only=True)["model"] for out in (one, two)]
    assert weights[0].keys() == weights[1].keys()
    worst = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    assert worst <= 1e-5, worst
    losses = [[json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "train"] for out in (one, two)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)


def test_world_size_must_divide_the_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "init_distributed", lambda device: (0, 3, False))
    for name in ("target", "base"):  # the arguments must name directories; the check comes before any loading
        (tmp_path / name).mkdir()
    with pytest.raises(ValueError, match="not a multiple of the world size 3"):
        pipeline.main(_argv(tmp_path, tmp_path / "out"))
