"""bench/decode.py's CPU dry run (--tiny): every stage runs on a tiny model and the record holds issue 21's fields,
the overlapped-steps variant's included (on a GPU the same code times the 8B shape)."""

from __future__ import annotations

import json

import torch

from bench import decode


def test_the_tiny_dry_run_records_the_decode_figures_and_the_overlap_variant(tmp_path):
    out = tmp_path / "decode.json"
    assert decode.main(["--tiny", "--skip-hf", "--batches", "1,2", "--contexts", "256", "--steps", "3",
                        "--max-k", "7", "--variant-batches", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    for field in ("floor_ms_bs1", "step_ms_bs1", "verify_ratio_k7_bs1", "floor_fraction_bs1", "date",
                  "step_ms_bs1_overlap", "floor_fraction_bs1_overlap"):
        assert isinstance(record[field], (int, float, str)), field
    overlap = [row for row in record["variants"] if row["variant"] == "overlap-steps"]
    assert len(overlap) == 1 and overlap[0]["batch"] == 1
    assert overlap[0]["overlapped_steps"] > 0  # the variant's steps really overlapped
    assert record["step_ms_bs1_overlap"] == overlap[0]["step_ms"]
    assert {row["batch"] for row in record["decode"]} == {1, 2}


def test_overlap_figures_need_the_variant_and_take_the_host_gap_from_its_profile():
    assert decode.overlap_figures([], 4.0) == {}
    rows = [{"variant": "overlap-steps", "batch": 1, "step_ms": 5.0, "profile": {"gpu_us_per_step": 4900.0}}]
    figures = decode.overlap_figures(rows, 4.0)
    assert figures["step_ms_bs1_overlap"] == 5.0 and figures["floor_fraction_bs1_overlap"] == 0.8
    assert abs(figures["host_gap_ms_bs1_overlap"] - 0.1) < 1e-9


def test_idle_gaps_split_kernel_boundaries_from_host_waits():
    """The docstring's example, overlapping kernels (no gap) and the empty profile."""
    assert decode.idle_gaps([(40, 45), (0, 5), (6, 10)]) == {"short_gap_us": 1, "short_gaps": 1, "long_gap_us": 30,
                                                            "long_gaps": 1}
    assert decode.idle_gaps([(0, 10), (2, 4), (10, 12)])["short_gaps"] == 0
    assert decode.idle_gaps([]) == {"short_gap_us": 0, "short_gaps": 0, "long_gap_us": 0, "long_gaps": 0}


def test_the_host_gap_splits_into_host_waits_and_kernel_boundaries():
    profile = {"idle": {"short_gap_us": 300.0, "short_gaps": 550, "long_gap_us": 40.0, "long_gaps": 1}}
    assert decode.idle_split(profile) == {"host_wait_ms_bs1": 0.04, "kernel_boundaries_ms_bs1": 0.3}
    assert decode.idle_split({"gpu_us_per_step": 1.0}) == {}
