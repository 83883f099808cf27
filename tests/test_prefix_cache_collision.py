"""A prefix-cache hit needs the block's tokens (and the block before it) to match, not only its hash.

The hash is replaced by one that collides on purpose: it depends on the block's depth in the chain
only, so block i of every prompt hashes alike.  Any hit that trusted the hash would then serve the
first prompt's keys/values to a different second prompt.
"""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.engine import kv_cache
from specdec.engine.kv_cache import BlockManager

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
FIRST = [5, 17, 33, 8, 41, 12, 60, 9, 27, 70, 3, 55, 21]
SECOND = [44, 6, 19, 88, 2, 73, 30, 15, 62, 11, 90, 38, 47]  # same length, no token in common position


def depth_only_hash(parent: int | None, tokens) -> int:
    """Every block at the same depth of its chain hashes alike, whatever its tokens."""
    return hash((parent, len(tokens)))


@pytest.fixture
def colliding_hash(monkeypatch):
    monkeypatch.setattr(kv_cache, "block_hash", depth_only_hash)


def trusting_the_hash(monkeypatch):
    """What a hit would be without the comparison: any block found by hash is taken."""
    monkeypatch.setattr(BlockManager, "holds", lambda self, block, tokens, parent: True)


def test_the_forced_collision_would_serve_the_first_prompts_blocks(colliding_hash, monkeypatch):
    blocks = BlockManager(num_blocks=16, block_size=4)
    first = blocks.allocate(blocks.blocks_for(len(FIRST)))
    blocks.register_full_blocks(FIRST, first, [], len(FIRST))
    with monkeypatch.context() as m:
        trusting_the_hash(m)
        assert blocks.cached_prefix(SECOND)[0] == first[:3]
    assert blocks.cached_prefix(SECOND)[0] == []
    assert blocks.cached_prefix(FIRST)[0] == first[:3]  # the real prefix still hits


@pytest.fixture(scope="module")
def second_alone(qwen3_dir):
    """SECOND generated on an engine that never saw another prompt."""
    return LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=4).generate(SECOND, GREEDY)[0].token_ids


def test_colliding_prompt_is_computed_not_reused_and_generates_as_alone(qwen3_dir, second_alone, colliding_hash):
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=4)
    llm.generate(FIRST, GREEDY)
    out = llm.generate(SECOND, GREEDY)[0]
    assert out.num_cached_prompt_tokens == 0
    assert out.token_ids == second_alone
    again = llm.generate(FIRST, GREEDY)[0]  # the first prompt's own blocks are still served to it
    assert again.num_cached_prompt_tokens == 12


def test_trusting_the_colliding_hash_would_change_the_output(qwen3_dir, second_alone, colliding_hash, monkeypatch):
    """The control: with the comparison off, the second prompt runs on the first's keys/values."""
    trusting_the_hash(monkeypatch)
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=4)
    llm.generate(FIRST, GREEDY)
    out = llm.generate(SECOND, GREEDY)[0]
    assert out.num_cached_prompt_tokens == 12
    assert out.token_ids != second_alone


def test_a_block_computed_behind_a_colliding_block_is_not_registered_behind_it(colliding_hash):
    """SECOND's third block follows tokens unlike FIRST's: it must never be served after FIRST's blocks."""
    blocks = BlockManager(num_blocks=16, block_size=4)
    short_first = FIRST[:9]  # two full blocks
    first = blocks.allocate(3)
    blocks.register_full_blocks(short_first, first, [], len(short_first))
    tail = FIRST[8:12]
    second_tokens = SECOND[:8] + tail + [1]  # block 2 holds FIRST's tokens 8..11, after SECOND's blocks
    second = blocks.allocate(4)
    blocks.register_full_blocks(second_tokens, second, [], 12)
    assert blocks.cached_prefix(FIRST)[0] == first[:2]


def test_a_block_handed_out_again_takes_the_blocks_after_it_out_of_the_cache(colliding_hash):
    """Block ids are reused: a child registered after block b must not follow b's new contents."""
    blocks = BlockManager(num_blocks=4, block_size=4)
    first = blocks.allocate(3)
    blocks.register_full_blocks(FIRST, first, [], 12)
    blocks.release(first[:1])  # only the first block goes back to the free list
    reused = blocks.allocate(2)  # hands out the never-used block 3, then the first prompt's block 0
    assert first[0] in reused
    second_tokens = SECOND[:4] + FIRST[4:]  # block 0 differs, blocks 1 and 2 equal FIRST's
    second_ids = [first[0]]
    blocks.register_full_blocks(second_tokens, second_ids, [], 4)
    assert blocks.cached_prefix(second_tokens)[0] == [first[0]]
