"""Drafts drawn on the device (engine/device_drafts.py): the host reads them as drawn, and a chain drawn in a
graph (static shapes) gives greedy output equal to plain decoding, with an EAGLE-3 head and with Qwen3.5's MTP
head.  The sampled distribution with chain graphs is tests/test_eagle3.py's (static shapes)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.device_drafts import DeviceDrafts
from tests.test_eagle3 import eagle_llm, head_dir, plain  # noqa: F401 (fixtures)
from tests.test_mtp import GREEDY as MTP_GREEDY, mtp_llm, target  # noqa: F401 (fixture)
from tests.test_qwen3_5_engine import PROMPTS
from tests.test_speculative import GREEDY, mixed_prompts


def test_the_host_reads_the_drafts_as_drawn_not_what_later_work_writes():
    """The copy to the host is queued with the drafts: what the next chain writes into the graph's static
    buffer afterwards (on a GPU, work queued after them) does not reach what the host reads."""
    tokens = torch.tensor([[5, 6, 7], [8, 9, 0]])
    drafts = DeviceDrafts.queued(tokens, {"a": 0, "b": 1})
    tokens.fill_(-3)  # the buffer's next use
    assert drafts.read() == [[5, 6, 7], [8, 9, 0]]


def count_chain_graphs(spec) -> list[int]:
    """Per chain drawn in a chain graph, its batch (a list that fills as the engine runs)."""
    seen, run = [], spec.chain_graphs.run_chain

    def spy(active, *args, **kwargs):
        seen.append(len(active))
        return run(active, *args, **kwargs)

    spec.chain_graphs.run_chain = spy
    return seen


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain_with_chains_drawn_in_graphs(qwen3_dir, head_dir, plain, k):
    llm = eagle_llm(qwen3_dir, head_dir, k, static_shapes=True, max_graph_batch=8)
    seen = count_chain_graphs(llm.engine.speculator)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert len(seen) > 5 and llm.engine.metrics()["accepted_tokens"] > 0


def test_mtp_greedy_equals_plain_with_chains_drawn_in_graphs(target):
    """Qwen3.5's MTP head on a hybrid target, its chains drawn in graphs beside the hybrid fixed-shape runner."""
    path, plain_tokens = target
    llm = mtp_llm(path, 2, static_shapes=True)
    seen = count_chain_graphs(llm.engine.speculator)
    assert [o.token_ids for o in llm.generate(PROMPTS, MTP_GREEDY)] == plain_tokens
    assert len(seen) > 5
