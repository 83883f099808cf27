"""One judge run: the two engines in sessions, the workloads' timed passes, the gate's data, the record.

Pass i of a workload is measured on both engines close together in time, alternating which goes first
(stock 1, candidate 1, candidate 2, stock 2, stock 3, candidate 3, ...), so consecutive passes of one engine
share a session: with `alternate` layout (the default when both are commands and a GPU is visible) only one
engine is up at a time and each session starts it; with `together` both stay up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import shlex
import time
from pathlib import Path

import httpx

from specdec.judge import gates, stats
from specdec.judge.client import (ACCEPTED, DRAFTED, STEP_COUNTERS, VERIFY_STEPS, EngineApi, NoLogprobs, RequestError,
                                  fetch_metrics, fetch_metrics_sync, find_metric, http_get, kv_use, run_batch)
from specdec.judge.config import JudgeConfig, load_prompts
from specdec.judge.engines import Engine, JudgeFailure, gpu_visible, nvml
from specdec.judge.progress import Reporter
from specdec.models.provenance import source_commit

ROLES = ("stock", "candidate")
SPEC_KEYS = ("ratios", "specscore", "greedy_agreement", "likelihood", "argmax", "fidelity", "lengths", "memory",
             "acceptance", "limits", "reason", "score")
SEED_STRIDE = 100_000
TOKEN_COUNT_TOLERANCE = 1.1  # candidate's claimed/retokenized token count may exceed stock's by 10 % at most


def session_plan(passes: int) -> list[tuple[str, list[int]]]:
    """[(role, passes)] in order; the last stock session comes after the candidate's first (it scores both)."""
    order = []
    for i in range(1, passes + 1):
        order += [("stock", i), ("candidate", i)] if i % 2 else [("candidate", i), ("stock", i)]
    sessions: list[tuple[str, list[int]]] = []
    for role, i in order:
        if sessions and sessions[-1][0] == role:
            sessions[-1][1].append(i)
        else:
            sessions.append((role, [i]))
    if not any(role == "stock" for role, _ in sessions[2:]):
        sessions.append(("stock", []))
    return sessions


