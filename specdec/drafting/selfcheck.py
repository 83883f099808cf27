"""``specdec draft selfcheck``: the six gates of docs/DRAFTING.md, before anyone spends a full run.

1. size: the drafter's directory within a limit;
2. startup: ``GET /health`` answers 200 within the startup limit (300 s) of launching the command;
3. smoke: one ``POST /draft`` returns a list of ints;
4. serving time, projected: walk windows of ~76 tokens, spread from openings to ends, of the first 32
   conversations at concurrency 32, then scale the time by held-out tokens / walked tokens: within budget;
5. request failures: failed, timed-out or malformed answers during gates 3-4: none;
6. healthy after requests: the server is alive and ``GET /health`` is still 200.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from specdec.drafting.protocol import DEFAULT_K, DraftFailure, FailureTally, fetch_draft, health_status, make_client
from specdec.drafting.verify import walk_conversations
from specdec.parent_watch import child_env

DEFAULT_PORT = 8100
WINDOW_TOKENS = 76
SAMPLE_CONVERSATIONS = 32


@dataclasses.dataclass
class Gate:
    number: int
    name: str
    passed: bool
    figure: str


@dataclasses.dataclass
class SelfCheckConfig:
    launch: str  # shell command that starts the server
    heldout: list[dict]
    url: str | None = None  # default: http://127.0.0.1:PORT, PORT from the command's --port
    drafter_dir: str | None = None  # default: the first model directory named in the command
    max_size_bytes: int = 4 * 10**9
    startup_timeout_s: float = 300.0
    budget_s: float = 600.0
    k: int = DEFAULT_K
    concurrency: int = 32
    timeout_s: float = 60.0
    vocab_size: int | None = None


def url_from_launch(launch: str) -> str:
    """http://127.0.0.1:PORT with the command's --port (default 8100, ``specdec draft serve``'s)."""
    args = shlex.split(launch)
    for i, arg in enumerate(args):
        if arg == "--port" and i + 1 < len(args):
            return f"http://127.0.0.1:{args[i + 1]}"
        if arg.startswith("--port="):
            return f"http://127.0.0.1:{arg.split('=', 1)[1]}"
    return f"http://127.0.0.1:{DEFAULT_PORT}"


def drafter_dir_from_launch(launch: str) -> Path | None:
    """The first argument of the command that names a model directory (a path or a short name)."""
    from specdec.assets import resolve_model

    for arg in shlex.split(launch):
        try:
            path = resolve_model(arg)
        except (FileNotFoundError, OSError):
            continue
        if (path / "config.json").is_file():
            return path
    return None


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def spread_windows(conversations: list[dict], width: int = WINDOW_TOKENS) -> list[tuple[int, int]]:
    """One window of ``width`` continuation tokens per conversation, from the opening of the first
    conversation to the end of the last: window i starts i / (n - 1) of the way through its conversation."""
    n = len(conversations)
    windows = []
    for i, conversation in enumerate(conversations):
        length = len(conversation["continuation"])
        start = round(i * max(0, length - width) / (n - 1)) if n > 1 else 0
        windows.append((start, min(length, start + width)))
    return windows


def check_size(config: SelfCheckConfig) -> Gate:
    path = Path(config.drafter_dir) if config.drafter_dir else drafter_dir_from_launch(config.launch)
    if path is None or not path.is_dir():
        return Gate(1, "size", False, "no drafter directory found: pass --drafter DIR")
    size = directory_bytes(path)
    return Gate(1, "size", size <= config.max_size_bytes,
                f"{size / 1e6:,.1f} MB in {path} (limit {config.max_size_bytes / 1e6:,.0f} MB)")


