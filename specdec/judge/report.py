"""report.html: the record for a person — score, workloads, gate table, speculation table, plots, the JSON."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from specdec.judge.client import STEP_COUNTERS
from specdec.judge.summary import headline, score_line, speed_lines

STYLE = """
body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;color:#222;padding:0 1em}
h1{font-size:1.3em;margin-bottom:.2em} .score{font-size:2.6em;font-weight:700;margin:.2em 0}
.sub{color:#666} .fail{color:#b00020;font-weight:600} .pass{color:#1b7f3b;font-weight:600}
.inconclusive{color:#9a6700;font-weight:600}
.top{background:#fff8e1;border-left:4px solid #9a6700;padding:.6em 1em;margin:1em 0;white-space:pre-wrap}
.reason{background:#fdecea;border-left:4px solid #b00020;padding:.6em 1em;margin:1em 0}
table{border-collapse:collapse;margin:.6em 0 1.4em} td,th{border-bottom:1px solid #ddd;padding:.3em .8em;
text-align:left} th{background:#f4f4f4} pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:.8em}
img{max-width:100%}
"""


def esc(value) -> str:
    return html.escape(str(value))


def num(value, fmt: str = ".4f") -> str:
    return "–" if value is None else format(value, fmt)


def table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def plots(record: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = record.get("workloads") or {}
    fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(3.2 * (len(workloads) + 1), 3.4), squeeze=False)
    for ax, (name, row) in zip(axes[0], workloads.items()):  # one panel a workload: their speeds differ a lot
        for role, color, shift in (("stock", "#9e9e9e", -0.2), ("candidate", "#1f77b4", 0.2)):
            speeds = row.get(f"{role}_tps") or []
            ax.bar([i + 1 + shift for i in range(len(speeds))], speeds, width=0.4, color=color, label=role)
        ax.set_xticks(range(1, max(len(row.get("stock_tps") or []), 1) + 1))
        ax.set_xlabel("pass")
        ax.set_title(f"{name}: output tokens / s")
    axes[0][0].legend(loc="lower left", fontsize="small")
    accept_ax = axes[0][-1]
    acceptance = record.get("acceptance") or {}
    shown = {w: v for w, v in acceptance.items() if v is not None}
    if shown:
        accept_ax.bar(list(shown), list(shown.values()), color="#2ca02c")
        accept_ax.set_ylabel("tokens per verify step")
    else:
        accept_ax.text(0.5, 0.5, "the candidate exposes no\nspeculation counters", ha="center", va="center")
        accept_ax.set_xticks([])
        accept_ax.set_yticks([])
    accept_ax.set_title("acceptance")
    fig.tight_layout()
    out = png(fig)
    plt.close(fig)
    return out


VERDICT_CLASS = {"pass": "pass", "fail": "fail", "inconclusive": "inconclusive", "not measurable": "inconclusive"}


def verdict_cell(gate: dict) -> str:
    verdict = gate.get("verdict") or ("pass" if gate["ok"] else "fail")
    return f'<span class="{VERDICT_CLASS.get(verdict, "sub")}">{esc("FAIL" if verdict == "fail" else verdict)}</span>'


def render(record: dict) -> str:
    ok = record.get("reason") is None
    verdict = record.get("verdict") or ("pass" if ok else "fail")
    parts = [f'<div class="top {VERDICT_CLASS.get(verdict, "")}">{esc(chr(10).join(headline(record)))}</div>',
             f"<h1>{esc(record.get('title', 'specdec judge'))}</h1>",
             f'<div class="score">SpecScore {num(record.get("specscore"), ".3f")}</div>',
             '<div class="sub">geometric mean of the three speedups (each the median of its passes); '
             f'score {num(record.get("score"), ".3f")}: <span class="{"pass" if ok else "fail"}">'
             f'{"awarded: no gate refused it" if ok else "not awarded"}</span></div>',
             f'<p class="sub">{esc(score_line(record))}</p>',
             f'<p class="sub">scorer: {esc(record.get("scorer") or "the stock engine")}</p>']
    if not ok:
        parts.append(f'<div class="reason"><b>reason:</b> {esc(record["reason"])}</div>')
    ratios = record.get("ratios") or {}
    workloads = record.get("workloads") or {}
    lines = []
    for name, row in workloads.items():
        ratio = ratios.get(name) or {}
        passes = ", ".join(f"{p:.3f}" for p in ratio.get("passes", []))
        kv = row.get("kv_use") or {}
        kv_text = f"; KV use stock {num(kv.get('stock'), '.0%')}, candidate {num(kv.get('candidate'), '.0%')}" \
            if name == "busy" else ""
        lines.append(f"<li><b>{esc(name)}</b> {num(ratio.get('ratio'), '.3f')}× (passes {esc(passes or '–')}; "
                     f"concurrency {esc(row.get('concurrency'))}{esc(kv_text)})</li>")
    parts.append("<h2>Workloads</h2><ul>" + "".join(lines) + "</ul>")
    parts.append("<pre>" + esc("\n".join(speed_lines(record))) + "</pre>")
    gate_rows = [[esc(g["check"]), esc(g["measured"]), esc(g["limit"]), verdict_cell(g), esc(g.get("power") or "")]
                 for g in record.get("gates") or []]
    parts.append("<h2>Lossless gate</h2>" + (table(["check", "measured", "limit", "verdict", "power"], gate_rows)
                                             if gate_rows else "<p>not reached (see reason)</p>"))
    spec_rows = [[esc(w), num((record.get("acceptance") or {}).get(w), ".2f"),
                  num((workloads[w] or {}).get("acceptance_rate"), ".3f"),
                  num((ratios.get(w) or {}).get("ratio"), ".3f") + "×"] for w in workloads]
    parts.append("<h2>Speculation</h2>" + table(["workload", "tokens per verify step", "acceptance rate",
                                                 "speedup"], spec_rows))
    steps_rows = step_rows(workloads)
    if steps_rows:
        parts.append("<h2>Where the time went</h2><p class='sub'>each engine's steps over a workload's timed passes "
                     "(as it reports them), and of those the eager ones: steps with a forward outside its CUDA graphs "
                     "(prefill and mixed steps)</p>" + table(["workload", "engine", "steps", "seconds",
                                                              "eager steps", "eager seconds"], steps_rows))
    parts.append("<h2>Plots</h2>" + plots(record))
    for note in record.get("notes") or []:
        parts.append(f"<p class='sub'>note: {esc(note)}</p>")
    parts.append("<h2>Record</h2><pre>" + esc(json.dumps(record, indent=1)) + "</pre>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(record.get('title', 'judge'))}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")


def step_rows(workloads: dict) -> list[list[str]]:
    """A row per workload and engine that reported its steps (record["workloads"][w]["engine_steps"])."""
    rows = []
    for name, row in workloads.items():
        counters = row.get("engine_steps") or {}
        for role in ("stock", "candidate"):
            values = {key: (counters.get(key) or {}).get(role) for key in STEP_COUNTERS}
            if any(v is not None for v in values.values()):
                rows.append([esc(name), esc(role), num(values["engine_steps"], ".0f"),
                             num(values["step_seconds"], ".2f"), num(values["eager_steps"], ".0f"),
                             num(values["eager_step_seconds"], ".2f")])
    return rows


def write_report(record: dict, path: Path) -> None:
    Path(path).write_text(render(record))
