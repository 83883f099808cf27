"""bench/first_use.py: what an engine builds on first use after its start-up, per judge-like phase, counted on
the CPU with the elementwise pieces compiled by dynamo (eager backend) as a GPU compiles them."""

from __future__ import annotations

import json

from bench import first_use
from tests.test_eager_warm_up import compiled_pieces


def test_after_a_full_start_up_nothing_is_built_and_the_record_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(first_use, "PHASES", [("warm-up", 2, 2, 3), ("solo 1", 2, 1, 5), ("team 1", 3, 3, 5)])
    out = tmp_path / "first-use.json"
    with compiled_pieces():  # restores the plain pieces the bench replaces
        assert first_use.main(["--device", "cpu", "--target", "ref-hybrid", "--speculator", "", "--prompts", "3",
                               "--kv-cache-tokens", "1024", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [row["phase"] for row in record["rows"]] == ["start-up", "warm-up", "solo 1", "team 1"]
    assert record["rows"][0]["compiled"] > 0  # the start-up compiled the pieces' variants ...
    assert record["built_after_start_up"] == 0  # ... and the phases built nothing more
    fields = {"phase", "seconds", "compiled", "triton", "cuda_graphs", "acceptance_keys"}
    assert all(set(row) == fields for row in record["rows"])
