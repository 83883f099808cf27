"""The Triton gated delta rule (specdec/kernels/delta_rule.py) against the PyTorch recurrent form and
`advance` of specdec/models/delta_rule.py, run on the CPU by Triton's interpreter.

As tests/interpreter.py explains, TRITON_INTERPRET must be set before triton is first imported, so the
kernel cases run in a child process started with it (test_kernel_cases_under_the_interpreter) and are skipped
in the test run itself.  Shapes are small: the interpreter runs every program, token by token, in Python.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from specdec.models import delta_rule as model_delta_rule
from specdec.models.attention import AttentionBatch
from specdec.models.config import ModelConfig
from specdec.models.delta_rule import advance, l2_normalize, recurrent
from specdec.models.gated_deltanet import GatedDeltaNet, plan_groups, uniform_group
from specdec.models.recurrent_state import StateBatch, commit, commit_on_device, new_state_pools
from tests.interpreter import CHILD, HAS_TRITON, child_only, kernel_module, parent_only, run_child

kernel = kernel_module("specdec.kernels.delta_rule")  # None outside the child


@parent_only
def test_kernel_cases_under_the_interpreter():
    """This file's kernel cases, in a child process started with TRITON_INTERPRET=1."""
    run_child(__file__, min_passed=34, parent_tests=8)  # this one, the GPU case and the 6 compile cases


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


