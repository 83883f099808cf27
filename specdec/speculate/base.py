"""The speculator protocol: fill each request's drafts for the coming step."""

from __future__ import annotations

from specdec.engine.request import Request


class Speculator:
    """Proposes up to k[i] draft tokens for requests[i], writing req.draft_token_ids (and draft_probs).

    draft_probs is [n, V] (the drafter's distributions, needed for lossless sampling) or None for a
    deterministic drafter (probability 1 on each drafted token); [n, V_draft] over a reduced draft
    vocabulary when req.draft_vocab gives the target id of each column.
    """

    name = "none"
    has_draft_model = False  # whether proposing costs forward passes of a drafter (for the cost model)
    feature_layers: tuple[int, ...] = ()  # target layers whose states observe() reads (models.transformer)

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        raise NotImplementedError

    def tree_nodes(self, k: int) -> int:
        """Draft tokens a request feeds at k: k for a chain; a tree's node count (req.draft_parents) for k deep."""
        return k

    def q_width(self) -> tuple[int, bool]:
        """(width, mapped) of the q rows a sampled request's drafts carry: req.draft_probs [k, width], and whether
        req.draft_vocab maps their columns (a reduced draft vocabulary).  The engine precaptures the fixed-shape
        acceptance's sampled verify graphs for it (engine/fixed_acceptance.py).  (0, False): a deterministic
        drafter, whose drafts carry no q (n-gram, remote)."""
        return 0, False

    def observe(self, seqs: list, starts: list[int], runner) -> None:
        """After every target step, its committed sequences (engine.scheduler.ScheduledSeq; seqs[i] fed tokens
        from position starts[i]) and the runner that holds the step's features (runner.step_features).  Where
        observe_ahead launched the step's work already, this only settles it."""

    def observe_ahead(self, seqs: list, starts: list[int], runner, launched) -> bool:
        """Before the host reads the step's fixed-shape acceptance (launched: engine/fixed_acceptance.Launched,
        its tokens and accepted counts still on the device), queue what observe would run for these sequences,
        so that the device runs it while the host reads and commits; observe(seqs, ...) after the commit then
        settles it without a second forward.  Returns whether it did (False, as here: observe does it all)."""
        return False

    def propose_ahead(self, seqs: list, ks: list[int], launched) -> bool:
        """Right behind observe_ahead (which returned True for these seqs), before the host reads the step's
        acceptance: launch the next step's drafts for seqs[i] at depth ks[i] (capped for every draft kept), so
        that the next propose hands them out instead of drafting again.  Returns whether it did (False, as
        here)."""
        return False

    def drop_ahead(self) -> None:
        """Drop what propose_ahead launched, where the next step does not use it (a no-op here)."""

    def release(self, request: Request) -> None:
        """The request finished or was aborted: drop any per-request state."""

    def metrics(self) -> dict:
        return {}
