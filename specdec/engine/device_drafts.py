"""Drafts drawn on the device (a head's chain graph, speculate/chain_graph.py), with their copy to the host
queued right behind the work that draws them, on its own CUDA event: reading them waits for that copy only.  A
plain `.tolist()` at read time would wait for everything queued on the stream by then (a chain run ahead of the
host, speculate/head_ahead.py, has the next observe and the commit's work behind it).

(Feeding such drafts to the verify step straight from the device, with placeholders on the host, was measured
on a GPU to save nothing once the chain runs ahead of the host, and was removed: docs/BENCHMARKS.md.)
"""

from __future__ import annotations

import dataclasses
import torch


@dataclasses.dataclass
class DeviceDrafts:
    tokens: torch.Tensor  # [B, depth] long, on the device: row r's first k_r entries are its request's chain
    rows: dict[str, int]  # request id -> its row of tokens
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
