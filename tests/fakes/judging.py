"""Judge runs against fake engines (tests.fakes.engine), small enough for the CPU test suite."""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import sys
from pathlib import Path


from specdec.judge import JudgeConfig, Limits, run_judge
from tests.fakes.engine import WORDS

FAST = dict(num_prompts=12, max_tokens=16, busy_max_tokens=24, concurrency=4, gate_prompts=6, quiet=True,
            startup_timeout_s=30.0, request_timeout_s=30.0)


def fake_command(*options: str) -> str:
    """A command line that starts a fake engine on the port the judge chooses."""
    return shlex.join([sys.executable, "-m", "tests.fakes.engine", "--token-ms", "0.5", "--kv-tokens", "1024",
                       *options]) + " --port {port}"


def write_prompts(path: Path, count: int = 48, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
            f.write(json.dumps({"id": f"p{i}", "prompt": words}) + "\n")
    return path


def judge_fakes(tmp_path: Path, stock: str | tuple = (), candidate: str | tuple = (), **overrides) -> dict:
    """Judge fake engines: options tuples become fake commands, strings are used as they are (URLs)."""
    spec = lambda x: x if isinstance(x, str) else fake_command(*x)  # noqa: E731
    limit_names = {f.name for f in dataclasses.fields(Limits)}
    limits = Limits(**{k: overrides.pop(k) for k in list(overrides) if k in limit_names})
    config = JudgeConfig(stock=spec(stock), candidate=spec(candidate), prompts=write_prompts(tmp_path / "p.jsonl"),
                         out=tmp_path / "out", limits=limits, **{**FAST, **overrides})
    return run_judge(config)
