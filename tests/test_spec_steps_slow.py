"""bench/spec_steps.py's slow steps: the run's steps past 4x its median, each named by what it was and what
first-use work (torch.compile graphs, Triton compiles, CUDA graph captures) ran in it, so that the GPU call can
say where its 0.2-0.7 s first-use steps come from; and bench/common.py's triton_compiles() that counts the
Triton part."""

from __future__ import annotations

import json
import types

import pytest

from bench.common import triton_compiles
from bench.spec_steps import TimedStep, graphs_held, slow_step_indices, slow_step_line

SLOW_STEP_KEYS = {"index", "ms", "k", "sequences", "fed", "drafts", "eager", "dynamo_compiles", "triton_compiles",
                  "graphs_captured"}


def test_slow_steps_are_those_past_four_medians_slowest_first():
    seconds = [0.010] * 22
    seconds[5], seconds[17] = 0.300, 0.310
    assert slow_step_indices(seconds) == [17, 5]


def test_slow_steps_are_at_most_the_limit_and_none_in_an_even_run():
    seconds = [0.010] * 40 + [0.1 + i / 100 for i in range(10)]
    assert slow_step_indices(seconds) == list(range(49, 41, -1))  # the 8 slowest of 10
    assert slow_step_indices([0.010] * 10) == [] and slow_step_indices([]) == []


def test_a_step_without_a_record_reports_none_for_its_shape():
    """An overlapped step() that only launched a step committed none: its shape's fields are None."""
    step = TimedStep(seconds=0.5, k=0, record=None, dynamo_compiles=0, triton_compiles=2, graphs_captured=1)
    reported = step.as_slow_step(3)
    assert set(reported) == SLOW_STEP_KEYS
    assert reported["fed"] is None and reported["eager"] is None and reported["index"] == 3
    assert "triton+2 dynamo+0 graphs+1" in slow_step_line(reported)


def test_graphs_held_counts_every_runner_and_skips_missing_parts():
    static = types.SimpleNamespace(graphs={(1, 1, 64): ("graph", "out"), (2, 1, 64): ("graph", "out")},
                                   acceptance=types.SimpleNamespace(shapes={
                                       "captured": types.SimpleNamespace(graph="graph"),
                                       "eager": types.SimpleNamespace(graph=None)}))
    piecewise = types.SimpleNamespace(graphs={16: ["g1", "g2", "g3"]})
    head = types.SimpleNamespace(graphs={(1, 4, 64): ("graph", "out")})
    engine = types.SimpleNamespace(runner=types.SimpleNamespace(static=static, piecewise=piecewise),
                                   speculator=types.SimpleNamespace(graphs=head, chain_graphs=None))
    assert graphs_held(engine) == 2 + 1 + 3 + 1
    bare = types.SimpleNamespace(runner=types.SimpleNamespace(), speculator=None)
    assert graphs_held(bare) == 0


def test_triton_compiles_is_a_count_that_never_raises():
    assert isinstance(triton_compiles(), int) and triton_compiles() >= 0


def test_triton_compiles_reads_each_devices_kernel_cache(monkeypatch):
    """Triton 3.x's layout: device_caches, device -> (kernel cache, key cache, target, backend, binder)."""
    pytest.importorskip("triton")
    from specdec.kernels import paged_attention

    before = triton_compiles()
    caches = {0: ({"a": object(), "b": object()}, {}, None, None, None), 1: ({"c": object()}, {}, None, None, None)}
    monkeypatch.setattr(paged_attention._merge_kernel, "device_caches", caches)
    assert triton_compiles() == before + 3


def test_the_dry_run_reports_slow_steps_for_every_row(tmp_path, capsys):
    """spec_steps.py's CPU dry run (the bundled ref-target, no twins): every row has its slow_steps, with the
    documented keys, and first_use_ms; a line per slow step is printed."""
    from bench.spec_steps import main

    out = tmp_path / "spec-steps.json"
    assert main(["--device", "cpu", "--target-twin", "", "--draft-twin", "", "--prompts", "2", "--tokens", "8",
                 "--configs", "plain,draft-k4,plain-overlap,draft-k0", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["config"] for row in rows] == ["plain", "draft-k4", "plain-overlap", "draft-k0"]
    assert set(rows[3]["by_k"]) == {"0"}  # a silenced speculator's steps all ran at k = 0
    printed = capsys.readouterr().out
    for row in rows:
        assert isinstance(row["slow_steps"], list) and len(row["slow_steps"]) <= 8
        assert isinstance(row["first_use_ms"], float) and row["first_use_ms"] >= 0.0
        assert "by_k" in row and "catch_up" in row  # the fields other tools read stay
        steps = sum(k["steps"] for k in row["by_k"].values())
        for step in row["slow_steps"]:
            assert set(step) == SLOW_STEP_KEYS and 0 <= step["index"] < steps
            assert step["ms"] > 0 and step["k"] in {int(k) for k in row["by_k"]}
            assert f"{row['config']}: slow step #{step['index']}:" in printed
        assert [s["ms"] for s in row["slow_steps"]] == sorted((s["ms"] for s in row["slow_steps"]), reverse=True)
        assert f"{row['config']}: {len(row['slow_steps'])} slow steps" in printed


def test_the_profile_splits_a_head_step_into_its_phases(tmp_path):
    """--profile-steps on a head config (its eager forwards piecewise): the phases the engine ran, the head's
    wake among them (observe ahead and chain ahead too where the step is accepted on its fixed shape, on a GPU),
    each with its host time."""
    from bench.spec_steps import main

    out = tmp_path / "spec-steps.json"
    assert main(["--device", "cpu", "--target-twin", "", "--draft-twin", "", "--head-twin", "", "--prompts", "2",
                 "--tokens", "12", "--configs", "eagle3-k3", "--profile-steps", "3", "--head-piecewise",
                 "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["rows"][0]["profile"]["phases"]
    assert {"propose", "wake", "verify forward", "accept", "commit", "observe"} <= set(phases)
    assert set(phases) <= {"propose", "wake", "schedule", "verify forward", "accept", "commit", "observe",
                           "observe ahead", "chain ahead"}
    assert all(phase["host_ms"] >= 0 and phase["device_ms"] >= 0 for phase in phases.values())
