"""The math of a Gated DeltaNet layer: the gated delta rule and the causal depthwise convolution before it.

Per value head the recurrent state S is a [Dk, Dv] matrix.  Each token t (q_t, k_t l2-normalised, q_t
also scaled by Dk^-0.5; g_t <= 0 a log decay; beta_t in (0, 1) a write strength) does

    S <- exp(g_t) * S                              forget a little
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T      the delta rule: move S's read-out at k_t toward v_t
    o_t = S^T q_t

Two forms give equal results (to float32 rounding): `recurrent`, token by token (decode and verify
steps), and `chunked`, which does 64 tokens at a time with a few matrix products (prefill).  Everything
here runs in float32, as transformers does.  Shapes: B sequences (batched), T tokens, H value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's l2norm, which transformers follows)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
    """One token: state [B, H, Dk, Dv], k [B, H, Dk], v [B, H, Dv], g / beta [B, H] -> the new state."""
    state = state * g.exp()[..., None, None]
    read = (state * k.unsqueeze(-1)).sum(dim=-2)  # [B, H, Dv]: S^T k
    delta = (v - read) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv]
    -> (out [B, T, H, Dv], the state after the T tokens)."""
    out = v.new_empty(v.shape)
    for t in range(v.shape[1]):
        state = recurrent_step(state, k[:, t], v[:, t], g[:, t], beta[:, t])
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(dim=-2)
    return out, state


