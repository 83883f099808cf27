"""Greedy drafts for many contexts at once, from a drafter model's own forward passes.

The drafting itself is ``DraftModelSpeculator``'s (catch up on the context, then k batched greedy steps).
What this adds is the server's cache: the drafter's key/value blocks of every full block of a context it
has seen are kept, keyed by the hash chain of the context's prefix (``BlockManager``'s prefix cache), so a
conversation's next request -- the same context grown by a few tokens -- feeds only what is new.  Only
keys/values of the client's context are ever cached, never drafted tokens or answers: every draft comes
out of forward passes.  Cached blocks are evicted least recently used first when fresh blocks are needed.
"""

from __future__ import annotations

import itertools
import time

import torch

from specdec.engine.request import Request
from specdec.models.transformer import CausalLM
from specdec.sampling import SamplingParams
from specdec.speculate.draft_model import DraftModelSpeculator

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
_ids = itertools.count()


class PrefixCachedDrafter:
    def __init__(self, model: CausalLM, kv_cache_tokens: int, block_size: int = 16, max_batch: int = 64):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_batch = max_batch
        on_gpu = model.lm_head.weight.device.type == "cuda"  # CUDA graphs for the one-token drafting steps
        self.speculator = DraftModelSpeculator(model, self.vocab_size, kv_cache_tokens, block_size,
                                               static_shapes=on_gpu, max_batch=max_batch)
        self.blocks = self.speculator.blocks
        self.device = self.speculator.device
        self.stats = {"draft_requests": 0, "draft_batches": 0, "drafted_tokens": 0, "context_tokens": 0,
                      "busy_s": 0.0}  # busy_s: seconds spent drafting (against wall time: how loaded)

    @torch.inference_mode()
    def draft(self, contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy tokens after contexts[i], batched in as few groups as the KV cache holds."""
        start = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in contexts]
        for group in self._groups_that_fit([len(c) + k for c, k in zip(contexts, ks)]):
            for i, draft in zip(group, self._draft_together([contexts[i] for i in group], [ks[i] for i in group])):
                drafts[i] = draft
        self.stats["busy_s"] += time.perf_counter() - start
        return drafts

    def _groups_that_fit(self, lengths: list[int]) -> list[list[int]]:
        """Consecutive groups of indices whose sequences fit the cache together (a lone misfit drafts nothing)."""
        groups: list[list[int]] = [[]]
        used = 0
        for i, length in enumerate(lengths):
            need = self.blocks.blocks_for(length)
            if groups[-1] and used + need > self.blocks.num_blocks:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += need
        return groups

    def _draft_together(self, contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        requests = [self._attach_cached_prefix(ctx) for ctx in contexts]
        try:
            self.speculator.propose(requests, ks)
            for req in requests:
                self._cache_context_blocks(req)
        finally:
            for req in requests:
                self.speculator.release(req)
        drafts = [list(req.draft_token_ids) for req in requests]
        self.stats["draft_requests"] += len(contexts)
        self.stats["draft_batches"] += 1
        self.stats["drafted_tokens"] += sum(len(d) for d in drafts)
        self.stats["context_tokens"] += sum(len(c) for c in contexts)
        return drafts

    def metrics(self) -> dict:
        return {**self.stats, **self.speculator.metrics(), "prefix_cache_hit_tokens": self.blocks.prefix_hits,
                "prefix_cache_query_tokens": self.blocks.prefix_queries,
                "kv_cache_tokens": self.blocks.num_blocks * self.blocks.block_size}

    def _attach_cached_prefix(self, context: list[int]) -> Request:
        """A request for the context whose drafter shadow starts on the cached blocks of its longest known prefix."""
        req = Request(context, GREEDY, self.device, request_id=f"draft-{next(_ids)}")
        cached, hashes = self.blocks.cached_prefix(context)
        self.blocks.acquire(cached)
        self.speculator.adopt(req.request_id, context[:len(cached) * self.blocks.block_size], cached, hashes)
        return req

    def _cache_context_blocks(self, req: Request) -> None:
        """Register the newly computed full blocks of the context (never those holding drafts)."""
        shadow = self.speculator.shadows.get(req.request_id)
        if shadow is None:  # no drafts for this one (context too long, or the cache was full)
            return
        context = req.prompt_token_ids
        self.blocks.register_full_blocks(context, shadow.seq.block_ids, shadow.seq.block_hashes,
                                         min(len(context), shadow.seq.num_computed))
