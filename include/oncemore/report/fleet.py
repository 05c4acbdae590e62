"""Every pipeline at once, one row each: what the oncemore page's index and ``oncemore status``
with no pipeline show. A row: the state (``error``: its status could not be read; ``alert``:
beyond its ``alert`` limits; ``new``: nothing committed yet; else ``ok``), the lag in records and
in time (the sum and the oldest over its partitions), the last commit's age, the last recorded
verify's verdict, and the records quarantined in the last 24 hours.

Invariant: one broken pipeline never hides the others (its row carries its error), and Kafka is
asked once per cluster, not once per pipeline (kafka/cluster.py): a hundred pipelines on one
cluster share one admin client, its metadata and one ListOffsets pair.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from oncemore.config.loading import broken_line, load_all
from oncemore.config.model import Pipeline
from oncemore.kafka.cluster import ClusterLookups
from oncemore.report.overview import pipeline_overview
from oncemore.report.status import FreshnessAlert, check_freshness

# Pipelines read side by side: their tables' logs and first unread records (librdkafka and
# delta-rs work outside the GIL).
THREADS = 8
COLUMNS = ("pipeline", "state", "lag", "lag_time", "last_commit_age", "verify", "quarantined_24h", "tags")


def print_every_pipeline(as_json: bool = False) -> bool:
    """``oncemore status`` with no pipeline: prints the rows of every pipeline of the pipelines
    directory (``format_rows``, then a line per file that does not load; or all as JSON); True
    when a pipeline could not be read or a file does not load."""
    pipelines, broken = load_all()
    rows = [data["row"] for data in overviews(pipelines)]
    if as_json:
        print(json.dumps({"pipelines": rows, "broken_configs": {path: str(e) for path, e in sorted(broken.items())}},
                         indent=2))
    else:
        print("\n".join([format_rows(rows), *(broken_line(path, e) for path, e in sorted(broken.items()))]))
    return bool(broken) or any(r["state"] == "error" for r in rows)


def overview(pipeline: Pipeline, detail: bool = False, kafka: ClusterLookups | None = None) -> dict[str, Any]:
    """The pipeline's overview (report.overview) with ``error`` None, or, when it cannot be read
    (Kafka down, a table unreadable), what stopped it in ``error``."""
    try:
        data = pipeline_overview(pipeline, detail=detail, kafka=kafka)
        data["error"] = None
    except Exception as exc:  # noqa: BLE001 - one broken pipeline must not hide the others
        data = {"pipeline": pipeline.name, "subscription": pipeline.source.describe_subscription(),
                "table_uri": pipeline.sink.table_uri or ", ".join(t.table_uri for t in pipeline.tables), "error": f"{type(exc).__name__}: {exc}"}
    return data


def overviews(pipelines: Sequence[Pipeline]) -> list[dict[str, Any]]:
    """Each pipeline's overview (in the order given) with its ``row``, Kafka's answers shared per cluster."""
    kafka = ClusterLookups()
    kafka.prefetch(pipelines)

    def one(pipeline: Pipeline) -> dict[str, Any]:
        data = overview(pipeline, kafka=kafka)
        data["row"] = row(pipeline, data)
        return data

    with ThreadPoolExecutor(max_workers=max(1, min(THREADS, len(pipelines)))) as pool:
        return list(pool.map(one, pipelines))


def row(pipeline: Pipeline, data: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's row, from its overview."""
    tags = list(pipeline.airflow.tags) if pipeline.airflow is not None else []
    if data["error"] is not None:
        return {"pipeline": pipeline.name, "state": "error", "why": data["error"], "lag": None, "lag_seconds": None,
                "last_commit": None, "last_commit_age_seconds": None, "verify": None, "quarantined_24h": None,
                "quarantined_24h_complete": None, "tags": tags}
    partitions = data["partitions"]
    last = data["last_commit"]
    try:
        check_freshness(pipeline, partitions)
        state, why = ("ok", None) if last else ("new", "nothing committed yet")
    except FreshnessAlert as alert:
        state, why = "alert", "; ".join(alert.evidence["beyond"])
    verified = data["verified"]
    return {"pipeline": pipeline.name, "state": state, "why": why,
            "lag": sum(r["lag"] for r in partitions),
            "lag_seconds": max((r["lag_seconds"] for r in partitions), default=0.0),
            "last_commit": last["time"] if last else None,
            "last_commit_age_seconds": last["age_seconds"] if last else None,
            "verify": None if verified is None else "OK" if verified["ok"] else "FAILED",
            "quarantined_24h": data["quarantined_24h"]["records"],
            "quarantined_24h_complete": data["quarantined_24h"]["complete"], "tags": tags}


def seconds(value: float | None) -> str:
    """A duration as people read it on a status line: 42.0s, 3.5m, 2.0h, 1.5d."""
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.1f}m"
    if value < 172_800:
        return f"{value / 3600:.1f}h"
    return f"{value / 86_400:.1f}d"


def cells(row: dict[str, Any]) -> dict[str, str]:
    """A row's COLUMNS as text."""
    quarantined = row["quarantined_24h"]
    return {"pipeline": row["pipeline"], "state": row["state"],
            "lag": "-" if row["lag"] is None else str(row["lag"]), "lag_time": seconds(row["lag_seconds"]),
            "last_commit_age": seconds(row["last_commit_age_seconds"]), "verify": row["verify"] or "-",
            "quarantined_24h": "-" if quarantined is None else f"{quarantined}{'' if row['quarantined_24h_complete'] else '+'}",
            "tags": ",".join(row["tags"]) or "-"}


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """One line per pipeline under a header; a row's state other than ok or new says why at its end."""
    shown = [cells(r) for r in rows]
    widths = {c: max([len(c), *(len(s[c]) for s in shown)]) for c in COLUMNS}
    lines = ["  ".join(f"{c:<{widths[c]}}" for c in COLUMNS).rstrip()]
    for r, s in zip(rows, shown):
        line = "  ".join(f"{s[c]:<{widths[c]}}" for c in COLUMNS).rstrip()
        lines.append(f"{line}  {r['why']}" if r["state"] in ("error", "alert") else line)
    return "\n".join(lines)
