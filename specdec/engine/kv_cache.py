"""Paged KV cache: fixed-size blocks, reference-counted, with prefix caching by hash chain.

A block's hash covers its tokens and, through its parent's hash, every token before it, so two
prompts share cached block i only if their first (i+1) * block_size tokens are identical.  Only
full blocks of committed tokens are ever hashed.  A freed block keeps its hash and content until it
is handed out again (least recently freed first), so a later prompt with the same prefix reuses it.
"""

from __future__ import annotations

import collections
import math

import torch

from specdec.models.config import ModelConfig


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at `position`: offset position % block_size in its block."""
    return block_ids[position // block_size] * block_size + position % block_size


def block_hash(parent: int | None, tokens: list[int] | tuple[int, ...]) -> int:
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.free_blocks: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.hash_of: dict[int, int] = {}  # block id -> hash
        self.block_of: dict[int, int] = {}  # hash -> block id
        self.prefix_hits = 0  # tokens served from the prefix cache
        self.prefix_queries = 0  # prompt tokens looked up

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def cached_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Cached blocks holding a prefix of token_ids (at most len - 1 tokens) and their hashes."""
        usable = (len(token_ids) - 1) // self.block_size
        blocks, hashes, parent = [], [], None
        for i in range(usable):
            h = block_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(blocks) * self.block_size
        return blocks, hashes

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
            old = self.hash_of.pop(b, None)
            if old is not None and self.block_of.get(old) == b:
                del self.block_of[old]
            self.ref_count[b] = 1
            out.append(b)
        return out

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
        size = self.block_size
        for i in range(len(hashes), num_tokens // size):
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * size:(i + 1) * size]))
            self.register(block_ids[i], hashes[-1])

    def register(self, block: int, h: int) -> None:
        if h not in self.block_of:
            self.block_of[h] = block
            self.hash_of[block] = h


class KVCache:
    """Per layer a key and a value tensor of shape [(num_blocks + 1) * block_size, n_kv_heads, head_dim].

    Block `num_blocks` (the last) is scratch, never handed out: padding rows of fixed-shape (CUDA graph)
    batches write and read there.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = ((num_blocks + 1) * block_size, config.num_key_value_heads, config.head_dim)
        self.layers = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                       for _ in range(config.num_hidden_layers)]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def num_blocks_for(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   kv_cache_tokens: int | None, memory_fraction: float, step_bytes: int = 0) -> int:
    """Blocks from a token budget, or from the device's free memory (see engine/memory.py)."""
    if kv_cache_tokens is not None:
        return max(1, math.ceil(kv_cache_tokens / block_size))
    if device.type == "cuda":
        from specdec.engine.memory import kv_budget_bytes

        free, _ = torch.cuda.mem_get_info(device)
        budget = kv_budget_bytes(free, memory_fraction, step_bytes)
    else:  # CPU: 32k tokens, at most 1 GiB
        tokens = min(32768, (1 << 30) // KVCache.bytes_per_token(config, dtype))
        return max(1, tokens // block_size)
    return max(1, budget // (KVCache.bytes_per_token(config, dtype) * block_size))
