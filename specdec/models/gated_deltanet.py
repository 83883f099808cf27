"""The Gated DeltaNet linear-attention layer of Qwen3.5 over the flat ragged step layout.

A layer projects all T rows of the step at once, then runs its recurrence per group of sequences that
feed the same number of tokens, or for the chunked form about as many chunks, padded with tokens that do
nothing (`plan_groups`, built once per step and shared by every linear layer; where the Triton kernel runs,
an eager step's sequences that are not deferred are one group laid end to end instead, ragged_group.py):
each group's states are advanced together and written back to their slots (deferred sequences excepted: see
specdec/models/recurrent_state.py).  The token-by-token form reads and writes the ssm pool's rows in place
(`recurrent_heads` with slots: no gather or scatter of the states where the kernel runs); the chunked form
and the conv state take a gather and a scatter.  A padded fixed-shape step
(engine/static_hybrid.py) is one group, built without reading anything back from the device.  Groups of at
most RECURRENT_MAX_TOKENS tokens per sequence (decode, verify) take the token-by-token form (one Triton launch
on a GPU), longer ones (prefill) the chunked form on a CPU (specdec/models/delta_rule.py).

Module names follow the Hugging Face checkpoint (model.layers.N.linear_attn.in_proj_qkv ...).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from specdec.models.attention import AttentionBatch
from specdec.models.config import ModelConfig
from specdec.models.delta_rule import (CHUNK, causal_conv, chunked, conv_state_after, fused_on, ragged,
                                       recurrent_heads)
from specdec.models.fused import Kernels
from specdec.models.fused_linear import FusedProjection, fuse
from specdec.models.ragged_group import RaggedGroup, ragged_causal_conv, ragged_group
from specdec.models.recurrent_state import Deferred, StateBatch
from specdec.transfer import upload

RECURRENT_MAX_TOKENS = 17  # a verify step of 16 drafts plus one; longer runs per sequence go chunked ...
# ... except where the Triton kernel runs: there an eager step's sequences that are not deferred run as one
# ragged group (ragged_group.py), and the rest token by token (False: padded groups and the chunked form, as on
# a CPU; bench/prefill.py times both)
RAGGED_IN_KERNEL = True


@dataclasses.dataclass
class SequenceGroup:
    """The step's sequences that each feed n tokens, or for the chunked form at most n (a padded group)."""

    seqs: list[int]  # their indices among the step's sequences
    rows: torch.Tensor  # [m, n] long: flat row of each one's j-th token
    slots: torch.Tensor  # [m] long: their state slots
    deferred: list[int]  # positions (in the group) of the deferred ones; empty: none
    kept: torch.Tensor | None = None  # [m'] positions of the others (state written back), when only some are deferred
    deferred_index: torch.Tensor | None = None  # [m - m'] the deferred positions, when only some are deferred
    in_order: bool = False  # rows are all of the step's rows in order (rows == arange(T).view(m, n))
    # a chunked group of sequences feeding different counts: which of the [m, n] rows are real (the others
    # repeat the sequence's last row and are made tokens that do nothing), and each one's count [m]
    real: torch.Tensor | None = None  # [m, n] bool
    counts: torch.Tensor | None = None  # [m] long

    def scatter_rows(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat rows, their outputs) of out [m, n, ...]: a padded group's real rows only."""
        if self.real is None:
            return self.rows.flatten(), out.flatten(0, 1)
        return self.rows[self.real], out[self.real]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The group's rows of t [T, ...] as [m, n, ...]: a view when they are the step's rows in order (no
        gather kernel), else gathered."""
        return t.reshape(*self.rows.shape, *t.shape[1:]) if self.in_order else t[self.rows]

    @property
    def n(self) -> int:
        return int(self.rows.shape[1])

    @property
    def recurrent(self) -> bool:
        return self.n <= RECURRENT_MAX_TOKENS


def plan_groups(batch: AttentionBatch) -> list[SequenceGroup]:
    """Group a step's sequences by how many tokens they feed (chunked ones by _group_key's buckets, padded to
    the longest).  Example: query counts (1, 5, 1), so flat rows 0 | 1..5 | 6 -> a group n = 1 of sequences
    [0, 2] with rows [[0], [6]], and n = 5 of [1] with rows [[1, 2, 3, 4, 5]].  Counts (20, 30): one chunked
    group n = 30, sequence 0's rows 0..19 then row 19 ten times more (real: its first 20).  Uses
    batch.host_lens (else reads query_start from the device: a sync); a padded step (batch.uniform, slots on the
    device) is one group without any host read."""
    states = batch.states
    if batch.uniform and isinstance(states.slots, torch.Tensor):
        return [uniform_group(batch.max_query_len, states)]
    counts = batch.host_lens[0] if batch.host_lens is not None else \
        (batch.query_start[1:] - batch.query_start[:-1]).tolist()
    if len(states.slots) != len(counts) or len(states.defer) != len(counts):
        raise ValueError(f"StateBatch has {len(states.slots)} slots and {len(states.defer)} defer flags for a "
                         f"step of {len(counts)} sequences: give one of each per sequence")
    starts = [0, *itertools.accumulate(counts)]
    device = batch.query_start.device
    groups: list[SequenceGroup | RaggedGroup] = []
    if RAGGED_IN_KERNEL and states.ssm and fused_on(states.ssm[0]):
        laid = [i for i, n in enumerate(counts) if n and not states.defer[i]]
        if laid:
            groups.append(ragged_group(laid, [starts[i] for i in laid], [counts[i] for i in laid],
                                       [states.slots[i] for i in laid], states.conv[0].shape[-1], starts[-1], device))
        counts = [n if states.defer[i] else 0 for i, n in enumerate(counts)]  # the deferred ones group below
    by_count: dict[int | tuple[str, int], list[int]] = {}  # _group_key -> the sequences of that group
    for i, n in enumerate(counts):
        if n:
            by_count.setdefault(_group_key(n, states.defer[i]), []).append(i)
    for seqs in by_count.values():
        n = max(counts[i] for i in seqs)
        padded = any(counts[i] < n for i in seqs)
        # row j of sequence i: its j-th token, or past its count its last one again (a padded group)
        rows = [[starts[i] + min(j, counts[i] - 1) for j in range(n)] for i in seqs]
        group = SequenceGroup(seqs=seqs, rows=upload(rows, device),
                              slots=upload([states.slots[i] for i in seqs], device),
                              deferred=[p for p, i in enumerate(seqs) if states.defer[i]],
                              in_order=not groups and len(by_count) == 1 and len(seqs) == len(counts) and not padded)
        if padded:
            group.real = upload([[j < counts[i] for j in range(n)] for i in seqs], device).bool()
            group.counts = upload([counts[i] for i in seqs], device)
        if group.deferred and len(group.deferred) < len(seqs):
            group.kept = upload([p for p, i in enumerate(seqs) if not states.defer[i]], device)
            group.deferred_index = upload(group.deferred, device)
        groups.append(group)
    return groups


def _group_key(n: int, deferred: bool) -> int | tuple[str, int]:
    """Which group a sequence feeding n tokens joins.  Token by token (n <= RECURRENT_MAX_TOKENS) or deferred:
    those of the same n.  Chunked: all whose chunk counts share a power-of-two bucket, padded to the longest
    (tokens that do nothing: the chunked form pads each sequence to whole chunks that way already), so that a
    prefill of many prompts of different lengths runs a few chunked calls, not one per length.  Buckets of 1, 2,
    3-4, 5-8, ... chunks.  Example, chunks of 64: n = 40 and 64 (1 chunk) join, 130 and 200 (3 and 4 chunks)
    join, 70 (2 chunks) and 300 (5 chunks) go apart."""
    if n <= RECURRENT_MAX_TOKENS or deferred:
        return n
    return ("chunked", (-(-n // CHUNK) - 1).bit_length())


def uniform_group(q: int, states: StateBatch) -> SequenceGroup:
    """The one group of a padded step: B sequences of q rows each, in order (sequence b's rows b*q .. b*q+q-1),
    slots [B] on the device; its sequences are all deferred or none (a graph holds one pattern)."""
    num_seqs = states.slots.shape[0]
    if len(states.defer) != num_seqs or len(set(states.defer)) > 1:
        raise ValueError(f"a padded step defers all of its {num_seqs} sequences or none, got {states.defer}")
    rows = torch.arange(num_seqs * q, device=states.slots.device).view(num_seqs, q)
    return SequenceGroup(seqs=list(range(num_seqs)), rows=rows, slots=states.slots,
                         deferred=list(range(num_seqs)) if any(states.defer) else [], in_order=True)


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) * silu(z) over each value head (the norm in float32, cast before the weight, the
    gate in float32, as transformers does).  Not zero-centred: the weight starts at one."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z [T, Hv, Dv] -> [T, Hv, Dv], x's dtype."""
        return Kernels.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """forward(x [T, hidden], groups, states) -> [T, hidden], in three parts: project (row-wise), core (the
    conv and delta rule per sequence group, with the state store) and output (row-wise); engine/piecewise_hybrid.py
    runs the row-wise parts as CUDA graphs.  state_index: this layer's place among the model's linear layers,
    i.e. its entry in states.conv / states.ssm."""

    def __init__(self, config: ModelConfig, state_index: int):
        super().__init__()
        c = config
        self.state_index = state_index
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.k_dim, self.v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_width, self.value_width = c.linear_key_dim, c.linear_value_dim
        conv_dim, kernel = c.linear_conv_dim, c.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.value_width, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False, padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_width, c.hidden_size, bias=False)
        self.in_proj: FusedProjection | None = None  # set by fuse_projections()

    def fuse_projections(self) -> bool:
        if self.in_proj is None or not self.in_proj.valid():
            self.in_proj = fuse([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        return self.in_proj is not None

    def project(self, x: torch.Tensor):
        """x [T, hidden] -> mixed q/k/v before the conv [T, conv_dim], z [T, Hv*Dv], b [T, Hv], a [T, Hv]."""
        if self.in_proj is not None:
            return tuple(self.in_proj(x))
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: torch.Tensor, groups: list[SequenceGroup], states: StateBatch) -> torch.Tensor:
        mixed, z, b, a = self.project(x)
        return self.output(self.core(mixed, b, a, groups, states), z)

    def core(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, groups: list[SequenceGroup],
             states: StateBatch) -> torch.Tensor:
        """The shape-dependent part (conv, delta rule, state store per group): mixed [T, conv_dim], b, a [T, Hv]
        -> [T, Hv, Dv] in mixed's dtype (rows of no group left unset)."""
        if len(groups) == 1 and groups[0].in_order:  # one group of every row in order: no scatter
            return groups[0].scatter_rows(self._attend(groups[0], mixed, b, a, states))[1]
        core = mixed.new_empty(mixed.shape[0], self.num_v_heads, self.v_dim)  # [T, Hv, Dv]
        for group in groups:
            rows, out = group.scatter_rows(self._attend(group, mixed, b, a, states))
            core[rows] = out
        return core

    def output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core [T, Hv, Dv] gated by z [T, Hv*Dv] in the norm -> out_proj -> [T, hidden].  Row-wise."""
        tokens = core.shape[0]
        out = self.norm(core, z.view(tokens, self.num_v_heads, self.v_dim))
        return self.out_proj(out.reshape(tokens, self.value_width))

    def _attend(self, group: SequenceGroup | RaggedGroup, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                states: StateBatch) -> torch.Tensor:
        """A group's outputs, in mixed's dtype: [R, Hv, Dv] for a ragged group, [m, n, Hv, Dv] for the others."""
        if isinstance(group, RaggedGroup):
            return self._attend_ragged(group, mixed, b, a, states)
        return self._attend_group(group, mixed, b, a, states)

    def _attend_ragged(self, group: RaggedGroup, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       states: StateBatch) -> torch.Tensor:
        """The ragged group's [R, Hv, Dv] outputs: one convolution over the window table, the gates row by row,
        one kernel launch; its states advanced in their slots."""
        conv_pool, ssm_pool = states.conv[self.state_index], states.ssm[self.state_index]
        take = (lambda t: t) if group.in_order else (lambda t: t[group.rows])
        conved, next_conv = ragged_causal_conv(take(mixed), conv_pool[group.slots], self.conv1d.weight, group)
        rows = conved.shape[0]
        q, k, v = conved.split([self.key_width, self.key_width, self.value_width], dim=-1)
        q, k = (t.reshape(1, rows, self.num_k_heads, self.k_dim) for t in (q, k))
        q, k, beta, g = Kernels.delta_rule_gates(q, k, take(b)[None], take(a)[None], self.A_log, self.dt_bias,
                                                 self.k_dim**-0.5)  # float32 [1, R, Hk, Dk] x 2, [1, R, Hv] x 2
        v = v.reshape(rows, self.num_v_heads, self.v_dim).float()
        out = ragged(q[0], k[0], v, g[0], beta[0], ssm_pool, group.starts, group.counts, group.slots)
        conv_pool[group.slots] = next_conv.to(conv_pool.dtype)
        return out.to(mixed.dtype)

    def _attend_group(self, group: SequenceGroup, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                      states: StateBatch) -> torch.Tensor:
        """One group's [m, n, Hv, Dv] outputs (x's dtype), its states advanced or recorded."""
        m, n = group.rows.shape
        conv_pool, ssm_pool = states.conv[self.state_index], states.ssm[self.state_index]
        conved, window = causal_conv(group.take(mixed), conv_pool[group.slots], self.conv1d.weight)  # [m, n, C]
        q, k, v = conved.split([self.key_width, self.key_width, self.value_width], dim=-1)
        q, k = (t.reshape(m, n, self.num_k_heads, self.k_dim) for t in (q, k))
        q, k, beta, g = Kernels.delta_rule_gates(q, k, group.take(b), group.take(a), self.A_log, self.dt_bias,
                                                 self.k_dim**-0.5)  # float32 [m, n, Hk, Dk] x 2, [m, n, Hv] x 2
        v = v.reshape(m, n, self.num_v_heads, self.v_dim)  # [m, n, Hv, Dv], x's dtype
        if group.real is not None:  # rows past a sequence's count: no write (k = v = beta = 0), no decay (g = 0)
            real = group.real.unsqueeze(-1)  # [m, n, 1]
            k, v = k * real.unsqueeze(-1), v * real.unsqueeze(-1)
            beta, g = beta * real, g * real
        token_by_token = group.recurrent or (RAGGED_IN_KERNEL and fused_on(ssm_pool))  # one launch does it all
        if token_by_token and group.kept is None:  # the slots' rows advanced (or, deferred, read) in place
            out, final = recurrent_heads(q, k, v.float(), g, beta, ssm_pool, slots=group.slots,
                                         store=not group.deferred)  # final None: nothing left to scatter
        elif token_by_token:  # only some deferred: one launch stores all its rows or none, so gather / scatter
            out, final = recurrent_heads(q, k, v.float(), g, beta, ssm_pool[group.slots])
        else:
            repeat = self.num_v_heads // self.num_k_heads  # value heads per key head
            out, final = chunked(q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2), v.float(),
                                 g, beta, ssm_pool[group.slots])
        self._store(group, states, window, final, (k, v, g, beta))
        return out.to(mixed.dtype, memory_format=torch.contiguous_format)  # one layout whatever the form

    def _store(self, group: SequenceGroup, states: StateBatch, window: torch.Tensor, final: torch.Tensor | None,
               kvgb: tuple[torch.Tensor, ...]) -> None:
        """Write the advanced states of the group's non-deferred sequences to their slots; record the rest.
        final [m, Hv, Dk, Dv], or None where the delta rule already wrote (or left) the ssm rows in place."""
        conv_pool, ssm_pool = states.conv[self.state_index], states.ssm[self.state_index]
        width = conv_pool.shape[-1]
        if group.counts is None:
            new_conv = window[..., window.shape[-1] - width:]  # the last K-1 inputs
        else:  # a padded group: the K-1 inputs before each sequence's padding
            new_conv = conv_state_after(window, group.counts, width)
        if not group.deferred:
            conv_pool[group.slots] = new_conv.to(conv_pool.dtype)
            if final is not None:
                ssm_pool[group.slots] = final
            return
        d = group.deferred_index  # None: every sequence of the group is deferred
        if d is not None:
            kept = group.kept
            conv_pool[group.slots[kept]] = new_conv[kept].to(conv_pool.dtype)
            ssm_pool[group.slots[kept]] = final[kept]
        fields = dict(slots=group.slots, window=window, k=kvgb[0], v=kvgb[1], g=kvgb[2], beta=kvgb[3])
        kept_fields = {name: states.keep(self.state_index, name, t if d is None else t[d])
                       for name, t in fields.items()}
        states.pending.setdefault(self.state_index, []).append(
            Deferred(seqs=[group.seqs[p] for p in group.deferred], **kept_fields))
