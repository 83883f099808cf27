"""bench/seeded_ops.py: the operations a speculative step runs, seeded against unseeded requests."""

from __future__ import annotations

import json

from bench.seeded_ops import main


def test_seeded_requests_draw_their_uniforms_in_calls_of_their_own(tmp_path):
    out = tmp_path / "ops.json"
    assert main(["--batches", "4", "--max-tokens", "6", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["steps_of"], r["seeded"]) for r in rows] == [("plain", False), ("plain", True),
                                                            ("eagle3 k=3", False), ("eagle3 k=3", True)]
    for unseeded, seeded in (rows[:2], rows[2:]):
        assert unseeded["steps"] > 0 < seeded["steps"]
        # today: at most three shared calls a step unseeded (the tests, the race, the head's chain), one or more
        # a request a step seeded (a counter-based draw would bring seeded steps to the unseeded count)
        assert unseeded["aten::rand"] <= 3 < seeded["aten::rand"]