def pool_case(batch, tokens, num_slots, seed):
    """A kernel case whose states live in a random pool [num_slots, H, Dk, Dv]: (inputs, pool, slots [B]), the
    slots distinct, in random order and never the first B in order (what ignoring them would read)."""
    q, k, v, g, beta, _ = make_case(batch, tokens, 1, 3, 24, 16, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pool = torch.randn(num_slots, *v.shape[2:3], 24, 16, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:batch]
    if torch.equal(slots, torch.arange(batch)):
        slots = slots.flip(0)
    return (q, k, v, g, beta), pool, slots


def untouched(pool, before, slots):
    """Whether the rows of pool [N, ...] outside slots are bit-identical to before's."""
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[slots] = False
    return torch.equal(pool[others], before[others])


@child_only
@pytest.mark.parametrize("store", [True, False], ids=["store", "no-store"])
@pytest.mark.parametrize("tokens,counts", [(3, None), (1, None), (4, [0, 4, 2]), (17, [17, 5, 0])])
def test_slots_read_and_write_the_pool_in_place(tokens, counts, store):
    """The slot-indexed mode equals the [B, ...] mode on the gathered states: the same outputs, the final states
    in the slots' rows (store) or the pool bit-unchanged (no store), every other row bit-identical."""
    inputs, pool, slots = pool_case(3, tokens, 7, seed=tokens)
    counts = None if counts is None else torch.tensor(counts)
    expected_out, expected_final = kernel.fused_recurrent(*inputs, pool[slots].clone(), counts)
    before = pool.clone()
    out, final = kernel.fused_recurrent(*inputs, pool, counts, slots=slots, store=store)
    assert final is None
    assert torch.equal(out, expected_out)  # the same arithmetic in the same order
    if store:
        assert torch.equal(pool[slots], expected_final)
        assert untouched(pool, before, slots)
    else:
        assert torch.equal(pool, before)


@child_only
def test_slots_without_outputs_advance_by_the_counts():
    """The commit's call (counts, no outputs) in place: each slot advanced by its own count, as `advance`."""
    inputs, pool, slots = pool_case(3, 5, 6, seed=4)
    q, k, v, g, beta = inputs
    counts = torch.tensor([5, 0, 2])
    expected = advance(pool[slots], grouped(k, 3), v, g, beta, counts, 5)
    before = pool.clone()
    out, final = kernel.fused_recurrent(*inputs, pool, counts, write_outputs=False, slots=slots)
    assert out is None and final is None
    close(pool[slots], expected)
    assert torch.equal(pool[slots[1]], before[slots[1]])  # count 0: the state as it was
    assert untouched(pool, before, slots)


@child_only
def test_slot_indexing_has_power():
    """A kernel that read or wrote the wrong rows would fail: with the slots permuted, sequence b's state comes
    from another row and the rows get other sequences' states; the pool's first B rows are not the slots."""
    inputs, pool, slots = pool_case(3, 2, 7, seed=5)
    before = pool.clone()
    _, expected_final = kernel.fused_recurrent(*inputs, pool[slots].clone())
    right_out = kernel.fused_recurrent(*inputs, before[slots].clone())[0]
    slots_ignored = kernel.fused_recurrent(*inputs, before[:3].clone())  # rows 0, 1, 2 instead
    out, _ = kernel.fused_recurrent(*inputs, pool, slots=slots[[1, 2, 0]])
    for actual, expected in ((out, right_out), (pool[slots], expected_final), (slots_ignored[0], right_out),
                             (slots_ignored[1], expected_final)):
        with pytest.raises(AssertionError):
            close(actual, expected)


@child_only
@pytest.mark.parametrize("counts", [None, [9, 4, 0]])
def test_runs_longer_than_the_compiled_counts_read_their_length_at_run_time(monkeypatch, counts):
    """Past MAX_TOKENS (lowered here to 4) the token count is a run-time argument: the same outputs and states
    as the recurrent form, with counts and in place on a pool too."""
    monkeypatch.setattr(kernel, "MAX_TOKENS", 4)
    (q, k, v, g, beta, state), pool, slots = make_case(3, 9, 2, 3, 16, 24, seed=4), None, torch.tensor([2, 0, 4])
    counts = None if counts is None else torch.tensor(counts)
    out, final = kernel.fused_recurrent(q, k, v, g, beta, state, counts)
    if counts is None:
        expected_out, expected_final = reference(q, k, v, g, beta, state)
        close(out, expected_out)
    else:
        expected_final = advance(state, grouped(k, v.shape[2]), v, g, beta, counts, 9)
    close(final, expected_final)
    pool = torch.randn(5, *state.shape[1:])
    pool[slots] = state
    kernel.fused_recurrent(q, k, v, g, beta, pool, counts, write_outputs=counts is None, slots=slots)
    close(pool[slots], expected_final)


@child_only
@pytest.mark.parametrize("counts", [[3, 1, 2], [20, 1], [1], [5, 18, 2, 7]])
def test_ragged_sequences_laid_end_to_end_each_equal_the_recurrent_form(counts):
    """The ragged mode: each sequence's rows of the flat inputs give its own recurrent form's outputs, and its
    final state lands in its slot of the pool; every other row of the pool is left bit-identical."""
    gen = torch.Generator().manual_seed(len(counts))
    cases = [make_case(1, n, 2, 3, 16, 24, seed=i + n) for i, n in enumerate(counts)]
    flat = [torch.cat([case[j][0] for case in cases]) for j in range(5)]  # q, k, v, g, beta: [R, ...]
    pool = torch.randn(len(counts) + 3, *cases[0][5].shape[1:], generator=gen)
    slots = torch.randperm(len(counts) + 3, generator=gen)[:len(counts)]
    for case, slot in zip(cases, slots):
        pool[slot] = case[5][0]
    before = pool.clone()
    starts = torch.tensor([0, *itertools.accumulate(counts)][:-1])
    out = kernel.fused_recurrent_ragged(*flat, pool, starts, torch.tensor(counts), slots)
    assert out.shape == flat[2].shape
    for case, start, n, slot in zip(cases, starts.tolist(), counts, slots):
        expected_out, expected_final = reference(*case)
        close(out[start:start + n], expected_out[0])
        close(pool[slot], expected_final[0])
    assert untouched(pool, before, slots)


@child_only
def test_padding_sequences_may_share_a_scratch_slot():
    """Two padding sequences on one scratch slot (as a fixed-shape step lays them) leave the real sequence's
    result and every other row as they would be alone."""
    inputs, pool, slots = pool_case(3, 2, 5, seed=6)
    scratch = 4
    slots = torch.tensor([1, scratch, scratch])
    expected_out, expected_final = kernel.fused_recurrent(*inputs, pool[slots].clone())
    before = pool.clone()
    out, _ = kernel.fused_recurrent(*inputs, pool, slots=slots)
    assert torch.equal(out[0], expected_out[0]) and torch.equal(pool[1], expected_final[0])
    assert untouched(pool, before, slots) and torch.isfinite(pool[scratch]).all()


HYBRID = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=300, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=6, rms_norm_eps=1e-6)
SCRATCH = 5  # the padded step's scratch slot (engine/state_slots.py), shared by its padding sequences


def ragged_step(pools, counts, slots, defer):
    """(groups, StateBatch) of a ragged step: sequence i feeds counts[i] tokens from slot slots[i]."""
    starts = [0, *itertools.accumulate(counts)]
    batch = AttentionBatch(torch.tensor(starts), torch.tensor(counts), torch.zeros(len(counts), 1, dtype=torch.long),
                           torch.zeros(starts[-1], dtype=torch.long), max(counts), max(counts),
                           host_lens=(list(counts), list(counts)))
    batch.states = StateBatch(*pools, slots=slots, defer=defer)
    return plan_groups(batch), batch.states


