"""Projection weights stored column-major (models/weight_layout.py; EngineConfig.column_major_weights): the same
function (logits, greedy tokens equal to transformers' on a Qwen3, a Llama with tied embeddings and a Qwen3.5
hybrid), fused projections moved as one and still serving their layers, tied embeddings left row-major, and the
default (on a GPU with the fused kernels, off on a CPU)."""

from __future__ import annotations

import torch

from specdec import LLM, SamplingParams
from specdec.engine.engine import Engine, EngineConfig
from specdec.models.config import ModelConfig
from specdec.models.loader import random_model
from specdec.models.weight_layout import is_column_major, lay_out_weights
from tests.checkpoints import save_tiny
from tests import test_qwen3_5_engine
from tests.test_qwen3_5_engine import generate
from tests.test_speculative import GREEDY, mixed_prompts

TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
            max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
hybrid = test_qwen3_5_engine.hybrid  # its module's fixture


def test_weights_move_column_major_and_back_with_the_same_logits_and_fused_views():
    model = random_model(ModelConfig.from_dict(TINY), torch.device("cpu"), torch.float32, seed=0)
    engine = Engine(model, EngineConfig(kv_cache_tokens=256, max_num_seqs=2))
    ids = list(range(3, 40))
    before = engine.all_logits(ids)
    layer = model.model.layers[0]
    moved = lay_out_weights(model, column_major=True)
    # per layer: the fused q/k/v, o, the fused gate/up, down; and the LM head
    assert moved == 4 * TINY["num_hidden_layers"] + 1
    assert is_column_major(layer.self_attn.o_proj.weight) and is_column_major(model.lm_head.weight)
    assert is_column_major(layer.self_attn.qkv.weight) and is_column_major(layer.mlp.gate_up.weight)
    assert layer.self_attn.qkv.valid() and layer.mlp.gate_up.valid()  # the layers still read the fused tensors
    assert lay_out_weights(model, column_major=True) == 0  # idempotent
    torch.testing.assert_close(engine.all_logits(ids), before, atol=1e-5, rtol=1e-5)
    assert lay_out_weights(model, column_major=False) == moved
    assert layer.self_attn.o_proj.weight.is_contiguous() and layer.self_attn.qkv.weight.is_contiguous()
    assert layer.self_attn.qkv.valid()


def test_an_engine_with_column_major_weights_decodes_the_same_tokens(llm, qwen3_dir):
    want = [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)]
    column = LLM(qwen3_dir, device="cpu", kv_cache_tokens=4096, block_size=4, column_major_weights=True)
    assert [o.token_ids for o in column.generate(mixed_prompts(), GREEDY)] == want
    assert is_column_major(column.engine.model.model.layers[0].mlp.down_proj.weight)
    assert not is_column_major(llm.engine.model.model.layers[0].mlp.down_proj.weight)  # the CPU's default: off


def test_tied_embeddings_stay_row_major(tmp_path):
    path = save_tiny(tmp_path, "llama", tie=True)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, device="cpu", kv_cache_tokens=1024).generate(mixed_prompts(3), params)]
    llm = LLM(path, device="cpu", kv_cache_tokens=1024, column_major_weights=True)
    model = llm.engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_contiguous()
    assert is_column_major(model.model.layers[0].self_attn.o_proj.weight)
    assert [o.token_ids for o in llm.generate(mixed_prompts(3), params)] == want


def test_a_hybrid_model_with_column_major_weights_equals_transformers(hybrid):
    path, expected = hybrid
    tokens, llm = generate(path, column_major_weights=True)
    assert tokens == expected
    mixers = [layer.linear_attn for layer in llm.engine.model.model.layers if hasattr(layer, "linear_attn")]
    assert mixers and all(is_column_major(m.in_proj.weight) and m.in_proj.valid() for m in mixers)


def test_weights_move_before_the_kv_cache_takes_the_free_memory(monkeypatch):
    """A moved weight's copy is transient, but on a GPU the KV cache is sized from the free memory: the move
    comes first (a 27B model's LM head is 2.5 GB), the projections fused before it."""
    import specdec.engine.engine as engine_module

    model = random_model(ModelConfig.from_dict(TINY), torch.device("cpu"), torch.float32, seed=0)
    layer, seen, real = model.model.layers[0], [], engine_module.KVCache

    def recording(*args, **kwargs):
        seen.append(layer.mlp.gate_up is not None and is_column_major(layer.mlp.gate_up.weight)
                    and is_column_major(layer.mlp.down_proj.weight))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "KVCache", recording)
    Engine(model, EngineConfig(kv_cache_tokens=256, max_num_seqs=2, column_major_weights=True))
    assert seen == [True]
