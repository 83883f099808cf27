"""The Triton paged-attention kernel (specdec/kernels/paged_attention.py) against the gather + SDPA path of
specdec/models/attention.py, run on the CPU by Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported (triton's own helpers, tl.zeros among them, are
decorated then), and it would change every later triton user of the process.  So the kernel tests run in a
child process started with it (test_kernel_cases_under_the_interpreter); in the test run itself they are
skipped and nothing imports triton.  Shapes are small (the interpreter runs every program in Python); one case
runs head_dim 128.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specdec.models import attention
from specdec.models.attention import AttentionBatch
from tests.interpreter import child_only, kernel_module, parent_only, run_child

kernel = kernel_module("specdec.kernels.paged_attention")  # None outside the child


@parent_only
def test_kernel_cases_under_the_interpreter():
    """This file's kernel cases, in a child process started with TRITON_INTERPRET=1."""
    run_child(__file__, min_passed=18, parent_tests=3)  # this test and the two sm_90 compiles


def make_case(query_lens, context_lens, block_size, kv_heads=2, group=2, head_dim=32, dtype=torch.float32,
              seed=0, spare_blocks=7):
    """A step over shuffled, non-contiguous blocks: (q [T, H, D], k_cache, v_cache, AttentionBatch).
    Every cache slot holds random values (the step's own keys included, as if written before attending)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # block ids handed out in random order
    width = max(needed) + 1
    tables, used = torch.zeros(len(needed), width, dtype=torch.long), 0
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor(order[used:used + n])
        used += n
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [int(tables[b, p // block_size]) * block_size + p % block_size
             for b, (n, c) in enumerate(zip(query_lens, context_lens)) for p in range(c - n, c)]
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(starts[-1], kv_heads * group, head_dim, generator=gen).to(dtype)
    batch = AttentionBatch(torch.tensor(starts), torch.tensor(context_lens), tables, torch.tensor(slots),
                           max(query_lens), max(context_lens), block_size=block_size)  # not prepared
    return q, k_cache, v_cache, batch


def reference(q, k_cache, v_cache, batch, scale, tree_mask=None):
    """The SDPA path (gathered keys, materialised mask) in float32."""
    ref = AttentionBatch(batch.query_start, batch.context_lens, batch.block_tables, batch.slot_mapping,
                         batch.max_query_len, batch.max_context_len, tree_mask=tree_mask)
    ref.block_size = batch.block_size
    ref.prepare_gather()
    return attention.paged_attention(q.float(), k_cache.float(), v_cache.float(), ref, scale)


def run_kernel(q, k_cache, v_cache, batch, scale, tree_mask=None, **overrides):
    return kernel.launch(q, k_cache, v_cache, batch.query_start, batch.context_lens, batch.block_tables,
                         batch.block_size, scale, batch.max_query_len, batch.max_context_len, tree_mask, **overrides)


# (query counts, context lengths): contexts shorter than a block, exactly on a block boundary, up to 300;
# decodes, verifies and 17-query steps in one batch
RAGGED = ([1, 17, 3, 16, 1, 9, 17, 5], [1, 17, 16, 32, 64, 100, 181, 300])


@child_only
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim", [(16, 2, 1, 32), (32, 1, 3, 48), (16, 2, 4, 64),
                                                                 (32, 2, 4, 32)])
def test_ragged_batch_matches_gather_sdpa(block_size, kv_heads, group, head_dim):
    q, k_cache, v_cache, batch = make_case(*RAGGED, block_size, kv_heads, group, head_dim, seed=block_size + group)
    expected = reference(q, k_cache, v_cache, batch, 0.3)
    out = run_kernel(q, k_cache, v_cache, batch, 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@child_only
@pytest.mark.parametrize("partition_keys,max_rows", [(64, 128), (32, 16)])
def test_split_partitions_and_row_chunks_merge_exactly(partition_keys, max_rows):
    """Contexts split over many partitions (merged by the second kernel) and query rows over several tiles
    give the single-pass result."""
    q, k_cache, v_cache, batch = make_case([1, 17, 4], [250, 140, 9], 16, kv_heads=1, group=4, seed=3)
    expected = reference(q, k_cache, v_cache, batch, 0.25)
    out = run_kernel(q, k_cache, v_cache, batch, 0.25, partition_keys=partition_keys, max_rows=max_rows)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    assert kernel.split_plan(3, 1, 250, q.device, 64, partition_keys)[0] > 1


@child_only
def test_contexts_far_shorter_than_the_graphs_share_every_split():
    """A step planned for contexts of up to 2048 keys (a graph's bucket: 8 splits at batch 2) with sequences of
    1, 70 and 513 keys: each sequence's keys shared among the splits (one tile each, most empty for the short
    ones) give the single-pass result, as fixed partitions of 256 keys do."""
    q, k_cache, v_cache, batch = make_case([1, 4, 1], [1, 70, 513], 16, kv_heads=2, group=2, seed=8)
    expected = reference(q, k_cache, v_cache, batch, 0.3)
    batch.max_context_len = 2048
    assert kernel.split_plan(3, 2, 2048, q.device, 64)[0] > 1
    torch.testing.assert_close(run_kernel(q, k_cache, v_cache, batch, 0.3), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(run_kernel(q, k_cache, v_cache, batch, 0.3, partition_keys=256), expected,
                               atol=2e-5, rtol=1e-4)


@parent_only
@pytest.mark.parametrize("split,tree", [(True, False), (False, True)])
def test_the_kernels_compile_for_hopper(split, tree):
    """The interpreter runs the kernels as Python and so accepts code Triton's compiler refuses (a partition
    size whose type changes in a branch did, 7410787): compile both to PTX for sm_90 (no GPU needed) in bf16 at
    the Qwen3-8B shape, with the engine's argument types (int64 context lengths and block tables)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.kernels import paged_attention as compiled

    def ptx(fn, pointers: dict, scalars: dict, constants: dict) -> str:
        signature = {**pointers, **scalars, **{name: "constexpr" for name in constants}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", part_m_ptr="*fp32",
                    part_l_ptr="*fp32", part_acc_ptr="*fp32", query_start_ptr="*i64",
                    context_lens_ptr="*i64", block_tables_ptr="*i64", tree_ptr="*i8")
    ints = ("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_ot", "stride_oh",
            "stride_bt", "tree_sb", "tree_st", "tree_si", "tree_sj", "partition_keys", "num_splits", "num_chunks")
    constants = dict(BLOCK_SIZE=16, GROUP=4, ROWS=16, HEAD_DIM=128, HEAD_PAD=128, BLOCK_N=64, HAS_TREE=tree,
                     SPLIT=split, PRECISION="tf32", DOT_TYPE=tl.bfloat16, INTERPRET=False)
    code = ptx(compiled._partition_kernel, pointers, {"qk_scale": "fp32", **{n: "i32" for n in ints}}, constants)
    assert ".entry _partition_kernel" in code and "st.global" in code
    merge_pointers = {n: pointers[n] for n in ("out_ptr", "part_m_ptr", "part_l_ptr", "part_acc_ptr",
                                               "query_start_ptr")}
    merge_ints = {n: "i32" for n in ("stride_ot", "stride_oh", "num_splits", "num_chunks")}
    merge_constants = dict(GROUP=4, ROWS=16, HEAD_DIM=128, HEAD_PAD=128, INTERPRET=False)
    assert ".entry _merge_kernel" in ptx(compiled._merge_kernel, merge_pointers, merge_ints, merge_constants)


