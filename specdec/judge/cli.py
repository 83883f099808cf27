"""`specdec judge` (any two OpenAI-compatible engines), `specdec demo` (the reference pair on CPU) and
`specdec leaderboard` (records ranked)."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
from pathlib import Path

from specdec.errors import ConfigError
from specdec.judge.config import QUICK, WORKLOADS, JudgeConfig, Limits

LIMIT_FLAGS = {"greedy_agreement_floor": "greedy agreement floor (default: none, reported only)",
               "likelihood_bound": "sampled replies' likelihood bound (default 0.05)",
               "argmax_bound": "share-of-first-choices bound (default 0.01)",
               "fidelity_ceiling": "fixed texts' log-prob ceiling (default 0.002; 0.02 for other kernels)",
               "length_margin": "reply-length margin (default 0.05)",
               "memory_slack_mib": "memory allowed above stock's peak, MiB (default 4096)",
               "memory_budget_mib": "a fixed memory budget for the candidate, MiB (instead of stock + slack)"}


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by judge and demo: what to run and how long."""
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for record.json, report.html and the engines' logs (demo: demo-out)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small run: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of solo,team,busy")
    parser.add_argument("--passes", type=int, default=3, help="timed passes per workload and engine (default 3)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per pass (default: all)")
    parser.add_argument("--concurrency", type=int, default=None, help="team concurrency (default 16)")
    parser.add_argument("--busy-concurrency", type=int, default=None,
                        help="busy concurrency (default: enough for >= 90%% KV-cache use per /metrics)")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 128)")
    parser.add_argument("--busy-max-tokens", type=int, default=None, help="max_tokens in busy (default 2x)")
    parser.add_argument("--gate-prompts", type=int, default=None,
                        help="prompts for greedy agreement and fixed texts (default 32)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="request i gets seed SEED + i")
    parser.add_argument("--layout", choices=("auto", "together", "alternate"), default="auto",
                        help="both engines up at once, or one at a time (auto: one at a time on a GPU)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for an engine's /health")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    limits = parser.add_argument_group("gate limits")
    for name, text in LIMIT_FLAGS.items():
        limits.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=text)


def config_from_args(args: argparse.Namespace, stock: str, candidate: str, prompts: Path, out: Path,
                     **overrides) -> JudgeConfig:
    sized = {key: getattr(args, key) for key in QUICK if getattr(args, key) is not None}
    if args.quick:
        sized = {**QUICK, **overrides, **sized}
    else:
        sized = {**overrides, **sized}
    limits = Limits(**{k: getattr(args, k) for k in LIMIT_FLAGS if getattr(args, k) is not None})
    return JudgeConfig(stock=stock, candidate=candidate, prompts=prompts, out=out,
                       workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
                       passes=args.passes, busy_concurrency=args.busy_concurrency, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, layout=args.layout, limits=limits,
                       request_timeout_s=args.request_timeout, startup_timeout_s=args.startup_timeout,
                       quiet=args.quiet, quick=args.quick, **sized,
                       **{k: getattr(args, k) for k in OPTIONAL if getattr(args, k, None)})


OPTIONAL = ("fixed_texts", "model", "stock_model", "candidate_model", "scorer", "scorer_device", "title")
"""judge options that only some runs give (JudgeConfig's defaults stand otherwise)."""


def cmd_judge(args: argparse.Namespace) -> int:
    from specdec.assets import heldout_prompts_path

    if args.out is None:
        raise ConfigError("specdec judge needs --out DIR (for record.json, report.html and the engines' logs)")
    config = config_from_args(args, args.stock, args.candidate, args.prompts or heldout_prompts_path(), args.out)
    return judge_and_print(config)


def judge_and_print(config: JudgeConfig, lead: list[str] = ()) -> int:
    from rich.console import Console

    from specdec.judge.run import run_judge
    from specdec.judge.summary import print_summary

    with sigterm_as_exit():
        record = run_judge(config)
    print_summary(Console(), record, lead)
    Console().print(f"record: {config.out / 'record.json'}\nreport: {config.out / 'report.html'}", highlight=False)
    return 0 if record["reason"] is None else 1


@contextlib.contextmanager
def sigterm_as_exit():
    """While judging, SIGTERM raises SystemExit(143) so that the run's `finally` stops the engines it started:
    Python's default would end the judge at once and leave them running (in sessions of their own, the signal
    does not reach them).  A second SIGTERM is ignored, so that it cannot cut that stopping short."""

    def terminate(sig: int, frame) -> None:
        signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + sig)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_command(model: str, kv_cache_tokens: int, extra: str = "") -> str:
    """A `specdec serve` command line for the judge (which fills in {port}: the run prints the real one)."""
    return (f"{shlex.quote(sys.executable)} -m specdec.cli serve {model} --device cpu --kv-cache-tokens "
            f"{kv_cache_tokens} --host 127.0.0.1 --port {{port}} {extra}").strip()


