"""The shipped reference pair: loads in transformers and in specdec alike, short names, manifest."""

from __future__ import annotations

import json

import pytest
import torch

from specdec import LLM
from specdec.assets import ASSETS_DIR, heldout_prompts_path, resolve_model, short_name_path


@pytest.mark.parametrize("name", ["ref-target", "ref-draft"])
def test_logits_match_transformers(name):
    import transformers

    path = resolve_model(name)
    assert path == short_name_path(name) and (path / "config.json").is_file()
    prompt = json.loads(heldout_prompts_path().read_text().splitlines()[0])["prompt"]
    llm = LLM(name, device="cpu", kv_cache_tokens=2048)
    ids = llm.encode(prompt)[:200]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (llm.engine.all_logits(ids) - ref).abs().max().item() <= 1e-4


def test_pair_shares_tokenizer_and_fits_the_size_budget():
    target, draft = short_name_path("ref-target"), short_name_path("ref-draft")
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    size = sum(f.stat().st_size for d in (target, draft) for f in d.iterdir())
    assert size <= 40_000_000
    assert (target / "model.safetensors.index.json").is_file()  # sharded, like real checkpoints


def test_manifest_and_heldout_prompts_exist():
    manifest = (ASSETS_DIR / "DATA_MANIFEST.md").read_text()
    assert "heldout" in manifest and "Rebuild" in manifest
    prompts = [json.loads(line) for line in heldout_prompts_path().read_text().splitlines()]
    assert len(prompts) >= 100 and all(p["prompt"] for p in prompts)


def test_readme_main_command_uses_the_pair():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "ref-target" in readme
