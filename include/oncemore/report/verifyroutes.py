"""``oncemore verify`` of a routed pipeline (config/routes.py): DESIGN.md invariant 7 audited from its
tables alone, its route tables and its quarantine table together.

Each of its tables records the ranges it consumed (commit/routed.py). For every table's kept commits:
1. history, per table: each commit starts where the table's commit before it ended, or at the end of
   a gap it records, or where a reset put it (verify._walk), and the table's snapshot holds the
   positions its last commit left;
2. rows, across the tables: every row of a table lies in a range that table committed, and no
   (topic, partition, offset) is in the tables, all of them together, more often than one table's
   commits cover it (once; twice where a reset rewound it): a record is in exactly one of them;
3. counts, per commit of each table whose offsets no other commit of it covers: its rows in the
   table are what its record says (a route table's ``written``, the quarantine table's
   ``quarantined``), less the rows a recorded deletion removed since.
The tables are the pipeline's and every table the quarantine table's commits name as a route's
(RoutesInForce) that no route names now: a route removed or moved keeps its records there.
The offsets of the quarantine table's committed ranges that hold a row in no table are the records
its commits count as ``unrouted`` (skipped), offsets that hold no record (transaction markers,
aborted records, compaction), or records a route table still lacks (behind after a crash between a
part's commits: ``status`` says so, and its next run commits them).

Invariants: as verify.py's (it reads the tables' files on Spark, writes nothing). Each table's
snapshot is read before its files.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

from oncemore.config.model import Pipeline
from oncemore.core.columns import QUARANTINE_TAG, ROUTE_TAG_PREFIX
from oncemore.core.storage import table_key
from oncemore.plan.commitinfo import CommitEntry
from oncemore.plan.ledger import Ledger
from oncemore.plan.tables import Ledgers
from oncemore.report.history import Removals, coverage, deleted_spans, scan_tasks, snapshot_files
from oncemore.report.verdict import EXAMPLES, Discrepancy, VerifyReport
from oncemore.run.session import register_source, slots

if TYPE_CHECKING:
    from oncemore.report.history import Piece

FORMER = ", no longer routed"  # ends the label of a table the routes named before (_former)


class _Named:
    """Adds the discrepancies found about one table to the report, naming the table."""

    def __init__(self, report: VerifyReport, label: str):
        self.report, self.label = report, label

    def add(self, found: Discrepancy) -> None:
        self.report.add(replace(found, table=self.label))


def verify_routes(pipeline: Pipeline, spark_factory, since: int | None = None) -> VerifyReport:
    """Audits a routed pipeline's tables (module docstring); ``spark_factory()`` gives the session."""
    from oncemore.report.verify import NothingToVerify, _walk

    ledgers = Ledgers(pipeline)
    tables = [(tag.removeprefix(ROUTE_TAG_PREFIX), ledger) for tag, (_, ledger) in ledgers.data.items()]
    tables += [*_former(pipeline, ledgers), (QUARANTINE_TAG, ledgers.quarantine)]
    snapshots = [ledger.snapshot() for _, ledger in tables]
    if all(s is None for s in snapshots):
        raise NothingToVerify(f"pipeline {pipeline.name}: no table of its routes at "
                              f"{', '.join(t.table_uri for t in pipeline.tables)} yet")
    quarantine = snapshots[-1]
    histories, whole = [], True
    for (_, ledger), table in zip(tables, snapshots):
        kept = ledger.kept_versions(table) if table is not None else []
        whole = whole and (not kept or kept[0] == 0)
        histories.append(sorted(ledger.recent_batches(None, table), key=lambda e: e.version) if table is not None else [])
    audited = [[e for e in history if since is None or e.version >= since] for history in histories]
    report = VerifyReport(pipeline.name, quarantine.version() if quarantine is not None else -1,
                          quarantine.version() if quarantine is not None else None, sum(map(len, audited)), since, whole)
    report.tables = {label: {"table_uri": ledger.table_uri, "version": table.version() if table is not None else None,
                             "commits": len(found), "rows": 0}
                     for (label, ledger), table, found in zip(tables, snapshots, audited)}

    # 1. Each table's history, and the positions its snapshot holds.
    for (label, ledger), table, history in zip(tables, snapshots, histories):
        if table is None and label.endswith(FORMER):
            report.add(Discrepancy("history", "-", -1, 0, 0, (), f"the table {ledger.table_uri} the quarantine "
                                   "table's commits routed records into is gone: its records are in no table", label))
        left = _walk(history, _Named(report, label))
        held = ledger.positions(left, table) if table is not None else {}
        for p, (position, version) in sorted(left.items()):
            if position is not None and held[p] != position:
                report.add(Discrepancy("position", p.topic, p.partition, min(position, held[p] or 0),
                                       max(position, held[p] or 0), (version,),
                                       f"the snapshot holds position {held[p]}, the last commit left {position}", label))

    # The tables' commits, numbered (a piece of history names the commits covering it by number).
    commits = [(i, entry) for i, history in enumerate(histories) for entry in history]
    numbered = [replace(entry, version=n) for n, (_, entry) in enumerate(commits)]
    topics = {p.topic for _, e in commits for p in e.record.partition_ranges()} | set(pipeline.source.topic_names or ())
    positions = ledgers.positions({p for _, e in commits for p in e.record.partition_ranges()})
    pieces, covered = coverage(numbered, positions, whole, topics)
    files = [f for i, table in enumerate(snapshots) if table is not None
             for f in snapshot_files(False, table, tables[i][1].table_uri, i)]
    removals = Removals(
        {label: deleted_spans(history) for (label, _), history in zip(tables, histories)},
        {label: ledger.rows_removed_outside(table) if table is not None else []
         for (label, ledger), table in zip(tables, snapshots)})
    if files:
        _audit(spark_factory(), files, covered, pieces, commits, audited, tables, removals, pipeline, report)
    return report


