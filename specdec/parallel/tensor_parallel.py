"""Tensor parallelism: one model split across N processes (one per GPU), joined by torch.distributed.

Execution model (SPMD).  Every rank runs the *same* program: the same LLM, Engine, scheduler and
speculator, fed the same requests in the same order.  Only the weights are split:

* q/k/v/gate/up are column-parallel: each rank holds whole attention heads (its share of the query
  heads and of the KV heads, so its paged KV cache holds only its KV heads) and its slice of the MLP;
* o_proj/down_proj are row-parallel: each rank multiplies its input slice and the partial outputs are
  summed with ``all_reduce``;
* the embedding is vocabulary-parallel (a rank looks up the ids in its vocabulary slice, zeros
  elsewhere, then ``all_reduce``), and so is the LM head (each rank computes its slice of the logits,
  then ``all_gather`` gives every rank the full logits).

Since every rank sees identical inputs and identical full logits, scheduling, greedy and seeded
sampling, acceptance and KV block allocation stay identical on all ranks without any further
communication.  Rank 0 reports the results (the CLI prints on rank 0 only).

Launch one process per rank with torchrun, which sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT::

    torchrun --nproc-per-node 2 -m specdec.cli generate MODEL --tensor-parallel-size 2 --prompt hi

The backend is NCCL on CUDA and gloo on CPU (the tests).
"""

from __future__ import annotations

import atexit
import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specdec.errors import ConfigError

# NVLink multicast (NVLS / symmetric-memory multicast) stays off on the lent GPU hosts.
_NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    local_rank: int


