"""The remote speculator keeps greedy output equal to plain decoding whatever its /draft server does."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import time
import types

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafting.server import ThreadedServer, create_app, load_drafter
from specdec.engine.request import Request
from specdec.server.metrics import ServerMetrics
from specdec.speculate import SpecConfig
from specdec.speculate.remote import RemoteSpeculator
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


# --------------------------------------------------------------------------
# health: logged once per change, counted by reason, retried after the back-off

LOGGER = "specdec.speculate.remote"
FAILING = {  # reason -> (behaviour, words the warning must carry)
    "timeout": (lambda tokens, k: ok([3] * k, delay=0.5), ["timeout"]),
    "malformed": (lambda tokens, k: (200, b"<html>not json</html>", 0.0), ["malformed reply", "not JSON"]),
    "wrong count": (lambda tokens, k: ok([3] * (k + 1)), ["malformed reply", "more than k"]),
    "status": (lambda tokens, k: (500, b"{}", 0.0), ["error status", "HTTP 500"]),
}


def fake_requests(n: int = 2) -> list[Request]:
    return [Request([5, 6, 7 + i], SamplingParams(max_tokens=8), torch.device("cpu")) for i in range(n)]


def step(spec: RemoteSpeculator, n: int = 2, k: int = 4) -> list[list[int]]:
    """One engine step's propose() for n requests: their drafts."""
    reqs = fake_requests(n)
    spec.propose(reqs, [k] * n)
    return [r.draft_token_ids for r in reqs]


def health_lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class Switch:
    """A /draft behaviour that fails (as `failing` does) until switched on, then drafts [3] * k."""

    def __init__(self, failing=FAILING["malformed"][0]):
        self.on, self.failing = False, failing

    def __call__(self, tokens, k):
        return ok([3] * k) if self.on else self.failing(tokens, k)


def fail_ten_steps(spec: RemoteSpeculator) -> None:
    for _ in range(10):
        assert step(spec) == [[], []]


@pytest.mark.parametrize("case", [*FAILING, "refused"])
def test_a_drafter_failing_ten_times_in_a_row_warns_once_naming_it_and_why(caplog, case):
    caplog.set_level(logging.INFO, logger=LOGGER)
    if case == "refused":
        server, words, reason = None, ["connection refused"], "refused"
        spec = RemoteSpeculator(closed_port_url(), timeout_s=0.2, vocab_size=96, backoff_s=0.0)
    else:
        behaviour, words = FAILING[case]
        server = FakeDraftServer(behaviour).__enter__()
        reason = "malformed" if case == "wrong count" else case
        spec = RemoteSpeculator(server.url, timeout_s=0.1, vocab_size=96, backoff_s=0.0)  # no pause: 10 calls
    try:
        fail_ten_steps(spec)
    finally:
        spec.close()
        if server is not None:
            server.stop()
    warnings = health_lines(caplog, logging.WARNING)
    assert len(warnings) == 1 and spec.url in warnings[0], warnings
    assert all(word in warnings[0] for word in words), warnings[0]
    assert health_lines(caplog, logging.INFO) == []
    m = spec.metrics()
    assert m["remote_failures_by_reason"][reason] == m["remote_failures"] == 20  # 10 steps of 2 requests
    assert m["remote_failing"] and m["remote_recoveries"] == 0


def test_recovery_logs_one_info_line_and_a_new_failure_warns_again(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    switch = Switch()
    with FakeDraftServer(switch) as server:
        spec = RemoteSpeculator(server.url, timeout_s=0.5, vocab_size=96, backoff_s=0.0)
        fail_ten_steps(spec)
        switch.on = True
        for _ in range(3):
            assert step(spec) == [[3] * 4] * 2
        assert health_lines(caplog, logging.INFO) == [f"drafter at {server.url} answering again after 20 failed calls"]
        assert len(health_lines(caplog, logging.WARNING)) == 1
        switch.on = False
        fail_ten_steps(spec)
        spec.close()
    assert len(health_lines(caplog, logging.WARNING)) == 2 and len(health_lines(caplog, logging.INFO)) == 1
    m = spec.metrics()
    assert m["remote_recoveries"] == 1 and m["remote_failing"]
    assert m["remote_failures_by_reason"]["malformed"] == m["remote_failures"] == 40


def test_a_drafter_that_recovers_is_used_again_after_the_back_off():
    switch = Switch()
    with FakeDraftServer(switch) as server:
        spec = RemoteSpeculator(server.url, timeout_s=0.5, vocab_size=96, max_failed_steps=1, backoff_s=0.3)
        assert step(spec) == [[], []] and spec.in_fallback and spec.backoff_s == pytest.approx(0.6)
        switch.on = True
        sent = server.requests
        assert step(spec) == [[], []]  # paused: the server is left alone
        assert server.requests == sent and spec.metrics()["remote_skipped"] == 2
        time.sleep(0.35)
        assert not spec.in_fallback and step(spec) == [[3] * 4] * 2  # asked again, and used
        spec.close()
    m = spec.metrics()
    assert m["remote_fallbacks"] == 1 and m["remote_recoveries"] == 1 and not m["remote_failing"]
    assert spec.backoff_s == pytest.approx(0.3)  # a healthy step resets the back-off


def test_the_health_counters_reach_the_prometheus_exposition():
    spec = RemoteSpeculator(closed_port_url(), timeout_s=0.2, vocab_size=96, backoff_s=0.0)
    step(spec)
    spec.close()
    loop = types.SimpleNamespace(snapshot=spec.metrics(), step_errors=0, aborted=0, alive=True,
                                 peak_memory=lambda: {"rss": 1})
    text = ServerMetrics(loop).render().decode()
    assert 'specdec_remote_draft_failures_by_reason_total{reason="refused"} 2.0' in text
    assert 'specdec_remote_draft_failures_by_reason_total{reason="timeout"} 0.0' in text
    assert "specdec_remote_draft_recoveries_total 0.0" in text


def flapping(period: int = 12):
    """A /draft behaviour that answers `period` requests well, then `period` with garbage, and so on."""
    calls = itertools.count()
    return lambda tokens, k: garbage(tokens, k) if next(calls) // period % 2 else ok([tokens[-1]] * k)


def test_greedy_output_is_plain_while_the_drafter_flaps(qwen3_dir, plain, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with FakeDraftServer(flapping()) as server:
        llm = remote_llm(qwen3_dir, server.url, timeout_s=0.5)
        spec = llm.engine.speculator
        spec.initial_backoff_s = spec.backoff_s = 0.01
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == plain
    m = llm.engine.metrics()
    recoveries = m["remote_recoveries"]
    assert recoveries >= 1 and m["draft_tokens"] > 0 and m["remote_failures_by_reason"]["malformed"] > 0
    assert len(health_lines(caplog, logging.INFO)) == recoveries
    assert len(health_lines(caplog, logging.WARNING)) in (recoveries, recoveries + 1)
