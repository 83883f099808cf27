"""Paged attention over a block-structured KV cache.

The model sees a flat list of T new tokens belonging to B sequences.  For every sequence the
``AttentionBatch`` says where its queries sit in the flat list, how many keys it has once this
step's keys are written, and which cache blocks hold them.

Worked example (block_size 4): a sequence already holding 5 tokens in blocks [7, 2] feeds 3 new
tokens (a 3-token verify step).  Its context length becomes 8, so it needs blocks [7, 2] and the
new keys go to slots 2*4+1, 2*4+2, 2*4+3 = 9, 10, 11.  Query i (0..2) sits at position 5+i and
sees key j iff j <= 5 + i, i.e. j <= context_len - query_len + i.

Grouped-query attention: each sequence's keys and values are gathered once per KV head (a row of
Hkv * D values per position) and SDPA maps query heads onto them (``enable_gqa``).  Measured on an H200
(2026-12-03): gathering one row per *query* head instead, to give SDPA equal head counts, made the gather
4x larger and decode slower at every batch size (bs1 9.4 -> 9.9 ms, bs128 25 -> 218 ms at 8B).

Backends (`set_attention_backend`): "sdpa" (the default) gathers and calls SDPA as above; "triton" sends steps
of at most 17 queries per sequence on a GPU to specdec/kernels/paged_attention.py, which reads keys straight
from the blocks (no gather, no mask).  The choice is made once per step, in `AttentionBatch.prepare`, so every
layer of a step (and a captured graph) takes the same path.

Tree verify: `AttentionBatch.tree_mask` (bool; [Q, Q] one static tree for every sequence, [B, Q, Q] one per
sequence, or [T, Q] one row per flat query) replaces the causal rule among a sequence's new tokens: query i
sees every committed key and new token j iff tree_mask[..., i, j].  Both backends honour it.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.kernels.tree_mask import tree_layout
from specdec.models.recurrent_state import StateBatch

BACKENDS = ("sdpa", "triton")
KERNEL_MAX_QUERIES = 17  # the Triton kernel's row tile: a verify of 16 drafts plus one
_backend = "sdpa"
_kernels = None  # specdec.kernels.paged_attention once the "triton" backend is chosen (it needs triton)


def set_attention_backend(name: str) -> None:
    """Pick the attention of later steps: "sdpa" (gather + SDPA, the default) or "triton" (the paged kernel
    for decode / verify steps of at most KERNEL_MAX_QUERIES queries per sequence on a GPU; every other step
    keeps SDPA).  Call it before the engine captures its graphs.  Raises ImportError without triton."""
    global _backend, _kernels
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, not {name!r}")
    if name == "triton" and _kernels is None:
        _kernels = importlib.import_module("specdec.kernels.paged_attention")
    _backend = name


def attention_backend() -> str:
    return _backend


def _kernel_device(t: torch.Tensor) -> bool:
    """Whether the kernel runs on t's device (a GPU)."""
    return t.is_cuda


def kernel_device(device: torch.device) -> bool:
    """Whether the "triton" backend's kernel runs on this device."""
    return _kernel_device(torch.empty(0, device=device))


