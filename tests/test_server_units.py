"""Server pieces without a running server: the Prometheus exposition and the served model name."""

from __future__ import annotations

import types

from specdec.server.metrics import ServerMetrics


def render(snapshot: dict) -> str:
    loop = types.SimpleNamespace(snapshot=snapshot, step_errors=0, aborted=0, alive=True,
                                 peak_memory=lambda: {"rss": 1 << 20})
    return ServerMetrics(loop).render().decode()


def test_remote_speculator_counters_appear_only_with_it():
    plain = render({"draft_tokens": 5, "accepted_tokens": 3, "draft_k": 4, "admission_batch": 6})
    assert "specdec_spec_draft_tokens_total 5.0" in plain and "specdec_spec_draft_k 4.0" in plain
    assert "specdec_admission_batch 6.0" in plain
    assert "remote_draft" not in plain
    remote = render({"remote_requests": 10, "remote_failures": 2, "remote_timeouts": 1, "remote_fallbacks": 1,
                     "remote_fallback": True})
    assert "specdec_remote_draft_requests_total 10.0" in remote
    assert "specdec_remote_draft_failures_total 2.0" in remote
    assert "specdec_remote_draft_fallback 1.0" in remote


def test_head_counters_appear_only_with_a_head():
    plain = render({"draft_tokens": 5})
    assert "specdec_head_" not in plain and "draft_forwards" not in plain
    head = render({"draft_forwards": 12, "head_eager_forwards": 1, "head_observed_ahead": 7, "head_chains_ahead": 5,
                   "head_chains_ahead_dropped": 2, "head_observes_without_logits": 3, "head_positions_kept": 40,
                   "head_wakes": 4})
    assert "specdec_spec_draft_forwards_total 12.0" in head
    assert "specdec_head_observed_ahead_total 7.0" in head
    assert "specdec_head_chains_ahead_total 5.0" in head
    assert "specdec_head_chains_ahead_dropped_total 2.0" in head
    assert "specdec_head_observes_without_logits_total 3.0" in head
    assert "specdec_head_positions_kept_total 40.0" in head and "specdec_head_wakes_total 4.0" in head


def test_a_twin_is_served_under_a_name_that_says_so():
    import argparse

    from specdec.server.cli import default_model_name

    assert default_model_name(argparse.Namespace(model="ref-target", twin="qwen3-8b")) == "ref-target as qwen3-8b twin"
    assert default_model_name(argparse.Namespace(model="ref-target", twin=None)) == "ref-target"


def test_streamed_text_decodes_short_windows_and_adds_up_to_the_whole(tmp_path):
    """Streaming decodes a few tokens per update (not the whole output: no quadratic cost), never splits a
    character, and its pieces concatenate to the full decode."""
    from specdec.assets import resolve_model
    from specdec.server.serving import IncrementalText
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model("ref-target"))
    text = "def naïve(x):\n    return x * 2  # größer, 日本語 ✓\n" * 20
    ids = tok.encode(text)
    lengths = []

    def decode(window):
        lengths.append(len(window))
        return tok.decode(window)

    inc = IncrementalText(decode, stop=[])
    pieces = [inc.update([t], False, None) for t in ids]
    pieces.append(inc.update([], True, tok.decode(ids)))
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert max(lengths) <= IncrementalText.CONTEXT + 8  # windows stay short however long the stream
