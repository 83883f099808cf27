"""A fixed-shape step's acceptance in three Triton launches, for steps in which no sequence cuts its distribution
(no top-k, no top-p): specdec/fixed_accept.py's maths (verify.py's tests, residual and exponential race) without
materialising the processed probabilities [B q, V] (issue 21).

Layout and inputs are fixed_accept.accept_fixed's: logits [B, q, V]; sequence b tests its n_b drafts on its rows
first_b .. first_b + n_b - 1 and draws its last token from row first_b + a_b (clamped to q - 1), a_b its accepted
drafts.  Sampled row r's probabilities are p_v = exp(l_v / T - m_r) / s_r, with m_r and s_r the row's max and sum
of exp of its scaled logits, so a test reads p at one draft from two scalars, and the race reads one row.

1. `_row_stats_kernel`, grid (B q rows, C chunks of V): each program reads its chunk of a row once: the chunk's
   max and sum of exp of the scaled logits (an online softmax) and the first argmax of the raw logits (greedy).
2. `_race_kernel`, grid (B, C), sampled sequences only: each program counts its sequence's a_b (a few scalars a
   draft; the chunk-0 program stores it) and races its chunk of the last token's distribution: both the residual max(p - q, 0) and p itself,
   each keeping its best score p / E (E ~ Exp(1): the caller passes E = -log1p(-u) for the step's uniforms u)
   at its first index, and its mass.
3. `_finish_kernel`, grid (B): the greedy count and token from the rows' argmaxes; for a sampled sequence its
   stored count and the chunks' best combined (the first index of the max, as torch.argmax), the residual taken where a draft was
   rejected and its mass is not numerically empty (verify._last_distribution); out [B, 1 + q]: a_b, the accepted
   drafts, the last token, then -1.

Example: B = 1, q = 4, V = 20,000, chunks of 8,192 (C = 3): 12 + 3 + 1 programs; row 0..2 test drafts 0..2, and
a sequence that accepted 1 races row 1's residual (draft 1 rejected there), over chunks [0, 8192), [8192, 16384),
[16384, 20000).

The same uniforms give the same tokens as accept_fixed up to float rounding (a sum taken in another order moves p
by an ulp: a test or a race decided within that margin can differ, with probability ~1e-7 a draw).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024  # logits a tile
CHUNK = 8192  # logits of a row one program reads (a multiple of BLOCK)


@triton.jit
def _row_stats_kernel(logits_ptr, stride_row, temperature_ptr, max_ptr, sum_ptr, best_ptr, best_at_ptr,
                      vocab, chunks, Q: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.load(temperature_ptr + row // Q)
    t = tl.where(t > 0, t, 1.0)  # a greedy row: its statistics go unread
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_at = tl.zeros((), tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    for tile in range(0, CHUNK // BLOCK):  # (the last chunk's tiles past the vocabulary are all masked)
        start = chunk * CHUNK + tile * BLOCK
        v = start + tl.arange(0, BLOCK)
        x = tl.load(base + v, mask=v < vocab, other=float("-inf")).to(tl.float32)
        tile_best, tile_at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        best_at = tl.where(tile_best > best, start + tile_at, best_at)  # strictly greater: the first index stays
        best = tl.maximum(best, tile_best)
        y = x / t
        m_new = tl.maximum(m, tl.max(y, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of -inf logits so far (masked ids): s stays 0
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(y - m_safe), 0)
        m = m_new
    at = row * chunks + chunk
    tl.store(max_ptr + at, m)
    tl.store(sum_ptr + at, s)
    tl.store(best_ptr + at, best)
    tl.store(best_at_ptr + at, best_at)


@triton.jit
def _stats(row, max_ptr, sum_ptr, chunks, C_POW2: tl.constexpr):
    """Row `row`'s max and sum of exp of its scaled logits, from its chunks' (rescaled to the row's max)."""
    c = tl.arange(0, C_POW2)
    ok = c < chunks
    m_c = tl.load(max_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    s_c = tl.load(sum_ptr + row * chunks + c, mask=ok, other=0.0)
    m = tl.max(m_c, 0)
    return m, tl.sum(tl.where(ok & (s_c > 0), s_c * tl.exp(m_c - m), 0.0), 0)


@triton.jit
def _first_best(value_ptr, at_ptr, base, chunks, C_POW2: tl.constexpr):
    """The first index of the max over chunks base .. base + chunks - 1 (chunks are in index order, each holding
    the first index of its own max)."""
    c = tl.arange(0, C_POW2)
    ok = c < chunks
    value = tl.load(value_ptr + base + c, mask=ok, other=float("-inf"))
    at = tl.load(at_ptr + base + c, mask=ok, other=2**31 - 1)
    top = tl.max(value, 0)
    return tl.min(tl.where(ok & (value == top), at, 2**31 - 1), 0)


@triton.jit
def _scoring_row(b, j, first, Q: tl.constexpr):
    """The flat logits row of sequence b's j-th scoring row (fixed_accept._scoring_rows)."""
    return b * Q + tl.minimum(first + j, Q - 1)


@triton.jit
def _q_at(b, j, x, Q: tl.constexpr, q_probs_ptr, q_rows_ptr, column_ptr, q_width, HAS_Q: tl.constexpr,
          MAPPED: tl.constexpr):
    """q_j(x) of sequence b's draft j (verify._DeviceQ.at_drafts): 1 where its q is one-hot, 0 outside the draft
    vocabulary."""
    if HAS_Q:
        q_row = tl.load(q_rows_ptr + b * (Q - 1) + j)
        if MAPPED:
            col = tl.load(column_ptr + x)
        else:
            col = x
        value = tl.load(q_probs_ptr + tl.maximum(q_row, 0).to(tl.int64) * q_width + tl.maximum(col, 0))
        value = tl.where(col >= 0, value, 0.0)
        return tl.where(q_row >= 0, value, 1.0)
    else:
        return 1.0


@triton.jit
def _sampled_count(b, Q: tl.constexpr, n, first, t, logits_ptr, stride_row, drafts_ptr, u_test_ptr, test_index_ptr,
                   q_probs_ptr, q_rows_ptr, column_ptr, q_width, max_ptr, sum_ptr, chunks,
                   HAS_Q: tl.constexpr, MAPPED: tl.constexpr, C_POW2: tl.constexpr):
    """a_b of rejection sampling: the leading drafts that pass u q(x) < p(x) (or p(x) >= q(x)), p(x) > 0
    (verify._passes)."""
    a = tl.zeros((), tl.int32)
    alive = n > 0
    for j in range(0, Q - 1):
        live = alive & (j < n)
        row = _scoring_row(b, j, first, Q)
        x = tl.maximum(tl.load(drafts_ptr + b * (Q - 1) + j), 0)
        m, s = _stats(row, max_ptr, sum_ptr, chunks, C_POW2)
        logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + x).to(tl.float32)
        p = tl.exp(logit / t - m) / s
        q_x = _q_at(b, j, x, Q, q_probs_ptr, q_rows_ptr, column_ptr, q_width, HAS_Q, MAPPED)
        u = tl.load(u_test_ptr + tl.load(test_index_ptr + b * (Q - 1) + j))
        passed = (p > 0) & ((p >= q_x) | (u * q_x < p))
        a = tl.where(live & passed, a + 1, a)
        alive = live & passed
    return a


@triton.jit
def _race_kernel(logits_ptr, stride_row, temperature_ptr, first_ptr, drafts_ptr, num_drafts_ptr, greedy_ptr,
                 u_test_ptr, test_index_ptr, exp_ptr, stride_exp, race_index_ptr, q_probs_ptr, q_rows_ptr,
                 column_ptr, q_width, max_ptr, sum_ptr, accepted_ptr, res_best_ptr, res_at_ptr, p_best_ptr, p_at_ptr,
                 res_mass_ptr, p_mass_ptr, vocab, chunks, Q: tl.constexpr, HAS_Q: tl.constexpr,
                 MAPPED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, C_POW2: tl.constexpr):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(greedy_ptr + b) == 0:
        t = tl.load(temperature_ptr + b)
        n = tl.load(num_drafts_ptr + b).to(tl.int32)
        first = tl.load(first_ptr + b).to(tl.int32)
        a = _sampled_count(b, Q, n, first, t, logits_ptr, stride_row, drafts_ptr, u_test_ptr, test_index_ptr,
                           q_probs_ptr, q_rows_ptr, column_ptr, q_width, max_ptr, sum_ptr, chunks,
                           HAS_Q, MAPPED, C_POW2)
        if chunk == 0:
            tl.store(accepted_ptr + b, a)
        rejected = a < n
        row = _scoring_row(b, a, first, Q)
        m, s = _stats(row, max_ptr, sum_ptr, chunks, C_POW2)
        at = tl.minimum(a, tl.maximum(Q - 2, 0))  # the rejected draft (rows that rejected none: unused)
        has_draft = Q > 1
        x_a = tl.maximum(tl.load(drafts_ptr + b * (Q - 1) + at, mask=has_draft, other=0), 0)
        q_row = -1
        if HAS_Q:
            q_row = tl.load(q_rows_ptr + b * (Q - 1) + at, mask=has_draft, other=-1)
        race_row = tl.load(race_index_ptr + b)
        res_best = tl.full((), float("-inf"), tl.float32)
        p_best = tl.full((), float("-inf"), tl.float32)
        res_at = tl.zeros((), tl.int32)
        p_at = tl.zeros((), tl.int32)
        res_mass = tl.zeros((), tl.float32)
        p_mass = tl.zeros((), tl.float32)
        base = logits_ptr + row.to(tl.int64) * stride_row
        for tile in range(0, CHUNK // BLOCK):
            start = chunk * CHUNK + tile * BLOCK
            v = start + tl.arange(0, BLOCK)
            ok = v < vocab
            y = tl.load(base + v, mask=ok, other=float("-inf")).to(tl.float32) / t
            p = tl.exp(y - m) / s  # [BLOCK], 0 past the vocabulary
            # the residual max(p - q, 0): q one-hot on the rejected draft, or its row (0 outside the draft vocabulary)
            res = tl.where(v == x_a, 0.0, p)
            if HAS_Q:
                if MAPPED:
                    col = tl.load(column_ptr + v, mask=ok, other=-1)
                else:
                    col = tl.where(ok, v, -1)
                q_v = tl.load(q_probs_ptr + tl.maximum(q_row, 0).to(tl.int64) * q_width + col,
                              mask=(col >= 0) & (q_row >= 0), other=0.0)
                sampled = tl.where(col >= 0, tl.maximum(p - q_v, 0.0), p)
                res = tl.where(q_row >= 0, sampled, res)
            e = tl.load(exp_ptr + race_row.to(tl.int64) * stride_exp + v, mask=ok, other=1.0)
            res_score = tl.where(ok, tl.where(res > 0, res / e, -1.0), float("-inf"))
            p_score = tl.where(ok, tl.where(p > 0, p / e, -1.0), float("-inf"))
            tile, tile_at = tl.max(res_score, 0, return_indices=True, return_indices_tie_break_left=True)
            res_at = tl.where(tile > res_best, start + tile_at, res_at)
            res_best = tl.maximum(res_best, tile)
            tile, tile_at = tl.max(p_score, 0, return_indices=True, return_indices_tie_break_left=True)
            p_at = tl.where(tile > p_best, start + tile_at, p_at)
            p_best = tl.maximum(p_best, tile)
            res_mass += tl.sum(res, 0)
            p_mass += tl.sum(p, 0)
        out = b * chunks + chunk
        tl.store(res_best_ptr + out, tl.where(rejected, res_best, float("-inf")))  # unread where none was rejected
        tl.store(res_at_ptr + out, res_at)
        tl.store(p_best_ptr + out, p_best)
        tl.store(p_at_ptr + out, p_at)
        tl.store(res_mass_ptr + out, res_mass)
        tl.store(p_mass_ptr + out, p_mass)


@triton.jit
def _finish_kernel(first_ptr, drafts_ptr, num_drafts_ptr, greedy_ptr, best_ptr, best_at_ptr, accepted_ptr,
                   res_best_ptr, res_at_ptr, p_best_ptr, p_at_ptr, res_mass_ptr, p_mass_ptr, out_ptr, chunks,
                   Q: tl.constexpr, ANY_SAMPLED: tl.constexpr, C_POW2: tl.constexpr, Q_POW2: tl.constexpr):
    b = tl.program_id(0)
    n = tl.load(num_drafts_ptr + b).to(tl.int32)
    first = tl.load(first_ptr + b).to(tl.int32)
    # greedy: the leading drafts equal to their row's argmax, then the argmax after them (sampler.greedy_accept)
    a = tl.zeros((), tl.int32)
    alive = n > 0
    for j in range(0, Q - 1):
        live = alive & (j < n)
        best = _first_best(best_ptr, best_at_ptr, _scoring_row(b, j, first, Q) * chunks, chunks, C_POW2)
        same = tl.maximum(tl.load(drafts_ptr + b * (Q - 1) + j), 0) == best
        a = tl.where(live & same, a + 1, a)
        alive = live & same
    token = _first_best(best_ptr, best_at_ptr, _scoring_row(b, a, first, Q) * chunks, chunks, C_POW2)
    if ANY_SAMPLED:
        if tl.load(greedy_ptr + b) == 0:
            a = tl.load(accepted_ptr + b)
            c = tl.arange(0, C_POW2)
            ok = c < chunks
            res_mass = tl.sum(tl.load(res_mass_ptr + b * chunks + c, mask=ok, other=0.0), 0)
            p_mass = tl.sum(tl.load(p_mass_ptr + b * chunks + c, mask=ok, other=0.0), 0)
            if (a < n) & (res_mass > 1e-6 * p_mass):  # verify._RESIDUAL_EPS
                token = _first_best(res_best_ptr, res_at_ptr, b * chunks, chunks, C_POW2)
            else:
                token = _first_best(p_best_ptr, p_at_ptr, b * chunks, chunks, C_POW2)
    # out[b] = a, then drafts 0 .. a - 1, the token at a, then -1 (verify._assemble)
    j = tl.arange(0, Q_POW2)
    drafts = tl.load(drafts_ptr + b * (Q - 1) + j, mask=j < a, other=-1)
    row = tl.where(j == a, token.to(tl.int64), drafts)
    tl.store(out_ptr + b * (Q + 1), a.to(tl.int64))
    tl.store(out_ptr + b * (Q + 1) + 1 + j, row, mask=j < Q)


def accept_fused(logits: torch.Tensor, first: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                 greedy: torch.Tensor, temperature: torch.Tensor, u_test: torch.Tensor, test_index: torch.Tensor,
                 exponentials: torch.Tensor, race_index: torch.Tensor, draft_q=None, any_sampled: bool = True,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """accept_fixed for a step without top-k / top-p, into out [B, 1 + q] long: a_b, then the tokens.

    Args (fixed_accept.accept_fixed's, the uniforms still indexed): logits [B, q, V] (float32 or bf16, rows
    contiguous); first, num_drafts [B] long; drafts [B, q-1] long; greedy [B] (nonzero: takes the argmax);
    temperature [B] float32; u_test [>= 1] float32 the drawn tests, test_index [B, q-1] long each draft's;
    exponentials [rows, V] float32 E = -log1p(-u) of the drawn race uniforms, race_index [B] long each sequence's
    row; draft_q a verify._DeviceQ or None (every draft deterministic); any_sampled: False when every sequence is
    greedy (known on the host)."""
    batch, q, vocab = logits.shape
    flat = logits.view(batch * q, vocab)
    device = logits.device
    chunks = triton.cdiv(vocab, CHUNK)
    c_pow2 = triton.next_power_of_2(chunks)
    out = torch.empty(batch, q + 1, dtype=torch.long, device=device) if out is None else out
    row_max, row_sum, best = (torch.empty(batch * q * chunks, device=device) for _ in range(3))
    best_at = torch.empty(batch * q * chunks, dtype=torch.int32, device=device)
    _row_stats_kernel[(batch * q, chunks)](flat, flat.stride(0), temperature, row_max, row_sum, best, best_at,
                                           vocab, chunks, Q=q, CHUNK=CHUNK, BLOCK=BLOCK)
    has_q, mapped = draft_q is not None, draft_q is not None and draft_q.column is not None
    q_probs = draft_q.probs if has_q else temperature  # (a stand-in pointer where there is no q)
    q_rows = draft_q.rows if has_q else test_index
    column = draft_q.column if mapped else test_index
    q_width = q_probs.shape[-1] if has_q else 0
    res_best, p_best, res_mass, p_mass = (torch.empty(batch * chunks, device=device) for _ in range(4))
    res_at, p_at = (torch.empty(batch * chunks, dtype=torch.int32, device=device) for _ in range(2))
    accepted = torch.empty(batch, dtype=torch.int32, device=device)  # a sampled sequence's a_b (the race's)
    if any_sampled:
        _race_kernel[(batch, chunks)](flat, flat.stride(0), temperature, first, drafts, num_drafts, greedy, u_test,
                                      test_index, exponentials, exponentials.stride(0), race_index, q_probs, q_rows,
                                      column, q_width, row_max, row_sum, accepted, res_best, res_at, p_best, p_at,
                                      res_mass, p_mass, vocab, chunks, Q=q, HAS_Q=has_q, MAPPED=mapped,
                                      CHUNK=CHUNK, BLOCK=BLOCK, C_POW2=c_pow2)
    _finish_kernel[(batch,)](first, drafts, num_drafts, greedy, best, best_at, accepted, res_best, res_at, p_best,
                             p_at, res_mass, p_mass, out, chunks, Q=q, ANY_SAMPLED=any_sampled, C_POW2=c_pow2,
                             Q_POW2=triton.next_power_of_2(q))
    return out
