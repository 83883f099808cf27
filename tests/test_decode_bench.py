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


def test_overlap_figures_need_the_variant_and_take_the_host_gap_from_its_replays():
    assert decode.overlap_figures([], 4.0) == {}
    rows = [{"variant": "overlap-steps", "batch": 1, "step_ms": 5.0, "profile": {"gpu_us_per_step": 4900.0},
             "replays": {"between_replays_ms": 0.03, "replays_per_step": 2.0}}]
    figures = decode.overlap_figures(rows, 4.0)
    assert figures["step_ms_bs1_overlap"] == 5.0 and figures["floor_fraction_bs1_overlap"] == 0.8
    assert figures["host_gap_ms_bs1_overlap"] == 0.03  # not the 0.1 ms of idle time the profile leaves
    without_graphs = [{k: v for k, v in rows[0].items() if k != "replays"}]
    assert "host_gap_ms_bs1_overlap" not in decode.overlap_figures(without_graphs, 4.0)


class _Mark:
    """A stand-in for a timed CUDA event: recorded at a device time t (ms)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def record(self):
        pass

    def elapsed_time(self, later) -> float:
        return later.t - self.t


def test_the_time_between_replays_sums_the_gaps_from_each_end_to_the_next_start():
    """The docstring's example, back-to-back replays (no gap) and a single replay (none to measure)."""
    assert abs(decode.between_replays_ms([(_Mark(0.0), _Mark(6.0)), (_Mark(6.1), _Mark(6.3))]) - 0.1) < 1e-9
    assert decode.between_replays_ms([(_Mark(0), _Mark(2)), (_Mark(2), _Mark(5)), (_Mark(5.5), _Mark(6))]) == 0.5
    assert decode.between_replays_ms([(_Mark(0), _Mark(2))]) == 0.0


def test_replay_marks_wrap_every_graph_replay_with_events_and_restore_it(monkeypatch):
    replayed = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replayed.append(graph))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: _Mark())
    original = torch.cuda.CUDAGraph.replay
    graph = object.__new__(torch.cuda.CUDAGraph)  # never captured: the wrapped replay is the stand-in above
    with decode.ReplayMarks() as marks:
        torch.cuda.CUDAGraph.replay(graph)
        graph.replay()
    assert replayed == [graph, graph] and len(marks.marks) == 2
    assert all(isinstance(e, _Mark) for pair in marks.marks for e in pair)
    assert torch.cuda.CUDAGraph.replay is original


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
