"""The fused acceptance kernel (specdec/kernels/accept.py) gives accept_fixed's tokens for the same uniforms, run on
the CPU by Triton's interpreter in a child process (tests/interpreter.py), on tests/test_fixed_accept.py's random
padded steps with the vocabulary split over several chunks and tiles; and it compiles for sm_90."""

from __future__ import annotations

import pytest
import torch

import tests.test_fixed_accept as steps
from specdec.engine.fixed_acceptance import FixedAcceptance
from specdec.sampling import SamplingParams
from tests.interpreter import child_only, kernel_module, parent_only, run_child
from tests.test_eagle3 import head_dir  # noqa: F401 (fixtures)

kernel = kernel_module("specdec.kernels.accept")  # None outside the child


@parent_only
def test_kernel_cases_under_the_interpreter():
    """This file's kernel cases, in a child process started with TRITON_INTERPRET=1."""
    run_child(__file__, min_passed=9, parent_tests=3)  # this test and the two sm_90 compiles


@pytest.fixture
def small_chunks(monkeypatch):
    """Steps without cuts (greedy, T 1, 1.3 and 0.7), a 37-token vocabulary (12 in the draft vocabulary) read in
    chunks of 16 and tiles of 8: three chunks, the last one short, and a tile wholly past the vocabulary."""
    monkeypatch.setattr(steps, "SETTINGS", [SamplingParams(temperature=t) for t in (0.0, 1.0, 1.3, 0.7)])
    monkeypatch.setattr(steps, "VOCAB", 37)
    monkeypatch.setattr(steps, "DRAFT_VOCAB", 12)
    monkeypatch.setattr(kernel, "CHUNK", 16)
    monkeypatch.setattr(kernel, "BLOCK", 8)


def accepted(seqs, batch, q, logits, seed, fused: bool):
    """Each sequence's emitted tokens through FixedAcceptance, with or without the kernel, and its accepted counts;
    the same uniforms either way (seeded generators reset, the global RNG seeded)."""
    steps.reseed(seqs, seed)
    torch.manual_seed(seed)
    acceptance = FixedAcceptance(torch.device("cpu"), capture=False)
    acceptance.fused_kernel = fused
    return acceptance.accept(seqs, batch, q, logits)


@child_only
@pytest.mark.parametrize("mode", ["none", "full", "mapped"])
@pytest.mark.parametrize("seeded", [False, True])
def test_the_kernel_gives_accept_fixeds_tokens(small_chunks, mode, seeded):
    """Greedy and sampled sequences mixed, ragged draft counts (0 included), padding sequences and rows, q over
    the full vocabulary, a mapped draft vocabulary or none: the same tokens.  (Steps with top-k or top-p keep
    accept_fixed.)"""
    cases = rejected = bonus = 0
    for seed in range(8):
        seqs, batch, q, logits = steps.random_step(seed, mode, seeded)
        want = accepted(seqs, batch, q, logits, seed, fused=False)
        assert accepted(seqs, batch, q, logits, seed, fused=True) == want, seed
        cases += 1
        rejected += sum(len(out) - 1 < s.num_drafts for s, out in zip(seqs, want) if not s.request.params.greedy)
        bonus += sum(len(out) - 1 == s.num_drafts for s, out in zip(seqs, want) if not s.request.params.greedy)
    assert cases == 8 and rejected >= 2 and bonus >= 2  # draws from the residual and from p both checked


@child_only
def test_whole_chunks_of_masked_logits_are_left_out(small_chunks):
    """Logits of -inf over whole chunks (ids a model masks, e.g. a padded vocabulary's): their tokens are never
    drawn and the rest is accepted as accept_fixed accepts it (a chunk of -inf must not make its sum NaN)."""
    for seed in range(4):
        seqs, batch, q, logits = steps.random_step(seed, "full", seeded=True)
        logits[:, 21:] = float("-inf")  # chunks [16, 32) from id 21 and [32, 37) wholly
        want = accepted(seqs, batch, q, logits, seed, fused=False)
        got = accepted(seqs, batch, q, logits, seed, fused=True)
        assert got == want and all(t < 21 or t in s.request.draft_token_ids for s, out in zip(seqs, got) for t in out)


