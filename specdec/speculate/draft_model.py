"""A separate small drafter model with its own paged KV cache, proposing a chain of k tokens per step.

For every target request the drafter keeps a shadow sequence: the tokens its cache was computed on.
Each step the shadow is synced with the request (a rejected draft makes the shadow diverge; its
cache is valid only up to the first difference).  The chain's first forward feeds the shadow's new
tokens and yields draft 1: one token after a rejection, two after full acceptance (the last draft,
never fed, and the bonus token), up to four after a short plain stretch, so it runs as a fixed-shape
(CUDA-graph) step; only a shadow further behind (speculation off for longer) first catches up in separate
forwards.  Then each draft is fed to get the next: k forwards for k drafts, all requests batched
together.  A draft is fed back as the device tensor it was drawn into (the shadow holds a placeholder for it),
so the host queues the k forwards without waiting for any, and reads the drafts once, after the last.
"""

from __future__ import annotations

import torch

from specdec.engine.kv_cache import BlockManager, KVCache
from specdec.engine.request import Request
from specdec.engine.runner import ModelRunner
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.transformer import CausalLM
from specdec.sampling import SamplingParams
from specdec.speculate.base import Speculator
from specdec.speculate.draw import draw_drafts

CATCH_UP_CHUNK = 2048  # most tokens fed in one drafter forward while catching up
# Most new tokens the chain's first forward takes: after full acceptance the last draft and the bonus, plus
# the tokens of up to two plain steps (the goodput guard's probe of plain decoding) before drafting resumes.
FIRST_FEED = 4


class Shadow:
    """The drafter's view of one request: the tokens its KV was computed on, and its blocks."""

    def __init__(self, device: torch.device, seed: int | None):
        self.seq = Request([0], SamplingParams(max_tokens=1), device)  # token store for the runner
        self.seq.prompt_token_ids = []
        self.generator = None
        if seed is not None:  # a seeded request drafts reproducibly, from a stream of its own
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed ^ 0x5EED)


