"""A fake OpenAI-compatible engine over a toy bigram "model", for testing the judge.

    python -m tests.fakes.engine --port PORT [--mode MODE] [--token-ms MS] [--speedup X] [--speculate] ...

The model: a vocabulary of WORDS plus an end-of-text token; the next token's log-probs depend only on the
previous word (a seeded table), so sampling, greedy decoding and prompt scoring (echo + logprobs) are all
real and deterministic given the request's seed.  Text is tokenized as whitespace-led words.  Replies take
token_ms / speedup milliseconds per token (requests run in parallel threads, as in a batching engine).

Modes, each built to fail one check of the judge's gate (normal passes them all):
  normal   the model as it is
  hot      samples at 1.6 x the asked temperature         (likelihood, first choices)
  cold     samples at 0.5 x the asked temperature         (likelihood, first choices)
  short    stops every reply at half its max_tokens        (reply lengths)
  perturb  adds noise to the log-probs it reports          (fixed texts)
  hog      holds --hog-mib of extra memory                 (device memory)
  inflate  claims twice the tokens it generated in usage   (token counts, reply lengths)
  crash    exits with code 3 before serving
  fail     answers completions with HTTP 500
  hang     never answers completions

--no-logprobs answers as `transformers serve` does (transformers 5.x, cli/serving/completion.py): it ignores
`echo` and `logprobs` (text and usage only, no logprobs field) and refuses max_tokens=0 with HTTP 400.
--served-model-name NAME lists NAME at /v1/models and answers a request for another model with HTTP 404.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

WORDS = [a + b for a in ("ka", "lo", "mi", "nu", "pe", "ro", "si", "tu") for b in ("n", "r", "s", "t", "")]
EOS = len(WORDS)
TOKEN = re.compile(r"\s*\S+")
KV_WINDOW_S = 0.3
TEMPERATURE_SCALE = {"hot": 1.6, "cold": 0.5}


def word_id(token: str) -> int:
    word = token.strip()
    return WORDS.index(word) if word in WORDS else zlib.crc32(word.encode()) % len(WORDS)


class ToyModel:
    def __init__(self, seed: int = 1234, scale: float = 2.5, eos_shift: float = -1.0, variant: float = 0.0):
        rng = np.random.default_rng(seed)
        logits = rng.normal(0.0, scale, size=(len(WORDS), len(WORDS) + 1))
        if variant:  # a different model under the same name: another table mixed in
            logits += variant * np.random.default_rng(seed + 1).normal(0.0, scale, size=logits.shape)
        logits[:, EOS] += eos_shift
        self.logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    def sample(self, prev: int, max_tokens: int, temperature: float, top_p: float, seed) -> tuple[list[int], bool]:
        """Token ids (without end-of-text) and whether end-of-text was drawn."""
        rng = np.random.default_rng(seed)
        out: list[int] = []
        for _ in range(max_tokens):
            lp = self.logprobs[prev]
            if temperature <= 0:
                nxt = int(np.argmax(lp))
            else:
                p = np.exp((lp - lp.max()) / temperature)
                p /= p.sum()
                order = np.argsort(-p)
                keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
                q = np.zeros_like(p)
                q[keep] = p[keep]
                nxt = int(rng.choice(len(p), p=q / q.sum()))
            if nxt == EOS:
                return out, True
            out.append(nxt)
            prev = nxt
        return out, False


class Fake:
    def __init__(self, args):
        self.args = args
        self.model = ToyModel(variant=args.variant)
        self.lock = threading.Lock()
        self.kv_in_use = 0
        self.kv_recent: list[tuple[float, int]] = []  # (time, tokens in use) over the last KV_WINDOW_S
        self.requests = 0
        # a speculating fake also reports engine steps, and one eager step (its prefill) per request
        self.counters = {"draft_tokens": 0, "accepted_tokens": 0, "drafts": 0, "engine_steps": 0, "engine_eager_steps": 0}
        self.hog = bytearray(os.urandom(1)) * (args.hog_mib * 1024 * 1024) if args.mode == "hog" else None
        if args.gpu_mib:  # hold GPU memory, for the judge's NVML measurement
            import torch

            self.gpu = torch.ones(args.gpu_mib * 1024 * 1024 // 4, device="cuda")

    def logprobs_of(self, tokens: list[str], offsets: list[int], first_prev: int | None, top: int) -> dict:
        lps, tops = [], []
        prev = first_prev
        for i, tok in enumerate(tokens):
            tid = EOS if tok == "" else word_id(tok)
            if prev is None:
                lps.append(None)
                tops.append(None)
            else:
                row = self.model.logprobs[prev]
                noise = 0.0
                if self.args.mode == "perturb":
                    noise = ((zlib.crc32(f"{i}{tok}".encode()) % 1000) / 1000 - 0.5) * 0.04
                lps.append(float(row[tid]) + noise)
                best = np.argsort(-row)[:top]
                tops.append({(" " + WORDS[b] if b != EOS else ""): float(row[b]) + noise for b in best})
            prev = tid
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def complete(self, body: dict) -> dict:
        prompt = body.get("prompt", "")
        prompt = prompt[0] if isinstance(prompt, list) else prompt
        max_tokens = int(body.get("max_tokens", 16))
        if self.args.mode == "short":
            max_tokens = max(1, max_tokens // 2) if max_tokens else 0
        temperature = float(body.get("temperature", 1.0))
        temperature *= TEMPERATURE_SCALE.get(self.args.mode, 1.0)
        prompt_tokens = [m.group() for m in TOKEN.finditer(prompt)]
        prompt_offsets = [m.start() for m in TOKEN.finditer(prompt)]
        prev = word_id(prompt_tokens[-1]) if prompt_tokens else 0
        reserve = len(prompt_tokens) + max_tokens
        self.use_kv(reserve)
        try:
            ids, stopped = self.model.sample(prev, max_tokens, temperature, float(body.get("top_p", 1.0)),
                                             body.get("seed"))
            n_out = len(ids) + stopped
            time.sleep(n_out * self.args.token_ms / 1000 / self.args.speedup)
        finally:
            self.use_kv(-reserve)
        self.count(n_out)
        text = "".join(" " + WORDS[i] for i in ids)
        claimed = 2 * n_out if self.args.mode == "inflate" else n_out
        choice = {"index": 0, "text": text, "finish_reason": "stop" if stopped else "length", "logprobs": None}
        if body.get("logprobs") is not None and not self.args.no_logprobs:
            gen_tokens = [" " + WORDS[i] for i in ids]
            gen_offsets = list(np.cumsum([0] + [len(t) for t in gen_tokens])[:-1] + len(prompt))
            if body.get("echo"):
                choice["text"] = prompt + text
                choice["logprobs"] = self.logprobs_of(prompt_tokens + gen_tokens, prompt_offsets + gen_offsets,
                                                      None, int(body["logprobs"]) or 1)
            else:
                choice["logprobs"] = self.logprobs_of(gen_tokens, gen_offsets, prev, int(body["logprobs"]) or 1)
            choice["logprobs"]["text_offset"] = [int(o) for o in choice["logprobs"]["text_offset"]]
        return {"id": f"cmpl-{self.requests}", "object": "text_completion", "model": self.args.served_model_name,
                "choices": [choice], "usage": {"prompt_tokens": len(prompt_tokens), "completion_tokens": claimed,
                                               "total_tokens": len(prompt_tokens) + claimed}}

    def refusal(self, body: dict) -> tuple[int, dict] | None:
        """(status, body) for a request this engine refuses: another model's name, or (as transformers serve)
        max_tokens=0."""
        model = body.get("model")
        if model is not None and model != self.args.served_model_name:
            return 404, {"error": {"message": f"the model {model!r} does not exist", "code": 404}}
        if self.args.no_logprobs and body.get("max_tokens") == 0:
            return 400, {"detail": "`max_new_tokens` must be greater than 0, but is 0."}
        return None

    def use_kv(self, tokens: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.kv_in_use += tokens
            self.kv_recent = [(t, n) for t, n in self.kv_recent if now - t < KV_WINDOW_S] + [(now, self.kv_in_use)]

    def kv_usage(self) -> float:
        """The most KV in use over the last KV_WINDOW_S: short fake requests would slip between scrapes."""
        now = time.monotonic()
        with self.lock:
            peak = max([n for t, n in self.kv_recent if now - t < KV_WINDOW_S] + [self.kv_in_use])
        return min(1.0, peak / self.args.kv_tokens)

    def count(self, n_out: int) -> None:
        if not self.args.speculate or n_out == 0:
            return
        steps = math.ceil(n_out / self.args.accept_len)
        with self.lock:
            self.counters["drafts"] += steps
            self.counters["accepted_tokens"] += n_out - steps
            self.counters["draft_tokens"] += 4 * steps
            self.counters["engine_steps"] += steps
            self.counters["engine_eager_steps"] += 1

    def metrics(self) -> str:
        lines = [f"fake_kv_cache_usage_perc {self.kv_usage()}"]
        if self.args.speculate:
            lines += [f"fake_{name}_total {value}" for name, value in self.counters.items()]
            lines += [f"fake_{name}_created 1.7e9" for name in self.counters]
        return "\n".join(lines) + "\n"


def handler(fake: Fake, started: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args):
            pass

        def reply(self, status: int, payload, content_type="application/json"):
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                ready = time.monotonic() - started >= fake.args.startup_s
                self.reply(200 if ready else 503, {"status": "ok" if ready else "loading"})
            elif self.path == "/metrics" and not fake.args.no_metrics:
                self.reply(200, fake.metrics(), "text/plain")
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": fake.args.served_model_name, "object": "model"}]})
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/completions":
                return self.reply(404, {"error": "not found"})
            with fake.lock:
                fake.requests += 1
                number = fake.requests
            if fake.args.crash_after and number > fake.args.crash_after:
                print(f"fake engine: crashing on request {number}", flush=True)
                os._exit(4)
            if fake.args.mode == "fail":
                return self.reply(500, {"error": {"message": "fake engine: internal error"}})
            if fake.args.mode == "hang":
                time.sleep(3600)
            refusal = fake.refusal(body)
            if refusal is not None:
                return self.reply(*refusal)
            self.reply(200, fake.complete(body))

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the judge may open hundreds of connections at once


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--mode", default="normal", choices=("normal", "hot", "cold", "short", "perturb", "hog",
                                                              "inflate", "crash", "fail", "hang"))
    parser.add_argument("--token-ms", type=float, default=1.0, help="milliseconds per generated token")
    parser.add_argument("--speedup", type=float, default=1.0, help="divide the time per token by this")
    parser.add_argument("--speculate", action="store_true", help="expose draft/accept counters in /metrics")
    parser.add_argument("--accept-len", type=float, default=2.5, help="tokens per verify step (with --speculate)")
    parser.add_argument("--kv-tokens", type=int, default=4096, help="KV capacity behind the usage gauge")
    parser.add_argument("--hog-mib", type=int, default=256)
    parser.add_argument("--gpu-mib", type=int, default=0, help="hold this much GPU memory (needs torch + CUDA)")
    parser.add_argument("--startup-s", type=float, default=0.0, help="answer /health 503 this long")
    parser.add_argument("--crash-after", type=int, default=0, help="exit(4) on the request after this many")
    parser.add_argument("--no-metrics", action="store_true")
    parser.add_argument("--variant", type=float, default=0.0,
                        help="serve a different model under the same name: this weight of a second table mixed in")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="ignore echo and logprobs, refuse max_tokens=0: as transformers serve does")
    parser.add_argument("--served-model-name", default="fake-toy", help="the one model name it answers to")
    args = parser.parse_args(argv)
    if args.mode == "crash":
        print("fake engine: failing to load the model (mode crash)", file=sys.stderr, flush=True)
        return 3
    fake = Fake(args)
    server = Server((args.host, args.port), handler(fake, time.monotonic()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
