"""Drafts fed to the verify step from the device (engine/device_drafts.py): where each draft lands in a padded
step, that the fixed-shape runner really takes them from the device (the host holds only placeholders until
the step is queued), and that greedy output still equals plain decoding, with an EAGLE-3 head and with
Qwen3.5's MTP head.  The sampled distribution with device drafts is tests/test_eagle3.py's (static shapes)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.device_drafts import PLACEHOLDER, DeviceDrafts, draft_positions
from specdec.engine.scheduler import ScheduledSeq
from specdec.engine.static_runner import StaticRunner
from tests.test_eagle3 import eagle_llm, head_dir, plain  # noqa: F401 (fixtures)
from tests.test_mtp import GREEDY as MTP_GREEDY, mtp_llm, target  # noqa: F401 (fixture)
from tests.test_qwen3_5_engine import PROMPTS
from tests.test_speculative import GREEDY, mixed_prompts


class _Req:
    def __init__(self, request_id: str):
        self.request_id = request_id


def test_draft_positions_follow_the_worked_example():
    """q = 4: sequence 0 feeds 1 token and no drafts, sequence 1 feeds 1 token and 3 drafts from tokens row 0,
    sequence 2 feeds 2 tokens (a catch-up) and 1 draft from row 1, sequence 3 has drafts but not on the device."""
    seqs = [ScheduledSeq(_Req("a"), 1, 0, samples=True), ScheduledSeq(_Req("b"), 4, 3, samples=True),
            ScheduledSeq(_Req("c"), 3, 1, samples=True), ScheduledSeq(_Req("d"), 3, 2, samples=True)]
    step_rows, token_rows, token_cols = draft_positions(seqs, {"b": 0, "c": 1, "a": 2}, q=4)
    assert step_rows == [5, 6, 7, 10]
    assert token_rows == [0, 0, 0, 1]
    assert token_cols == [0, 1, 2, 0]


def test_the_host_reads_the_drafts_as_drawn_not_what_later_work_writes():
    """The copy to the host is queued with the drafts: what the next chain writes into the graph's static
    buffer afterwards (on a GPU, work queued after them) does not reach what the host reads."""
    tokens = torch.tensor([[5, 6, 7], [8, 9, 0]])
    drafts = DeviceDrafts.queued(tokens, {"a": 0, "b": 1})
    tokens.fill_(-3)  # the buffer's next use
    assert drafts.read() == [[5, 6, 7], [8, 9, 0]]


def test_the_runner_feeds_device_drafts_as_it_feeds_host_drafts(qwen3_dir, head_dir):
    """One verify step of three decoding requests (3, 0 and 2 drafts) run twice through the fixed-shape runner:
    with the drafts' values on the host, and with placeholders on the host and the values in a device tensor
    whose rows are in another order.  Same logits for every row."""
    import torch

    from specdec.engine.device_drafts import DeviceDrafts

    llm = eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in mixed_prompts(3)]
    while any(r.is_prefilling or r.num_computed == 0 for r in reqs):
        engine.step()
    engine.speculator.read_drafts()
    drafts = [[11, 12, 13], [], [21, 22]]
    seqs = [ScheduledSeq(r, 1 + len(d), len(d), samples=True) for r, d in zip(reqs, drafts)]

    def forward(device_drafts=None):
        return [rows.clone() for rows in engine.runner.forward(seqs, drafts=device_drafts)]

    for r, d in zip(reqs, drafts):
        r.draft_token_ids = list(d)
    want = forward()
    tokens = torch.tensor([[21, 22, 0], [11, 12, 13]])  # rows: request 2's chain, then request 0's
    for r, d in zip(reqs, drafts):
        r.draft_token_ids = [PLACEHOLDER] * len(d)
    got = forward(DeviceDrafts(tokens, {reqs[2].request_id: 0, reqs[0].request_id: 1}))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    swapped = torch.tensor([[21, 22, 0], [11, 13, 12]])  # control: two drafts swapped give other logits
    assert not torch.allclose(forward(DeviceDrafts(swapped, {reqs[2].request_id: 0, reqs[0].request_id: 1}))[0],
                              want[0])


def count_device_draft_steps(monkeypatch) -> list[list[int]]:
    """Per fixed-shape step fed drafts from the device: the placeholders the host held when it was staged."""
    seen = []
    run = StaticRunner.run

    def spy(self, seqs, fed_ids=None, drafts=None):
        if drafts is not None:
            seen.append([t for s in seqs for t in s.request.draft_token_ids[:s.num_drafts]])
        return run(self, seqs, fed_ids, drafts)

    monkeypatch.setattr(StaticRunner, "run", spy)
    return seen


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain_with_drafts_fed_from_the_device(qwen3_dir, head_dir, plain, k, monkeypatch):
    seen = count_device_draft_steps(monkeypatch)
    llm = eagle_llm(qwen3_dir, head_dir, k, static_shapes=True, max_graph_batch=8)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert len(seen) > 5 and llm.engine.metrics()["accepted_tokens"] > 0
    assert all(t == PLACEHOLDER for step in seen for t in step)  # the host had not read them yet
    assert llm.engine.speculator.device_drafts is None  # every chain was read once its step was queued


def test_device_drafts_off_reads_every_chain_before_its_step(qwen3_dir, head_dir, plain, monkeypatch):
    """device_drafts=False (--no-device-drafts; the default with CUDA graphs): the host holds
    real drafts when each step is staged, and output still equals plain decoding."""
    seen = count_device_draft_steps(monkeypatch)
    llm = eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8, device_drafts=False)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert seen == [] and llm.engine.metrics()["accepted_tokens"] > 0
    from specdec.cli import build_parser, engine_kwargs

    assert engine_kwargs(build_parser().parse_args(["generate", "m", "--no-device-drafts"]))["device_drafts"] is False


def test_drafts_are_read_first_for_a_step_the_runner_cannot_feed(qwen3_dir, head_dir, plain, monkeypatch):
    """Where the fixed-shape runner does not take the step (an eager step), the host reads the chain before
    the forward: no step gets device drafts, every chain is read, output equals plain decoding."""
    seen = count_device_draft_steps(monkeypatch)
    llm = eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8)
    spec, reads = llm.engine.speculator, []
    read = spec.read_drafts
    spec.read_drafts = lambda: reads.append(spec.device_drafts is not None) or read()
    monkeypatch.setattr(llm.engine.runner, "takes_device_drafts", lambda seqs: False)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert not seen and sum(reads) > 5


def test_a_speculator_left_unread_refuses_an_eager_forward(qwen3_dir, head_dir):
    llm = eagle_llm(qwen3_dir, head_dir, 3, static_shapes=False)
    with pytest.raises(ValueError, match="read them first"):
        llm.engine.runner.forward([], drafts=object())


def test_mtp_greedy_equals_plain_with_drafts_fed_from_the_device(target, monkeypatch):
    """Qwen3.5's MTP head on a hybrid target: the hybrid fixed-shape runner feeds the chain from the device."""
    path, plain_tokens = target
    seen = count_device_draft_steps(monkeypatch)
    llm = mtp_llm(path, 2, static_shapes=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, MTP_GREEDY)] == plain_tokens
    assert len(seen) > 5 and all(t == PLACEHOLDER for step in seen for t in step)
