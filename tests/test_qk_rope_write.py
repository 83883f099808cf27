"""The fused query/key norm, rotary embedding and KV-cache write (specdec/kernels/qk_rope_write.py) against the
plain pieces it replaces (models/fused.py's rms_norm_rotate and rotate, attention.write_kv), run on the CPU by
Triton's interpreter in a child process (tests/interpreter.py), and a tiny model's forward with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.models import fused
from specdec.models.attention import write_kv
from tests.interpreter import child_only, kernel_module, parent_only, run_child

kernel = kernel_module("specdec.kernels.qk_rope_write")  # None outside the child


@parent_only
def test_kernel_cases_under_the_interpreter():
    """This file's kernel cases, in a child process started with TRITON_INTERPRET=1."""
    run_child(__file__, min_passed=12, parent_tests=4)  # this test and the three sm_90 compiles


def make_layer(tokens, heads, kv_heads, head_dim, dtype=torch.float32, seed=0, slots=40):
    """One layer's projection output as one fused QKV GEMM leaves it (q, k, v strided views of one [T, width]
    tensor), norm weights, cos/sin [T, 1, D] of random positions, caches of random contents and the step's
    slot_mapping (distinct slots in random order)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    views = (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim))
    weights = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype), torch.rand(head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 50
    angles = torch.cat([angles, angles], dim=-1)
    cos_sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens]
    return views, weights, cos_sin, caches, slot_mapping


def plain(views, weights, cos_sin, caches, slot_mapping, eps=1e-6, norm=True):
    """The pieces the kernel replaces: -> rotated q; caches written in place."""
    q, k, v = views
    if norm:
        q, k = (fused.rms_norm_rotate(x, w, eps, *cos_sin) for x, w in zip((q, k), weights))
    else:
        q, k = fused.rotate(q, *cos_sin), fused.rotate(k, *cos_sin)
    write_kv(*caches, k, v, slot_mapping)
    return q


def fused_call(views, weights, cos_sin, caches, slot_mapping, eps=1e-6, norm=True):
    return kernel.qk_rope_write(*views, *(weights if norm else (None, None)), eps, *cos_sin, slot_mapping, *caches)


def plain_qwen3_5(views, weights, cos_sin, caches, slot_mapping, eps=1e-6):
    """Qwen3.5's pieces: zero-centred q/k norms, the rotation of each head's first R dims (cos_sin [T, 1, R]),
    the other dims passed through; caches written in place."""
    rot = cos_sin[0].shape[-1]

    def normed_rotated(x, w):
        n = fused.zero_centred_rms_norm(x, w, eps)
        return torch.cat([fused.rotate(n[..., :rot], *cos_sin), n[..., rot:]], dim=-1)

    q, k = (normed_rotated(x, w) for x, w in zip(views[:2], weights))
    write_kv(*caches, k, views[2], slot_mapping)
    return q


@child_only
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (2, 2, 128), (6, 3, 24), (4, 1, 8)])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_the_plain_pieces(heads, kv_heads, head_dim, norm):
    """Queries, the written keys and values, and every untouched cache slot equal the plain path's (float32);
    head_dim 24 has halves of 12 (padded to 16 in the kernel), head_dim 8 the tiny model's."""
    views, weights, cos_sin, caches, slots = make_layer(5, heads, kv_heads, head_dim, seed=head_dim)
    expected_caches = [c.clone() for c in caches]
    expected = plain(views, weights, cos_sin, expected_caches, slots, norm=norm)
    got = fused_call(views, weights, cos_sin, caches, slots, norm=norm)
    assert got.is_contiguous() and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for cache, reference in zip(caches, expected_caches):
        torch.testing.assert_close(cache, reference, atol=1e-5, rtol=1e-5)


