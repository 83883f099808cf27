"""Acceptance on fixed shapes (specdec/fixed_accept.py, engine/fixed_acceptance.py) gives today's tokens: the
sampler's ragged path (verify.accept_ragged for sampled sequences, greedy_accept for greedy ones) for the same
uniforms, on random padded batches."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specdec.engine.fixed_acceptance import FixedAcceptance
from specdec.engine.sampler import _sample_chains
from specdec.engine.scheduler import ScheduledSeq
from specdec.fixed_accept import accept_fixed, device_q, fixed_q
from specdec.sampling import SamplingParams, processed_probs_rows
from specdec.verify import DraftQ, accept_ragged

SETTINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
            SamplingParams(temperature=1.3, top_k=3)]
VOCAB, DRAFT_VOCAB = 16, 8


def random_step(seed: int, mode: str, seeded: bool, sampled_only: bool = False, device: str = "cpu"):
    """A padded step: (sequences, batch bucket B, q, logits [B q, V]).  mode: "none" (deterministic drafts),
    "full" (q over the target vocabulary) or "mapped" (q over an 8-token draft vocabulary); a few sequences draft
    deterministically beside those with q, some draft nothing, some fed 2 tokens (short prefill, catch-up)."""
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 6, (1,), generator=g))
    batch, q = 1 << (count - 1).bit_length(), int(torch.randint(1, 6, (1,), generator=g))
    logits = torch.randn(batch * q, VOCAB, generator=g) * 2
    vocab_ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB] if mode == "mapped" else None
    seqs, device_ids = [], None if vocab_ids is None else vocab_ids.to(device)  # one draft vocabulary, shared
    for i in range(count):
        fed_before = int(torch.randint(1, 3, (1,), generator=g)) if q > 1 else 1  # committed tokens fed
        n = int(torch.randint(0, q - fed_before + 1, (1,), generator=g))
        settings_ = SETTINGS[int(torch.randint(1 if sampled_only else 0, len(SETTINGS), (1,), generator=g))]
        rows = logits[i * q + fed_before - 1:i * q + fed_before + n]  # [n + 1, V] the sequence's scoring rows
        with_q = mode != "none" and bool(torch.rand(1, generator=g) < 0.75)
        probs = None
        if with_q:
            probs = (torch.randn(n, VOCAB if vocab_ids is None else DRAFT_VOCAB, generator=g) * 2).softmax(-1)
            drafts = torch.multinomial(probs, 1, generator=g).view(-1) if n else torch.zeros(0, dtype=torch.long)
            drafts = drafts if vocab_ids is None else vocab_ids[drafts]
        else:  # the target's argmax or a random token
            best, other = rows[:n].argmax(-1), torch.randint(0, VOCAB, (n,), generator=g)
            drafts = torch.where(torch.rand(n, generator=g) < 0.6, best, other)
        request = types.SimpleNamespace(
            params=settings_, draft_token_ids=drafts.tolist(), draft_probs=None if probs is None else probs.to(device),
            draft_parents=None, draft_vocab=device_ids if with_q else None,
            generator=torch.Generator(device).manual_seed(seed + i) if seeded and not settings_.greedy else None)
        seqs.append(ScheduledSeq(request, fed_before + n, n, True))
    return seqs, batch, q, logits.to(device)


def today(seqs, q, logits):
    """The sampler's ragged path on the sequences' rows."""
    rows = [logits[i * q + s.num_new - 1 - s.num_drafts:i * q + s.num_new] for i, s in enumerate(seqs)]
    return _sample_chains(seqs, rows)


def reseed(seqs, seed):
    for i, s in enumerate(seqs):
        if s.request.generator is not None:
            s.request.generator.manual_seed(seed + i)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), mode=st.sampled_from(["none", "full", "mapped"]), seeded=st.booleans())
@example(seed=3, mode="mapped", seeded=False)
def test_the_fixed_shape_gives_the_ragged_paths_tokens(seed, mode, seeded):
    """Greedy and sampled sequences mixed, ragged draft counts (0 included), padding sequences and rows, the
    settings T 0.7 with top-p 0.9 and top-k, q over the full vocabulary, over a mapped draft vocabulary, or none;
    seeded sequences draw from their generators, the others from the global RNG: same tokens either way."""
    seqs, batch, q, logits = random_step(seed, mode, seeded)
    torch.manual_seed(seed)
    want = today(seqs, q, logits)
    reseed(seqs, seed)
    torch.manual_seed(seed)
    acceptance = FixedAcceptance(torch.device("cpu"), capture=False)
    assert acceptance.accept(seqs, batch, q, logits) == want


def steps_on_one_acceptance(device: str, capture: bool, count: int) -> None:
    """count random steps through one FixedAcceptance (its buffers reused, on a GPU its graphs replayed), each
    checked against the ragged path; the logits sit in one buffer per (B, q), as the static runner's do."""
    acceptance, buffers = FixedAcceptance(torch.device(device), capture=capture), {}
    for seed in range(count):
        mode = ("none", "full", "mapped")[seed % 3]
        seqs, batch, q, logits = random_step(seed % 12, mode, seeded=seed % 2 == 0, device=device)
        torch.manual_seed(seed)
        want = today(seqs, q, logits)
        reseed(seqs, seed % 12)
        torch.manual_seed(seed)
        buffer = buffers.setdefault((batch, q), torch.empty_like(logits))
        assert acceptance.accept(seqs, batch, q, buffer.copy_(logits)) == want, seed
    assert acceptance.steps == count and len(acceptance.shapes) < count  # shapes were used again


