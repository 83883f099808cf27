"""Our Qwen3 / Llama forward passes against transformers' on the same weights."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
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


def test_fused_projections_are_views_and_change_nothing(tmp_path):
    """The engine reads q/k/v and gate/up with one GEMM each; the weights become views of the fused
    tensors (no second copy), the logits stay those of transformers, and a weight replaced afterwards is
    used (the fused path steps aside) rather than a stale copy."""
    path = save_tiny(tmp_path, arch="qwen3")
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(path, device="cpu", kv_cache_tokens=512, block_size=8)
    attn, mlp = llm.model.model.layers[0].self_attn, llm.model.model.layers[0].mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    fused = attn.qkv.weight
    assert attn.k_proj.weight.data_ptr() == fused.data_ptr() + attn.q_proj.weight.numel() * fused.element_size()
    ref = hf_logits(path, ids)
    assert (llm.engine.all_logits(ids) - ref).abs().max().item() <= 1e-4

    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach() * 2)  # replaced, not updated in place
    assert not attn.qkv.valid()
    changed = llm.engine.all_logits(ids)
    assert (changed - ref).abs().max().item() > 1e-3  # the new weight is in use
    unfused = (attn.q_proj(torch.ones(1, attn.q_proj.in_features)), attn.v_proj(torch.ones(1, attn.v_proj.in_features)))
    assert torch.equal(attn.project(torch.ones(1, attn.q_proj.in_features))[2], unfused[1])
    assert llm.model.fuse_projections()  # fusing again picks the new weight up
    assert attn.qkv.valid() and torch.allclose(llm.engine.all_logits(ids), changed, atol=1e-5)


def test_fused_kernels_fall_back_to_plain_ones_when_compiling_fails(monkeypatch, caplog):
    """A GPU without a working compiler keeps the plain kernels and says why (no crash at start-up)."""
    from specdec.models import fused

    def broken_compile(fn, **_):
        def run(*args, **kwargs):
            raise RuntimeError("no working Triton here")
        return run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "compile", broken_compile)
    before = fused.Kernels.rms_norm
    with caplog.at_level("WARNING", logger="specdec"):
        assert fused.enable_fused_kernels() is False
    assert fused.Kernels.rms_norm is before and not fused.Kernels.fused
    assert "fused kernels unavailable" in caplog.text  # (here: no CUDA tensors or no Triton, whichever first)


def test_a_failing_fused_kv_write_leaves_the_compiled_pieces_on(monkeypatch, caplog):
    """The q/k norm, rotary and KV write kernel is tried on its own: if it fails, the compiled pieces stay in
    use, attention layers write as before, and a warning names the kernel."""
    from specdec.models import fused

    for name in (*fused.PLAIN, "fused", "qk_rope_write"):  # restored after the test
        monkeypatch.setattr(fused.Kernels, name, fused.Kernels.__dict__[name])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fused, "compile_all", lambda: dict(fused.PLAIN))
    monkeypatch.setattr(fused, "_try_compiled", lambda compiled: None)

    def broken_writer():
        raise RuntimeError("no sm_90 here")

    monkeypatch.setattr(fused, "_tried_qk_rope_write", broken_writer)
    with caplog.at_level("WARNING", logger="specdec"):
        assert fused.enable_fused_kernels() is True
    assert fused.Kernels.fused and fused.Kernels.qk_rope_write is None
    assert "q/k norm, rotary and KV write unavailable" in caplog.text and "no sm_90 here" in caplog.text


def test_plain_kernels_swap_compiled_pieces_out_for_a_while(monkeypatch):
    from specdec.models import fused

    def compiled(*args):
        raise AssertionError("the compiled piece ran")

    monkeypatch.setattr(fused.Kernels, "fused", True)
    for name in fused.PLAIN:
        monkeypatch.setattr(fused.Kernels, name, staticmethod(compiled))
    x = torch.randn(3, 8)
    with fused.plain_kernels():
        assert torch.equal(fused.Kernels.rms_norm(x, torch.ones(8), 1e-6), fused.rms_norm(x, torch.ones(8), 1e-6))
        assert all(getattr(fused.Kernels, name) is fn for name, fn in fused.PLAIN.items())
    assert all(getattr(fused.Kernels, name) is compiled for name in fused.PLAIN)


def test_any_shape_attention_folds_query_heads_exactly(qwen3_dir, monkeypatch):
    """The GPU's attention for steps of arbitrary shape (memory-efficient kernel, query heads folded into rows
    instead of cuDNN's plan per shape) gives SDPA's grouped-query result; forced on here, the engine's
    prefills and mixed steps still match transformers' logits and the plain greedy outputs."""
    import torch.nn.functional as F

    from specdec.models import attention
    from specdec.models.attention import AttentionBatch

    torch.manual_seed(0)
    batch = AttentionBatch(torch.tensor([0, 5, 7, 12]), torch.tensor([20, 9, 32]), torch.arange(12).reshape(3, 4),
                           torch.zeros(12, dtype=torch.long), 5, 32).prepare(8)
    q, k, v = torch.randn(3, 8, 5, 16), torch.randn(3, 2, 32, 16), torch.randn(3, 2, 32, 16)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.bias(q.dtype), scale=0.3, enable_gqa=True)
    assert torch.allclose(attention._any_shape_attention(q, k, v, batch, 0.3), expected, atol=1e-5)

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=1024, block_size=4)
    prompts = [list(range(10, 10 + 3 * n)) for n in (2, 5, 4)]
    plain = [o.token_ids for o in llm.generate(prompts, greedy)]
    ids = prompts[1]
    before = llm.engine.all_logits(ids)
    used = []
    any_shape = attention._any_shape_attention
    monkeypatch.setattr(attention, "_plan_per_shape", lambda q: True)
    monkeypatch.setattr(attention, "_any_shape_attention", lambda *a: used.append(1) or any_shape(*a))
    assert torch.allclose(llm.engine.all_logits(ids), before, atol=1e-4)
    assert torch.allclose(llm.engine.all_logits(ids), hf_logits(qwen3_dir, ids), atol=1e-4)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
    assert used