@dataclasses.dataclass
class AttentionBatch:
    query_start: torch.Tensor  # [B+1] long: queries of seq b are flat rows query_start[b]:query_start[b+1]
    context_lens: torch.Tensor  # [B] long: keys of seq b after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each new token's key/value
    max_query_len: int
    max_context_len: int
    uniform: bool = False  # every sequence has exactly max_query_len queries (no host sync to unpad)
    # Per sequence on the host (query count, context length): a step of mixed query counts is then split into
    # groups (split_by_query_length) instead of padding every sequence to the longest.
    host_lens: tuple[list[int], list[int]] | None = None
    seq_starts: torch.Tensor | None = None  # [B] flat row of each sequence's first query (default: query_start)
    groups: list["QueryGroup"] = dataclasses.field(default_factory=list)
    tree_mask: torch.Tensor | None = None  # bool tree among each sequence's new tokens (module docstring)
    block_size: int = 0  # set by prepare
    use_kernel: bool = False  # set by prepare: the Triton kernel attends this step (no gather indices built)
    # Derived index tensors for the gathered-SDPA path (built once per step, shared by all layers).
    query_index: torch.Tensor | None = None  # [B, max_q] flat row of each padded query (0 for padding)
    query_valid: torch.Tensor | None = None  # [B, max_q] bool
    key_slots: torch.Tensor | None = None  # [B, max_ctx] cache slot of each key (0 for padding)
    mask: torch.Tensor | None = None  # [B, 1, max_q, max_ctx] bool, True = may attend
    _bias: dict = dataclasses.field(default_factory=dict)  # dtype -> additive mask (0 / -inf)
    # Recurrent state of a hybrid model's linear-attention layers (specdec/models/recurrent_state.py); None for
    # models without any.
    states: StateBatch | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    def prepare(self, block_size: int) -> "AttentionBatch":
        """Choose the backend for this step; for SDPA build the padded gather indices and the causal mask (or,
        given host_lens, the query-length groups, each prepared alike); returns self."""
        self.block_size = block_size
        self.use_kernel = self._kernel_applies()
        if not self.use_kernel:
            self.prepare_gather()
        return self

    def _kernel_applies(self) -> bool:
        size = self.block_size
        return (_backend == "triton" and _kernel_device(self.context_lens) and self.seq_starts is None
                and self.max_query_len <= KERNEL_MAX_QUERIES and size >= 16 and size & (size - 1) == 0)

    def prepare_gather(self) -> None:
        """The SDPA path's gather indices and mask (or query-length groups)."""
        block_size = self.block_size
        if self.host_lens is not None and not self.uniform and self.tree_mask is None:
            self.groups = split_by_query_length(self, block_size)
            return
        device = self.context_lens.device
        query_lens = self.query_start[1:] - self.query_start[:-1]  # [B]
        starts = self.seq_starts if self.seq_starts is not None else self.query_start[:-1]
        q_offsets = torch.arange(self.max_query_len, device=device)  # [max_q]
        self.query_valid = q_offsets[None, :] < query_lens[:, None]
        self.query_index = torch.where(self.query_valid, starts[:, None] + q_offsets[None, :], 0)
        k_pos = torch.arange(self.max_context_len, device=device)  # [max_ctx]
        blocks = self.block_tables.gather(1, (k_pos // block_size).expand(self.num_seqs, -1).clamp(
            max=self.block_tables.shape[1] - 1))
        key_valid = k_pos[None, :] < self.context_lens[:, None]  # [B, max_ctx]
        self.key_slots = torch.where(key_valid, blocks * block_size + k_pos % block_size, 0)
        # query i of seq b is at absolute position context_len - query_len + i
        q_pos = (self.context_lens - query_lens)[:, None] + q_offsets[None, :]  # [B, max_q]
        if self.tree_mask is None:
            causal = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, max_ctx]
        else:
            causal = self._tree_visible(k_pos, self.context_lens - query_lens)
        self.mask = (causal & key_valid[:, None, :]).unsqueeze(1)

    def _tree_visible(self, k_pos: torch.Tensor, first_new: torch.Tensor) -> torch.Tensor:
        """[B, max_q, max_ctx] bool: key k is committed context (k < first_new[b]) or new token k - first_new[b]
        is marked in query i's tree row.  Example: first_new 5, tree row [1, 0, 1] -> keys 0..4, 5 and 7."""
        q = self.max_query_len
        tree = self.tree_mask
        layout = tree_layout(tree, self.num_seqs, int(self.slot_mapping.shape[0]))
        if layout == "per_row":
            rows = tree[self.query_index][:, :, :q]  # [B, max_q, q]
        elif layout == "per_seq":
            rows = tree[:, :q, :q]
        else:
            rows = tree[:q, :q].expand(self.num_seqs, q, q)
        new_key = k_pos[None, :] - first_new[:, None]  # [B, max_ctx]
        index = new_key.clamp(0, q - 1)[:, None, :].expand(-1, rows.shape[1], -1)  # [B, max_q, max_ctx]
        return (new_key < 0)[:, None, :] | rows.gather(2, index)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias [B, 1, max_q, max_ctx] (0 where allowed, -inf elsewhere), built once
        per step and shared by every layer (SDPA would otherwise convert the boolean mask in each one)."""
        if dtype not in self._bias:
            self._bias[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._bias[dtype]

    def folded_bias(self, dtype: torch.dtype, groups: int) -> torch.Tensor:
        """The bias for queries with `groups` heads folded into their rows (`_any_shape_attention`):
        [B, 1, groups * max_q, max_ctx], each query row's mask repeated once per folded head."""
        if groups == 1:
            return self.bias(dtype)
        key = (dtype, groups)
        if key not in self._bias:
            b, _, t, c = self.mask.shape
            self._bias[key] = self.bias(dtype).expand(b, groups, t, c).reshape(b, 1, groups * t, c)
        return self._bias[key]


@dataclasses.dataclass
class QueryGroup:
    """The sequences of a step whose query counts round up to one power of two, attended as one padded batch."""

    batch: AttentionBatch  # prepared; its query_index points into the step's flat rows
    rows: torch.Tensor  # [n] the step's flat rows of the group's real queries ...
    padded_rows: torch.Tensor  # [n] ... and where each sits among the group's [b * max_q] padded rows


SHORT_QUERIES = 16  # sequences with at most this many queries (decodes, verifies) share one group