def layer_steps(layer, pools):
    """A Gated DeltaNet layer's steps over pools (conv, ssm), each compared by the caller: the layer's outputs
    after each step, and a copy of the pools after it and after each commit."""
    gen = torch.Generator().manual_seed(7)
    seen = []

    def run(groups, states, rows):
        with torch.no_grad():
            seen.append(layer(torch.randn(rows, layer.in_proj_qkv.in_features, generator=gen), groups, states))
        seen.append([t.clone() for t in pools[0] + pools[1]])

    run(*ragged_step(pools, [1, 3, 1], [1, 3, 2], [False] * 3), 5)  # groups n 1 (two sequences) and n 3
    run(*ragged_step(pools, [2, 2], [3, 1], [False] * 2), 4)  # one group in order
    groups, verify = ragged_step(pools, [4, 4, 4], [3, 1, 2], [True] * 3)  # all deferred: pools untouched
    run(groups, verify, 12)
    commit(verify, [2, 0, 4])
    seen.append([t.clone() for t in pools[0] + pools[1]])
    padded = StateBatch(*pools, slots=torch.tensor([1, SCRATCH, SCRATCH]), defer=[True] * 3)
    run([uniform_group(3, padded)], padded, 9)  # a fixed-shape verify step, two padding sequences
    commit_on_device(padded, torch.tensor([3, 0, 0]))
    seen.append([t.clone() for t in pools[0] + pools[1]])
    groups, mixed = ragged_step(pools, [2, 2], [2, 3], [True, False])  # only some deferred: gather / scatter
    run(groups, mixed, 4)
    commit(mixed, [1, 0])
    seen.append([t.clone() for t in pools[0] + pools[1]])
    # a prefill: 40 and 21 tokens (one padded group: the chunked form, or the kernel at a run-time length)
    # beside a decode step
    run(*ragged_step(pools, [40, 1, 21], [4, 1, 0], [False] * 3), 62)
    return seen


@child_only
def test_the_layer_and_its_commits_through_the_kernel_equal_the_pytorch_form(monkeypatch):
    """gated_deltanet and recurrent_state with the kernel forced on the CPU (slot-indexed, in place) give the
    PyTorch form's outputs and pools at every step: sequences that are not deferred laid end to end in one
    launch (ragged_group.py; the PyTorch form's groups by count, chunked for long runs), a deferred verify (its
    pools untouched) and its commit, a padded step whose padding shares the scratch slot and its
    commit_on_device, a step with only some sequences deferred.  The scratch slot's rows are not compared."""
    config = ModelConfig.from_dict(HYBRID)
    torch.manual_seed(0)
    layer = GatedDeltaNet(config, state_index=0)
    plain = layer_steps(layer, new_state_pools(config, 6, "cpu", torch.float32))
    calls, ragged_rows = [], []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("slots") is not None)
        return kernel.fused_recurrent(*args, **kwargs)

    def counted_ragged(*args):
        ragged_rows.append(args[0].shape[0])
        return kernel.fused_recurrent_ragged(*args)

    forced = types.SimpleNamespace(supports=kernel.fits, fused_recurrent=counted,  # the interpreter runs CPU tensors
                                   fused_recurrent_ragged=counted_ragged)
    monkeypatch.setattr(model_delta_rule, "_kernel_for", lambda state: forced)
    fused = layer_steps(layer, new_state_pools(config, 6, "cpu", torch.float32))
    assert len(calls) >= 3 and all(calls)  # the deferred steps' groups in place (the kernel's slot mode)
    # every step's sequences that are not deferred ran laid end to end: 5, 4, the mixed step's one of 2, 62 rows
    assert ragged_rows == [5, 4, 2, 62]
    real = torch.arange(6) != SCRATCH
    for got, want in zip(fused, plain):
        if isinstance(got, list):
            for a, b in zip(got, want):
                close(a[real], b[real])
        else:
            close(got, want)
    for seen in (plain, fused):  # each copy of the pools: [conv, ssm]
        before_verify, after_verify, after_commit, after_padded, device_commit = (seen[i] for i in (3, 5, 6, 8, 9))
        assert all(map(torch.equal, after_verify, before_verify))  # deferred: untouched
        assert all(map(torch.equal, after_padded, after_commit))  # the scratch slot too
        assert not torch.equal(after_commit[1], after_verify[1])  # the commit moved the ssm rows
        assert not torch.equal(device_commit[1][1], after_padded[1][1])  # and commit_on_device slot 1's


