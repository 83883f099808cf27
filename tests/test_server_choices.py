"""n choices per prompt: n engine requests of the same prompt, each with its own index and (when seeded)
its own reproducible seed, streaming too; usage counts the prompt once."""

from __future__ import annotations

import collections

import httpx
import pytest

from specdec import SamplingParams
from specdec.server.app import create_app
from specdec.server.choices import choice_seed
from specdec.server.protocol import MAX_N
from tests.test_server import MODEL, ServerThread, tiny_llm, token_ids

SAMPLED = dict(temperature=1.0, seed=1234, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with ServerThread(create_app(tiny_llm(qwen3_dir), MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_choice_seeds_are_reproducible_distinct_and_in_range():
    assert choice_seed(None, 3) is None and choice_seed(7, 0) == 7
    seeds = [choice_seed(s, i) for s in (-5, 0, 1, 2 ** 63 - 1) for i in range(1, MAX_N)]
    assert seeds == [choice_seed(s, i) for s in (-5, 0, 1, 2 ** 63 - 1) for i in range(1, MAX_N)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2 ** 63 for s in seeds)
    assert choice_seed(5, 1) != 6  # not seed + index: (5, n=2) does not repeat (6, n=1)


def test_seeded_n_gives_distinct_reproducible_samples_equal_to_generate(client, llm):
    ids = [5, 9, 14, 3, 22, 8]
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=8, n=4, logprobs=0, **SAMPLED)
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    samples = [token_ids(llm, c.logprobs) for c in out.choices]
    assert len({tuple(s) for s in samples}) == 4
    assert [token_ids(llm, c.logprobs) for c in client.completions.create(**kwargs).choices] == samples
    refs = llm.generate([ids] * 4, [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True,
                                                   seed=choice_seed(1234, i)) for i in range(4)])
    assert [r.token_ids for r in refs] == samples
    one = client.completions.create(**{**kwargs, "n": 1})
    assert token_ids(llm, one.choices[0].logprobs) == samples[0]  # sample 0 is the n=1 answer
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4 * 8
    assert out.usage.total_tokens == len(ids) + 32


def test_several_prompts_times_n_are_indexed_prompt_major(client, llm):
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    greedy = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0,
                                                                       ignore_eos=True))]
    assert [token_ids(llm, c.logprobs) for c in out.choices] == [greedy[0], greedy[0], greedy[1], greedy[1]]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 12


def test_echo_with_n_echoes_every_choice(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, n=3, echo=True, logprobs=0, **SAMPLED)
    assert len(out.choices) == 3 and all(c.text.startswith("abc") for c in out.choices)
    assert all(len(c.logprobs.tokens) == len(out.choices[0].logprobs.tokens) for c in out.choices)


def test_streamed_completions_with_n_carry_each_choice_index(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, n=3, **SAMPLED)
    whole = client.completions.create(**kwargs)
    texts, finished = collections.defaultdict(str), {}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_with_n_streaming_and_not(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, **SAMPLED)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content != whole.choices[1].message.content
    roles, texts = {}, collections.defaultdict(str)
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            texts[c.index] += c.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert dict(texts) == {c.index: c.message.content for c in whole.choices}
    assert whole.usage.completion_tokens == 12


def test_n_beyond_the_limit_is_a_400_naming_the_limit(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "n": MAX_N + 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "n" and f"[1, {MAX_N}]" in error["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "n": MAX_N, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N


def test_the_samples_share_the_prompt_through_the_prefix_cache(server, client):
    before = server.metrics()[("specdec_prefix_cache_hit_tokens_total", ())]
    ids = [3 + i % 90 for i in range(40)]  # 10 blocks of 4, the last one holding the token fed to the first step
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, n=4, **SAMPLED)
    assert len(out.choices) == 4 and out.usage.prompt_tokens == 40
    # samples 1-3 join once sample 0 has computed the prompt: at least 9 blocks of it each from the cache
    assert server.metrics()[("specdec_prefix_cache_hit_tokens_total", ())] - before >= 3 * 36
