"""Paged attention for decode and verify steps in Triton: keys and values read straight from the paged cache
through the block tables (no gathered copy, no materialised mask).

Inputs are the engine's (specdec/models/attention.py): a flat list of T new queries, q [T, H, D]; sequence b
owns flat rows query_start[b]:query_start[b + 1] and has context_lens[b] keys once this step's keys are written;
k_cache / v_cache [num_slots, Hkv, D] with slot = block_id * block_size + offset.  Query i of a sequence of
context c and q new tokens sits at position c - q + i and sees key j iff j <= c - q + i, or, given a tree
mask, iff j < c - q (the committed context) or tree[i, j - (c - q)] (the new token is an ancestor or itself).

One program attends one (sequence, KV head, key partition): its G = H / Hkv query heads times the sequence's q
queries are the rows of one tile, so each K/V tile is loaded once for the whole group.  Example: G 4, q 3 ->
rows 0..11, row r being query r // 4 of query head kv_head * 4 + r % 4; the tile is padded to 16 rows (a dot
needs at least 16).  Long contexts at small batch are split over several partitions (flash-decoding), each
program keeping an online softmax in float32 (base 2, the scale folded in), and a second kernel merges the
partitions' (max, sum, accumulator).  The split is chosen on the host from the batch size and the longest
context, so a fixed-shape step (a CUDA graph) always launches the same grid; each program then takes its share
of its own sequence's keys, so that every split works whatever the step's real contexts.  Example: a graph of
contexts up to 2048 splits batch 1 into 8 partitions; a sequence of 512 keys gives each 64 keys (one tile), not
2 partitions of 256 keys and 6 idle ones.

`paged_attention` is the entry point; `supports` says whether a call can run here.  Under torch.compile it is
called through an opaque custom op (specdec::paged_attention) with a shape-only fake.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specdec.kernels.tree_mask import tree_strides

LOG2E = 1.4426950408889634
MAX_QUERIES = 17  # queries per sequence the row tile is sized for (verify of 16 drafts + 1)
MAX_ROWS = 128  # rows (queries x grouped heads) of one program's tile; more are split into chunks
MIN_PARTITION = 256  # keys: a split partition never covers fewer (its merge would cost more than it saves)
SHARED_PARTITIONS = True  # each sequence shares its own keys among the splits (False: MIN_PARTITION-sized ones)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, n0, end, seq, kv_head, first_new, query, q_rows, row_ok, dims, dim_ok,
                 k_ptr, v_ptr, block_tables_ptr, tree_ptr, qk_scale, stride_ks, stride_kh, stride_vs, stride_vh,
                 stride_bt, tree_sb, tree_st, tree_si, tree_sj,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_TYPE: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N (those < end) folded into the online softmax (m_i, l_i [ROWS], acc [ROWS, D])."""
    pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    key_ok = pos < end
    # Block-table walk.  Example (block size 16): table row [7, 2, 9], position 37 -> table[37 // 16] = 9,
    # slot 9 * 16 + 37 % 16 = 149.
    block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=key_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [BLOCK_N]
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :], mask=kv_mask,
                other=0.0)  # [BLOCK_N, HEAD_PAD]
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype).to(DOT_TYPE)
    scores = tl.dot(q.to(DOT_TYPE), tl.trans(k), input_precision=PRECISION) * qk_scale  # [ROWS, BLOCK_N]
    new_key = pos - first_new  # [BLOCK_N] index among the sequence's new tokens (negative: committed context)
    if HAS_TREE:
        tree_rows = seq * tree_sb + q_rows * tree_st + query * tree_si  # [ROWS]
        in_new = (new_key >= 0) & key_ok
        ancestor = tl.load(tree_ptr + tree_rows[:, None] + new_key[None, :] * tree_sj,
                           mask=row_ok[:, None] & in_new[None, :], other=0)
        visible = (new_key < 0)[None, :] | (ancestor != 0)
    else:
        visible = new_key[None, :] <= query[:, None]  # causal: position <= c - q + i
    scores = tl.where(visible & key_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
    p = tl.exp2(scores - m_safe[:, None])  # [ROWS, BLOCK_N]
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(q.dtype).to(DOT_TYPE)  # rounded to the input dtype, as the GPU's dot takes it
    acc = acc * alpha[:, None] + tl.dot(p, v.to(q.dtype).to(DOT_TYPE), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _partition_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        query_start_ptr, context_lens_ptr, block_tables_ptr, tree_ptr,
        qk_scale,  # softmax scale * log2(e): scores are kept in base 2
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
        tree_sb, tree_st, tree_si, tree_sj,  # tree[b, flat row, query i, new key j] strides (0 = shared)
        partition_keys, num_splits, num_chunks,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, DOT_TYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """One program per (sequence, KV head, key partition x row chunk)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) // num_chunks
    chunk = tl.program_id(2) % num_chunks
    first_row = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - first_row
    ctx = tl.load(context_lens_ptr + seq)
    first_new = ctx - q_len  # position of the sequence's first new token

    rows = chunk * ROWS + tl.arange(0, ROWS)  # [ROWS] row r: query r // GROUP of head kv_head * GROUP + r % GROUP
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = query < q_len
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = first_row + query  # [ROWS] flat row of each tile row
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [ROWS, HEAD_PAD]

    m_i = tl.full([ROWS], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    # partition_keys 0: the sequence's own context over the grid's splits, whole tiles each
    keys = tl.where(partition_keys > 0, partition_keys, tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N)
    start = split * keys
    end = tl.minimum(start + keys, ctx)
    end = tl.where(split == num_splits - 1, ctx, end)  # the last partition takes any keys past the plan
    if INTERPRET:  # the interpreter takes no tensor loop bounds (numpy >= 2.4): the same tiles, by while
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, n0, end, seq, kv_head, first_new, query, q_rows, row_ok, dims, dim_ok, k_ptr,
                v_ptr, block_tables_ptr, tree_ptr, qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                tree_sb, tree_st, tree_si, tree_sj, BLOCK_SIZE, BLOCK_N, HAS_TREE, PRECISION, DOT_TYPE)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, n0, end, seq, kv_head, first_new, query, q_rows, row_ok, dims, dim_ok, k_ptr,
                v_ptr, block_tables_ptr, tree_ptr, qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                tree_sb, tree_st, tree_si, tree_sj, BLOCK_SIZE, BLOCK_N, HAS_TREE, PRECISION, DOT_TYPE)

    if SPLIT:  # partials [B, Hkv, splits, chunks * ROWS(, HEAD_PAD)], merged by _merge_kernel
        part = ((seq * tl.num_programs(1) + kv_head) * num_splits + split) * (num_chunks * ROWS) + rows  # [ROWS]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_split(m_i, l_i, acc, split, seq, kv_head, rows, row_ok, dims, part_m_ptr, part_l_ptr, part_acc_ptr,
                 num_splits, num_chunks, ROWS: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Partition `split`'s (max, sum, accumulator) folded into the running ones."""
    part = ((seq * tl.num_programs(1) + kv_head) * num_splits + split) * (num_chunks * ROWS) + rows  # [ROWS]
    m_s = tl.load(part_m_ptr + part, mask=row_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=row_ok, other=0.0)
    acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], mask=row_ok[:, None], other=0.0)
    m_new = tl.maximum(m_i, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    beta = tl.exp2(m_s - m_safe)
    return m_new, l_i * alpha + l_s * beta, acc * alpha[:, None] + acc_s * beta[:, None]


@triton.jit
def _merge_kernel(
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, query_start_ptr, stride_ot, stride_oh, num_splits,
        num_chunks, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        INTERPRET: tl.constexpr):
    """One program per (sequence, KV head, row chunk): the softmax over the union of its partitions."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_row = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - first_row
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = query < q_len
    dims = tl.arange(0, HEAD_PAD)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    if INTERPRET:
        split = 0
        while split < num_splits:
            m_i, l_i, acc = _merge_split(m_i, l_i, acc, split, seq, kv_head, rows, row_ok, dims, part_m_ptr,
                                         part_l_ptr, part_acc_ptr, num_splits, num_chunks, ROWS, HEAD_PAD)
            split += 1
    else:
        for split in range(num_splits):
            m_i, l_i, acc = _merge_split(m_i, l_i, acc, split, seq, kv_head, rows, row_ok, dims, part_m_ptr,
                                         part_l_ptr, part_acc_ptr, num_splits, num_chunks, ROWS, HEAD_PAD)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (first_row + query)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


INTERPRETED = not isinstance(_partition_kernel, triton.runtime.JITFunction)  # decorated under TRITON_INTERPRET=1


def _dot_type(dtype: torch.dtype):
    """The dot's operand type: the input's; float32 for bfloat16 under the interpreter, whose dot has no
    bfloat16 (operands are still rounded to bfloat16 first, as on the GPU)."""
    if INTERPRETED and dtype == torch.bfloat16:
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def supports(q: torch.Tensor, k_cache: torch.Tensor, block_size: int, max_query_len: int) -> bool:
    """Whether `paged_attention` handles this call: float inputs, whole query groups, at most MAX_QUERIES
    queries per sequence, a power-of-two block size of at least 16."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    return (q.dtype in DTYPES and k_cache.dtype in DTYPES and heads % kv_heads == 0 and q.shape[2] <= 256
            and 1 <= max_query_len <= MAX_QUERIES and block_size >= 16 and block_size & (block_size - 1) == 0)


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter on a CPU: a few programs