def init_tensor_parallel(world_size: int, device: str | torch.device | None = None) -> TensorParallel:
    """Join (or reuse) the default process group of `world_size` ranks, from torchrun's environment.

    Raises ConfigError when the process was not launched with a matching world size.
    """
    if world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be at least 1, got {world_size}")
    hint = f"launch with torchrun --nproc-per-node {world_size} (one process per rank)"
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    else:
        if not dist.is_available():
            raise ConfigError("tensor parallelism needs torch.distributed, which this torch build lacks")
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ConfigError(f"tensor_parallel_size={world_size} but {', '.join(missing)} not set: {hint}")
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world != world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} but {world} processes were launched: {hint}")
    if not dist.is_initialized():
        for key, value in _NO_MULTICAST_ENV.items():
            os.environ.setdefault(key, value)
        use_cuda = torch.cuda.is_available() if device in (None, "auto") else torch.device(device).type == "cuda"
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
        atexit.register(_destroy)
    return TensorParallel(rank, world, local_rank)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: str | torch.device | None, tp: TensorParallel) -> str | torch.device | None:
    """The device of this rank: 'cuda' / 'auto' become cuda:LOCAL_RANK; cpu stays cpu."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", tp.local_rank)
    return device


# ------------------------------------------------------------------------------ keeping the ranks in step
# SPMD holds only while every decision is the same on every rank.  Two inputs to decisions are local:
# free device memory (KV cache sizes) and measured step times (the adaptive draft-length controller).


def min_across_ranks(value: int) -> int:
    """The smallest `value` of all ranks (e.g. KV cache tokens from each GPU's free memory)."""
    t = torch.tensor([value], dtype=torch.long, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class RankZeroController:
    """Wraps the draft-length controller (speculate.controller.KController): rank 0's choice of k, which
    rests on its own step timings, is broadcast, so every rank drafts and verifies alike."""

    def __init__(self, controller):
        self.__dict__["inner"] = controller

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def choose(self, request_ids: list[str], other_tokens: int) -> int:
        k = torch.tensor([self.inner.choose(request_ids, other_tokens)], dtype=torch.long,
                         device=_collective_device())
        dist.broadcast(k, src=0)
        self.inner.last_k = int(k.item())
        return self.inner.last_k


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agreed_kv_cache_tokens(model, engine_config, device: torch.device) -> int:
    """KV cache tokens every rank can hold: this rank's budget (as the Engine would size it), min over ranks."""
    from specdec.engine.kv_cache import num_blocks_for

    blocks = num_blocks_for(model.config, engine_config.block_size, model.lm_head.weight.dtype, torch.device(device),
                            engine_config.kv_cache_tokens, engine_config.gpu_memory_utilization)
    return min_across_ranks(blocks) * engine_config.block_size


# ---------------------------------------------------------------------------------------------- modules


def _take(weight: torch.Tensor, dim: int, start: int, length: int) -> nn.Parameter:
    """A fresh contiguous copy of weight[start:start+length] along `dim` (the full tensor can be freed)."""
    return nn.Parameter(weight.narrow(dim, start, length).clone(memory_format=torch.contiguous_format),
                        requires_grad=False)


def _column_parallel(linear: nn.Linear, start: int, length: int) -> None:
    """Keep output rows [start, start+length) of `linear` in place."""
    linear.weight = _take(linear.weight, 0, start, length)
    if linear.bias is not None:
        linear.bias = _take(linear.bias, 0, start, length)
    linear.out_features = length


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_slice @ W[:, slice].T) + b: the input columns of this rank, summed across ranks."""

    def __init__(self, linear: nn.Linear, start: int, length: int, group=None):
        super().__init__()
        self.weight = _take(linear.weight, 1, start, length)
        self.bias = linear.bias  # added once, after the reduction
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def _vocab_slice(vocab_size: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, length, padded length): ceil(V / world) ids per rank, the last rank may hold fewer."""
    per_rank = -(-vocab_size // world)
    start = min(rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, start+length) of the table; other ids look up zeros; all_reduce."""

    def __init__(self, weight: torch.Tensor, rank: int, world: int, group=None):
        super().__init__()
        self.start, length, _ = _vocab_slice(weight.shape[0], rank, world)
        self.weight = _take(weight, 0, self.start, length)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class ParallelLMHead(nn.Module):
    """Each rank computes the logits of its vocabulary slice; all_gather returns the full [N, V] logits."""

    def __init__(self, weight: torch.Tensor | nn.Parameter, vocab_size: int, rank: int, world: int, group=None,
                 sliced: bool = False):
        """weight: the full [V, hidden] head, or (sliced=True) this rank's rows already (tied embeddings)."""
        super().__init__()
        start, length, self.padded = _vocab_slice(vocab_size, rank, world)
        self.weight = weight if sliced else _take(weight, 0, start, length)
        self.vocab_size, self.world, self.group = vocab_size, world, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        if local.shape[-1] < self.padded:  # all_gather wants equal shapes
            local = F.pad(local, (0, self.padded - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


# ---------------------------------------------------------------------------------------------- sharding


def check_divisible(config, world: int) -> None:
    """ConfigError unless heads, KV heads and the MLP width split evenly over `world` ranks."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world:
            raise ConfigError(f"tensor_parallel_size {world} does not divide {name} ({value}): "
                              f"pick a size that divides {name}")


@torch.no_grad()
def shard_model(model, rank: int, world: int, group=None):
    """Convert a loaded CausalLM in place into this rank's shard; returns it.

    Afterwards ``model.config`` is this rank's view (its attention and KV head counts, its MLP width;
    vocabulary and everything else unchanged), so the engine sizes a KV cache holding only this rank's
    KV heads; ``model.full_config`` keeps the original.  world == 1 leaves the model untouched.
    """
    config = model.config
    if world == 1:
        return model
    check_divisible(config, world)
    heads, kv_heads = config.num_attention_heads // world, config.num_key_value_heads // world
    inter = config.intermediate_size // world
    d = config.head_dim
    for layer in model.model.layers:
        attn = layer.self_attn
        _column_parallel(attn.q_proj, rank * heads * d, heads * d)
        _column_parallel(attn.k_proj, rank * kv_heads * d, kv_heads * d)
        _column_parallel(attn.v_proj, rank * kv_heads * d, kv_heads * d)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank * heads * d, heads * d, group)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        mlp = layer.mlp
        _column_parallel(mlp.gate_proj, rank * inter, inter)
        _column_parallel(mlp.up_proj, rank * inter, inter)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank * inter, inter, group)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    embed = VocabParallelEmbedding(model.model.embed_tokens.weight, rank, world, group)
    model.model.embed_tokens = embed
    head_weight = embed.weight if tied else model.lm_head.weight
    model.lm_head = ParallelLMHead(head_weight, config.vocab_size, rank, world, group, sliced=tied)
    model.full_config = config
    model.config = dataclasses.replace(config, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                       intermediate_size=inter)
    model.tensor_parallel = (rank, world)
    return model