def test_one_acceptance_serves_many_steps():
    steps_on_one_acceptance("cpu", capture=False, count=36)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_give_the_ragged_paths_tokens_on_a_gpu():
    steps_on_one_acceptance("cuda", capture=True, count=48)


def test_the_draws_stay_the_ragged_paths_so_seeded_requests_reproduce():
    """After a step the generators and the global RNG stand where the ragged path leaves them."""
    seqs, batch, q, logits = random_step(11, "full", seeded=True)
    torch.manual_seed(0)
    today(seqs, q, logits)
    after = [s.request.generator.get_state() for s in seqs if s.request.generator is not None], torch.rand(3)
    reseed(seqs, 11)
    torch.manual_seed(0)
    FixedAcceptance(torch.device("cpu"), capture=False).accept(seqs, batch, q, logits)
    assert after[0] and all(torch.equal(a, s.request.generator.get_state()) for a, s in
                            zip(after[0], [s for s in seqs if s.request.generator is not None]))
    assert torch.equal(after[1], torch.rand(3))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), mapped=st.booleans())
def test_the_function_on_padded_q_rows_with_a_has_q_flag_per_draft(seed, mapped):
    """accept_fixed with q as padded rows [B, q-1, V_q] and a has-q flag per draft (mixed within a row), every
    row sampled at T = 1 from its own uniforms: equals accept_ragged on the ragged rows with the same draws."""
    g = torch.Generator().manual_seed(seed)
    batch, k = 4, 3
    n = torch.randint(0, k + 1, (batch,), generator=g)
    target = torch.randn(batch, k + 1, VOCAB, generator=g) * 2
    width = DRAFT_VOCAB if mapped else VOCAB
    ids = torch.randperm(VOCAB, generator=g)[:width] if mapped else None
    probs = (torch.randn(batch, k, width, generator=g) * 2).softmax(-1)
    has_q = torch.rand(batch, k, generator=g) < 0.6
    cols = torch.multinomial(probs.view(-1, width), 1, generator=g).view(batch, k)
    drafts = torch.where(has_q, cols if ids is None else ids[cols], target[:, :k].argmax(-1))
    seeds = torch.randint(0, 2**31, (batch,), generator=g).tolist()
    u_test, u_race = torch.zeros(batch, k), torch.zeros(batch, VOCAB)
    for b in range(batch):  # what verify._draw_uniforms draws for a seeded row: n_b tests, then V race uniforms
        u = torch.rand(int(n[b]) + VOCAB, generator=torch.Generator().manual_seed(seeds[b]))
        u_test[b, :n[b]], u_race[b] = u[:n[b]], u[n[b]:]
    real = torch.arange(k) < n.unsqueeze(1)  # [B, k]
    rows = torch.cat([torch.arange(k + 1) < n[b] + 1 for b in range(batch)])
    q_index = torch.where(has_q, torch.arange(batch * k).view(batch, k), -1)[real]
    want = accept_ragged(processed_probs_rows(target.view(-1, VOCAB)[rows], [SamplingParams()] * int(rows.sum())),
                         drafts[real], n.tolist(), DraftQ(probs.view(-1, width), q_index, ids),
                         [torch.Generator().manual_seed(s) for s in seeds])
    ones, zeros = torch.ones(batch), torch.zeros(batch, dtype=torch.long)
    a, tokens = accept_fixed(target, zeros, drafts, n, zeros.bool(), ones, zeros, ones, u_test, u_race,
                             fixed_q(probs, has_q, ids, VOCAB), cuts=False)
    assert torch.equal(a, want.num_accepted)
    assert torch.equal(tokens.gather(1, a.unsqueeze(1)).squeeze(1), want.token)
    assert all(torch.equal(tokens[b, :a[b]], drafts[b, :a[b]]) for b in range(batch))
    assert (tokens[:, 1:] >= 0).sum() == a.sum()  # -1 after the last token


