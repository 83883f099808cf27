"""EAGLE-3 speculation: a one-layer head drafts a chain of k tokens from the target's own hidden states.

The head's KV cache has one layer and as many blocks as the target's, and is indexed by the target's block
tables: head position p sits in the same slot as target position p, so prefix-cache hits, preemption and
block release need no bookkeeping of their own.

After every target step (`observe`), the head reads what that forward computed.  For each request, the
positions whose keys the step committed, p = start .. num_computed - 1, are fed to the head in one batched
forward: the embedding of token p + 1 beside fc(the target's features at p).  The output at the last
position predicts the request's next token, the first draft.  Example: a verify step fed x_9 and drafts d1 d2
d3 at positions 9..12 and accepted d1 d2 (so x_10 = d1, x_11 = d2, x_12 = the corrected token); the head
is fed positions 9, 10, 11 with tokens x_10, x_11, x_12 beside the target's features at 9, 10, 11, and its
output at 11 predicts x_13.

Where the verify step is accepted on its fixed shape, that forward, and the next step's chain behind it,
can be queued before the host reads the acceptance (specdec/speculate/head_ahead.py).

`propose` then draws draft 1 from that output and runs k - 1 one-token forwards, each feeding the draft just
drawn (a device tensor: no host round trip) beside the head's own previous output, at positions
num_tokens - 1 onwards.  Those positions are overwritten by the next `observe`, which feeds the verified
tokens there.  The chain needs the target's blocks up to its last position; it takes them from the target's
block manager (the verify step needs them anyway), and a request that gets none drafts one token.  Requests
are chained longest k first, so the rows still drafting at any forward are a prefix of the batch.

With tree_width m > 1 the head drafts a tree instead (specdec/draft_tree.py spine_and_siblings): the same
chain of forwards, fed each depth's first candidate (the spine), and beside every spine node the depth's other
m - 1 candidates as leaves.  A greedy request's candidates are the head's m best tokens; a sampled request's
are m independent draws from the head's distribution at its settings, verified against that distribution
(specdec/verify_tree.py).

With static shapes (on a GPU, with the target's) the forwards run through HeadGraphs: padded buckets
replayed as CUDA graphs, inputs staged without waiting for the device; an observe of a prefill's many
positions runs eagerly beside them.  A chain (tree_width 1) whose shape fits runs whole as one ChainGraphs
replay (specdec/speculate/chain_graph.py): every draw and forward on the device, settings and uniforms as
tensors; trees and shapes that do not fit go step by step.

An observe of a step that drafted nothing (k = 0 for every sequence) skips its outputs' logits, a GEMV over the
head's whole LM head (specdec/speculate/head_graphs.py's note): the head's state keeps last_logits None, and the
chain that drafts from it next, if any, computes them from its last output (`observe_logits_always`: always
compute them, as before).  Such a step's plain decode rows are not even observed while the head sleeps
(specdec/speculate/head_sleep.py): their feature rows are kept and fed in one forward when it next drafts.
"""

from __future__ import annotations

import torch

from specdec.draft_tree import spine_and_siblings
from specdec.engine.device_drafts import DeviceDrafts
from specdec.engine.kv_cache import BlockManager, KVCache, slot_of
from specdec.engine.request import Request
from specdec.engine.runner import flat_attention_batch
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.eagle3 import Eagle3Head
from specdec.speculate.base import Speculator
from specdec.speculate.chain_graph import ChainGraphs
from specdec.speculate.draw import draw_drafts
from specdec.speculate.head_ahead import HeadAhead
from specdec.speculate.head_graphs import HeadGraphs, Layout
from specdec.speculate.head_piecewise import HeadPiecewise
from specdec.speculate.head_sleep import HeadSleep, KeptAhead
from specdec.transfer import upload
from specdec.verify import in_target_vocab


class HeadState:
    """The head's view of one request: how many leading positions its KV holds, and its last output."""

    def __init__(self, device: torch.device, seed: int | None):
        self.computed = 0
        self.last: torch.Tensor | None = None  # [1, H] the head's output at position computed - 1
        self.last_logits: torch.Tensor | None = None  # [1, V_draft] its logits, when the forward computed them
        self.pending: list[torch.Tensor] = []  # [1, F] feature rows of positions computed.. kept asleep (head_sleep)
        self.generator = None
        if seed is not None:  # a seeded request drafts reproducibly, from a stream of its own
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed ^ 0xEA61E)


class Eagle3Speculator(HeadAhead, HeadSleep, Speculator):
    name = "eagle3"
    has_draft_model = True  # proposing costs head forwards (the cost model times one: see HeadCostRunner)

    def __init__(self, head: Eagle3Head, blocks: BlockManager, target_vocab: int, feature_layers: tuple[int, ...],
                 static_shapes: bool = False, max_batch: int = 256, max_context: int = 8192,
                 cuda_graphs: bool = True, tree_width: int = 1):
        self.head = head
        head.fuse_projections()  # one GEMM for q/k/v and one for gate/up, as the target's (weights become views)
        self.tree_width = tree_width  # candidates per depth (1: a chain, drafted at each request's settings)
        self.device = head.lm_head.weight.device
        self.blocks = blocks  # the target's: the head's cache is indexed by the target's block tables
        self.block_size = blocks.block_size
        self.target_vocab = target_vocab
        self.feature_layers = feature_layers
        self.kv = KVCache(head.config.layer, blocks.num_blocks, blocks.block_size, self.device,
                          head.lm_head.weight.dtype)
        self.target_ids = head.target_ids()  # [V_draft]
        self.max_positions = head.config.layer.max_position_embeddings
        self.states: dict[str, HeadState] = {}
        self.graphs = self.graphs_without_logits = self.chain_graphs = None
        if static_shapes:  # q up to 33: an observe after a verify of up to 32 drafts, as the target's steps
            self.graphs = HeadGraphs(head, self.kv, self.device, max_batch, max_q=33, max_context=max_context,
                                     capture=cuda_graphs)
            # an observe after a step that drafted nothing: one position a sequence, outputs without logits
            self.graphs_without_logits = HeadGraphs(head, self.kv, self.device, max_batch, max_q=1,
                                                    max_context=max_context, capture=cuda_graphs,
                                                    with_logits=False, pool=self.graphs.pool)
            self.chain_graphs = ChainGraphs(head, self.kv, self.device, max_batch, max_depth=32,
                                            max_context=max_context, capture=cuda_graphs,
                                            target_ids=self.target_ids, pool=self.graphs.pool)
        self.step_by_step = False  # True: chains take the step-by-step path even where a chain graph fits
        self.observe_logits_always = False  # True: observes compute logits even after a step without drafts
        self._init_ahead()  # what runs ahead of the host (speculate/head_ahead.py)
        self._init_sleep()  # steps without drafts keep their rows (speculate/head_sleep.py)
        self.runner = HeadCostRunner(self)
        self.piecewise: HeadPiecewise | None = None  # eager forwards as two graphs around attention (opt-in)
        self.stats = {"draft_forwards": 0, "head_tokens_observed": 0, "skipped_no_blocks": 0,
                      "head_eager_forwards": 0,  # forwards that did not fit the padded buckets
                      "head_observed_ahead": 0,  # steps observed before the host read their acceptance
                      "head_chains_ahead": 0,  # chains launched before the host read the last step's acceptance
                      "head_chains_ahead_dropped": 0,  # of those, chains the next step did not use
                      "head_observes_without_logits": 0,  # observes of a step without drafts that skipped logits
                      "head_positions_kept": 0,  # positions of steps without drafts kept asleep (head_sleep.py)
                      "head_wakes": 0}  # forwards feeding kept positions before a chain

    # ------------------------------------------------------------------ after the target's step

    @torch.inference_mode()
    def observe(self, seqs: list[ScheduledSeq], starts: list[int], runner) -> None:
        """Feed the head every position the target's step committed (see the module's note); where
        observe_ahead fed them already, settle what it launched."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.seqs is seqs:
            if isinstance(ahead, KeptAhead):
                self._settle_kept(ahead)
            else:
                self._settle(ahead)
            return
        rows = []  # (request, first position, count, ids: token p + 1 for position p, features [count, 3 H_t])
        for i, (seq, start) in enumerate(zip(seqs, starts)):
            req = seq.request
            count = req.num_computed - start
            if req.finished or count <= 0 or start + count > self.max_positions:
                continue
            rows.append((req, start, count, req.token_ids_between(start + 1, start + 1 + count),
                         runner.step_features(i, count)))
        self._feed(self._sleep_or_wake(rows, self._sleeps(seqs)), self._observe_with_logits(seqs))

    def _feed(self, rows, with_logits: bool) -> None:
        """Head forwards over these rows: those of at most the graphs' q positions in one, longer ones in
        another (eager)."""
        short = self.graphs.max_q if self.graphs is not None else 0
        for group in ([r for r in rows if r[2] <= short], [r for r in rows if r[2] > short]):
            if group:
                self._observe(group, with_logits)

    def _observe_with_logits(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether an observe of this step computes its outputs' logits: where some sequence had drafts (the next
        step likely drafts too, and its chain reads them), or always with observe_logits_always."""
        return self.observe_logits_always or any(seq.num_drafts > 0 for seq in seqs)

    def _observe(self, rows, with_logits: bool) -> None:
        """One head forward over these rows' positions; each request keeps its output at its last one."""
        ids = [t for row in rows for t in row[3]]
        states = self.head.project(torch.cat([row[4] for row in rows]))  # [T, H]
        out, logits = self._forward(ids, states, [(req.block_ids, start, count) for req, start, count, _, _ in rows],
                                    with_logits)
        if not with_logits and logits is None:
            self.stats["head_observes_without_logits"] += 1
        end = 0
        for req, start, count, _, _ in rows:
            end += count
            state = self._state(req)
            state.computed, state.last = start + count, out[end - 1:end]
            state.last_logits = None if logits is None else logits[end - 1:end]
        self.stats["head_tokens_observed"] += end

    # ------------------------------------------------------------------ before the target's step

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]) -> None:
        """Each request's chain of up to ks[i] drafts.  Where propose_ahead launched this step's chains already
        and they are the chains planned here, they are handed out instead of drafted again; otherwise they are
        dropped (drop_ahead) and the chains drafted here.  A request whose head sleeps is woken first."""
        self._wake([req for req, k in zip(requests, ks) if k > 0])
        active = []
        for req, k in zip(requests, ks):
            req.clear_drafts()
            state = self.states.get(req.request_id)
            if k <= 0 or state is None or state.last is None or state.computed != req.num_tokens - 1:
                continue  # the head has not seen this request's newest position (nothing to draft from)
            k = self._chain_depth(req, k, req.num_tokens)
            if k > 1 and not self._blocks_for_chain(req, k, req.num_tokens):
                k = 1  # the first draft needs no head forward, so no block
                self.stats["skipped_no_blocks"] += 1
            if k > 0:
                active.append((req, k))
        if self._take_ahead(requests, active):
            return
        self.drop_ahead()
        if active:
            self._chain(active)

    def _chain_depth(self, req: Request, k: int, num_tokens: int) -> int:
        """k capped where the head has positions: a chain from num_tokens - 1 writes up to num_tokens + k - 3."""
        return min(k, self.max_positions - num_tokens + 1)

    def tree_nodes(self, k: int) -> int:
        """Draft tokens a verify step of depth k feeds per request."""
        return k * self.tree_width

    def q_width(self) -> tuple[int, bool]:
        """(width, mapped) of a sampled request's draft_probs (Speculator.q_width): the head's draft vocabulary,
        mapped by target_ids (req.draft_vocab), or without target_ids (an MTP head over the target's vocabulary)
        the target's, padded there by _q_rows."""
        if self.target_ids is None:
            return self.target_vocab, False
        return len(self.target_ids), True

    def _chain(self, active: list[tuple[Request, int]]) -> None:
        """Draft 1 from each request's last head output, then k - 1 forwards, all requests batched."""
        active = sorted(active, key=lambda item: -item[1])  # longest chain first: live rows are a prefix
        reqs = [r for r, _ in active]
        uniforms = self._chain_uniforms(active)  # [B, k_max, m] or None
        last = [self.states[r.request_id] for r in reqs]
        states = torch.cat([s.last for s in last])  # [B, H]
        logits = torch.cat([s.last_logits for s in last]) if all(s.last_logits is not None for s in last) else None
        shape = self._chain_graph_shape(active)
        if shape is not None:
            self._chain_in_graph(active, shape, states, logits, uniforms)
            return
        drawn = [self._draw(reqs, states, logits, uniforms, 0)]  # per forward: its tokens, q rows
        for i in range(1, active[0][1]):
            live = sum(1 for _, k in active if k > i)
            reqs, states = reqs[:live], states[:live]
            # chain forward i feeds draft i at position num_tokens - 2 + i
            tokens = drawn[-1][0]  # [B] drafts, or [B, m] a tree's candidates (the first is the spine's)
            states, logits = self._forward((tokens if tokens.dim() == 1 else tokens[:, 0])[:live], states,
                                           [(r.block_ids, r.num_tokens - 2 + i, 1) for r in reqs])
            self.stats["draft_forwards"] += 1
            drawn.append(self._draw(reqs, states, logits, uniforms, i))
        self._hand_out(active, drawn)

    def _chain_graph_shape(self, active: list[tuple[Request, int]]) -> tuple[int, int, int] | None:
        """The chain graph's (batch, depth, context) bucket for this chain, or None: a tree, no static shapes, or
        a shape that does not fit (they go step by step)."""
        if self.tree_width != 1 or self.chain_graphs is None or self.step_by_step:
            return None
        shape = self.chain_graphs.chain_shape(active)
        return shape if self.chain_graphs.shape_fits(shape) else None

    def _chain_in_graph(self, active, shape, states: torch.Tensor, logits: torch.Tensor | None,
                        uniforms: torch.Tensor | None) -> None:
        """The whole chain as one replay (specdec/speculate/chain_graph.py), then the one read-back."""
        if logits is None:  # an eager observe's output (a prefill): its logits, queued on the device
            logits = self.head.logits(states)  # [B, V_draft]
        tokens, q = self.chain_graphs.run_chain(active, shape, states, logits,
                                                None if uniforms is None else uniforms[:, :, 0])
        self.stats["draft_forwards"] += active[0][1] - 1
        q_rows = self._q_rows(active, lambda row, k: [q[row, :k]])
        drafts = DeviceDrafts.queued(tokens, {req.request_id: row for row, (req, _) in enumerate(active)})
        self._give_chains(active, drafts, q_rows)

    def _give_chains(self, active, drafts: DeviceDrafts, q_rows) -> None:
        """Give each request its chain of a chain graph's drafts (drafts.rows: request id -> its row), read now
        (the one host sync, on their copy queued behind the chains)."""
        rows, tokens = drafts.rows, drafts.read()  # [B, depth]
        self._give(active, [[[t] for t in tokens[rows[req.request_id]][:k]] for req, k in active], q_rows)

    def _chain_uniforms(self, active: list[tuple[Request, int]]) -> torch.Tensor | None:
        """[B, k_max, m] the uniforms of every draw of the chain (m = tree_width draws a depth, one uniform each),
        drawn at once: a seeded request's from its own stream (so what it drafts does not depend on its batch),
        the others' in one call; None when every request is greedy."""
        if all(r.params.greedy for r, _ in active):
            return None
        depth, width = active[0][1], self.tree_width
        out = torch.rand(len(active), depth, width, device=self.device)
        for row, (req, k) in enumerate(active):
            generator = self._state(req).generator
            if generator is not None:  # its own k draws only: how long the batch's chains are does not matter
                out[row, :k] = torch.rand(k, width, generator=generator, device=self.device)
        return out

    def _hand_out(self, active, drawn) -> None:
        """Read every forward's drafts back at once (the one host sync) and give each request its chain, or its
        tree: the spine (each depth's first candidate), then each depth's other candidates (spine_and_siblings'
        layout); a sampled request also gets each depth's q [k, V_draft] in the head's draft vocabulary, with
        the target id of each column (req.draft_vocab; for a tree, row r: the distribution of the children of
        fed row r, 0 the root's)."""
        counts = [tokens.shape[0] for tokens, _ in drawn]  # forward i's live rows
        tops = [t.tolist() for t in torch.cat([t.view(t.shape[0], -1) for t, _ in drawn]).split(counts)]
        self._give(active, [[tops[d][row] for d in range(k)] for row, (_, k) in enumerate(active)],
                   self._q_rows(active, lambda row, k: [qs[row] for _, qs in drawn if row < len(qs)]))

    def _give(self, active, candidates: list[list[list[int]]], probs) -> None:
        """candidates[row][d]: request row's candidates at depth d (target ids, the spine's first); probs: each
        sampled request's q [k, V_draft] in turn."""
        for row, (req, k) in enumerate(active):
            tops = candidates[row]
            req.draft_token_ids = [c[0] for c in tops] + [t for c in tops for t in c[1:]]
            if self.tree_width > 1:
                req.draft_parents = spine_and_siblings(k, self.tree_width)
            if not req.params.greedy:
                req.draft_probs = next(probs)  # [k, V_draft]
                req.draft_vocab = self.target_ids  # [V_draft], or None: q is in the target vocabulary already

    def _q_rows(self, active, rows_of):
        """Every sampled request's q rows [k, V_draft] in turn, left in the draft vocabulary (the verifier reads
        them there through target_ids; without target_ids, draft id i is target id i); rows_of(row, k): the
        request's q rows, as tensors [n, V_draft] to concatenate."""
        sampled = [(row, k) for row, (req, k) in enumerate(active) if not req.params.greedy]
        if not sampled:
            return iter(())
        q = torch.cat([t for row, k in sampled for t in rows_of(row, k)])  # [sum k, V_draft]
        if self.target_ids is None:
            q = in_target_vocab(q, self.target_vocab, None)  # [sum k, V_target]: padded if narrower
        return iter(torch.split(q, [k for _, k in sampled]))

    def _draw(self, reqs: list[Request], states: torch.Tensor, logits: torch.Tensor | None,
              uniforms: torch.Tensor | None, step: int):
        """Draw step `step` of the chain from the head's outputs states [B, H] (or their logits [B, V_draft],
        when the forward computed them) -> (the tokens fed next [B], per row its q [1, V_draft] or None); for a
        tree, the depth's candidates [B, m] (column 0 is fed next): a greedy row's m best tokens, a sampled
        row's m independent draws from q."""
        if logits is None:
            logits = self.head.logits(states)  # [B, V_draft]
        return draw_drafts(logits, [r.params for r in reqs], [self._state(r).generator for r in reqs],
                           self.target_vocab, self.target_ids, map_q=False, draws=self.tree_width,
                           uniforms=None if uniforms is None else uniforms[:len(reqs), step])

    def _blocks_for_chain(self, req: Request, k: int, num_tokens: int) -> bool:
        """Blocks of the target's tables up to the chain's last position, num_tokens + k - 3 (num_tokens: the
        request's when the chain drafts; for a chain launched ahead, the most it can have by then)."""
        need = self.blocks.blocks_for(num_tokens + k - 2) - len(req.block_ids)
        if need <= 0:
            return True
        fresh = self.blocks.allocate(need)
        if fresh is None:
            return False
        req.block_ids.extend(fresh)
        return True

    # ------------------------------------------------------------------ the head's forward

    def _forward(self, ids: list[int] | torch.Tensor, states: torch.Tensor, layout: list[tuple[list[int], int, int]],
                 with_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [T] (host list or device tensor), states [T, H]; layout: per sequence (block ids, first position,
        tokens), rows in order -> (the head's outputs [T, H], their logits [T, V_draft] from a padded forward, or
        None from an eager one, or from graphs without logits where with_logits is False and they hold its shape);
        its keys/values are written at those positions."""
        picked = self._graphs_for(layout, with_logits)
        if picked is not None:
            graphs, shape = picked
            return graphs.run_layout(layout, shape, ids, states)
        self.stats["head_eager_forwards"] += 1
        ids, positions, batch = self._eager_inputs(ids, layout)
        if self.piecewise is not None and self.piecewise.fits(ids.shape[0]):
            return self.piecewise.forward(ids, positions, states, batch, self.kv.layers[0]), None
        return self.head(ids, positions, states, batch, self.kv.layers[0]), None

    def _eager_inputs(self, ids, layout: Layout):
        """(ids [T], positions [T], AttentionBatch) of an eager forward of this layout, on the device."""
        starts, ctx, positions, slots = [0], [], [], []
        for blocks, start, count in layout:
            starts.append(starts[-1] + count)
            ctx.append(start + count)
            positions.extend(range(start, start + count))
            slots.extend(slot_of(blocks, p, self.block_size) for p in range(start, start + count))
        batch = flat_attention_batch([b for b, _, _ in layout], starts, ctx, slots, self.block_size, self.device)
        return (upload(ids, self.device) if isinstance(ids, list) else ids), upload(positions, self.device), batch

    def enable_piecewise(self, max_tokens: int, capture: bool = True) -> None:
        """Run eager forwards of up to max_tokens positions as two graphs around attention (head_piecewise.py,
        an Eagle3Head's only); the cost runner points at them so the engine's precapture captures them."""
        if isinstance(self.head, Eagle3Head):
            self.piecewise = HeadPiecewise(self.head, self.device, max_tokens, capture)
            self.runner.piecewise = self.piecewise

    def _graphs_for(self, layout: Layout, with_logits: bool) -> tuple[HeadGraphs, tuple[int, int, int]] | None:
        """The head graphs that run a forward of this layout, and its shape bucket there; None: it runs eagerly.
        Without logits, the graphs that skip them where they hold the shape (q = 1), else those that compute them."""
        for graphs in ((self.graphs,) if with_logits else (self.graphs_without_logits, self.graphs)):
            if graphs is not None:
                shape = graphs.layout_shape(layout)
                if graphs.shape_fits(shape):
                    return graphs, shape
        return None

    def precapture_graphs(self, ks: list[int], eager: bool = False) -> int:
        """Capture the head's buckets before serving: chain steps (q = 1) and observes after a verify of each
        k the controller may choose (q = k + 1), observes without logits after a step of k = 0 (q = 1), and for
        chains a chain graph of each depth k.  eager: where forwards run without graphs (a CPU), run and record
        the shapes all the same (how the tests check them).  Returns how many shapes."""
        if self.graphs is None or not (self.graphs.capture or eager):
            return 0
        count = self.graphs.precapture([1] + [k + 1 for k in ks])
        # one more graph per (batch, context) bucket at q = 1, as many as the q = 1 shapes above (e.g. batches
        # 1 .. 256 x contexts 256 .. 8192: 9 x 6 = 54)
        count += self.graphs_without_logits.precapture([1])
        if self.tree_width == 1:  # a chain of each depth k as one graph
            count += self.chain_graphs.precapture(ks)
        return count

    # ------------------------------------------------------------------

    def _state(self, req: Request) -> HeadState:
        if req.request_id not in self.states:
            self.states[req.request_id] = HeadState(self.device, req.params.seed)
        return self.states[req.request_id]

    def release(self, request: Request) -> None:
        self.states.pop(request.request_id, None)

    def metrics(self) -> dict:
        return dict(self.stats)


class HeadCostRunner:
    """What start-up calibration times for a drafter step (speculate/build.py measures `runner.forward` on
    scratch sequences): one head forward of the sequences' tokens beside zero states, as a chain step runs."""

    piecewise = None

    def __init__(self, spec: Eagle3Speculator):
        self.spec = spec
        self.device = spec.device
        self.static = spec.graphs  # its max_batch: how far calibration times one-token (graph) steps

    def forward(self, seqs: list[ScheduledSeq], fed_ids=None) -> list[torch.Tensor]:
        spec = self.spec
        layout = [(s.request.block_ids, s.request.num_computed, s.num_new) for s in seqs]
        tokens = sum(s.num_new for s in seqs)
        ids = [0] * tokens
        states = torch.zeros(tokens, spec.head.config.layer.hidden_size, dtype=spec.head.lm_head.weight.dtype,
                             device=self.device)
        out, logits = spec._forward(ids, states, layout)
        if logits is None:
            spec.head.logits(out)
        return []