def split_by_query_length(batch: AttentionBatch, block_size: int) -> list[QueryGroup]:
    """Group a step's sequences: all with at most SHORT_QUERIES queries together, longer ones by their query
    count rounded up to a power of two.

    Padding every sequence of a mixed step to its longest query count made the padded queries, the mask and
    the bias [B, max_q, max_ctx]: 52 decoding sequences beside a 500-token prefill chunk padded to 26,000
    query rows.  But each group costs a dozen kernel launches per layer, and an eager step of a small model is
    all launches (the reference target's: 9-15 ms, bench/eager_steps.py): verifies of n-gram drafts, whose
    lengths vary from 0 to k, made up to five groups of short queries.  Example: query counts
    (1, 1, 500, 5, 1, 40) -> groups {0, 1, 3, 4} (q 5), {2} (q 500), {5} (q 40); each group's keys reach only
    its own longest context."""
    query_lens, context_lens = batch.host_lens
    starts = [0, *itertools.accumulate(query_lens)]
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(query_lens):
        buckets.setdefault(0 if n <= SHORT_QUERIES else (n - 1).bit_length(), []).append(i)
    device = batch.context_lens.device
    groups = []
    for members in buckets.values():
        lens = [query_lens[i] for i in members]
        q = max(lens)
        index = torch.tensor(members, device=device)
        compact = torch.tensor([0, *itertools.accumulate(lens)], device=device)
        sub = AttentionBatch(compact, batch.context_lens[index], batch.block_tables[index], batch.slot_mapping, q,
                             -(-max(context_lens[i] for i in members) // 16) * 16,  # aligned for fused kernels
                             seq_starts=torch.tensor([starts[i] for i in members], device=device))
        rows = [starts[i] + j for i in members for j in range(query_lens[i])]
        padded = [g * q + j for g, n in enumerate(lens) for j in range(n)]
        groups.append(QueryGroup(sub.prepare(block_size), torch.tensor(rows, device=device),
                                 torch.tensor(padded, device=device)))
    return groups


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache [num_slots, Hkv, D]; k, v [T, Hkv, D]; writes row t to slot slot_mapping[t]."""
    # index_put_ (not index_copy_): torch.compile keeps it in place instead of copying the whole cache
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                    scale: float) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D], attending over each sequence's cached keys (the Triton kernel where the
    step chose it, else gather + SDPA)."""
    if batch.use_kernel:
        if _kernels.supports(q, k_cache, batch.block_size, batch.max_query_len):
            return _kernels.paged_attention(q, k_cache, v_cache, batch.query_start, batch.context_lens,
                                          batch.block_tables, batch.block_size, scale, batch.max_query_len,
                                          batch.max_context_len, batch.tree_mask)
        batch.use_kernel = False  # inputs the kernel cannot take (dtype, heads): SDPA, indices built once
        batch.prepare_gather()
    if batch.groups:  # a step of mixed query counts: one padded attention per query-length group
        out = torch.empty_like(q)
        for group in batch.groups:
            padded = _padded_attention(q, k_cache, v_cache, group.batch, scale)  # [b * max_q, H, D]
            out[group.rows] = padded[group.padded_rows]
        return out
    out = _padded_attention(q, k_cache, v_cache, batch, scale)
    if batch.uniform:  # rows are already in flat order; boolean indexing would sync (and break graphs)
        return out
    return out[batch.query_valid.flatten()]


def _padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                      scale: float) -> torch.Tensor:
    """q [T, H, D] -> [B * max_q, H, D]: every sequence's queries padded to max_q rows."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    if batch.uniform:  # flat rows are already [B, max_q] in order: a view, no gather
        qp = q.view(batch.num_seqs, batch.max_query_len, num_heads, head_dim).transpose(1, 2)
    else:
        qp = q[batch.query_index].transpose(1, 2)  # [B, H, max_q, D]
    kp = k_cache[batch.key_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, max_ctx, D]
    vp = v_cache[batch.key_slots].transpose(1, 2).to(q.dtype)
    if not batch.uniform and _plan_per_shape(q):
        out = _any_shape_attention(qp, kp, vp, batch, scale)
    else:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.bias(q.dtype), scale=scale,
                                             enable_gqa=kp.shape[1] != num_heads)  # [B, H, max_q, D]
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B * max_q, H, D]


def _plan_per_shape(q: torch.Tensor) -> bool:
    """Whether SDPA on this device would pick a kernel that builds a plan per shape (cuDNN on a GPU)."""
    return q.is_cuda


def _any_shape_attention(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, batch: AttentionBatch,
                         scale: float) -> torch.Tensor:
    """Attention for a step of arbitrary shape on a GPU (prefills, a drafter's catch-ups, mixed steps), by the
    memory-efficient kernel: qp [B, H, max_q, D], kp/vp [B, Hkv, max_ctx, D] -> [B, H, max_q, D].

    Not cuDNN (SDPA's first choice on an H100/H200), which builds an execution plan for every new shape, and
    such steps rarely repeat a shape: a plan per prompt length stalls serving mid-request.  The fixed-shape
    (CUDA graph) steps keep cuDNN, their plans built once at start-up.  The memory-efficient kernel wants equal
    head counts, so each KV head's G = H / Hkv query heads are folded into its query rows instead of
    repeating keys and values G times.  Example: H 32, Hkv 8, max_q 5 -> queries [B, 8, 4 * 5, D], row
    g * 5 + t of KV head j being query head j * 4 + g at position t (the heads SDPA's enable_gqa pairs).
    """
    b, h, t, d = qp.shape
    groups = h // kp.shape[1]
    folded = qp.reshape(b, h // groups, groups * t, d)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):  # math: where efficient cannot run
        out = F.scaled_dot_product_attention(folded, kp, vp, attn_mask=batch.folded_bias(qp.dtype, groups),
                                             scale=scale)
    return out.reshape(b, h, t, d)
