"""What one HTTP request asks of the engine: n choices per prompt, each an engine request of its own.

Choice i of prompt p has index p * n + i, as in OpenAI's API.  The n requests of a prompt share its
token ids (the engine's prefix cache shares the prompt's full KV blocks), and each gets its own
SamplingParams: the room the context leaves after the prompt, and, for a seeded request, its own seed.
"""

from __future__ import annotations

import dataclasses

from specdec.sampling import SamplingParams
from specdec.server.protocol import APIError

MASK64 = (1 << 64) - 1


def choice_seed(seed: int | None, sample: int) -> int | None:
    """The seed of a prompt's sample `sample`: the request's seed for sample 0 (so n=1 answers as before),
    for the others a 63-bit mix of (seed, sample) -- reproducible, and unrelated to the seeds seed + 1, ...

    One step of splitmix64 over seed + sample * golden ratio: choice_seed(5, 1) is not choice_seed(6, 0)."""
    if seed is None or sample == 0:
        return seed
    z = (seed + sample * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1


def fit_to_context(params: SamplingParams, prompt_tokens: int, context: int, param: str | None,
                   prompt_name: str = "prompt") -> SamplingParams:
    """params with max_tokens at most what the context leaves after the prompt.

    A max_tokens the client chose (`param` names its field) that does not fit is a 400 saying both
    numbers; a default one is cut to fit."""
    room = context - prompt_tokens
    if params.max_tokens <= room:
        return params
    if param is not None:
        raise APIError(400, f"{param} is {params.max_tokens}, but this model's context of {context} tokens leaves "
                            f"{room} after the {prompt_name}'s {prompt_tokens} tokens: set {param} to at most "
                            f"{room}, or shorten the prompt", param=param, code="context_length_exceeded")
    return dataclasses.replace(params, max_tokens=room)


def sample_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of a prompt's n samples: the same but for the seed."""
    return [params if i == 0 else dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]
