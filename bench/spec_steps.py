#!/usr/bin/env python3
"""Where a speculating engine's time and memory go at batch 1 (the judge's solo load; --batch N: N replies at
once, as under the team load), on scaled twins.

For the plain twin engine and each speculating one: tokens/s over a few sampled replies (temperature 1,
seeded; --temperature 0: greedy), per k the steps taken, their mean time and the drafter's share of it
(`propose`), tokens per step, the steps in which the drafter first caught up on tokens it had skipped
(speculation switched back on) and their mean time, and the device memory the engine holds (allocated and reserved).
Config plain-overlap: plain decoding with overlapped steps (engine/overlap.py); its steps are Engine.step() calls,
one more per reply than it has steps (the first launches, the last commits), timed without a device sync.  They
are the default with CUDA graphs, so on a GPU `plain` is overlapped too; plain-no-overlap is plain without them.
Configs eagle3-k0, mtp-k0, draft-k0: the speculator with its controller held at k = 0 (it drafts nothing; a head
sleeps, speculate/head_sleep.py): what speculation costs where it does not pay, against plain and plain-no-overlap.
slow_steps: the up to 8 slowest steps past 4x the run's median step, each with what it was (its StepRecord: k,
sequences, fed, drafts, eager) and what first-use work ran in it (torch.compile graphs, Triton compiles of the
specdec.kernels, CUDA graphs captured), printed a line each; first_use_ms: their time beyond the median.

GPU:  python3 bench/spec_steps.py --out $OUT/spec-steps-h200.json
CPU dry run (tiny, no twins):  python3 bench/spec_steps.py --device cpu --target-twin "" --draft-twin "" \\
          --prompts 2 --tokens 16 --out /tmp/spec-steps.json
MTP configs' dry run:  python3 bench/spec_steps.py --device cpu --target ref-hybrid --target-twin "" \\
          --configs plain,mtp-k1,mtp-k1-v32k,mtp-k2-v32k --mtp-draft-vocab 2048 --prompts 2 --tokens 16 \\
          --out /tmp/spec-steps-mtp.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import (alloc_retries, compiles, environment, free_device_memory, sync,  # noqa: E402
                          triton_compiles, write_json)
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path  # noqa: E402
from specdec.engine import fixed_acceptance as fixed_acceptance_module  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402


SLOW_FACTOR = 4.0  # a step slower than this many times the run's median step is a slow (first-use) step
SLOW_LIMIT = 8  # slow steps reported per run, slowest first


@dataclasses.dataclass
class TimedStep:
    """One timed Engine.step() call and what it was: its k, the engine's StepRecord for it (None where the call
    committed no step: an overlapped call that only launched one), and what first-use work it did: torch.compile
    graphs built, Triton binaries compiled, CUDA graphs captured."""
    seconds: float
    k: int
    record: object | None  # specdec.engine.engine.StepRecord
    dynamo_compiles: int
    triton_compiles: int
    graphs_captured: int

    def as_slow_step(self, index: int) -> dict:
        record = self.record
        return {"index": index, "ms": 1e3 * self.seconds, "k": self.k,
                **{field: getattr(record, field, None) for field in ("sequences", "fed", "drafts", "eager")},
                "dynamo_compiles": self.dynamo_compiles, "triton_compiles": self.triton_compiles,
                "graphs_captured": self.graphs_captured}


def first_use_counts(engine) -> tuple[int, int, int]:
    """(torch.compile graphs, Triton binaries, CUDA graphs) built so far: a step's change in them says which
    first-use work it did."""
    return compiles(), triton_compiles(), graphs_held(engine)


def graphs_held(engine) -> int:
    """CUDA graphs the engine's runners hold: the target's static runner (and its fixed acceptance's shapes) and
    piecewise runner, an EAGLE-3 / MTP head's HeadGraphs and ChainGraphs, a drafter's own runner's.  Read
    defensively: a part an engine lacks counts 0."""
    spec = engine.speculator
    spec_runner = getattr(spec, "runner", None)
    holders = (getattr(engine.runner, "static", None), getattr(engine.runner, "piecewise", None),
               getattr(spec, "graphs", None), getattr(spec, "chain_graphs", None),
               getattr(spec_runner, "static", None), getattr(spec_runner, "piecewise", None))
    return sum(_graphs_of(holder) for holder in holders if holder is not None)


def _graphs_of(runner) -> int:
    """A StaticRunner's graphs (key -> (graph, out)), a PiecewiseRunner's (bucket -> [graph per piece]) and its
    FixedAcceptance's shapes that hold a graph."""
    count = 0
    graphs = getattr(runner, "graphs", None)
    if isinstance(graphs, dict):
        count += sum(len(g) if isinstance(g, list) else 1 for g in list(graphs.values()))
    shapes = getattr(getattr(runner, "acceptance", None), "shapes", None)
    if isinstance(shapes, dict):
        count += sum(getattr(shape, "graph", None) is not None for shape in list(shapes.values()))
    return count


@contextlib.contextmanager
def recording_steps(engine):
    """Engine.trace set to a fresh list (yielded) for the block, to read the StepRecords a step() appends; they
    also go to the trace set before, if any."""
    outer, records = getattr(engine, "trace", None), []
    engine.trace = records
    try:
        yield records
    finally:
        engine.trace = outer
        if outer is not None:
            outer.extend(records)


def slow_step_indices(seconds: list[float], factor: float = SLOW_FACTOR, limit: int = SLOW_LIMIT) -> list[int]:
    """The indices of up to `limit` steps slower than `factor` x the median step, slowest first (a capture or a
    compile at first use: 0.2-0.7 s against a 7-40 ms step)."""
    if not seconds:
        return []
    median = statistics.median(seconds)
    slow = [i for i, s in enumerate(seconds) if s > factor * median]
    return sorted(slow, key=lambda i: seconds[i], reverse=True)[:limit]


def slow_step_line(step: dict) -> str:
    """One slow step, short, for a device call's log tail."""
    counts = f"triton+{step['triton_compiles']} dynamo+{step['dynamo_compiles']} graphs+{step['graphs_captured']}"
    return (f"slow step #{step['index']}: {step['ms']:.1f} ms k={step['k']} eager={step['eager']} "
            f"fed={step['fed']} seqs={step['sequences']} drafts={step['drafts']} {counts}")


class StepClock:
    """Times every engine step and the speculator's propose() within it, grouped by the step's k, and keeps each
    step in order (`steps`: its StepRecord and first-use work) to name the slow ones."""

    def __init__(self, llm: LLM):
        self.engine = llm.engine
        self.by_k: dict[int, list[float]] = collections.defaultdict(list)
        self.propose_by_k: dict[int, list[float]] = collections.defaultdict(list)
        self.tokens_by_k: dict[int, int] = collections.Counter()
        self.catch_up_s: list[float] = []  # steps whose drafter first caught up on tokens it had skipped
        self.steps: list[TimedStep] = []  # every timed step, in order
        self._propose_s = 0.0
        step, spec = self.engine.step, self.engine.speculator
        if spec is not None:
            propose = spec.propose

            def timed_propose(requests, ks):
                t0 = time.perf_counter()
                propose(requests, ks)
                self._propose_s += time.perf_counter() - t0
            spec.propose = timed_propose

        def timed_step():
            self._propose_s = 0.0
            before = self.engine.stats["tokens_emitted"]
            forwards = self._draft_forwards()
            counts = first_use_counts(self.engine)
            with recording_steps(self.engine) as records:
                t0 = time.perf_counter()
                finished = step()
                if not self.engine.overlap_steps:  # overlapped: a step() returns with the next step still running
                    sync(self.engine.device)
                seconds = time.perf_counter() - t0
            k = self.engine.controller.last_k if self.engine.controller is not None else 0
            self._keep_step(seconds, k, records, counts)
            if k and self._draft_forwards() - forwards > k:  # more drafter forwards than drafts: a catch-up
                self.catch_up_s.append(seconds)
            self.by_k[k].append(seconds)
            self.propose_by_k[k].append(self._propose_s)
            self.tokens_by_k[k] += self.engine.stats["tokens_emitted"] - before
            return finished
        self.engine.step = timed_step

    def _keep_step(self, seconds: float, k: int, records: list, counts_before: tuple[int, int, int]) -> None:
        """Keep a timed step: its last StepRecord (an overlapped call may commit the step before it and run its
        own; one that only launched has none) and the first-use work done during it."""
        built = [after - before for after, before in zip(first_use_counts(self.engine), counts_before)]
        self.steps.append(TimedStep(seconds, k, records[-1] if records else None, *built))

    def slow_steps(self) -> list[dict]:
        """The run's slow steps (slow_step_indices over all k together), as the summary reports them."""
        indices = slow_step_indices([step.seconds for step in self.steps])
        return [self.steps[i].as_slow_step(i) for i in indices]

    def _draft_forwards(self) -> int:
        spec = self.engine.speculator
        return spec.stats.get("draft_forwards", 0) if spec is not None and hasattr(spec, "stats") else 0

    def reset(self) -> None:
        self.catch_up_s.clear()
        self.steps.clear()
        self.by_k.clear()
        self.propose_by_k.clear()
        self.tokens_by_k.clear()

    def summary(self) -> dict:
        # median_ms beside the mean: a run's few first-use steps (a capture, a compile: 0.2-0.7 s) move a mean of
        # ~100 steps by several ms, not the median
        by_k = {str(k): {"steps": len(t), "step_ms": 1e3 * sum(t) / len(t), "median_ms": 1e3 * statistics.median(t),
                         "max_ms": 1e3 * max(t),
                         "propose_ms": 1e3 * sum(self.propose_by_k[k]) / len(t),
                         "tokens_per_step": self.tokens_by_k[k] / len(t)}
                for k, t in sorted(self.by_k.items())}
        catch_up = {"steps": len(self.catch_up_s),
                    "step_ms": 1e3 * sum(self.catch_up_s) / max(1, len(self.catch_up_s))}
        # slow_steps: the steps past SLOW_FACTOR x the median (all k), each with what it was and the first-use
        # work done in it; first_use_ms: their time beyond the median, what they cost the run
        slow = self.slow_steps()
        median_ms = 1e3 * statistics.median(s.seconds for s in self.steps) if self.steps else 0.0
        return {"by_k": by_k, "catch_up": catch_up, "slow_steps": slow,
                "first_use_ms": sum((step["ms"] - median_ms for step in slow), 0.0)}


def profile_phases(llm: LLM, prompts: list[str], params: SamplingParams, steps: int) -> dict:
    """Where one engine step's time goes, per phase (propose, schedule, verify forward, accept, commit, observe, and
    within them observe ahead, chain ahead, wake):
    host milliseconds per step (the phase's wall time as the host runs it, waits for the device included) and
    device milliseconds per step (the kernels the phase launched, graph replays included), over `steps` steps
    of the prompts' replies decoding together under torch.profiler; `device_busy_ms` is every kernel's time per step, `step_ms` the wall."""
    import specdec.engine.engine as engine_module
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = llm.engine
    spec = engine.speculator
    # "observe ahead" and "chain ahead" run inside "accept" (queued behind the acceptance: its device time
    # includes theirs), "wake" inside "propose" (a sleeping head fed its kept rows)
    targets = [("propose", spec, "propose"), ("observe", spec, "observe"), ("schedule", engine.scheduler, "schedule"),
               ("verify forward", engine.runner, "forward"), ("accept", engine_module, "sample_tokens"),
               ("commit", engine, "_commit"), ("observe ahead", spec, "observe_ahead"),
               ("chain ahead", spec, "propose_ahead"), ("wake", spec, "_wake")]
    saved, host_s = [], collections.Counter()  # host_s: each phase's wall seconds, timed by its wrapper
    for label, owner, attr in targets:
        if owner is None or not hasattr(owner, attr):
            continue
        original = getattr(owner, attr)
        saved.append((owner, attr, original))

        def wrapped(*a, _f=original, _label=label, **kw):
            with record_function(_label):
                t = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    host_s[_label] += time.perf_counter() - t
        setattr(owner, attr, wrapped)
    try:
        reqs = [engine.add_request(llm.tokenizer.encode(p), dataclasses.replace(params, max_tokens=steps * 8))
                for p in prompts]
        for _ in range(3):  # past the prefill
            engine.step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
        sync(engine.device)
        host_s.clear()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            done = 0
            while done < steps and not any(r.finished for r in reqs):
                engine.step()
                done += 1
            sync(engine.device)
        wall = time.perf_counter() - t0
        measured = dict(host_s)
        while engine.has_work():
            engine.step()
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)
    events = prof.key_averages()
    ms_per_step = 1e-3 / max(1, done)  # profiler times are microseconds
    labels = {label for label, _, _ in targets}
    phases = {e.key: {"host_ms": 1e3 * measured.get(e.key, 0.0) / max(1, done),
                      "device_ms": e.device_time_total * ms_per_step}
              for e in events if e.key in labels}
    # kernels, copies and memsets only: a phase's annotation, an operator (aten::) and a runtime call (cuda...)
    # carry their kernels' device time again (before 2026-12-08 device_busy_ms counted kernels twice, ~2x the step)
    kernels = sum(e.self_device_time_total for e in events
                  if e.key not in labels and not e.key.startswith(("aten::", "cuda")))
    def top(time_of, count=12):
        ranked = sorted((e for e in events if e.key not in labels), key=time_of, reverse=True)[:count]
        return [[e.key[:80], round(time_of(e) * ms_per_step, 4), e.count // max(1, done)] for e in ranked]
    # every kernel (up to 80), so that two engines' steps can be diffed kernel by kernel (graph replays included)
    return {"steps": done, "step_ms": 1e3 * wall / max(1, done), "device_busy_ms": kernels * ms_per_step,
            "phases": phases, "top_device": top(lambda e: e.self_device_time_total, 80),
            "top_host": top(lambda e: e.self_cpu_time_total),  # [op, ms per step, calls per step]
            "phase_kernels": phase_kernels(prof.events(), labels, ms_per_step, done)}


def phase_kernels(events, labels: set[str], ms_per_step: float, steps: int, top: int = 8) -> dict:
    """Per phase, its most expensive kernels: [kernel, device ms per step, launches per step], graph replays'
    kernels included (the profiler files them under the cudaGraphLaunch that replayed them)."""
    out = {}
    for label in labels:
        totals, counts = collections.Counter(), collections.Counter()
        stack = [e for e in events if e.name == label]
        while stack:
            event = stack.pop()
            for kernel in event.kernels:
                totals[kernel.name[:80]] += kernel.duration
                counts[kernel.name[:80]] += 1
            stack.extend(event.cpu_children)
        if totals:
            out[label] = [[name, round(us * ms_per_step, 4), counts[name] // max(1, steps)]
                          for name, us in totals.most_common(top)]
    return out


def measure(name: str, make, prompts: list[str], tokens: int, device: torch.device,
            profile_steps: int = 0, batch: int = 1, temperature: float = 1.0) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    llm = make()
    built_s = time.perf_counter() - t0
    clock = StepClock(llm)
    params = [SamplingParams(max_tokens=tokens, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate(prompts[:batch], params[:batch])  # warm-up
    clock.reset()
    before, compiles_before, retries_before = llm.engine.metrics(), compiles(), alloc_retries(device)
    emitted, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):  # `batch` at a time (1: the judge's solo load)
        emitted += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + batch], params[i:i + batch]))
    seconds = time.perf_counter() - t0
    after = llm.engine.metrics()
    row = {"config": name, "built_s": built_s, "tok_s": emitted / seconds, **clock.summary(),
           "compiles": compiles() - compiles_before, "alloc_retries": alloc_retries(device) - retries_before,
           **{key: after.get(key, 0) - before.get(key, 0)
              for key in ("eager_forwards", "draft_eager_forwards", "head_eager_forwards")}}
    if profile_steps:
        row["profile"] = profile_phases(llm, prompts[:batch], params[0], profile_steps)
    if device.type == "cuda":
        row.update(allocated_mib=torch.cuda.memory_allocated(device) / 2**20,
                   reserved_mib=torch.cuda.memory_reserved(device) / 2**20,
                   peak_allocated_mib=torch.cuda.max_memory_allocated(device) / 2**20)
    del llm, clock
    free_device_memory(device)
    return row


def with_head_switches(llm: LLM, early: bool | None, chain_ahead: bool | None, piecewise: bool = False) -> LLM:
    """The LLM with its head's early observe and chain ahead set as asked (None: left as the speculator has
    them), and with piecewise its eager forwards as two graphs around attention (head_piecewise.py), captured
    here rather than at first use."""
    speculator = llm.engine.speculator
    if early is not None and hasattr(speculator, "early_observe"):
        speculator.early_observe = early
    if chain_ahead is not None and hasattr(speculator, "chain_ahead"):
        speculator.chain_ahead = chain_ahead
    if piecewise and hasattr(speculator, "enable_piecewise"):
        speculator.enable_piecewise(llm.engine.config.max_num_batched_tokens, llm.engine.config.cuda_graphs)
        if speculator.piecewise is not None:
            speculator.piecewise.capture_all()
    return llm


def silenced(llm: LLM, config: str) -> LLM:
    """A "-k0" config's LLM with its controller held at k = 0: the speculator drafts nothing (a head sleeps,
    head_sleep.py), so the row says what speculation costs where it does not pay."""
    if config.endswith("-k0"):
        llm.engine.controller.k_max = 0
    return llm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/spec-steps-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--target-twin", default="qwen3-8b")
    parser.add_argument("--draft", default="ref-draft")
    parser.add_argument("--draft-twin", default="qwen3-0.6b")
    parser.add_argument("--head", default="ref-head", help="the EAGLE-3 head of the eagle3 configs")
    parser.add_argument("--head-twin", default="qwen3-8b", help="the head's twin shape (that of its target)")
    parser.add_argument("--mtp-draft-vocab", type=int, default=32768,
                        help="the draft vocabulary of the mtp-k*-v32k configs (the target tokenizer's most frequent "
                             "ids; lower it on a target of a smaller vocabulary run without a twin)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="replies decoding together (1: the solo load)")
    parser.add_argument("--configs", default="plain,draft-adaptive-k8,draft-k4")
    parser.add_argument("--temperature", type=float, default=1.0, help="the replies' temperature (0: greedy)")
    parser.add_argument("--fixed-acceptance", action=argparse.BooleanOptionalAction, default=None,
                        help="the engines' EngineConfig.fixed_acceptance (default: the engine's)")
    parser.add_argument("--early-observe", action=argparse.BooleanOptionalAction, default=None,
                        help="an EAGLE-3 / MTP head's observe launched before the host reads acceptance "
                             "(Eagle3Speculator.early_observe; default: the speculator's)")
    parser.add_argument("--chain-ahead", action=argparse.BooleanOptionalAction, default=None,
                        help="an EAGLE-3 / MTP head's next chain launched behind its early observe "
                             "(Eagle3Speculator.chain_ahead; default: the speculator's)")
    parser.add_argument("--head-piecewise", action="store_true",
                        help="an EAGLE-3 head's eager forwards (prefill observes, wide catch-ups) as two CUDA graphs "
                             "around attention per token bucket (Eagle3Speculator.enable_piecewise)")
    parser.add_argument("--piecewise-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="the engines' EngineConfig.piecewise_graphs (default: the engine's)")
    parser.add_argument("--attention-backend", default=None, choices=("sdpa", "triton"),
                        help="the engines' attention (default: the engine's, triton on a GPU)")
    parser.add_argument("--fused-accept", action=argparse.BooleanOptionalAction, default=True,
                        help="accept steps without top-k / top-p through specdec/kernels/accept.py "
                             "(engine/fixed_acceptance.py FUSED_KERNEL; default on, as the engine)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="also profile this many steps of one reply per engine (profile_phases)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    fixed_acceptance_module.FUSED_KERNEL = args.fused_accept
    prompts = [json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines()[:args.prompts]]
    engine = dict(device=device, max_num_seqs=args.batch, kv_cache_tokens=4096 * args.batch, max_model_len=2048,
                  twin=args.target_twin or None, attention_backend=args.attention_backend,
                  fixed_acceptance=args.fixed_acceptance,
                  piecewise_graphs=args.piecewise_graphs)
    draft = dict(model=args.draft, draft_twin=args.draft_twin or None)
    configs = {"plain": None, "plain-overlap": None, "plain-no-overlap": None,
               "draft-adaptive-k8": SpecConfig("draft", num_draft_tokens=8, **draft),
               "draft-k8": SpecConfig("draft", num_draft_tokens=8, adaptive=False, **draft),
               "draft-k4": SpecConfig("draft", num_draft_tokens=4, adaptive=False, **draft),
               "draft-k2": SpecConfig("draft", num_draft_tokens=2, adaptive=False, **draft)}
    head = dict(model=args.head, draft_twin=args.head_twin or None)
    configs.update({f"eagle3-k{k}": SpecConfig("eagle3", num_draft_tokens=k, adaptive=False, **head)
                    for k in (3, 5, 7)})
    configs["ngram-adaptive-k8"] = SpecConfig("ngram", num_draft_tokens=8)
    configs.update({f"mtp-k{k}": SpecConfig("mtp", num_draft_tokens=k, adaptive=False) for k in (1, 2, 3, 4)})
    configs["mtp-adaptive-k4"] = SpecConfig("mtp", num_draft_tokens=4)  # a Qwen3.5 target's own MTP head
    # the same head over a reduced draft vocabulary: a V_d-row LM head (on a twin, padded ids fill what the
    # small tokenizer lacks, masked: the GEMV's cost is the real model's)
    configs.update({f"mtp-k{k}-v32k": SpecConfig("mtp", num_draft_tokens=k, adaptive=False,
                                                 draft_vocab_size=args.mtp_draft_vocab) for k in (1, 2)})
    configs["eagle3-adaptive-k7"] = SpecConfig("eagle3", num_draft_tokens=7, **head)
    # what a speculator costs while it drafts nothing: its controller held at k = 0 (silenced below)
    configs["eagle3-k0"] = SpecConfig("eagle3", num_draft_tokens=1, adaptive=False, **head)
    configs["mtp-k0"] = SpecConfig("mtp", num_draft_tokens=1, adaptive=False)
    configs["draft-k0"] = SpecConfig("draft", num_draft_tokens=1, adaptive=False, **draft)
    for width, k in ((2, 7), (3, 5), (4, 4)):  # draft trees of at most 16 nodes (the Triton kernel's 17 rows)
        configs[f"eagle3-tree{width}-k{k}"] = SpecConfig("eagle3", num_draft_tokens=k, adaptive=False,
                                                         tree_width=width, **head)
        configs[f"eagle3-tree{width}-adaptive-k{k}"] = SpecConfig("eagle3", num_draft_tokens=k, tree_width=width,
                                                                  **head)
    results = {"env": environment(device), "attention_backend": args.attention_backend or "engine default",
               "fixed_acceptance": args.fixed_acceptance, "fused_accept": args.fused_accept,
               "piecewise_graphs": args.piecewise_graphs, "early_observe": args.early_observe,
               "chain_ahead": args.chain_ahead,
               "target": f"{args.target} as {args.target_twin} twin",
               "drafter": f"{args.draft} as {args.draft_twin} twin", "tokens": args.tokens, "batch": args.batch,
               "temperature": args.temperature, "rows": []}
    # plain-overlap: plain decoding with overlapped steps (engine/overlap.py), which needs fixed acceptance
    overrides = {"plain-overlap": dict(overlap_steps=True, fixed_acceptance=True, static_shapes=True),
                 "plain-no-overlap": dict(overlap_steps=False)}
    for name in args.configs.split(","):
        options = {**engine, **overrides.get(name, {})}
        row = measure(name, lambda: silenced(with_head_switches(LLM(args.target, speculator=configs[name], **options),
                                                                args.early_observe, args.chain_ahead,
                                                                args.head_piecewise), name),
                      prompts, args.tokens, device, args.profile_steps, args.batch, args.temperature)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        for step in row["slow_steps"]:
            print(f"{name}: {slow_step_line(step)}", flush=True)
        print(f"{name}: {len(row['slow_steps'])} slow steps, first_use_ms={row['first_use_ms']:.1f}", flush=True)
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
