"""What an EAGLE-3 / MTP head runs ahead of the host on a speculative step (issue 21): its observe of the step,
and the next step's chain behind it, queued before the host reads the step's acceptance.

The head's ordinary path is in specdec/speculate/eagle3.py (its module note has the example used here: a verify
step fed x_9 and drafts d1 d2 d3 at positions 9..12 and accepted d1 d2); `HeadAhead` is a part of
Eagle3Speculator, reading its head, graphs, states and stats.

Where the verify step is accepted on its fixed shape (engine/fixed_acceptance.py), the head's observe runs
ahead (`observe_ahead`, issue 21): queued right behind the acceptance, before the host reads it, so the
device runs it while the host reads and commits.  Not knowing yet how many drafts were kept, it feeds every
fed position, tokens from the acceptance's output on the device (in the example: positions 9..12 with x_10,
x_11, x_12 and whatever follows the corrected token), and gathers on the device the output at position
9 + num_accepted (11) as the request's last.  Position 12's key is garbage until the next chain or observe
rewrites it, which happens before anything reads it.  `observe` after the commit then only settles the
bookkeeping.  Steps with a prefill, a tree or a shape the head's graphs do not hold observe after the commit.

Behind that observe the next step's chain can run ahead too (`propose_ahead`, issue 21), so the device goes
acceptance -> observe -> next chain while the host reads, commits and schedules.  Its first position, the
next num_tokens - 1 = start + accepted + 1, is known only on the device: the chain is staged as if no draft
was kept, at start + 1, and shifted there by num_accepted (ChainGraphs.shift_staged: positions, context
lengths and the real rows' slots from the block tables).  In the example: staged at 10, shifted by 2 to 12.
k, the shape bucket and the target's blocks are those of the worst case, every draft kept.  The next `propose`
hands the chain out where it plans exactly the same chains (its tokens, whose copy to the host ran during the
commit), and otherwise drops it, giving a seeded
request's head generator back its draws, so that seeded replies do not depend on it.  Only where the next
step is sure to decode the same requests (Speculation._ahead_ks) and `chain_ahead` is on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.engine.device_drafts import DeviceDrafts
from specdec.engine.fixed_acceptance import Launched
from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledSeq
from specdec.speculate.head_graphs import Layout
from specdec.transfer import upload


class ObservedAhead(NamedTuple):
    """An observe launched before the host read the step's acceptance (Eagle3Speculator.observe_ahead)."""

    seqs: list[ScheduledSeq]  # the step's sequences (the list itself: observe settles only that step)
    starts: list[int]  # seqs[i]'s first fed position
    last: torch.Tensor  # [B, H] the head's output at each sequence's last accepted position
    last_logits: torch.Tensor | None  # [B, V_draft] its logits; None when the step drafted nothing


class ChainAhead(NamedTuple):
    """A draft chain launched before the host read the acceptance of the step it follows (propose_ahead): what
    the next propose hands out instead of drafting again, if it plans the same chains."""

    observed: ObservedAhead  # the early observe whose outputs the chain started from
    ks: dict[str, int]  # request id -> its chain's depth k
    drafts: DeviceDrafts  # the chains' tokens, row per request (drafts.rows), their copy to the host queued
    q: dict[str, torch.Tensor]  # request id -> a sampled request's q rows [k, V_draft]
    generator_states: dict[str, torch.Tensor]  # request id -> its head generator's state before the chain drew