@child_only
def test_head_dim_128():
    q, k_cache, v_cache, batch = make_case([1, 8, 3], [40, 200, 17], 16, kv_heads=1, group=4, head_dim=128, seed=4)
    expected = reference(q, k_cache, v_cache, batch, 128 ** -0.5)
    torch.testing.assert_close(run_kernel(q, k_cache, v_cache, batch, 128 ** -0.5), expected, atol=2e-5, rtol=1e-4)


@child_only
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_half_inputs_accumulate_in_float32(dtype, atol):
    q, k_cache, v_cache, batch = make_case([1, 5, 17], [70, 33, 120], 32, kv_heads=2, group=2, dtype=dtype, seed=5)
    out = run_kernel(q, k_cache, v_cache, batch, 0.2, partition_keys=64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, batch, 0.2), atol=atol, rtol=0)


# A static draft tree of 6 nodes laid out [root, a, b, c, d, e]: root -> a, b; a -> c, d; b -> e.
PARENTS = [-1, 0, 0, 1, 1, 2]


def ancestors(parents) -> torch.Tensor:
    """[Q, Q] bool: row i marks node i and its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def dense_tree_reference(q, k_cache, v_cache, batch, scale, tree):
    """Per sequence, SDPA over its keys with the tree rule spelled out: every committed key, then new token j
    iff tree[i, j] (tree [Q, Q] shared by the sequences)."""
    outs, starts, group = [], batch.query_start.tolist(), q.shape[1] // k_cache.shape[1]
    for b, c in enumerate(batch.context_lens.tolist()):
        n = starts[b + 1] - starts[b]
        pos = torch.arange(c)
        slots = batch.block_tables[b][pos // batch.block_size] * batch.block_size + pos % batch.block_size
        keys = k_cache[slots].transpose(0, 1).repeat_interleave(group, 0)  # [H, c, D]
        values = v_cache[slots].transpose(0, 1).repeat_interleave(group, 0)
        mask = torch.ones(n, c, dtype=torch.bool)
        mask[:, c - n:] = tree[:n, :n]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[starts[b]:starts[b + 1]].transpose(0, 1), keys, values, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@child_only
def test_tree_mask_in_every_layout_matches_gather_sdpa():
    tree = ancestors(PARENTS)  # [6, 6]
    q, k_cache, v_cache, batch = make_case([6, 6, 6], [6, 40, 103], 16, kv_heads=2, group=2, seed=6)
    expected = dense_tree_reference(q, k_cache, v_cache, batch, 0.3, tree)
    layouts = {"shared": tree, "per_seq": tree.expand(3, 6, 6).contiguous(), "per_row": tree.repeat(3, 1)}
    for name, mask in layouts.items():
        torch.testing.assert_close(reference(q, k_cache, v_cache, batch, 0.3, mask), expected, atol=2e-5, rtol=1e-4)
        for partition_keys in (None, 32):
            out = run_kernel(q, k_cache, v_cache, batch, 0.3, mask, partition_keys=partition_keys)
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4, msg=f"{name} {partition_keys}")
    causal = torch.ones(6, 6, dtype=torch.bool).tril()  # a chain is the plain causal rule
    torch.testing.assert_close(run_kernel(q, k_cache, v_cache, batch, 0.3, causal),
                               run_kernel(q, k_cache, v_cache, batch, 0.3), atol=1e-6, rtol=0)


@child_only
def test_per_sequence_trees_of_fewer_queries():
    """Per-sequence trees wider than a sequence's query count: only its first q rows and columns count."""
    trees = torch.stack([ancestors(PARENTS), ancestors([-1, 0, 1, 0, -1, -1])])  # the second verifies 4 nodes
    q, k_cache, v_cache, batch = make_case([6, 4], [30, 20], 16, kv_heads=1, group=3, seed=7)
    expected = reference(q, k_cache, v_cache, batch, 0.3, trees)
    torch.testing.assert_close(run_kernel(q, k_cache, v_cache, batch, 0.3, trees), expected, atol=2e-5, rtol=1e-4)


