"""Paged KV cache: fixed-size blocks, reference-counted, with prefix caching by hash chain.

A block's hash covers its tokens and, through its parent's hash, every token before it.  The hash only
finds a candidate: a hit also compares the block's stored tokens and its parent block, so two prompts
share cached block i only if their first (i+1) * block_size tokens are identical, hash collisions or
not.  Only full blocks of committed tokens are ever registered.  A freed block keeps its entry and
content until it is handed out again (least recently freed first), so a later prompt with the same
prefix reuses it.
"""

from __future__ import annotations

import array
import collections
import math
from typing import NamedTuple

import torch

from specdec.models.config import ModelConfig


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at `position`: offset position % block_size in its block."""
    return block_ids[position // block_size] * block_size + position % block_size


def block_hash(parent: int | None, tokens: list[int] | tuple[int, ...]) -> int:
    return hash((parent, tuple(tokens)))


def packed(tokens: list[int] | tuple[int, ...]) -> bytes:
    """A block's token ids, 4 bytes each: what a prefix-cache hit compares besides the hash."""
    return array.array("I", tokens).tobytes()


class CachedBlock(NamedTuple):
    """A registered block: its chain hash, its tokens (packed) and the registered block before it."""

    hash: int
    tokens: bytes
    parent: int | None


class BlockManager:
    """Blocks, their reference counts and the prefix cache.

    A hash only finds a candidate block: a hit also needs the block's tokens to equal the prompt's and
    its parent to be the block matched just before, so a hash collision never serves another prompt's
    keys/values.  A block handed out again leaves the cache with every registered block after it.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching  # off: no prompt is served from cached blocks (hybrid models)
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.free_blocks: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, CachedBlock] = {}  # block id -> what it holds
        self.block_of: dict[int, int] = {}  # hash -> block id
        self.children: dict[int, set[int]] = {}  # block id -> registered blocks whose parent it is
        self.prefix_hits = 0  # tokens served from the prefix cache
        self.prefix_queries = 0  # prompt tokens looked up

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def cached_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Cached blocks holding a prefix of token_ids (at most len - 1 tokens) and their hashes."""
        usable = (len(token_ids) - 1) // self.block_size if self.prefix_caching else 0
        blocks, hashes, parent = [], [], None
        for i in range(usable):
            tokens = token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = block_hash(hashes[-1] if hashes else None, tokens)
            block = self.lookup(h, tokens, parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = block
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(blocks) * self.block_size
        return blocks, hashes

    def lookup(self, h: int, tokens: list[int], parent: int | None) -> int | None:
        """The registered block with hash h holding `tokens` after block `parent`, or None."""
        block = self.block_of.get(h)
        if block is None or not self.holds(block, tokens, parent):
            return None
        return block

    def holds(self, block: int, tokens: list[int], parent: int | None) -> bool:
        entry = self.cached[block]
        return entry.parent == parent and entry.tokens == packed(tokens)

    def acquire(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free_blocks[b]
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, or None (nothing allocated) when fewer than n are free."""
        if n > len(self.free_blocks):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free_blocks.popitem(last=False)
            self.forget(b)
            self.ref_count[b] = 1
            out.append(b)
        return out

    def forget(self, block: int) -> None:
        """Take a block out of the prefix cache, and with it every registered block after it (their
        keys/values were computed after this block's tokens, which it no longer holds)."""
        stack = [block]
        while stack:
            b = stack.pop()
            entry = self.cached.pop(b, None)
            if entry is None:
                continue
            if self.block_of.get(entry.hash) == b:
                del self.block_of[entry.hash]
            siblings = self.children.get(entry.parent)
            if siblings is not None:  # absent when the parent left the cache first, in this same loop
                siblings.discard(b)
                if not siblings:
                    del self.children[entry.parent]
            stack.extend(self.children.pop(b, ()))

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; tail blocks are freed first so prefixes stay cached longest."""
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} released twice"
            if self.ref_count[b] == 0:
                self.free_blocks[b] = None

    def register_full_blocks(self, tokens: list[int], block_ids: list[int], hashes: list[int], num_tokens: int) -> None:
        """Extend the hash chain `hashes` over every full block of tokens[:num_tokens] not hashed yet, and
        register each block so that later prompts with the same prefix can reuse it."""
        if not self.prefix_caching:
            return
        size = self.block_size
        first, end = len(hashes), num_tokens // size
        for i in range(first, end):
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * size:(i + 1) * size]))
        if end > first:
            self._register_chain(tokens, block_ids, hashes, first, end)

    def _register_chain(self, tokens: list[int], block_ids: list[int], hashes: list[int], first: int,
                        end: int) -> None:
        """Register blocks first..end-1 of a sequence behind the cached blocks that hold its earlier ones."""
        size = self.block_size
        start = first if first == 0 or self._cached_as(block_ids[first - 1], hashes[first - 1]) else 0
        parent = block_ids[start - 1] if start else None
        for i in range(start, end):
            block_tokens = tokens[i * size:(i + 1) * size]
            holder = self.block_of.get(hashes[i])
            if holder is None:
                self._register(block_ids[i], hashes[i], block_tokens, parent)
                holder = block_ids[i]
            elif not self.holds(holder, block_tokens, parent):
                return  # a hash collision: this sequence's later blocks stay out of the cache
            parent = holder

    def _cached_as(self, block: int, h: int) -> bool:
        entry = self.cached.get(block)
        return entry is not None and entry.hash == h

    def _register(self, block: int, h: int, tokens: list[int], parent: int | None) -> None:
        self.block_of[h] = block
        self.cached[block] = CachedBlock(h, packed(tokens), parent)
        if parent is not None:
            self.children.setdefault(parent, set()).add(block)


class KVCache:
    """Per full-attention layer a key and a value tensor of shape [(num_blocks + 1) * block_size, n_kv_heads,
    head_dim] (a hybrid model's linear layers keep recurrent state instead: engine/state_slots.py).

    Block `num_blocks` (the last) is scratch, never handed out: padding rows of fixed-shape (CUDA graph)
    batches write and read there.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = ((num_blocks + 1) * block_size, config.num_key_value_heads, config.head_dim)
        # one tensor [layers, 2 (key, value), slots, heads, dim]: a slot moves in every layer at once (move_slots)
        self.data = torch.zeros(config.num_attention_layers, 2, *shape, device=device, dtype=dtype)
        self.layers = [(layer[0], layer[1]) for layer in self.data]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys and values at slots src [n] to slots dst [n] in every layer (all read before any write)."""
        self.data[:, :, dst] = self.data[:, :, src]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_attention_layers * config.num_key_value_heads * config.head_dim * itemsize


GRAPH_RESERVE_BYTES = 512 << 20  # CUDA graph memory pool and allocator slack


def kv_budget_bytes(free_bytes: int, utilization: float, step_bytes: int) -> int:
    """The KV cache's share: `utilization` of the free memory, less the largest step (engine/memory.py measures
    it) and the graph reserve."""
    return max(0, int(free_bytes * utilization) - step_bytes - GRAPH_RESERVE_BYTES)


def num_blocks_for(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   kv_cache_tokens: int | None, memory_fraction: float, step_bytes: int = 0,
                   shared_bytes_per_token: int = 0) -> int:
    """Blocks from a token budget, or from the device's free memory (kv_budget_bytes), where each token
    also pays `shared_bytes_per_token` for the caches that share the block tables."""
    if kv_cache_tokens is not None:
        return max(1, math.ceil(kv_cache_tokens / block_size))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = kv_budget_bytes(free, memory_fraction, step_bytes)
    else:  # CPU: 32k tokens, at most 1 GiB
        tokens = min(32768, (1 << 30) // KVCache.bytes_per_token(config, dtype))
        return max(1, tokens // block_size)
    return max(1, budget // ((KVCache.bytes_per_token(config, dtype) + shared_bytes_per_token) * block_size))
