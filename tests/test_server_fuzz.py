"""Property: no request body, however wrong, gets a 5xx, and the server stays healthy (hypothesis).

Bodies are JSON-ish: a valid request with fields overridden by random values (wrong types, huge
integers, odd strings with lone surrogates, NaN), fields left out, unknown fields, and raw bytes under
random content types.  The in-process uvicorn server of tests/test_server.py serves the tiny model."""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.server.app import create_app
from tests.test_server import MODEL, ServerThread, tiny_llm

FUZZ = settings(max_examples=70, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ODD_STRINGS = ["", " ", "\x00", "a\ud800b", "\udfff", "\ud83d\ude00", "日本語", "\u202e", "NaN", "true", "1e999",
               "x" * 300, "<|endoftext|>", "{\"prompt\": 1}", "\n\r\t"]
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(2 ** 80), max_value=2 ** 80), st.sampled_from([0, -1, 1, 2 ** 63, 2 ** 64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(ODD_STRINGS),
)
EDGE_INTS = [0, -1, 1, 255, 256, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 63) - 1, 10 ** 12]
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)
field_values = st.one_of(values, st.sampled_from(EDGE_INTS), st.sampled_from(ODD_STRINGS))  # a field's new value

SHARED = ["model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream",
          "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias", "user"]
COMPLETION = SHARED + ["prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix"]
CHAT = SHARED + ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"]
VALID = {"completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
         "chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}

messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"])},
    optional={"content": st.one_of(values, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"])},
                                                                          optional={"text": values}), max_size=3)),
              "name": values}), max_size=3)
prompts = st.one_of(values, st.lists(st.integers(min_value=-5, max_value=300), max_size=20),
                    st.lists(st.lists(st.integers(min_value=0, max_value=100), max_size=5), max_size=3))


def bodies(endpoint: str) -> st.SearchStrategy[dict]:
    fields = COMPLETION if endpoint == "completions" else CHAT
    special = {"prompt": prompts, "messages": messages}
    overrides = st.dictionaries(st.sampled_from(fields), field_values, min_size=1, max_size=3).flatmap(
        lambda base: st.fixed_dictionaries({k: special.get(k, st.just(v)) for k, v in base.items()}))
    dropped = st.lists(st.sampled_from(list(VALID[endpoint])), max_size=2, unique=True)
    extra = st.dictionaries(st.text(max_size=8), values, max_size=2)
    return st.builds(lambda o, d, e: {k: v for k, v in {**VALID[endpoint], **e, **o}.items() if k not in d},
                     overrides, dropped, extra)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with ServerThread(create_app(tiny_llm(qwen3_dir), MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def assert_no_server_error(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" or r.status_code == 404, error
        assert error["message"]
    else:  # a stream's errors come inside it
        assert "server_error" not in r.text, r.text[:500]


def send(http: httpx.Client, endpoint: str, body: dict) -> httpx.Response:
    content = json.dumps(body)  # ensure_ascii: a lone surrogate travels as its \u escape, NaN as NaN
    return http.post(f"/v1/{endpoint}", content=content, headers={"content-type": "application/json"})


@FUZZ
@given(body=bodies("completions"))
@example(body={"prompt": "a\ud800b"})  # the inputs a user found to be 500s, tried on every run
@example(body={"prompt": "hi", "seed": 2 ** 70})
def test_fuzzed_completion_bodies_never_get_a_5xx(http, body):
    assert_no_server_error(send(http, "completions", body))


@FUZZ
@given(body=bodies("chat/completions"))
@example(body={"messages": [{"role": "user", "content": "a\ud800b"}]})
@example(body={"messages": [{"role": "user", "content": "hi"}], "seed": -(2 ** 63) - 1})
def test_fuzzed_chat_bodies_never_get_a_5xx(http, body):
    assert_no_server_error(send(http, "chat/completions", body))


@settings(FUZZ, max_examples=40)
@given(content=st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"null", b"[]", b'"x"', b"{", b"\xef\xbb\xbf{}"])),
       content_type=st.sampled_from([None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "application/json; charset=utf-8", "multipart/form-data", "application/vnd+json"]),
       endpoint=st.sampled_from(["completions", "chat/completions"]))
def test_raw_bytes_under_any_content_type_never_get_a_5xx(http, content, content_type, endpoint):
    headers = {} if content_type is None else {"content-type": content_type}
    assert_no_server_error(http.post(f"/v1/{endpoint}", content=content, headers=headers))


def test_the_server_is_healthy_after_the_fuzzing(server, http):
    assert http.get("/health").status_code == 200
    for endpoint, body in VALID.items():
        r = send(http, endpoint, body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    counts = collections.Counter()
    for (name, labels), n in server.metrics().items():
        if name == "specdec_requests_total":
            counts[dict(labels)["status"]] += n
    assert not any(status.startswith("5") for status in counts), counts
    assert counts.get("200", 0) > 10 and counts.get("400", 0) > 10, counts  # the fuzz reached both paths