def test_without_cuts_the_sort_free_processing_is_the_cut_one():
    from specdec.sampling import processed_probs_tensors

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.0, 1.0, 0.7, 1.3, 2.0, 0.0])
    off, ones = torch.zeros(6, dtype=torch.long), torch.ones(6)
    torch.testing.assert_close(processed_probs_tensors(logits, t, off, ones, cuts=False),
                               processed_probs_tensors(logits, t, off, ones), atol=1e-6, rtol=0)


def test_trees_and_mixed_draft_vocabularies_take_the_ragged_path():
    from specdec.engine.fixed_acceptance import eligible

    vocab_ids = torch.arange(DRAFT_VOCAB)

    def seq(q_width=None, parents=None):
        request = types.SimpleNamespace(
            params=SETTINGS[1], draft_token_ids=[1, 2], draft_parents=parents, generator=None,
            draft_probs=None if q_width is None else torch.rand(2, q_width).softmax(-1),
            draft_vocab=vocab_ids if q_width == DRAFT_VOCAB else None)
        return ScheduledSeq(request, 3, 2, True)

    assert eligible([seq(), seq(DRAFT_VOCAB), seq(DRAFT_VOCAB)])  # deterministic drafts beside one draft vocabulary
    assert eligible([seq(VOCAB), seq()])
    assert not eligible([seq(), seq(parents=[-1, 0])])  # a tree
    assert not eligible([seq(VOCAB), seq(DRAFT_VOCAB)])  # q over the target vocabulary beside a draft vocabulary