def test_mixed_query_counts_attend_in_groups_with_the_padded_result():
    """A step of decodes and verifies beside prefill chunks is attended per query-length group (the short
    queries together, each longer one by its power of two; each padded to its own longest), not all padded to
    the longest prefill; the result is the same."""
    from specdec.models.attention import AttentionBatch, paged_attention

    torch.manual_seed(1)
    block_size, query_lens, context_lens = 4, [1, 1, 9, 3, 1, 40, 20], [7, 13, 9, 20, 2, 44, 20]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    tables = torch.randperm(100)[:84].reshape(7, 12)  # distinct blocks per sequence
    k_cache, v_cache = torch.randn(100 * block_size, 2, 8), torch.randn(100 * block_size, 2, 8)
    q = torch.randn(starts[-1], 4, 8)

    def batch(host_lens):
        return AttentionBatch(torch.tensor(starts), torch.tensor(context_lens), tables, torch.zeros(starts[-1],
                              dtype=torch.long), max(query_lens), 48, host_lens=host_lens).prepare(block_size)

    grouped = batch((query_lens, context_lens))
    assert sorted(g.batch.max_query_len for g in grouped.groups) == [9, 20, 40]
    assert [g.batch.max_context_len for g in sorted(grouped.groups, key=lambda g: g.batch.max_query_len)] == \
        [32, 32, 48]  # each group's keys reach its own longest context, padded to 16
    expected = paged_attention(q, k_cache, v_cache, batch(None), 0.35)
    assert torch.allclose(paged_attention(q, k_cache, v_cache, grouped, 0.35), expected, atol=1e-6)
