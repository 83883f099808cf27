"""Drafters as services: the /draft server drafts what the drafter itself would, and the verifier's tau
is right on drafters built to known answers."""

from __future__ import annotations

import concurrent.futures
import json
import math

import httpx
import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.drafting.heldout import load_heldout
from specdec.drafting.server import ThreadedServer, create_app, load_drafter
from specdec.drafting.verify import tau_record, walk_conversations
from specdec.drafting.walk import common_prefix_length, walk
from specdec.train.distill import acceptance_walk
from tests.checkpoints import save_tiny
from tests.fakes_draft.server import FakeDraftServer, Oracle, garbage, ok

K = 16


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("drafter"), "qwen3", seed=7, num_hidden_layers=1)


@pytest.fixture(scope="module")
def drafter_plain(drafter_dir):
    """The drafter run by the engine, without any cache shared across calls: the reference drafts."""
    return LLM(drafter_dir, device="cpu", kv_cache_tokens=4096, block_size=4)


def reference_drafts(llm: LLM, contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in ks]
    return [o.token_ids for o in llm.generate(contexts, params)]


def random_contexts(n: int, seed: int, low: int = 3, high: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (int(length),), generator=g).tolist()
            for length in torch.randint(low, high, (n,), generator=g)]


def synthetic_conversations() -> list[dict]:
    """Continuations of lengths around multiples of k + 1 = 17, one empty, one of a single token."""
    g = np.random.default_rng(0)
    lengths = [0, 1, 5, 16, 17, 34, 40, 51, 3]
    return [{"id": f"c{i}", "prompt": g.integers(2, 96, 4 + i).tolist(),
             "continuation": g.integers(2, 96, n).tolist()} for i, n in enumerate(lengths)]


def test_walk_follows_the_specification():
    assert walk(6, lambda pos: 4 if pos == 0 else 0) == (6, 2)  # 5 tokens, then the last one alone
    assert walk(3, lambda pos: 0) == (3, 3)
    assert walk(10, lambda pos: 16, start=4) == (6, 1)  # never past the end
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix_length([], [1]) == 0
    matches = np.array([1, 1, 0, 1, 1, 1, 1, 0, 0], bool)
    assert acceptance_walk(matches, 3) == (9, 4)  # 3 (a=2) + 4 (a=3) + 1 (a=0) + 1 (a=0)


def test_drafts_are_the_drafters_own_greedy_tokens_with_a_small_evicting_cache(drafter_dir, drafter_plain):
    drafter = load_drafter(str(drafter_dir), device="cpu", kv_cache_tokens=160, block_size=4)
    contexts = random_contexts(6, seed=1)
    ks = [1, 3, 16, 7, 16, 2]
    assert drafter.draft(contexts, ks) == reference_drafts(drafter_plain, contexts, ks)
    # the conversations go on: the cached prefix is reused, the drafts stay those of a fresh computation
    grown = [c + d[:2] for c, d in zip(contexts, reference_drafts(drafter_plain, contexts, [2] * 6))]
    hits = drafter.blocks.prefix_hits
    assert drafter.draft(grown, [16] * 6) == reference_drafts(drafter_plain, grown, [16] * 6)
    assert drafter.blocks.prefix_hits > hits
    # new contexts evict the old ones from the 160-token cache, and still draft right
    fresh = random_contexts(6, seed=2)
    assert drafter.draft(fresh, [16] * 6) == reference_drafts(drafter_plain, fresh, [16] * 6)
    assert drafter.blocks.num_free == drafter.blocks.num_blocks  # every block given back after the call


@pytest.fixture(scope="module")
def drafter_server(drafter_dir):
    drafter = load_drafter(str(drafter_dir), device="cpu", kv_cache_tokens=4096, block_size=4)
    with ThreadedServer(create_app(drafter)) as server:
        yield server


def test_server_batches_concurrent_requests_and_refuses_bad_ones(drafter_server, drafter_plain):
    url = drafter_server.url
    contexts = random_contexts(12, seed=3)
    with httpx.Client(trust_env=False) as client, concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert client.get(f"{url}/health").status_code == 200
        answers = list(pool.map(lambda c: client.post(f"{url}/draft", json={"tokens": c, "k": 5}).json()["draft"],
                                contexts))
        assert answers == reference_drafts(drafter_plain, contexts, [5] * 12)
        default = client.post(f"{url}/draft", json={"tokens": contexts[0]}).json()["draft"]
        assert default == reference_drafts(drafter_plain, contexts[:1], [K])[0]
        for bad in ({"tokens": [96]}, {"tokens": [-1]}, {"tokens": []}, {"tokens": [True]}, {"tokens": "12"},
                    {"tokens": [3], "k": -1}, {"tokens": [3], "k": 65}, {"tokens": [3], "k": "4"}, [3]):
            assert client.post(f"{url}/draft", json=bad).status_code == 400, bad
        assert client.post(f"{url}/draft", content=b"{not json").status_code == 400
        metrics = client.get(f"{url}/metrics").json()
        assert client.get(f"{url}/health").status_code == 200
    assert metrics["draft_requests"] == 13 and metrics["draft_batches"] <= 13


def known_answer_run(behaviour, conversations, k=K, concurrency=4, timeout_s=10.0):
    with FakeDraftServer(behaviour) as server:
        return walk_conversations(server.url, conversations, k, concurrency, timeout_s, vocab_size=96)