@pytest.mark.parametrize("cuts,any_sampled,with_q", [(True, True, True), (False, True, False), (True, False, True)])
def test_the_function_reads_no_value_on_the_host_and_makes_no_data_dependent_shape(cuts, any_sampled, with_q):
    """What a CUDA graph needs, checked on a CPU: accept_fixed (and device_q's column map) run on fake tensors,
    which hold no values, so neither a host read (.item(), .tolist(), a branch on a value) nor an op whose output
    shape depends on values (boolean-mask indexing, nonzero) can run; such an op does raise there (the control)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    batch, q, long = 4, 3, dict(dtype=torch.long)
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t) for t in (
        torch.randn(batch, q, VOCAB), torch.zeros(batch, **long), torch.zeros(batch, q - 1, **long),
        torch.ones(batch, **long), torch.zeros(batch, dtype=torch.bool), torch.ones(batch), torch.zeros(batch, **long),
        torch.ones(batch), torch.rand(batch, q - 1), torch.rand(batch, VOCAB), torch.rand(batch * (q - 1), DRAFT_VOCAB),
        torch.zeros(batch, q - 1, **long), torch.arange(DRAFT_VOCAB))]
    with mode:
        draft_q = device_q(fake[10], fake[11], fake[12], VOCAB) if with_q else None
        a, tokens = accept_fixed(*fake[:10], draft_q, cuts=cuts, any_sampled=any_sampled)
        assert a.shape == (batch,) and tokens.shape == (batch, q)
        with pytest.raises(DynamicOutputShapeException):
            fake[0][fake[4]]  # a boolean mask: its rows depend on the values


@pytest.mark.parametrize("key_tail", [(True, True, DRAFT_VOCAB, True), (True, False, VOCAB, False),
                                      (False, False, 0, False)])
def test_the_graphs_body_runs_on_fake_tensors_too(key_tail):
    """FixedAcceptance's captured work (the staged inputs' views, the uniforms' gathers, the q rows) likewise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specdec.engine.fixed_acceptance import _Shape

    sampled, cuts, width, mapped = key_tail
    with FakeTensorMode():
        acceptance = FixedAcceptance(torch.device("cpu"), capture=False)
        shape = _Shape(4, 3, torch.randn(4 * 3, VOCAB), width, torch.device("cpu"), acceptance._scratch)
        acceptance.vocab_ids[width] = torch.arange(width)
        acceptance._body(shape, (4, 3, sampled, cuts, width, mapped, None))
        assert shape.out.shape == (4, 4)


# ---------------------------------------------------------------------------------------------- precapture


def precaptured_variant(seqs, q) -> bool:
    """Whether a step's key is one precapture makes (given a q width): greedy only, or sampled without cuts, with q
    rows (at q > 1) or without."""
    sampled = [s for s in seqs if not s.request.params.greedy]
    return not any(s.request.params.top_k > 0 or s.request.params.top_p < 1.0 for s in sampled)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
def test_precaptured_keys_serve_their_steps_without_a_new_key(device):
    """Precapture (padding only, on a GPU captured) makes each (B, q)'s greedy and sort-free sampled keys (with q
    rows, and at q > 1 without them too); steps of those variants then reuse them (on a GPU: replay graphs captured from padding) and give the ragged path's
    tokens, while a step with cuts still makes its key."""
    acceptance = FixedAcceptance(torch.device(device), capture=device == "cuda")
    buffers = {(b, q): torch.zeros(b * q, VOCAB, device=device) for b in (1, 2, 4, 8) for q in range(1, 6)}
    state = torch.get_rng_state()
    made = acceptance.precapture([(b, q, x) for (b, q), x in buffers.items()], DRAFT_VOCAB, mapped=True)
    assert made == len(acceptance.shapes) == sum(2 if q == 1 else 3 for _, q in buffers)
    assert torch.equal(state, torch.get_rng_state())  # no uniform drawn
    assert acceptance.precapture([(b, q, x) for (b, q), x in buffers.items()], DRAFT_VOCAB, mapped=True) == 0
    seen = {True: 0, False: 0}
    for seed in range(40):
        seqs, batch, q, logits = random_step(seed, "mapped", seeded=seed % 2 == 0, device=device)
        torch.manual_seed(seed)
        want = today(seqs, q, logits)
        reseed(seqs, seed)
        torch.manual_seed(seed)
        before, known = len(acceptance.shapes), precaptured_variant(seqs, q)
        assert acceptance.accept(seqs, batch, q, buffers[batch, q].copy_(logits)) == want, seed
        assert (len(acceptance.shapes) == before) or not known, seed
        seen[known] += 1
    assert seen[True] and seen[False] and len(acceptance.shapes) > made  # both kinds of step came


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, qwen3_dir):
    from tests.test_eagle3 import make_head_dir

    return make_head_dir(tmp_path_factory.mktemp("head"), qwen3_dir)


