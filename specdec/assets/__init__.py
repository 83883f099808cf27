"""Shipped assets: the reference model pair and its held-out prompt set.

``ref-target`` (a small Qwen3 causal LM) and ``ref-draft`` (a much smaller Qwen3 drafter with the same
tokenizer) are Hugging Face directories under this package, built by ``bench/refpair.py``;
``ref-head`` is the EAGLE-3 draft head of ``ref-target`` (``specdec train head``, ``bench/gpu_head.sh``);
``ref-hybrid`` is a small Qwen3.5-shaped (hybrid) target with its own trained MTP head (``mtp.*``), on
``ref-target``'s tokenizer (``bench/gpu_hybrid.sh``);
``heldout-prompts.jsonl`` holds prefixes of held-out source files, one ``{"id", "prompt", ...}`` a line.
"""

from __future__ import annotations

import os
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
SHORT_NAMES = {"ref-target": "ref-target", "ref-draft": "ref-draft", "ref-head": "ref-head",
               "ref-hybrid": "ref-hybrid"}
HELDOUT_PROMPTS = "heldout-prompts.jsonl"


def short_name_path(name: str) -> Path:
    """The directory a short name stands for (whether or not it has been built yet)."""
    if name not in SHORT_NAMES:
        raise KeyError(name)
    return ASSETS_DIR / SHORT_NAMES[name]


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A model directory from a short name (``ref-target``, ``ref-draft``) or an existing path.

    Raises ``FileNotFoundError`` for anything else, and for a short name whose checkpoint is not there.
    """
    name = os.fspath(name_or_path)
    if name in SHORT_NAMES:
        path = short_name_path(name)
        if not (path / "config.json").is_file() and name == "ref-head":
            raise FileNotFoundError(
                f"'ref-head' resolves to {path}, which holds no checkpoint (config.json) yet: train it with "
                "`specdec train head --target ref-target --prompts CORPUS --out RUN` and copy RUN/export/bf16 "
                "there, or pass an EAGLE-3 head directory")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{name!r} resolves to {path}, which holds no checkpoint (config.json) yet: build the "
                "reference pair with `python3 bench/refpair.py --out DIR` and copy its ref-target/ and "
                "ref-draft/ here, or pass a Hugging Face model directory"
            )
        return path
    path = Path(name).expanduser()
    if path.exists():
        return path
    raise FileNotFoundError(
        f"unknown model {name!r}: not a short name ({', '.join(sorted(SHORT_NAMES))}) and no such path; "
        "pass a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)"
    )


def heldout_prompts_path() -> Path:
    """Path of the held-out prompt set (``{"id", "prompt"}`` per line, ~200 prompts)."""
    return ASSETS_DIR / HELDOUT_PROMPTS
