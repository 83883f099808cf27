"""Overlapped steps (issue 21): the host schedules and launches step N+1 while step N still runs on the device.

Without overlap a step ends by reading its sampled tokens to the host (a full sync) and committing them, and
only then is the next step scheduled, staged and launched: the device idles for all of that host work.  Here a
plain decode step is left in flight instead, its tokens still on the device.  The next Engine.step() gives
each of its requests one pending output token, a placeholder (PLACEHOLDER), schedules step N+1 with it,
stages it (the placeholder as the fed id) and launches it with the real tokens copied over the staged ids on
the device from step N's sampled tokens (the fixed-shape runner's fed_ids).  Only then does the host read step
N's tokens (waiting for step N's copy back, not for N+1) and commit them: each placeholder gives way to its
token and Engine._commit runs as without overlap.

Which steps: every sequence a plain decode (one fed token, no drafts, samples, no logprobs), on the fixed-shape
runner, accepted there (engine/fixed_acceptance.py: the tokens are made on the device), not a hybrid model, and
with a speculator a step its controller planned at k = 0.  The step behind it is launched only when its
scheduling is certain to come out the same as after the commit: nobody waits for admission, every running
request was in the step in flight and still runs, the free blocks cover every request's next token (no
preemption), and a controller plans k = 0 for it too (Speculation.plan_behind; a k > 0 is kept for the step
after the commit).  Anything else, a speculator being set included, first commits the step in flight, then runs
as without overlap.

A speculator that reads the target's features (an EAGLE-3 head) observes a step in flight at its launch
(Speculation.observe_in_flight: Speculator.observe_ahead, queued behind the step's acceptance, before any later
forward overwrites the features); where it cannot, the step is committed before another is launched.  A
speculative step is never left in flight; what runs ahead of its host work is that same observe (queued before
the host reads the acceptance; speculate/eagle3.py), and behind it the next step's draft chain
(Speculator.propose_ahead), under the same conditions as here (Speculation._ahead_ks).

A request that finishes when step N is committed was still fed in step N+1: that token and its KV slot are
dropped (its blocks are released as for any finished request, before the device has run N+1; on a GPU any
later use of them is queued behind N+1 on the stream, and the slot it writes lies past the full blocks
registered for the prefix cache).  An abort while a step is in flight does the same: the aborted request's
token from that step is never committed, as if it had been aborted right after the last commit.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.engine.fixed_acceptance import Launched
from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledSeq, Scheduler
from specdec.transfer import upload

PLACEHOLDER = -1  # a pending token's id until the host reads it: out of range, so a premature read fails loudly


@dataclasses.dataclass
class InFlight:
    """A launched plain decode step whose tokens the host has not read yet."""

    seqs: list[ScheduledSeq]  # one fed token, no drafts, samples: each request's row i of the step
    starts: list[int]  # seqs[i]'s fed position (what a speculator's observe of the step reads from)
    logits: list[torch.Tensor]  # per sequence [1, V] (unread here: no logprobs in the scope)
    launched: Launched  # its acceptance: launched.tokens [B, 1] on the device, row i sequence i's token
    started: float  # time.perf_counter() when the host began the step
    overlapped: bool  # launched behind another step in flight
    plain: object = None  # with a speculator, how it prices the step at the commit (speculation.PlainStep)

    def live(self) -> list[Request]:
        """Its requests that still run (not finished or aborted since it was launched), in its order."""
        return [s.request for s in self.seqs if not s.request.finished]

    def tokens_for(self, reqs: list[Request], device: torch.device) -> torch.Tensor:
        """[len(reqs)] on the device: the token this step sampled for each of reqs (all among its sequences).

        Example: the step ran requests a, b, c and b finished since: the step behind feeds a, c, so it takes
        rows 0 and 2 of the tokens."""
        rows = {id(s.request): i for i, s in enumerate(self.seqs)}
        index = [rows[id(r)] for r in reqs]
        tokens = self.launched.tokens[:, 0]  # [B]: a plain decode emits one token, column 0
        if index == list(range(len(reqs))):
            return tokens[:len(reqs)]
        return tokens.index_select(0, upload(index, tokens.device))


def plain_decode(seqs: list[ScheduledSeq]) -> bool:
    """Whether every sequence feeds exactly its newest token, drafts none, samples and wants no logprobs."""
    return bool(seqs) and all(s.num_new == 1 and not s.num_drafts and s.samples and s.request.params.logprobs is None
                              for s in seqs)


def schedules_alike(scheduler: Scheduler, reqs: list[Request], fed: list[int] | None = None,
                    held: list[int] | None = None) -> bool:
    """Whether the next schedule is sure to run exactly reqs in their order, each feeding fed[i] tokens: nobody
    waits, reqs are all that run, the budget takes their tokens and the free blocks cover the held[i] tokens each
    needs blocks for (so nobody is preempted).  Defaults, for the step behind a plain decode step in flight (reqs:
    its live requests, each one token ahead): fed 1, held num_computed + 2 (a request fed its newest token at
    position num_computed in flight feeds position num_computed + 1 behind it).  A chain launched ahead of a
    speculative step's commit (Speculation._ahead_ks) passes its own worst case."""
    if scheduler.waiting or scheduler.out_of_cache or scheduler.running != reqs or not reqs:
        return False
    if sum(fed or [1] * len(reqs)) > scheduler.max_num_batched_tokens:
        return False
    blocks = scheduler.blocks
    held = held or [r.num_computed + 2 for r in reqs]
    need = sum(max(0, blocks.blocks_for(n) - len(r.block_ids)) for r, n in zip(reqs, held))
    return need <= blocks.num_free


def hold_pending(reqs: list[Request]) -> None:
    """Each request one token ahead: its token from the step in flight is a placeholder, counted as computed
    (it is fed, and its key written, by the step behind)."""
    for req in reqs:
        req.output_token_ids.append(PLACEHOLDER)
        req.num_computed += 1


def release_pending(req: Request) -> None:
    """Undo hold_pending for one request, so that its step in flight commits as without overlap."""
    if req.output_token_ids[-1] != PLACEHOLDER:
        raise RuntimeError(f"request {req.request_id} holds no pending token")
    req.output_token_ids.pop()
    req.num_computed -= 1
