"""``specdec draft heldout``: the held-out set, the target's greedy continuations made by the engine.

Input: JSON lines ``{"id": ..., "prompt": "text" or [token ids], ...}`` (e.g. the bundled
``heldout-prompts.jsonl``).  Output: JSON lines ``{"id", "prompt": [ids], "continuation": [ids]}``, the
continuation being what the engine decodes greedily (temperature 0), all prompts batched; it stops at the
target's EOS (kept, since the target produced it) or after ``max_tokens``.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.errors import InvalidRequestError


def read_jsonl(path: str | Path) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc}") from exc
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{path}:{number} is not JSON: {exc}") from exc
    return rows


def load_heldout(path: str | Path, limit: int | None = None) -> list[dict]:
    """Conversations ``{"id", "prompt": [ids], "continuation": [ids]}``, checked."""
    rows = read_jsonl(path)[:limit]
    if not rows:
        raise InvalidRequestError(f"{path} holds no conversations")
    for i, row in enumerate(rows):
        ok = isinstance(row, dict) and all(
            isinstance(row.get(key), list) and all(isinstance(t, int) for t in row[key])
            for key in ("prompt", "continuation"))
        if not ok or not row["prompt"]:
            raise InvalidRequestError(f"{path}: conversation {i} is not {{\"id\", \"prompt\": [ids] (non-empty), "
                                      "\"continuation\": [ids]}: make the file with `specdec draft heldout`")
        row.setdefault("id", str(i))
    return rows


def make_heldout(llm, prompts: list[dict], max_tokens: int = 128, use_tqdm: bool = True) -> list[dict]:
    """The target's greedy continuation of each prompt, all generated together by the engine."""
    from specdec.sampling import SamplingParams

    ids = [llm.encode(row["prompt"]) for row in prompts]
    completions = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=use_tqdm)
    return [{"id": str(row.get("id", i)), "prompt": prompt, "continuation": out.token_ids}
            for i, (row, prompt, out) in enumerate(zip(prompts, ids, completions))]