def wait_healthy(process: subprocess.Popen, client, url: str, timeout_s: float) -> Gate:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if health_status(client, url, timeout_s=2.0) == 200:
            return Gate(2, "startup", True, f"GET /health 200 after {time.monotonic() - start:.1f} s")
        if process.poll() is not None:
            return Gate(2, "startup", False, f"the server exited with status {process.returncode} before it was "
                                             "healthy")
        time.sleep(0.25)
    return Gate(2, "startup", False, f"GET /health not 200 within {timeout_s:.0f} s")


def smoke(client, config: SelfCheckConfig, url: str, tally: FailureTally) -> Gate:
    prompt = config.heldout[0]["prompt"]
    try:
        draft = fetch_draft(client, url, prompt, config.k, config.vocab_size, config.timeout_s)
    except DraftFailure as failure:
        tally.record(failure)
        return Gate(3, "smoke", False, f"POST /draft failed: {failure}")
    tally.record(None)
    shown = draft if len(draft) <= 8 else draft[:8] + ["..."]
    return Gate(3, "smoke", True, f"POST /draft -> {len(draft)} ids {shown}")


def projected_serving_time(config: SelfCheckConfig, url: str, tally: FailureTally) -> Gate:
    sample = config.heldout[:SAMPLE_CONVERSATIONS]
    windows = spread_windows(sample)
    run = walk_conversations(url, sample, config.k, config.concurrency, config.timeout_s, config.vocab_size,
                             windows, tally)
    walked = sum(end - start for start, end in windows)
    total = sum(len(c["continuation"]) for c in config.heldout)
    if not walked:
        return Gate(4, "serving time", False, "the sampled windows hold no continuation tokens")
    projected = run.serving_time_s * total / walked
    return Gate(4, "serving time", projected <= config.budget_s,
                f"{projected:.1f} s projected for {total:,} tokens ({run.serving_time_s:.2f} s for {walked:,} "
                f"sampled tokens; budget {config.budget_s:.0f} s)")


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the launched command's process group, then SIGKILL what is left after 10 s."""
    if process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_selfcheck(config: SelfCheckConfig, log_path: str | Path | None = None) -> list[Gate]:
    """Launch the server, run the six gates, stop the server; the gates in order."""
    url = (config.url or url_from_launch(config.launch)).rstrip("/")
    gates = [check_size(config)]
    tally = FailureTally()
    log_path = log_path or tempfile.mkstemp(prefix="draft-selfcheck-", suffix=".log")[1]
    with open(log_path, "w") as log, make_client(config.concurrency, config.timeout_s) as client:
        # SPECDEC_PARENT_PID: a `specdec draft serve` launched here ends itself if this check is killed
        process = subprocess.Popen(config.launch, shell=True, start_new_session=True, stdout=log,
                                   stderr=subprocess.STDOUT, env=child_env())
        try:
            gates.append(wait_healthy(process, client, url, config.startup_timeout_s))
            if gates[-1].passed:
                gates.append(smoke(client, config, url, tally))
                gates.append(projected_serving_time(config, url, tally))
            else:
                gates += [Gate(3, "smoke", False, "not run: the server never became healthy"),
                          Gate(4, "serving time", False, "not run: the server never became healthy")]
            gates.append(Gate(5, "request failures", tally.failures == 0 and tally.requests > 0,
                              f"{tally.failures} of {tally.requests} requests failed "
                              f"({', '.join(f'{k} {n}' for k, n in tally.kinds().items())})"))
            status = health_status(client, url) if process.poll() is None else None
            figure = f"GET /health {status}" if process.poll() is None else \
                f"the server exited with status {process.returncode}"
            gates.append(Gate(6, "healthy after requests", status == 200, figure))
        finally:
            stop_process_group(process)
    return gates


def report(gates: list[Gate]) -> str:
    lines = [f"  {g.number}. {g.name:<24} {'PASS' if g.passed else 'FAIL'}  {g.figure}" for g in gates]
    verdict = "all gates pass" if all(g.passed for g in gates) else \
        f"{sum(not g.passed for g in gates)} gate(s) FAIL"
    return "\n".join(["self-check", *lines, verdict])
