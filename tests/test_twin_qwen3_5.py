"""Scaled twins of Qwen3.5 hybrids compute the small model's function (and its MTP head drafts the same tokens)
at a larger shape: padded gated attention, Gated DeltaNet layers, MLP, vocabulary and layers."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, ConfigError, SamplingParams
from specdec.engine.engine import Engine, EngineConfig
from specdec.models.config import ModelConfig
from specdec.models.loader import load_model
from specdec.models.twin import SHAPES, make_twin, twin_config
from specdec.models.twin_builder import head_dim_map
from specdec.models.twin_qwen3_5 import layer_placement
from specdec.speculate import SpecConfig
from tests.test_mtp import save_with_mtp
from tests.test_qwen3_5 import build_hf
from tests.test_qwen3_5_engine import PROMPTS

LIN, FULL = "linear_attention", "full_attention"
# the small models (tests/test_qwen3_5.py): hidden 64, 4 / 2 heads of 32, linear 2 key / 4 value heads of 16,
# layers [full, lin, lin, full] (rotary 16 of 32) or [lin, lin, lin, full] (rotary 8 of 32), vocabulary 300
SHAPE = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=8, layer_types=(LIN, LIN, LIN, FULL) * 2,
             num_attention_heads=6, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
             linear_num_key_heads=3, linear_num_value_heads=9, linear_key_head_dim=32, linear_value_head_dim=24,
             vocab_size=320)
SAME_VOCAB = dict(SHAPE, vocab_size=300)  # an MTP head's twin keeps the vocabulary
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def text(seed: int, n: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A checkpoint with mtp.* weights, layers [full, lin, lin, full]."""
    return save_with_mtp(build_hf("two-full"), tmp_path_factory.mktemp("two-full"))


@pytest.fixture(scope="module", params=["two-full", "one-full"])
def pair(request, tmp_path_factory):
    """(small model, its twin at SHAPE) per layer pattern."""
    path = tmp_path_factory.mktemp(request.param)
    build_hf(request.param).save_pretrained(path)
    small = load_model(path, "cpu")
    return small, make_twin(small, SHAPE, calibration=[text(9, 64)])


def logprobs(model, ids, chunk: int | None = None) -> torch.Tensor:
    """[T, V] by prefill, in chunks of `chunk` tokens (<= 17: the DeltaNet's token-by-token form, as decode)."""
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, block_size=4, **options))
    return engine.all_logits(ids).float().log_softmax(-1)


@pytest.mark.parametrize("chunk,n", [(None, 80), (5, 30)])
def test_twin_logprobs_equal_the_small_model(pair, chunk, n):
    small, twin = pair
    assert twin.config.linear_layer_ids == (0, 1, 2, 4, 5, 6) and twin.config.rotary_dim == 16
    ids = text(1, n)
    ref, got = logprobs(small, ids, chunk), logprobs(twin, ids, chunk)
    assert (got[:, :300] - ref).abs().max().item() <= 1e-4
    assert got[:, 300:].exp().sum(-1).max().item() < 1e-6  # the padded vocabulary is never chosen


def test_benchmark_noise_keeps_the_logprobs_within_1e_3(pair):
    small, _ = pair
    twin = make_twin(small, SHAPE, noise=1e-6, calibration=[text(9, 64)])  # as on a GPU
    ids = text(2, 80)
    assert (logprobs(twin, ids)[:, :300] - logprobs(small, ids)).abs().max().item() <= 1e-3


def test_twin_greedy_output_equals_the_small_model(hybrid_dir):
    plain = LLM(hybrid_dir, device="cpu", kv_cache_tokens=2048, block_size=4)
    twin = LLM(hybrid_dir, device="cpu", kv_cache_tokens=2048, block_size=4, twin=SHAPE)
    assert twin.model.config.hidden_size == 96
    assert [o.token_ids for o in twin.generate(PROMPTS[:3], GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS[:3], GREEDY)]


def mtp_run(path, twin=None, params=None, **spec) -> tuple[list[list[int]], list[list[int]], dict]:
    """(outputs, every drafted chain, engine metrics) of MTP speculation at k = 3, greedy and seeded sampling
    (or `params`, one per prompt); spec: more SpecConfig fields."""
    llm = LLM(path, device="cpu", kv_cache_tokens=2048, block_size=4, twin=twin,
              speculator=SpecConfig("mtp", num_draft_tokens=3, adaptive=False, **spec))
    spec, drafts = llm.engine.speculator, []
    propose = spec.propose

    def recording(requests, ks):
        propose(requests, ks)
        drafts.extend(list(r.draft_token_ids) for r in requests if r.draft_token_ids)

    spec.propose = recording
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True)  # accepts some drafts
    outs = [o.token_ids for o in llm.generate(PROMPTS[:3], params or [GREEDY, sampled, sampled])]
    return outs, drafts, llm.engine.metrics()


