#!/usr/bin/env python3
"""Plain decoding at 8B scale on one GPU: step time against the memory floor, batch scaling, prefill,
the verify-step cost model, and transformers' static-cache generate on the same weights; variants at batch 1
and 8 (compiled graphs; overlapped steps, whose batch-1 step time, floor share and host gap are recorded as
step_ms_bs1_overlap, floor_fraction_bs1_overlap and host_gap_ms_bs1_overlap; steps without overlap).  The main
table runs the engine's defaults, overlapped steps among them since they became the default with CUDA graphs,
so the no-overlap variant keeps the comparison.  host_gap_ms_bs1 is the device time between graph replays per
batch-1 step (CUDA events around each replay, no profiler running); idle_ms_bs1, a step's wall time less its
kernels' time, holds the kernel boundaries inside the replays too (idle_split parts it, from the profile).

GPU run:      python3 bench/decode.py --out bench/results/decode-h200.json
CPU dry run:  python3 bench/decode.py --tiny --out /tmp/decode.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import copy_bandwidth_gbs, environment, sync, timed, write_json  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.engine.scheduler import ScheduledSeq  # noqa: E402
from specdec.models.config import ModelConfig  # noqa: E402
from specdec.models.fused import Kernels, enable_fused_kernels  # noqa: E402
from specdec.models.loader import random_model  # noqa: E402
from specdec.models.weight_layout import lay_out_weights  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 151645}
QWEN3_06B = dict(QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True)  # a drafter's shape (Qwen3-0.6B)
TINY = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=8192, eos_token_id=1)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


ATTENTION_BACKEND = None  # --attention-backend: every engine of the run


def make_engine(model, batch: int, context: int, kv_tokens: int, fused: bool | None = None, **options) -> Engine:
    """An engine for `batch` sequences of about `context` tokens; options: other EngineConfig fields (a variant's)."""
    config = EngineConfig(kv_cache_tokens=kv_tokens, max_num_seqs=max(batch, 1), max_num_batched_tokens=8192,
                          max_graph_batch=max(batch, 1), max_graph_context=context + 1024, fused_kernels=fused,
                          attention_backend=ATTENTION_BACKEND, **options)
    return Engine(model, config)


def start_requests(engine: Engine, batch: int, context: int, vocab: int, gen: torch.Generator) -> float:
    """Admit `batch` requests whose prompts share all but their last 16 tokens (prefix cache: one prefill).

    Returns the prefill throughput (tokens/s) of the shared prompt's first request.
    """
    shared = torch.randint(0, vocab, (context - 16,), generator=gen).tolist()
    params = SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True)
    first = engine.add_request(shared + torch.randint(0, vocab, (16,), generator=gen).tolist(), params)
    sync(engine.device)
    t0 = time.perf_counter()
    while first.num_computed < first.num_tokens - 1 or not first.output_token_ids:
        engine.step()
    sync(engine.device)
    prefill_tok_s = context / (time.perf_counter() - t0)
    for _ in range(batch - 1):
        engine.add_request(shared + torch.randint(0, vocab, (16,), generator=gen).tolist(), params)
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    return prefill_tok_s


def decode_step_ms(engine: Engine, steps: int) -> float:
    for _ in range(3):  # capture / warm up this shape
        engine.step()
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    return (time.perf_counter() - t0) / steps * 1e3


def verify_cost_ms(engine: Engine, k: int, vocab: int) -> float:
    """Time of one target forward with k drafts per running request (q = k + 1 tokens each)."""
    reqs = list(engine.scheduler.running)
    gen = torch.Generator().manual_seed(k)
    seqs = []
    for req in reqs:
        req.draft_token_ids = torch.randint(0, vocab, (k,), generator=gen).tolist()
        engine.scheduler._grow(req, req.num_computed + 1 + k)
        seqs.append(ScheduledSeq(req, 1 + k, k, samples=True))
    ms = timed(lambda: engine.runner.forward(seqs), engine.device, repeats=10, warmup=2) * 1e3
    for req in reqs:
        req.draft_token_ids = []
    return ms


