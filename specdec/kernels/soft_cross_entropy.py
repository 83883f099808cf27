"""A draft head's training loss, the cross-entropy of its logits against the target's distribution, and its
gradient in one Triton launch (train/head_loss.py calls it on CUDA).

Per row of logits z [N, V] (bf16 or float32) and the target's log-probabilities log p [N, V] (float32):

    ce = -sum_v p_v log softmax(z)_v = lse(z) * P - sum_v p_v z_v          (P = sum_v p_v, 1 up to rounding)
    d ce / d z_v = softmax(z)_v * P - p_v

Written with tensors, a training step writes and reads float copies of [N, V] several times for this at each
unrolled step (log-softmax, the product with p, their backward): about 7 GB a step at 32 x 512 rows x 8,192
columns x 7 steps, the largest part of its time (docs/BENCHMARKS.md).  Here one program a row reads z and log p
in two passes (the row's maximum, sum of exponentials, P and dot product; then the gradient) and writes the
gradient once, in z's dtype.  The gradient is kept for the backward, which only scales each row by the row's
incoming gradient: the loss is linear in each row's ce.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_BLOCK = 4096  # columns a program holds at once


@triton.jit
def _soft_ce_kernel(z_ptr, logp_ptr, grad_ptr, ce_ptr, stride_z, stride_p, stride_g, VOCAB: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row, p_row, g_row = z_ptr + row * stride_z, logp_ptr + row * stride_p, grad_ptr + row * stride_g
    cols = tl.arange(0, BLOCK)
    # pass 1: the running maximum m and sum s of exp(z - m) (one value each), P and sum p z (per lane)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    mass = tl.zeros([BLOCK], tl.float32)
    dot = tl.zeros([BLOCK], tl.float32)
    for start in range(0, VOCAB, BLOCK):
        ok = start + cols < VOCAB
        z = tl.load(z_row + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp(tl.load(p_row + start + cols, mask=ok, other=float("-inf")))  # 0 past the row
        m_new = tl.maximum(m, tl.max(z, axis=0))  # finite: every block holds a column of the row
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        mass += p
        dot += p * tl.where(ok, z, 0.0)  # z is -inf past the row, where p is 0
    lse = m + tl.log(s)
    total = tl.sum(mass, axis=0)
    tl.store(ce_ptr + row, lse * total - tl.sum(dot, axis=0))
    # pass 2: the gradient softmax(z) P - p
    for start in range(0, VOCAB, BLOCK):
        ok = start + cols < VOCAB
        z = tl.load(z_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(tl.load(p_row + start + cols, mask=ok, other=float("-inf")))
        grad = tl.exp(z - lse) * total - p
        tl.store(g_row + start + cols, grad.to(grad_ptr.dtype.element_ty), mask=ok)


def soft_cross_entropy_rows(logits: torch.Tensor, target_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V], target_logprobs [N, V] float32 (rows contiguous) -> (ce [N] float32, d ce / d logits [N, V]
    in the logits' dtype)."""
    if logits.shape != target_logprobs.shape or logits.dim() != 2:
        raise ValueError(f"logits {tuple(logits.shape)} and target log-probabilities "
                         f"{tuple(target_logprobs.shape)}: two [rows, vocabulary] tensors of one shape")
    logits, target_logprobs = logits.contiguous(), target_logprobs.float().contiguous()
    rows, vocab = logits.shape
    grad = torch.empty_like(logits)
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
        _soft_ce_kernel[(rows,)](logits, target_logprobs, grad, ce, logits.stride(0), target_logprobs.stride(0),
                                 grad.stride(0), VOCAB=vocab, BLOCK=block,  # one compile per vocabulary size
                                 num_warps=8 if block >= 2048 else 4)  # 16 columns a thread in a full block
    return ce, grad


class SoftCrossEntropy(torch.autograd.Function):
    """ce [N] = SoftCrossEntropy.apply(logits [N, V], target_logprobs [N, V]); no gradient for the target."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
        ce, grad = soft_cross_entropy_rows(logits, target_logprobs)
        ctx.save_for_backward(grad)
        return ce

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce[:, None].to(grad.dtype), None
