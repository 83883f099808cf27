"""``specdec draft serve | heldout | verify | selfcheck``."""

from __future__ import annotations

import argparse

from specdec.drafting.protocol import DEFAULT_K
from specdec.engine_args import add_engine_args, engine_kwargs


def cmd_serve(args: argparse.Namespace) -> int:
    from specdec.drafting.server import serve
    from specdec.parent_watch import exit_with_parent

    exit_with_parent()  # a supervisor (draft selfcheck, a bench) killed while we serve must not leave us behind
    serve(args.drafter, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
          kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size, max_batch=args.max_batch)
    return 0


def cmd_heldout(args: argparse.Namespace) -> int:
    from specdec import LLM
    from specdec.assets import heldout_prompts_path
    from specdec.data.corpus import write_jsonl
    from specdec.drafting.heldout import make_heldout, read_jsonl

    prompts = read_jsonl(args.prompts or heldout_prompts_path())[:args.limit]
    llm = LLM(args.target, **engine_kwargs(args))
    rows = make_heldout(llm, prompts, args.max_tokens)
    write_jsonl(args.out, rows)
    tokens = sum(len(r["continuation"]) for r in rows)
    print(f"{len(rows)} conversations, {tokens:,} continuation tokens -> {args.out}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from specdec.drafting.verify import summary, verify, write_record

    record = verify(args.url, args.heldout, args.k, args.concurrency, args.timeout, args.vocab_size,
                    args.tau_base, args.tau_goal, args.limit, progress=True)
    print(summary(record))
    if args.out:
        write_record(record, args.out)
        print(f"record -> {args.out}")
    return 0


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from specdec.drafting.heldout import load_heldout
    from specdec.drafting.selfcheck import SelfCheckConfig, report, run_selfcheck

    config = SelfCheckConfig(args.launch, load_heldout(args.heldout), args.url, args.drafter,
                             int(args.max_size_gb * 1e9), args.startup_timeout, args.budget, args.k,
                             args.concurrency, args.timeout, args.vocab_size)
    gates = run_selfcheck(config, args.log)
    print(report(gates))
    if args.out:
        from specdec.drafting.verify import write_record

        write_record({"gates": [vars(g) for g in gates], "passed": all(g.passed for g in gates)}, args.out)
    return 0 if all(g.passed for g in gates) else 1


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heldout", required=True, help="held-out set (JSON lines from `specdec draft heldout`)")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="draft tokens asked for per request (16)")
    parser.add_argument("--concurrency", type=int, default=32, help="conversations walked at once (32)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per /draft request (60)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the target's vocabulary: ids outside [0, V) make a draft malformed")


def add_draft_parser(sub) -> None:
    draft = sub.add_parser("draft", help="drafters as services: serve, held-out set, verify, self-check")
    actions = draft.add_subparsers(dest="draft_command", required=True)

    serve = actions.add_parser("serve", help="serve a drafter on GET /health and POST /draft")
    serve.add_argument("drafter", help="drafter model directory, or a bundled short name (ref-draft)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--max-batch", type=int, default=64, help="most /draft requests drafted together")
    serve.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    serve.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    serve.add_argument("--kv-cache-tokens", type=int, default=None,
                       help="drafter KV cache in tokens, shared by all conversations (default: half the free GPU "
                            "memory up to 1M tokens, or 32k on CPU)")
    serve.add_argument("--block-size", type=int, default=16)
    serve.set_defaults(func=cmd_serve)

    heldout = actions.add_parser("heldout", help="the target's greedy continuations of held-out prompts")
    heldout.add_argument("--target", required=True, help="target model directory, or a short name (ref-target)")
    heldout.add_argument("--prompts", default=None,
                         help="JSON lines {id, prompt (text or ids)} (default: the bundled held-out prompts)")
    heldout.add_argument("--out", required=True, help="output JSON lines {id, prompt, continuation}")
    heldout.add_argument("--max-tokens", type=int, default=128, help="longest continuation (128)")
    heldout.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    add_engine_args(heldout)
    heldout.set_defaults(func=cmd_heldout)

    verify = actions.add_parser("verify", help="tau of a /draft server on a held-out set")
    verify.add_argument("--url", required=True, help="base URL of the /draft server")
    add_client_args(verify)
    verify.add_argument("--out", default=None, help="write the JSON record here")
    verify.add_argument("--tau-base", type=float, default=None, help="tau of the untouched base drafter (1.0)")
    verify.add_argument("--tau-goal", type=float, default=None, help="tau goal of the score (k + 1)")
    verify.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    verify.set_defaults(func=cmd_verify)

    check = actions.add_parser("selfcheck", help="launch a drafter server and run the six gates")
    check.add_argument("--launch", required=True, help="shell command that starts the server")
    add_client_args(check)
    check.add_argument("--url", default=None, help="server URL (default: from the command's --port, else 8100)")
    check.add_argument("--drafter", default=None, help="drafter directory for the size gate (default: from --launch)")
    check.add_argument("--max-size-gb", type=float, default=4.0, help="size limit of the drafter directory (4 GB)")
    check.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to become healthy (300)")
    check.add_argument("--budget", type=float, default=600.0, help="projected serving-time budget, seconds (600)")
    check.add_argument("--log", default=None, help="write the server's output here (default: a temp file)")
    check.add_argument("--out", default=None, help="write the gates as JSON here")
    check.set_defaults(func=cmd_selfcheck)