class Judge:
    def __init__(self, config: JudgeConfig, reporter: Reporter | None = None):
        self.config = config
        self.reporter = reporter or Reporter(config.quiet)
        config.out.mkdir(parents=True, exist_ok=True)
        self.prompts = load_prompts(config.prompts, config.num_prompts)
        self.gate_prompts = load_prompts(config.prompts, config.gate_prompts)
        self.fixed_texts = load_prompts(config.fixed_texts, config.gate_prompts) if config.fixed_texts \
            else self.gate_prompts
        self.engines = {role: Engine(role, spec, config.out, config.startup_timeout_s)
                        for role, spec in (("stock", config.stock), ("candidate", config.candidate))}
        self.apis: dict[str, EngineApi] = {}
        self.layout = config.layout
        self.busy_concurrency = config.busy_concurrency
        self.notes: list[str] = []
        workloads = config.workloads
        self.speeds = {r: {w: {} for w in workloads} for r in ROLES}  # pass number -> tokens/s
        self.lengths = {r: {w: {} for w in workloads} for r in ROLES}  # pass number -> reply lengths
        self.counters = {r: {w: {"accepted": 0.0, "drafted": 0.0, "steps": 0.0, "tokens": 0, "seen": False,
                                 **dict.fromkeys(STEP_COUNTERS)} for w in workloads} for r in ROLES}
        self.kv_peak: dict[str, dict[str, float | None]] = {r: {w: None for w in workloads} for r in ROLES}
        self.sampled = {r: {} for r in ROLES}  # pass number -> (prompts, replies) of the first workload
        self.greedy: dict[str, list] = {}
        self.fixed: dict[str, list] = {}
        self.scored: dict[str, list[gates.ScoredReply]] = {}
        self.token_counts: dict[str, float] = {}
        self.has_top = True
        self.no_logprobs: set[str] = set()  # engines that answered a scoring request without log-probs
        self.sampled_scored = False
        self.scorer = None
        if config.scorer is not None:
            from specdec.judge.scoring import LocalScorer

            self.reporter.say(f"scorer: loading {config.scorer}")
            self.scorer = LocalScorer(config.scorer, config.scorer_device)

    # ---- the run ----

    def run(self) -> dict:
        """Judge, write record.json and report.html into config.out, return the record."""
        from specdec.judge.report import write_report

        started = time.time()
        reason = None
        try:
            self.execute()
        except JudgeFailure as failure:
            reason = failure.reason
        finally:
            for engine in self.engines.values():
                engine.stop()
        record = self.record(reason, time.time() - started)
        (self.config.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
        write_report(record, self.config.out / "report.html")
        return record

    def execute(self) -> None:
        if self.layout == "auto":
            both_launched = all(e.launched for e in self.engines.values())
            self.layout = "alternate" if both_launched and gpu_visible() else "together"
        if self.layout == "together":
            for engine in self.engines.values():  # load both models at once
                engine.launch()
            for role in ROLES:  # and time nothing until both are up
                self.bring_up(role)
        for role, passes in session_plan(self.config.passes):
            self.session(role, passes)

    def session(self, role: str, passes: list[int]) -> None:
        engine = self.engines[role]
        if self.layout == "alternate":
            for other in self.engines.values():
                if other is not engine and other.launched:
                    other.stop()
        self.bring_up(role)
        for number in passes:
            for workload in self.config.workloads:
                self.run_pass(role, workload, number)
        if role not in self.greedy:
            self.collect_gate_data(role)
        if role == "stock" and self.sampled["candidate"] and not self.sampled_scored:
            self.score_sampled()

    def bring_up(self, role: str) -> None:
        """Start the engine if it is not up, learn its model name, warm it up."""
        engine = self.engines[role]
        if engine.healthy:
            return
        engine.launch()
        self.reporter.say(f"[bold]{role}[/]: {'starting' if engine.launched else 'using'} {engine.command}")
        engine.ready(note=self.reporter.say)
        if role not in self.apis:
            self.apis[role] = EngineApi(engine.url, self.config.model_for(role) or model_name(engine.url),
                                        self.config.request_timeout_s)
        self.apis[role].base_url = engine.url
        n = min(self.config.concurrency, len(self.prompts))
        bodies = [dict(body, max_tokens=min(8, body["max_tokens"])) for body in self.bodies("team")[:n]]
        self.batch(role, "warm-up", bodies, n)

    # ---- workloads ----

    def concurrency(self, workload: str) -> int:
        return {"solo": 1, "team": self.config.concurrency}.get(workload) or self.busy_concurrency

    def bodies(self, workload: str, number: int = 0, count: int | None = None) -> list[dict]:
        """Pass `number`'s requests (0: warm-up and probes).  Request i of pass p has seed SEED + 100000 p + i:
        the same on both engines, new samples in each pass."""
        c = self.config
        max_tokens = c.busy_max_tokens if workload == "busy" else c.max_tokens
        count = count or max(len(self.prompts), 1 if workload == "solo" else self.concurrency(workload))
        return [{"prompt": self.prompts[i % len(self.prompts)], "max_tokens": max_tokens, "temperature": c.temperature,
                 "top_p": c.top_p, "seed": c.seed + SEED_STRIDE * number + i} for i in range(count)]

    def run_pass(self, role: str, workload: str, number: int) -> None:
        if workload == "busy" and self.busy_concurrency is None:
            self.calibrate_busy()
        label = f"{workload} pass {number}/{self.config.passes}"
        bodies = self.bodies(workload, number)
        before = self.read_counters(role)
        kv: list[float] = []
        replies, seconds = self.batch(role, label, bodies, self.concurrency(workload),
                                      poll=self.kv_poller(kv) if workload == "busy" else None)
        after = self.read_counters(role)
        tokens = sum(r.completion_tokens for r in replies)
        if tokens == 0:
            raise JudgeFailure(f"{role} engine produced no tokens in {label}")
        self.speeds[role][workload][number] = tokens / seconds
        self.lengths[role][workload][number] = [r.completion_tokens for r in replies]
        self.add_counters(role, workload, before, after, tokens)
        if kv:
            self.kv_peak[role][workload] = max(kv + [self.kv_peak[role][workload] or 0.0])
        if workload == self.config.workloads[0]:
            self.sampled[role][number] = ([b["prompt"] for b in bodies], replies)
        self.reporter.say(f"{role:<9} {label:<16} {tokens:>7} tokens in {seconds:7.2f} s = "
                          f"{tokens / seconds:9.1f} tok/s" + (f"  (KV use {max(kv):.0%})" if kv else ""))

    def calibrate_busy(self) -> None:
        """Find a concurrency at which the stock engine reports >= busy_kv_target KV-cache use.

        Use grows about in proportion to the requests in flight: each probe scales the concurrency by
        1.1 / (use seen), at most 8x a probe; after three probes the last estimate stands.
        """
        c = self.config
        concurrency = min(c.concurrency, c.busy_max_concurrency)
        for _ in range(3):
            kv: list[float] = []
            self.batch("stock", f"busy probe at concurrency {concurrency}", self.bodies("busy", 0, concurrency),
                       concurrency, poll=self.kv_poller(kv))
            if not kv:
                concurrency = min(4 * c.concurrency, c.busy_max_concurrency)
                self.notes.append("the stock engine reports no KV-cache use in /metrics: busy ran at "
                                  f"concurrency {concurrency} (4 x team)")
                break
            use = max(kv)
            if use >= c.busy_kv_target or concurrency >= c.busy_max_concurrency:
                break
            concurrency = min(c.busy_max_concurrency, 8 * concurrency, math.ceil(1.1 * concurrency / max(use, 1e-3)))
        self.busy_concurrency = concurrency
        self.reporter.say(f"busy: concurrency {concurrency}")

    @staticmethod
    def kv_poller(sink: list[float]):
        async def poll(client: httpx.AsyncClient):
            use = kv_use(await fetch_metrics(client))
            if use is not None:
                sink.append(use)
        return poll

    def read_counters(self, role: str) -> dict | None:
        values = fetch_metrics_sync(self.engines[role].url)
        if values is None:
            return None
        return {"accepted": find_metric(values, ACCEPTED), "drafted": find_metric(values, DRAFTED),
                "steps": find_metric(values, VERIFY_STEPS),
                **{key: find_metric(values, patterns) for key, patterns in STEP_COUNTERS.items()}}

    def add_counters(self, role, workload, before, after, tokens) -> None:
        total = self.counters[role][workload]
        total["tokens"] += tokens
        if before is None or after is None:
            return
        for key in ("accepted", "drafted", "steps"):
            if before[key] is not None and after[key] is not None:
                total[key] += after[key] - before[key]
                total["seen"] = True
        for key in STEP_COUNTERS:  # None where the engine does not report them
            if before[key] is not None and after[key] is not None:
                total[key] = (total[key] or 0) + after[key] - before[key]

    # ---- the gate's data ----

    def collect_gate_data(self, role: str) -> None:
        c = self.config
        bodies = self.greedy_bodies(self.gate_prompts)
        replies, _ = self.batch(role, "greedy replies", bodies, c.concurrency)
        self.greedy[role] = replies
        if self.scorer is not None:
            self.fixed[role] = self.continue_fixed_texts(role)
            return
        try:
            fixed, _ = self.batch(role, "fixed texts", [{"prompt": t} for t in self.fixed_texts], c.concurrency,
                                  score=True)
        except NoLogprobs:
            self.no_logprobs.add(role)
            self.reporter.say(f"{role}: the engine returns no prompt log-probs: the gates that need them are "
                              "not measurable (give --scorer MODEL_DIR)")
            return
        self.fixed[role] = fixed

    def greedy_bodies(self, prompts: list[str]) -> list[dict]:
        c = self.config
        # the top two log-probs: where a candidate's reply splits from the stock's, how close the stock's choice was
        return [{"prompt": p, "max_tokens": c.max_tokens, "temperature": 0.0, "logprobs": 2, "seed": c.seed + i}
                for i, p in enumerate(prompts)]

    def continue_fixed_texts(self, role: str) -> list[gates.ScoredReply]:
        """With a scorer: the engine's greedy continuation of each fixed text, scored by the scorer."""
        if self.fixed_texts is self.gate_prompts:
            replies = self.greedy[role]
        else:
            replies, _ = self.batch(role, "fixed texts' continuations", self.greedy_bodies(self.fixed_texts),
                                    self.config.concurrency)
        with self.reporter.batch(f"{'scorer':<9} {role} fixed texts", len(replies)) as bar:
            return [self.scored_locally(t, r.text, bar) for t, r in zip(self.fixed_texts, replies)]

    def scored_locally(self, prompt: str, reply: str, bar) -> gates.ScoredReply:
        scored = self.scorer.score(prompt, reply)
        bar.advance(scored.num_tokens)
        return scored

    def score_sampled(self) -> None:
        """The reference scores both engines' sampled replies: the stock engine (prompt + reply, through echo),
        or the local scorer where one is given.

        The replies are those of the first workload's passes that both engines have run by now.
        """
        self.sampled_scored = True
        numbers = sorted(set(self.sampled["stock"]) & set(self.sampled["candidate"]))
        for role in ROLES:
            prompts = [p for n in numbers for p in self.sampled[role][n][0]]
            replies = [r for n in numbers for r in self.sampled[role][n][1]]
            if self.scorer is not None:
                with self.reporter.batch(f"{'scorer':<9} {role} replies", len(replies)) as bar:
                    self.scored[role] = [self.scored_locally(p, r.text, bar) for p, r in zip(prompts, replies)]
            elif "stock" in self.no_logprobs:
                return
            else:
                try:
                    self.scored[role] = self.scored_by_stock(role, prompts, replies)
                except NoLogprobs:
                    self.no_logprobs.add("stock")
                    self.scored.clear()
                    return
            retokenized = sum(s.num_tokens for s in self.scored[role])
            self.token_counts[role] = sum(r.completion_tokens for r in replies) / max(retokenized, 1)

    def scored_by_stock(self, role: str, prompts: list[str], replies: list) -> list[gates.ScoredReply]:
        texts = [{"prompt": p + r.text} for p, r in zip(prompts, replies)]
        scored, _ = self.batch("stock", f"scoring {role} replies", texts, self.config.concurrency, score=True)
        prompt_tokens: dict[str, int] = {}
        if any(s.text_offset is None for s in scored):
            unique = sorted(set(prompts))
            counted, _ = self.batch("stock", "scoring prompts", [{"prompt": p} for p in unique],
                                    self.config.concurrency, score=True)
            prompt_tokens = {p: len(s.tokens) for p, s in zip(unique, counted)}
        self.has_top &= all(s.top_logprobs is not None for s in scored)
        return [gates.score_reply(s, len(p), prompt_tokens.get(p)) for p, s in zip(prompts, scored)]

    def batch(self, role: str, label: str, bodies: list[dict], concurrency: int, poll=None, score: bool = False):
        engine = self.engines[role]
        with self.reporter.batch(f"{role:<9} {label}", len(bodies)) as bar:
            try:
                return asyncio.run(run_batch(self.apis[role], bodies, concurrency,
                                             on_reply=lambda r: bar.advance(r.completion_tokens), poll=poll,
                                             score=score))
            except NoLogprobs:
                raise
            except RequestError as exc:
                engine.check_alive(f"during {label}", grace_s=3.0 if exc.dropped else 0.0)  # a dying one drops first
                raise JudgeFailure(f"{role} engine: a request failed during {label}: {exc}"
                                   f"{self.model_hint(role)}") from None

    def model_hint(self, role: str) -> str:
        """Where an engine's /v1/models does not list the model its requests name: which names it lists."""
        listed = model_names(self.apis[role].base_url)
        model = self.apis[role].model
        if not listed or model in listed:
            return ""
        return (f" (the requests name the model {model!r}, which the engine's /v1/models does not list: it lists "
                f"{', '.join(map(repr, listed))}; give --{role}-model NAME where the engines name one model "
                "differently)")

    # ---- the record ----

    def record(self, reason: str | None, seconds: float) -> dict:
        c = self.config
        record: dict = {key: None for key in SPEC_KEYS}
        record["limits"] = dataclasses.asdict(c.limits)
        checks: list[gates.Check] = []
        if reason is None:
            checks = self.evaluate(record)
            refused = [f"{ch.name}: {ch.why}" for ch in checks if not ch.ok]
            claimed = self.token_counts.get("candidate", 1.0) / max(self.token_counts.get("stock", 1.0), 1e-9)
            if claimed > TOKEN_COUNT_TOLERANCE:
                refused.append(f"token counts: the candidate's usage.completion_tokens claim {claimed:.2f} x what "
                               "its replies hold (by the reference's tokenizer), against stock's own ratio")
            if refused:
                failed = any(ch.verdict == gates.FAIL for ch in checks) or claimed > TOKEN_COUNT_TOLERANCE
                reason = ("gate failed: " if failed else "gate not measurable: ") + "; ".join(refused)
        record["reason"] = reason
        record["score"] = record["specscore"] if reason is None else 0.0
        record.update(self.verdicts(checks, reason))
        record.update(self.extras(checks, seconds, record["ratios"]))
        return rounded(record)

    def verdicts(self, checks: list[gates.Check], reason: str | None) -> dict:
        """The record's top: its verdict, the gates that could not tell, and what --quick cannot check."""
        inconclusive = [{"check": ch.name, "why": ch.why, "power": ch.power} for ch in checks
                        if ch.verdict == gates.INCONCLUSIVE]
        unmeasured = [{"check": ch.name, "why": ch.why} for ch in checks if ch.verdict == gates.NOT_MEASURABLE]
        if reason is not None:
            verdict = gates.NOT_MEASURABLE if reason.startswith("gate not measurable") else gates.FAIL
        else:
            verdict = gates.INCONCLUSIVE if inconclusive else gates.PASS
        quick = None
        if self.config.quick and checks:  # a run that stopped before its gates has no sizes to speak of
            replies = len(self.scored.get("candidate", []))
            names = ", ".join(row["check"] for row in inconclusive)
            quick = (f"--quick: {replies} sampled replies per engine and {len(self.fixed_texts)} fixed texts. "
                     + (f"At this size {names} cannot tell a candidate within its bound from one outside it; "
                        "run without --quick for a verdict on them." if inconclusive else
                        "Every statistical gate resolved its bound even at this size."))
        return {"verdict": verdict, "inconclusive": inconclusive, "not_measurable": unmeasured, "quick": quick}

    def evaluate(self, record: dict) -> list[gates.Check]:
        c, limits = self.config, self.config.limits
        workloads = c.workloads
        ordered = {r: {w: [self.speeds[r][w][i] for i in range(1, c.passes + 1)] for w in workloads} for r in ROLES}
        record["ratios"], record["specscore"] = stats.specscore(
            {w: stats.pass_ratios(ordered["candidate"][w], ordered["stock"][w]) for w in workloads})
        checks = []
        record["memory"], check = gates.memory(self.engines["candidate"].memory.peak_mib(),
                                               self.engines["stock"].memory.peak_mib(), limits,
                                               self.engines["candidate"].launched)
        checks.append(check)
        record["fidelity"], check = self.fidelity()
        checks.append(check)
        if self.scored:
            record["likelihood"], record["argmax"], pair = gates.likelihood_and_argmax(
                self.scored["candidate"], self.scored["stock"], self.scorer is not None or self.has_top, limits)
        else:
            pair = [gates.unmeasurable("sampled replies' likelihood", "likelihood",
                                       f"95 % interval within ±{limits.likelihood_bound:g}"),
                    gates.unmeasurable("share of first choices", "argmax",
                                       f"95 % interval within ±{limits.argmax_bound:g}")]
        checks += pair
        use_tokens = all(r.tokens is not None for role in ROLES for r in self.greedy[role])
        sequences = {role: [r.tokens if use_tokens else list(r.text) for r in self.greedy[role]] for role in ROLES}
        record["greedy_divergences"] = (gates.greedy_divergences(self.greedy["candidate"], self.greedy["stock"])
                                        if use_tokens else None)
        record["greedy_agreement"], check = gates.greedy_agreement(sequences["candidate"], sequences["stock"], limits,
                                                                   record["greedy_divergences"])
        checks.append(check)
        per_request = {r: {w: mean_over_passes(self.lengths[r][w]) for w in workloads} for r in ROLES}
        record["lengths"], check = gates.lengths(per_request["candidate"], per_request["stock"], limits)
        checks.append(check)
        record["acceptance"] = {w: self.acceptance(w) for w in workloads}
        return checks

    def fidelity(self) -> tuple[float | None, gates.Check]:
        limits = self.config.limits
        if self.scorer is not None:
            return gates.fidelity_by_reference(self.fixed["candidate"], self.fixed["stock"], limits)
        if self.no_logprobs:
            engines = " and ".join(sorted(self.no_logprobs))
            return None, gates.unmeasurable("fixed texts' log-probabilities", "fidelity",
                                            f"≤ {limits.fidelity_ceiling:g}",
                                            gates.NO_LOGPROBS.replace("this engine", f"this engine ({engines})"))
        return gates.fidelity(self.fixed["candidate"], self.fixed["stock"], limits)

    def acceptance(self, workload: str) -> float | None:
        """Tokens per verify step of the candidate: 1 + accepted / steps (or tokens / steps)."""
        total = self.counters["candidate"][workload]
        if not total["seen"] or total["steps"] <= 0:
            return None
        if total["accepted"] or total["drafted"]:
            return 1.0 + total["accepted"] / total["steps"]
        return total["tokens"] / total["steps"]

    def extras(self, checks: list[gates.Check], seconds: float, ratios: dict | None) -> dict:
        c = self.config
        workloads = {}
        for w in c.workloads:
            rate = self.counters["candidate"][w]
            workloads[w] = {
                "concurrency": self.concurrency(w),
                "max_tokens": c.busy_max_tokens if w == "busy" else c.max_tokens,
                "requests": len(self.bodies(w)) if self.concurrency(w) else None,
                "stock_tps": [self.speeds["stock"][w][i] for i in sorted(self.speeds["stock"][w])],
                "candidate_tps": [self.speeds["candidate"][w][i] for i in sorted(self.speeds["candidate"][w])],
                "kv_use": {r: self.kv_peak[r][w] for r in ROLES},
                "acceptance_rate": rate["accepted"] / rate["drafted"] if rate["drafted"] > 0 else None,
                # each engine's steps over the workload's timed passes and their seconds, and of those its eager
                # steps (where an engine reports them: this project's do)
                "engine_steps": {key: {r: self.counters[r][w][key] for r in ROLES} for key in STEP_COUNTERS},
            }
        return {
            "title": c.title or self.title(),
            "gates": [ch.row() for ch in checks],
            "speed": speed_summary(ratios),
            "models": {role: self.apis[role].model if role in self.apis else c.model_for(role) for role in ROLES},
            "scorer": self.scorer.describe() if self.scorer is not None else
            ("none: the stock engine gives no prompt log-probs" if "stock" in self.no_logprobs else
             "the stock engine (echo + logprobs)"),
            "workloads": workloads,
            "gate_replies": {"workload": c.workloads[0], "passes": sorted(set(self.sampled["stock"])
                                                                          & set(self.sampled["candidate"])),
                             "per_engine": len(self.scored.get("candidate", []))},
            "token_counts": self.token_counts or None,
            "notes": self.notes,
            "layout": self.layout,
            "engines": {role: e.summary() for role, e in self.engines.items()},
            "settings": c.settings(),
            "duration_s": seconds,
            "run": provenance(),
        }

    def title(self) -> str:
        model = self.apis["stock"].model if "stock" in self.apis else "model"
        return f"{model} · {speculator_name(self.config.candidate)}"


def speed_summary(ratios: dict | None) -> dict | None:
    """Paired rounds and their spread (stats.paired_rounds), and each workload's pass-to-pass spread."""
    if not ratios:
        return None
    summary = stats.paired_rounds(ratios)
    summary["workloads"] = {w: stats.workload_spread(row["passes"], row["ratio"]) for w, row in ratios.items()}
    return summary


def mean_over_passes(by_pass: dict[int, list[int]]) -> list[float]:
    """Per request index (the same prompt in every pass, on both engines), its mean reply length over passes."""
    rows = [by_pass[i] for i in sorted(by_pass)]
    return [sum(col) / len(col) for col in zip(*rows)]


def model_name(url: str) -> str:
    """The first model id the engine lists at /v1/models (or "default")."""
    return (model_names(url) or ["default"])[0]


def model_names(url: str) -> list[str]:
    """The model ids the engine lists at /v1/models ([] where it lists none or answers nothing readable)."""
    try:
        return [str(row["id"]) for row in http_get(f"{url}/v1/models").json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


def speculator_name(spec: str) -> str:
    """'draft (ref-draft, k=4)' from a specdec command line; else the command's program or the URL."""
    if spec.startswith(("http://", "https://")):
        return f"candidate at {spec}"
    argv = shlex.split(spec)
    flags = {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}
    if "--speculator" in flags:
        details = [flags[f] for f in ("--draft-model", "--draft-url") if f in flags]
        details += [f"k={flags['--num-draft-tokens']}"] if "--num-draft-tokens" in flags else []
        return flags["--speculator"] + (f" ({', '.join(details)})" if details else "")
    return Path(argv[0]).name if argv else "candidate"


def rounded(value, digits: int = 6):
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else None  # JSON has no infinity
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def run_judge(config: JudgeConfig) -> dict:
    return Judge(config).run()


def provenance() -> dict:
    """When and where a record was made: the UTC date, specdec's commit (SPECDEC_COMMIT, else git where the
    package is a checkout, else None) and the GPUs NVML sees (none on a CPU machine)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": source_commit(),
            "gpus": nvml().names()}
