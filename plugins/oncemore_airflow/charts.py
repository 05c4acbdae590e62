"""Inline SVG charts for the oncemore page (``pipeline_charts``: a pipeline page's plots): drawn on the server from the ledger's figures, so the
page needs no JavaScript, no CDN and no chart library in the api-server, renders in one response
and shows the same in a screenshot. Every mark carries its figure as a tooltip (``<title>``) and
a ``data-value`` attribute, which the browser tests check against the ledger."""

from __future__ import annotations

from html import escape
from typing import Any, Sequence

WIDTH, HEIGHT, PAD = 720, 180, 36
MAX_BAR = 48  # a few hours of history still look like bars, not a wall


def pipeline_charts(data: dict[str, Any]) -> dict[str, str]:
    """A pipeline page's plots (SVG) from its overview: records per hour of their Kafka timestamp
    (the hour a record belongs to, as a data interval does, whenever a run committed it), the lag
    after each commit, and the records quarantined per hour."""
    hours = data["per_hour"]
    labels = [h["hour"][:13].replace("T", " ") + "h" for h in hours]
    lag = data["lag_after_commit"]
    return {
        "records": bar_chart(labels, [("written", "#2e86c1", [h["written"] for h in hours]),
                                      ("quarantined", "#e67e22", [h["quarantined"] for h in hours])],
                             "Records ingested per hour of their Kafka timestamp (written, quarantined)"),
        "lag": line_chart([f"v{p['version']} {p['time'][:16]}" for p in lag], [p["lag"] for p in lag],
                          "Lag after each commit (records behind the log end it planned to)"),
        "quarantine": bar_chart(labels, [("quarantined", "#e67e22", [h["quarantined"] for h in hours])],
                                "Records quarantined per hour of their Kafka timestamp"),
    }


def bar_chart(labels: Sequence[str], series: Sequence[tuple[str, str, Sequence[int]]], title: str) -> str:
    """Stacked bars, one per label; ``series`` is (name, css colour, values) from the bottom up."""
    if not labels:
        return f'<p class="empty">{escape(title)}: no commits in the recent history</p>'
    totals = [sum(values[i] for _, _, values in series) for i in range(len(labels))]
    top = max(max(totals), 1)
    step = min((WIDTH - 2 * PAD) / len(labels), MAX_BAR)
    marks = []
    for i, label in enumerate(labels):
        base = HEIGHT - PAD
        for name, colour, values in series:
            height = (HEIGHT - 2 * PAD) * values[i] / top
            marks.append(
                f'<rect class="bar {escape(name)}" data-label="{escape(label)}" data-value="{values[i]}" '
                f'x="{PAD + i * step + 1:.1f}" y="{base - height:.1f}" width="{max(step - 2, 1):.1f}" '
                f'height="{height:.1f}" fill="{colour}"><title>{escape(label)}: {values[i]:,} {escape(name)}</title></rect>')
            base -= height
    return _frame(title, marks, top, labels)


def line_chart(labels: Sequence[str], values: Sequence[int], title: str, colour: str = "#c0392b") -> str:
    """One line with a dot per point."""
    if not labels:
        return f'<p class="empty">{escape(title)}: no commits with lag figures in the recent history</p>'
    top = max(max(values), 1)
    step = (WIDTH - 2 * PAD) / max(len(labels) - 1, 1)
    points = [(PAD + i * step, HEIGHT - PAD - (HEIGHT - 2 * PAD) * v / top) for i, v in enumerate(values)]
    marks = [f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
             f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}"/>']
    marks += [f'<circle class="point" data-label="{escape(label)}" data-value="{v}" cx="{x:.1f}" cy="{y:.1f}" r="2.5" '
              f'fill="{colour}"><title>{escape(label)}: {v:,}</title></circle>'
              for label, v, (x, y) in zip(labels, values, points)]
    return _frame(title, marks, top, labels)


def _frame(title: str, marks: list[str], top: int, labels: Sequence[str]) -> str:
    axis = (f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#888"/>'
            f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end" font-size="10">{top:,}</text>'
            f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end" font-size="10">0</text>'
            f'<text x="{PAD}" y="{HEIGHT - PAD + 14}" font-size="10">{escape(labels[0])}</text>'
            f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 14}" text-anchor="end" font-size="10">{escape(labels[-1])}</text>')
    return (f'<figure><figcaption>{escape(title)}</figcaption><svg class="chart" role="img" aria-label="{escape(title)}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}">{axis}{"".join(marks)}</svg></figure>')
