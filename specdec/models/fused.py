"""Elementwise pieces of the decoder that a GPU wants fused: RMSNorm (with the residual add), rotary
embedding, SiLU-and-multiply; for Qwen3.5 also the zero-centred and the gated RMSNorm and the per-token
gates of the gated delta rule.

Each is plain PyTorch here; `enable_fused_kernels()` swaps in `torch.compile`d versions (Triton kernels
that do each in one pass) on a GPU, where a decode step is otherwise thousands of tiny kernels.  The
CPU (and the tests) keep the plain versions, whose arithmetic follows transformers exactly.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from specdec.models.delta_rule import l2_normalize


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] / rms(x) over the last dim, in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight [D] * x [..., D] / rms(x), in float32 and cast back before the weight (as transformers does)."""
    return weight * _normalized(x, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, 1, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rms_norm_rotate(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """rotate(rms_norm(x)): Qwen3's per-head query/key norm followed by the rotary embedding."""
    return rotate(rms_norm(x, weight, eps), cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] / rms(x) * (1 + weight [D]), all in float32 and cast back (Qwen3.5's norms, whose weight
    starts at zero)."""
    return (_normalized(x, eps) * (1.0 + weight.float())).to(x.dtype)


def add_zero_centred_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, zero_centred_rms_norm(x + delta)): the residual add and the next norm in one pass."""
    x = x + delta
    return x, zero_centred_rms_norm(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x [..., D]) * silu(z [..., D]), the gate in float32, cast back to x's dtype (the output norm
    of a Gated DeltaNet layer, per value head)."""
    return (rms_norm(x, weight, eps) * F.silu(z.float())).to(x.dtype)


def delta_rule_gates(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, scale: float):
    """The gated delta rule's per-token inputs, in float32: q, k [..., Hk, Dk] l2-normalised (q also times
    scale, Dk^-0.5); from b, a [..., Hv] the write strength beta = sigmoid(b) and the log decay
    g = -exp(A_log) * softplus(a + dt_bias) <= 0 (A_log, dt_bias [Hv]).  Returns (q, k, beta, g)."""
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return l2_normalize(q.float()) * scale, l2_normalize(k.float()), beta, g


PLAIN = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotate": rotate, "rms_norm_rotate": rms_norm_rotate,
         "silu_mul": silu_mul, "zero_centred_rms_norm": zero_centred_rms_norm,
         "add_zero_centred_rms_norm": add_zero_centred_rms_norm, "gated_rms_norm": gated_rms_norm,
         "delta_rule_gates": delta_rule_gates}


class Kernels:
    """The implementations in use (plain by default)."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rotate = staticmethod(rotate)
    rms_norm_rotate = staticmethod(rms_norm_rotate)
    silu_mul = staticmethod(silu_mul)
    zero_centred_rms_norm = staticmethod(zero_centred_rms_norm)
    add_zero_centred_rms_norm = staticmethod(add_zero_centred_rms_norm)
    gated_rms_norm = staticmethod(gated_rms_norm)
    delta_rule_gates = staticmethod(delta_rule_gates)
    fused = False
    # specdec.kernels.qk_rope_write.qk_rope_write where set (a GPU with working fused kernels): a layer's query/key
    # norms, rotary embedding and KV-cache writes in one launch (transformer.Attention.forward)
    qk_rope_write = None


@contextlib.contextmanager
def plain_kernels():
    """The plain pieces for the duration, even where compiled ones are in use.

    Eager steps keep the compiled pieces: on an H200 (bench/eager_steps.py, 2026-12-03) the plain ones made
    the 8B twin's eager steps slower from 134 tokens up (42 -> 44 ms; 2048-token prefill 68 -> 90 ms) and
    saved the 8-layer reference target only 1-3 ms of a 9-15 ms step, whose cost is host dispatch."""
    if not Kernels.fused:
        yield
        return
    saved = {name: Kernels.__dict__[name] for name in (*PLAIN, "qk_rope_write")}
    for name, fn in PLAIN.items():
        setattr(Kernels, name, staticmethod(fn))
    Kernels.qk_rope_write = None
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(Kernels, name, fn)