def fa_llm(qwen3_dir, head_dir, spec: str):
    """A CPU engine on the fixed-shape runner (fixed acceptance on): plain decoding or an EAGLE-3 head drafting 2
    over its 64-token draft vocabulary."""
    from specdec import LLM
    from tests.test_eagle3 import eagle_llm

    kw = dict(static_shapes=True, max_graph_batch=4, max_graph_context=256)
    if spec == "eagle3":
        return eagle_llm(qwen3_dir, head_dir, 2, **kw)
    return LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, **kw)


def expected_keys(qs, width: int, mapped: bool) -> set:
    """Greedy, sampled with q rows (at q > 1) and sampled without them, for each (B, q)."""
    return {key for b in (1, 2, 4) for q in qs for key in
            ((b, q, False, False, 0, False, None), (b, q, True, False, width if q > 1 else 0, mapped and q > 1, None),
             (b, q, True, False, 0, False, None))}


FA_GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FA_SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
FA_TOP_P = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)


@pytest.mark.parametrize("spec, qs, width, mapped", [("plain", [1], 0, False), ("eagle3", [1, 2, 3], 64, True)])
def test_engine_precapture_prepares_the_acceptance_and_serving_adds_no_key(qwen3_dir, head_dir, spec, qs, width,
                                                                           mapped):
    """Engine.precapture_graphs (run on a CPU with eager=True) prepares, for each (B, q) the static runner
    precaptured, the greedy key and the sort-free sampled ones, at the speculator's q width (an EAGLE-3 head's
    draft vocabulary, mapped) and without q rows; greedy and seeded sampled serving then add no key, a top-p request still does (lazily);
    and the outputs are those of an engine without precapture."""
    from tests.test_engine import prompts

    llm, lazy = fa_llm(qwen3_dir, head_dir, spec), fa_llm(qwen3_dir, head_dir, spec)
    static = llm.engine.runner.static
    acceptance = static.acceptance
    assert llm.engine.fixed_acceptance and not acceptance.shapes
    count = llm.engine.precapture_graphs(eager=True)
    assert set(acceptance.shapes) == expected_keys(qs, width, mapped)
    assert count == len(static.shapes) + len(acceptance.shapes) == 3 * len(qs) + len(expected_keys(qs, width, mapped))
    for params in (FA_GREEDY, FA_SEEDED):
        want = [o.token_ids for o in lazy.generate(prompts(3), params)]
        assert [o.token_ids for o in llm.generate(prompts(3), params)] == want
        assert set(acceptance.shapes) == expected_keys(qs, width, mapped)
    assert acceptance.steps and lazy.engine.runner.static.acceptance.shapes  # both served on fixed acceptance
    llm.generate(prompts(3), FA_TOP_P)
    assert any(key[3] for key in acceptance.shapes)  # a key with cuts, made at its first step


def test_a_wrong_precaptured_width_shows_when_serving(qwen3_dir, head_dir, monkeypatch):
    """The served sampled steps' key holds the speculator's width: precaptured at another, they make a new one."""
    from tests.test_engine import prompts

    llm = fa_llm(qwen3_dir, head_dir, "eagle3")
    monkeypatch.setattr(llm.engine.speculator, "q_width", lambda: (63, True))
    llm.engine.precapture_graphs(eager=True)
    acceptance = llm.engine.runner.static.acceptance
    before = set(acceptance.shapes)
    llm.generate(prompts(3), FA_GREEDY)
    assert set(acceptance.shapes) == before
    llm.generate(prompts(3), FA_SEEDED)
    assert {key[4] for key in set(acceptance.shapes) - before} == {64}
