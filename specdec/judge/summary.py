"""A record in words: the lines that the console and report.html both lead with.

The top says the record's verdict and what its gates could not tell; then one line that tells SpecScore and
score apart; then the paired rounds and their spread, with a warning where the spread is wider than the
effect (and "cannot tell" instead of a speedup).
"""

from __future__ import annotations

VERDICT_TEXT = {
    "pass": "every gate passed",
    "fail": "REFUSED: a gate failed",
    "inconclusive": "INCONCLUSIVE: no gate failed, but some cannot tell at this size",
    "not measurable": "NOT MEASURABLE: the engines give nothing to check some gates with",
}


def fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def headline(record: dict) -> list[str]:
    """The record's first lines: its verdict, each inconclusive or unmeasurable gate, what --quick misses."""
    verdict = record.get("verdict") or ("pass" if record.get("reason") is None else "fail")
    reason = record.get("reason") or ""
    if verdict == "fail" and not reason.startswith("gate"):  # the run stopped (an engine), no gate was checked
        return [f"verdict: STOPPED before any gate was checked: {reason}"]
    lines = [f"verdict: {VERDICT_TEXT.get(verdict, verdict)}"]
    for row in record.get("inconclusive") or []:
        lines.append(f"  inconclusive: {row['check']}: {row['why']}; power {row['power']}")
    for row in record.get("not_measurable") or []:
        lines.append(f"  not measurable: {row['check']}: {row['why']}")
    if record.get("quick"):
        lines.append(record["quick"])
    return lines


def score_line(record: dict) -> str:
    """SpecScore (speed alone) and score (what is awarded) in one line, saying how they differ."""
    specscore, score = fmt(record.get("specscore"), ".3f"), fmt(record.get("score"), ".3f")
    speed = f"SpecScore {specscore} is speed alone (geometric mean of the workloads' median speedups)"
    if record.get("reason") is None:
        return f"{speed}; score {score} is what is awarded: SpecScore, since no gate refused it (0 if one does)"
    return f"{speed}; score {score}: withheld (see the verdict and the reason)"


def speed_lines(record: dict) -> list[str]:
    """Per workload its pass ratios and spread; the paired rounds; a warning and "cannot tell" where due."""
    speed = record.get("speed") or {}
    spreads = speed.get("workloads") or {}
    acceptance = record.get("acceptance") or {}
    lines = []
    for name, row in (record.get("ratios") or {}).items():
        spread = spreads.get(name) or {}
        flag = "  (spread wider than the effect: cannot tell)" if spread.get("spread_wider_than_effect") else ""
        lines.append(f"  {name:<5} {row['ratio']:.3f}x  passes {', '.join(f'{p:.3f}' for p in row['passes'])}"
                     f"  spread {fmt(spread.get('spread'), '.3f')}  acceptance {fmt(acceptance.get(name), '.2f')} "
                     f"tokens/step{flag}")
    rounds = speed.get("rounds") or []
    if not rounds:
        return lines
    lines.append(f"paired rounds (stock and candidate back to back): {', '.join(f'{r:.3f}' for r in rounds)}; "
                 f"spread {speed['spread']:.3f} against an effect of {speed['effect']:+.3f}")
    if speed.get("spread_wider_than_effect"):
        lines.append(f"WARNING: the rounds' spread ({speed['spread']:.3f}) is wider than the effect "
                     f"({speed['effect']:+.3f}): the machine's noise is larger than the speedup")
    lines.append(speed_verdict(speed))
    return lines


def speed_verdict(speed: dict) -> str:
    if speed.get("verdict") == "faster":
        return f"speed: faster (every paired round above 1: {speed['low']:.3f}–{speed['high']:.3f})"
    if speed.get("verdict") == "slower":
        return f"speed: slower (every paired round below 1: {speed['low']:.3f}–{speed['high']:.3f})"
    return (f"speed: cannot tell whether the candidate is faster (rounds {fmt(speed.get('low'), '.3f')}–"
            f"{fmt(speed.get('high'), '.3f')}); more passes or a quieter machine would resolve it")


def print_summary(console, record: dict, lead: list[str] = ()) -> None:
    """The console's account of a record: headline first, then score, speed, the gate table, the reason."""
    from rich.markup import escape
    from rich.table import Table

    for line in [*lead, *headline(record)]:
        console.print(escape(line), highlight=False)
    console.print(f"\n[bold]{escape(record['title'])}[/]")
    console.print(escape(score_line(record)), highlight=False)
    for line in speed_lines(record):
        console.print(escape(line), highlight=False)
    if record.get("gates"):
        table = Table("check", "measured", "limit", "verdict", "power")
        for gate in record["gates"]:
            verdict = gate.get("verdict") or ("pass" if gate["ok"] else "fail")
            shown = "[red]FAIL[/]" if verdict == "fail" else f"[yellow]{verdict}[/]" if verdict in (
                "inconclusive", "not measurable") else verdict
            table.add_row(gate["check"], gate["measured"], gate["limit"], shown, gate.get("power") or "")
        console.print(table)
    console.print(f"scorer: {escape(str(record.get('scorer')))}", highlight=False)
    if record.get("reason"):
        console.print(f"[red]reason:[/] {escape(record['reason'])}", highlight=False)