RECOMPILE_LIMIT = 64  # variants per piece: a target and a drafter of other widths, 1 or many rows, views


def compile_elementwise(fn, backend: str = "inductor"):
    """fn compiled for any shape.  Each piece still gets a variant per distinct guard (one row or many,
    2-D or per-head 3-D, contiguous or a view, a target and a drafter), so the recompile limit is raised;
    and not fullgraph, so that a piece past the limit runs eagerly instead of failing the step."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True, backend=backend)


def enable_fused_kernels() -> bool:
    """Compile the elementwise pieces (GPU only); returns whether they are now in use.

    Each compiled piece is tried once on a small tensor here; if compiling fails (no working Triton, an
    unsupported GPU) the plain versions stay and a warning says why."""
    if Kernels.fused or not torch.cuda.is_available():
        return Kernels.fused
    compiled = compile_all()
    try:
        _try_compiled(compiled)
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: run the plain kernels
        _warn_unavailable("fused kernels", exc)
        return False
    use_compiled(compiled)
    try:
        Kernels.qk_rope_write = staticmethod(_tried_qk_rope_write())
    except Exception as exc:  # noqa: BLE001 - the compiled pieces stay; attention layers write as before
        _warn_unavailable("the fused q/k norm, rotary and KV write", exc)
    return True


def _warn_unavailable(what: str, exc: Exception) -> None:
    import logging

    logging.getLogger("specdec").warning("%s unavailable (%s: %s); using plain PyTorch ones", what,
                                         type(exc).__name__, str(exc).splitlines()[0][:200])


def compile_all(backend: str = "inductor") -> dict:
    """Every elementwise piece compiled (compile_elementwise), by name."""
    return {name: compile_elementwise(fn, backend) for name, fn in PLAIN.items()}


def use_compiled(compiled: dict) -> None:
    """Run these compiled pieces from now on (Kernels.fused).  With compile_all("eager") a CPU takes the
    variants a GPU would (dynamo's guards decide them): how the first-use benches and tests count them."""
    for name, fn in compiled.items():
        setattr(Kernels, name, staticmethod(fn))
    Kernels.fused = True


def _try_compiled(compiled: dict) -> None:
    """Run every compiled piece once on small CUDA tensors (bf16, 3 rows of 2 heads x 64; the delta rule's
    gates as one sequence of 3 tokens)."""
    x = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    cos = sin = torch.ones(3, 1, 64, device="cuda", dtype=torch.bfloat16)
    compiled["rms_norm"](x, w, 1e-6)
    compiled["add_rms_norm"](x, x, w, 1e-6)
    compiled["rotate"](x, cos, sin)
    compiled["rms_norm_rotate"](x, w, 1e-6, cos, sin)
    compiled["silu_mul"](x, x)
    compiled["zero_centred_rms_norm"](x, w, 1e-6)
    compiled["add_zero_centred_rms_norm"](x, x, w, 1e-6)
    compiled["gated_rms_norm"](x, x, w, 1e-6)
    heads, gates = x.unsqueeze(0), x[..., 0].unsqueeze(0)  # [1, 3, 2, 64], [1, 3, 2]
    compiled["delta_rule_gates"](heads, heads, gates, gates, w[:2], w[:2], 64**-0.5)


def _tried_qk_rope_write():
    """specdec.kernels.qk_rope_write's entry point, run once on small CUDA tensors (bf16, 3 tokens, 2 query heads
    and 1 key head of 64 dims, an 8-slot cache)."""
    from specdec.kernels.qk_rope_write import qk_rope_write

    q = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    kv = q[:, :1]
    cos = sin = torch.ones(3, 1, 64, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(8, 1, 64, device="cuda", dtype=torch.bfloat16)
    qk_rope_write(q, kv, kv, q[0, 0], q[0, 0], 1e-6, cos, sin, torch.arange(3, device="cuda"), cache, cache.clone())
    return qk_rope_write