@pytest.fixture
def triton_backend(monkeypatch):
    """The "triton" backend with the CPU counted as a kernel device (the interpreter runs it)."""
    monkeypatch.setattr(attention, "_kernel_device", lambda t: True)
    attention.set_attention_backend("triton")
    yield
    attention.set_attention_backend("sdpa")


def test_backend_is_opt_in_and_chooses_per_step():
    assert attention.attention_backend() == "sdpa"
    q, k_cache, v_cache, batch = make_case([1, 3], [20, 40], 16)
    assert not batch.prepare(16).use_kernel and batch.mask is not None
    with pytest.raises(ValueError):
        attention.set_attention_backend("flash")


def test_engine_attention_backend_defaults_to_sdpa_and_refuses_what_cannot_run(qwen3_dir):
    from specdec import LLM, ConfigError

    assert LLM(qwen3_dir, device="cpu", kv_cache_tokens=256).engine.metrics()["attention_backend"] == "sdpa"
    with pytest.raises(ConfigError, match="runs on a GPU"):
        LLM(qwen3_dir, device="cpu", kv_cache_tokens=256, attention_backend="triton")
    with pytest.raises(ConfigError, match="must be one of sdpa, triton"):
        LLM(qwen3_dir, device="cpu", kv_cache_tokens=256, attention_backend="flash")
    assert attention.attention_backend() == "sdpa"


