#!/usr/bin/env python3
"""Acceptance per draft position on the reference target: the EAGLE-3 head against ref-draft and n-gram.

Every speculator drafts a fixed k (no controller) for the same held-out prompts, all at once, greedy and at
temperature 1 (drafts at the request's own settings, exact rejection sampling).  From the engine's counters:
  - conditional acceptance a_j: of the chains whose drafts 0..j-1 were accepted, the share accepting draft j;
  - the share of verify steps accepting at least j + 1 drafts, and tau (tokens per verify step);
  - greedy outputs equal to plain decoding's (bf16 on a GPU: batch-shape rounding may split rare ties);
  - at temperature > 0, the target's own uncertainty on its replies (target_uncertainty): whether the target
    or the drafter bounds acceptance.

GPU run:      python3 bench/head_acceptance.py --head ref-head --out bench/results/head-acceptance-h200.json
CPU dry run:  python3 bench/head_acceptance.py --device cpu --prompts 4 --max-tokens 16 --out /tmp/acc.json
MTP head:     python3 bench/head_acceptance.py --target ref-hybrid --speculators "" --mtp-ks 1,2,3,4
8B twins:     python3 bench/head_acceptance.py --twin qwen3-8b --speculators eagle3 --temperatures 1 (the same
              functions at the twin's shapes in bf16: does the twin's rounding cost acceptance?)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from bench.speculative import load_prompts  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402

ALL = ("eagle3", "draft", "ngram")

DRAFTER_TWIN = {"qwen3-8b": "qwen3-0.6b"}  # the drafter's twin beside its target's (docs/TWINS.md)


def speculators(head: str, drafter: str, k: int, tree_widths: list[int] = (), names: list[str] = ALL,
                mtp_ks: list[int] = (), twin: str | None = None) -> dict[str, SpecConfig]:
    """The configs measured, by name; mtp-kK: a Qwen3.5 target's own MTP head drafting K tokens.  With a
    target twin the head is padded to the same shape (its target's) and the drafter to its own twin."""
    head = dict(model=head, draft_twin=twin)
    configs = {"eagle3": SpecConfig("eagle3", num_draft_tokens=k, adaptive=False, **head),
               "draft": SpecConfig("draft", model=drafter, num_draft_tokens=k, adaptive=False,
                                   draft_twin=DRAFTER_TWIN.get(twin) if twin else None),
               "ngram": SpecConfig("ngram", num_draft_tokens=k, adaptive=False)}
    configs = {name: config for name, config in configs.items() if name in names}
    for mtp_k in mtp_ks:
        configs[f"mtp-k{mtp_k}"] = SpecConfig("mtp", num_draft_tokens=mtp_k, adaptive=False)
    for width in tree_widths:  # the head drafting trees of k depths, `width` candidates a depth
        configs[f"eagle3-tree{width}"] = SpecConfig("eagle3", num_draft_tokens=k, adaptive=False,
                                                    tree_width=width, **head)
    return configs


def per_position(before: dict, after: dict, k: int) -> dict:
    """Acceptance by draft position from two engine metric snapshots.

    Example, k = 3, 10 steps with drafts, accepted_per_position [8, 4, 1]: a = [0.8, 0.5, 0.25],
    at least j + 1 accepted = [0.8, 0.4, 0.1], tau = 1 + (8 + 4 + 1) / 10 = 2.3 (steps all with drafts)."""
    steps = after["drafts"] - before["drafts"]
    accepted = [a - b for a, b in zip(after["accepted_per_position"][:k], before["accepted_per_position"][:k])]
    reached = [steps, *accepted[:-1]]
    return {"steps_with_drafts": steps,
            "conditional": [round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
            "at_least": [round(a / steps, 4) if steps else None for a in accepted],
            "tau": round(1 + sum(accepted) / max(1, steps), 3),
            "acceptance": round(sum(accepted) / max(1, steps * k), 4)}


def measure(model: str, config: SpecConfig | None, prompts: list[str], params: SamplingParams, device: str,
            twin: str | None = None) -> tuple[dict, list[list[int]]]:
    # counts only, so no CUDA graphs to capture; a fixed KV size, as the engines run one after another
    llm = LLM(model, device=device, speculator=config, kv_cache_tokens=65536, cuda_graphs=False, twin=twin)
    before = dict(llm.engine.metrics())
    outs = llm.generate(prompts, params)
    row = per_position(before, llm.engine.metrics(), config.num_draft_tokens) if config is not None else {}
    row["tokens"] = sum(len(o.token_ids) for o in outs)
    del llm
    return row, [o.token_ids for o in outs]


def target_uncertainty(model: str, prompts: list[str], params: SamplingParams, device: str,
                       twin: str | None = None) -> dict:
    """How predictable the target is on its own replies at these settings: the mean entropy (nats) of the
    distribution it samples each reply token from, and the mean probability of its most likely token (what a
    drafter proposing exactly the target's argmax would be accepted at; a drafter sampling exactly the
    target's distribution would be accepted always)."""
    from specdec.sampling import processed_probs

    llm = LLM(model, device=device, kv_cache_tokens=65536, cuda_graphs=False, twin=twin)
    entropy, top, count = 0.0, 0.0, 0
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids = llm.encode(prompt)
        logits = llm.engine.all_logits(ids + out.token_ids)[len(ids) - 1:-1]  # [reply, V]: each reply token's
        probs = processed_probs(logits.float(), params)  # the distribution it was drawn from
        entropy += float(-(probs * probs.clamp_min(1e-30).log()).sum())
        top += float(probs.max(-1).values.sum())
        count += probs.shape[0]
    del llm
    return {"entropy_nats": round(entropy / max(1, count), 4), "argmax_probability": round(top / max(1, count), 4),
            "tokens": count}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--head", default="ref-head", help="EAGLE-3 head directory or short name")
    parser.add_argument("--drafter", default="ref-draft")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts (the bundled set)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--tree-widths", default="", help="also the head drafting trees of these widths (e.g. 2,3)")
    parser.add_argument("--speculators", default=",".join(ALL), help="which of eagle3, draft, ngram ('' for none)")
    parser.add_argument("--mtp-ks", default="", help="also the target's own MTP head at these k (e.g. 1,2,3,4)")
    parser.add_argument("--twin", default=None, help="the target (and its head) as this twin shape, e.g. qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/results/head-acceptance-h200.json")
    args = parser.parse_args(argv)
    prompts = load_prompts(args.prompts)
    record = {"environment": environment(torch.device(args.device)), "target": args.target, "head": args.head, "drafter": args.drafter,
              "twin": args.twin, "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens, "rows": {}}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True, seed=0)
        plain = measure(args.target, None, prompts, params, args.device, args.twin)[1] if temperature == 0 else None
        if temperature > 0:
            record["rows"][f"target-t{temperature:g}"] = target_uncertainty(args.target, prompts, params, args.device,
                                                                                  args.twin)
            print(f"target  T={temperature:g}  {record['rows'][f'target-t{temperature:g}']}", flush=True)
        widths = [int(w) for w in args.tree_widths.split(",") if w]
        names = [n for n in args.speculators.split(",") if n]
        mtp_ks = [int(k) for k in args.mtp_ks.split(",") if k]
        for name, config in speculators(args.head, args.drafter, args.k, widths, names, mtp_ks,
                                                args.twin).items():
            row, outputs = measure(args.target, config, prompts, params, args.device, args.twin)
            if plain is not None:
                row["greedy_equal_to_plain"] = sum(o == p for o, p in zip(outputs, plain)) / len(plain)
            record["rows"][f"{name}-t{temperature:g}"] = row
            print(f"{name:7s} T={temperature:g}  tau {row['tau']:.2f}  a_j {row['conditional']}", flush=True)
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
