"""The server with its engine in a process of its own (create_app(EngineSpec(...)), what `specdec serve` runs):
the same answers as the engine on a thread of the server, and the engine process's failures reported, never
waited on forever."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from specdec.server.app import create_app
from specdec.server.engine_process import EngineSpec, EngineStartError
from tests.test_server import (BAD_REQUESTS, GREEDY, MODEL, ServerThread, disconnect_mid_stream_frees_kv, prompt_ids,
                               tiny_llm, wait_for)

OPTIONS = dict(device="cpu", dtype="float32", kv_cache_tokens=4096, block_size=4)  # as tiny_llm builds it


def process_app(qwen3_dir, **kwargs):
    return create_app(EngineSpec(str(qwen3_dir), {**OPTIONS, **kwargs}), MODEL)


@pytest.fixture(scope="module")
def proc(qwen3_dir):
    with ServerThread(process_app(qwen3_dir)) as srv:
        yield srv


@pytest.fixture(scope="module")
def thread(qwen3_dir):
    with ServerThread(create_app(tiny_llm(qwen3_dir), MODEL)) as srv:
        yield srv


def engine_process(server):
    return server.app.state.engine_loop.transport.process


def test_the_engine_runs_in_a_child_process(proc):
    child = engine_process(proc)
    assert child.is_alive() and psutil.Process(child.pid).ppid() == os.getpid()  # in the server's process tree
    assert httpx.get(f"{proc.url}/health").status_code == 200
    assert proc.app.state.llm is None  # nothing of the model was built in the server process


def test_completions_and_chat_stream_equal_thread_mode(proc, thread):
    def answers(server):
        client = server.client()
        greedy = client.completions.create(model=MODEL, prompt=prompt_ids(1), max_tokens=12, logprobs=2, **GREEDY)
        sampled = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0.9, seed=7,
                                            n=2, stop=["q"])
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=10, logprobs=True,
            top_logprobs=2, stream=True, **GREEDY))
        streamed = ("".join(c.choices[0].delta.content or "" for c in chunks),
                    [(e.token, round(e.logprob, 4)) for c in chunks if c.choices[0].logprobs
                     for e in c.choices[0].logprobs.content], chunks[-1].choices[0].finish_reason)
        g = greedy.choices[0]
        return ((g.text, g.logprobs.tokens, [round(x, 4) for x in g.logprobs.token_logprobs], g.finish_reason),
                [(c.text, c.finish_reason) for c in sampled.choices], streamed)

    assert answers(proc) == answers(thread)


def test_prompt_logprobs_equal_thread_mode(proc, thread):
    def scored(server):
        out = server.client().completions.create(model=MODEL, prompt=prompt_ids(3, length=30), max_tokens=0,
                                                 echo=True, logprobs=1)
        lp = out.choices[0].logprobs
        return lp.tokens, lp.token_logprobs[0], lp.token_logprobs[1:], [sorted(t) if t else t for t in lp.top_logprobs]

    ours, theirs = scored(proc), scored(thread)
    assert ours[0] == theirs[0] and ours[1] is None and ours[3] == theirs[3]
    assert ours[2] == pytest.approx(theirs[2], abs=1e-5)


def test_concurrent_requests_all_finish_as_in_thread_mode(proc, thread):
    async def run(server):
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            outs = await asyncio.gather(*[
                client.completions.create(model=MODEL, prompt=prompt_ids(i, 3 + i), max_tokens=6, **GREEDY)
                for i in range(12)])
        return [(o.choices[0].text, o.choices[0].finish_reason) for o in outs]

    assert asyncio.run(run(proc)) == asyncio.run(run(thread))


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_the_same_errors_as_thread_mode(proc, thread, endpoint, body, status, param):
    ours, theirs = (httpx.post(f"{s.url}/v1/{endpoint}", json={"model": MODEL, **body}) for s in (proc, thread))
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()) and ours.status_code == status


def test_disconnect_mid_stream_aborts_in_the_engine_process(proc):
    disconnect_mid_stream_frees_kv(proc)  # unslowed (a patch cannot reach the engine process): 200 tokens outlast 3
    m = proc.metrics()
    assert m[("specdec_engine_steps_total", ())] > 0 and m[("specdec_peak_memory_bytes", (("kind", "rss"),))] > 0
    assert m[("specdec_engine_alive", ())] == 1


def test_engine_process_killed_fails_requests_and_health(qwen3_dir):
    with ServerThread(process_app(qwen3_dir)) as srv:
        body = {"model": MODEL, "prompt": prompt_ids(2), "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # generating
            os.kill(engine_process(srv).pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["error"]["message"] == "the engine stopped"
        wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503)
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert srv.metrics()[("specdec_engine_alive", ())] == 0


def test_a_model_that_cannot_be_built_fails_startup_naming_it(tmp_path):
    app = create_app(EngineSpec(str(tmp_path / "no-such-model"), OPTIONS), MODEL)

    async def start():
        async with app.router.lifespan_context(app):
            pass

    started = time.monotonic()
    with pytest.raises(EngineStartError, match="failed to build the engine: ModelLoadError: .*no-such-model"):
        asyncio.run(start())
    assert time.monotonic() - started < 120