@child_only
@pytest.mark.parametrize("head_dim,rot", [(32, 8), (24, 12), (16, 16)])
def test_qwen3_5_partial_rotary_and_zero_centred_norms(head_dim, rot):
    """centred=True and a rotation of the first R dims match Qwen3.5's pieces, with the query of each head read
    from beside its gate ([T, H, 2D] rows, as the gated q_proj lays them out)."""
    views, weights, (cos, sin), caches, slots = make_layer(5, 4, 2, head_dim, seed=head_dim + rot)
    gated = torch.randn(5, 4, 2 * head_dim)
    views = (gated[..., :head_dim], *views[1:])  # each head's query beside its gate
    cos_sin = cos[..., :rot // 2].repeat(1, 1, 2), sin[..., :rot // 2].repeat(1, 1, 2)
    expected_caches = [c.clone() for c in caches]
    expected = plain_qwen3_5(views, weights, cos_sin, expected_caches, slots)
    got = kernel.qk_rope_write(*views, *weights, 1e-6, *cos_sin, slots, *caches, centred=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for cache, reference in zip(caches, expected_caches):
        torch.testing.assert_close(cache, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused_call(views, weights, cos_sin, [c.clone() for c in caches], slots), expected)


@child_only
def test_a_wrong_slot_or_head_order_fails_the_comparison():
    """Negative control: the comparison above sees a cache written at shifted slots, and swapped heads."""
    views, weights, cos_sin, caches, slots = make_layer(4, 4, 2, 32, seed=3)
    expected_caches = [c.clone() for c in caches]
    plain(views, weights, cos_sin, expected_caches, slots)
    fused_call(views, weights, cos_sin, caches, slots.roll(1))
    assert not torch.allclose(caches[0], expected_caches[0])
    swapped = (views[0].flip(1), views[1], views[2])
    assert not torch.allclose(fused_call(swapped, weights, cos_sin, [c.clone() for c in caches], slots),
                              plain(views, weights, cos_sin, [c.clone() for c in caches], slots))


@child_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_as_the_compiled_pieces(dtype):
    """In bf16/fp16 the kernel rounds where rms_norm does (the normalised row, then the weight) and once after
    the rotation, in float32 between: within one rounding of the plain pieces, which round every operation."""
    views, weights, cos_sin, caches, slots = make_layer(6, 4, 2, 64, dtype=dtype, seed=11)
    expected_caches = [c.clone() for c in caches]
    expected = plain(views, weights, cos_sin, expected_caches, slots)
    got = fused_call(views, weights, cos_sin, caches, slots)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[0], expected_caches[0], atol=tol, rtol=tol)
    assert torch.equal(caches[1], expected_caches[1])  # values are copied, not computed


@child_only
def test_supports_even_rotations_and_one_dtype():
    _, _, (cos, _), (cache, _), _ = make_layer(2, 2, 1, 32)
    assert kernel.supports(torch.float32, cache, cos)
    assert not kernel.supports(torch.bfloat16, cache, cos)  # the cache's dtype differs
    assert kernel.supports(torch.float32, cache, cos[..., :16])  # a partial rotation (Qwen3.5)
    assert not kernel.supports(torch.float32, cache, cos[..., :15])  # an odd one


@child_only
@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_a_model_forward_with_the_kernel_equals_the_plain_one(model, tmp_path, monkeypatch):
    """A tiny model's greedy outputs (prefill, decode and a batch) are the same with the kernel writing every
    layer's keys and values as without it, and the kernel ran in every layer."""
    from specdec import LLM, SamplingParams
    from tests.checkpoints import save_tiny

    path = save_tiny(tmp_path / model, model)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [list(range(10, 10 + n)) for n in (5, 19, 2)]
    plain_outputs = [o.token_ids for o in LLM(path, device="cpu", kv_cache_tokens=512).generate(prompts, greedy)]
    calls = []
    monkeypatch.setattr(fused.Kernels, "qk_rope_write",
                        staticmethod(lambda *a: calls.append(a[0].shape) or kernel.qk_rope_write(*a)))
    llm = LLM(path, device="cpu", kv_cache_tokens=512)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain_outputs
    layers = llm.engine.runner.model.config.num_hidden_layers
    assert len(calls) >= 2 * layers and len(calls) % layers == 0


def test_the_writer_is_off_by_default_and_in_plain_kernels(monkeypatch):
    """On a CPU no writer is set; plain_kernels() turns a set one off for its duration (training's shapes)."""
    assert fused.Kernels.qk_rope_write is None
    monkeypatch.setattr(fused.Kernels, "fused", True)
    monkeypatch.setattr(fused.Kernels, "qk_rope_write", staticmethod(print))
    with fused.plain_kernels():
        assert fused.Kernels.qk_rope_write is None
    assert fused.Kernels.qk_rope_write is print


@parent_only
@pytest.mark.parametrize("has_norm,centred,head_dim,rot", [(True, False, 128, 128), (False, False, 128, 128),
                                                           (True, True, 256, 64)])
def test_the_kernel_compiles_for_hopper(has_norm, centred, head_dim, rot):
    """The interpreter runs the kernel as Python and so accepts code Triton's compiler refuses: compile it to PTX
    for sm_90 (no GPU needed) in bf16 at the Qwen3-8B layer's shape, with and without the norms (Llama), and at
    the Qwen3.5-27B attention layer's (head_dim 256, 64 rotary dims, zero-centred norms)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.kernels import qk_rope_write as compiled

    pointers = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "q_weight_ptr", "k_weight_ptr", "cos_ptr",
                                          "sin_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers.update(slots_ptr="*i64", eps="fp32")
    strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ct", "stride_st",
               "stride_ot", "stride_oh", "stride_kcs", "stride_kch", "stride_vcs", "stride_vch")
    constants = dict(HEADS=32, HEAD_DIM=head_dim, D_PAD=head_dim, ROT=rot, CENTRED=centred, HAS_NORM=has_norm)
    signature = {**pointers, **{name: "i32" for name in strides}, **{k: "constexpr" for k in constants}}
    source = ASTSource(fn=compiled._qk_rope_write_kernel, signature=signature, constexprs=constants)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".entry _qk_rope_write_kernel" in ptx and "st.global" in ptx


def test_a_step_traced_by_torch_compile_keeps_the_plain_pieces(monkeypatch):
    """Inside torch.compile (compile_graphs) the layer takes heads() and attend(), which inductor fuses itself,
    not the Triton writer."""
    from specdec.models.attention import AttentionBatch
    from specdec.models.config import ModelConfig
    from specdec.models.loader import random_model

    config = ModelConfig.from_dict(dict(architectures=["Qwen3ForCausalLM"], hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=8, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-6,
                                        rope_theta=10000.0, tie_word_embeddings=False))
    model = random_model(config, "cpu", torch.float32)
    attn = model.model.layers[0].self_attn
    calls = []
    monkeypatch.setattr(fused.Kernels, "qk_rope_write", staticmethod(lambda *a: calls.append(a)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    caches = (torch.zeros(16, 2, 8), torch.zeros(16, 2, 8))
    batch = AttentionBatch(torch.tensor([0, 2]), torch.tensor([2]), torch.tensor([[0]]), torch.tensor([0, 1]), 2, 2)
    out = attn(torch.randn(2, 32), model.rotary.lookup(torch.arange(2), torch.float32), batch.prepare(16), caches)
    assert out.shape == (2, 4, 8) and not calls and caches[0][:2].abs().sum() > 0  # written by write_kv


@child_only
def test_eagle3_speculation_with_the_kernel_keeps_greedy_output(qwen3_dir, tmp_path, monkeypatch):
    """With the kernel writing the target's and the EAGLE-3 head's keys and values (both through
    transformer.Attention), greedy speculative output equals plain decoding's, and the head's layer ran it too."""
    from specdec import LLM
    from specdec.speculate import SpecConfig
    from tests.test_eagle3 import make_head_dir
    from tests.test_speculative import GREEDY, mixed_prompts

    head = make_head_dir(tmp_path / "head", qwen3_dir)
    prompts = mixed_prompts(2)  # the interpreter runs a program a token and head: ~20 ms each
    greedy = dataclasses.replace(GREEDY, max_tokens=12)
    plain_outputs = [o.token_ids for o in LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048).generate(prompts, greedy)]
    caches = set()  # the key caches the kernel wrote: one per target layer, and the head's
    monkeypatch.setattr(fused.Kernels, "qk_rope_write",
                        staticmethod(lambda *a: caches.add(a[-2].data_ptr()) or kernel.qk_rope_write(*a)))
    spec = SpecConfig("eagle3", model=str(head), num_draft_tokens=3, adaptive=False)
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, speculator=spec)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain_outputs
    assert llm.engine.speculator.stats["draft_forwards"] > 0
    assert len(caches) == llm.engine.runner.model.config.num_hidden_layers + 1


@child_only
def test_a_qwen3_5_forward_with_the_kernel_equals_the_plain_one(tmp_path, monkeypatch):
    """A tiny Qwen3.5 hybrid (gated attention, zero-centred q/k norms, partial rotary) generates the same greedy
    tokens with the kernel writing its full-attention layers' keys and values as without it."""
    from specdec import LLM
    from tests.test_qwen3_5 import build_hf
    from tests.test_qwen3_5_engine import GREEDY, PROMPTS

    build_hf("two-full").save_pretrained(tmp_path)
    plain_outputs = [o.token_ids for o in LLM(tmp_path, device="cpu", kv_cache_tokens=2048).generate(PROMPTS, GREEDY)]
    caches = set()
    monkeypatch.setattr(fused.Kernels, "qk_rope_write",
                        staticmethod(lambda *a, **kw: caches.add(a[-2].data_ptr()) or kernel.qk_rope_write(*a, **kw)))
    llm = LLM(tmp_path, device="cpu", kv_cache_tokens=2048)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_outputs
    config = llm.engine.runner.model.config
    assert len(caches) == config.num_hidden_layers - len(config.linear_layer_ids)  # every full-attention layer
