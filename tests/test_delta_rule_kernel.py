"""The Triton gated delta rule (specdec/kernels/delta_rule.py) against the PyTorch recurrent form and
`advance` of specdec/models/delta_rule.py, run on the CPU by Triton's interpreter.

As tests/interpreter.py explains, TRITON_INTERPRET must be set before triton is first imported, so the
kernel cases run in a child process started with it (test_kernel_cases_under_the_interpreter) and are skipped
in the test run itself.  Shapes are small: the interpreter runs every program, token by token, in Python.
"""

from __future__ import annotations


import pytest
import torch

from specdec.models.delta_rule import advance, l2_normalize, recurrent
from tests.interpreter import CHILD, HAS_TRITON, child_only, kernel_module, parent_only, run_child

kernel = kernel_module("specdec.kernels.delta_rule")  # None outside the child


@parent_only
def test_kernel_cases_under_the_interpreter():
    """This file's kernel cases, in a child process started with TRITON_INTERPRET=1."""
    run_child(__file__, min_passed=16, parent_tests=2)


def make_case(batch, tokens, key_heads, repeat, dk, dv, seed=0):
    """Inputs as the layer makes them: q, k [B, T, Hk, Dk] l2-normalised (q scaled), v [B, T, H, Dv], g <= 0,
    beta in (0, 1) [B, T, H], a random state [B, H, Dk, Dv]; H = repeat * Hk."""
    gen = torch.Generator().manual_seed(seed)
    heads = key_heads * repeat
    q = l2_normalize(torch.randn(batch, tokens, key_heads, dk, generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(batch, tokens, key_heads, dk, generator=gen))
    v = torch.randn(batch, tokens, heads, dv, generator=gen)
    g = -torch.rand(batch, tokens, heads, generator=gen) * 2
    beta = torch.rand(batch, tokens, heads, generator=gen)
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def grouped(x, heads):
    """Key heads [B, T, Hk, Dk] repeated to the H value heads, value head h reading key head h // (H / Hk)."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def reference(q, k, v, g, beta, state):
    return recurrent(grouped(q, v.shape[2]), grouped(k, v.shape[2]), v, g, beta, state)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


# (B, T, Hk, H / Hk, Dk, Dv): one token to 17, one group or three value heads a key head, head dims powers of two
# or not (the tile padded and masked)
SHAPES = [(1, 1, 2, 1, 16, 16), (3, 1, 1, 3, 24, 40), (1, 2, 2, 3, 40, 24), (3, 2, 2, 1, 16, 40),
          (1, 5, 1, 3, 16, 24), (3, 5, 2, 1, 40, 16), (1, 17, 1, 3, 24, 16), (3, 17, 1, 1, 16, 16)]


@child_only
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}-Hk{}-R{}-Dk{}-Dv{}".format(*s))
def test_matches_the_recurrent_form(shape):
    q, k, v, g, beta, state = make_case(*shape, seed=sum(shape))
    before = state.clone()
    out, final = kernel.fused_recurrent(q, k, v, g, beta, state)
    expected_out, expected_final = reference(q, k, v, g, beta, state)
    assert out.shape == v.shape and final.shape == state.shape and out.dtype == final.dtype == torch.float32
    close(out, expected_out)
    close(final, expected_final)
    assert torch.equal(state, before)  # the state is not modified in place


@child_only
def test_column_blocks_and_warps_do_not_change_the_result():
    """Dv 40 in blocks of 16 (three programs a head, the last one half masked) gives the single-block result."""
    q, k, v, g, beta, state = make_case(2, 3, 1, 3, 24, 40, seed=1)
    out, final = kernel.fused_recurrent(q, k, v, g, beta, state)
    split_out, split_final = kernel.fused_recurrent(q, k, v, g, beta, state, block_v=16, num_warps=2)
    close(split_out, out)
    close(split_final, final)


@child_only
@pytest.mark.parametrize("tokens,counts", [(5, [0, 2, 5]), (2, [1, 0, 2]), (1, [0, 1, 1]), (17, [17, 0, 9])])
def test_counts_advance_each_sequence_by_its_own_tokens(tokens, counts):
    q, k, v, g, beta, state = make_case(3, tokens, 1, 3, 24, 16, seed=tokens)
    counts = torch.tensor(counts)
    expected = advance(state, grouped(k, 3), v, g, beta, counts, int(counts.max()))
    before = state.clone()
    out, final = kernel.fused_recurrent(q, k, v, g, beta, state, counts, write_outputs=False)
    assert out is None
    close(final, expected)
    assert torch.equal(state, before)
    out, final = kernel.fused_recurrent(q, k, v, g, beta, state, counts)  # the outputs within the counts too
    close(final, expected)
    full_out = reference(q, k, v, g, beta, state)[0]
    for b, n in enumerate(counts.tolist()):
        close(out[b, :n], full_out[b, :n])


@child_only
def test_tokens_past_a_count_are_never_read():
    """Padding past a sequence's count (NaN here) leaves its state alone: a ragged batch needs no clean pad."""
    q, k, v, g, beta, state = make_case(2, 4, 1, 3, 16, 24, seed=2)
    counts = torch.tensor([1, 3])
    expected = advance(state, grouped(k, 3), v, g, beta, counts, 3)
    for b, n in enumerate(counts.tolist()):
        for x in (k, v, g, beta):
            x[b, n:] = float("nan")
    final = kernel.fused_recurrent(q, k, v, g, beta, state, counts, write_outputs=False)[1]
    close(final, expected)


@child_only
def test_the_comparison_has_power():
    """A kernel that grouped heads wrongly (value head h on key head h % Hk, what .repeat would lay out), left
    a token out, or ignored the counts would fail the checks above."""
    q, k, v, g, beta, state = make_case(2, 3, 2, 3, 16, 16, seed=3)
    out, final = kernel.fused_recurrent(q, k, v, g, beta, state)
    wrong_group = recurrent(q.repeat(1, 1, 3, 1), k.repeat(1, 1, 3, 1), v, g, beta, state)
    one_token_short = reference(q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], state)[1]
    for actual, wrong in ((out, wrong_group[0]), (final, wrong_group[1]), (final, one_token_short)):
        with pytest.raises(AssertionError):
            close(actual, wrong)
    counted = kernel.fused_recurrent(q, k, v, g, beta, state, torch.tensor([3, 1]), write_outputs=False)[1]
    with pytest.raises(AssertionError):
        close(counted, final)
    close(counted[0], final[0])


