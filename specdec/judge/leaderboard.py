"""`specdec leaderboard RECORDS... --out DIR`: judge records ranked, as one HTML page and a markdown table.

Ranking: records whose every gate passed, by score; then inconclusive ones (no gate failed, some could not
tell), by SpecScore; then those whose log-prob gates could not be measured; then failed ones.  Each row says
its verdict and, for all but passing ones, why.

Records written before gates had verdicts are re-judged from the intervals they store (the likelihood and
first-choice gaps with their standard errors, the reply-length intervals) against their own limits, so an
old "pass" whose interval straddled its bound shows as inconclusive.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import subprocess
from pathlib import Path

from specdec.judge import stats
from specdec.judge.gates import FAIL, INCONCLUSIVE, NOT_MEASURABLE, PASS

RANK_ORDER = {PASS: 0, INCONCLUSIVE: 1, NOT_MEASURABLE: 2, FAIL: 3}
LOADS = ("solo", "team", "busy")
GATE_SHORT = {"memory": "memory", "fidelity": "fixed texts", "likelihood": "likelihood", "argmax": "first choices",
              "greedy_agreement": "greedy", "lengths": "lengths"}


def gate_verdicts(record: dict) -> dict[str, str]:
    """{record key: verdict} for each gate; re-judged from stored intervals where the record predates verdicts."""
    verdicts = {}
    limits = record.get("limits") or {}
    for gate in record.get("gates") or []:
        verdict = gate.get("verdict") or restored_verdict(record, gate, limits)
        verdicts[gate["key"]] = verdict
    return verdicts


def restored_verdict(record: dict, gate: dict, limits: dict) -> str:
    if not gate["ok"]:
        return FAIL
    key = gate["key"]
    if key in ("likelihood", "argmax") and record.get(key):
        bound = limits.get("likelihood_bound" if key == "likelihood" else "argmax_bound", 0.05)
        gap, half = record[key]["gap"], stats.Z95 * record[key]["se"]
        return stats.band_verdict(gap - half, gap + half, -bound, bound)
    if key == "lengths" and record.get("lengths"):
        margin = limits.get("length_margin", 0.05)
        each = [stats.band_verdict(row["low"], row["high"], 1 - margin, 1 + margin) for row in record["lengths"].values()]
        return FAIL if FAIL in each else INCONCLUSIVE if INCONCLUSIVE in each else PASS
    if key == "greedy_agreement" and limits.get("greedy_agreement_floor") is None:
        return "reported"
    return PASS


def record_verdict(record: dict, verdicts: dict[str, str]) -> str:
    if record.get("verdict"):
        return record["verdict"]
    if record.get("reason") is not None:
        return FAIL
    return INCONCLUSIVE if INCONCLUSIVE in verdicts.values() else PASS


def why(record: dict, verdict: str, verdicts: dict[str, str]) -> str:
    if verdict == PASS:
        return ""
    if record.get("reason"):
        return record["reason"]
    rows = record.get("inconclusive")
    if rows:
        return "; ".join(f"{row['check']}: {row['power']}" for row in rows)
    return "inconclusive (re-judged from the stored intervals): " + ", ".join(
        GATE_SHORT.get(k, k) for k, v in verdicts.items() if v == INCONCLUSIVE)


def device_of(record: dict) -> str:
    """The device a record ran on: as it says, else the GPUs its run saw, else the engines' --device."""
    if record.get("device"):
        return record["device"]
    gpus = (record.get("run") or {}).get("gpus") or []
    if gpus:
        return ", ".join(sorted(set(gpus)))
    engines = record.get("engines") or {}
    specs = " ".join(str(e.get("spec", "")) for e in engines.values())
    match = re.search(r"--device[ =](\S+)", specs)
    if match:
        return match.group(1)
    if any("NVML" in str(e.get("memory_method")) for e in engines.values()):
        return "GPU"
    return "unknown"


def model_of(record: dict) -> str:
    models = record.get("models") or {}
    if models.get("stock"):
        stock, candidate = models["stock"], models.get("candidate")
        return stock if candidate in (None, stock) else f"{stock} / {candidate}"
    title = record.get("title") or ""
    head = re.split(r" · |, ", title)[0]
    return re.sub(r" as \S+ twin$", "", head) or "unknown"


def twin_of(record: dict) -> str:
    specs = " ".join(str(e.get("spec", "")) for e in (record.get("engines") or {}).values())
    match = re.search(r"--twin[ =](\S+)", specs) or re.search(r" as (\S+) twin", record.get("title") or "")
    return match.group(1) if match else "–"


def commit_of(record: dict, path: Path) -> str:
    """The record's own commit field, else its run's (the judge's provenance), else the commit that added its file
    (marked "recorded in")."""
    commit = record.get("commit") or (record.get("run") or {}).get("commit")
    if commit and commit != "unknown":
        return commit
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "–"
    return f"recorded in {out.stdout.strip()}" if out.returncode == 0 and out.stdout.strip() else "–"


def spread_of(record: dict) -> float | None:
    """The paired rounds' spread (highest round's score - lowest), where the record has passes."""
    if (record.get("speed") or {}).get("spread") is not None:
        return record["speed"]["spread"]
    ratios = record.get("ratios") or {}
    if not ratios or any(len(row.get("passes") or []) < 2 for row in ratios.values()):
        return None
    return stats.paired_rounds(ratios)["spread"]


