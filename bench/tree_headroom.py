#!/usr/bin/env python3
"""What drafting several candidates per position would accept: the headroom of draft trees, before building them.

The engine speculates with k = 1 at the requests' settings; at every verify step each sampled request's draft
distribution q (the drafter's, at its first draft) and the target's distribution p at the same position are
recorded from the verifier's inputs.  From these pairs, exactly (no sampling):
  - one draft: acceptance sum_x min(p, q), what the engine gets today;
  - m drafts drawn independently from q, verified by recursive rejection sampling (each rejection leaves the
    residual r' = norm(max(r - q, 0)) for the next candidate, so the output still follows p): acceptance
    1 - prod_i (1 - sum_x min(r_i, q));
  - the target's argmax probability (a drafter proposing exactly it) and its entropy.
A static tree of width m at the first position accepts its first token with the m-draft probability.

GPU run:      python3 bench/tree_headroom.py --out bench/results/tree-headroom-h200.json
CPU run:      python3 bench/tree_headroom.py --device cpu --prompts 32 --max-tokens 64 --out /tmp/tree.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import specdec.engine.sampler as sampler  # noqa: E402
from bench.common import environment, write_json  # noqa: E402
from bench.speculative import load_prompts  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402


def recursive_acceptance(p: torch.Tensor, q: torch.Tensor, widths: list[int]) -> dict[int, torch.Tensor]:
    """p, q [N, V] (rows sum to 1) -> {m: [N] probability that one of m drafts from q is accepted}.

    Example: p = (0.5, 0.5), q = (1, 0): one draft is accepted with 0.5; after a rejection the residual is
    (0, 1), which q never proposes, so more drafts add nothing: {1: 0.5, 2: 0.5}."""
    out, residual = {}, p.double().clone()
    q = q.double()
    missed = torch.ones(p.shape[0], dtype=torch.float64)  # probability that every draft so far was rejected
    for m in range(1, max(widths) + 1):
        accepted = torch.minimum(residual, q).sum(-1).clamp(max=1.0)  # [N]
        missed = missed * (1 - accepted)
        if m in widths:
            out[m] = 1 - missed
        left = (residual - q).clamp(min=0)
        mass = left.sum(-1, keepdim=True)
        residual = torch.where(mass > 1e-12, left / mass.clamp(min=1e-30), residual)
    return out


def record_pairs(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) [N, V] at every first draft the engine verified, from the verifier's own inputs."""
    ps, qs = [], []
    accept = sampler.accept

    def recording(draft_ids, draft_probs, target_probs, generators=None):
        drafted = draft_ids[:, 0] >= 0 if draft_ids.shape[1] else torch.zeros(0, dtype=torch.bool)
        if draft_probs is not None and drafted.any():
            rows = drafted.nonzero().flatten().to(target_probs.device)
            ps.append(target_probs[rows, 0].float().cpu())
            qs.append(draft_probs[rows, 0].float().cpu())
        return accept(draft_ids, draft_probs, target_probs, generators)

    sampler.accept = recording
    try:
        llm.generate(prompts, params)
    finally:
        sampler.accept = accept
    return torch.cat(ps), torch.cat(qs)


def summarize(p: torch.Tensor, q: torch.Tensor, widths: list[int]) -> dict:
    multi = recursive_acceptance(p, q, widths)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return {"positions": int(p.shape[0]),
            "accepted_with_m_drafts": {str(m): round(float(a.mean()), 4) for m, a in multi.items()},
            "target_argmax_probability": round(float(p.max(-1).values.mean()), 4),
            "target_entropy_nats": round(float(entropy.mean()), 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--head", default="ref-head")
    parser.add_argument("--drafter", default="ref-draft")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="1,0.7")
    parser.add_argument("--widths", default="1,2,3,4,8")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/results/tree-headroom-h200.json")
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    prompts = load_prompts(args.prompts)
    record = {"environment": environment(torch.device(args.device)), "target": args.target, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "rows": {}}
    drafters = {"eagle3": SpecConfig("eagle3", model=args.head, num_draft_tokens=1, adaptive=False),
                "draft": SpecConfig("draft", model=args.drafter, num_draft_tokens=1, adaptive=False)}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True, seed=0)
        for name, config in drafters.items():
            llm = LLM(args.target, device=args.device, speculator=config, kv_cache_tokens=65536, cuda_graphs=False)
            row = summarize(*record_pairs(llm, prompts, params), widths)
            del llm
            record["rows"][f"{name}-t{temperature:g}"] = row
            print(f"{name:7s} T={temperature:g}  {row}", flush=True)
            write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