def test_twin_mtp_head_drafts_what_the_small_head_drafts(hybrid_dir):
    outs, drafts, stats = mtp_run(hybrid_dir)
    twin_outs, twin_drafts, twin_stats = mtp_run(hybrid_dir, twin=SAME_VOCAB)
    assert twin_outs == outs and twin_drafts == drafts and len(drafts) >= 10
    assert stats["accepted_tokens"] > 0  # the acceptance is the small pair's
    for key in ("verify_steps", "draft_tokens", "accepted_tokens", "accepted_per_position"):
        assert twin_stats[key] == stats[key], key


def test_mtp_twin_with_a_padded_vocabulary_drafts_what_the_small_head_drafts(hybrid_dir):
    """vocabulary 320 for 300: the padded tokens' logits are masked, so greedy drafts and counts stay the small
    pair's (sampled requests draw over a wider row of uniforms, so they are compared at the same vocabulary)."""
    outs, drafts, stats = mtp_run(hybrid_dir, params=[GREEDY] * 3)
    twin_outs, twin_drafts, twin_stats = mtp_run(hybrid_dir, twin=SHAPE, params=[GREEDY] * 3)
    assert twin_outs == outs and twin_drafts == drafts and len(drafts) >= 10
    for key in ("verify_steps", "draft_tokens", "accepted_tokens", "accepted_per_position"):
        assert twin_stats[key] == stats[key], key


def test_qwen3_5_27b_shape():
    small = ModelConfig.from_dict({"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 248320,
                                   "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
                                   "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                                   "linear_num_value_heads": 16, "rope_parameters": {"rope_theta": 1e7,
                                                                                    "partial_rotary_factor": 0.25}})
    big = twin_config(small, SHAPES["qwen3.5-27b"])  # the config only: no weights are built
    assert (big.hidden_size, big.intermediate_size, big.num_hidden_layers) == (5120, 17408, 64)
    assert (big.num_attention_heads, big.num_key_value_heads, big.head_dim, big.rotary_dim) == (24, 4, 256, 64)
    assert (big.linear_num_key_heads, big.linear_num_value_heads) == (16, 48)
    assert (big.linear_key_head_dim, big.linear_value_head_dim, big.linear_conv_kernel_dim) == (128, 128, 4)
    assert big.layer_kinds == (LIN, LIN, LIN, FULL) * 16 and big.num_attention_layers == 16
    assert (big.vocab_size, big.tie_word_embeddings, big.rope_theta) == (248320, False, 1e7)
    assert layer_placement(small.layer_kinds, big.layer_kinds) == list(range(24))


def test_head_dim_map_with_partial_rotary():
    # rotary halves [0, 1 | 2, 3] -> [0, 2 | 4, 6]; unrotated [4..7] -> 8 + 2 * [0..3]
    assert head_dim_map(8, 16, 4, 8).tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    assert head_dim_map(4, 8, 2, 2).tolist() == [0, 1, 2, 5]  # rotary kept; unrotated [2, 3] -> 2 + 3 * [0, 1]


def test_impossible_hybrid_twins_are_refused(hybrid_dir):
    small = load_model(hybrid_dir, "cpu")
    with pytest.raises(ConfigError, match="layer_types"):
        make_twin(small, dict(SHAPE, layer_types=(FULL,) * 8))
    with pytest.raises(ConfigError, match="linear value heads per key head"):
        make_twin(small, dict(SHAPE, linear_num_value_heads=3))
    with pytest.raises(ConfigError, match="must give layer_types"):
        make_twin(small, {k: v for k, v in SHAPE.items() if k != "layer_types"})
    with pytest.raises(ConfigError, match="conv_kernel"):
        make_twin(small, dict(SHAPE, linear_conv_kernel_dim=3))


def test_command_line_paths(hybrid_dir, tmp_path, capsys):
    from specdec.cli import build_parser, engine_kwargs, main

    args = build_parser().parse_args(["generate", str(hybrid_dir), "--twin", "qwen3.5-27b", "--speculator", "mtp"])
    assert engine_kwargs(args)["twin"] == "qwen3.5-27b"  # LLM(model, twin="qwen3.5-27b"): built in memory
    # a saved Qwen3.5 twin could not keep its per-head eps: refused before anything is built
    assert main(["twin", str(hybrid_dir), "--shape", "qwen3.5-27b", "--out", str(tmp_path / "twin")]) == 2
    assert "in memory" in capsys.readouterr().err and not (tmp_path / "twin").exists()
