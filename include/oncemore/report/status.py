"""Reading a pipeline back: per-partition status (positions, log bounds, lag in records and in
time; with routes, each table's positions and where one is behind), the quarantine rate of its
recent batches beside its ``quarantine`` limit, an upsert
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
from oncemore.core.columns import ROUTE_TAG_PREFIX
from oncemore.plan.tables import QUARANTINE, Ledgers
from oncemore.report.parts import routed_batches

# Commits of recent history searched for each partition's last commit.
STATUS_HISTORY = 50
# An upsert pipeline's batches shown, newest first, and what of their events.
UPSERT_BATCHES = 10
UPSERT_COUNTS = ("inserted", "updated", "deleted", "stale")
# Batch commits the quarantine rate is taken over, newest first.
RATE_COMMITS = 50


class FreshnessAlert(OncemoreError):
    """A pipeline is further behind its topic than its ``alert`` limits allow."""


def status(pipeline: Pipeline, recent: Sequence[CommitEntry] | None = None, ledgers: Ledgers | None = None,
           kafka: ClusterLookups | None = None) -> dict[str, Any]:
    """Per partition: the committed position (with routes, where the pipeline stands: the lowest
    of its tables', each table's beside it), the log's bounds (``log_end`` is the last stable
    offset), the lag in records, the lag in time (``lag_seconds``: the age of the first record not
    yet ingested) and the partition's last commit among ``recent`` (this pipeline's recent
    batches, newest first; read from the tables when not given). ``ledgers``: the tables' ledgers
    when the caller keeps them (their snapshots are then only updated); ``kafka``: the lookups the
    pipelines read together share (one admin client per cluster)."""
    kafka = kafka or ClusterLookups()
    state = kafka.describe_source(pipeline)
    bounds = kafka.log_bounds(pipeline, state.partitions)
    ledgers = ledgers or Ledgers(pipeline)
    positions = ledgers.positions(state.partitions)
    held = ledgers.held(state.partitions)
    quarantine_positions = held[QUARANTINE]
    if recent is None:
        recent = recent_batches(ledgers, STATUS_HISTORY)
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
    main = ledgers.main.snapshot() if not ledgers.routed else None
    data = {"pipeline": pipeline.name, "subscription": pipeline.source.describe_subscription(),
            "topics": {t: {"topic_id": i.topic_id} for t, i in sorted(state.identities.items())},
            "table_uri": pipeline.sink.table_uri, "table_version": main.version() if main is not None else None,
            "partitions": rows, "gone": _gone(pipeline, kafka, ledgers, recent, set(state.topics)),
            "quarantine": quarantine_rate(pipeline, recent)}
    if ledgers.routed:
        data["routes"] = routes_state(pipeline, ledgers, held)
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


def recent_batches(ledgers: Ledgers, limit: int) -> list[CommitEntry]:
    """The pipeline's recent batches, newest first: its main table's commits, or with routes the
    parts its tables committed (report/parts.py)."""
    if not ledgers.routed:
        return ledgers.main.recent_batches(limit)
    return routed_batches(ledgers.by_tag(), limit)[0]


def routes_state(pipeline: Pipeline, ledgers: Ledgers, held: dict) -> dict[str, Any]:
    """A routed pipeline's tables: by route (and the quarantine table), where it is, its version and
    its own positions, and the partitions where it lacks records the quarantine table holds the
    positions of (a crash between a part's commits: the next run commits it alone); and
    ``changed_from``, the routes the last run committed under when the pipeline file's differ (the
    next run applies them, or refuses while a table is behind: plan/tables.py)."""
    routes = pipeline.routes
    found = ledgers.in_force()
    effective = ledgers.effective(held, found)
    quarantine = held[QUARANTINE]
    tables = {}
    for tag, ledger in ledgers.by_tag().items():
        table = ledger.snapshot()
        tables[tag.removeprefix(ROUTE_TAG_PREFIX)] = {
            "table_uri": ledger.table_uri, "version": table.version() if table is not None else None,
            "positions": {str(p): v for p, v in held[tag].items()},
            "behind": {str(p): [v, quarantine[p]] for p, v in effective[tag].items()
                       if quarantine[p] is not None and (v is None or v < quarantine[p])}}
    changed = found is not None and not found.same_routes(ledgers.configured())
    return {"by": routes.by, "unrouted": routes.unrouted, "tables": tables,
            "changed_from": found.describe() if changed else None}


def _gone(pipeline: Pipeline, kafka: ClusterLookups, ledgers: Ledgers, recent: Sequence[CommitEntry],
          topics: set[str]) -> dict[str, dict[str, Any]]:
    """Topics the pipeline's recent batches read that it reads no longer: deleted from the cluster,
    or no longer matching its pattern (a rotated topic), with the positions the tables keep for them."""
    partitions = sorted({p for e in recent for p in e.record.partition_ranges() if p.topic not in topics})
    if not partitions:
        return {}
    existing = kafka.metadata(pipeline).topics
    held = ledgers.positions(partitions)
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
    routes = data.get("routes")
    if routes is None:
        lines = [f"pipeline {data['pipeline']}: topics {', '.join(data['topics'])} -> {data['table_uri']}"]
    else:
        lines = [f"pipeline {data['pipeline']}: topics {', '.join(data['topics'])}, routed by {routes['by']} "
                 f"(unrouted: {routes['unrouted']}):"]
        for name, table in routes["tables"].items():
            what = "quarantine" if name == QUARANTINE else f"route {name}"
            behind = "; behind: " + ", ".join(f"{p} at {v} (the quarantine table at {top})"
                                              for p, (v, top) in table["behind"].items()) if table["behind"] else ""
            lines.append(f"  {what} -> {table['table_uri']} (version {table['version']}){behind}")
        if routes["changed_from"]:
            lines.append(f"  the last run routed {routes['changed_from']}: the next run routes as above")
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