DEMO_SPECULATORS = {
    "ngram": ("--speculator ngram --num-draft-tokens {k}",
              "n-gram lookup in the request's own context (the speculator that pays on a CPU: the ref-draft "
              "drafter costs about a target forward here, docs/BENCHMARKS.md)"),
    "draft": ("--speculator draft --draft-model ref-draft --num-draft-tokens {k}",
              "the ref-draft drafter (on a CPU it costs about as much per forward as the target, so expect "
              "no speedup; it pays on a GPU)"),
}


def cmd_demo(args: argparse.Namespace) -> int:
    import importlib.util

    from specdec.assets import heldout_prompts_path, resolve_model

    for name in ("ref-target", "ref-draft") if args.speculator == "draft" else ("ref-target",):
        try:
            resolve_model(name)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
    if importlib.util.find_spec("specdec.server") is None:
        raise ConfigError("`specdec serve` is not available in this build, and the demo needs it to start engines")
    flags, why = DEMO_SPECULATORS[args.speculator]
    stock = serve_command("ref-target", args.kv_cache_tokens)
    candidate = serve_command("ref-target", args.kv_cache_tokens, flags.format(k=args.num_draft_tokens))
    config = config_from_args(args, stock, candidate, heldout_prompts_path(), args.out or Path("demo-out"),
                              **({} if args.quick else DEMO))
    lead = [f"speculator: {args.speculator} (k={args.num_draft_tokens}): {why}"]
    if not args.quiet:
        print(lead[0], flush=True)
    return judge_and_print(config, lead)


DEMO = dict(num_prompts=16, max_tokens=64, busy_max_tokens=96, concurrency=8, gate_prompts=16)
"""The demo without --quick: a larger CPU run (tens of minutes on 2 cores)."""


def add_judge_parsers(sub) -> None:
    judge = sub.add_parser("judge", help="SpecScore and the lossless gate: a candidate engine against stock",
                           description="Compare a speculating engine with stock on solo, team and busy loads; "
                                       "write record.json and report.html.  An engine is a command line (its "
                                       "{port} is filled in; without one, --port PORT is appended) or the URL "
                                       "of a running OpenAI-compatible server.")
    judge.add_argument("--stock", required=True, help="command line or URL of the engine without speculation")
    judge.add_argument("--candidate", required=True, help="command line or URL of the speculating engine")
    judge.add_argument("--prompts", type=Path, default=None,
                       help="JSON lines with a \"prompt\" field (default: the bundled held-out prompts)")
    judge.add_argument("--fixed-texts", type=Path, default=None,
                       help="texts scored by both engines (default: the first --gate-prompts prompts)")
    judge.add_argument("--model", default=None, help="the requests' model field (default: from /v1/models)")
    judge.add_argument("--stock-model", default=None,
                       help="the stock engine's model field, where the engines name one model differently "
                            "(default: --model)")
    judge.add_argument("--candidate-model", default=None, help="the candidate's model field (default: --model)")
    judge.add_argument("--scorer", type=Path, default=None, metavar="MODEL_DIR",
                       help="score fixed texts' greedy continuations and sampled replies with this local "
                            "reference model (for engines without prompt log-probs, e.g. transformers serve)")
    judge.add_argument("--scorer-device", default="auto", help="the scorer's device (default: auto)")
    judge.add_argument("--title", default=None, help="the report's title (default: model · speculator)")
    add_run_args(judge)
    judge.set_defaults(func=cmd_judge)

    demo = sub.add_parser("demo", help="judge the reference pair on CPU: ref-target alone vs with ref-draft")
    demo.add_argument("--speculator", choices=tuple(DEMO_SPECULATORS), default="ngram",
                      help="ngram (default: it pays on a CPU) or draft (the ref-draft drafter, which pays on a GPU)")
    demo.add_argument("--num-draft-tokens", type=int, default=4, help="k of the speculator (default 4)")
    demo.add_argument("--kv-cache-tokens", type=int, default=2048,
                      help="each engine's KV cache in tokens (small, so that busy fills it)")
    add_run_args(demo)
    demo.set_defaults(func=cmd_demo)

    from specdec.judge.leaderboard import add_leaderboard_parser

    add_leaderboard_parser(sub)
