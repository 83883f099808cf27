"""Per-sequence recurrent state of the linear-attention (Gated DeltaNet) layers, and its commit after a
speculative step.

The engine owns the pools (one conv and one ssm tensor per linear layer, a slot per live sequence) and
hands a StateBatch to each forward through `AttentionBatch.states`.  A sequence's rows of the step read
its slot's state; normally the forward writes the advanced state back.  A deferred sequence (a verify
step, whose drafts may be rejected) leaves its slot as it was: the forward records in `pending` what
`commit` needs to advance the slot by only the accepted tokens.

    states = StateBatch(conv, ssm, slots=[3, 8], defer=[True, False])
    logits = model(ids, positions, AttentionBatch(..., states=states), kv_caches)
    commit(states, counts=[2, 0])   # seq 0 keeps its first 2 fed tokens; seq 1 was advanced already

A padded fixed-shape step (a CUDA graph, engine/static_hybrid.py) gives the slots as a device tensor, copies
its records into a RecordArena (fixed memory the graph writes at every replay) and commits them with
`commit_on_device`, whose counts never reach the host.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.models.config import ModelConfig
from specdec.models.delta_rule import conv_state_after, recurrent_heads
from specdec.transfer import upload


@dataclasses.dataclass
class StateBatch:
    conv: list[torch.Tensor]  # per linear layer: [num_slots, conv_dim, kernel - 1] (model dtype), the pool
    ssm: list[torch.Tensor]  # per linear layer: [num_slots, Hv, Dk, Dv] float32, the pool
    slots: list[int] | torch.Tensor  # per sequence of this step: its slot in the pools (host ints, or [B] long
    # on the device for a padded step, whose sequences then all feed the same number of rows)
    defer: list[bool]  # per sequence: True = compute from the slot's state but do not write it back
    pending: dict = dataclasses.field(default_factory=dict)  # linear layer index -> [Deferred], by the forward
    arena: RecordArena | None = None  # where a padded step's records are kept (None: their own tensors)

    def keep(self, layer: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """tensor as a deferred record of `layer` holds it: itself, or its copy in the arena."""
        return tensor if self.arena is None else self.arena.keep((layer, name), tensor)


class RecordArena:
    """One flat buffer per (linear layer, record field) that the deferred records of padded steps are copied
    into, so that every captured CUDA graph writes its records to the same memory (as the runner's logits
    buffer): a graph's records are views valid until the next step.  A buffer grows when a larger shape first
    runs; graphs captured before keep the old one."""

    def __init__(self):
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}

    def keep(self, key: tuple[int, str], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < tensor.numel() or buffer.dtype != tensor.dtype:
            buffer = self.buffers[key] = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        view = buffer[:tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        return view


@dataclasses.dataclass
class Deferred:
    """What one linear layer saw of m deferred sequences that each fed n tokens (float32 unless noted)."""

    seqs: list[int]  # their indices among the step's sequences
    slots: torch.Tensor  # [m] long: their slots
    window: torch.Tensor  # [m, conv_dim, kernel - 1 + n] (model dtype): the conv state, then the n inputs
    k: torch.Tensor  # [m, n, Hk, Dk] l2-normalised keys, one per key head
    v: torch.Tensor  # [m, n, Hv, Dv] (model dtype)
    g: torch.Tensor  # [m, n, Hv] log decays
    beta: torch.Tensor  # [m, n, Hv]

    @property
    def fed(self) -> int:
        return int(self.v.shape[1])


def commit(states: StateBatch, counts: list[int]) -> None:
    """Advance each deferred sequence i's slot by exactly the first counts[i] tokens it fed in the forward
    that filled states.pending (0 <= counts[i] <= fed), as if only those had been fed: the delta rule
    replayed over the saved keys/values/decays from the slot's state, the conv state rebuilt from the saved
    inputs.  Entries of counts for sequences not deferred are ignored.  Empties states.pending."""
    if len(counts) != len(states.slots):
        raise ValueError(f"commit needs one count per sequence of the step ({len(states.slots)}), "
                         f"got {len(counts)}")
    for records in states.pending.values():
        for record in records:
            for i in record.seqs:
                if not 0 <= counts[i] <= record.fed:
                    raise ValueError(f"sequence {i} fed {record.fed} tokens: its count must be in "
                                     f"[0, {record.fed}], not {counts[i]}")
    uploaded: dict[tuple[int, ...], torch.Tensor] = {}  # the same sequences' counts serve every layer
    for layer, records in states.pending.items():
        for record in records:
            mine = [counts[i] for i in record.seqs]
            if not any(mine):
                continue
            key = tuple(record.seqs)
            if key not in uploaded:
                uploaded[key] = upload(mine, record.slots.device)
            _commit_record(states.conv[layer], states.ssm[layer], record, uploaded[key], max(mine))
    states.pending.clear()


def commit_on_device(states: StateBatch, counts: torch.Tensor) -> None:
    """commit for a padded step whose sequences were all deferred, counts [B] long already on the device (the
    padding sequences' 0): no host read and no branch on the counts, so a CUDA graph can hold it.  Every record
    replays all its fed tokens, masked past each count.  Leaves states.pending as it is (a graph's records
    are rewritten at each replay)."""
    for layer, records in states.pending.items():
        for record in records:
            if record.seqs != list(range(len(record.seqs))) or len(record.seqs) != counts.shape[0]:
                raise ValueError(f"commit_on_device needs records of all {counts.shape[0]} sequences in order, "
                                 f"got sequences {record.seqs}")
            _commit_record(states.conv[layer], states.ssm[layer], record, counts, record.fed)


def _commit_record(conv: torch.Tensor, ssm: torch.Tensor, record: Deferred, counts: torch.Tensor,
                   steps: int) -> None:
    """Advance record's slots by counts [m] (device) of their fed tokens; steps = max(counts) on the host."""
    slots = record.slots  # the ssm rows advanced in place (the queries are unused: no outputs)
    recurrent_heads(record.k, record.k, record.v.float(), record.g, record.beta, ssm, counts, steps, slots=slots)
    conv[slots] = conv_state_after(record.window, counts, conv.shape[-1]).to(conv.dtype)


def new_state_pools(config: ModelConfig, num_slots: int, device: torch.device | str,
                    dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed pools for `config`'s linear layers: (conv [num_slots, conv_dim, kernel - 1] in dtype,
    ssm [num_slots, Hv, Dk, Dv] float32), one of each per linear layer, in layer order."""
    c = config
    conv = [torch.zeros(num_slots, c.linear_conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
            for _ in c.linear_layer_ids]
    ssm = [torch.zeros(num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                       dtype=torch.float32, device=device) for _ in c.linear_layer_ids]
    return conv, ssm
