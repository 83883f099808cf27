#!/usr/bin/env python3
"""tau of a drafter served over /draft, on the target's held-out set, and its serving time: ``specdec draft
serve`` in a process of its own, the six self-check gates, then ``specdec draft verify`` over the whole set.

Defaults: ref-draft at k = 16 and concurrency 32 on bench/results/ref-target-heldout.jsonl, which is
ref-target's greedy continuations (128 tokens at most) of the 200 bundled held-out prompts, made once by
the engine on CPU in float32 (``--make-heldout`` remakes it; the same file serves CPU and GPU runs, so the
figures compare):
    specdec draft heldout --target ref-target --out bench/results/ref-target-heldout.jsonl \\
        --device cpu --kv-cache-tokens 70000

CPU:  python3 bench/draft_verify.py --device cpu --out bench/results/draft-verify-cpu.json
GPU:  python3 bench/draft_verify.py --device cuda --out bench/results/draft-verify-h200.json
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from specdec.drafting.protocol import health_status, make_client  # noqa: E402
from specdec.drafting.selfcheck import SelfCheckConfig, report, run_selfcheck, stop_process_group  # noqa: E402
from specdec.drafting.verify import summary, verify  # noqa: E402
from specdec.parent_watch import child_env  # noqa: E402

HELDOUT = REPO / "bench" / "results" / "ref-target-heldout.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_heldout(path: Path, target: str) -> None:
    subprocess.run([sys.executable, "-m", "specdec.cli", "draft", "heldout", "--target", target, "--out", str(path),
                    "--device", "cpu", "--kv-cache-tokens", "70000"], check=True, cwd=REPO)


def serve_command(args: argparse.Namespace, port: int) -> str:
    return (f"cd {REPO} && exec {sys.executable} -m specdec.cli draft serve {args.drafter} --port {port} "
            f"--device {args.device}")


def verify_against_fresh_server(args: argparse.Namespace) -> tuple[dict, dict]:
    """Start the server, wait for health, walk the whole held-out set; (record, server metrics)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(serve_command(args, port), shell=True, start_new_session=True, env=child_env())
    try:
        with make_client(1, 10.0) as client:
            start = time.monotonic()
            while health_status(client, url, 2.0) != 200:
                if process.poll() is not None or time.monotonic() - start > 300:
                    raise RuntimeError("the drafter server did not become healthy")
                time.sleep(0.25)
            startup_s = time.monotonic() - start
            record = verify(url, args.heldout, args.k, args.concurrency, timeout_s=60.0, vocab_size=args.vocab_size,
                            progress=True)
            record["startup_s"] = round(startup_s, 2)
            server_metrics = client.get(f"{url}/metrics").json()
    finally:
        stop_process_group(process)
    return record, server_metrics


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--drafter", default="ref-draft")
    p.add_argument("--target", default="ref-target", help="for --make-heldout")
    p.add_argument("--heldout", type=Path, default=HELDOUT)
    p.add_argument("--make-heldout", action="store_true", help="remake the held-out set first")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=8192, help="the target's vocabulary (ref-target: 8192)")
    p.add_argument("--no-selfcheck", action="store_true")
    args = p.parse_args()
    if args.make_heldout or not args.heldout.is_file():
        make_heldout(args.heldout, args.target)
    result = {"command": " ".join(sys.argv), "device": args.device, "drafter": args.drafter,
              **environment(torch.device(args.device))}
    if not args.no_selfcheck:
        from specdec.drafting.heldout import load_heldout

        config = SelfCheckConfig(serve_command(args, free_port()), load_heldout(args.heldout), k=args.k,
                                 concurrency=args.concurrency, vocab_size=args.vocab_size)
        gates = run_selfcheck(config)
        print(report(gates))
        result["selfcheck"] = [vars(g) for g in gates]
    record, server_metrics = verify_against_fresh_server(args)
    print(summary(record))
    result.update(verify=record, server_metrics=server_metrics)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
