"""bench/soak.py in miniature: a few seconds of mixed clients against `specdec serve --speculator remote`, the
drafter killed and restarted, SIGTERM with requests in flight; exit status 0 and every invariant holds.

--fixed-k: every decode step calls the drafter (the outage is felt at once, and the server skips the
step-cost calibration, which takes minutes on a CPU). About 40 s on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--duration-s", "8", "--warmup-s", "2", "--kill-at-s", "2", "--outage-s", "2", "--clients", "3",
         "--prompts", "2", "--max-tokens", "12", "--long-max-tokens", "64", "--server-args=--fixed-k",
         "--startup-timeout-s", "60", "--recovery-timeout-s", "40", "--term-timeout-s", "20"]


def test_short_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), *SHORT, "--workdir", str(tmp_path),
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.exists(), run.stdout + run.stderr
    record = json.loads(out.read_text())
    failed = [name for name, ok in record["invariants"].items() if not ok]
    assert not failed, f"{failed}: {run.stdout[-3000:]}"
    assert run.returncode == 0, run.stdout + run.stderr
    # the run did what it claims: checked greedy replies, invalid requests, an outage with requests served
    assert record["served"]["greedy_checked_equal"] > 0
    assert record["by_kind"]["invalid"].get("ok", 0) > 0
    assert record["drafter_fault"]["valid_requests_during_outage"] > 0
    assert record["sigterm"]["server_exit_status"] == 0 and record["sigterm"]["in_flight_at_sigterm"] > 0
    assert record["kv_cache_usage"]["end"] == 0