def test_the_default_backend_is_the_kernel_on_a_gpu_with_triton(monkeypatch):
    import specdec.engine.engine as engine

    monkeypatch.setattr(engine, "kernel_device", lambda device: device.type == "cuda")
    has_triton = importlib.util.find_spec("triton") is not None
    assert engine.default_attention_backend(torch.device("cuda")) == ("triton" if has_triton else "sdpa")
    assert engine.default_attention_backend(torch.device("cpu")) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no triton installed
    assert engine.default_attention_backend(torch.device("cuda")) == "sdpa"


@child_only
def test_triton_backend_runs_decode_and_verify_steps(triton_backend):
    q, k_cache, v_cache, batch = make_case(*RAGGED, 16, seed=8)
    expected = reference(q, k_cache, v_cache, batch.prepare(16), 0.3)
    assert batch.use_kernel and batch.mask is None and batch.key_slots is None  # no gather, no mask
    torch.testing.assert_close(attention.paged_attention(q, k_cache, v_cache, batch, 0.3), expected, atol=2e-5,
                               rtol=1e-4)
    long_step = make_case([18, 1], [40, 20], 16)[3].prepare(16)  # a prefill chunk: SDPA
    small_blocks = make_case([1, 3], [20, 40], 8)[3].prepare(8)
    assert not long_step.use_kernel and not small_blocks.use_kernel


@child_only
def test_triton_backend_keeps_greedy_outputs(qwen3_dir, triton_backend, monkeypatch):
    """End to end on the tiny model (block size 16; head_dim 8, padded to 16 in the kernel): greedy outputs
    match the SDPA backend's, the 19-token prompt's prefill going to SDPA, everything else to the kernel."""
    from specdec import LLM, SamplingParams

    calls = []
    launch = kernel.paged_attention
    monkeypatch.setattr(kernel, "paged_attention", lambda *a: calls.append(a[0].shape[0]) or launch(*a))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [list(range(10, 10 + n)) for n in (5, 19)]
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=16, attention_backend="triton")
    assert llm.engine.metrics()["attention_backend"] == "triton"
    with_kernel = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert calls and max(calls) <= 2 * attention.KERNEL_MAX_QUERIES
    calls.clear()
    sdpa = LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=16, attention_backend="sdpa")
    assert [o.token_ids for o in sdpa.generate(prompts, greedy)] == with_kernel and not calls


@child_only
def test_split_partitions_keep_greedy_outputs_through_the_engine(qwen3_dir, triton_backend, monkeypatch):
    """Every layer's launch of every decode step split over partitions (MIN_PARTITION lowered) and merged by the
    second kernel: greedy outputs match the SDPA backend's."""
    from specdec import LLM, SamplingParams

    monkeypatch.setattr(kernel, "MIN_PARTITION", 16)
    plans = []
    plan = kernel.split_plan
    monkeypatch.setattr(kernel, "split_plan", lambda *a: plans.append(plan(*a)) or plans[-1])
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [list(range(10, 80)), list(range(5, 12))]  # 70 and 7 tokens: decode contexts up to 73 keys
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=16, attention_backend="triton")
    split = [o.token_ids for o in llm.generate(prompts, greedy)]
    layers = llm.engine.runner.model.config.num_hidden_layers
    assert sum(splits > 1 for splits, _ in plans) >= 2 * layers  # every layer, 2+ steps
    sdpa = LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=16, attention_backend="sdpa")
    assert [o.token_ids for o in sdpa.generate(prompts, greedy)] == split

