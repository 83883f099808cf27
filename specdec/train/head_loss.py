"""The training-time test (EAGLE-3 and MTP heads alike): the head unrolled on its own states for several steps, a loss at each.

While drafting, a chain rooted at position r (the head has read the target's states up to r) runs step s
at position r + s: the token input is the draft for position r + s + 1 and the state input is the head's
own output of step s - 1 at position r + s - 1.  Teacher-forced, every root is trained at once: at step s,
position p belongs to root p - s, its token input is x_{p+1} (the draft, if the earlier ones were right),
its state input the step-(s - 1) output at p - 1, and it predicts x_{p+2}.  Its attention sees

    the step-0 keys of the real positions 0 .. p - s            (what the head had read at the root)
    the step-j key at position p - s + j, for j = 1 .. s        (its own chain so far; j = s is itself)

Example, s = 2, p = 7: root 5; keys of step 0 at 0..5, of step 1 at 6, of step 2 at 7.

The loss at step s is the cross-entropy of the head's distribution against the target's next-token
distribution at p + 1 over the draft vocabulary (the KL up to a constant), weighted decay^s.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from specdec.models.fused import plain_kernels


class UnrolledHead(Protocol):
    """What the unrolling needs of a head (train/head_unroll.py: EAGLE-3's, MTP's), on [B, T] batches."""

    scale: float  # the attention's softmax scale

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot] for positions [T]."""

    def first_state(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [B, T, F] -> step 0's state input [B, T, H]."""

    def heads(self, embed: torch.Tensor, state: torch.Tensor, cos_sin) -> tuple[torch.Tensor, ...]:
        """(q [B, T, Hq, D], k, v [B, T, Hkv, D], carry: what finish needs) of one step's attention."""

    def finish(self, attended: torch.Tensor, carry) -> torch.Tensor:
        """The attention's output [B, T, Hq, D] -> the step's output [B, T, H], the state the next step reads."""

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        """A step's output [B, T, H] -> logits [B, T, V_draft]."""

    def target_ids(self) -> torch.Tensor | None:
        """[V_draft] the target id of each draft id; None: the draft vocabulary is the target's."""


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, T, ...] moved n positions later along T (row p holds x[p - n]); the first n rows are zeros."""
    if n == 0:
        return x
    return torch.cat([x.new_zeros(x.shape[0], n, *x.shape[2:]), x[:, :-n]], dim=1)


def unrolled_logits(head: UnrolledHead, embed: torch.Tensor, features: torch.Tensor,
                    steps: int) -> list[torch.Tensor]:
    """embed [B, T, H] (the embedding of token p + 1 at row p), features [B, T, F] (the target's at p)
    -> per step s < steps the head's logits [B, T, V_draft] at every position (rows p < s are meaningless)."""
    batch, tokens, _ = embed.shape
    positions = torch.arange(tokens, device=embed.device)
    causal = positions[None, :] <= positions[:, None]  # [T(query), T(key)]
    keys, values, out = [], [], []
    with plain_kernels():  # the plain pieces take [B, T, ...] as well as [T, ...]
        cos_sin = head.rotary(positions, embed.dtype)
        state = head.first_state(features)  # step 0's states [B, T, H]
        for s in range(steps):
            q, k, v, carry = head.heads(embed, state, cos_sin)  # [B, T, Hq | Hkv, D]
            keys.append(k)
            values.append(v)
            output = head.finish(_chain_attention(q, keys, values, causal, s, head.scale), carry)  # [B, T, H]
            out.append(head.logits(output))
            state = shift(output, 1)  # step s + 1 at p reads step s's output at p - 1
    return out


def _chain_attention(q, keys, values, causal, s: int, scale: float) -> torch.Tensor:
    """Attention of step s's queries q [B, T, Hq, D] over the step-0 keys of positions <= p - s and the step-j
    keys at position p - s + j (j = 1..s): see the module's note.  keys/values: one [B, T, Hkv, D] per step."""
    group = q.shape[2] // keys[0].shape[2]

    def expand(t):  # [B, T, Hkv, D] -> [B, T, Hq, D]: query head h reads kv head h // group
        return t.repeat_interleave(group, dim=2)

    k0, v0 = expand(keys[0]), expand(values[0])
    q = q * scale  # scaled here, on [B, T, Hq, D], not on the [B, Hq, T, T + s] scores
    scores0 = torch.einsum("bqhd,bkhd->bhqk", q, k0)  # [B, Hq, T, T]
    visible = shift(causal[None], s)[0] if s else causal  # row p: keys <= p - s
    if s:
        visible = visible.clone()
        visible[:s, 0] = True  # rows of no root (p < s) see key 0, so softmax stays finite; their loss is 0
    scores0 = scores0.masked_fill(~visible, float("-inf"))
    chain_k = [expand(shift(keys[j], s - j)) for j in range(1, s + 1)]  # row p: step j's key at p - s + j
    chain_v = [expand(shift(values[j], s - j)) for j in range(1, s + 1)]
    # a query's dot product with its own chain key, elementwise (as a batched GEMM it was B T Hq products of
    # 1 x D by D x 1), with float products as the GEMM's
    diagonal = [(q.float() * k).sum(-1).to(q.dtype).transpose(1, 2)[..., None] for k in chain_k]  # [B, Hq, T, 1]
    scores = torch.cat([scores0, *diagonal], dim=-1)  # [B, Hq, T, T + s]
    weights = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)  # float inside, no float copy
    out = torch.einsum("bhqk,bkhd->bqhd", weights[..., :q.shape[1]], v0)
    for j, v in enumerate(chain_v):
        out = out + weights[..., q.shape[1] + j].transpose(1, 2)[..., None] * v
    return out


