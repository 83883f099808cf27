"""Drafts never preempt: the scheduler gives drafts only blocks that are held or free, and takes back a
drafter's lookahead blocks before it preempts anyone for a plain token."""

from __future__ import annotations

import torch

from specdec import LLM
from specdec.engine.kv_cache import BlockManager
from specdec.engine.request import Request, Status
from specdec.engine.scheduler import Scheduler
from specdec.sampling import SamplingParams
from specdec.speculate import SpecConfig
from tests.test_speculative import GREEDY, mixed_prompts, plain  # noqa: F401 (fixture)

BLOCK = 4


def decoding(blocks: BlockManager, prompt_len: int, drafts: int) -> Request:
    """A running request that has computed all but its newest token, with `drafts` drafts proposed."""
    req = Request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), torch.device("cpu"))
    req.block_ids = blocks.allocate(blocks.blocks_for(prompt_len))
    req.num_computed = prompt_len - 1
    req.status = Status.RUNNING
    req.draft_token_ids = [7] * drafts
    return req


def test_drafts_take_only_free_blocks_and_never_preempt():
    blocks = BlockManager(num_blocks=5, block_size=BLOCK)
    scheduler = Scheduler(blocks, max_num_batched_tokens=64, max_num_seqs=8)
    old, new = decoding(blocks, 8, drafts=6), decoding(blocks, 8, drafts=6)  # 2 blocks each, 1 block free
    scheduler.running = [old, new]
    seqs = scheduler.schedule()
    assert scheduler.num_preemptions == 0 and [s.request for s in seqs] == [old, new]
    # the oldest's drafts take the free block (positions 8..11: 4 drafts); nothing is left for the newest's
    assert [s.num_drafts for s in seqs] == [4, 0] and [s.num_new for s in seqs] == [5, 1]
    assert blocks.num_free == 0


def test_lookahead_blocks_are_taken_back_before_anyone_is_preempted():
    blocks = BlockManager(num_blocks=6, block_size=BLOCK)
    scheduler = Scheduler(blocks, max_num_batched_tokens=64, max_num_seqs=8)
    drafter = decoding(blocks, 8, drafts=0)
    drafter.block_ids += blocks.allocate(2)  # a head's chain took two blocks for drafts it then did not keep
    full = decoding(blocks, 8, drafts=0)
    full.output_token_ids = [3]  # its newest token opens a third block: it needs one, none is free
    scheduler.running = [full, drafter]
    seqs = scheduler.schedule()
    assert scheduler.num_preemptions == 0 and len(seqs) == 2
    assert len(full.block_ids) == 3 and len(drafter.block_ids) == 2


def preemptions(llm: LLM) -> int:
    outs = llm.generate(mixed_prompts(), GREEDY)
    return llm.engine.scheduler.num_preemptions, [o.token_ids for o in outs]


def test_speculation_adds_no_preemptions_under_a_tight_cache(qwen3_dir, plain):
    tight = dict(device="cpu", kv_cache_tokens=160, block_size=4, max_num_batched_tokens=64)
    plain_preempted, plain_out = preemptions(LLM(qwen3_dir, **tight))
    spec = LLM(qwen3_dir, speculator=SpecConfig("ngram", num_draft_tokens=8, adaptive=False), **tight)
    spec_preempted, spec_out = preemptions(spec)
    assert plain_out == spec_out == plain
    assert spec.engine.metrics()["draft_tokens"] > 0
    assert plain_preempted > 0 and spec_preempted <= plain_preempted


def test_the_controller_counts_the_drafts_the_step_really_verifies(qwen3_dir, plain):
    """Drafts the scheduler cuts (no free block) are not counted in the tokens the controller expects."""
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=160, block_size=4, max_num_batched_tokens=64,
              speculator=SpecConfig("ngram", num_draft_tokens=8, adaptive=False))
    planned, told = [], []
    schedule, drafted = llm.engine.scheduler.schedule, llm.engine.controller.drafted

    def recording_schedule():
        seqs = schedule()
        planned.append({s.request.request_id: s.num_drafts for s in seqs})
        return seqs

    def recording_drafted(ids, counts):
        told.append((planned[-1], dict(zip(ids, counts))))
        return drafted(ids, counts)

    llm.engine.scheduler.schedule, llm.engine.controller.drafted = recording_schedule, recording_drafted
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert told and all(counts[r] == step.get(r, 0) for step, counts in told for r in counts)
    assert any(0 < c < 8 for _, counts in told for c in counts.values())  # some were cut or found short
