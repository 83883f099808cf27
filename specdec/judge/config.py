"""What the judge runs (JudgeConfig) and the gate's limits (Limits)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specdec.errors import ConfigError

WORKLOADS = ("solo", "team", "busy")
LAYOUTS = ("auto", "together", "alternate")


@dataclasses.dataclass
class Limits:
    greedy_agreement_floor: float | None = None
    likelihood_bound: float = 0.05
    argmax_bound: float = 0.01
    fidelity_ceiling: float = 0.002  # 0.02 for engines whose kernels differ from stock
    length_margin: float = 0.05
    memory_slack_mib: float = 4096.0
    memory_budget_mib: float | None = None  # a fixed budget instead of stock's peak + slack


@dataclasses.dataclass
class JudgeConfig:
    stock: str  # a command line (with {port}) or a URL
    candidate: str
    prompts: Path
    out: Path
    workloads: tuple[str, ...] = WORKLOADS
    passes: int = 3
    num_prompts: int | None = None  # None: every prompt in the file
    concurrency: int = 16  # team
    busy_concurrency: int | None = None  # None: enough for >= busy_kv_target KV-cache use (from /metrics)
    busy_kv_target: float = 0.9
    busy_max_concurrency: int = 512
    max_tokens: int = 128
    busy_max_tokens: int | None = None  # None: 2 x max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    gate_prompts: int = 32  # prompts for greedy agreement and fixed texts
    fixed_texts: Path | None = None  # None: the first gate_prompts prompts
    limits: Limits = dataclasses.field(default_factory=Limits)
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 900.0
    layout: str = "auto"  # together: both engines up at once; alternate: one at a time
    model: str | None = None  # the request's "model" field (default: the engine's first /v1/models id)
    stock_model: str | None = None  # per engine, for engines that name the same model differently (default: model)
    candidate_model: str | None = None
    scorer: Path | None = None  # a local reference model that scores texts (engines without prompt log-probs)
    scorer_device: str = "auto"
    quick: bool = False  # sized by --quick: the record says what it cannot check at that size
    title: str | None = None
    quiet: bool = False

    def __post_init__(self):
        self.prompts, self.out = Path(self.prompts), Path(self.out)
        self.workloads = tuple(self.workloads)
        if not self.workloads or any(w not in WORKLOADS for w in self.workloads):
            raise ConfigError(f"workloads must be some of {', '.join(WORKLOADS)}, got {self.workloads!r}")
        if self.passes < 1 or self.concurrency < 1 or self.max_tokens < 1 or self.gate_prompts < 1:
            raise ConfigError("passes, concurrency, max_tokens and gate_prompts must be at least 1")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.scorer is not None:
            self.scorer = Path(self.scorer)
        if self.busy_max_tokens is None:
            self.busy_max_tokens = 2 * self.max_tokens

    def model_for(self, role: str) -> str | None:
        """The requests' model field for one engine ("stock" or "candidate"), or None to ask the engine."""
        return (self.stock_model if role == "stock" else self.candidate_model) or self.model

    def settings(self) -> dict:
        """The run's settings for the record (JSON-safe)."""
        out = dataclasses.asdict(self)
        out.pop("limits")
        return json.loads(json.dumps(out, default=str))


QUICK = dict(num_prompts=8, max_tokens=32, busy_max_tokens=48, concurrency=4, gate_prompts=8)
"""--quick: a small run (minutes on a CPU) that still has every workload, all passes and every check."""


def load_prompts(path: Path, limit: int | None = None) -> list[str]:
    """Prompts from a JSON-lines file (`{"prompt": ...}` or `{"text": ...}` a line) or plain text lines."""
    if not Path(path).is_file():
        raise ConfigError(f"no prompts file at {path}: pass --prompts FILE (JSON lines with a \"prompt\" field)")
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = line
        if isinstance(row, dict):
            row = row.get("prompt", row.get("text"))
        if not isinstance(row, str):
            raise ConfigError(f"{path}: every line needs a \"prompt\" string, got {line[:80]!r}")
        prompts.append(row)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts
