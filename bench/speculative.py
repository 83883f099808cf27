#!/usr/bin/env python3
"""Speculation against plain decoding on the reference pair: tokens/s and tokens per verify step at
concurrency 1, 16 and 64, with the draft and n-gram speculators; transformers' assisted generation
with the same pair as the peer at batch 1.

GPU run:      python3 bench/speculative.py --out bench/results/speculative-h200.json
CPU dry run:  python3 bench/speculative.py --device cpu --concurrency 1,4 --max-tokens 16 --out /tmp/spec.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import compiles, environment, free_device_memory, sync, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path, short_name_path  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402

CONFIGS = {
    "plain": None,
    "draft-adaptive-k8": SpecConfig("draft", model="ref-draft", num_draft_tokens=8),
    "draft-k4": SpecConfig("draft", model="ref-draft", num_draft_tokens=4, adaptive=False),
    "ngram-adaptive-k8": SpecConfig("ngram", num_draft_tokens=8),
    "ngram-k4": SpecConfig("ngram", num_draft_tokens=4, adaptive=False),
    "eagle3-adaptive-k7": SpecConfig("eagle3", model="ref-head", num_draft_tokens=7),
    "eagle3-k3": SpecConfig("eagle3", model="ref-head", num_draft_tokens=3, adaptive=False),
    "eagle3-k5": SpecConfig("eagle3", model="ref-head", num_draft_tokens=5, adaptive=False),
    "eagle3-k7": SpecConfig("eagle3", model="ref-head", num_draft_tokens=7, adaptive=False),
}


def load_prompts(n: int) -> list[str]:
    lines = heldout_prompts_path().read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def run_load(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    before = dict(llm.engine.metrics())
    compiles_before = compiles()
    llm.engine.trace = []
    sync(llm.device)
    with gc_timer() as gc_seconds:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(llm.device)
        seconds = time.perf_counter() - t0
    trace, llm.engine.trace = llm.engine.trace, None
    after = llm.engine.metrics()
    tokens = sum(len(o.token_ids) for o in outs)
    steps = after["verify_steps"] - before["verify_steps"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in ("steps", "eager_forwards",
                                                                    "draft_forwards", "draft_eager_forwards")}
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "tokens_per_verify_step": tokens / max(1, steps), **delta,
            "compiles": compiles() - compiles_before, "gc_ms": 1e3 * gc_seconds[0],
            "steps_by_kind": summarize_steps(trace), "guard": guard_state(llm),
            "acceptance": (after["accepted_tokens"] - before["accepted_tokens"]) / max(1, drafted),
            "draft_tokens": drafted, "outputs": [o.token_ids for o in outs]}


@contextlib.contextmanager
def gc_timer():
    """Yields a one-item list that holds, on exit, the seconds Python's garbage collector ran inside."""
    spent, started = [0.0], []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spent[0] += time.perf_counter() - started.pop()

    gc.callbacks.append(callback)
    try:
        yield spent
    finally:
        gc.callbacks.remove(callback)


def guard_state(llm: LLM) -> dict[str, list[float]] | None:
    """The controller's goodput estimate per batch bucket and k ("b3-k4"): [decode-only steps measured,
    measured step time / the calibrated tables', tokens of the drafts really proposed / of k for every request]."""
    controller = llm.engine.controller
    if controller is None or not controller.adaptive:
        return None
    return controller.state()


def summarize_steps(trace) -> dict[str, dict]:
    """Steps grouped by kind ("spec"/"plain" x "graph"/"eager"): count, mean ms, tokens fed and emitted."""
    groups: dict[str, list] = {}
    for r in trace:
        groups.setdefault(f"{'spec' if r.k else 'plain'}-{'eager' if r.eager else 'graph'}", []).append(r)
    return {kind: {"steps": len(rs), "ms": round(1e3 * sum(r.seconds for r in rs) / len(rs), 3),
                   "total_ms": round(1e3 * sum(r.seconds for r in rs), 1),
                   "fed": round(sum(r.fed for r in rs) / len(rs), 1),
                   "emitted": round(sum(r.emitted for r in rs) / len(rs), 1),
                   "sequences": round(sum(r.sequences for r in rs) / len(rs), 1)}
            for kind, rs in sorted(groups.items())}


