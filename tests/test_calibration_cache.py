"""The calibration cache: a second start-up with the same setup reads the tables instead of measuring them."""

from __future__ import annotations

import pytest

from specdec import LLM
from specdec.speculate import SpecConfig, build


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache turned on in a directory of its own; yields the list of measure_tables calls."""
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", "on")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    calls = []
    measure = build.measure_tables
    monkeypatch.setattr(build, "measure_tables", lambda *a: calls.append(1) or measure(*a))
    return calls


def ngram_llm(target_dir, **kw) -> LLM:
    return LLM(target_dir, device="cpu", kv_cache_tokens=1024, block_size=4, max_num_batched_tokens=64,
               speculator=SpecConfig("ngram", num_draft_tokens=4), **kw)


def points(llm: LLM) -> tuple:
    costs = llm.engine.controller.costs
    return (costs.target.tokens, costs.target.seconds,
            {k: (t.tokens, t.seconds) for k, t in sorted(costs.verify.items())})


def test_a_second_start_with_the_same_setup_reads_the_tables(qwen3_dir, cache, tmp_path):
    first = ngram_llm(qwen3_dir)
    assert len(cache) == 1 and len(list((tmp_path / "calibration").glob("*.json"))) == 1
    second = ngram_llm(qwen3_dir)
    assert len(cache) == 1  # not measured again
    assert points(second) == points(first)
    out = second.generate([[5, 6, 7, 5, 6, 7, 5, 6]], None)[0]
    assert len(out.token_ids) > 0


def test_another_engine_shape_is_measured_and_kept_apart(qwen3_dir, cache, tmp_path):
    ngram_llm(qwen3_dir)
    ngram_llm(qwen3_dir, max_num_seqs=8)
    assert len(cache) == 2 and len(list((tmp_path / "calibration").glob("*.json"))) == 2


def test_an_unreadable_cache_file_is_measured_over(qwen3_dir, cache, tmp_path):
    ngram_llm(qwen3_dir)
    (path,) = (tmp_path / "calibration").glob("*.json")
    path.write_text('{"target": {"1": -1.0}, "draft": null, "verify": {}}')  # parses, but no valid table
    llm = ngram_llm(qwen3_dir)
    assert len(cache) == 2 and all(s > 0 for s in llm.engine.controller.costs.target.seconds)
    path.write_text("{ not json")
    ngram_llm(qwen3_dir)
    assert len(cache) == 3
    ngram_llm(qwen3_dir)
    assert len(cache) == 3  # rewritten by the measurement before


def test_turned_off_it_measures_every_time(qwen3_dir, cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", "off")
    ngram_llm(qwen3_dir)
    ngram_llm(qwen3_dir)
    assert len(cache) == 2 and not (tmp_path / "calibration").exists()