def _former(pipeline: Pipeline, ledgers: Ledgers) -> list[tuple[str, Ledger]]:
    """The tables the quarantine table's commits routed records into that are no route's table
    now (a route removed, or moved to another table), labelled by route: their records count too."""
    table = ledgers.quarantine.snapshot()
    now = {table_key(ledger.table_uri) for _, ledger in ledgers.data.values()}
    named = set() if table is None else {
        (route, location) for entry in ledgers.quarantine.recent_batches(None, table) if entry.record.routes
        for route, location in entry.record.routes.tables.items() if location not in now}
    return [(f"{route} ({location}){FORMER}", Ledger(location, pipeline.name, pipeline.sink.storage_options))
            for route, location in sorted(named)]


def _audit(spark, files, covered, pieces: dict[int, "Piece"], commits: list[tuple[int, CommitEntry]],
           audited: list[list[CommitEntry]], tables: list, removals: Removals, pipeline: Pipeline,
           report: VerifyReport) -> None:
    """Items 2 and 3 over the scanned coordinates of every table's rows."""
    from pyspark.sql import functions as F

    from oncemore.report.tablescan import BEFORE, FOREIGN, OUTSIDE, CoordinatesDataSource

    register_source(spark, CoordinatesDataSource)
    reader = (spark.read.format(CoordinatesDataSource.name()).option("files", json.dumps(scan_tasks(files, slots(spark))))
              .option("coverage", covered.to_json()))
    for key, value in (pipeline.sink.storage_options or {}).items():
        reader = reader.option(f"storage.{key}", value)
    rows = reader.load()
    labels = [label for label, _ in tables]
    # Per piece and table, its rows; per piece, the most rows one offset has across the tables.
    by_table = {(r["segment"], r["table"]): r["rows"] for r in
                rows.groupBy("segment", "table").agg(F.count(F.lit(1)).alias("rows")).collect()}
    per_offset = rows.groupBy("segment", "topic", "partition", "offset").agg(F.count(F.lit(1)).alias("n"))
    most = {r["segment"]: r["most"] for r in per_offset.groupBy("segment").agg(F.max("n").alias("most")).collect()}
    covering = {s: [commits[n][0] for n in piece.versions] for s, piece in pieces.items()}
    # How often one table's commits cover a piece: more than once where a reset rewound it.
    times = {s: max(found.count(i) for i in set(found)) for s, found in covering.items()}

    quarantine = len(tables) - 1
    for (segment, table), count in by_table.items():
        report.tables[labels[table]]["rows"] += count
        if segment == BEFORE or segment == FOREIGN:
            key = "before" if segment == BEFORE else "foreign"
            report.rows[key] = report.rows.get(key, 0) + count
        elif segment >= 0 and table in covering[segment]:
            key = "quarantine" if table == quarantine else "main"
            report.rows[key] = report.rows.get(key, 0) + count
        elif segment == OUTSIDE or segment >= 0:
            shown = rows.filter((F.col("segment") == segment) & (F.col("table") == table)).orderBy(
                "topic", "partition", "offset").limit(EXAMPLES).collect()
            for r in shown:
                report.add(Discrepancy("outside", r["topic"], r["partition"], r["offset"], r["offset"] + 1, (),
                                       "a row in no range this table committed", labels[table]))
            report.counts["outside"] += count - len(shown)

    doubled = [s for s, n in most.items() if s >= 0 and n > times[s]]
    if doubled:
        found = per_offset.filter(F.col("segment").isin(doubled) & (F.col("n") > 1)).orderBy(
            "topic", "partition", "offset").limit(50).collect()
        for r in [r for r in found if r["n"] > times[r["segment"]]][:EXAMPLES]:
            versions = _named(pieces[r["segment"]].versions, commits, labels)
            report.add(Discrepancy("duplicate", r["topic"], r["partition"], r["offset"], r["offset"] + 1,
                                   tuple(v for _, v in versions), f"in the tables {r['n']} times, committed "
                                   f"{times[r['segment']]} time(s) by one table ({_which(versions)})"))
        report.counts["duplicate"] = sum(r["extra"] for r in per_offset.filter(
            F.col("segment").isin(doubled) & (F.col("n") > 1)).agg(F.sum(F.col("n") - 1).alias("extra")).collect())

    # 3. Counts, per commit of each table; and what the quarantine table's ranges hold besides rows.
    mine: dict[int, list[int]] = {}
    for s, piece in pieces.items():
        for n in piece.versions:
            mine.setdefault(n, []).append(s)
    number = {(i, e.version): n for n, (i, e) in enumerate(commits)}
    for i, entries in enumerate(audited):
        label = labels[i]
        for entry in entries:
            record, ranges = entry.record, entry.record.partition_ranges()
            segments = mine.get(number[(i, entry.version)], [])
            if any(times[s] > 1 for s in segments):
                continue  # offsets ingested again after a rewinding reset: counted per offset above
            found = sum(by_table.get((s, i), 0) for s in segments)
            removed = sum(removals.within(label, p, s, e) for p, (s, e) in ranges.items())
            report.rows["deleted"] = report.rows.get("deleted", 0) + removed
            what = "quarantined" if i == quarantine else "written"
            stated = record.records.get(what, 0)
            if i == quarantine:
                report.unrouted += record.records.get("unrouted", 0)
                anywhere = sum(by_table.get((s, t), 0) for s in segments for t in range(len(tables)))
                report.offsets_without_row += (sum(e - s for s, e in ranges.values()) - anywhere
                                               - record.records.get("unrouted", 0))
            if found != stated - removed:
                p, (start, end) = min(ranges.items())
                outside = removals.outside[label]
                report.add(Discrepancy(
                    "count", p.topic, p.partition, start, end, (entry.version,),
                    f"commit {entry.version} (run {record.run_id}, {len(ranges)} partition(s)) has {found} rows in the "
                    f"table, its record says {stated} {what}" + (f" ({removed} of them deleted since by oncemore "
                                                                 "delete)" if removed else "")
                    + ("; rows were removed outside oncemore by version(s) " + ", ".join(
                        f"{v} ({op})" for v, op in outside) if outside else ""), label))


def _named(numbers, commits: list[tuple[int, CommitEntry]], labels: list[str]) -> list[tuple[str, int]]:
    return [(labels[commits[n][0]], commits[n][1].version) for n in numbers]


def _which(versions: list[tuple[str, int]]) -> str:
    return ", ".join(f"{label} version {v}" for label, v in versions)

