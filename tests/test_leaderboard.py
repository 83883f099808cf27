"""specdec leaderboard: passing records by score, then inconclusive ones, failed ones last, each saying why."""

from __future__ import annotations

import json

from specdec.judge.leaderboard import ranked, write_leaderboard


def record(score: float, reason: str | None = None, verdict: str | None = None) -> dict:
    gates = [{"check": "device memory", "key": "memory", "measured": "1 MiB", "limit": "≤ 2", "ok": reason is None,
              "verdict": "pass" if reason is None else "fail"}]
    return {"ratios": {w: {"passes": [score, score * 1.1, score * 0.9], "ratio": score} for w in ("solo", "team",
                                                                                                 "busy")},
            "specscore": score, "score": 0.0 if reason else score, "reason": reason, "gates": gates,
            "acceptance": {"solo": 2.5, "team": 2.0, "busy": 1.5}, "title": f"m · ngram {score}",
            "verdict": verdict or ("fail" if reason else "pass"), "inconclusive": [], "device": "cpu",
            "commit": "abc1234", "models": {"stock": "m", "candidate": "m"}}


def test_failed_record_ranks_below_passing_ones_and_says_why(tmp_path):
    paths = []
    for name, rec in (("fast-but-failed", record(3.0, reason="gate failed: device memory: too much")),
                      ("slow", record(1.1)), ("fast", record(1.8))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rec))
    entries = write_leaderboard(paths, tmp_path / "board")
    assert [e["name"] for e in entries] == ["fast", "slow", "fast-but-failed"]
    assert entries[2]["verdict"] == "fail" and "device memory: too much" in entries[2]["why"]
    table = (tmp_path / "board" / "leaderboard.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 3 ")]
    assert "fast: m · ngram 1.8" in rows[0] and "FAILED" in rows[1] and "too much" in rows[1]
    assert "2.50 / 2.00 / 1.50" in rows[0] and "abc1234" in rows[0] and "| cpu |" in rows[0]
    page = (tmp_path / "board" / "leaderboard.html").read_text()
    assert "<script" not in page and page.index("fast: m") < page.index("slow: m") < page.index("fast-but-failed")


def test_the_device_column_names_the_gpu_the_run_saw(tmp_path):
    """A judge record names no device itself: the GPUs of its run (provenance), else its engines' --device."""
    on_gpu, on_cpu = record(1.5), record(1.2)
    del on_gpu["device"], on_cpu["device"]
    on_gpu["run"] = {"gpus": ["NVIDIA H100 80GB HBM3"]}
    on_gpu["engines"] = {"stock": {"spec": "specdec serve m --device cuda"}}
    on_cpu["run"] = {"gpus": []}
    on_cpu["engines"] = {"stock": {"spec": "specdec serve m --device cpu"}}
    paths = [tmp_path / "gpu.json", tmp_path / "cpu.json"]
    for path, rec in zip(paths, (on_gpu, on_cpu)):
        path.write_text(json.dumps(rec))
    assert [e["device"] for e in ranked(paths)] == ["NVIDIA H100 80GB HBM3", "cpu"]


def test_the_commit_column_takes_the_runs_commit_where_the_record_has_none(tmp_path):
    rec = record(1.5)
    del rec["commit"]
    rec["run"] = {"commit": "1ea58c7", "gpus": []}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rec))
    assert ranked([path])[0]["commit"] == "1ea58c7"


def test_inconclusive_record_ranks_below_passing_ones_marked(tmp_path):
    unsure = record(2.5, verdict="inconclusive")
    unsure["inconclusive"] = [{"check": "sampled replies' likelihood", "why": "straddles", "power": "±0.8 against ±0.05"}]
    paths = [tmp_path / "unsure.json", tmp_path / "sure.json"]
    paths[0].write_text(json.dumps(unsure))
    paths[1].write_text(json.dumps(record(1.2)))
    entries = ranked(paths)
    assert [e["verdict"] for e in entries] == ["pass", "inconclusive"]
    assert "±0.8 against ±0.05" in entries[1]["why"]


def test_old_records_are_re_judged_from_their_intervals(tmp_path):
    old = record(1.5)
    del old["verdict"]
    old["gates"] = [{"check": "sampled replies' likelihood", "key": "likelihood", "ok": True}]
    old["likelihood"] = {"gap": 0.0, "se": 0.4}  # ±0.78 against ±0.05: it could not tell
    old["limits"] = {"likelihood_bound": 0.05}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert ranked([path])[0]["verdict"] == "inconclusive"
