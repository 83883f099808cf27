"""The recurrent (token by token) gated delta rule of a Gated DeltaNet layer in Triton: one launch per layer
and step, the float32 state read once and written once (specdec/models/delta_rule.py has the math; its
`recurrent` takes ~6 PyTorch ops per token, each reading and writing the whole state).

Inputs are the layer's (specdec/models/gated_deltanet.py, `_attend_group`) before the key heads are repeated:
q, k [B, T, Hk, Dk] (l2-normalised, q also scaled by Dk^-0.5), v [B, T, H, Dv], g, beta [B, T, H], the states
[B, H, Dk, Dv]; H = R * Hk, value head h reading key head h // R (as q.repeat_interleave(R, dim=2) lays them).

One program owns one (sequence, value head, block of BLOCK_V state columns): its [Dk, BLOCK_V] slice of the
state stays in registers across the T tokens, and each token does, with k, q the key head's [Dk] vectors and
v the value head's [BLOCK_V] slice:

    S <- exp(g) * S;   delta = beta * (v - S^T k);   S <- S + k delta^T;   o = S^T q

Columns of S never mix (every step is per column or a sum over rows), so the column blocks are independent
programs.  Example, Qwen3.5-27B (Hk 16, H 48, so R 3; Dk = Dv = 128; BLOCK_V 32): the grid is (B, 48, 4);
program (5, 7, 2) owns state[5, 7, :, 64:96] and reads key head 7 // 3 = 2 (value heads 6, 7, 8 share it),
v[5, t, 7, 64:96], g[5, t, 7] and beta[5, t, 7], and writes out[5, t, 7, 64:96].  Dk and Dv need not be powers
of two: the tile is padded to powers of two and masked (padded rows hold k = q = 0 and stay 0).

With counts [B], sequence b applies only its first counts[b] tokens to the state: the loads of k, v, g and
beta of a later token are masked off, which makes it a no-op (decay exp(0) = 1, k = 0, beta = 0; its values
are never read, so padding may hold anything).  The outputs of such tokens are those of the held state.  The
grid depends only on the shapes (a CUDA graph replays it) and nothing waits on the device.  The token count T is
compiled in up to MAX_TOKENS (decode and verify steps: one compilation per count, warmed up at start-up); a
longer run (a prefill, whose lengths vary from step to step) reads it at run time, one compilation for all:
token by token in one launch costs less than the chunked form's ~100 PyTorch ops while the host launches them.

With slots [B] (long, on the device) the state argument is the layer's whole pool [N, H, Dk, Dv] (N slots,
specdec/models/recurrent_state.py) and sequence b's state is its row slots[b]: read there, and written back
there in place (unless store is off: a deferred verify step leaves its slots as they were), with no gather
into a [B, ...] copy before the launch nor scatter after it.  Example, the 27B shapes above with a pool of
N = 40 slots and slots = [17, 3]: program (1, 7, 2) reads and writes pool[3, 7, :, 64:96], i.e. the elements
((3 * 48 + 7) * 128 + r) * 128 + c for rows r < 128 and columns 64 <= c < 96, where the [B, ...] form uses
sequence 1's own row, ((1 * 48 + 7) * 128 + r) * 128 + c.  A program reads its whole tile before it writes
it and no two programs share a tile of a real sequence, whose slot is its own (engine/state_slots.py).
The padding sequences of a fixed-shape step may all share the one scratch slot: their programs then race
on its rows (one may read what another wrote), which is harmless because nothing real ever reads that slot
or the padding sequences' outputs (the old scatter of copies had the same nondeterminism).

`fused_recurrent` is the entry point; `supports` says whether a call can run here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 17  # token counts compiled in: decode and verify steps (16 drafts + 1); longer runs read theirs
MAX_HEAD_DIM = 256  # Dk and Dv
BLOCK_V = 32  # state columns per program: 128 B of each state row, a [128, 32] tile (32 registers a thread)


@triton.jit
def _token(S, t, base, head, key_head, count, rows, row_ok, cols, col_ok, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
           out_ptr, HK: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
           WRITE_OUT: tl.constexpr):
    """Token t of the program's sequence, whose first token is row `base` of the inputs, applied to S
    [DK_PAD, BLOCK_V] (a no-op past `count`); its output columns written.  Returns the new S."""
    active = t < count
    key_row = (base + t) * HK + key_head  # row of q / k [rows * Hk, DK]
    value_row = (base + t) * H + head  # row of v / out [rows * H, DV], element of g / beta [rows * H]
    k = tl.load(k_ptr + key_row * DK + rows, mask=row_ok & active, other=0.0)  # [DK_PAD]
    v = tl.load(v_ptr + value_row * DV + cols, mask=col_ok & active, other=0.0)  # [BLOCK_V]
    g = tl.load(g_ptr + value_row, mask=active, other=0.0)
    beta = tl.load(beta_ptr + value_row, mask=active, other=0.0)
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], 0)) * beta  # [BLOCK_V]: beta * (v - S^T k)
    S = S + k[:, None] * delta[None, :]
    if WRITE_OUT:
        q = tl.load(q_ptr + key_row * DK + rows, mask=row_ok, other=0.0)  # [DK_PAD]
        tl.store(out_ptr + value_row * DV + cols, tl.sum(S * q[:, None], 0), mask=col_ok)
    return S


@triton.jit(do_not_specialize=["tokens"])  # one compilation for every run-time length (none per divisibility)
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, counts_ptr, slots_ptr, starts_ptr, out_ptr,
                      final_ptr, tokens, T: tl.constexpr, HK: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr, HAS_COUNTS: tl.constexpr,
                      HAS_SLOTS: tl.constexpr, HAS_STARTS: tl.constexpr, STORE: tl.constexpr,
                      WRITE_OUT: tl.constexpr):
    """One program per (sequence, value head, block of BLOCK_V columns); every tensor contiguous.  The state
    row is the sequence's own (state [B, ...], final [B, ...]) or, with HAS_SLOTS, slots[seq] (state and final
    both the pool [N, ...]); STORE off writes no final state.  T: the tokens per sequence, or 0: `tokens`, or
    with HAS_STARTS (and T = 0) ragged sequences laid end to end: sequence seq's counts[seq] rows from
    starts[seq], the program stopping at its own count (no padding, nothing written past it)."""
    seq = tl.program_id(0).to(tl.int64)  # int64: N * H * Dk * Dv may pass 2^31
    state_row = tl.load(slots_ptr + seq).to(tl.int64) if HAS_SLOTS else seq
    head = tl.program_id(1)
    key_head = head // (H // HK)
    rows = tl.arange(0, DK_PAD)
    row_ok = rows < DK
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < DV
    tile = (state_row * H + head) * DK * DV + rows[:, None] * DV + cols[None, :]  # [DK_PAD, BLOCK_V] offsets
    tile_ok = row_ok[:, None] & col_ok[None, :]
    S = tl.load(state_ptr + tile, mask=tile_ok, other=0.0)
    if T > 0:  # the count compiled in (decode and verify steps)
        count = tl.load(counts_ptr + seq) if HAS_COUNTS else T
        for t in range(T):
            S = _token(S, t, seq * T, head, key_head, count, rows, row_ok, cols, col_ok, q_ptr, k_ptr, v_ptr, g_ptr,
                       beta_ptr, out_ptr, HK, H, DK, DV, WRITE_OUT)
    else:  # read at run time (a prefill's runs; a while loop, which the interpreter also runs)
        if HAS_STARTS:  # ragged: its own rows, up to its own count
            base = tl.load(starts_ptr + seq).to(tl.int64)
            count = tl.load(counts_ptr + seq)
            limit = count
        else:
            base = seq * tokens
            count = tl.load(counts_ptr + seq) if HAS_COUNTS else tokens
            limit = tokens
        t = 0
        while t < limit:
            S = _token(S, t, base, head, key_head, count, rows, row_ok, cols, col_ok, q_ptr, k_ptr, v_ptr, g_ptr,
                       beta_ptr, out_ptr, HK, H, DK, DV, WRITE_OUT)
            t += 1
    if STORE:
        tl.store(final_ptr + tile, S, mask=tile_ok)


INTERPRETED = not isinstance(_recurrent_kernel, triton.runtime.JITFunction)  # decorated under TRITON_INTERPRET=1


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor, counts: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> bool:
    """Whether the shapes are the kernel's: q, k [B, T, Hk, Dk], v [B, T, H, Dv], g, beta [B, T, H],
    state [B, H, Dk, Dv] (with slots [B]: the pool [N, H, Dk, Dv], contiguous as it is written in place),
    counts [B], with H a multiple of Hk, T >= 1, Dk, Dv <= MAX_HEAD_DIM."""
    if q.dim() != 4 or v.dim() != 4 or state.dim() != 4:
        return False
    batch, tokens, key_heads, dk = q.shape
    heads, dv = v.shape[2], v.shape[3]
    state_ok = state.shape == (batch, heads, dk, dv) if slots is None else \
        state.shape[1:] == (heads, dk, dv) and slots.shape == (batch,) and state.is_contiguous()
    return (k.shape == q.shape and v.shape[:2] == (batch, tokens) and g.shape == beta.shape == (batch, tokens, heads)
            and state_ok and (counts is None or counts.shape == (batch,))
            and heads % key_heads == 0 and tokens >= 1 and dk <= MAX_HEAD_DIM and dv <= MAX_HEAD_DIM)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, counts: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> bool:
    """Whether `fused_recurrent` handles this call: CUDA tensors, float32 (counts, slots integer), shapes that
    `fits`.  The caller falls back to specdec.models.delta_rule otherwise."""
    floats = (q, k, v, g, beta, state)
    indices = tuple(t for t in (counts, slots) if t is not None)
    return (all(t.is_cuda for t in floats + indices) and all(t.dtype == torch.float32 for t in floats)
            and not any(t.is_floating_point() for t in indices) and fits(q, k, v, g, beta, state, counts, slots))


def launch_config(dk: int, dv: int, block_v: int | None = None) -> tuple[int, int, int]:
    """(DK_PAD, BLOCK_V, num_warps): the tile [DK_PAD, BLOCK_V] at about 32 state registers a thread.
    Example: Dk = Dv = 128 -> (128, 32, 4); Dk 256 -> (256, 32, 8); Dk = Dv = 24 -> (32, 32, 1)."""
    dk_pad = max(16, triton.next_power_of_2(dk))
    block_v = min(block_v or BLOCK_V, max(16, triton.next_power_of_2(dv)))
    return dk_pad, block_v, max(1, min(8, dk_pad * block_v // 1024))


def fused_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, counts: torch.Tensor | None = None, write_outputs: bool = True,
                    slots: torch.Tensor | None = None, store: bool = True, block_v: int | None = None,
                    num_warps: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """q, k [B, T, Hk, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv] (all float32, left
    unchanged) -> (out [B, T, H, Dv] or None without write_outputs, final state [B, H, Dk, Dv]).

    Equals delta_rule.recurrent(q.repeat_interleave(R, 2), k.repeat_interleave(R, 2), v, g, beta, state),
    R = H // Hk.  counts [B] (integer, on the device): the final state is delta_rule.advance's, sequence b
    taking only its first counts[b] tokens.  slots [B] (integer, on the device): state is the pool
    [N, H, Dk, Dv] (contiguous), sequence b's state its row slots[b], and the final states are written over
    those rows in place (store) or nowhere (not store: the pool is left as it was); the second result is
    then None.  block_v / num_warps override launch_config (benchmarks)."""
    batch, tokens, key_heads, dk = q.shape
    heads, dv = v.shape[2], v.shape[3]
    dk_pad, block_v, warps = launch_config(dk, dv, block_v)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if slots is None:
        state = state.contiguous()
        final = torch.empty_like(state)
    elif state.is_contiguous():
        slots = slots.contiguous()
        final = state  # the pool: its slots' rows rewritten in place (or, without store, not at all)
    else:
        raise ValueError("the state pool must be contiguous: the kernel writes its rows in place")
    out = v.new_empty(v.shape) if write_outputs else None
    _recurrent_kernel[(batch, heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state, state if counts is None else counts, state if slots is None else slots, state,
        v if out is None else out, final, tokens, T=tokens if tokens <= MAX_TOKENS else 0, HK=key_heads, H=heads,
        DK=dk, DV=dv, DK_PAD=dk_pad, BLOCK_V=block_v, HAS_COUNTS=counts is not None, HAS_SLOTS=slots is not None,
        HAS_STARTS=False, STORE=slots is None or store, WRITE_OUT=write_outputs, num_warps=num_warps or warps)
    return out, (final if slots is None else None)


def fused_recurrent_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           pool: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """m sequences of any lengths laid end to end, no padding: q, k [R, Hk, Dk]; v [R, H, Dv]; g, beta [R, H]
    (float32), sequence i's counts[i] rows from row starts[i]; pool [N, H, Dk, Dv] (contiguous), sequence i's
    state its row slots[i], advanced there in place -> out [R, H, Dv].  Example: counts [3, 1, 2], starts
    [0, 3, 4]: sequence 1 is row 3, sequence 2 rows 4 and 5; their programs stop after 1 and 2 tokens."""
    rows, key_heads, dk = q.shape
    heads, dv = v.shape[1], v.shape[2]
    if not pool.is_contiguous():
        raise ValueError("the state pool must be contiguous: the kernel writes its rows in place")
    dk_pad, block_v, warps = launch_config(dk, dv)
    q, k, v, g, beta, starts, counts, slots = (t.contiguous() for t in (q, k, v, g, beta, starts, counts, slots))
    out = v.new_empty(v.shape)
    _recurrent_kernel[(len(starts), heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, pool, counts, slots, starts, out, pool, 0, T=0, HK=key_heads, H=heads, DK=dk, DV=dv,
        DK_PAD=dk_pad, BLOCK_V=block_v, HAS_COUNTS=True, HAS_SLOTS=True, HAS_STARTS=True, STORE=True,
        WRITE_OUT=True, num_warps=warps)
    return out