def test_oracle_drafter_gets_k_plus_one_except_at_conversation_ends():
    conversations = synthetic_conversations()
    run = known_answer_run(Oracle(conversations).right_for(None), conversations)
    for walked, c in zip(run.conversations, conversations):
        n = len(c["continuation"])
        assert (walked.tokens, walked.steps) == (n, math.ceil(n / (K + 1)))
        if n % (K + 1) == 0 and n:
            assert walked.tokens / walked.steps == K + 1
    record = tau_record(run, K)
    lengths = [len(c["continuation"]) for c in conversations]
    assert record["tau"] == round(sum(lengths) / sum(math.ceil(n / (K + 1)) for n in lengths), 4)
    assert record["samples"] == 8 and record["failures"] == 0 and record["draft_tokens"] == K


def test_empty_drafter_gets_one():
    conversations = synthetic_conversations()
    record = tau_record(known_answer_run(lambda tokens, k: ok([]), conversations), K)
    assert record["tau"] == 1.0 and record["tau_macro_over_prompts"] == 1.0 and record["score"] == 0.0
    assert record["failures"] == 0 and record["requests"] == record["steps"]


@pytest.mark.parametrize("j", [0, 3, 7])
def test_drafter_right_for_exactly_j_tokens_gets_j_plus_one(j):
    conversations = synthetic_conversations()
    run = known_answer_run(Oracle(conversations).right_for(j), conversations)
    for walked, c in zip(run.conversations, conversations):
        n = len(c["continuation"])
        assert (walked.tokens, walked.steps) == (n, math.ceil(n / (j + 1)))
    lengths = [len(c["continuation"]) for c in conversations]
    assert tau_record(run, K)["tau"] == round(sum(lengths) / sum(math.ceil(n / (j + 1)) for n in lengths), 4)


def test_failures_count_as_empty_drafts_and_never_crash_the_walk():
    """Right drafts where pos % 4 == 0; an error status, garbage, a timeout or ids out of range elsewhere."""
    conversations = synthetic_conversations()
    oracle = Oracle(conversations)

    def flaky(tokens, k):
        cont, pos = oracle.locate(tokens)
        return [ok(cont[pos:pos + k]), (500, b"boom", 0.0), garbage(tokens, k), ok([], delay=1.0),
                ok([96])][pos % 5]

    run = known_answer_run(flaky, conversations, timeout_s=0.25)
    expected_kinds = {"error": 0, "timeout": 0, "malformed": 0}
    tokens = steps = 0
    for c in conversations:
        n = len(c["continuation"])

        def accepted_at(pos):
            kind = [None, "error", "malformed", "timeout", "malformed"][pos % 5]
            if kind:
                expected_kinds[kind] += 1
            return 0 if kind else min(K, n - pos)

        t, s = walk(n, accepted_at)
        tokens, steps = tokens + t, steps + s
    record = tau_record(run, K)
    assert (record["tokens"], record["steps"]) == (tokens, steps)
    assert record["failure_kinds"] == expected_kinds and record["failures"] == sum(expected_kinds.values()) > 0


@pytest.fixture(scope="module")
def heldout_file(tmp_path_factory, qwen3_dir):
    """A held-out set made by `specdec draft heldout` from text and token-id prompts."""
    path = tmp_path_factory.mktemp("heldout")
    prompts = [{"id": "t0", "prompt": "def add(a, b):"}, {"id": "t1", "prompt": "x = [1, 2, 3]\n"}]
    prompts += [{"id": f"i{i}", "prompt": c} for i, c in enumerate(random_contexts(6, seed=4))]
    (path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = path / "heldout.jsonl"
    assert main(["draft", "heldout", "--target", str(qwen3_dir), "--prompts", str(path / "prompts.jsonl"),
                 "--out", str(out), "--max-tokens", "24", "--device", "cpu", "--kv-cache-tokens", "2048",
                 "--block-size", "4"]) == 0
    return out


def test_heldout_holds_the_engines_greedy_continuations(heldout_file, llm):
    rows = load_heldout(heldout_file)
    assert [r["id"] for r in rows][:3] == ["t0", "t1", "i0"] and len(rows) == 8
    assert rows[0]["prompt"] == llm.encode("def add(a, b):")
    expected = llm.generate([r["prompt"] for r in rows], SamplingParams(max_tokens=24, temperature=0))
    assert [r["continuation"] for r in rows] == [o.token_ids for o in expected]


def test_verify_over_draft_equals_the_teacher_forced_tau(heldout_file, drafter_server, drafter_dir, tmp_path,
                                                         capsys):
    from specdec.train.distill import acceptance_tau, draft_matches, load_model

    out = tmp_path / "record.json"
    assert main(["draft", "verify", "--url", drafter_server.url, "--heldout", str(heldout_file), "--k", "4",
                 "--concurrency", "3", "--vocab-size", "96", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = load_heldout(heldout_file)
    matches = draft_matches(load_model(drafter_dir, "cpu"), [r["prompt"] for r in rows],
                            [r["continuation"] for r in rows])
    assert record["tau"] == round(acceptance_tau(matches, 4), 4)
    assert record["metric"] == "mean_acceptance_length" and record["samples"] == 8 and record["failures"] == 0
    assert record["draft_tokens"] == 4 and record["serving_time_s"] > 0 and 0 <= record["score"] <= 100
    assert record["tokens"] == sum(len(r["continuation"]) for r in rows)
    assert "tau_macro_over_prompts" in capsys.readouterr().out
