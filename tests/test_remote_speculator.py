"""The remote speculator keeps greedy output equal to plain decoding whatever its /draft server does."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafting.server import ThreadedServer, create_app, load_drafter
from specdec.speculate import SpecConfig
from tests.checkpoints import save_tiny
from tests.fakes_draft.server import FakeDraftServer, garbage, ok

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def prompts(n: int = 5, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in torch.randint(3, 20, (n,), generator=g).tolist():
        p = torch.randint(2, 96, (length,), generator=g).tolist()
        out.append(p + p[: length // 2])
    return out


@pytest.fixture(scope="module")
def plain(llm):
    return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


def remote_llm(model_dir, url: str, k: int = 4, timeout_s: float = 2.0) -> LLM:
    spec = SpecConfig("remote", url=url, num_draft_tokens=k, adaptive=False, timeout_s=timeout_s)
    return LLM(model_dir, device="cpu", kv_cache_tokens=4096, block_size=4, speculator=spec)


def served(model_dir):
    return ThreadedServer(create_app(load_drafter(str(model_dir), device="cpu", kv_cache_tokens=4096, block_size=4)))


def test_served_drafter_keeps_greedy_output_and_proposes(qwen3_dir, tmp_path, plain):
    drafter_dir = save_tiny(tmp_path, "qwen3", seed=7, num_hidden_layers=1)
    with served(drafter_dir) as server:
        llm = remote_llm(qwen3_dir, server.url)
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == plain
    m = llm.engine.metrics()
    assert m["speculator"] == "remote" and m["draft_tokens"] > 0
    assert m["remote_failures"] == 0 and m["remote_requests"] > 0 and not m["remote_fallback"]


def test_the_target_served_as_its_own_drafter_has_every_draft_accepted(qwen3_dir, plain):
    with served(qwen3_dir) as server:
        llm = remote_llm(qwen3_dir, server.url, k=5)
        outs = llm.generate(prompts(), GREEDY)
    m = llm.engine.metrics()
    assert [o.token_ids for o in outs] == plain
    assert m["draft_tokens"] > 0 and m["accepted_tokens"] == m["draft_tokens"]


@pytest.mark.parametrize("case", ["slow", "garbage", "out of range", "dies mid-run"])
def test_a_bad_server_never_changes_the_output_and_falls_back(qwen3_dir, plain, case):
    behaviours = {"slow": lambda tokens, k: ok([3] * k, delay=1.0), "garbage": garbage,
                  "out of range": lambda tokens, k: ok([96] * k), "dies mid-run": lambda tokens, k: ok([3] * k)}
    with FakeDraftServer(behaviours[case], die_after=6 if case == "dies mid-run" else None) as server:
        llm = remote_llm(qwen3_dir, server.url, timeout_s=0.2)
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == plain
    m = llm.engine.metrics()
    assert m["remote_failures"] > 0 and m["remote_fallbacks"] >= 1
    kind = {"slow": "timeouts", "garbage": "malformed", "out of range": "malformed", "dies mid-run": "errors"}[case]
    assert m[f"remote_{kind}"] > 0
    if case == "dies mid-run":
        assert m["draft_tokens"] > 0  # it drafted while the server lived


def test_sampling_with_a_deterministic_remote_drafter_runs(qwen3_dir):
    with FakeDraftServer(lambda tokens, k: ok([tokens[-1]] * k)) as server:
        llm = remote_llm(qwen3_dir, server.url)
        params = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
        first = [o.token_ids for o in llm.generate(prompts(3), params)]
        assert [o.token_ids for o in llm.generate(prompts(3), params)] == first
    assert all(len(t) == 20 for t in first) and llm.engine.metrics()["draft_tokens"] > 0
