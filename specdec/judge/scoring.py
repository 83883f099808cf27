"""--scorer MODEL_DIR: a local reference model that scores texts for engines that return no prompt log-probs.

`transformers serve`, for one, ignores `echo` and `logprobs`: it returns text and token counts only.  The judge
then scores every fixed text's greedy continuations and every sampled reply with specdec's own engine on the
reference model (the same forward pass as `LLM.score`, which also gives each position's top-1), so every gate
of the lossless check runs for any engine that returns text.
"""

from __future__ import annotations

from pathlib import Path

from specdec.judge.gates import ScoredReply
from specdec.sequences import common_prefix_length


class LocalScorer:
    """The reference model in this process: scores prompt + reply texts token by token."""

    def __init__(self, model_dir: str | Path, device: str = "auto", kv_cache_tokens: int = 8192):
        from specdec import LLM
        from specdec.errors import ConfigError

        self.model_dir = str(model_dir)
        self.llm = LLM(model_dir, device=device, kv_cache_tokens=kv_cache_tokens)
        if self.llm.tokenizer is None:
            raise ConfigError(f"--scorer {model_dir}: the directory has no tokenizer.json, so it cannot score text")

    def describe(self) -> str:
        return f"local reference {self.model_dir} (specdec, {self.llm.device})"

    def score(self, prompt: str, reply: str) -> ScoredReply:
        """Log-probs of the reply's tokens given the prompt, and how many were the reference's top-1.

        The reply's tokens are those past the prompt's own tokens (texts are tokenized whole, as an engine
        would see them; where the prompt's last token merges with the reply's first, that token counts as the
        reply's).
        """
        import torch

        prompt_ids = self.llm.tokenizer.encode(prompt)
        ids = self.llm.tokenizer.encode(prompt + reply)
        start = max(common_prefix_length(prompt_ids, ids), 1)  # the first token has no prefix to be scored against
        if len(ids) <= start:
            return ScoredReply(0.0, 0, 0)
        with torch.inference_mode():
            logp = self.llm.engine.all_logits(ids[:-1]).float().log_softmax(-1)  # row i predicts token i + 1
        rows = logp[start - 1:]
        targets = torch.tensor(ids[start:], device=rows.device)
        picked = rows.gather(1, targets[:, None]).squeeze(1)
        top1 = (picked >= rows.max(-1).values - 1e-6).sum().item()
        return ScoredReply(float(picked.sum().item()), len(targets), int(top1))