def recurrent_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, counts: torch.Tensor | None = None, steps: int | None = None,
                    slots: torch.Tensor | None = None, store: bool = True
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`recurrent` with q, k per key head ([B, T, Hk, Dk]; value head h reads key head h // (H / Hk)): on a GPU
    one Triton launch (specdec/kernels/delta_rule.py), else the PyTorch form over repeated heads.  With counts
    [B] (and steps = max(counts) on the host, or T) it is `advance` instead: (None, the state).

    With slots [B] (long, on the state's device) state is the layer's pool [N, H, Dk, Dv]: sequence b starts
    from row slots[b], whose final state is written back there (store) or dropped (not store: the pool is left
    as it was), and the second result is None.  The kernel reads and writes the rows in place; the PyTorch
    form gathers them and scatters the results."""
    kernel = _kernel_for(state)
    if kernel is not None and kernel.supports(q, k, v, g, beta, state, counts, slots):
        return kernel.fused_recurrent(q, k, v, g, beta, state, counts, write_outputs=counts is None, slots=slots,
                                      store=store)
    if slots is None:
        return _torch_heads(q, k, v, g, beta, state, counts, steps)
    out, final = _torch_heads(q, k, v, g, beta, state[slots], counts, steps)
    if store:
        state[slots] = final
    return out, None


def _torch_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, counts: torch.Tensor | None, steps: int | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """recurrent_heads' PyTorch form: state [B, H, Dk, Dv], the key heads repeated to the value heads."""
    repeat = v.shape[2] // k.shape[2]
    k = k.repeat_interleave(repeat, dim=2)
    if counts is not None:
        return None, advance(state, k, v, g, beta, counts, v.shape[1] if steps is None else steps)
    return recurrent(q.repeat_interleave(repeat, dim=2), k, v, g, beta, state)


def ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           pool: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Sequences laid end to end (kernels/delta_rule.fused_recurrent_ragged: q, k [R, Hk, Dk], v [R, H, Dv], g,
    beta [R, H]; sequence i's counts[i] rows from starts[i], its state pool[slots[i]], advanced in place) ->
    out [R, H, Dv].  Only where fused_on(pool)."""
    kernel = _kernel_for(pool)
    if kernel is None:
        raise RuntimeError("the ragged delta rule runs in the Triton kernel only: check fused_on first")
    return kernel.fused_recurrent_ragged(q, k, v, g, beta, pool, starts, counts, slots)


def fused_on(state: torch.Tensor) -> bool:
    """Whether recurrent_heads runs as one Triton launch on state's device, whatever the token count: then a
    prefill run, too, is cheaper token by token in that launch than in `chunked`'s ~100 PyTorch ops a call."""
    return _kernel_for(state) is not None


def _kernel_for(state: torch.Tensor):
    """The kernel module for a call on state's device: specdec.kernels.delta_rule on a GPU, else None (the
    interpreter tests replace this to run the kernel on the CPU)."""
    return _fused_kernel() if state.is_cuda else None


_kernel_module = None  # specdec.kernels.delta_rule once imported; False where triton is missing


def _fused_kernel():
    global _kernel_module
    if _kernel_module is None:
        try:
            from specdec.kernels import delta_rule as module
        except ImportError:
            module = False
        _kernel_module = module
    return _kernel_module or None


def advance(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            counts: torch.Tensor, steps: int) -> torch.Tensor:
    """The state of each sequence b after only its first counts[b] tokens (0 <= counts[b] <= T): the
    recurrent form, a sequence past its count keeping its state.  Shapes as `recurrent`; counts [B] long on
    the state's device, steps = max(counts) on the host."""
    for t in range(steps):
        stepped = recurrent_step(state, k[:, t], v[:, t], g[:, t], beta[:, t])
        state = torch.where((counts > t)[:, None, None, None], stepped, state)
    return state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `recurrent` (same arguments and results), CHUNK tokens at a time.

    Within a chunk, with c_i the cumulative log decay from the chunk's start through token i, token j's
    write reaches token i >= j scaled by exp(c_i - c_j).  The writes of a chunk depend on each other (each
    corrects what the earlier ones left); solving one unit lower-triangular system per chunk (the "UT
    transform") gives them all at once: u (the value corrections against a zero state) and w (the decayed
    keys through which the state entering the chunk is subtracted).  Then per chunk, S the entering state:
        v_new = u - w S,   out = (q * exp(c)) S + (q k^T * decay) v_new,
        S <- exp(c_last) S + (k * exp(c_last - c))^T v_new.
    The sequence is padded to whole chunks with tokens that do nothing (k = v = 0, g = 0, beta = 0)."""
    batch, tokens, heads, _ = k.shape
    pad = -tokens % chunk
    n = (tokens + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, n, chunk, ...], zero-padded
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(batch, heads, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    decay = g.cumsum(dim=-1)  # [B, H, n, C]: c_i
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)  # j > i: not yet written
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()  # [.., C, C]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * pair  # its strict lower triangle; the solve takes a unit diagonal
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pair  # [B, H, n, C, C]: token i reads token j's write
    q_from_start = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    out = torch.empty_like(u)  # [B, H, n, C, Dv]
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = q_from_start[:, :, c] @ state + within[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, n * chunk, -1)[:, :, :tokens]
    return out.transpose(1, 2), state


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution (then SiLU) of new inputs after the previous ones.

    x [B, n, C] this step's inputs; state [B, C, K-1] the K-1 inputs before them (zeros for a new sequence);
    weight [C, 1, K].  Returns (out [B, n, C] in x's dtype, window [B, C, K-1+n]: the state followed by the
    new inputs, whose last K-1 columns are the next state).  Example, K = 4: state [a b c], inputs [x y] ->
    window [a b c x y]; out_x = silu(w . [a b c x]), out_y = silu(w . [b c x y]); next state [c x y]."""
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)
    out = F.silu(F.conv1d(window.to(weight.dtype), weight, groups=weight.shape[0]))  # [B, C, n]
    return out.transpose(1, 2).to(x.dtype), window


def conv_state_after(window: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state [B, C, width] after each sequence's first counts[b] new inputs, from its `window`
    [B, C, width + n] (as causal_conv returns it).  Example, width 3: window [a b c x y z w], count 2 ->
    columns 2, 3, 4 = [c x y] (the last 3 inputs once x and y are in); count 0 -> [a b c]."""
    columns = counts[:, None] + torch.arange(width, device=window.device)  # [B, width]
    return window.gather(2, columns[:, None, :].expand(-1, window.shape[1], -1))
