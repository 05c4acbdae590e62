"""What an on-call engineer looks at first, per pipeline: its state now (``report.status``) and its
recent history from the Delta log — batches (an upsert's with what their events did: inserted,
updated, deleted, stale), records per hour, lag after each commit, quarantine counts and a sample
of quarantined records.

Read-only, and from the same ledger contract as the CLI: the tables' logs and Kafka, no store of
its own. Only recent history is read (the newest HISTORY_COMMITS commits, never the whole log), so
the cost does not grow with the table's age.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from oncemore.commit.share import records_read, value_head
from oncemore.config.model import Pipeline
from oncemore.config.values import format_timestamp_ms
from oncemore.core import hours
from oncemore.core.storage import filesystem
from oncemore.kafka.cluster import ClusterLookups
from oncemore.core.columns import ROUTE_TAG_PREFIX
from oncemore.plan.ledger import CommitEntry, Ledger
from oncemore.plan.tables import Ledgers
from oncemore.report.parts import routed_batches
from oncemore.report.status import UPSERT_COUNTS, describe_rate, status
from oncemore.report.verdict import Discrepancy, last_result

HISTORY_COMMITS = 500
BATCHES_SHOWN = 20
QUARANTINE_SAMPLE = 10
_HOUR_MS = 3_600_000
_DAY_MS = 24 * _HOUR_MS
HOURS_SHOWN = 7 * 24  # the per-hour series' newest hours


# The page's ledgers live as long as the process (the API server): a view only brings their
# snapshots up to date and reads the commits that landed since the last view. One view of a
# pipeline at a time uses them.
_LEDGERS: dict[tuple, tuple[Ledgers, threading.Lock]] = {}
_LEDGERS_LOCK = threading.Lock()


def _ledgers(pipeline: Pipeline) -> tuple[Ledgers, threading.Lock]:
    sink = pipeline.sink
    key = (pipeline.name, tuple(t.table_uri for t in pipeline.tables), sink.quarantine_uri,
           tuple(sorted(sink.storage_options.items())))
    with _LEDGERS_LOCK:
        if key not in _LEDGERS:
            _LEDGERS[key] = (Ledgers(pipeline), threading.Lock())
        return _LEDGERS[key]


def pipeline_overview(pipeline: Pipeline, detail: bool = False, kafka: ClusterLookups | None = None) -> dict[str, Any]:
    """The pipeline's status and recent batches; with ``detail``, also the series the pipeline
    page plots and a sample of quarantined records. ``kafka``: the lookups pipelines read
    together share (kafka/cluster.py)."""
    ledgers, lock = _ledgers(pipeline)
    with lock:
        return _overview(pipeline, ledgers, detail, kafka)


def _overview(pipeline: Pipeline, ledgers: Ledgers, detail: bool, kafka: ClusterLookups | None) -> dict[str, Any]:
    if ledgers.routed:  # the parts its tables committed, with the versions of each part's commits
        history, versions = routed_batches(ledgers.by_tag(), HISTORY_COMMITS)
    else:
        history, versions = ledgers.main.recent_batches(HISTORY_COMMITS), None
    data = status(pipeline, history, ledgers, kafka)
    now_ms = int(time.time() * 1000)
    data["last_commit"] = {**_batch(history[0]), "age_seconds": max(now_ms - history[0].timestamp_ms, 0) / 1000} \
        if history else None
    data["quarantined_24h"] = quarantined_since(history, now_ms - _DAY_MS)
    data["batches"] = [_batch(e) for e in history[:BATCHES_SHOWN]]
    if versions is not None:
        for batch, made in zip(data["batches"], versions):
            batch["tables"] = {tag.removeprefix(ROUTE_TAG_PREFIX): v for tag, v in sorted(made.items())}
    data["history"] = {"commits": len(history), "since": format_timestamp_ms(history[-1].timestamp_ms) if history else None}
    data["verified"] = _verified(pipeline)
    data["quarantine"]["line"] = describe_rate(data["quarantine"])
    if detail:
        data["per_hour"] = per_hour(history)
        data["lag_after_commit"] = [{"time": format_timestamp_ms(e.timestamp_ms), "version": e.version,
                                     "lag": sum(e.record.lag().values())}
                                    for e in reversed(history) if e.record.log_end]
        data["quarantine_sample"] = quarantine_sample(pipeline, ledgers.quarantine)
    return data


def _verified(pipeline: Pipeline) -> dict[str, Any] | None:
    """The last recorded ``oncemore verify`` (verify.py): when, its verdict line, the first discrepancy."""
    result = last_result(pipeline)
    if result is None:
        return None
    first = result["discrepancies"][0] if result["discrepancies"] else None
    return {"ok": result["ok"], "at": result["at"], "summary": result["summary"],
            "first": Discrepancy(**{**first, "versions": tuple(first["versions"])}).line() if first else None}


def quarantined_since(history: list[CommitEntry], since_ms: int) -> dict[str, Any]:
    """Records the commits of ``history`` (newest first) quarantined since ``since_ms``;
    ``complete`` is false when the history read (HISTORY_COMMITS) ends after ``since_ms``, so
    older commits of that time were not counted."""
    recent = [e for e in history if e.timestamp_ms >= since_ms]
    return {"records": sum(e.record.records.get("quarantined", 0) for e in recent),
            "complete": len(recent) < len(history) or len(history) < HISTORY_COMMITS}


def per_hour(history: list[CommitEntry]) -> list[dict[str, Any]]:
    """Records written and quarantined per hour of their Kafka timestamp (each commit's ``hours``),
    as Airflow users read data intervals: a catch-up run's commits show under the hours their
    records belong to, not the hour they were committed. What a commit's hours leave out (commits
    before record format 9, rows whose timestamp a transform dropped) counts at its commit's hour,
    so every record is charted once. Oldest hour first, empty hours between included, at most the
    newest HOURS_SHOWN hours."""
    counted: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # {hour: [written, quarantined]}
    for entry in history:
        written, quarantined = entry.record.records.get("written", 0), entry.record.records.get("quarantined", 0)
        for hour, (hour_written, hour_quarantined) in entry.record.hours.items():
            at = counted[hours.hour_ms(hour) // _HOUR_MS]
            at[hours.WRITTEN] += hour_written
            at[hours.QUARANTINED] += hour_quarantined
            written, quarantined = written - hour_written, quarantined - hour_quarantined
        if written or quarantined:
            at = counted[entry.timestamp_ms // _HOUR_MS]
            at[hours.WRITTEN] += written
            at[hours.QUARANTINED] += quarantined
    if not counted:
        return []
    newest = max(counted)
    shown = [(h, counted.get(h, [0, 0])) for h in range(max(min(counted), newest - HOURS_SHOWN + 1), newest + 1)]
    return [{"hour": format_timestamp_ms(h * _HOUR_MS), "written": figures[hours.WRITTEN],
             "quarantined": figures[hours.QUARANTINED]} for h, figures in shown]


def quarantine_sample(pipeline: Pipeline, quarantine: Ledger, limit: int = QUARANTINE_SAMPLE) -> list[dict[str, Any]]:
    """The newest quarantined records (by offset, from the newest files): partition, offset, the
    error and the first bytes of the value."""
    table = quarantine.snapshot()
    if table is None:
        return []
    actions = pa.table(table.get_add_actions(flatten=True)).to_pydict()  # arro3 -> pyarrow
    newest = sorted(zip(actions["modification_time"], actions["path"]), reverse=True)[:limit]
    if not newest:
        return []
    fs, root = filesystem(pipeline.sink.quarantine_uri, pipeline.sink.storage_options)
    rows = ds.dataset([f"{root}/{path}" for _, path in newest], filesystem=fs, format="parquet").to_table(
        columns=["_kafka_topic", "_kafka_partition", "_kafka_offset", "error", "value"])
    rows = rows.take(pc.sort_indices(rows, [("_kafka_offset", "descending")])[:limit]).to_pylist()
    return [{"topic": r["_kafka_topic"], "partition": r["_kafka_partition"], "offset": r["_kafka_offset"], "error": r["error"],
             "value_head": value_head(r["value"])} for r in rows]


def _rate(records: Mapping[str, int]) -> float | None:
    read = records_read(records)
    return records.get("quarantined", 0) / read if read else None


def _batch(entry: CommitEntry) -> dict[str, Any]:
    record = entry.record
    return {
        "version": entry.version, "time": format_timestamp_ms(entry.timestamp_ms), "run_id": record.run_id,
        "batch_seq": record.batch_seq,
        "ranges": {str(p): list(r) for p, r in sorted(record.partition_ranges().items())},
        "written": record.records.get("written", 0), "quarantined": record.records.get("quarantined", 0),
        "filtered": record.records.get("filtered", 0), "unrouted": record.records.get("unrouted", 0),
        "expectations": dict(record.expectations),
        "quarantine_rate": _rate(record.records), "quarantine_accepted": record.quarantine_accepted,
        "duration_seconds": record.duration_ms / 1000 if record.duration_ms else None,
        "reset": record.reset is not None,
        **{c: record.records[c] for c in UPSERT_COUNTS if c in record.records},  # an upsert's batch
    }
