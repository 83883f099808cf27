"""The head's training loss in one Triton launch (specdec/kernels/soft_cross_entropy.py) against the same sum
written with tensors (train/head_loss.soft_cross_entropy on the CPU) and its autograd gradient, run on the CPU by
Triton's interpreter in a child process (tests/interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from specdec.train.head_loss import soft_cross_entropy
from tests.interpreter import child_only, kernel_module, parent_only, run_child

kernel = kernel_module("specdec.kernels.soft_cross_entropy")  # None outside the child


@parent_only
def test_kernel_cases_under_the_interpreter():
    """This file's kernel cases, in a child process started with TRITON_INTERPRET=1."""
    run_child(__file__, min_passed=8, parent_tests=3)  # this test and the two sm_90 compiles


def rows(count: int, vocab: int, dtype=torch.float32, seed: int = 0, spread: float = 3.0):
    """Logits [count, vocab] and a target's log-probabilities over the same columns."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(count, vocab, generator=gen) * spread).to(dtype)
    target = (torch.randn(count, vocab, generator=gen) * spread).log_softmax(-1)
    return logits, target


def reference(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce [N], d sum(w ce) / d logits) by autograd through the tensor formula, w the fixed row weights below."""
    logits = logits.float().detach().requires_grad_(True)
    ce = soft_cross_entropy(logits, target)
    (ce * weights(len(ce))).sum().backward()
    return ce.detach(), logits.grad


def weights(count: int) -> torch.Tensor:
    return torch.linspace(0.5, 2.0, count)


@child_only
@pytest.mark.parametrize("vocab", [96, 4096, 10_000])  # below one block, exactly one, several with a ragged last
def test_loss_and_gradient_match_the_tensor_formula(vocab):
    logits, target = rows(5, vocab)
    expected_ce, expected_grad = reference(logits, target)
    x = logits.clone().requires_grad_(True)
    ce = kernel.SoftCrossEntropy.apply(x, target)
    (ce * weights(len(ce))).sum().backward()
    torch.testing.assert_close(ce, expected_ce, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(x.grad, expected_grad, rtol=1e-5, atol=1e-6)


@child_only
def test_a_target_that_is_not_normalised_still_gives_the_cross_entropy():
    """-sum p log q for a p of any mass (the kernel's lse * P term), e.g. a row past a sequence's end."""
    logits, target = rows(3, 300)
    target = target + torch.tensor([[0.0], [-2.0], [-float("inf")]])  # mass 1, e^-2, 0
    expected_ce, expected_grad = reference(logits, target)
    ce, grad = kernel.soft_cross_entropy_rows(logits, target)
    torch.testing.assert_close(ce, expected_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad * weights(3)[:, None], expected_grad, rtol=1e-5, atol=1e-6)
    assert ce[2] == 0 and not grad[2].any()


@child_only
def test_bf16_logits_give_a_bf16_gradient_close_to_the_float_one():
    logits, target = rows(4, 2000, dtype=torch.bfloat16)
    expected_ce, expected_grad = reference(logits, target)  # from the same bf16 values, in float
    ce, grad = kernel.soft_cross_entropy_rows(logits, target)
    assert grad.dtype == torch.bfloat16 and ce.dtype == torch.float32
    torch.testing.assert_close(ce, expected_ce, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad.float() * weights(4)[:, None], expected_grad, rtol=1e-2, atol=1e-4)


@child_only
def test_the_head_loss_entry_point_takes_batches_of_rows():
    """train/head_loss.soft_cross_entropy's fused path (the default on CUDA) on [B, T, V], forward and backward."""
    logits, target = rows(6, 700)
    logits, target = logits.view(2, 3, 700), target.view(2, 3, 700)
    results = []
    for fused in (True, False):
        x = logits.clone().requires_grad_(True)
        ce = soft_cross_entropy(x, target, fused=fused)
        (ce * weights(6).view(2, 3)).sum().backward()
        results.append((ce.detach(), x.grad))
    assert results[0][0].shape == (2, 3)
    for fused_result, plain_result in zip(*results):
        torch.testing.assert_close(fused_result, plain_result, rtol=1e-5, atol=1e-5)


@child_only
def test_a_wrong_target_column_fails_the_comparison():
    """Negative control: the kernel fed the target's columns rolled by one does not match."""
    logits, target = rows(2, 500)
    expected_ce, _ = reference(logits, target)
    ce, _ = kernel.soft_cross_entropy_rows(logits, target.roll(1, dims=-1))
    assert not torch.allclose(ce, expected_ce, rtol=1e-3, atol=1e-3)


@child_only
def test_strided_rows_and_bad_shapes():
    logits, target = rows(6, 128)
    every_other = logits[::2]  # rows 2 apart
    torch.testing.assert_close(kernel.soft_cross_entropy_rows(every_other, target[::2])[0],
                               reference(every_other, target[::2])[0], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="two \\[rows, vocabulary\\] tensors of one shape"):
        kernel.soft_cross_entropy_rows(logits, target[:, :64])


@parent_only
@pytest.mark.parametrize("logits_type", ["*bf16", "*fp32"])
def test_the_kernel_compiles_for_hopper(logits_type):
    """The interpreter accepts code Triton's compiler may refuse: compile for sm_90 (no GPU needed) at the
    published Qwen3-8B heads' draft vocabulary (32,000: eight blocks, the last ragged)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.kernels import soft_cross_entropy as compiled

    constants = {"VOCAB": 32_000, "BLOCK": compiled.MAX_BLOCK}
    signature = {"z_ptr": logits_type, "logp_ptr": "*fp32", "grad_ptr": logits_type, "ce_ptr": "*fp32",
                 "stride_z": "i32", "stride_p": "i32", "stride_g": "i32", "VOCAB": "constexpr", "BLOCK": "constexpr"}
    source = ASTSource(fn=compiled._soft_ce_kernel, signature=signature, constexprs=constants)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".entry _soft_ce_kernel" in ptx and "st.global" in ptx
