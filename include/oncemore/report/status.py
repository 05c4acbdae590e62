"""Reading a pipeline back: per-partition status (positions, log bounds, lag in records and in
time), the quarantine rate of its recent batches beside its ``quarantine`` limit, an upsert
pipeline's recent batches by what their events did (inserted, updated, deleted, stale:
commit/merge.py's counts, as each commit's record states them), and the freshness check of a
pipeline's ``alert`` limits; with ``sink.catalog``, whether its tables are registered there
(asked of the catalog each time: nothing is kept between runs)."""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from oncemore.catalog.registration import catalog_state
from oncemore.commit.share import records_read
from oncemore.config.model import Pipeline
from oncemore.config.values import format_timestamp_ms
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.errors import OncemoreError
from oncemore.kafka.cluster import ClusterLookups
from oncemore.plan.bounds import first_matching
from oncemore.plan.commitinfo import CommitEntry
from oncemore.plan.ledger import Ledger

# Commits of recent history searched for each partition's last commit.
STATUS_HISTORY = 50
# An upsert pipeline's batches shown, newest first, and what of their events.
UPSERT_BATCHES = 10
UPSERT_COUNTS = ("inserted", "updated", "deleted", "stale")
# Batch commits the quarantine rate is taken over, newest first.
RATE_COMMITS = 50


class FreshnessAlert(OncemoreError):
    """A pipeline is further behind its topic than its ``alert`` limits allow."""


def status(pipeline: Pipeline, recent: Sequence[CommitEntry] | None = None, main: Ledger | None = None,
           quarantine: Ledger | None = None, kafka: ClusterLookups | None = None) -> dict[str, Any]:
    """Per partition: the committed position, the log's bounds (``log_end`` is the last stable
    offset), the lag in records, the lag in time (``lag_seconds``: the age of the first record not
    yet ingested) and the partition's last commit among ``recent`` (this pipeline's recent
    batches, newest first; read from the table when not given). ``main`` and ``quarantine``: the
    tables' ledgers when the caller keeps them (their snapshots are then only updated); ``kafka``:
    the lookups the pipelines read together share (one admin client per cluster)."""
    options = pipeline.sink.storage_options
    kafka = kafka or ClusterLookups()
    state = kafka.describe_source(pipeline)
    bounds = kafka.log_bounds(pipeline, state.partitions)
    main = main or Ledger(pipeline.sink.table_uri, pipeline.name, options)
    quarantine = quarantine or Ledger(pipeline.sink.quarantine_uri, pipeline.name, options)
    table = main.snapshot()
    positions = main.positions(state.partitions, table)
    quarantine_positions = quarantine.positions(state.partitions)
    if recent is None:
        recent = main.recent_batches(STATUS_HISTORY, table)
    last_commit: dict[KafkaPartition, CommitEntry] = {}
    for entry in recent:
        for partition in entry.record.partition_ranges():
            last_commit.setdefault(partition, entry)
    starts = {p: positions[p] if positions[p] is not None else bounds[p].earliest for p in state.partitions}
    unread = first_matching(pipeline, {p: (starts[p], bounds[p].latest) for p in state.partitions
                                       if starts[p] < bounds[p].latest}, lambda _stamp: True)
    now_ms = int(time.time() * 1000)
    rows = []
    for p in state.partitions:
        first_unread = unread.get(p)
        rows.append({
            "topic": p.topic,
            "partition": p.partition,
            "position": positions[p],
            "quarantine_position": quarantine_positions[p],
            "log_start": bounds[p].earliest,
            "log_end": bounds[p].latest,
            "lag": max(bounds[p].latest - starts[p], 0),
            "lag_seconds": max(now_ms - first_unread[1], 0) / 1000 if first_unread else 0.0,
            "last_commit": format_timestamp_ms(last_commit[p].timestamp_ms) if p in last_commit else None,
            "last_commit_version": last_commit[p].version if p in last_commit else None,
        })
    data = {"pipeline": pipeline.name, "subscription": pipeline.source.describe_subscription(),
            "topics": {t: {"topic_id": i.topic_id} for t, i in sorted(state.identities.items())},
            "table_uri": pipeline.sink.table_uri, "table_version": table.version() if table is not None else None,
            "partitions": rows, "gone": _gone(pipeline, kafka, main, table, recent, set(state.topics)),
            "quarantine": quarantine_rate(pipeline, recent)}
    if pipeline.sink.catalog is not None:
        data["catalog"] = catalog_state(pipeline)
    if pipeline.upsert is not None:
        data["upsert"] = {"keys": list(pipeline.upsert.keys), "sequence_by": pipeline.upsert.sequence_by,
                          "batches": [upsert_counts(e) for e in recent if e.record.reset is None
                                      and e.record.deletion is None][:UPSERT_BATCHES]}
    return data


