"""Model runner: turns a list of scheduled sequences into one flat forward pass."""

from __future__ import annotations

import torch

from specdec.draft_tree import ancestor_mask, depths
from specdec.engine.kv_cache import KVCache, slot_of
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.attention import AttentionBatch
from specdec.models.transformer import CausalLM
from specdec.transfer import upload


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device, static=None, piecewise=None,
                 states=None):
        self.model = model
        model.fuse_projections()  # one GEMM for q/k/v and one for gate/up (weights become views: no copy)
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.static = static  # StaticRunner for uniform decode/verify steps (CUDA graphs on GPU), or None
        self.eager_forwards = 0  # forwards that did not take the fixed-shape path (prefills, other shapes)
        self.static_step = False  # whether the last forward took it
        self.piecewise = piecewise  # PiecewiseRunner for those (all but attention as CUDA graphs), or None
        self.feature_rows: list[int] = []  # the last forward's row of each sequence's first fed token
        self.states = states  # engine/state_slots.StateSlots of a hybrid model, or None

    def step_features(self, seq_index: int, count: int) -> torch.Tensor:
        """[count, F] the model's captured features (CausalLM.capture_features) of the first `count` tokens
        sequence seq_index fed in the last forward: a view, valid until the next forward."""
        row = self.feature_rows[seq_index]
        return self.model.features[row:row + count]

    def takes_static(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether the fixed-shape runner takes forward(seqs) (a step whose inputs it can take from the device)."""
        return self.static is not None and self.static.can_run(seqs)

    @torch.inference_mode()
    def forward(self, seqs: list[ScheduledSeq], fed_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Logits [1 + num_drafts, V] for each sequence that samples this step, else an empty tensor.

        For a sampling sequence the rows are the target's predictions after its last committed token
        and after each of its drafts: row j scores draft j, the last row gives the bonus token.

        fed_ids [len(seqs)] (a device tensor), for steps where every sequence feeds one token: the tokens to
        feed, in place of the request's stored ones (a drafter's chain feeds back the draft it just drew
        without waiting for the host to read it).
        """
        if fed_ids is not None and any(s.num_new != 1 for s in seqs):
            raise ValueError("fed_ids needs every sequence to feed exactly one token")
        self.static_step = self.takes_static(seqs)
        if self.static_step:
            logits = self.static.run(seqs, fed_ids)
            self.feature_rows = self.static.row_starts
            return logits
        self.eager_forwards += 1
        ids, positions, slots, starts, ctx, logits_rows, counts = [], [], [], [0], [], [], []
        for seq in seqs:
            req = seq.request
            start = req.num_computed
            tokens = req.token_ids_between(start, start + seq.num_new - seq.num_drafts)
            tokens += req.draft_token_ids[:seq.num_drafts]
            ids.extend(tokens)
            positions.extend(start + offset for offset in fed_offsets(seq))
            slots.extend(self._slot(req.block_ids, p) for p in range(start, start + seq.num_new))
            starts.append(starts[-1] + seq.num_new)
            ctx.append(start + seq.num_new)
            n_logits = 1 + seq.num_drafts if seq.samples else 0
            logits_rows.extend(range(starts[-1] - n_logits, starts[-1]))
            counts.append(n_logits)
        self.feature_rows = starts[:-1]
        tree = None
        if any(s.tree_parents is not None for s in seqs):
            tree = self._long(tree_mask_rows(seqs, max(s.num_new for s in seqs))).bool()  # [T, max_q]
        batch = self._batch(seqs, starts, ctx, slots, tree)
        if self.states is not None:
            batch.states = self.states.batch(seqs)
        ids = self._long(ids) if fed_ids is None else fed_ids.to(device=self.device, dtype=torch.long)
        piecewise = self.piecewise is not None and self.piecewise.fits(len(positions))
        model = self.piecewise.forward if piecewise else self.model
        logits = model(ids, self._long(positions), batch, self.kv_cache.layers,
                       self._long(logits_rows))  # [sum(counts), V]
        return list(torch.split(logits, counts))

    @torch.inference_mode()
    def forward_all_rows(self, seq: ScheduledSeq) -> torch.Tensor:
        """Logits [num_new, V] at every fed position of one sequence (scoring; always eager)."""
        req = seq.request
        start = req.num_computed
        ids = self._long(req.token_ids_between(start, start + seq.num_new))
        positions = torch.arange(start, start + seq.num_new, device=self.device)
        slots = [self._slot(req.block_ids, p) for p in range(start, start + seq.num_new)]
        batch = self._batch([seq], [0, seq.num_new], [start + seq.num_new], slots)
        if self.states is not None:
            batch.states = self.states.batch([seq])
        return self.model(ids, positions, batch, self.kv_cache.layers)

    @torch.inference_mode()
    def keep_path(self, seq_index: int, seq: ScheduledSeq, start: int, rows: list[int]) -> None:
        """After a tree verify fed at positions from `start`: move the accepted nodes' keys/values (every layer)
        and captured features to the fed rows a chain of the same drafts would have used, so that what follows
        (commit, rollback of the rest, a head's observe) reads the accepted path as a chain.

        rows: the verdict's rows (specdec/verify_tree.py): rows[j + 1] - 1 is the node accepted as draft j.
        Example: the root fed at index 0 and nodes 0..5 at 1..6, path nodes 0 then 4 (rows [0, 1, 5]): draft 1
        moves from fed index 5 to 2; draft 0 is already at 1."""
        committed = seq.num_new - seq.num_drafts  # the root is fed index committed - 1
        moves = [(committed + row - 1, committed + j) for j, row in enumerate(rows[1:]) if row - 1 != j]
        if not moves:
            return
        blocks = seq.request.block_ids
        src = self._long([self._slot(blocks, start + f) for f, _ in moves])
        dst = self._long([self._slot(blocks, start + f) for _, f in moves])
        self.kv_cache.move_slots(src, dst)
        if self.model.features is not None:
            base = self.feature_rows[seq_index]
            features = self.model.features
            features[self._long([base + f for _, f in moves])] = features[self._long([base + f for f, _ in moves])]

    def _slot(self, block_ids: list[int], position: int) -> int:
        return slot_of(block_ids, position, self.block_size)

    def _long(self, values) -> torch.Tensor:
        return upload(values, self.device)

    def _batch(self, seqs: list[ScheduledSeq], starts, ctx, slots, tree_mask=None) -> AttentionBatch:
        return flat_attention_batch([s.request.block_ids for s in seqs], starts, ctx, slots, self.block_size,
                                    self.device, tree_mask)


def flat_attention_batch(block_ids: list[list[int]], starts: list[int], ctx: list[int], slots: list[int],
                         block_size: int, device: torch.device, tree_mask: torch.Tensor | None = None
                         ) -> AttentionBatch:
    """The AttentionBatch of a flat step: sequence i's queries are rows starts[i]..starts[i + 1] (starts has one
    entry more than sequences), its context ctx[i] tokens, its keys in blocks block_ids[i]; tree_mask: per flat
    row (models/attention.py), for steps that verify draft trees."""
    def long(values):
        return upload(values, device)

    width = max(len(b) for b in block_ids)
    tables = [b + [0] * (width - len(b)) for b in block_ids]
    counts = [b - a for a, b in zip(starts, starts[1:])]
    return AttentionBatch(
        query_start=long(starts),
        context_lens=long(ctx),
        block_tables=long(tables),
        slot_mapping=long(slots),
        max_query_len=max(counts),
        max_context_len=max(ctx),  # each query-length group pads its own keys (split_by_query_length)
        host_lens=(counts, list(ctx)),
        tree_mask=tree_mask,
    ).prepare(block_size)


def fed_offsets(seq: ScheduledSeq) -> list[int]:
    """Each fed token's position after the first fed one: 0, 1, 2, ... for a chain; a tree's nodes sit at the
    root's position plus their depth."""
    parents = seq.tree_parents
    committed = seq.num_new - seq.num_drafts
    if parents is None:
        return list(range(seq.num_new))
    return list(range(committed)) + [committed - 1 + d for d in depths(parents)]


def tree_mask_rows(seqs: list[ScheduledSeq], width: int) -> list[list[int]]:
    """[T][width] the per-row tree mask of a flat step (models/attention.py): row r of a sequence sees its fed
    rows j <= r (a chain, or the committed tokens before a tree's root) or, for a tree node, the root, its
    ancestors and itself."""
    out = []
    for seq in seqs:
        committed, parents = seq.num_new - seq.num_drafts, seq.tree_parents
        rows = [[int(j <= r) for j in range(width)] for r in range(committed if parents else seq.num_new)]
        if parents is not None:
            for mask in ancestor_mask(parents)[1:]:  # node rows: committed context, then the tree's columns
                rows.append([1] * (committed - 1) + [int(m) for m in mask] + [0] * (width - committed - len(mask) + 1))
        out.extend(rows)
    return out
