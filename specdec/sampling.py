"""Sampling parameters and the logits -> distribution processing every sampler and verifier shares."""

from __future__ import annotations

import dataclasses

import torch

from specdec.errors import InvalidRequestError
from specdec.transfer import upload


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request.  temperature 0 means greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N >= 0 = sampled token's log-prob plus top-N alternatives

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def cuts(self) -> bool:
        """Whether sampling cuts the distribution by top-k or top-p (greedy never does: it takes the argmax)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be 0 (off) or a positive integer, got {self.top_k!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            raise InvalidRequestError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> the distribution actually sampled from, [N, V] float32.

    Greedy gives the one-hot of the argmax; otherwise softmax(logits / T) restricted to the top-k
    tokens and to the smallest set whose mass reaches top_p (ties broken by token order), renormalised.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def processed_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [N, V], one SamplingParams per row -> processed_probs of every row, [N, V] float32.

    Rows that share temperature, top-k and top-p are processed together: a batch of alike requests (the
    usual case) costs one call, not one per row."""
    groups: dict[tuple, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault((p.greedy, p.temperature, p.top_k, p.top_p), []).append(row)
    if len(groups) == 1:
        return processed_probs(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        index = upload(rows, logits.device)
        out[index] = processed_probs(logits[index], params[rows[0]])
    return out


def processed_probs_tensors(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, cuts: bool = True) -> torch.Tensor:
    """logits [N, V], per row temperature [N] (0: greedy), top_k [N] long (0: off) and top_p [N] -> [N, V]
    float32: row i is processed_probs of logits[i] at its settings.  No host sync and no data-dependent shape,
    so it runs inside a CUDA graph.  cuts=False promises (on the host) that no row has top-k or top-p: the
    sort is skipped and each row is plain softmax(logits / T), as processed_probs computes it.

    One descending sort serves both cuts: top-k keeps the tokens at least as likely as the k-th (ties kept, as
    processed_probs' threshold keeps them), top-p the smallest sorted prefix whose mass reaches top_p.
    Example: scaled logits [1, 3, 2, 3], top_k 2 -> sorted [3, 3, 2, 1] (order [1, 3, 2, 0]), kth = 3: tokens
    1 and 3 are kept."""
    logits = logits.float()
    greedy = temperature <= 0  # [N]
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)  # [N, V]
    probs = _cut_probs(scaled, top_k, top_p) if cuts else scaled.softmax(-1)  # [N, V]
    # a greedy row: its argmax's one-hot (scattered: F.one_hot reads its input on the host, off a GPU)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # [N, V]
    return torch.where(greedy.unsqueeze(-1), one_hot, probs)


def _cut_probs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, V] softmax of scaled logits [N, V] cut to each row's top_k [N] and top_p [N] (processed_probs_tensors)."""
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [N]
    kth = ordered.gather(-1, (k - 1).unsqueeze(-1))  # [N, 1]
    sorted_probs = ordered.masked_fill(ordered < kth, float("-inf")).softmax(-1)  # [N, V] in sorted order
    cut = torch.where(top_p < 1.0, top_p, float("inf")).unsqueeze(-1)  # [N, 1]: top_p 1 keeps every token
    kept = sorted_probs * _nucleus(sorted_probs, cut)
    return torch.zeros_like(kept).scatter_(-1, order, kept / kept.sum(-1, keepdim=True))  # [N, V]


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending probability) whose mass reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = _nucleus(sorted_probs, top_p)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def _nucleus(sorted_probs: torch.Tensor, top_p) -> torch.Tensor:
    """[N, V] bool over probabilities sorted descending: the smallest prefix whose mass reaches top_p (a float,
    or [N, 1] per row); the first token is always kept."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
    return mass_before < top_p


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int):
    """logits [N, V], token_ids [N] -> (chosen log-prob [N], top-n ids [N, n], top-n log-probs [N, n]).

    Log-probs are those of the model (log_softmax of the raw logits), as OpenAI's API reports them.
    """
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, token_ids[:, None]).squeeze(-1)
    top = logp.topk(n, dim=-1) if n > 0 else None
    if top is None:
        empty = token_ids.new_zeros((token_ids.shape[0], 0))
        return chosen, empty, logp.new_zeros((token_ids.shape[0], 0))
    return chosen, top.indices, top.values
