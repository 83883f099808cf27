"""EAGLE-3 draft trees (--tree-width): greedy output equals plain decoding token for token, sampled output
follows the target's distribution (with a control that fails), and accepted side branches are compacted."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams
from specdec.errors import ConfigError
from specdec.speculate import SpecConfig
import specdec.verify_tree as verify_tree
from tests.stats import chi_square_p
from tests.test_eagle3 import _token2_counts, eagle_llm, head_dir, plain  # noqa: F401 (fixtures)
from tests.test_speculative import GREEDY, _exact_token2_marginal, mixed_prompts
from tests.test_verify_tree import accept_first_child


def tree_llm(target_dir, head, k: int, width: int, **kw):
    llm = eagle_llm(target_dir, head, k, **kw)
    llm.engine.speculator.tree_width = width  # the same head and engine, drafting trees
    if llm.engine.runner.static is not None:
        llm.engine.runner.static.enable_tree_masks()
    return llm


def count_side_paths(llm) -> list[int]:
    """Counts the verify steps whose accepted path left the spine (its keys had to move)."""
    moved = []
    keep_path = llm.engine.runner.keep_path

    def counting(i, seq, start, rows):
        if any(row != j for j, row in enumerate(rows)):
            moved.append(1)
        return keep_path(i, seq, start, rows)

    llm.engine.runner.keep_path = counting
    return moved


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k,width", [(1, 2), (3, 4), (5, 3)])
def test_greedy_equals_plain_with_draft_trees(qwen3_dir, head_dir, plain, k, width, static):
    llm = tree_llm(qwen3_dir, head_dir, k, width, static_shapes=static, max_graph_batch=4)
    moved = count_side_paths(llm)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert llm.engine.metrics()["accepted_tokens"] > 0
    assert moved, "no accepted path left the spine: the compaction was not exercised"


@pytest.mark.parametrize("static", [False, True])
def test_trees_stay_exact_under_preemption_chunking_and_prefix_hits(qwen3_dir, head_dir, plain, static):
    tight = tree_llm(qwen3_dir, head_dir, 3, 3, kv_cache_tokens=192, max_num_batched_tokens=24,
                     static_shapes=static, max_graph_batch=8)
    assert [o.token_ids for o in tight.generate(mixed_prompts(), GREEDY)] == plain
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight.generate(mixed_prompts(), GREEDY)] == plain  # prefix-cache hits
    assert tight.engine.blocks.prefix_hits > 0


def test_trees_with_mixed_sampling_settings_keep_greedy_rows_exact(qwen3_dir, head_dir, plain):
    llm = tree_llm(qwen3_dir, head_dir, 3, 2, static_shapes=True, max_graph_batch=8)
    prompts = mixed_prompts()
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i,
                                                        ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for i, o in enumerate(outs) if i % 2 == 0] == plain[::2]
    assert outs[1].token_ids == llm.generate(prompts[1], params[1])[0].token_ids  # seeded: batch-independent


def propose_from(llm, q: torch.Tensor, width: int) -> None:
    """Make every depth's candidates `width` independent draws from q [V] (a distribution over the target's
    vocabulary near the target's own), so that the random head's trees are accepted often, at the spine and at
    its siblings: the test then has power over both."""
    spec = llm.engine.speculator
    spec.target_ids = None  # q and the candidates are in the target's vocabulary already

    def draw(reqs, states, logits, uniforms, step):
        return torch.multinomial(q.expand(len(reqs), -1), width, replacement=True), [q[None]] * len(reqs)

    spec._draw = draw


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_tree_tokens_follow_the_target_distribution(qwen3_dir, head_dir, broken, monkeypatch):
    """T = 1 through the padded (graph) path with trees of width 3 whose candidates are drawn from a
    distribution near the target's: the second token follows the target's exact marginal; a walk that accepts
    every first child fails the same check."""
    if broken:
        monkeypatch.setattr(verify_tree, "_walk", accept_first_child)
    llm = tree_llm(qwen3_dir, head_dir, 2, 3, max_num_seqs=64, kv_cache_tokens=16384, static_shapes=True,
                   max_graph_batch=64)
    prompt = [5, 17, 30, 2, 9]
    marginal = _exact_token2_marginal(qwen3_dir, prompt)
    propose_from(llm, torch.tensor(0.5 * marginal + 0.5 / len(marginal), dtype=torch.float32), 3)
    moved = count_side_paths(llm)
    counts, outs = _token2_counts(llm, prompt, 4000)
    p = chi_square_p(counts, marginal)
    if broken:
        assert p < 1e-6
    else:
        accepted = sum(o.num_accepted for o in outs)
        assert accepted > 500 and sum(o.num_steps for o in outs) - accepted > 500  # power: both outcomes
        assert len(moved) > 200  # ... and side branches accepted
        assert p > 1e-3


def test_tree_width_is_checked():
    with pytest.raises(ConfigError, match="eagle3"):
        SpecConfig("ngram", tree_width=2)
    with pytest.raises(ConfigError, match="lower either"):
        SpecConfig("eagle3", model="x", num_draft_tokens=8, tree_width=5)
    with pytest.raises(ConfigError, match="tree_width"):
        SpecConfig("eagle3", model="x", tree_width=0)


def test_sampled_trees_of_the_head_itself_follow_the_target(qwen3_dir, head_dir):
    """The head's own sampled trees (spine and siblings drawn from its distribution, mapped through d2t): the
    second token follows the target's exact marginal."""
    llm = tree_llm(qwen3_dir, head_dir, 2, 3, max_num_seqs=64, kv_cache_tokens=16384, static_shapes=True,
                   max_graph_batch=64)
    moved = count_side_paths(llm)
    prompt = [5, 17, 30, 2, 9]
    counts, outs = _token2_counts(llm, prompt, 4000)
    accepted = sum(o.num_accepted for o in outs)
    assert accepted > 300 and len(moved) > 100, (accepted, len(moved))
    assert chi_square_p(counts, _exact_token2_marginal(qwen3_dir, prompt)) > 1e-3
