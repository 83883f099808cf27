"""bench/prefill.py: a team-like prefill timed per variant, with the profile of one more run."""

from __future__ import annotations

import json

from bench import prefill


def test_prompt_lengths_are_ragged_and_sum_to_the_tokens_asked():
    lengths = prefill.prompt_lengths(12, 2048)
    assert sum(lengths) == 2048 and len(lengths) == 12
    assert lengths == sorted(lengths) and 2.5 < lengths[-1] / lengths[0] < 3.5


def test_each_variant_prefills_fresh_prompts_in_one_step_and_records_its_costliest_operators(tmp_path):
    out = tmp_path / "prefill.json"
    assert prefill.main(["--device", "cpu", "--target", "ref-hybrid", "--twin", "", "--prompts", "3",
                         "--tokens", "90", "--repeats", "2", "--top", "5", "--variants", "eager,piecewise", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["prompt_lengths"] == prefill.prompt_lengths(3, 90)
    assert [row["variant"] for row in record["rows"]] == ["eager", "piecewise"]
    for row in record["rows"]:
        assert row["steps_per_run"] == [1, 1]  # 90 tokens fit one step's budget
        assert len(row["run_ms"]) == 2 and row["median_ms"] > 0
        assert 0 < len(row["profile"]["top"]) <= 5 and row["profile"]["own_ms"] > 0
    assert prefill.fresh_prompts([4, 5], 1, 100) != prefill.fresh_prompts([4, 5], 2, 100)


def test_with_a_speculator_the_runs_hold_its_observe_and_first_chain(tmp_path):
    out = tmp_path / "prefill.json"
    assert prefill.main(["--device", "cpu", "--target", "ref-hybrid", "--twin", "", "--prompts", "2", "--tokens", "40",
                         "--repeats", "1", "--top", "0", "--variants", "eager", "--max-tokens", "3",
                         "--speculator", "mtp", "--num-draft-tokens", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["speculator"] == "mtp k=2" and record["max_tokens"] == 3
    assert 1 < record["rows"][0]["steps_per_run"][0] <= 3  # the prefill, then verify steps of up to 3 tokens