@child_only
def test_supports_cuda_float32_of_the_kernel_shapes_only():
    case = make_case(2, 3, 2, 3, 24, 40)
    q, k, v, g, beta, state = case
    assert kernel.fits(*case) and kernel.fits(*case, counts=torch.tensor([1, 2]))
    assert not kernel.supports(*case)  # CPU tensors: the PyTorch path
    assert not kernel.fits(q, k, v[:, :, :5], g[:, :, :5], beta[:, :, :5], state[:, :5])  # 5 heads, Hk 2
    assert not kernel.fits(q, k, v, g, beta, state[:1])
    assert not kernel.fits(q, k, v, g, beta, state, counts=torch.tensor([1]))
    assert not kernel.fits(*make_case(1, kernel.MAX_TOKENS + 1, 1, 1, 16, 16))
    assert not kernel.fits(*make_case(1, 1, 1, 1, 16, kernel.MAX_HEAD_DIM + 8))


@pytest.mark.skipif(CHILD or not HAS_TRITON or not torch.cuda.is_available(), reason="needs a CUDA GPU and triton")
def test_compiled_kernel_on_the_gpu():
    """The compiled kernel (not the interpreter) at the test shapes and the layer's: Qwen3.5-27B at B 512, T 4;
    Dk = Dv = 256 at T 64; head dims 100 and 200.  Outputs, final states and counted states."""
    from specdec.kernels import delta_rule as compiled

    for shape in SHAPES + [(512, 4, 16, 3, 128, 128), (4, 64, 2, 2, 256, 256), (3, 3, 1, 1, 100, 200)]:
        q, k, v, g, beta, state = (t.cuda() for t in make_case(*shape, seed=sum(shape)))
        counts = torch.arange(shape[0], device="cuda") % (shape[1] + 1)
        assert compiled.supports(q, k, v, g, beta, state, counts)
        out, final = compiled.fused_recurrent(q, k, v, g, beta, state)
        expected_out, expected_final = reference(q, k, v, g, beta, state)
        close(out, expected_out)
        close(final, expected_final)
        counted = compiled.fused_recurrent(q, k, v, g, beta, state, counts, write_outputs=False)[1]
        close(counted, advance(state, grouped(k, v.shape[2]), v, g, beta, counts, shape[1]))
