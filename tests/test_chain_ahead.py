"""The next step's draft chain launched before the host reads a step's acceptance (Eagle3Speculator.propose_ahead,
issue 21), run on the CPU where every copy is synchronous: the device-side shift of a chain staged as if no
draft was kept, greedy output equal to plain decoding, seeded sampled replies the same with the chain ahead on
and off, the same drafts step by step, and fallbacks (requests finishing, joining) that drop or skip it."""

from __future__ import annotations

import pytest

from specdec import SamplingParams
from tests import test_eagle3, test_mtp
from tests.test_mtp import GREEDY as MTP_GREEDY, mtp_llm
from tests.test_observe_ahead import run_staggered, seeded_params, static_eagle, tokens
from tests.test_qwen3_5_engine import PROMPTS
from tests.test_speculative import GREEDY, mixed_prompts

head_dir, plain, target = test_eagle3.head_dir, test_eagle3.plain, test_mtp.target  # their modules' fixtures


def with_chain_ahead(llm, on: bool = True):
    llm.engine.speculator.chain_ahead = on
    return llm


def chains(llm) -> tuple[int, int]:
    """(chains launched ahead, of those dropped)."""
    stats = llm.engine.speculator.stats
    return stats["head_chains_ahead"], stats["head_chains_ahead_dropped"]


# ---------------------------------------------------------------------------------------------- the shift


SHIFT_CASES = [
    # (start, accepted, k, blocks): block size 4; the verify step fed start .. start + drafts
    (9, 2, 3, [7, 2, 9, 5]),  # positions 10, 11 -> 12, 13: into the table's next block
    (5, 0, 4, [3, 8, 1]),  # nothing kept: as staged
    (14, 3, 2, [6, 4, 11, 10, 12]),  # 15 -> 18: from the last slot of a block to the next one
    (2, 1, 1, [1, 2]),  # k = 1: no forward, only padding rows
    (0, 4, 5, [13, 14, 15]),  # four positions on, three forwards crossing a block boundary
]