class DraftModelSpeculator(Speculator):
    name = "draft"
    has_draft_model = True

    def __init__(self, model: CausalLM, target_vocab: int, kv_cache_tokens: int, block_size: int = 16,
                 static_shapes: bool = False, max_batch: int = 256, max_context: int = 8192,
                 piecewise: bool = False, cuda_graphs: bool = True):
        self.model = model
        self.device = model.lm_head.weight.device
        self.target_vocab = target_vocab
        self.max_positions = model.config.max_position_embeddings
        num_blocks = max(1, kv_cache_tokens // block_size)
        self.kv = KVCache(model.config, num_blocks, block_size, self.device, model.lm_head.weight.dtype)
        self.blocks = BlockManager(num_blocks, block_size)
        static = None
        if static_shapes:  # CUDA graphs for the chained one-token steps (and short catch-ups)
            from specdec.engine.static_runner import StaticRunner

            static = StaticRunner(model, self.kv, self.device, max_batch, max_q=33,
                                  max_context=min(max_context, self.max_positions), capture=True)
        pieces = None
        if piecewise:  # catch-ups (a new request's prompt) with all but attention as CUDA graphs
            from specdec.engine.piecewise import PiecewiseRunner

            pieces = PiecewiseRunner(model, self.device, CATCH_UP_CHUNK, capture=cuda_graphs)
        self.runner = ModelRunner(model, self.kv, self.device, static, pieces)
        self.shadows: dict[str, Shadow] = {}
        self.stats = {"draft_forwards": 0, "skipped_no_cache": 0}

    # ------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]) -> None:
        active = []
        for req, k in zip(requests, ks):
            req.clear_drafts()
            k = min(k, self.max_positions - req.num_tokens)
            if k > 0 and self._sync(req, k):
                active.append((req, k))
        if not active:
            return
        self._catch_up([self._shadow(r) for r, _ in active])
        drawn = self._chain(active)
        for req, _ in active:  # the drafts are read back once, after the whole chain
            shadow = self._shadow(req).seq.prompt_token_ids
            tokens = drawn[req.request_id]
            req.draft_token_ids = tokens
            shadow[len(shadow) - len(tokens):] = tokens  # the placeholders the chain fed on the device
            shadow.pop()  # the last draft was never fed: the shadow's cache ends one token earlier

    def _chain(self, active: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """k forwards for k drafts, all requests batched: forward i feeds draft i - 1 straight from the device
        (the shadow holds a placeholder for it until the end), so the host never waits between forwards.

        Returns each request's drafts; sampled requests' draft_probs are set ([k, V_target])."""
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in active}
        drawn: list[tuple[list[Request], torch.Tensor]] = []  # per forward: its requests, their tokens [B]
        step, previous = list(active), None
        for i in range(max(k for _, k in active)):
            kept = [j for j, (_, k) in enumerate(step) if k > i]  # positions in the previous forward's batch
            step = [step[j] for j in kept]
            if previous is not None and len(kept) < len(previous):  # a request with fewer drafts is done
                previous = previous[torch.tensor(kept, device=previous.device)]
            seqs = [self._feed(r) for r, _ in step]
            logits = [rows[-1:] for rows in self.runner.forward(seqs, previous)]  # per seq [1, V_draft]
            self.stats["draft_forwards"] += 1
            previous, qs = self._next_tokens([r for r, _ in step], torch.cat(logits))
            drawn.append(([r for r, _ in step], previous))
            for (req, _), seq, q in zip(step, seqs, qs):
                shadow = self._shadow(req)
                shadow.seq.num_computed += seq.num_new
                probs[req.request_id].append(q)
                shadow.seq.prompt_token_ids.append(0)  # placeholder for this draft, fed at the next forward
        tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        for reqs, ids in drawn:
            for req, token in zip(reqs, ids.tolist()):
                tokens[req.request_id].append(token)
        for req, _ in active:
            if not req.params.greedy:
                req.draft_probs = torch.cat(probs[req.request_id])  # [k, V]
        return tokens

    def q_width(self) -> tuple[int, bool]:
        """(width, mapped) of a sampled request's draft_probs (Speculator.q_width): the target's vocabulary."""
        return self.target_vocab, False

    def adopt(self, request_id: str, tokens: list[int], block_ids: list[int], block_hashes: list[int]) -> None:
        """Start a request's shadow on blocks that already hold the drafter's keys/values for `tokens`
        (the /draft server's prefix cache); the caller has taken a reference to each block."""
        shadow = Shadow(self.device, None)
        shadow.seq.prompt_token_ids = list(tokens)
        shadow.seq.num_computed = len(tokens)
        shadow.seq.block_ids = list(block_ids)
        shadow.seq.block_hashes = list(block_hashes)
        self.shadows[request_id] = shadow

    def precapture_graphs(self, ks: list[int]) -> int:
        """Capture the drafter's chain shapes before serving: its first forward feeds 1..FIRST_FEED tokens, the
        rest 1.  Returns how many shapes."""
        static = self.runner.static
        if static is None or not static.capture:
            return 0
        return static.precapture(list(range(1, FIRST_FEED + 1)))

    def release(self, request: Request) -> None:
        shadow = self.shadows.pop(request.request_id, None)
        if shadow is not None:
            self.blocks.release(shadow.seq.block_ids)

    def metrics(self) -> dict:
        return {**self.stats, "draft_eager_forwards": self.runner.eager_forwards}

    # ------------------------------------------------------------------

    def _shadow(self, req: Request) -> Shadow:
        if req.request_id not in self.shadows:
            self.shadows[req.request_id] = Shadow(self.device, req.params.seed)
        return self.shadows[req.request_id]

    def _sync(self, req: Request, k: int) -> bool:
        """Align the shadow with the request's tokens and give it blocks for k more; False = skip."""
        shadow = self._shadow(req).seq
        tokens = req.all_token_ids
        valid = _common_prefix(shadow.prompt_token_ids, tokens, min(shadow.num_computed, len(tokens) - 1))
        shadow.prompt_token_ids = list(tokens)
        shadow.num_computed = valid
        keep = self.blocks.blocks_for(valid)
        self.blocks.release(shadow.block_ids[keep:])
        del shadow.block_ids[keep:]
        need = self.blocks.blocks_for(len(tokens) + k - 1) - len(shadow.block_ids)
        fresh = self.blocks.allocate(need) if need > 0 else []
        if fresh is None:  # drafter cache full: this request goes without drafts (and gives its cache back)
            self.release(req)
            self.stats["skipped_no_cache"] += 1
            return False
        shadow.block_ids.extend(fresh)
        return True

    def _catch_up(self, shadows: list[Shadow]) -> None:
        """Feed each shadow's uncomputed tokens but the last FIRST_FEED, in chunks of CATCH_UP_CHUNK tokens."""
        while True:
            seqs, budget = [], CATCH_UP_CHUNK
            for s in shadows:
                behind = len(s.seq.prompt_token_ids) - FIRST_FEED - s.seq.num_computed
                if behind > 0 and budget > 0:
                    n = min(behind, budget)
                    seqs.append(ScheduledSeq(s.seq, n, 0, samples=False))
                    budget -= n
            if not seqs:
                return
            self.runner.forward(seqs)
            self.stats["draft_forwards"] += 1
            for seq in seqs:
                seq.request.num_computed += seq.num_new

    def _feed(self, req: Request) -> ScheduledSeq:
        shadow = self._shadow(req).seq
        return ScheduledSeq(shadow, len(shadow.prompt_token_ids) - shadow.num_computed, 0, samples=True)

    def _next_tokens(self, requests: list[Request], logits: torch.Tensor):
        """logits [B, V_draft] -> (draft tokens [B] on the device, B distributions q [1, V_target] or None for
        greedy rows); each seeded request draws from its shadow's generator."""
        return draw_drafts(logits, [r.params for r in requests],
                           [self._shadow(r).generator for r in requests], self.target_vocab)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most limit (checked from the tail: drafts diverge there)."""
    n = min(limit, len(a), len(b))
    start = max(0, n - 64)
    if a[:start] != b[:start]:  # an earlier difference (never expected): recompute everything
        return 0
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i
