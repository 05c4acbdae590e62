"""Reading a pipeline back: per-partition status (positions, log bounds, lag) and the check that a
planned run really is in the table."""

from __future__ import annotations

from typing import Any

from . import kafka
from .config import Pipeline, format_timestamp_ms
from .errors import OncemoreError
from .ledger import Ledger
from .planner import Plan


class RunNotCommitted(OncemoreError):
    """The table's positions do not cover what the run planned."""


def status(pipeline: Pipeline) -> dict[str, Any]:
    topic, options = pipeline.source.topic, pipeline.sink.storage_options
    admin = kafka.admin_client(pipeline)
    state = kafka.describe_topic(admin, pipeline)
    bounds = kafka.log_bounds(admin, pipeline, state.partitions)
    main = Ledger(pipeline.sink.table_uri, pipeline.name, topic, options)
    positions = main.positions(state.partitions)
    quarantine_positions = Ledger(pipeline.sink.quarantine_uri, pipeline.name, topic, options).positions(state.partitions)
    last_commit: dict[int, int] = {}
    for entry in main.recent_batches(limit=50):
        for partition in entry.record.ranges.get(topic, {}):
            last_commit.setdefault(int(partition), entry.timestamp_ms)
    rows = []
    for p in state.partitions:
        position = positions[p]
        lag = bounds[p].latest - (position if position is not None else bounds[p].earliest)
        rows.append({
            "partition": p,
            "position": position,
            "quarantine_position": quarantine_positions[p],
            "log_start": bounds[p].earliest,
            "log_end": bounds[p].latest,
            "lag": max(lag, 0),
            "last_commit": format_timestamp_ms(last_commit[p]) if p in last_commit else None,
        })
    return {"pipeline": pipeline.name, "topic": topic, "topic_id": state.identity.topic_id,
            "table_uri": pipeline.sink.table_uri, "partitions": rows}


def format_status(data: dict[str, Any]) -> str:
    lines = [f"pipeline {data['pipeline']}: topic {data['topic']} -> {data['table_uri']}"]
    header = ("partition", "position", "log_start", "log_end", "lag", "last_commit")
    lines.append("  ".join(f"{h:>12}" for h in header))
    for row in data["partitions"]:
        lines.append("  ".join(f"{str(row[h] if row[h] is not None else '-'):>12}" for h in header))
    return "\n".join(lines)


def verify_run(pipeline: Pipeline, plan: Plan, run_id: str) -> dict[str, Any]:
    """Checks that the table's positions reach every planned end and sums what ``run_id`` committed.

    Raises RunNotCommitted otherwise: a run that reports success must have its commits in the log
    (or find that another run committed the same range)."""
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name, pipeline.source.topic, pipeline.sink.storage_options)
    planned_ends = plan.ends()
    positions = ledger.positions(planned_ends)
    short = {p: (positions[p], end) for p, end in planned_ends.items() if positions[p] is None or positions[p] < end}
    if short:
        detail = ", ".join(f"{plan.topic}/{p}: position {pos}, planned end {end}" for p, (pos, end) in sorted(short.items()))
        raise RunNotCommitted(f"pipeline {pipeline.name}: run {run_id} planned ranges the table does not hold ({detail})",
                              pipeline=pipeline.name, topic=plan.topic, short=short)
    # A batch cut by byte budgets takes several commits; look back far enough for all of them.
    commits = [e for e in ledger.recent_batches(limit=4 * len(plan.batches) + 50) if e.record.run_id == run_id]
    return {
        "pipeline": pipeline.name,
        "run_id": run_id,
        "status": "committed" if commits else "no-op",
        "commits": sorted(e.version for e in commits),
        "records": {
            "written": sum(e.record.records["written"] for e in commits),
            "quarantined": sum(e.record.records["quarantined"] for e in commits),
        },
        "partitions": status(pipeline)["partitions"],
    }
