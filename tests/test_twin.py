"""Scaled twins compute the small model's function at the large model's shapes."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, ConfigError, SamplingParams
from specdec.engine.engine import Engine, EngineConfig
from specdec.models.loader import load_model
from specdec.models.twin import make_twin, save_twin
from specdec.models.twin_builder import head_dim_map
from tests.checkpoints import save_tiny

SHAPE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, head_dim=16, vocab_size=150, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def small(qwen3_dir):
    return load_model(qwen3_dir, "cpu")


@pytest.fixture(scope="module")
def small_tied(tmp_path_factory):
    return load_model(save_tiny(tmp_path_factory.mktemp("tied"), "qwen3", tie=True, seed=3), "cpu")


def text(seed: int, n: int = 120) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logprobs(model, ids) -> torch.Tensor:
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024))
    return engine.all_logits(ids).float().log_softmax(-1)  # [T, V]


@pytest.mark.parametrize("noise,tol", [(0.0, 1e-4), (1e-6, 1e-3)])
@pytest.mark.parametrize("tied", [False, True])
def test_twin_logprobs_equal_the_small_model(small, small_tied, noise, tol, tied):
    small = small_tied if tied else small
    twin = make_twin(small, dict(SHAPE, tie_word_embeddings=tied), noise=noise)
    assert twin.config.hidden_size == 64 and twin.config.vocab_size == 150
    ids = text(1)
    ref, got = logprobs(small, ids), logprobs(twin, ids)
    assert (got[:, :96] - ref).abs().max().item() <= tol
    assert got[:, 96:].exp().sum(-1).max().item() < 1e-6  # the padded vocabulary is never chosen


def test_twin_greedy_output_equals_the_small_model(qwen3_dir, small):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048)
    twin_llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, twin=SHAPE)
    assert twin_llm.model.config.hidden_size == 64
    prompts = [text(s, 17) for s in range(3)]
    assert [o.token_ids for o in twin_llm.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]


def test_saved_twin_loads_in_transformers_with_the_same_result(small, qwen3_dir, tmp_path):
    import transformers

    twin = make_twin(small, SHAPE)
    save_twin(twin, qwen3_dir, tmp_path / "twin")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32).eval()
    ids = text(2)
    with torch.no_grad():
        hf_logp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert (hf_logp[:, :96] - logprobs(small, ids)).abs().max().item() <= 1e-4
    assert (tmp_path / "twin" / "tokenizer.json").is_file()


def test_head_dim_map_keeps_rotary_pairs():
    m = head_dim_map(8, 16).tolist()
    assert m == [0, 2, 4, 6, 8, 10, 12, 14]  # halves [0..3] -> [0, 2, 4, 6], [4..7] -> [8, 10, 12, 14]


def test_impossible_twins_are_refused(small):
    with pytest.raises(ConfigError, match="hidden size"):
        make_twin(small, dict(SHAPE, hidden_size=32))
    with pytest.raises(ConfigError, match="head_dim"):
        make_twin(small, dict(SHAPE, head_dim=12))
    with pytest.raises(ConfigError, match="tied embeddings"):
        make_twin(small, dict(SHAPE, tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="unknown twin shape"):
        make_twin(small, "qwen9-1t")