def check_against_transformers(model, config_dict: dict, device, vocab: int) -> dict:
    """bf16 logits of our engine vs transformers on the same weights; and transformers' static-cache speed."""
    import transformers

    cfg = transformers.Qwen3Config(**{k: v for k, v in config_dict.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(cfg)
    hf.load_state_dict({k: v for k, v in model.state_dict().items()}, assign=True, strict=False)
    with torch.device(device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    hf = hf.eval()
    ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    engine = Engine(model, EngineConfig(kv_cache_tokens=4096, max_num_seqs=4))
    ours = engine.all_logits(ids[0].tolist()).float()
    with torch.no_grad():
        ref = hf(ids.to(device)).logits[0].float()
    scale = ref.abs().max().item()
    out = {"hf_logits_max_abs_diff": (ours - ref).abs().max().item(), "hf_logits_max_abs": scale,
           "hf_argmax_agreement": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    new = 128
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        hf.generate(ids.to(device), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    cache_implementation="static", pad_token_id=0)
        sync(device)
        seconds = time.perf_counter() - t0
    out["hf_static_tok_s_bs1"] = new / seconds
    del hf
    return out


def check_graph_replay(engine: Engine) -> float:
    """Max |logits| difference between a CUDA-graph replay and the same padded step run eagerly."""
    static = engine.runner.static
    seqs = [ScheduledSeq(r, 1, 0, samples=True) for r in engine.scheduler.running]
    replay = torch.cat(static.run(seqs)).float()
    q = 1
    batch = 1 << max(0, len(seqs) - 1).bit_length()
    ctx = max(s.request.num_computed + q for s in seqs)
    context = 1 << max(0, max(ctx, 256) - 1).bit_length()
    eager = static._eager(batch, q, context)[:len(seqs)].float()
    return (replay - eager).abs().max().item()


def kernel_profile(engine: Engine, steps: int = 5, top: int = 15) -> dict:
    """CUDA kernels of a few decode steps (torch.profiler): count per step and the top ones by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.device_time_total for e in events)
    rows = sorted(events, key=lambda e: -e.device_time_total)[:top]
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    return {"kernels_per_step": sum(e.count for e in events) / steps, "gpu_us_per_step": total_us / steps,
            "idle": {k: v / steps for k, v in idle_gaps(spans).items()},
            "top": [{"name": e.key[:80], "count_per_step": e.count / steps, "us_per_step": e.device_time_total / steps}
                    for e in rows]}


class ReplayMarks:
    """While active, CUDA events recorded on the stream just before and just after every CUDA-graph replay (by
    wrapping torch.cuda.CUDAGraph.replay), in launch order: [(start, end)].  The device time from one replay's
    end to the next one's start is the time between graph replays, where the device waits for the host or runs
    the few kernels outside the graphs; the kernel boundaries inside a replay are not in it."""

    def __init__(self):
        self.marks: list[tuple] = []

    def __enter__(self):
        self.original = torch.cuda.CUDAGraph.replay
        marks, original = self.marks, self.original

        def replay(graph):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            original(graph)
            end.record()
            marks.append((start, end))

        torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.replay = self.original


def between_replays_ms(marks: list[tuple]) -> float:
    """The device time between consecutive graph replays, summed (ms): marks [(start, end)] events (anything with
    elapsed_time(later) in ms), in launch order.  Example: replays at [0, 6.0] and [6.1, 6.3] ms -> 0.1."""
    return sum(max(0.0, end.elapsed_time(following)) for (_, end), (following, _) in zip(marks, marks[1:]))


def replay_gap_ms(engine: Engine, steps: int) -> dict:
    """Per decode step, the device time between graph replays (issue 21's host time between replays) over
    `steps` steady steps, and the replays a step makes; without a profiler, whose start and stop add gaps."""
    for _ in range(2):
        engine.step()
    sync(engine.device)
    with ReplayMarks() as marks:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    per_step = len(marks.marks) / steps  # the window's n replays have n - 1 gaps between them
    mean_gap = between_replays_ms(marks.marks) / max(1, len(marks.marks) - 1)
    return {"between_replays_ms": mean_gap * per_step, "replays_per_step": per_step}


def idle_gaps(spans: list[tuple[float, float]], long_us: float = 20.0) -> dict:
    """Where the device idles between kernels, from their (start, end) times in us: gaps shorter than long_us
    (between the kernels of one graph replay: the cost of a kernel boundary) and longer ones (the device waiting
    for the host), each summed and counted.  Example: kernels at [0, 5], [6, 10], [40, 45] -> short 1 us (one
    gap), long 30 us (one gap)."""
    short_us = long_us_sum = 0.0
    short_n = long_n = 0
    ordered = sorted(spans)
    end = ordered[0][1] if ordered else 0.0
    for start, stop in ordered[1:]:
        gap = start - end
        if 0 < gap < long_us:
            short_us, short_n = short_us + gap, short_n + 1
        elif gap >= long_us:
            long_us_sum, long_n = long_us_sum + gap, long_n + 1
        end = max(end, stop)
    return {"short_gap_us": short_us, "short_gaps": short_n, "long_gap_us": long_us_sum, "long_gaps": long_n}


VARIANTS = {  # name -> make_engine options (the main table runs the engine's defaults)
    "compiled-graphs": dict(compile_graphs="inductor"),
    # overlapped steps (engine/overlap.py, issue 21): the host schedules each step while the one before it runs
    "overlap-steps": dict(overlap_steps=True, fixed_acceptance=True, static_shapes=True),
    "no-overlap": dict(overlap_steps=False),  # the default before overlapped steps were measured
    # a layer's query/key norms, rotations and KV-cache writes as four kernels, not kernels/qk_rope_write.py's one
    "separate-qk-writes": dict(qk_rope_write=False),
    # the paged-attention kernel's shortest split partition (kernels/paged_attention.py, 256 keys by default):
    # 64 spreads a batch-1 step of 512 keys over 8 partitions, 4096 over one (no merge kernel)
    "partitions-64": dict(min_partition=64),
    "partitions-4096": dict(min_partition=4096),
    # the split partitions of MIN_PARTITION keys planned for the graph's longest context, as before each
    # sequence shared its own keys among the splits
    "fixed-partitions": dict(shared_partitions=False),
    # every projection weight stored row-major, as before column-major storage became the GPU's default
    # (models/weight_layout.py)
    "row-major-weights": dict(column_major_weights=False),
}
CPU_VARIANTS = ("overlap-steps",)  # those the CPU dry run (--tiny) runs too: no compile, no CUDA needed


def set_kernel_option(name: str, value):
    """Set the paged-attention kernel's module constant `name` (MIN_PARTITION, SHARED_PARTITIONS)
    where its module is in use and value is not None; returns the value before (None where nothing was set)."""
    module = sys.modules.get("specdec.kernels.paged_attention")
    if value is None or module is None:
        return None
    before = getattr(module, name)
    setattr(module, name, value)
    return before


def variant_rows(model, args, vocab: int, gen, device, save=lambda rows: None) -> list[dict]:
    """Batch 1 and 8 at the first context with each speed-up variant: step time, graph replay vs eager,
    and (batch 1, on a GPU) a kernel profile. A failure is recorded as a finding, not a reason to lose the run.
    On a CPU (the dry run) only CPU_VARIANTS."""
    rows = []
    context = int(args.contexts.split(",")[0])
    names = [n for n in args.variants.split(",") if n and (device.type == "cuda" or n in CPU_VARIANTS)]
    for name in names:
        options = dict(VARIANTS[name])
        writer = Kernels.qk_rope_write if options.pop("qk_rope_write", True) else None
        kernel_options = {"MIN_PARTITION": options.pop("min_partition", None),
                          "SHARED_PARTITIONS": options.pop("shared_partitions", None)}
        row_major = options.get("column_major_weights") is False
        for batch in (int(b) for b in args.variant_batches.split(",")):
            t0 = time.perf_counter()
            saved, Kernels.qk_rope_write = Kernels.qk_rope_write, writer
            saved_options = {option: set_kernel_option(option, value) for option, value in kernel_options.items()}
            if row_major:
                lay_out_weights(model, column_major=False)
            try:
                engine = make_engine(model, batch, context, batch * 64 + context + 64 * (args.max_k + 2) * batch,
                                     **options)
                start_requests(engine, batch, context, vocab, gen)
                ms = decode_step_ms(engine, args.steps)
                engine.drain()  # an overlapped step left in flight is committed before the checks below
                rows.append({"variant": name, "batch": batch, "context": context, "step_ms": ms,
                             "tok_s": batch * 1e3 / ms, "overlapped_steps": engine.stats["overlapped_steps"]})
                if engine.runner.static is not None and engine.runner.static.capture:
                    rows[-1]["graph_vs_eager_max_abs_diff"] = check_graph_replay(engine)
                if batch == 1 and device.type == "cuda":
                    rows[-1]["profile"] = kernel_profile(engine)
                    if engine.runner.static is not None and engine.runner.static.capture:
                        rows[-1]["replays"] = replay_gap_ms(engine, args.steps)
                    engine.drain()
            except Exception as exc:
                rows.append({"variant": name, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:500]})
            finally:
                Kernels.qk_rope_write = saved
                for option, value in saved_options.items():
                    set_kernel_option(option, value)
                if row_major:
                    engine = None  # its graphs read the weights about to move
                    lay_out_weights(model, column_major=device.type == "cuda")  # as the default engines leave them
            rows[-1]["setup_s"] = time.perf_counter() - t0
            print(name, {k: v for k, v in rows[-1].items() if k != "profile"}, flush=True)
            save(rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def idle_split(profile: dict) -> dict:
    """The host gap's two parts per step, from a profile's idle gaps: the device waiting for the host
    (host_wait_ms_bs1: gaps of 20 us or more) and kernel boundaries inside graph replays (the shorter gaps)."""
    idle = profile.get("idle")
    if not idle:
        return {}
    return {"host_wait_ms_bs1": idle["long_gap_us"] / 1e3, "kernel_boundaries_ms_bs1": idle["short_gap_us"] / 1e3}


def overlap_figures(variants: list[dict], floor_ms: float) -> dict:
    """Issue 21's batch-1 figures with overlapped steps, from the overlap-steps variant's batch-1 row: its step
    time, share of the memory floor and (with graphs, on a GPU) the device time left between graph replays."""
    row = next((r for r in variants if r.get("variant") == "overlap-steps" and r["batch"] == 1 and "step_ms" in r),
               None)
    if row is None:
        return {}
    out = {"step_ms_bs1_overlap": row["step_ms"], "floor_fraction_bs1_overlap": floor_ms / row["step_ms"]}
    if "replays" in row:
        out["host_gap_ms_bs1_overlap"] = row["replays"]["between_replays_ms"]
    return out


def table_row(model, args, batch: int, context: int, first_context: int, vocab: int, gen, device,
              verify: list) -> dict:
    """One (batch, context) row of the decode table; at the first context also the verify costs (into
    `verify`) and, at batch 1 on a GPU, a kernel profile."""
    engine = make_engine(model, batch, context, batch * 64 + context + 64 * (args.max_k + 2) * batch)
    prefill = start_requests(engine, batch, context, vocab, gen)
    ms = decode_step_ms(engine, args.steps)
    row = {"batch": batch, "context": context, "step_ms": ms, "tok_s": batch * 1e3 / ms, "prefill_tok_s": prefill}
    if engine.runner.static is not None and engine.runner.static.capture:
        row["graph_vs_eager_max_abs_diff"] = check_graph_replay(engine)
    if batch == 1 and context == first_context and device.type == "cuda":
        row["profile"] = kernel_profile(engine)
        if engine.runner.static is not None and engine.runner.static.capture:
            row["replays"] = replay_gap_ms(engine, args.steps)
    if context == first_context and batch in (1, 8, 32) and args.max_k > 0:
        one = verify_cost_ms(engine, 0, vocab)
        for k in range(args.max_k + 1):
            ms_k = verify_cost_ms(engine, k, vocab)
            verify.append({"batch": batch, "k": k, "forward_ms": ms_k, "relative": ms_k / one})
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/decode-h200.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU: a dry run of every stage")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "qwen3-0.6b"])
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison and its timing")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--variant-batches", default="1,8")
    parser.add_argument("--attention-backend", default=None, choices=("sdpa", "triton"),
                        help="the engines' attention (default: the engine's)")
    args = parser.parse_args(argv)
    global ATTENTION_BACKEND
    ATTENTION_BACKEND = args.attention_backend
    unknown = [n for n in args.variants.split(",") if n and n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    device = torch.device("cpu" if args.tiny else "cuda")
    config_dict = TINY if args.tiny else {"qwen3-8b": QWEN3_8B, "qwen3-0.6b": QWEN3_06B}[args.shape]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict = {"env": environment(device), "model": config_dict, "dtype": str(dtype)}
    t_start = time.perf_counter()

    bw = copy_bandwidth_gbs(device, 0.25 if args.tiny else 4.0)
    model = random_model(ModelConfig.from_dict(config_dict), device, dtype)
    wbytes = weight_bytes(model)
    results.update(copy_bandwidth_gbs=bw, weight_bytes=wbytes, floor_ms_bs1=wbytes / (bw * 1e9) * 1e3)
    print(f"copy bandwidth {bw:.0f} GB/s, weights {wbytes / 1e9:.2f} GB, floor {results['floor_ms_bs1']:.3f} ms")
    if not args.skip_hf:
        results.update(check_against_transformers(model, config_dict, device, config_dict["vocab_size"]))
        print({k: v for k, v in results.items() if k.startswith("hf_")})

    # The engine's GPU default compiles the elementwise pieces, process-wide and for good: do it before any
    # engine so that every row of the table (and the transformers check) runs the same kernels.
    results["fused_kernels"] = device.type == "cuda" and enable_fused_kernels()
    results["qk_rope_write"] = Kernels.qk_rope_write is not None  # one launch for q/k norms, rotations, KV writes
    table, verify, gen = [], [], torch.Generator().manual_seed(0)
    for context in contexts:
        for batch in batches:
            try:
                row = table_row(model, args, batch, context, contexts[0], config_dict["vocab_size"], gen, device,
                                verify)
            except torch.OutOfMemoryError:  # a row that does not fit this GPU is a finding, not a lost run
                row = {"batch": batch, "context": context, "error": "out of memory"}
            table.append(row)
            print(row, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results["decode"] = table
    results["verify_cost"] = verify
    bs1 = next(r for r in table if r["batch"] == 1 and r["context"] == contexts[0] and "step_ms" in r)
    results["step_ms_bs1"] = bs1["step_ms"]
    if "profile" in bs1:  # a step's idle device time: its wall time less its kernels' time
        results["idle_ms_bs1"] = max(0.0, bs1["step_ms"] - bs1["profile"]["gpu_us_per_step"] / 1e3)
        results.update(idle_split(bs1["profile"]))
    if "replays" in bs1:  # of it, the time between graph replays (the rest: kernel boundaries inside them)
        results["host_gap_ms_bs1"] = bs1["replays"]["between_replays_ms"]
    results["attention_backend"] = args.attention_backend or "sdpa"
    results.update(commit=results["env"].get("commit"), date=results["env"].get("date"))
    for b in (1, 32):  # issue 21's figures: a verify step of 7 drafts against a plain step
        row = next((v for v in verify if v["batch"] == b and v["k"] == 7), None)
        if row is not None:
            results[f"verify_ratio_k7_bs{b}"] = row["relative"]
    results["floor_fraction_bs1"] = results["floor_ms_bs1"] / bs1["step_ms"]
    results["wall_s"] = time.perf_counter() - t_start
    write_json(args.out, results)  # the main figures are safe even if a variant below runs out of time
    print(f"bs1: {bs1['step_ms']:.3f} ms/step = {1e3 / bs1['step_ms']:.0f} tok/s; floor {results['floor_ms_bs1']:.3f} ms "
          f"({results['floor_fraction_bs1']:.0%} of floor); transformers static "
          f"{results.get('hf_static_tok_s_bs1', float('nan')):.0f} tok/s")
    def save(rows):
        results["variants"], results["wall_s"] = rows, time.perf_counter() - t_start
        write_json(args.out, results)

    results["variants"] = variant_rows(model, args, config_dict["vocab_size"], gen, device, save)
    results.update(overlap_figures(results["variants"], results["floor_ms_bs1"]))
    results["wall_s"] = time.perf_counter() - t_start
    write_json(args.out, results)
    for row in results["variants"]:
        profile = row.get("profile", {})
        print(f"{row['variant']} bs{row['batch']}: " + (f"{row['step_ms']:.3f} ms/step, "
              f"{profile.get('kernels_per_step', 0):.0f} kernels/step" if "step_ms" in row else row["error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
