"""Malformed requests a user found against `specdec serve`: each one a 4xx whose message names the field
and what is allowed, never a 500 (through a real uvicorn server on the tiny model)."""

from __future__ import annotations

import httpx
import pytest

from specdec.server.app import create_app
from tests.test_server import MODEL, ServerThread, tiny_llm

JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with ServerThread(create_app(tiny_llm(qwen3_dir), MODEL)) as srv:
        yield srv


def post(server, endpoint: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint}", content=content, headers=JSON if headers is None else headers)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_a_lone_surrogate_in_a_completion_prompt_is_a_400_naming_the_prompt(server):
    # written as bytes: the JSON escape \ud800 with no low half, as a client may send it
    error = error_of(post(server, "completions", b'{"prompt": "a\\ud800b"}'))
    assert error["param"] == "prompt" and "surrogate" in error["message"] and "U+D800" in error["message"]
    error = error_of(post(server, "completions", b'{"prompt": ["ok", "a\\udfffb"]}'))
    assert error["message"].startswith("prompt[1] ")


def test_a_lone_surrogate_in_a_chat_message_is_a_400_naming_the_message(server):
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    error = error_of(post(server, "chat/completions", body))
    assert error["param"] == "messages" and error["message"].startswith("messages[0].content ")
    # a surrogate pair is one valid character and is served
    ok = post(server, "chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], '
                                          b'"max_tokens": 2}')
    assert ok.status_code == 200, ok.text


def test_a_seed_beyond_int64_is_a_400_with_the_range(server):
    error = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "seed": 2 ** 70}))
    assert error["param"] == "seed" and str(2 ** 63 - 1) in error["message"] and str(2 ** 70) in error["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "seed": 2 ** 63 - 1, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("endpoint,field", [("completions", "max_tokens"), ("chat/completions", "max_tokens"),
                                            ("chat/completions", "max_completion_tokens")])
def test_max_tokens_beyond_the_context_is_a_400_saying_both_numbers(server, endpoint, field):
    body = {"prompt": [5] * 12} if endpoint == "completions" else {"messages": USER}
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={**body, field: 10 ** 12})
    error = error_of(r)
    context = server.app.state.llm.engine.max_model_len
    prompt_tokens = 12 if endpoint == "completions" else int(error["message"].split("prompt's ")[1].split()[0])
    assert error["param"] == field and error["code"] == "context_length_exceeded"
    assert str(10 ** 12) in error["message"] and f"leaves {context - prompt_tokens} " in error["message"]
    # exactly what the context leaves is served
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={**body, field: context - prompt_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == context - prompt_tokens


def test_a_default_max_tokens_is_cut_to_the_context_silently(server):
    context = server.app.state.llm.engine.max_model_len
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5] * (context - 3), "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("field,value", [("stream", "yes"), ("stream", 1), ("echo", "true"), ("ignore_eos", 0),
                                         ("stream_options", {"include_usage": "yes"})])
def test_booleans_are_strict(server, field, value):
    error = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", field: value}))
    assert error["param"] == field and "true or false" in error["message"]


def test_chat_booleans_are_strict(server):
    error = error_of(httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER, "logprobs": "yes"}))
    assert error["param"] == "logprobs" and "true or false" in error["message"]


@pytest.mark.parametrize("endpoint,field", [("completions", "prompt"), ("chat/completions", "messages")])
def test_an_empty_body_names_the_required_field(server, endpoint, field):
    for content in (b"", b"  \n"):
        error = error_of(post(server, endpoint, content))
        assert error["param"] == field and "empty" in error["message"] and field in error["message"]
    error = error_of(post(server, endpoint, b"{}"))
    assert error["message"].startswith(f"{field} is required")


def test_a_text_plain_body_is_a_415_asking_for_json(server):
    r = post(server, "completions", b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    error = error_of(r, 415)
    assert "application/json" in error["message"] and "text/plain" in error["message"]
    assert "dictionary" not in error["message"]
    # no Content-Type at all is read as JSON (as FastAPI does)
    r = post(server, "completions", b'{"prompt": "hi", "max_tokens": 2}', headers={})
    assert r.status_code == 200, r.text


def test_invalid_utf8_says_where(server):
    error = error_of(post(server, "completions", b'{"prompt": "hi\xff"}'))
    assert "UTF-8" in error["message"] and "0xff" in error["message"] and "offset 14" in error["message"]


@pytest.mark.parametrize("content,words", [(b"{not json", "not valid JSON"), (b'{"prompt": NaN}', "NaN"),
                                           (b"[" * 50000, "too deeply"), (b'["hi"]', "JSON object"),
                                           (b'{"prompt": ' + b"9" * 5000 + b"}", "not valid JSON")])
def test_bodies_that_are_not_a_json_object_are_400s(server, content, words):
    assert words in error_of(post(server, "completions", content))["message"]


def test_chat_top_logprobs_out_of_range_names_top_logprobs(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER, "logprobs": True, "top_logprobs": 50})
    error = error_of(r)
    assert error["param"] == "top_logprobs" and error["message"].startswith("top_logprobs must be")
    assert "[0, 20]" in error["message"] and "50" in error["message"]


@pytest.mark.parametrize("endpoint,body,starts", [
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens must be"),
    ("completions", {"prompt": "hi", "stop": 5}, "stop must be a string or a list of strings"),
    ("completions", {"prompt": [1.5]}, "prompt must be a string"),
    ("chat/completions", {"messages": [{"role": "robot"}]}, "messages[0].role must be one of"),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role is required"),
    ("chat/completions", {"messages": "Hi"}, "messages must be a list of messages"),
])
def test_messages_name_the_field_and_what_is_allowed_in_english(server, endpoint, body, starts):
    error = error_of(httpx.post(f"{server.url}/v1/{endpoint}", json=body))
    assert error["message"].startswith(starts), error["message"]
    assert "invalid the" not in error["message"] and "Input should" not in error["message"]


def test_the_server_is_healthy_after_all_of_them(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    statuses = {labels for (name, labels) in server.metrics() if name == "specdec_requests_total"}
    assert not any(dict(labels)["status"].startswith("5") for labels in statuses)
