"""Server pieces without a running server: the Prometheus exposition and the served model name."""

from __future__ import annotations

import types

from specdec.server.metrics import ServerMetrics


def render(snapshot: dict) -> str:
    engine = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))
    loop = types.SimpleNamespace(snapshot=snapshot, step_errors=0, aborted=0, alive=True, engine=engine)
    return ServerMetrics(loop).render().decode()


def test_remote_speculator_counters_appear_only_with_it():
    plain = render({"draft_tokens": 5, "accepted_tokens": 3, "draft_k": 4})
    assert "specdec_spec_draft_tokens_total 5.0" in plain and "specdec_spec_draft_k 4.0" in plain
    assert "remote_draft" not in plain
    remote = render({"remote_requests": 10, "remote_failures": 2, "remote_timeouts": 1, "remote_fallbacks": 1,
                     "remote_fallback": True})
    assert "specdec_remote_draft_requests_total 10.0" in remote
    assert "specdec_remote_draft_failures_total 2.0" in remote
    assert "specdec_remote_draft_fallback 1.0" in remote


def test_a_twin_is_served_under_a_name_that_says_so():
    import argparse

    from specdec.server.cli import default_model_name

    assert default_model_name(argparse.Namespace(model="ref-target", twin="qwen3-8b")) == "ref-target as qwen3-8b twin"
    assert default_model_name(argparse.Namespace(model="ref-target", twin=None)) == "ref-target"
