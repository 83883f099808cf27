"""bench/target_depth.py's measure: the rows it compares are the same tokens' distributions, so the target's own
last exit and the target used as its own drafter are accepted at exactly 1, and an earlier exit at less."""

from __future__ import annotations

import torch

from bench import target_depth
from specdec.train.distill import load_model


def test_the_last_exit_and_the_target_as_drafter_are_accepted_at_one(qwen3_dir):
    target = load_model(qwen3_dir, "cpu", torch.float32)
    convs = [{"prompt": [5, 17, 30, 2], "continuation": [9, 44, 61, 3, 8]}, {"prompt": [40], "continuation": [7, 7]}]
    row = target_depth.depth_overlaps(target, target, convs)
    layers = target.config.num_hidden_layers
    assert row["tokens"] == 5 + 2  # every continuation token is predicted once
    assert len(row["early_exit"]) == layers and abs(row["early_exit"][-1] - 1.0) < 1e-4
    assert abs(row["drafter"] - 1.0) < 1e-4
    assert all(0.0 < x < 1.0 for x in row["early_exit"][:-1])
    assert row["entropy_nats"] > 0 and 0 < row["argmax_p"] < 1


def test_continuation_rows_are_the_positions_predicting_continuation_tokens():
    # prompt of 3 tokens (positions 0-2), continuation of 4 (positions 3-6): positions 2..5 predict them
    assert target_depth.continuation_rows({"prompt": [1, 2, 3], "continuation": [4, 5, 6, 7]}) == slice(2, 6)
