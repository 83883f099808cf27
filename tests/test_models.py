"""Our Qwen3 / Llama forward passes against transformers' on the same weights."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM
from tests.checkpoints import save_tiny

CASES = {  # name -> save_tiny kwargs
    "qwen3-gqa-untied": dict(arch="qwen3"),
    "qwen3-tied": dict(arch="qwen3", tie=True),
    "qwen3-mha": dict(arch="qwen3", num_key_value_heads=4),
    "llama-gqa-untied": dict(arch="llama"),
    "llama-tied-rope-scaled": dict(arch="llama", tie=True, rope_scaling=True),
    "llama-sharded": dict(arch="llama", max_shard_size="20KB"),
}


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, V]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp(request.param), seed=hash(request.param) % 1000, **CASES[request.param])
    ids = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    return path, ids, hf_logits(path, ids)


def test_prefill_logits_match_transformers(case):
    path, ids, ref = case
    llm = LLM(path, device="cpu", kv_cache_tokens=512, block_size=16)
    ours = llm.engine.all_logits(ids)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_decode_step_logits_match_transformers(case):
    """One token per step against a growing paged cache (block size 4, so many block boundaries)."""
    path, ids, ref = case
    llm = LLM(path, device="cpu", kv_cache_tokens=512, block_size=4, max_num_batched_tokens=1)
    ours = llm.engine.all_logits(ids)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_chunked_prefill_logits_match_transformers(case):
    path, ids, ref = case
    llm = LLM(path, device="cpu", kv_cache_tokens=512, block_size=8, max_num_batched_tokens=37)
    assert (llm.engine.all_logits(ids) - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint_is_really_sharded(tmp_path):
    path = save_tiny(tmp_path, arch="llama", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
