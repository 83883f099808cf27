"""Drafts the host has not read yet: a chain drawn on the device, fed to the verify step from there.

A head that drafts its chain in one CUDA graph (speculate/chain_graph.py) leaves the tokens on the device.
Reading them first would make the host wait for the chain before it can stage and launch the verify step,
so the device would sit idle for that staging and launch (~2-3 ms a step at the Qwen3.5-27B twin's shape).
Instead the speculator gives each request placeholders of the right length (the scheduler needs only how
many drafts there are), the fixed-shape runner stages the step with them and then copies the real tokens
over them on the device, and the host reads the drafts into the placeholders once the verify step is queued
behind the chain (engine.Engine._forward): the read then waits only for the chain, while the device goes on
into the verify step.  The tokens reach the host by a copy queued right behind the chain, on its own CUDA
event: a plain `.tolist()` at read time would wait for everything queued on the stream by then, the verify
forward included, and the host would stage the step's acceptance only after the verify instead of beside it.
"""

from __future__ import annotations

import dataclasses
import torch

PLACEHOLDER = -1  # a draft's id until the host reads it: an out-of-range id, so a premature read fails loudly


@dataclasses.dataclass
class DeviceDrafts:
    tokens: torch.Tensor  # [B, depth] long, on the device: row r's first k_r entries are its request's chain
    rows: dict[str, int]  # request id -> its row of tokens (the speculator's read_drafts fills the placeholders)
    host: torch.Tensor | None = None  # [B, depth] their copy on the host (pinned on a GPU; may be in flight)
    copied: torch.cuda.Event | None = None  # on a GPU: recorded when that copy is done

    @classmethod
    def queued(cls, tokens: torch.Tensor, rows: dict[str, int]) -> DeviceDrafts:
        """Drafts whose copy to the host is queued now, right behind the work that draws them (what later work
        writes into `tokens`, a graph's static buffer, does not reach the copy)."""
        if tokens.device.type != "cuda":
            return cls(tokens, rows, tokens.clone())
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, rows, host, copied)

    def read(self) -> list[list[int]]:
        """[B, depth] the tokens on the host: waits for their copy only, not for work queued after it."""
        if self.copied is not None:
            self.copied.synchronize()
        return (self.tokens if self.host is None else self.host).tolist()


def draft_positions(seqs, rows: dict[str, int], q: int) -> tuple[list[int], list[int], list[int]]:
    """Where each verified draft goes in a padded step of q rows per sequence, and where it comes from:
    (flat row of the step's ids [batch * q], row of tokens, column of tokens), one entry per draft.

    Sequence i's row of the step feeds its committed tokens, then its num_drafts drafts.  Example: q = 4,
    sequence 1 (rows 4..7) feeds 1 committed token and 3 drafts from tokens row 0 -> step rows 5, 6, 7 take
    tokens[0, 0], tokens[0, 1], tokens[0, 2].  Sequences without drafts on the device are left as staged."""
    step_rows, token_rows, token_cols = [], [], []
    for i, seq in enumerate(seqs):
        row = rows.get(seq.request.request_id)
        if row is None or not seq.num_drafts:
            continue
        first = i * q + seq.num_new - seq.num_drafts
        step_rows += range(first, first + seq.num_drafts)
        token_rows += [row] * seq.num_drafts
        token_cols += range(seq.num_drafts)
    return step_rows, token_rows, token_cols
