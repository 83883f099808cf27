"""An EAGLE-3 head's draft chain as one graph (speculate/chain_graph.py), run un-captured on the CPU: the same
drafts and q as the step-by-step chain, greedy output equal to plain decoding, and a shorter chain's extra
forwards writing only the scratch block."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams
from specdec.engine.kv_cache import slot_of
from specdec.engine.static_runner import _input_views
from tests.test_eagle3 import eagle_llm, head_dir, plain  # noqa: F401 (fixtures)
from tests.test_speculative import GREEDY, mixed_prompts

NUCLEUS = SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, ignore_eos=True)
TOP_K = SamplingParams(max_tokens=50, temperature=1.0, top_k=5, ignore_eos=True)
HOT = SamplingParams(max_tokens=50, temperature=1.3, ignore_eos=True)
GREEDY_LONG = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)


def seeded(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, seed=seed, ignore_eos=True)


def count_chain_runs(spec) -> list[int]:
    runs = []
    run_chain = spec.chain_graphs.run_chain
    spec.chain_graphs.run_chain = lambda *a, **kw: runs.append(1) or run_chain(*a, **kw)
    return runs


def ready_requests(llm, params: list[SamplingParams]):
    """Requests whose prefill the head has observed: each has a last head output to draft from."""
    engine, spec = llm.engine, llm.engine.speculator
    reqs = [engine.add_request(p, sp) for p, sp in zip(mixed_prompts(len(params)), params)]
    for _ in range(10):
        states = [spec.states.get(r.request_id) for r in reqs]
        if all(s is not None and s.computed == r.num_tokens - 1 for s, r in zip(states, reqs)):
            return reqs
        engine.step()
    raise AssertionError("the head did not observe every prefill")


def propose_once(spec, reqs, ks, step_by_step: bool, seed: int = 7):
    """Each request's drafts and q, and the head's KV after one propose; the cache and the seeded requests'
    streams are put back, so that a second propose starts from the same state and draws the same uniforms."""
    kv = [t.clone() for t in spec.kv.layers[0]]
    generators = [spec._state(r).generator for r in reqs]
    streams = [None if g is None else g.get_state() for g in generators]
    spec.step_by_step = step_by_step
    torch.manual_seed(seed)  # the unseeded rows' uniforms
    try:
        spec.propose(reqs, ks)
    finally:
        spec.step_by_step = False
    drafts = [(list(r.draft_token_ids), r.draft_probs) for r in reqs]
    kv_after = [t.clone() for t in spec.kv.layers[0]]
    for t, saved in zip(spec.kv.layers[0], kv):
        t.copy_(saved)
    for g, state in zip(generators, streams):
        if g is not None:
            g.set_state(state)
    return drafts, kv_after


BATCHES = {
    "mixed": ([GREEDY_LONG, NUCLEUS, TOP_K, seeded(NUCLEUS, 11), HOT, seeded(GREEDY_LONG, 3)], [5, 2, 1, 5, 2, 5]),
    "greedy": ([GREEDY_LONG] * 4, [5, 1, 2, 5]),
    "seeded": ([seeded(NUCLEUS, 1), seeded(TOP_K, 2), seeded(HOT, 3)], [1, 2, 5]),
    "one deep": ([NUCLEUS, TOP_K], [6, 1]),
    "no cuts": ([HOT, seeded(HOT, 4), GREEDY_LONG], [5, 3, 2]),
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_the_chain_graph_drafts_what_the_step_by_step_chain_drafts(qwen3_dir, head_dir, batch):
    """Same uniforms, same drafts; q allclose; the same keys and values written outside the scratch block."""
    params, ks = BATCHES[batch]
    llm = eagle_llm(qwen3_dir, head_dir, 5, static_shapes=True, max_graph_batch=8)
    spec = llm.engine.speculator
    reqs = ready_requests(llm, params)
    runs = count_chain_runs(spec)
    graph, kv_graph = propose_once(spec, reqs, ks, step_by_step=False)
    assert len(runs) == 1
    steps, kv_steps = propose_once(spec, reqs, ks, step_by_step=True)
    assert len(runs) == 1
    for (tokens, q), (want_tokens, want_q), k, p in zip(graph, steps, ks, params):
        assert tokens == want_tokens and len(tokens) == k
        if p.greedy:
            assert q is None and want_q is None
        else:
            assert q.shape == want_q.shape == (k, spec.head.config.draft_vocab_size)
            torch.testing.assert_close(q, want_q, atol=1e-6, rtol=0)
    real = spec.kv.scratch_block * spec.kv.block_size
    for graph_side, steps_side in zip(kv_graph, kv_steps):
        torch.testing.assert_close(graph_side[:real], steps_side[:real], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("batch, cuts", [("mixed", True), ("seeded", True), ("no cuts", False), ("greedy", False)])
def test_a_chain_sorts_only_where_a_row_cuts_by_top_k_or_top_p(qwen3_dir, head_dir, monkeypatch, batch, cuts):
    """The chain graph's draws ask processed_probs_tensors for the top-k / top-p sort only where some row of
    the chain has a cut (the graph is keyed by it), and then for every draw."""
    import specdec.speculate.chain_graph as chain_graph
    asked = []
    real = chain_graph.processed_probs_tensors
    monkeypatch.setattr(chain_graph, "processed_probs_tensors",
                        lambda *a, cuts=True: asked.append(cuts) or real(*a, cuts=cuts))
    params, ks = BATCHES[batch]
    llm = eagle_llm(qwen3_dir, head_dir, 5, static_shapes=True, max_graph_batch=8)
    spec = llm.engine.speculator
    reqs = ready_requests(llm, params)
    asked.clear()
    propose_once(spec, reqs, ks, step_by_step=False)
    assert asked == [cuts] * max(ks)
    shape = spec.chain_graphs.chain_shape(sorted(zip(reqs, ks), key=lambda item: -item[1]))
    assert spec.chain_graphs._graph_key(*shape) == (*shape, cuts)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_equals_plain_with_chain_graphs(qwen3_dir, head_dir, plain, k):
    llm = eagle_llm(qwen3_dir, head_dir, k, static_shapes=True, max_graph_batch=8)
    runs = count_chain_runs(llm.engine.speculator)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert len(runs) > 5 and llm.engine.metrics()["accepted_tokens"] > 0


@pytest.mark.parametrize("step_by_step", [False, True])
def test_a_shorter_chain_writes_no_key_past_its_end(qwen3_dir, head_dir, step_by_step):
    """Chains of 5, 1 and 2 in one batch, each request owning two spare blocks past its newest token: the
    chain writes keys only at positions num_tokens - 1 .. num_tokens + k - 3 of each request (its k - 1
    forwards); every other slot outside the scratch block keeps its value.  The graph's staged slots say so."""
    llm = eagle_llm(qwen3_dir, head_dir, 5, static_shapes=True, max_graph_batch=8)
    spec, blocks = llm.engine.speculator, llm.engine.blocks
    ks = [5, 1, 2]
    reqs = ready_requests(llm, [GREEDY_LONG, NUCLEUS, TOP_K])
    for req in reqs:  # blocks the extra forwards of a short chain would reach, were they not sent to scratch
        req.block_ids.extend(blocks.allocate(2))
    bs = spec.block_size
    written = {slot_of(r.block_ids, p, bs) for r, k in zip(reqs, ks) for p in range(r.num_tokens - 1, r.num_tokens + k - 2)}
    kept = torch.tensor(sorted(set(range(spec.kv.scratch_block * bs)) - written))
    before = [t[kept].clone() for t in spec.kv.layers[0]]
    _, after = propose_once(spec, reqs, ks, step_by_step=step_by_step)
    for t, saved in zip(after, before):
        assert torch.equal(t[kept], saved)
    if not step_by_step:  # rows in the chain's order, longest first: k = 5, 2, 1
        graphs = spec.chain_graphs
        batch, depth, context = graphs.chain_shape(sorted(zip(reqs, ks), key=lambda item: -item[1]))
        slots = _input_views(graphs.inputs, batch, depth, graphs._columns(context))[2].view(batch, depth)
        scratch = slots // bs == spec.kv.scratch_block  # [batch, depth]
        assert scratch.tolist() == [[False] * 4 + [True], [False] + [True] * 4] + [[True] * 5] * 2