def soft_cross_entropy(logits: torch.Tensor, target_logprobs: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """-sum_v p_v log softmax(logits)_v per row: logits [..., V], target_logprobs [..., V] (log p) -> [...].
    fused (default: on CUDA): one Triton launch computes it and its gradient (specdec/kernels/soft_cross_entropy.py);
    otherwise the same sum with tensors."""
    if logits.is_cuda if fused is None else fused:
        from specdec.kernels.soft_cross_entropy import SoftCrossEntropy

        vocab = logits.shape[-1]
        ce = SoftCrossEntropy.apply(logits.reshape(-1, vocab), target_logprobs.reshape(-1, vocab))
        return ce.view(logits.shape[:-1])
    return -(target_logprobs.float().exp() * F.log_softmax(logits, dim=-1, dtype=torch.float32)).sum(-1)


def head_loss(head: UnrolledHead, embed: torch.Tensor, features: torch.Tensor, target_logprobs: torch.Tensor,
              lengths: torch.Tensor, steps: int, decay: float = 0.8, fused: bool | None = None,
              row_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weighted loss, [steps] per-step accuracy of the argmax against the target's), both on the device:
    reading either is a host sync, which the training loop makes only when it logs.  fused: soft_cross_entropy's.
    row_loss(step logits [B, T, V_draft], target_logprobs) -> [B, T]: another loss per position than the
    cross-entropy (bench/head_objective.py's), masked and weighted per step as it is.

    target_logprobs [B, T, V_draft]: the target's log-distribution at row p + 1 over the draft vocabulary,
    placed at row p (what position p's head output must predict); lengths [B]: real tokens per row.
    Position p of step s counts when p >= s and p + 1 < length."""
    logits = unrolled_logits(head, embed, features, steps)
    positions = torch.arange(embed.shape[1], device=embed.device)
    in_row = positions[None, :] + 1 < lengths[:, None]  # [B, T]
    target_argmax = target_logprobs.argmax(-1)  # [B, T]
    total, accuracy, weight_sum = 0.0, [], 0.0
    for s, step_logits in enumerate(logits):
        mask = (in_row & (positions[None, :] >= s)).float()  # [B, T]
        ce = (row_loss(step_logits, target_logprobs) if row_loss is not None
              else soft_cross_entropy(step_logits, target_logprobs, fused))  # [B, T]
        total = total + decay**s * (ce * mask).sum() / mask.sum().clamp(min=1)
        weight_sum += decay**s
        hit = (step_logits.argmax(-1) == target_argmax).float()
        accuracy.append((hit * mask).sum() / mask.sum().clamp(min=1))
    return total / weight_sum, torch.stack(accuracy).detach()
