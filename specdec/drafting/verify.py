"""``specdec draft verify``: tau of a /draft server on a held-out set, by the walk of docs/DRAFTING.md.

Every conversation is walked from its first continuation token to its last (``walk``), asking the server
for a draft of the whole context so far at each step.  Conversations run concurrently (32 at a time by
default); within one the requests are sequential, each depending on the last.  A failed answer counts as
the empty draft (a step of one token) and as a failure.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import time
from pathlib import Path

from specdec.drafting.protocol import DEFAULT_K, FailureTally, base_url, draft_or_empty, make_client
from specdec.drafting.walk import common_prefix_length, walk

METRIC = "mean_acceptance_length"


@dataclasses.dataclass
class Walked:
    id: str
    tokens: int
    steps: int


@dataclasses.dataclass
class WalkRun:
    conversations: list[Walked]
    tally: FailureTally
    serving_time_s: float  # wall clock from the first request to the last answer


def walk_conversations(url: str, conversations: list[dict], k: int = DEFAULT_K, concurrency: int = 32,
                       timeout_s: float = 60.0, vocab_size: int | None = None,
                       windows: list[tuple[int, int]] | None = None, tally: FailureTally | None = None,
                       progress: bool = False) -> WalkRun:
    """Walk each conversation (over ``windows[i]`` = (start, end) of its continuation, default all of it)."""
    from tqdm.auto import tqdm

    tally = tally or FailureTally()
    windows = windows or [(0, len(c["continuation"])) for c in conversations]
    client = make_client(concurrency, timeout_s)

    def walk_one(conversation: dict, window: tuple[int, int]) -> Walked:
        prompt, continuation = conversation["prompt"], conversation["continuation"]

        def accepted_at(pos: int) -> int:
            draft = draft_or_empty(client, url, prompt + continuation[:pos], k, tally, vocab_size)
            return common_prefix_length(draft, continuation[pos:pos + k])

        return Walked(str(conversation.get("id")), *walk(window[1], accepted_at, window[0]))

    start = time.perf_counter()
    with client, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        jobs = [pool.submit(walk_one, c, w) for c, w in zip(conversations, windows)]
        with tqdm(total=len(jobs), desc="walk", unit="conv", disable=not progress) as bar:
            for _ in concurrent.futures.as_completed(jobs):
                bar.update()
        walked = [job.result() for job in jobs]
    return WalkRun(walked, tally, time.perf_counter() - start)


def score(tau: float, tau_base: float, tau_goal: float) -> float:
    """clamp((tau - tau_base) / (tau_goal - tau_base) * 100, 0, 100)."""
    return min(100.0, max(0.0, (tau - tau_base) / (tau_goal - tau_base) * 100.0))


def tau_record(run: WalkRun, k: int, tau_base: float | None = None, tau_goal: float | None = None,
               **context) -> dict:
    """The verifier's JSON record.  Defaults: tau_base 1 (no drafter), tau_goal k + 1 (every draft accepted)."""
    tau_base = 1.0 if tau_base is None else tau_base
    tau_goal = k + 1.0 if tau_goal is None else tau_goal
    walked = [w for w in run.conversations if w.steps]
    tokens, steps = sum(w.tokens for w in walked), sum(w.steps for w in walked)
    tau = tokens / steps if steps else float("nan")
    macro = sum(w.tokens / w.steps for w in walked) / len(walked) if walked else float("nan")
    return {
        "metric": METRIC,
        "tau": round(tau, 4),
        "tokens": tokens,
        "steps": steps,
        "samples": len(walked),
        "draft_tokens": k,
        "tau_macro_over_prompts": round(macro, 4),
        "score": round(score(tau, tau_base, tau_goal), 2) if steps else 0.0,
        "tau_base": tau_base,
        "tau_goal": tau_goal,
        "failures": run.tally.failures,
        "failure_kinds": run.tally.kinds(),
        "requests": run.tally.requests,
        "serving_time_s": round(run.serving_time_s, 3),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **context,
    }


def summary(record: dict) -> str:
    """The one-screen summary of a verifier record."""
    kinds = ", ".join(f"{kind} {n}" for kind, n in record["failure_kinds"].items())
    rate = record["requests"] / record["serving_time_s"] if record["serving_time_s"] else 0.0
    return "\n".join([
        f"drafter {record.get('url', '?')} on {record.get('heldout', '?')}: {record['samples']} conversations, "
        f"k = {record['draft_tokens']}, concurrency {record.get('concurrency', '?')}",
        f"  tau                     {record['tau']:.3f}  ({record['tokens']:,} tokens in {record['steps']:,} steps)",
        f"  tau_macro_over_prompts  {record['tau_macro_over_prompts']:.3f}",
        f"  score                   {record['score']:.1f}  (tau_base {record['tau_base']:.3f}, "
        f"tau_goal {record['tau_goal']:.3f})",
        f"  failures                {record['failures']:,} of {record['requests']:,} requests ({kinds})",
        f"  serving time            {record['serving_time_s']:.1f} s  ({rate:.0f} requests/s)",
    ])


def verify(url: str, heldout: str | Path, k: int = DEFAULT_K, concurrency: int = 32, timeout_s: float = 60.0,
           vocab_size: int | None = None, tau_base: float | None = None, tau_goal: float | None = None,
           limit: int | None = None, progress: bool = False) -> dict:
    from specdec.drafting.heldout import load_heldout

    conversations = load_heldout(heldout, limit)
    run = walk_conversations(base_url(url), conversations, k, concurrency, timeout_s, vocab_size, progress=progress)
    return tau_record(run, k, tau_base, tau_goal, url=base_url(url), heldout=str(heldout), concurrency=concurrency)


def write_record(record: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
