"""What a request must satisfy to be queued: a pure check, usable wherever the engine's limits are known
(the engine itself, and a server process whose engine runs in another process)."""

from __future__ import annotations

import dataclasses

from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # prompt + output
    capacity_tokens: int  # the whole KV cache
    stop_strings: bool  # the engine can detokenize (stop strings need it)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the problem."""
        params.validate()
        self.check_prompt(prompt_token_ids)
        if params.stop and not self.stop_strings:
            raise InvalidRequestError("stop strings need a tokenizer: this model directory has none")

    def check_prompt(self, ids) -> None:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt token ids must be integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of range for this model's vocabulary "
                                      f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                                      "tokens, which must hold the prompt and at least one generated token")
        if len(ids) + 1 > self.capacity_tokens:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens but the KV cache holds only "
                                      f"{self.capacity_tokens}: raise kv_cache_tokens")
