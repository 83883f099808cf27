"""A head's eager forwards as two pieces around attention (speculate/head_piecewise.py), run on the CPU where the
pieces run eagerly on the padded static buffers: the same outputs as the head's own forward at ragged layouts,
the same drafts step by step and greedy output equal to plain decoding, forwards past the widest bucket eager."""

from __future__ import annotations

import torch

from tests import test_eagle3
from tests.test_chain_ahead import record_drafts
from tests.test_eagle3 import eagle_llm
from tests.test_observe_ahead import tokens
from tests.test_speculative import GREEDY, mixed_prompts

head_dir, plain = test_eagle3.head_dir, test_eagle3.plain  # its module's fixtures


def piecewise(llm, max_tokens: int = 512):
    llm.engine.speculator.enable_piecewise(max_tokens)
    return llm


def test_the_pieces_give_the_heads_outputs_at_ragged_layouts(qwen3_dir, head_dir):
    """Two requests fed 5 and 23 positions (28 rows in the 32 bucket) beside random features: the outputs and the
    keys written equal the head's own forward's."""
    llm = eagle_llm(qwen3_dir, head_dir, 3)
    engine, spec = llm.engine, llm.engine.speculator
    reqs = [engine.add_request(p, GREEDY) for p in mixed_prompts(2)]
    engine.step()  # the prompts' blocks
    layout = [(reqs[0].block_ids, 2, 5), (reqs[1].block_ids, 1, 23)]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (28,), generator=gen).tolist()
    states = torch.randn(28, spec.head.config.layer.hidden_size, generator=gen)
    cache = spec.kv.layers[0][0]
    before = cache.clone()  # the prompts' keys, which both forwards attend over
    want, _ = spec._forward(ids, states, layout)
    keys = cache.clone()
    cache.copy_(before)
    piecewise(llm)
    out, logits = spec._forward(ids, states, layout)
    assert logits is None and spec.piecewise.forwards == 1 and spec.piecewise.bucket(28) == 32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    slots = [b * 4 + o for blocks, start, n in layout for b, o in
             ((blocks[p // 4], p % 4) for p in range(start, start + n))]
    assert not torch.equal(before[slots], keys[slots])  # the forward wrote them
    torch.testing.assert_close(cache[slots], keys[slots], atol=1e-5, rtol=1e-5)


def test_greedy_with_piecewise_head_forwards_equals_plain_and_drafts_alike(qwen3_dir, head_dir, plain):
    """Every head forward of an engine without fixed shapes is eager: with the pieces, every step verifies the
    drafts it verifies without them, and the output is plain decoding's."""
    reference = eagle_llm(qwen3_dir, head_dir, 3)
    want = record_drafts(reference.engine)
    assert tokens(reference.generate(mixed_prompts(), GREEDY)) == plain
    llm = piecewise(eagle_llm(qwen3_dir, head_dir, 3))
    seen = record_drafts(llm.engine)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert seen == want and sum(len(d) for step in seen for d in step) > 20
    assert llm.engine.speculator.piecewise.forwards == llm.engine.speculator.stats["head_eager_forwards"] > 20


def test_forwards_past_the_widest_bucket_run_eagerly(qwen3_dir, head_dir, plain):
    llm = piecewise(eagle_llm(qwen3_dir, head_dir, 3), max_tokens=16)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    spec = llm.engine.speculator
    assert spec.piecewise.buckets == [16] and 0 < spec.piecewise.forwards < spec.stats["head_eager_forwards"]
