"""One generation request and its lifecycle state."""

from __future__ import annotations

import dataclasses
import enum
import itertools

import torch

from specdec.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-prob), best first


class Request:
    """Token ids, KV bookkeeping and sampling state of one sequence.

    ``num_computed`` counts the leading tokens whose keys/values are in the cache.  While decoding it is
    ``num_tokens - 1``: the newest token is fed at the next step.
    """

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, device: torch.device,
                 request_id: str | None = None, eos_token_ids: tuple[int, ...] = ()):
        self.request_id = request_id or f"req-{next(_ids)}"
        self.arrival = next(_ids)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.generator = params.make_generator(device)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_cached_prefix = 0  # prompt tokens served from the prefix cache at the last admission
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of the full, committed blocks registered so far
        self.state_slot: int | None = None  # a hybrid model's recurrent-state slot (engine/state_slots.py)
        self.draft_token_ids: list[int] = []  # proposed for the next step
        self.draft_probs: torch.Tensor | None = None  # [k, V] drafter distributions, None = deterministic
        # draft_probs' columns, when they span a reduced draft vocabulary: [V_draft] the target id of each (an
        # EAGLE-3 head's d2t; q is 0 at every other token); None: draft_probs spans the target vocabulary.
        self.draft_vocab: torch.Tensor | None = None
        # A draft tree instead of a chain: node i's parent (-1: the newest token), parents before children
        # (specdec/verify_tree.py); None: the drafts are a chain.  For a tree, draft_probs[r] is the distribution
        # the children of fed row r (0: the newest token, i + 1: node i) were drawn from.
        self.draft_parents: list[int] | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text: str | None = None  # output text cut at a stop string, when one was hit
        self.num_preemptions = 0
        self.num_steps = 0  # verify/decode steps that produced tokens
        self.num_drafted = 0
        self.num_accepted = 0
        self.accepted_per_position: list[int] = []  # [j]: verify steps in which draft j was accepted

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a step feeds only the newest tokens)."""
        split = len(self.prompt_token_ids)
        if start >= split:
            return self.output_token_ids[start - split:end - split]
        if end <= split:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - split]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def clear_drafts(self) -> None:
        self.draft_token_ids, self.draft_probs, self.draft_parents, self.draft_vocab = [], None, None, None

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