def transformers_peer(device: torch.device, prompts: list[str], max_tokens: int) -> dict:
    import transformers

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = transformers.AutoModelForCausalLM.from_pretrained(short_name_path("ref-target"), dtype=dtype).to(device)
    draft = transformers.AutoModelForCausalLM.from_pretrained(short_name_path("ref-draft"), dtype=dtype).to(device)
    tok = transformers.AutoTokenizer.from_pretrained(short_name_path("ref-target"))
    out = {}
    for name, kwargs in (("hf_plain_bs1", {}), ("hf_assisted_bs1", {"assistant_model": draft})):
        tokens, t0 = 0, None
        for i, p in enumerate(prompts):
            ids = tok(p, return_tensors="pt").input_ids.to(device)
            if i == 1:  # the first prompt warms up
                sync(device)
                t0 = time.perf_counter()
            gen = target.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kwargs)
            if i >= 1:
                tokens += gen.shape[1] - ids.shape[1]
        sync(device)
        out[name] = {"tok_s": tokens / (time.perf_counter() - t0), "tokens": tokens}
    return out


def time_loads(llms: dict[str, LLM], prompts: list[str], params: SamplingParams, rounds: int) -> dict[str, dict]:
    """Each engine's load `rounds` times, the engines taking turns (a drift in clocks or host load then hits
    every config alike); each config's row is its median round by tokens/s, with every round's tokens/s in
    round order (tok_s_rounds: round r of each config ran back to back).  One 0.2-1.5 s window per config
    moved plain decoding by 40 % between runs."""
    timed: dict[str, list[dict]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            timed[name].append(run_load(llm, prompts, params))
    rows = {}
    for name, runs in timed.items():
        in_order = [round(r["tok_s"]) for r in runs]
        runs.sort(key=lambda r: r["tok_s"])
        rows[name] = {**runs[len(runs) // 2], "tok_s_rounds": in_order}
    return rows


def profile_load(llm: LLM, prompts: list[str], params: SamplingParams, top: int) -> list[str]:
    """The `top` functions by own time over one more run of the load, under cProfile (not a timed run)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(llm.generate, prompts, params)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()][-top - 1:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/speculative-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each load per config (median kept)")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                        help="also time transformers' plain and assisted generation at batch 1")
    parser.add_argument("--piecewise", action=argparse.BooleanOptionalAction, default=None,
                        help="engines replay all but attention of eager steps as CUDA graphs (piecewise_graphs; "
                             "default: the engine's, on with CUDA graphs)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile each load once more and keep its N costliest functions")
    parser.add_argument("--head", default="ref-head", help="the EAGLE-3 head of the eagle3 configs")
    args = parser.parse_args(argv)
    for name, config in CONFIGS.items():
        if config is not None and config.method == "eagle3":
            CONFIGS[name] = dataclasses.replace(config, model=args.head)
    device = torch.device(args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    names = args.configs.split(",")
    results = {"env": environment(device), "max_tokens": args.max_tokens, "rounds": args.rounds,
               "piecewise_graphs": args.piecewise, "loads": []}
    for c in (int(c) for c in args.concurrency.split(",")):
        prompts = load_prompts(max(3 * c, 12))  # longer timed windows than 2c: the 2c ones lasted 0.2-0.8 s
        # an explicit KV size: sized from free memory, a later engine would find what earlier ones kept
        llms = {name: LLM("ref-target", device=device, speculator=CONFIGS[name], max_num_seqs=c,
                          kv_cache_tokens=32768, piecewise_graphs=args.piecewise) for name in names}
        results["piecewise_graphs"] = next(iter(llms.values())).engine.piecewise_graphs
        for llm in llms.values():
            run_load(llm, prompts, params)  # warm-up: graph capture for every shape this load meets
        rows = time_loads(llms, prompts, params, args.rounds)
        plain = rows.get("plain")
        plain_outputs = plain["outputs"] if plain else None
        for name, row in rows.items():
            outputs = row.pop("outputs")
            if plain is not None and name != "plain":
                row["identical_to_plain"] = f"{sum(a == b for a, b in zip(outputs, plain_outputs))}/{len(outputs)}"
                row["speedup"] = row["tok_s"] / plain["tok_s"]
                # each round against plain decoding's same round (run seconds apart): a host's drift cancels
                ratios = sorted(a / b for a, b in zip(row["tok_s_rounds"], plain["tok_s_rounds"]))
                row["speedup_paired"] = statistics.median(ratios)
                row["speedup_rounds"] = [round(r, 3) for r in ratios]
            if args.profile:
                row["profile"] = profile_load(llms[name], prompts, params, args.profile)
            row.update(config=name, concurrency=c)
            results["loads"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        for name, row in rows.items():
            for line in row.get("profile", []):
                print(f"{name} c{c} | {line}")
        write_json(args.out, results)  # kept if a time limit ends the run early
        del llms
        free_device_memory(device)
    if args.peer:
        results.update(transformers_peer(device, load_prompts(9), args.max_tokens))
        print({k: v for k, v in results.items() if k.startswith("hf_")})
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
