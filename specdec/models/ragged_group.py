"""A Gated DeltaNet step's sequences laid end to end, as the step lays them: no padding, one group for all.

Where the Triton delta-rule kernel runs (a GPU), the sequences of an eager step that are not deferred (its
prefills, and in a mixed step its plain decodes) are one `RaggedGroup`: the kernel's ragged mode runs every one
to its own count in one launch (specdec/kernels/delta_rule.py), and the causal convolution reads each row's
window from one table, so a layer costs a dozen operators whatever the prompt lengths.  Elsewhere (the CPU,
whose prefill takes the chunked form) gated_deltanet.plan_groups' padded groups run instead.

The convolution's window table stacks the sequences' conv states, then the step's inputs: with m sequences and
a kernel of width K, rows 0 .. m(K-1)-1 are the states (sequence i's K-1 columns at rows i(K-1) ..), and row
m(K-1) + r is input row r.  A token's window is its K-1 predecessors in its own sequence, reaching into the
sequence's state where it has fewer, then the token itself.  Example, K = 4, counts (2, 1): rows 0-2 are
sequence 0's state, 3-5 sequence 1's, 6 and 7 sequence 0's inputs x0 x1, 8 sequence 1's input.  Sequence 0's
token 0 reads rows (0, 1, 2, 6), its token 1 (1, 2, 6, 7); sequence 1's token 0 reads (3, 4, 5, 8).  The next
conv states are the last K-1 rows of each sequence's own window: (2, 6, 7) and (4, 5, 8).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from specdec.transfer import upload


@dataclasses.dataclass
class RaggedGroup:
    seqs: list[int]  # their indices among the step's sequences
    rows: torch.Tensor  # [R] long: their flat rows of the step, sequence by sequence
    slots: torch.Tensor  # [m] long: their state slots
    starts: torch.Tensor  # [m] long: where each one's rows start in `rows`
    counts: torch.Tensor  # [m] long: how many rows each one feeds
    windows: torch.Tensor  # [R, K] long: the window table's rows each row's convolution reads
    next_states: torch.Tensor  # [m, K-1] long: the window table's rows that are each one's next conv state
    in_order: bool  # rows are all of the step's rows in order (no gather)

    deferred = ()  # (a ragged group holds no deferred sequence: its states are written back at once)

    def scatter_rows(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat rows, their outputs) of out [R, ...], as SequenceGroup.scatter_rows."""
        return self.rows, out


def ragged_group(seqs: list[int], starts: list[int], counts: list[int], slots: list[int], width: int,
                 steps_rows: int, device: torch.device) -> RaggedGroup:
    """The group of these sequences (seqs[i] feeds counts[i] rows of the step from its row starts[i]; width:
    the conv kernel's K - 1 columns of state; steps_rows: the step's T)."""
    counts_a = np.asarray(counts, dtype=np.int64)
    local_starts = np.concatenate([[0], np.cumsum(counts_a)[:-1]])  # [m] in the group's rows
    seq_of_row = np.repeat(np.arange(len(seqs)), counts_a)  # [R]
    position = np.arange(len(seq_of_row)) - local_starts[seq_of_row]  # [R]: the token's index in its sequence
    windows = _table_rows(position[:, None] + np.arange(-width, 1), seq_of_row[:, None], local_starts, width,
                          len(seqs))
    next_states = _table_rows(counts_a[:, None] + np.arange(-width, 0), np.arange(len(seqs))[:, None],
                              local_starts, width, len(seqs))
    rows = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
    in_order = len(rows) == steps_rows and bool((rows == np.arange(steps_rows)).all())
    return RaggedGroup(seqs=seqs, rows=upload(torch.from_numpy(rows), device), slots=upload(slots, device),
                       starts=upload(torch.from_numpy(local_starts), device), counts=upload(counts, device),
                       windows=upload(torch.from_numpy(windows), device),
                       next_states=upload(torch.from_numpy(next_states), device), in_order=in_order)


def _table_rows(position: np.ndarray, seq: np.ndarray, local_starts: np.ndarray, width: int, m: int) -> np.ndarray:
    """The window table's row of sequence `seq`'s token at `position` (negative: its state's column width +
    position), elementwise."""
    return np.where(position < 0, seq * width + width + position, m * width + local_starts[seq] + position)


def ragged_causal_conv(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, group: RaggedGroup):
    """delta_rule.causal_conv for the group's sequences laid end to end: x [R, C] their inputs, states [m, C, K-1]
    their conv states, weight [C, 1, K] -> (out [R, C] in x's dtype, SiLU applied; the next states [m, C, K-1]).
    The products are summed in float32."""
    table = torch.cat([states.to(x.dtype).transpose(1, 2).reshape(-1, x.shape[1]), x])  # [m(K-1) + R, C]
    out = (table[group.windows].float() * weight[:, 0].t().float()).sum(dim=1)  # [R, K, C] * [K, C] -> [R, C]
    return F.silu(out).to(x.dtype), table[group.next_states].transpose(1, 2)
