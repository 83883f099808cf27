"""Elementwise pieces of the decoder that a GPU wants fused: RMSNorm (with the residual add), rotary
embedding, SiLU-and-multiply.

Each is plain PyTorch here; `enable_fused_kernels()` swaps in `torch.compile`d versions (Triton kernels
that do each in one pass) on a GPU, where a decode step is otherwise thousands of tiny kernels.  The
CPU (and the tests) keep the plain versions, whose arithmetic follows transformers exactly.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), in float32 and cast back before the weight (as transformers does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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


PLAIN = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotate": rotate, "rms_norm_rotate": rms_norm_rotate,
         "silu_mul": silu_mul}


class Kernels:
    """The implementations in use (plain by default)."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rotate = staticmethod(rotate)
    rms_norm_rotate = staticmethod(rms_norm_rotate)
    silu_mul = staticmethod(silu_mul)
    fused = False


@contextlib.contextmanager
def plain_kernels():
    """The plain pieces for the duration, even where compiled ones are in use.

    Eager steps keep the compiled pieces: on an H200 (bench/eager_steps.py, 2026-12-03) the plain ones made
    the 8B twin's eager steps slower from 134 tokens up (42 -> 44 ms; 2048-token prefill 68 -> 90 ms) and
    saved the 8-layer reference target only 1-3 ms of a 9-15 ms step, whose cost is host dispatch."""
    if not Kernels.fused:
        yield
        return
    saved = {name: Kernels.__dict__[name] for name in PLAIN}
    for name, fn in PLAIN.items():
        setattr(Kernels, name, staticmethod(fn))
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
    compiled = {name: compile_elementwise(fn) for name, fn in PLAIN.items()}
    try:
        _try_compiled(compiled)
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: run the plain kernels
        import logging

        logging.getLogger("specdec").warning("fused kernels unavailable (%s: %s); using plain PyTorch ones",
                                             type(exc).__name__, str(exc).splitlines()[0][:200])
        return False
    for name, fn in compiled.items():
        setattr(Kernels, name, staticmethod(fn))
    Kernels.fused = True
    return True


def _try_compiled(compiled: dict) -> None:
    """Run every compiled piece once on small CUDA tensors (bf16, 3 rows of 2 heads x 64)."""
    x = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    cos = sin = torch.ones(3, 1, 64, device="cuda", dtype=torch.bfloat16)
    compiled["rms_norm"](x, w, 1e-6)
    compiled["add_rms_norm"](x, x, w, 1e-6)
    compiled["rotate"](x, cos, sin)
    compiled["rms_norm_rotate"](x, w, 1e-6, cos, sin)
    compiled["silu_mul"](x, x)
