"""A Gated DeltaNet step's sequences laid end to end (models/ragged_group.py): the window table's index
arithmetic, the convolution over it against delta_rule.causal_conv per sequence, and when plan_groups lays a
step out that way.  The kernel's ragged mode and a layer through it: tests/test_delta_rule_kernel.py."""

from __future__ import annotations

import pytest
import torch

from specdec.models import gated_deltanet
from specdec.models.config import ModelConfig
from specdec.models.delta_rule import causal_conv
from specdec.models.gated_deltanet import SequenceGroup
from specdec.models.ragged_group import RaggedGroup, ragged_causal_conv, ragged_group
from specdec.models.recurrent_state import new_state_pools
from tests.test_delta_rule_kernel import HYBRID, ragged_step


def test_the_window_table_follows_the_worked_example():
    """K = 4, counts (2, 1): rows 0-2 sequence 0's state, 3-5 sequence 1's, 6-7 sequence 0's inputs, 8 sequence
    1's; the windows and next states as the module's docstring works them out."""
    group = ragged_group([0, 1], [0, 2], [2, 1], [7, 4], width=3, steps_rows=3, device=torch.device("cpu"))
    assert group.windows.tolist() == [[0, 1, 2, 6], [1, 2, 6, 7], [3, 4, 5, 8]]
    assert group.next_states.tolist() == [[2, 6, 7], [4, 5, 8]]
    assert group.in_order and group.starts.tolist() == [0, 2] and group.slots.tolist() == [7, 4]


@pytest.mark.parametrize("counts", [[2, 1], [1, 1, 1], [9, 1, 4], [1], [6]])
def test_the_convolution_over_the_table_equals_each_sequences_own(counts):
    """Sequences of 1 token to more than the kernel's width, laid end to end out of the step's order (the step's
    rows 3.. first): outputs and next states equal causal_conv on each sequence alone."""
    gen = torch.Generator().manual_seed(sum(counts))
    channels, width = 10, 3
    step = torch.randn(3 + sum(counts), channels, generator=gen)
    states = torch.randn(len(counts), channels, width, generator=gen)
    weight = torch.randn(channels, 1, width + 1, generator=gen)
    starts = [3 + sum(counts[:i]) for i in range(len(counts))]
    group = ragged_group(list(range(len(counts))), starts, counts, list(range(len(counts))), width, len(step),
                         torch.device("cpu"))
    assert not group.in_order and group.rows.tolist() == list(range(3, len(step)))
    out, next_states = ragged_causal_conv(step[group.rows], states, weight, group)
    for i, (start, n) in enumerate(zip(starts, counts)):
        expected, window = causal_conv(step[start:start + n][None], states[i:i + 1], weight)
        torch.testing.assert_close(out[start - 3:start - 3 + n], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(next_states[i], window[0, :, -width:])


def test_the_comparison_has_power():
    """A table whose windows are shifted by one row gives other outputs."""
    gen = torch.Generator().manual_seed(3)
    step, states, weight = torch.randn(5, 4, generator=gen), torch.randn(2, 4, 3, generator=gen), torch.randn(4, 1, 4)
    group = ragged_group([0, 1], [0, 2], [2, 3], [0, 1], 3, 5, torch.device("cpu"))
    right = ragged_causal_conv(step, states, weight, group)[0]
    group.windows = group.windows.roll(1, dims=1)
    assert not torch.allclose(ragged_causal_conv(step, states, weight, group)[0], right)


@pytest.mark.parametrize("ragged_on", [True, False])
def test_where_the_kernel_runs_the_sequences_not_deferred_are_one_ragged_group(monkeypatch, ragged_on):
    """A mixed step (a decode, a verify of 3 deferred, a prompt of 40): with the kernel (forced here) and
    RAGGED_IN_KERNEL, the decode and the prompt are one ragged group in the step's order and the verify its own
    group; without, the groups by count of a CPU."""
    monkeypatch.setattr(gated_deltanet, "fused_on", lambda state: True)
    monkeypatch.setattr(gated_deltanet, "RAGGED_IN_KERNEL", ragged_on)
    pools = new_state_pools(ModelConfig.from_dict(HYBRID), 6, "cpu", torch.float32)
    groups, _ = ragged_step(pools, [1, 3, 40], [2, 4, 1], [False, True, False])
    if ragged_on:
        ragged, verify = groups
        assert isinstance(ragged, RaggedGroup) and ragged.seqs == [0, 2] and ragged.rows.tolist() == [0, *range(4, 44)]
        assert ragged.counts.tolist() == [1, 40] and ragged.slots.tolist() == [2, 1] and not ragged.in_order
        assert isinstance(verify, SequenceGroup) and verify.seqs == [1] and verify.deferred == [0]
    else:
        assert all(isinstance(g, SequenceGroup) for g in groups) and sorted(g.seqs for g in groups) == [[0], [1], [2]]
