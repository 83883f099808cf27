"""Drafters as services: the /draft server, the held-out set, the acceptance verifier and its self-check gates.

- ``protocol``: the /draft wire format and the one client call every consumer shares.
- ``walk``: the greedy acceptance walk that defines tau.
- ``drafter`` + ``server``: ``specdec draft serve``, greedy drafts from a drafter's own forward passes.
- ``heldout``: ``specdec draft heldout``, the target's greedy continuations made by the engine.
- ``verify``: ``specdec draft verify``, tau over /draft on a held-out set.
- ``selfcheck``: ``specdec draft selfcheck``, the six gates before a full run.

See docs/DRAFTING.md for the specification.
"""