def quarantine_rate(pipeline: Pipeline, recent: Sequence[CommitEntry]) -> dict[str, Any]:
    """The share of their records the newest RATE_COMMITS batches quarantined (of every record they
    read: written, quarantined or filtered, as the limit counts them), the newest batch's alone, the
    pipeline's limit, and the batches among them committed over it because a run accepted it."""
    batches = [e for e in recent if e.record.reset is None and e.record.deletion is None][:RATE_COMMITS]

    def share(entries: Sequence[CommitEntry]) -> dict[str, Any]:
        quarantined = sum(e.record.records.get("quarantined", 0) for e in entries)
        records = sum(records_read(e.record.records) for e in entries)
        return {"records": records, "quarantined": quarantined, "rate": quarantined / records if records else None}

    last = {"version": batches[0].version, "batch_seq": batches[0].record.batch_seq, **share(batches[:1])} \
        if batches else None
    return {"max_fraction": pipeline.quarantine.max_fraction, "min_quarantined": pipeline.quarantine.min_quarantined,
            "commits": len(batches), **share(batches), "last_batch": last,
            "accepted": [e.version for e in batches if e.record.quarantine_accepted]}


def describe_rate(rate: dict[str, Any]) -> str:
    """``quarantine_rate`` as one line."""
    limit = f"limit {rate['max_fraction']:.0%} once {rate['min_quarantined']} are quarantined"
    if not rate["commits"]:
        return f"quarantine: no batches yet ({limit})"
    last = rate["last_batch"]
    line = (f"quarantine: {_percent(rate['rate'])} of the last {rate['commits']} batch commits' {rate['records']} "
            f"records ({rate['quarantined']}); last batch (version {last['version']}): {_percent(last['rate'])} "
            f"({last['quarantined']} of {last['records']}); {limit}")
    if rate["accepted"]:
        line += f"; committed over the limit by a run that accepted it: version(s) {', '.join(map(str, rate['accepted']))}"
    return line


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def upsert_counts(entry: CommitEntry) -> dict[str, Any]:
    """An upsert batch's commit: which, when, and what its events did (UPSERT_COUNTS)."""
    return {"version": entry.version, "time": format_timestamp_ms(entry.timestamp_ms), "batch_seq": entry.record.batch_seq,
            **{c: entry.record.records.get(c, 0) for c in UPSERT_COUNTS}}


def _gone(pipeline: Pipeline, kafka: ClusterLookups, main: Ledger, table, recent: Sequence[CommitEntry],
          topics: set[str]) -> dict[str, dict[str, Any]]:
    """Topics the pipeline's recent batches read that it reads no longer: deleted from the cluster,
    or no longer matching its pattern (a rotated topic), with the positions the table keeps for them."""
    partitions = sorted({p for e in recent for p in e.record.partition_ranges() if p.topic not in topics})
    if not partitions:
        return {}
    existing = kafka.metadata(pipeline).topics
    held = main.positions(partitions, table)
    return {topic: {"why": "no longer subscribed" if topic in existing else "deleted",
                    "positions": {str(p.partition): held[p] for p in partitions if p.topic == topic}}
            for topic in sorted({p.topic for p in partitions})}


def check_freshness(pipeline: Pipeline, partitions: Sequence[dict[str, Any]]) -> None:
    """Raises FreshnessAlert naming every partition (rows of ``status``) beyond the pipeline's
    ``alert`` limits."""
    limits = pipeline.alert
    beyond = []
    for row in partitions:
        if limits.max_lag_records is not None and row["lag"] > limits.max_lag_records:
            beyond.append(f"{row['topic']}/{row['partition']}: {row['lag']} records behind (limit "
                          f"{limits.max_lag_records}, position {_position(row)}, log end {row['log_end']})")
        if limits.max_lag_minutes is not None and row["lag_seconds"] > limits.max_lag_minutes * 60:
            beyond.append(f"{row['topic']}/{row['partition']}: oldest record not ingested is "
                          f"{row['lag_seconds'] / 60:.1f} minutes old (limit {limits.max_lag_minutes:g}, position "
                          f"{_position(row)})")
    if beyond:
        raise FreshnessAlert(f"pipeline {pipeline.name}: " + "; ".join(beyond), beyond=beyond)


def _position(row: dict[str, Any]) -> str:
    return "none yet" if row["position"] is None else str(row["position"])


def format_status(data: dict[str, Any]) -> str:
    lines = [f"pipeline {data['pipeline']}: topics {', '.join(data['topics'])} -> {data['table_uri']}"]
    header = ("topic", "partition", "position", "log_start", "log_end", "lag", "lag_seconds", "last_commit")
    lines.append("  ".join(f"{h:>12}" for h in header))
    for row in data["partitions"]:
        lines.append("  ".join(f"{str(row[h] if row[h] is not None else '-'):>12}" for h in header))
    lines.append(describe_rate(data["quarantine"]))
    if "catalog" in data:
        lines.append(data["catalog"]["summary"])
    for topic, gone in data["gone"].items():
        lines.append(f"topic {topic} is gone ({gone['why']}): nothing more is read from it; positions kept at "
                     f"{json.dumps(gone['positions'])}")
    if "upsert" in data:
        lines.append(f"recent batches (upserts by {', '.join(data['upsert']['keys'])}):")
        header = ("version", "time", "batch_seq", *UPSERT_COUNTS)
        widths = {h: 27 if h == "time" else 12 for h in header}
        lines.append("  ".join(f"{h:>{widths[h]}}" for h in header))
        lines += ["  ".join(f"{str(batch[h]):>{widths[h]}}" for h in header) for batch in data["upsert"]["batches"]]
    return "\n".join(lines)