def test_the_shifted_chain_is_what_the_host_stages_after_the_commit(qwen3_dir, head_dir):
    """ChainGraphs.shift_staged on chains staged at start + 1 (as if no draft was kept) gives, row for row, the
    positions, context lengths, slots and tables the host stages for the same chains at start + 1 + accepted,
    the chain's first position after the commit (num_tokens - 1), including padding rows and a padding
    sequence."""
    import torch

    from specdec.engine.static_runner import _input_views
    from specdec.transfer import upload

    chain = static_eagle(qwen3_dir, head_dir, 5).engine.speculator.chain_graphs
    depth = max(k for _, _, k, _ in SHIFT_CASES)
    shape = chain.bucket(len(SHIFT_CASES) + 1, depth, max(s + 1 + a for s, a, _, _ in SHIFT_CASES))

    def staged(first_of) -> list[torch.Tensor]:
        rows = [(blocks, first_of(start, a), [0] * (k - 1)) for start, a, k, blocks in SHIFT_CASES]
        chain._stage(rows, depth, shape[0], shape[2])
        return [v.clone() for v in _input_views(chain.inputs, shape[0], depth, chain._columns(shape[2]))]

    want = staged(lambda start, a: start + 1 + a)
    staged(lambda start, a: start + 1)
    shift = upload([a for _, a, _, _ in SHIFT_CASES], chain.device)
    chain.shift_staged(shape, shift, [k - 1 for _, _, k, _ in SHIFT_CASES])
    got = [v.clone() for v in _input_views(chain.inputs, shape[0], depth, chain._columns(shape[2]))]
    for name, g, w in zip(["ids", "positions", "slots", "context lengths", "tables"], got, want):
        assert torch.equal(g, w), name
    # the worked example: positions 12, 13 in block 5 of [7, 2, 9, 5]
    assert got[1].view(shape[0], depth)[0, :2].tolist() == [12, 13]
    assert got[2].view(shape[0], depth)[0, :2].tolist() == [5 * 4 + 0, 5 * 4 + 1]


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_an_eagle3_head_equals_plain(qwen3_dir, head_dir, plain, k):
    llm = static_eagle(qwen3_dir, head_dir, k)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    launched, dropped = chains(llm)
    assert launched > 0 and dropped < launched and llm.engine.metrics()["accepted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_mtp_on_a_hybrid_target_equals_plain(target, k):
    path, expected = target
    llm = mtp_llm(path, k, static_shapes=True)
    assert tokens(llm.generate(PROMPTS, MTP_GREEDY)) == expected
    launched, dropped = chains(llm)
    assert launched > 0 and dropped < launched and llm.engine.metrics()["accepted_tokens"] > 0


def record_drafts(engine) -> list[list[list[int]]]:
    """Per target forward, the drafts each sequence verifies."""
    seen, forward = [], engine.runner.forward

    def spy(seqs, *args, **kwargs):
        seen.append([s.request.draft_token_ids[:s.num_drafts] for s in seqs])
        return forward(seqs, *args, **kwargs)

    engine.runner.forward = spy
    return seen


def test_every_step_verifies_the_drafts_it_would_without_the_chain_ahead(qwen3_dir, head_dir):
    """Two engines stepped in lockstep over the same greedy requests, one launching chains ahead: every step
    verifies the same drafts, and each request keeps as many (a chain shifted to the wrong positions drafts
    from other keys at other rotary positions, and its drafts differ)."""
    ahead, today = (with_chain_ahead(static_eagle(qwen3_dir, head_dir, 4), on).engine for on in (True, False))
    drafts_ahead, drafts_today = record_drafts(ahead), record_drafts(today)
    pairs = [(ahead.add_request(p, GREEDY), today.add_request(p, GREEDY)) for p in mixed_prompts()]
    while ahead.has_work() or today.has_work():
        ahead.step()
        today.step()
        assert drafts_ahead == drafts_today
        for a, b in pairs:
            assert a.output_token_ids == b.output_token_ids
            assert (a.num_drafted, a.num_accepted) == (b.num_drafted, b.num_accepted)
    assert ahead.speculator.stats["head_chains_ahead"] > 5 and today.speculator.stats["head_chains_ahead"] == 0
    assert ahead.metrics()["accepted_tokens"] > 0


# ---------------------------------------------------------------------------------------------- sampled


def staggered_lengths(params: list[SamplingParams], lengths: list[int]) -> list[SamplingParams]:
    """The same settings with other max_tokens, so that requests finish at different steps."""
    return [SamplingParams(max_tokens=n, temperature=p.temperature, top_p=p.top_p, seed=p.seed, ignore_eos=True)
            for p, n in zip(params, lengths)]


def test_seeded_sampled_replies_are_the_same_with_the_chain_ahead_on_and_off(qwen3_dir, head_dir):
    """T = 1 and T = 0.7 with top-p 0.9, seeded, batched, finishing at different steps: the head's seeded draws
    are the same whether a chain ran ahead, was dropped and redrawn, or drafted in propose."""
    prompts = mixed_prompts()
    params = staggered_lengths(seeded_params(len(prompts)), [30, 9, 22, 4, 17, 30])
    runs = []
    for on in (True, False):
        llm = with_chain_ahead(static_eagle(qwen3_dir, head_dir, 3), on)
        runs.append(tokens(llm.generate(prompts, params)))
        assert (chains(llm)[0] > 0) == on
    assert runs[0] == runs[1]


def test_seeded_sampled_mtp_replies_are_the_same_with_the_chain_ahead_on_and_off(target):
    path, _ = target
    params = staggered_lengths(seeded_params(len(PROMPTS)), [24, 6, 15, 11][:len(PROMPTS)])
    runs = []
    for on in (True, False):
        llm = with_chain_ahead(mtp_llm(path, 2, static_shapes=True), on)
        runs.append(tokens(llm.generate(PROMPTS, params)))
        assert (chains(llm)[0] > 0) == on
    assert runs[0] == runs[1]


def test_a_dropped_chain_gives_its_seeded_draws_back(qwen3_dir, head_dir):
    """Every chain launched ahead dropped (the next propose is made to plan otherwise): the seeded replies are
    still those without the chain ahead, so the dropped chains' draws were given back."""
    prompts = mixed_prompts(4)
    params = seeded_params(len(prompts))
    want = tokens(with_chain_ahead(static_eagle(qwen3_dir, head_dir, 3), False).generate(prompts, params))
    llm = static_eagle(qwen3_dir, head_dir, 3)
    llm.engine.speculator._take_ahead = lambda requests, active: False
    assert tokens(llm.generate(prompts, params)) == want
    launched, dropped = chains(llm)
    assert launched > 0 and dropped == launched


# ---------------------------------------------------------------------------------------------- fallbacks


def test_requests_finishing_and_joining_stand_the_chain_ahead_down_and_stay_exact(qwen3_dir, head_dir, plain):
    """Requests finish at different steps (their rows of a chain launched ahead go unused) and half the batch
    joins after three steps (a step with a prefill waiting or joining launches no chain ahead)."""
    llm = static_eagle(qwen3_dir, head_dir, 5)
    lengths = [7, 30, 12, 3, 21, 16]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outputs = run_staggered(llm.engine, mixed_prompts(), params, joining_at=3)
    assert outputs == [p[:n] for p, n in zip(plain, lengths)]
    launched, dropped = chains(llm)
    observed = llm.engine.speculator.stats["head_observed_ahead"]
    assert 0 < launched < observed  # some steps observed ahead launched no chain behind the observe
    assert dropped > 0  # near max_tokens the worst case caps k below what the commit leaves: redrafted


def test_the_mtp_head_falls_back_and_stands_down_the_same_way(target):
    """Staggered joins on a hybrid target with MTP: some steps are observed after the commit, some observed ahead
    launch no chain behind them; greedy output stays exact."""
    path, expected = target
    llm = mtp_llm(path, 2, static_shapes=True)
    lengths = [5, 24, 2, 17]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outputs = run_staggered(llm.engine, PROMPTS, params, joining_at=2)
    assert outputs == [e[:n] for e, n in zip(expected, lengths)]
    observed = llm.engine.speculator.stats["head_observed_ahead"]
    assert 0 < observed < llm.engine.stats["steps"]
    launched, _ = chains(llm)
    assert 0 < launched < observed


def test_the_switch_off_launches_nothing_ahead(qwen3_dir, head_dir, plain):
    llm = with_chain_ahead(static_eagle(qwen3_dir, head_dir, 3), False)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert chains(llm) == (0, 0) and llm.engine.speculator.stats["head_observed_ahead"] > 0


def test_the_host_reads_the_chains_run_ahead_and_seeded_replies_do_not_depend_on_them(qwen3_dir, head_dir, plain):
    """The verify step takes drafts from the host, which reads a chain run ahead in propose; greedy output stays
    exact, and seeded replies are those of chains drafted there."""
    llm = static_eagle(qwen3_dir, head_dir, 3)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    launched, dropped = chains(llm)
    assert launched > dropped >= 0 and launched > 0
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    replies = []
    for ahead in (True, False):
        llm = with_chain_ahead(static_eagle(qwen3_dir, head_dir, 3), ahead)
        replies.append(tokens(llm.generate(mixed_prompts()[:4], params)))
        assert (chains(llm)[0] > 0) == ahead
    assert replies[0] == replies[1]


def test_under_preemption_and_chunked_prefill_greedy_stays_exact(qwen3_dir, head_dir, plain):
    tight = static_eagle(qwen3_dir, head_dir, 4, kv_cache_tokens=160, max_num_batched_tokens=24)
    assert tokens(tight.generate(mixed_prompts(), GREEDY)) == plain
    assert tight.engine.scheduler.num_preemptions > 0