class HeadAhead:
    """The observe_ahead / propose_ahead part of Eagle3Speculator (Speculator's protocol), and the settling and
    hand-out of what they launched, which Eagle3Speculator's observe and propose call."""

    def _init_ahead(self) -> None:
        self.early_observe = True  # observe_ahead runs where it can (False: every observe after the commit)
        self.chain_ahead = True  # propose_ahead launches the next chain where it can (False: every chain in propose)
        self._ahead: ObservedAhead | None = None  # the observe launched ahead of the step being committed
        self._settled: ObservedAhead | None = None  # the last early observe observe() settled
        self._chain_launched: ChainAhead | None = None  # the next step's chain, launched ahead (propose_ahead)

    @torch.inference_mode()
    def observe_ahead(self, seqs: list[ScheduledSeq], starts: list[int], runner, launched: Launched) -> bool:
        """Launch the step's observe before the host knows how many drafts each sequence kept: the head is fed
        every fed position, start .. start + num_new - 1, with the emitted tokens still on the device (fed
        position start + j takes emitted token j, as observe feeds token p + 1 at p), and its output at each
        sequence's last accepted position, start + num_accepted, is gathered on the device.  Only a step of
        decoding chains whose padded shape fits the head's graphs qualifies (_ahead_layout); else False.

        The positions past the accepted ones get keys/values computed from rejected drafts.  They are never
        read: after the commit the head holds num_computed = start + accepted + 1 positions, and positions
        >= num_computed are written before they are read (the next chain's forward 1 writes num_computed
        itself, each later forward its own position, and the next observe rewrites from num_computed on).  The
        writes that land in blocks the commit then trims are queued before, in stream order, any later use of
        those blocks."""
        layout = self._ahead_layout(seqs, starts)
        if self._sleeps(seqs) and layout is not None:  # a step without drafts: its rows kept (head_sleep.py)
            self._ahead = self._keep_ahead(seqs, starts, runner)
            return True
        if self._keeps_any(seqs):  # fed after the commit, led by the kept rows
            return False
        with_logits = self._observe_with_logits(seqs)
        picked = None if layout is None else self._graphs_for(layout, with_logits)
        if picked is None:
            return False
        graphs, shape = picked
        counts = [count for _, _, count in layout]
        features = torch.cat([runner.step_features(i, count) for i, count in enumerate(counts)])  # [T, 3 H_t]
        out, logits = graphs.run_layout(layout, shape, launched.tokens, self.head.project(features))
        if logits is None:
            self.stats["head_observes_without_logits"] += 1
        # sequence i's outputs are rows offset_i .. offset_i + count_i - 1, its last accepted one offset_i + a_i.
        # Example: counts 3 and 2 (offsets 0, 3), accepted 1 and 0: rows 1 and 3.
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        rows = upload(offsets, self.device) + launched.num_accepted  # [B] on the device: no host sync
        self._ahead = ObservedAhead(seqs, list(starts), out.index_select(0, rows),
                                    None if logits is None else logits.index_select(0, rows))
        self.stats["head_observed_ahead"] += 1
        return True

    def _ahead_layout(self, seqs: list[ScheduledSeq], starts: list[int]) -> Layout | None:
        """The head forward's layout (block ids, first position, count) of observing every fed position of a
        step, or None where the step must be observed after its commit: early observes off, no head graphs, a
        sequence that does not decode a chain from its newest token (a prefill, a tree, a step that does not
        sample) or a position past the head's.  (observe_ahead then needs head graphs that hold its shape.)"""
        if not self.early_observe or self.graphs is None:
            return None
        for seq, start in zip(seqs, starts):
            req = seq.request
            decoding = seq.samples and seq.tree_parents is None and seq.num_new == 1 + seq.num_drafts
            if not decoding or start != req.num_computed or start + seq.num_new > self.max_positions:
                return None
        return [(seq.request.block_ids, start, seq.num_new) for seq, start in zip(seqs, starts)]

    def _settle(self, ahead: ObservedAhead) -> None:
        """The committed step's bookkeeping, as observe would leave it: each live request's head holds its
        committed positions, its last output the one gathered at its last accepted position."""
        self._settled = ahead
        observed = 0
        for row, (seq, start) in enumerate(zip(ahead.seqs, ahead.starts)):
            req = seq.request
            if req.finished:
                continue
            state = self._state(req)
            state.computed = req.num_computed  # start + accepted + 1
            state.last = ahead.last[row:row + 1]
            state.last_logits = None if ahead.last_logits is None else ahead.last_logits[row:row + 1]
            observed += req.num_computed - start
        self.stats["head_tokens_observed"] += observed

    # ------------------------------------------------------------------ the next step's chain, launched ahead

    @torch.inference_mode()
    def propose_ahead(self, seqs: list[ScheduledSeq], ks: list[int], launched: Launched) -> bool:
        """Launch the next step's chains right behind this step's early observe, before the host reads how many
        drafts each sequence kept (issue 21); ks[i]: seqs[i]'s k for the next step, capped for its worst case
        (every draft kept).  Each chain starts from the observe's output gathered at the sequence's last
        accepted position, and is staged as if no draft was kept, then shifted on the device by the number
        kept (ChainGraphs.shift_staged).  The next propose hands the chains out if it plans the same ones
        (_take_ahead), else drops them (drop_ahead).  Only where this step was observed ahead, chains are on
        (chain_ahead, tree_width 1, a chain graph) and the worst case's shape fits; returns whether it
        launched."""
        self.drop_ahead()  # (a chain launched ahead is consumed or dropped by the propose after it: a guard)
        ahead = self._ahead
        if not self.chain_ahead or not isinstance(ahead, ObservedAhead) or ahead.seqs is not seqs:
            return False
        if self.tree_width != 1 or self.chain_graphs is None or self.step_by_step:
            return False
        plan = self._ahead_plan(seqs, ahead.starts, ks)
        if plan is None:
            return False
        active = [(req, k) for _, req, k in plan]
        # where each chain starts: staged as if no draft was kept, start + 1; at worst start + num_drafts + 1.
        # Example: a step fed positions 9..12 (start 9, 3 drafts): staged at 10, the bucket's context holding a
        # start of 13 (all 3 kept); the device adds num_accepted, say 2: first position 12 = the next
        # num_tokens - 1 (num_computed 9 + 2 + 1 = 12 after the commit, num_tokens 13).
        firsts = [ahead.starts[row] + 1 for row, _, _ in plan]
        worst = [first + seqs[row].num_drafts for first, (row, _, _) in zip(firsts, plan)]
        shape = self.chain_graphs.chain_shape(active, worst)
        if not self.chain_graphs.shape_fits(shape):
            return False
        rows = upload([row for row, _, _ in plan], self.device)  # [B] each chain's sequence in the step
        saved = {req.request_id: self._state(req).generator.get_state() for req, _ in active
                 if self._state(req).generator is not None}
        uniforms = self._chain_uniforms(active)  # [B, k_max, 1] or None
        states = ahead.last.index_select(0, rows)  # [B, H]
        if ahead.last_logits is None:  # observed without logits (a step without drafts): computed here
            logits = self.head.logits(states)  # [B, V_draft]
        else:
            logits = ahead.last_logits.index_select(0, rows)
        tokens, q = self.chain_graphs.run_chain(
            active, shape, states, logits,
            None if uniforms is None else uniforms[:, :, 0], firsts=firsts,
            shift=launched.num_accepted.index_select(0, rows))
        self.stats["draft_forwards"] += active[0][1] - 1
        q_rows = self._q_rows(active, lambda row, k: [q[row, :k]])
        sampled_q = {req.request_id: next(q_rows) for req, _ in active if not req.params.greedy}
        drafts = DeviceDrafts.queued(tokens, {req.request_id: row for row, (req, _) in enumerate(active)})
        self._chain_launched = ChainAhead(ahead, {req.request_id: k for req, k in active}, drafts, sampled_q, saved)
        self.stats["head_chains_ahead"] += 1
        return True

    def _ahead_plan(self, seqs: list[ScheduledSeq], starts: list[int], ks: list[int]
                    ) -> list[tuple[int, Request, int]] | None:
        """(row of the step, request, k) of each chain to launch ahead, longest k first: k capped, and the
        target's blocks taken, for the request's worst case, every draft kept (num_tokens start + num_drafts
        + 2 after the commit), so the chain fits whatever is kept; None where blocks run out.  The blocks past
        what the commit keeps go back to the free list at the commit (Engine._trim_blocks), after the chain
        in stream order."""
        plan = []
        for row, (seq, start, k) in enumerate(zip(seqs, starts, ks)):
            req = seq.request
            most = start + seq.num_drafts + 2
            k = self._chain_depth(req, k, most) if k > 0 else 0
            if k <= 0:
                continue
            if k > 1 and not self._blocks_for_chain(req, k, most):
                return None
            plan.append((row, req, k))
        plan.sort(key=lambda item: -item[2])  # longest chain first, as _chain
        return plan or None

    def _take_ahead(self, requests: list[Request], active: list[tuple[Request, int]]) -> bool:
        """Hand out the chains propose_ahead launched, as _chain_in_graph does (_give_chains), where they are exactly the chains planned here
        (active): the same requests at the same depths, each drafting from the early observe the commit settled.

        A request of the launched chains that finished at the commit is left out: its chain wrote the head's
        keys at positions past its end, in blocks the commit released after the chain in stream order (any
        later owner of those blocks writes them before it reads them).  Anything else that differs (a request
        not drafting now, another k, the head's state not that observe's) and the chains are dropped."""
        launched = self._chain_launched
        if launched is None or not active or launched.observed is not self._settled:
            return False
        live = {req.request_id for req in requests}
        if {rid: k for rid, k in launched.ks.items() if rid in live} != {req.request_id: k for req, k in active}:
            return False
        self._chain_launched = None
        # the tokens are read now: their copy, queued behind the chains, ran during the commit
        self._give_chains(active, launched.drafts,
                          iter([launched.q[req.request_id] for req, _ in active if not req.params.greedy]))
        return True

    def drop_ahead(self) -> None:
        """Drop the chains propose_ahead launched, if any: their tokens are never read, and each seeded
        request's head generator gets back the draws they took, so a seeded reply is the same whether or not
        a chain ran ahead (the chain drafted again in propose draws them anew)."""
        launched, self._chain_launched = self._chain_launched, None
        if launched is None:
            return
        for request_id, generator_state in launched.generator_states.items():
            state = self.states.get(request_id)
            if state is not None:
                state.generator.set_state(generator_state)
        self.stats["head_chains_ahead_dropped"] += 1
