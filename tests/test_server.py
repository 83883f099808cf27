"""The OpenAI-compatible server, through the official `openai` client against a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec import LLM, SamplingParams
from specdec.server.app import create_app

MODEL = "tiny"


class ServerThread:
    """uvicorn serving an app on a free loopback port, in a background thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted labels): value} from /metrics."""
        text = httpx.get(f"{self.url}/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def tiny_llm(qwen3_dir, **kwargs) -> LLM:
    return LLM(qwen3_dir, device="cpu", dtype="float32", kv_cache_tokens=4096, block_size=4, **kwargs)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with ServerThread(create_app(tiny_llm(qwen3_dir), MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def prompt_ids(i: int, length: int = 12) -> list[int]:
    return [2 + (i * 7 + j * 13) % 94 for j in range(length)]


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def token_ids(llm: LLM, logprobs) -> list[int]:
    return [llm.tokenizer.token_to_id(t) for t in logprobs.tokens]


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_equals_generate_token_for_token(client, llm):
    ids = prompt_ids(1)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, logprobs=2, **GREEDY)
    ref = llm.generate(ids, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2))[0]
    choice = out.choices[0]
    assert token_ids(llm, choice.logprobs) == ref.token_ids
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 20
    assert out.usage.total_tokens == len(ids) + 20
    assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset == [sum(len(t) for t in choice.logprobs.tokens[:i]) for i in range(20)]


def test_text_prompts_stop_strings_and_batches(client, llm):
    prompts = ["Hello, world", "def f(x):"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, stop=["e"], **GREEDY)
    refs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=["e"]))
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert [c.finish_reason for c in out.choices] == [r.finish_reason for r in refs]


def test_chat_equals_generate(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    ref = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12


@pytest.mark.parametrize("stop", [None, ["a", "q"]])
def test_completion_stream_equals_non_stream(client, stop):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, stop=stop, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices


def test_chat_stream_equals_non_stream_with_logprobs(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=16, logprobs=True,
                  top_logprobs=3, **GREEDY)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]
    assert len(whole.logprobs.content) == 16 and all(len(e.top_logprobs) == 3 for e in whole.logprobs.content)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in whole.logprobs.content)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo_scores_the_prompt_like_llm_score(client, llm):
    ids = prompt_ids(3, length=40)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(llm.score([ids])[0], abs=1e-4)
    assert token_ids(llm, lp) == ids and out.choices[0].text == llm.tokenizer.decode(ids)
    assert out.usage.completion_tokens == 0
    # echo with generation: prompt then completion, log-probs for both
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, echo=True, logprobs=0, **GREEDY)
    assert out.choices[0].text.startswith("abc") and len(out.choices[0].logprobs.tokens) == 3 + 4


def test_64_concurrent_requests_equal_generate(server, llm):
    greedy = [(prompt_ids(i, 4 + i % 17), dict(temperature=0)) for i in range(48)]
    sampled = [(prompt_ids(i, 9), dict(temperature=0.8, top_p=0.9, seed=i)) for i in range(16)]
    jobs = greedy + sampled

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with aclient:
            return await asyncio.gather(*[
                aclient.completions.create(model=MODEL, prompt=ids, max_tokens=10, logprobs=0, **kw,
                                           extra_body={"ignore_eos": True}) for ids, kw in jobs])

    outs = asyncio.run(run())
    refs = llm.generate([ids for ids, _ in jobs],
                        [SamplingParams(max_tokens=10, ignore_eos=True, **kw) for _, kw in jobs])
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    assert [token_ids(llm, o.choices[0].logprobs) for o in outs] == [r.token_ids for r in refs]


def kv_idle(server) -> bool:
    m = server.metrics()
    return m[("specdec_kv_cache_usage", ())] == 0 and m[("specdec_num_requests_running", ())] == 0


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def slow_engine(server, monkeypatch):
    """Each engine step takes at least 20 ms, so a long request is still running when the client leaves."""
    runner = server.app.state.llm.engine.runner
    forward = runner.forward

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", slow)


def disconnect_mid_stream_frees_kv(server) -> None:
    """A stream its client closes after a few chunks: the request is aborted and its KV blocks freed."""
    aborts = server.metrics()[("specdec_request_aborts_total", ())]
    stream = server.client().completions.create(model=MODEL, prompt=prompt_ids(5), max_tokens=200, stream=True,
                                                **GREEDY)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.metrics()[("specdec_kv_cache_usage", ())] > 0
    stream.close()
    wait_for(lambda: kv_idle(server))
    assert server.metrics()[("specdec_request_aborts_total", ())] == aborts + 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_kv(server, slow_engine):
    disconnect_mid_stream_frees_kv(server)


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server, slow_engine):
    aborts = server.metrics()[("specdec_request_aborts_total", ())]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.3,
                   json={"model": MODEL, "prompt": prompt_ids(6), "max_tokens": 200, "ignore_eos": True})
    wait_for(lambda: kv_idle(server))
    assert server.metrics()[("specdec_request_aborts_total", ())] == aborts + 1


def test_metrics_count_requests_and_tokens(server, client):
    before = server.metrics()
    key = ("specdec_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    client.completions.create(model=MODEL, prompt=prompt_ids(7, 10), max_tokens=5, **GREEDY)
    after = server.metrics()
    assert after[key] == before.get(key, 0) + 1
    assert after[("specdec_prompt_tokens_total", ())] == before[("specdec_prompt_tokens_total", ())] + 10
    assert after[("specdec_generation_tokens_total", ())] == before[("specdec_generation_tokens_total", ())] + 5
    latency = ("specdec_request_latency_seconds_count", (("endpoint", "/v1/completions"),))
    assert after[latency] == before.get(latency, 0) + 1
    assert after[("specdec_peak_memory_bytes", (("kind", "rss"),))] > 0
    assert ("specdec_spec_accepted_per_position_total", (("position", "0"),)) in after
    assert after[("specdec_engine_steps_total", ())] > before[("specdec_engine_steps_total", ())]
    seconds, eager = (after[(f"specdec_engine_{name}_total", ())] - before[(f"specdec_engine_{name}_total", ())]
                      for name in ("step_seconds", "eager_step_seconds"))
    assert 0 < eager <= seconds  # on the CPU every step is eager (no fixed-shape runner)
    assert after[("specdec_engine_eager_steps_total", ())] == after[("specdec_engine_steps_total", ())]


BAD_REQUESTS = [  # (endpoint, body, status, param)
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": [5, 96]}, 400, "prompt"),
    ("completions", {"prompt": [5] * 256}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1.5]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("completions", {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ("completions", {"prompt": "hi", "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": "true"}}, 400, "stream_options"),
    ("completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"}, 400, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 12}, 400,
     "max_completion_tokens"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, endpoint, body, status, param):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_bad_json_huge_body_and_unknown_route(server, client):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    huge = json.dumps({"model": MODEL, "prompt": "x" * (5 << 20)})
    r = httpx.post(f"{server.url}/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/v1/nothing").json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):  # the client raises the documented exception
        client.completions.create(model=MODEL, prompt="hi", temperature=7e3)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_engine_step_failure_fails_its_requests_and_server_keeps_serving(server, client, monkeypatch):
    engine = server.app.state.llm.engine
    step = engine.step
    calls = {"n": 0}

    def broken_once():
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("simulated device fault")
        return step()

    monkeypatch.setattr(engine, "step", broken_once)
    with pytest.raises(openai.InternalServerError, match="simulated device fault"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    events = httpx.post(f"{server.url}/v1/completions",
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}).text
    assert "simulated device fault" in events and events.endswith("data: [DONE]\n\n")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4, **GREEDY).usage.completion_tokens == 4
    wait_for(lambda: kv_idle(server))
    assert server.metrics()[("specdec_engine_step_errors_total", ())] >= 2


def test_api_key(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=256, block_size=4)
    with ServerThread(create_app(llm, MODEL, api_key="sekret")) as srv:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert srv.client(api_key="sekret").completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        assert httpx.get(f"{srv.url}/health").status_code == 200  # health and metrics stay open
        srv.app.state.engine_loop.shutdown()
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer sekret"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_speculation_counters_with_ngram(qwen3_dir, llm):
    from specdec.speculate.config import SpecConfig

    spec_llm = tiny_llm(qwen3_dir, speculator=SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False))
    ids = [5, 6, 7, 8, 9] * 8  # repetitive: n-gram lookup drafts from it
    with ServerThread(create_app(spec_llm, MODEL)) as srv:
        out = srv.client().completions.create(model=MODEL, prompt=ids, max_tokens=24, logprobs=0, **GREEDY)
        m = srv.metrics()
    ref = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert token_ids(llm, out.choices[0].logprobs) == ref.token_ids  # lossless
    assert m[("specdec_spec_draft_tokens_total", ())] > 0 and m[("specdec_spec_drafts_total", ())] > 0
    assert m[("specdec_spec_verify_steps_total", ())] > 0
    assert m[("specdec_spec_accepted_tokens_total", ())] == sum(
        v for (name, _), v in m.items() if name == "specdec_spec_accepted_per_position_total")


def test_a_server_with_overlapped_steps_answers_as_generate_does(qwen3_dir):
    """The server's engine with fixed-shape steps, where overlapped steps are on by default (as on a GPU): many
    concurrent greedy and seeded sampled requests, streamed or not, get the text an engine without overlap gives,
    and the overlapped path was taken."""
    jobs = [(prompt_ids(i, 5 + i % 9), dict(temperature=0)) for i in range(12)]
    jobs += [(prompt_ids(i, 7), dict(temperature=0.9, top_p=0.95, seed=i)) for i in range(12)]
    with ServerThread(create_app(tiny_llm(qwen3_dir, static_shapes=True, max_graph_batch=32), MODEL)) as srv:

        async def run():
            aclient = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)

            async def one(i, ids, kw):
                if i % 3:
                    out = await aclient.completions.create(model=MODEL, prompt=ids, max_tokens=10, **kw,
                                                           extra_body={"ignore_eos": True})
                    return out.choices[0].text
                stream = await aclient.completions.create(model=MODEL, prompt=ids, max_tokens=10, stream=True, **kw,
                                                          extra_body={"ignore_eos": True})
                return "".join([chunk.choices[0].text async for chunk in stream])

            async with aclient:
                return await asyncio.gather(*[one(i, ids, kw) for i, (ids, kw) in enumerate(jobs)])

        texts = asyncio.run(run())
        overlapped = srv.metrics()[("specdec_engine_overlapped_steps_total", ())]
    reference = tiny_llm(qwen3_dir, static_shapes=True, max_graph_batch=32, overlap_steps=False)
    refs = reference.generate([ids for ids, _ in jobs], [SamplingParams(max_tokens=10, ignore_eos=True, **kw)
                                                         for _, kw in jobs])
    assert texts == [r.text for r in refs]
    assert overlapped > 0