@child_only
def test_supports_cuda_float32_of_the_kernel_shapes_only():
    case = make_case(2, 3, 2, 3, 24, 40)
    q, k, v, g, beta, state = case
    assert kernel.fits(*case) and kernel.fits(*case, counts=torch.tensor([1, 2]))
    assert not kernel.supports(*case)  # CPU tensors: the PyTorch path
    assert not kernel.fits(q, k, v[:, :, :5], g[:, :, :5], beta[:, :, :5], state[:, :5])  # 5 heads, Hk 2
    assert not kernel.fits(q, k, v, g, beta, state[:1])
    assert not kernel.fits(q, k, v, g, beta, state, counts=torch.tensor([1]))
    assert kernel.fits(*make_case(1, kernel.MAX_TOKENS + 1, 1, 1, 16, 16))  # a prefill's run: any length
    assert not kernel.fits(*make_case(1, 0, 1, 1, 16, 16))
    assert not kernel.fits(*make_case(1, 1, 1, 1, 16, kernel.MAX_HEAD_DIM + 8))
    pool = torch.zeros(5, *state.shape[1:])
    assert kernel.fits(*case[:5], pool, slots=torch.tensor([4, 0])) and not kernel.fits(*case[:5], pool)
    assert not kernel.fits(*case[:5], pool, slots=torch.tensor([4]))
    strided = torch.zeros(5, state.shape[1], state.shape[3], state.shape[2]).transpose(2, 3)  # not contiguous
    assert not kernel.fits(*case[:5], strided, slots=torch.tensor([4, 0]))
    assert not kernel.fits(*case[:5], pool[:, :5], slots=torch.tensor([4, 0]))


@pytest.mark.skipif(CHILD or not HAS_TRITON or not torch.cuda.is_available(), reason="needs a CUDA GPU and triton")
def test_compiled_kernel_on_the_gpu():
    """The compiled kernel (not the interpreter) at the test shapes and the layer's: Qwen3.5-27B at B 512, T 4;
    Dk = Dv = 256 at T 64; head dims 100 and 200.  Outputs, final states and counted states; the slot-indexed
    mode on a pool of B + 2 states, the slots B + 1 down to 2 (reversed and shifted)."""
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
        pool = torch.randn(shape[0] + 2, *state.shape[1:], device="cuda")
        slots = torch.arange(shape[0] + 1, 1, -1, device="cuda")
        before = pool.clone()
        assert compiled.supports(q, k, v, g, beta, pool, counts, slots)
        expected_out = compiled.fused_recurrent(q, k, v, g, beta, pool[slots].clone())[0]
        out = compiled.fused_recurrent(q, k, v, g, beta, pool, slots=slots, store=False)[0]
        close(out, expected_out)
        assert torch.equal(pool, before)
        compiled.fused_recurrent(q, k, v, g, beta, pool, counts, write_outputs=False, slots=slots)
        close(pool[slots], advance(before[slots], grouped(k, v.shape[2]), v, g, beta, counts, shape[1]))
        assert untouched(pool, before, slots)


@parent_only
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("has_slots,store,has_counts,write_out,has_starts",
                         [(False, True, False, True, False), (False, True, True, False, False),
                          (True, True, False, True, False), (True, False, False, True, False),
                          (True, True, True, False, False), (True, True, True, True, True)])
def test_the_kernel_compiles_for_hopper(has_slots, store, has_counts, write_out, has_starts):
    """The interpreter runs the kernel as Python and so accepts code Triton's compiler refuses; compiling it to
    PTX for sm_90 (no GPU needed) checks each mode the engine launches: decode / verify steps in place on the
    pools (store on, or off for a deferred verify), the commit with counts, and the gathered form; the token
    count compiled in (T = 2) or read at run time (T = 0, a prefill's run); ragged runs laid end to end."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.kernels import delta_rule as compiled

    pointers = {name: "*fp32" for name in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "state_ptr", "out_ptr",
                                          "final_ptr")}
    pointers.update(counts_ptr="*i64", slots_ptr="*i64", starts_ptr="*i64", tokens="i32")
    compiled_in = (has_counts or not has_slots) and not has_starts
    constants = dict(T=2 if compiled_in else 0, HK=16, H=48, DK=128, DV=128, DK_PAD=128, BLOCK_V=32,
                     HAS_COUNTS=has_counts, HAS_SLOTS=has_slots, HAS_STARTS=has_starts, STORE=store,
                     WRITE_OUT=write_out)  # the Qwen3.5-27B layer's shape
    source = ASTSource(fn=compiled._recurrent_kernel, signature={**pointers, **{k: "constexpr" for k in constants}},
                       constexprs=constants)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".entry _recurrent_kernel" in ptx and "st.global" in ptx
