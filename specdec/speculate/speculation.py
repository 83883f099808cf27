"""Speculation as the engine sees it: one object, called in two places per step.

    before the step   propose(scheduler): the controller plans k for the decoding requests, the speculator
                      fills their drafts; scheduled(seqs): the drafts the step really verifies (the scheduler
                      cuts drafts that find no free block), which the controller's expected tokens count
    after the step    after_step(...): the speculator observes what the target's forward computed (the
                      features of the layers it asked for, for every fed position: no extra forward), the
                      controller learns the step's cost.  (Where the engine offered the speculator the step
                      before reading its acceptance, Speculator.observe_ahead, observe only settles that; and
                      the next step's drafts may be launched there too, Speculator.propose_ahead, which the
                      next propose hands out if it plans the same ones.)
    per request       verified(req, drafts, accepted) when its drafts were checked, release(req) when it ends

A step the controller plans at k = 0 is a plain decode step, which the engine may leave in flight
(engine/overlap.py): observe_in_flight queues the speculator's observe of it at once, plan_behind chooses the
k of the step behind it before its commit (a plain step is launched behind it; drafts wait for the commit),
and after_step prices it at k = 0 (plain_step) once it is committed.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from specdec.engine.overlap import schedules_alike
from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledSeq, Scheduler
from specdec.speculate.base import Speculator


class PlainStep(NamedTuple):
    """A plain decode step left in flight (engine/overlap.py), as the controller prices it at its commit."""

    decoding: int  # its decoding requests
    probe: bool  # whether the controller ran it as a probe of k = 0


class Speculation:
    def __init__(self, speculator: Speculator, controller, max_model_len: int, step_budget: int):
        self.speculator = speculator
        self.controller = controller  # speculate.controller.KController (or the tensor-parallel proxy)
        self.max_model_len = max_model_len
        self.step_budget = step_budget  # the engine's max_num_batched_tokens
        self.decoding = 0  # decoding requests in the step being run
        self.drafting: list[Request] = []  # the requests propose() drafted for, until scheduled()
        self._planned: int | None = None  # k chosen behind a step in flight for the propose after its commit

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose states the speculator reads after each step (CausalLM.capture_features)."""
        return self.speculator.feature_layers

    @property
    def last_k(self) -> int:
        return self.controller.last_k if self.decoding else 0

    def propose(self, scheduler: Scheduler) -> None:
        """Drafts for every decoding request: k from the controller, capped by what may still be generated."""
        decoding, prefill = [], 0  # prefill: tokens of prompts that may share the step, up to its budget
        for r in scheduler.running:
            behind = r.num_tokens - r.num_computed
            if behind > 1:
                prefill += behind
            else:
                decoding.append(r)
        for r in scheduler.joining(prefills=prefill > 0):
            if prefill >= self.step_budget:
                break
            prefill += r.num_tokens
        self.decoding = len(decoding)
        planned, self._planned = self._planned, None
        if planned is not None and not prefill:  # chosen behind the step in flight just committed (plan_behind)
            k = planned if decoding else 0
        else:
            k = self.controller.choose([r.request_id for r in decoding], min(prefill, self.step_budget))
        if not k:  # a plain step: no speculator work (a host-bound step at 64 sequences is ~1.3 ms)
            self.speculator.drop_ahead()  # drafts launched ahead of the last commit go unused
            for r in decoding:
                if r.draft_token_ids:  # drafts of a step that left this request out
                    r.clear_drafts()
            return
        self.speculator.propose(decoding, self.capped_ks(decoding, k))
        self.drafting = decoding

    def capped_ks(self, requests: list[Request], k: int, gained: list[int] | None = None) -> list[int]:
        """Each request's k: the controller's k, capped so that no request drafts a token past its max_tokens or
        the model's max_model_len.  gained[i]: tokens requests[i] gains before it drafts (a chain launched ahead
        of the commit that adds them: at most every draft kept plus one; default none).  Example: max_tokens 20
        with 15 tokens out and 3 more to come -> at most 20 - 18 - 1 = 1 draft (the verify emits drafts + 1)."""
        gained = gained if gained is not None else [0] * len(requests)
        return [max(0, min(k, r.params.max_tokens - (len(r.output_token_ids) + g) - 1,
                           self.max_model_len - (r.num_tokens + g) - 1)) for r, g in zip(requests, gained)]

    def observe_ahead(self, scheduler: Scheduler, seqs: list[ScheduledSeq], starts: list[int], runner,
                      launched) -> None:
        """sample_tokens' on_launch for a step accepted on its fixed shape (launched: its acceptance, still on the
        device): the speculator's observe of the step launched before the host reads it (Speculator.observe_ahead),
        and behind that the next step's drafts (Speculator.propose_ahead) where the next step is sure to decode
        the same requests (_ahead_ks)."""
        if not self.speculator.observe_ahead(seqs, starts, runner, launched):
            return
        ks = self._ahead_ks(scheduler, seqs, starts)
        if ks is not None:
            self.speculator.propose_ahead(seqs, ks, launched)

    def _ahead_ks(self, scheduler: Scheduler, seqs: list[ScheduledSeq], starts: list[int]) -> list[int] | None:
        """Each sequence's k for the next step's drafts, where they may be launched before this step's commit,
        else None: where the next schedule is sure to verify exactly these requests (overlap.schedules_alike)
        even with every draft of this step kept.  k: the one the controller chose for this step (choosing again
        here would move its probes and estimates; the next propose chooses, and a k that differs drops what was
        launched), capped for the worst case by capped_ks."""
        if not self.controller.last_k:
            return None
        reqs = [s.request for s in seqs]
        ks = self.capped_ks(reqs, self.controller.last_k, [1 + s.num_drafts for s in seqs])
        # with all d drafts kept num_tokens is start + d + 2, and the next verify feeds up to position
        # start + d + 1 + k.  Example: start 9, d 3, k 4: at worst num_tokens 14 after the commit, the next
        # verify feeds positions 13..17, which need the blocks of 18 tokens.
        held = [start + s.num_drafts + 2 + k for s, start, k in zip(seqs, starts, ks)]
        alike = schedules_alike(scheduler, reqs, [1 + k for k in ks], held)
        return ks if any(ks) and alike else None

    # ------------------------------------------------------------------ plain steps in flight (engine/overlap.py)

    def plain_step(self) -> PlainStep | None:
        """For a plain decode step about to be left in flight: how after_step prices it once committed (the
        controller may have chosen for the step behind by then), or None where the controller planned drafts for
        it (the step found none: an n-gram miss) and it is committed as a speculative step is."""
        if self.controller.last_k:
            return None
        return PlainStep(self.decoding, self.controller.probing)

    def observe_in_flight(self, seqs: list[ScheduledSeq], starts: list[int], runner, launched) -> bool:
        """A plain decode step is left in flight: queue the speculator's observe of it now, before a later forward
        overwrites the features it reads (Speculator.observe_ahead; observe after the commit settles it).  False
        where that cannot be (no head graph holds the shape, a request finished at the commit before): the step
        must then be committed before any other forward.  A speculator that reads no features observes
        nothing here."""
        if not self.speculator.feature_layers:
            return True
        if any(s.request.finished for s in seqs):
            return False
        return self.speculator.observe_ahead(seqs, starts, runner, launched)

    def plan_behind(self, reqs: list[Request]) -> bool:
        """The step behind a plain decode step in flight, decoding reqs with nothing joining
        (overlap.schedules_alike): the controller chooses its k now.  True where that is 0, a plain step the
        engine launches behind the one in flight; otherwise the choice is kept for the propose that follows the
        commit of the step in flight (one choice per step)."""
        self.decoding = len(reqs)
        k = self.controller.choose([r.request_id for r in reqs], 0)
        if k:
            self._planned = k
            return False
        self.speculator.drop_ahead()
        return True

    # ------------------------------------------------------------------

    def scheduled(self, seqs: list[ScheduledSeq]) -> None:
        """The step's plan is made: tell the controller the drafts each drafted request really verifies (its
        draft depth; 0 where the scheduler cut them all or left the request out)."""
        if not self.drafting:
            return
        depth = {s.request.request_id: s.draft_depth for s in seqs}
        self.controller.drafted([r.request_id for r in self.drafting],
                                [depth.get(r.request_id, 0) for r in self.drafting])
        self.drafting = []

    def after_step(self, seqs: list[ScheduledSeq], starts: list[int], runner, started: float,
                   plain: PlainStep | None = None) -> float:
        """The target's step is committed: the speculator observes it (starts[i] is where seqs[i]'s fed tokens
        began; the runner holds the step's features, ModelRunner.step_features), then the controller learns
        its seconds since perf_counter() read `started` (it counts the tokens the acceptance rates expect, not
        those emitted, and prices the step by its k).  plain: a plain step committed from flight (plain_step),
        priced at k = 0.  Returns the seconds."""
        self.speculator.observe(seqs, starts, runner)
        seconds = time.perf_counter() - started
        if plain is not None:
            if plain.decoding:
                self.controller.observe_step(plain.decoding, 0, seconds, plain.probe)
        elif self.decoding:
            self.controller.observe_step(self.decoding, self.controller.last_k, seconds)
        return seconds

    def verified(self, req: Request, num_drafts: int, accepted: int) -> None:
        self.controller.acceptance.update(req.request_id, num_drafts, accepted)

    def release(self, req: Request) -> None:
        self.speculator.release(req)
        self.controller.acceptance.forget(req.request_id)

    def metrics(self) -> dict:
        return {"speculator": self.speculator.name, "draft_k": self.controller.last_k,
                **self.speculator.metrics()}