def split_plan(num_seqs: int, kv_heads: int, max_context_len: int, device: torch.device, block_n: int,
               partition_keys: int | None = None) -> tuple[int, int]:
    """(splits, keys per partition) for the longest context: about 4 programs per processor at small batch,
    partitions of at least MIN_PARTITION keys, a multiple of block_n.  Example (132 processors, Hkv 8, 8192
    keys): batch 1 wants 528 / 8 = 66 splits, capped at 8192 / 256 = 32 -> 32 partitions of 256 keys; batch 8
    -> 9 splits of 960 keys; batch 64 has 512 programs already -> 1 split.  (launch keeps the splits and lets
    each sequence share its own context among them.)"""
    if partition_keys is None:
        wanted = -(-4 * _processors(device) // (num_seqs * kv_heads))
        splits = max(1, min(wanted, max_context_len // MIN_PARTITION))
        partition_keys = -(-max_context_len // splits)
    partition_keys = max(block_n, -(-partition_keys // block_n) * block_n)
    return max(1, -(-max_context_len // partition_keys)), partition_keys


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
           context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, scale: float,
           max_query_len: int, max_context_len: int, tree_mask: torch.Tensor | None = None,
           partition_keys: int | None = None, block_n: int | None = None, num_warps: int | None = None,
           max_rows: int = MAX_ROWS) -> torch.Tensor:
    """q [T, H, D], caches [slots, Hkv, D], query_start [B+1], context_lens [B], block_tables [B, W] ->
    out [T, H, D] (q's dtype).  tree_mask (specdec/kernels/tree_mask.py) replaces the causal rule among a
    sequence's new tokens.  partition_keys / block_n / num_warps / max_rows override the launch heuristics
    (benchmarks, tests; partition_keys fixes every partition's keys, where by default each sequence shares its
    own context among the splits).  Example: q 17, G 4 -> 68 rows in one tile of 128; G 8 -> 136 rows, 2 chunks
    of 128."""
    num_rows, heads, head_dim = q.shape
    num_seqs, kv_heads = context_lens.shape[0], k_cache.shape[1]
    group = heads // kv_heads
    rows = min(max_rows, max(16, triton.next_power_of_2(max_query_len * group)))
    chunks = -(-max_query_len * group // rows)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = block_n or (64 if rows * head_pad <= 64 * 128 else 32)
    num_warps = num_warps or (4 if rows <= 32 else 8)
    splits, fixed_keys = split_plan(num_seqs, kv_heads, max(1, max_context_len), q.device, block_n,
                                    partition_keys)
    if partition_keys is None and SHARED_PARTITIONS:
        fixed_keys = 0  # each sequence's share of its own keys (_partition_kernel)
    out = q.new_empty(q.shape)
    tree = query_start if tree_mask is None else tree_mask  # (any pointer when unused)
    tree = tree.view(torch.int8) if tree.dtype == torch.bool else tree
    strides = tree_strides(tree_mask, num_seqs, num_rows)
    if splits > 1:
        part_m = torch.empty(num_seqs * kv_heads * splits * chunks * rows, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(part_m.shape[0] * head_pad, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _partition_kernel[(num_seqs, kv_heads, splits * chunks)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, query_start, context_lens, block_tables, tree,
        scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *strides,
        fixed_keys, splits, chunks,
        BLOCK_SIZE=block_size, GROUP=group, ROWS=rows, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_N=block_n,
        HAS_TREE=tree_mask is not None, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_TYPE=_dot_type(q.dtype),
        INTERPRET=INTERPRETED, num_warps=num_warps)
    if splits > 1:
        _merge_kernel[(num_seqs, kv_heads, chunks)](
            out, part_m, part_l, part_acc, query_start, out.stride(0), out.stride(1), splits, chunks,
            GROUP=group, ROWS=rows, HEAD_DIM=head_dim, HEAD_PAD=head_pad, INTERPRET=INTERPRETED, num_warps=4)
    return out


@torch.library.custom_op("specdec::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                        context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, scale: float,
                        max_query_len: int, max_context_len: int, tree_mask: torch.Tensor | None
                        ) -> torch.Tensor:
    return launch(q, k_cache, v_cache, query_start, context_lens, block_tables, block_size, scale,
                  max_query_len, max_context_len, tree_mask)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, query_start, context_lens, block_tables, block_size, scale, max_query_len,
      max_context_len, tree_mask):
    return q.new_empty(q.shape)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, scale: float,
                    max_query_len: int, max_context_len: int, tree_mask: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """`launch` with the default heuristics; through the custom op while torch.compile traces (opaque to it),
    directly otherwise (no dispatcher overhead in eager steps)."""
    args = (q, k_cache, v_cache, query_start, context_lens, block_tables, block_size, float(scale),
            max_query_len, max_context_len, tree_mask)
    if torch.compiler.is_compiling():
        return _paged_attention_op(*args)
    return launch(*args)