def entry(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        from specdec.errors import ConfigError

        raise ConfigError(f"cannot read the judge record {path}: {exc}") from None
    verdicts = gate_verdicts(record)
    verdict = record_verdict(record, verdicts)
    ratios = record.get("ratios") or {}
    return {"path": str(path), "name": Path(path).stem, "title": record.get("title") or Path(path).stem,
            "verdict": verdict, "why": why(record, verdict, verdicts), "score": record.get("score") or 0.0,
            "specscore": record.get("specscore"), "loads": {w: (ratios.get(w) or {}).get("ratio") for w in LOADS},
            "acceptance": {w: (record.get("acceptance") or {}).get(w) for w in LOADS}, "gates": verdicts,
            "device": device_of(record), "model": model_of(record), "twin": twin_of(record),
            "commit": commit_of(record, Path(path)), "spread": spread_of(record)}


def ranked(paths: list[Path]) -> list[dict]:
    """Entries best first: by verdict group, then score (SpecScore for records whose score was withheld)."""
    entries = [entry(p) for p in paths]
    return sorted(entries, key=lambda e: (RANK_ORDER.get(e["verdict"], 3), -(e["score"] or e["specscore"] or 0.0)))


def fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


HEADER = ["rank", "record", "score", "verdict", "solo", "team", "busy", "tokens / verify step", "spread",
          "gates", "device", "model", "twin", "commit", "why not first"]


def cells(rank: int, e: dict) -> list[str]:
    marked = {PASS: "pass", INCONCLUSIVE: "INCONCLUSIVE", NOT_MEASURABLE: "NOT MEASURABLE", FAIL: "FAILED"}
    score = fmt(e["score"], ".3f") + ("" if e["verdict"] == PASS else f" (SpecScore {fmt(e['specscore'], '.3f')})")
    return [str(rank), f"{e['name']}: {e['title']}", score, marked.get(e["verdict"], e["verdict"]),
            *(fmt(e["loads"][w], ".3f") + ("×" if e["loads"][w] is not None else "") for w in LOADS),
            " / ".join(fmt(e["acceptance"][w], ".2f") for w in LOADS), fmt(e["spread"], ".3f"),
            ", ".join(f"{GATE_SHORT.get(k, k)} {v}" for k, v in e["gates"].items()) or "–",
            e["device"], e["model"], e["twin"], e["commit"], e["why"] or "–"]


def markdown(entries: list[dict]) -> str:
    def row(values):
        return "| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in values) + " |"

    lines = ["# Leaderboard", "", "Ranked by score; a record with an inconclusive gate ranks below every passing one, "
             "a failed one below both. Loads are speedups (median of passes); tokens per verify step are "
             "solo / team / busy; spread is the paired rounds' highest score minus the lowest.", "",
             row(HEADER), row(["---"] * len(HEADER))]
    lines += [row(cells(i + 1, e)) for i, e in enumerate(entries)]
    return "\n".join(lines) + "\n"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;font-size:.9em}
td,th{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}th{background:#f4f4f4}
tr.fail td{color:#b00020}tr.inconclusive td,tr.unmeasured td{color:#9a6700}.sub{color:#666}"""
ROW_CLASS = {PASS: "pass", INCONCLUSIVE: "inconclusive", NOT_MEASURABLE: "unmeasured", FAIL: "fail"}


def page(entries: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = "".join(f'<tr class="{ROW_CLASS.get(e["verdict"], "fail")}">'
                   + "".join(f"<td>{html.escape(c)}</td>" for c in cells(i + 1, e)) + "</tr>"
                   for i, e in enumerate(entries))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>specdec leaderboard</title>"
            f"<style>{STYLE}</style></head><body><h1>Leaderboard</h1><p class='sub'>Ranked by score; inconclusive "
            "records (no gate failed, some could not tell) below every passing one, failed ones last.</p>"
            f"<table><tr>{head}</tr>{body}</table></body></html>\n")


def write_leaderboard(paths: list[Path], out: Path) -> list[dict]:
    entries = ranked(paths)
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaderboard.html").write_text(page(entries))
    (out / "leaderboard.md").write_text(markdown(entries))
    return entries


def cmd_leaderboard(args: argparse.Namespace) -> int:
    entries = write_leaderboard(args.records, args.out)
    for i, e in enumerate(entries):
        print(f"{i + 1:>2}. {fmt(e['score'], '.3f')}  {e['verdict']:<14} {e['name']}" + (f"  ({e['why']})" if e["why"]
                                                                                       else ""))
    print(f"leaderboard: {args.out / 'leaderboard.html'}\nmarkdown:    {args.out / 'leaderboard.md'}")
    return 0


def add_leaderboard_parser(sub) -> None:
    board = sub.add_parser("leaderboard", help="rank judge records (record.json files) by score: HTML and markdown",
                           description="Rank judge records: passing ones by score, then inconclusive, then failed; "
                                       "write DIR/leaderboard.html (self-contained) and DIR/leaderboard.md.")
    board.add_argument("records", type=Path, nargs="+", help="record.json files written by specdec judge / demo")
    board.add_argument("--out", type=Path, required=True, help="directory for leaderboard.html and leaderboard.md")
    board.set_defaults(func=cmd_leaderboard)