@child_only
def test_the_kernel_reads_the_race_uniforms_it_is_given(small_chunks):
    """A control: with other uniforms for the race (the tests' kept), the kernel's last tokens change somewhere,
    so the equality above is not a kernel that ignores its draws."""
    differing = 0
    for seed in range(10):
        seqs, batch, q, logits = steps.random_step(seed, "full", seeded=True, sampled_only=True)
        want = accepted(seqs, batch, q, logits, seed, fused=False)
        acceptance = FixedAcceptance(torch.device("cpu"), capture=False)
        acceptance.fused_kernel = True
        steps.reseed(seqs, seed)
        original = acceptance._fused_body

        def shifted(shape, x, draft_q, any_sampled):
            shape.u_race.copy_(shape.u_race.roll(1, dims=1))  # same values, other tokens' noise
            original(shape, x, draft_q, any_sampled)
        acceptance._fused_body = shifted
        differing += acceptance.accept(seqs, batch, q, logits) != want
    assert differing >= 3


@child_only
def test_an_engine_accepting_through_the_kernel_gives_the_same_replies(qwen3_dir, head_dir):
    """Through the engine (an EAGLE-3 head drafting 2 over its draft vocabulary, fixed acceptance, precaptured
    keys): greedy and seeded T = 1 replies with the kernel are those without it, and served steps went through
    it."""
    from tests.test_engine import prompts

    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)]
    replies, calls = [], []
    for fused in (False, True):
        llm = steps.fa_llm(qwen3_dir, head_dir, "eagle3")
        acceptance = llm.engine.runner.static.acceptance
        acceptance.fused_kernel = fused
        body = acceptance._fused_body
        acceptance._fused_body = lambda *a, _body=body: calls.append(1) or _body(*a)
        llm.engine.precapture_graphs(eager=True)
        replies.append([[o.token_ids for o in llm.generate(prompts(3), p)] for p in params])
    assert replies[0] == replies[1] and len(calls) > 20


@parent_only
@pytest.mark.parametrize("has_q,mapped", [(True, True), (False, False)])
def test_the_kernels_compile_for_hopper(has_q, mapped):
    """The interpreter runs the kernels as Python and so accepts code Triton's compiler refuses: compile each to
    PTX for sm_90 (no GPU needed) with bf16 logits, q = 4, with a mapped draft vocabulary's q and without q."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.kernels import accept as compiled

    shared = dict(logits_ptr="*bf16", stride_row="i32", temperature_ptr="*fp32")
    stats = dict(max_ptr="*fp32", sum_ptr="*fp32")
    inputs = dict(first_ptr="*i64", drafts_ptr="*i64", num_drafts_ptr="*i64", greedy_ptr="*i64", u_test_ptr="*fp32",
                  test_index_ptr="*i64")
    q_side = dict(q_probs_ptr="*fp32", q_rows_ptr="*i64", column_ptr="*i64", q_width="i32")
    partials = dict(res_best_ptr="*fp32", res_at_ptr="*i32", p_best_ptr="*fp32", p_at_ptr="*i32",
                    res_mass_ptr="*fp32", p_mass_ptr="*fp32")
    kernels = {
        "_row_stats_kernel": ({**shared, **stats, "best_ptr": "*fp32", "best_at_ptr": "*i32", "vocab": "i32",
                               "chunks": "i32"}, dict(Q=4, CHUNK=compiled.CHUNK, BLOCK=compiled.BLOCK)),
        "_race_kernel": ({**shared, **inputs, "exp_ptr": "*fp32", "stride_exp": "i32", "race_index_ptr": "*i64",
                          **q_side, **stats, "accepted_ptr": "*i32", **partials, "vocab": "i32", "chunks": "i32"},
                         dict(Q=4, HAS_Q=has_q, MAPPED=mapped, CHUNK=compiled.CHUNK, BLOCK=compiled.BLOCK, C_POW2=32)),
        "_finish_kernel": ({"first_ptr": "*i64", "drafts_ptr": "*i64", "num_drafts_ptr": "*i64", "greedy_ptr": "*i64",
                            "best_ptr": "*fp32", "best_at_ptr": "*i32", "accepted_ptr": "*i32", **partials,
                            "out_ptr": "*i64", "chunks": "i32"}, dict(Q=4, ANY_SAMPLED=True, C_POW2=32, Q_POW2=4)),
    }
    for name, (arguments, constants) in kernels.items():
        fn = getattr(compiled, name)
        assert list(arguments) + list(constants) == fn.arg_names, name  # the signature as the kernel declares it
        signature = {**arguments, **{k: "constexpr" for k in constants}}
        ptx = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert f".entry {name}" in ptx and "st.global" in ptx, name
