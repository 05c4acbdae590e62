"""``oncemore verify``: the exactly-once contract audited from a pipeline's tables alone.

A routed pipeline's tables are audited together by verifyroutes.py. For the pipeline's commits
in the main table's log (every one whose commit file the log keeps;
``since`` limits item 3 to the commits from that version on), it checks:
1. history: per partition, each batch starts where the one before ended, or at the end of a gap
   that batch records, or where a reset put the partition, and a reset moved it from where the
   history had left it; the snapshot's positions are where the last batch or reset left each
   partition;
2. rows: every row of the main and the quarantine table lies in a committed range, and no
   (topic, partition, offset) is in the tables more often than committed ranges cover it (once;
   twice where a reset rewound the partition and the offsets were ingested again). A quarantine
   row at or past the main table's position is *pending*, not a fault: a batch's quarantine
   commit lands before its main commit, and the batch's next run commits the rest;
3. counts: per commit, its rows in the main table and in the quarantine table are what its record
   says it wrote and quarantined, less the rows a deletion recorded removing since (``oncemore
   delete``). Its other offsets held records a transform filtered (counted in the record) or no
   record at all (transaction markers, aborted transactions, compaction). A count that differs is
   named by the partition and offsets Kafka still holds and neither table does, and by the
   commits that removed rows without an oncemore record (another writer's DELETE, MERGE, ...).

An upsert table holds one row per key, not a row per record: item 3 is upserts.py's instead (no key
on two rows; each commit's record accounts for every record of its ranges), and ``replay`` reads
the committed ranges again from Kafka and compares the table with them key by key (replay.py).

Invariants: it reads the ``_kafka_*`` columns of the files the snapshots list (an upsert table's
key columns too, and for a replay its rows), on Spark (tablescan.py), so compaction and vacuum
(files rewritten, rows and positions unchanged) never change its verdict, and it writes nothing
(a replay's tasks hand their counts back through a staging directory, removed at the end). The
main table's snapshot is read first: a batch committing meanwhile adds quarantine rows past the
main position (pending), never main rows.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

from oncemore.config.model import Pipeline
from oncemore.config.values import ConfigError
from oncemore.core.coordinates import KafkaPartition, flat
from oncemore.core.errors import OncemoreError
from oncemore.plan.commitinfo import CommitEntry
from oncemore.plan.ledger import Ledger
from oncemore.report.history import Piece, Removals, coverage, deleted_spans, scan_tasks, snapshot_files
from oncemore.report.verdict import EXAMPLES, Discrepancy, VerifyReport
from oncemore.run.session import register_source, slots

if TYPE_CHECKING:  # tablescan imports PySpark: the oncemore page reads results without it
    from oncemore.report.tablescan import Coverage


class NothingToVerify(OncemoreError):
    pass


def verify(pipeline: Pipeline, spark_factory, since: int | None = None, replay: bool = False) -> VerifyReport:
    """Audits ``pipeline``'s tables (module docstring); ``spark_factory()`` gives the session.
    ``replay`` (an upsert table's): also compares the table with its committed ranges read again."""
    if replay and pipeline.upsert is None:
        raise ConfigError(pipeline.origin, "upsert", "verify --replay compares an upsert table with its change "
                                                     "events; this pipeline appends (verify without --replay audits it)")
    if pipeline.routes is not None:
        from oncemore.report.verifyroutes import verify_routes

        return verify_routes(pipeline, spark_factory, since)
    options = pipeline.sink.storage_options
    main = Ledger(pipeline.sink.table_uri, pipeline.name, options)
    table = main.snapshot()
    if table is None:
        raise NothingToVerify(f"pipeline {pipeline.name}: no table at {pipeline.sink.table_uri} yet")
    quarantine = Ledger(pipeline.sink.quarantine_uri, pipeline.name, options)
    quarantine_table = quarantine.snapshot()
    kept = main.kept_versions(table)
    history = sorted(main.recent_batches(None, table), key=lambda e: e.version)
    audited = [e for e in history if since is None or e.version >= since]
    whole_log = bool(kept) and kept[0] == 0
    report = VerifyReport(pipeline.name, table.version(), quarantine_table.version() if quarantine_table else None,
                          len(audited), since, whole_log)

    left = _walk(history, report)
    held = main.positions(left, table)
    for p, (position, version) in sorted(left.items()):
        if position is not None and held[p] != position:
            report.add(Discrepancy("position", p.topic, p.partition, min(position, held[p] or 0),
                                   max(position, held[p] or 0), (version,),
                                   f"the snapshot holds position {held[p]}, the last commit left {position}"))

    topics = {p.topic for e in history for p in e.record.partition_ranges()} | set(pipeline.source.topic_names or ())
    pieces, covered = coverage(history, held, whole_log, topics)
    replaying = None
    if replay:
        from oncemore.report.replay import replayable

        replaying = replayable(pipeline, pieces)  # before a file is read: the ranges must all be in Kafka still
    files = snapshot_files(False, table, pipeline.sink.table_uri)
    removals = Removals({"main": deleted_spans(history), "quarantine": {}},
                        {"main": main.rows_removed_outside(table), "quarantine": []})
    if quarantine_table is not None:
        files += snapshot_files(True, quarantine_table, pipeline.sink.quarantine_uri)
        removals.deleted["quarantine"] = deleted_spans(quarantine.recent_batches(None, quarantine_table))
        removals.outside["quarantine"] = quarantine.rows_removed_outside(quarantine_table)
    per_piece = _audit_rows(spark_factory(), files, covered, pieces, audited, pipeline, removals, report) if files else {}
    if pipeline.upsert is not None:
        from oncemore.report.upserts import audit_upserts

        audit_upserts(pipeline, spark_factory, table, [f for f in files if not f[0]], covered, pieces, per_piece,
                      audited, removals, report, replaying)
    return report


def _walk(history: list[CommitEntry], report: VerifyReport) -> dict[KafkaPartition, tuple[int | None, int]]:
    """Checks each partition's batches follow on (history, item 1); where each partition was left,
    by which version."""
    left: dict[KafkaPartition, tuple[int | None, int]] = {}
    for entry in history:
        record, version = entry.record, entry.version
        if record.reset is not None:
            # A reset's record says where it moved each partition from: the history must agree,
            # or the record passes a rewind off as deliberate that never was. From no position is
            # what a reset after expired txn actions states (the snapshot it committed on held none).
            for p, was in sorted(flat(record.reset.from_positions).items()):
                position, previous = left.get(p, (was, None))
                if was is not None and was != position:
                    report.add(Discrepancy("history", p.topic, p.partition, min(was or 0, position),
                                           max(was or 0, position), (previous, version),
                                           f"reset {version} says it moved the partition from {was}, where commit "
                                           f"{previous} left it at {position}"))
            for p, to in flat(record.reset.to_positions).items():
                left[p] = (to, version)
        for p, (start, end) in sorted(record.partition_ranges().items()):
            position, previous = left.get(p, (None, None))
            skipped = any((g.topic, g.partition, g.start, g.end) == (p.topic, p.partition, position, start)
                          for g in record.gaps)
            if position is not None and start != position and not skipped:
                report.add(Discrepancy("history", p.topic, p.partition, min(start, position), max(start, position),
                                       (previous, version), f"commit {version} starts at {start}, where commit "
                                                            f"{previous} left the partition at {position}"))
            left[p] = (end, version)
    return left


def _audit_rows(spark, files, covered: Coverage, pieces: dict[int, Piece], audited: list[CommitEntry],
                pipeline: Pipeline, removals: Removals, report: VerifyReport) -> dict:
    """Item 2 over the scanned coordinates, and an append's item 3; the rows per piece (by segment:
    main, rows, offsets, most)."""
    from pyspark.sql import functions as F

    from oncemore.report.tablescan import BEFORE, FOREIGN, OUTSIDE, PENDING, CoordinatesDataSource

    register_source(spark, CoordinatesDataSource)
    tasks = scan_tasks(files, slots(spark))
    reader = spark.read.format(CoordinatesDataSource.name()).option("files", json.dumps(tasks)).option("coverage", covered.to_json())
    for key, value in (pipeline.sink.storage_options or {}).items():
        reader = reader.option(f"storage.{key}", value)
    rows = reader.load()
    per_offset = rows.groupBy("segment", "topic", "partition", "offset").agg(
        F.count(F.lit(1)).alias("n"), F.sum(F.when(F.col("quarantine"), 0).otherwise(1)).alias("main"))
    per_piece = {r["segment"]: r for r in per_offset.groupBy("segment").agg(
        F.sum("main").alias("main"), F.sum("n").alias("rows"), F.count(F.lit(1)).alias("offsets"),
        F.max("n").alias("most")).collect()}

    def rows_of(code: int) -> int:
        return per_piece[code]["rows"] if code in per_piece else 0

    report.rows = {"main": sum(r["main"] for s, r in per_piece.items() if s >= 0),
                   "quarantine": sum(r["rows"] - r["main"] for s, r in per_piece.items() if s >= 0),
                   "pending": rows_of(PENDING), "before": rows_of(BEFORE), "foreign": rows_of(FOREIGN)}
    if rows_of(OUTSIDE):
        for r in rows.filter(F.col("segment") == OUTSIDE).orderBy("topic", "partition", "offset").limit(
                5).collect():
            report.add(Discrepancy("outside", r["topic"], r["partition"], r["offset"], r["offset"] + 1, (),
                                   f"a row in the {'quarantine' if r['quarantine'] else 'main'} table, in no "
                                   "committed range"))
        report.counts["outside"] = rows_of(OUTSIDE)

    doubled = [s for s, r in per_piece.items() if s >= 0 and r["most"] > len(pieces[s].versions)]
    if doubled:
        found = per_offset.filter(F.col("segment").isin(doubled) & (F.col("n") > 1)).orderBy(
            "topic", "partition", "offset").limit(50).collect()
        for r in [r for r in found if r["n"] > len(pieces[r["segment"]].versions)][:5]:
            piece = pieces[r["segment"]]
            report.add(Discrepancy("duplicate", r["topic"], r["partition"], r["offset"], r["offset"] + 1,
                                   piece.versions, f"in the tables {r['n']} times ({r['main']} in the main table), "
                                                   f"committed {len(piece.versions)} time(s)"))
        report.counts["duplicate"] = sum(per_piece[s]["rows"] - per_piece[s]["offsets"] for s in doubled)

    def in_tables(segments: list[int]) -> set[int]:
        """The offsets the tables hold in ``segments``."""
        return {r["offset"] for r in per_offset.filter(F.col("segment").isin(segments)).select("offset").collect()}

    if pipeline.upsert is None:
        _check_counts(audited, pieces, per_piece, removals, report,
                      lambda entry, mine: _missing(pipeline, entry, pieces, mine, in_tables))
    return per_piece


def _check_counts(audited: list[CommitEntry], pieces: dict[int, Piece], per_piece, removals: Removals,
                  report: VerifyReport, missing: Callable[[CommitEntry, list[int]], dict[KafkaPartition, list[int] | None]]
                  ) -> None:
    """Per commit whose offsets no other commit covers: rows in each table as its record says, but
    for the rows a recorded deletion removed since; where not, the partition at fault (``missing``:
    per partition, its committed offsets Kafka holds and neither table does; None where Kafka no
    longer holds the range)."""
    by_version: dict[int, list[int]] = {}
    for s, piece in pieces.items():
        for version in piece.versions:
            by_version.setdefault(version, []).append(s)
    for entry in audited:
        record = entry.record
        ranges = record.partition_ranges()
        report.filtered += record.records.get("filtered", 0)
        mine = by_version.get(entry.version, [])
        if any(len(pieces[s].versions) > 1 for s in mine):
            continue  # offsets ingested again after a rewinding reset: counted per offset above
        rows = {p: [0, 0] for p in ranges}  # per partition: main, quarantine
        for s in mine:
            if s in per_piece:
                rows[pieces[s].partition][0] += per_piece[s]["main"]
                rows[pieces[s].partition][1] += per_piece[s]["rows"] - per_piece[s]["main"]
        main, quarantined = sum(m for m, _ in rows.values()), sum(q for _, q in rows.values())
        removed = {what: sum(removals.within(what, p, s, e) for p, (s, e) in ranges.items())
                   for what in ("main", "quarantine")}
        report.rows["deleted"] = report.rows.get("deleted", 0) + sum(removed.values())
        report.offsets_without_row += sum(e - s for s, e in ranges.values()) - main - quarantined - sum(removed.values())
        wrong = [(what, found, stated, removed[what]) for what, found, stated in (
            ("main", main, record.records.get("written", 0)),
            ("quarantine", quarantined, record.records.get("quarantined", 0))) if found != stated - removed[what]]
        if not wrong:
            continue
        lost = missing(entry, mine)
        for what, found, stated, deleted in wrong:
            for discrepancy in _count_discrepancies(entry, what, found, stated, deleted, rows, lost,
                                                    removals.outside[what]):
                report.add(discrepancy)


def _count_discrepancies(entry: CommitEntry, what: str, found: int, stated: int, deleted: int, rows, lost,
                         outside: list[tuple[int, str]]) -> list[Discrepancy]:
    """A commit's count that differs from its record (less the rows recorded deletions removed),
    named by the partitions at fault, one discrepancy each with its own offsets: those Kafka holds
    and neither table does; else (Kafka no longer holds them) one naming every partition's rows
    beside its range, for a reader to compare. Commits of another writer that removed rows from
    the table are named with it."""
    record, ranges = entry.record, entry.record.partition_ranges()
    since = f" ({deleted} of them deleted since by oncemore delete)" if deleted else ""
    said = (f"commit {entry.version} (run {record.run_id}, {len(ranges)} partition(s)) has {found} rows in the {what} "
            f"table, its record says {stated}{since}")
    if outside:
        said += ("; rows were removed outside oncemore by version(s) "
                 + ", ".join(f"{v} ({operation})" for v, operation in outside))
    at_fault = sorted(p for p, offsets in lost.items() if offsets)
    if at_fault:
        filtered = "; a transform may have filtered some of them" if record.records.get("filtered") else ""
        return [Discrepancy("count", p.topic, p.partition, *ranges[p], (entry.version,),
                            f"{said}: offset(s) {_examples(lost[p])} of {p} are in Kafka and in neither table{filtered}")
                for p in at_fault]
    gone = [p for p, offsets in lost.items() if offsets is None]
    per_partition = ", ".join(f"{p} [{s}, {e}): {rows[p][0]} + {rows[p][1]} rows" for p, (s, e) in sorted(ranges.items()))
    p, (start, end) = min(ranges.items())
    why = "Kafka no longer holds the range" if gone else "every record Kafka holds is in a table"
    return [Discrepancy("count", p.topic, p.partition, start, end, (entry.version,),
                        f"{said} ({why}; main + quarantine rows per partition: {per_partition})")]


def _examples(offsets: list[int]) -> str:
    """The first EXAMPLES offsets, and how many more."""
    more = len(offsets) - EXAMPLES
    return ", ".join(map(str, offsets[:EXAMPLES])) + (f" and {more} more" if more > 0 else "")


def _missing(pipeline: Pipeline, entry: CommitEntry, pieces: dict[int, Piece], mine: list[int],
             in_tables: Callable[[list[int]], set[int]]) -> dict[KafkaPartition, list[int] | None]:
    """Per partition of a commit, the offsets of its range that hold a record in Kafka (read as a
    run reads them) and are in neither table; None where Kafka no longer holds the range or cannot
    be read."""
    from oncemore.kafka import clients

    ranges = entry.record.partition_ranges()
    try:  # asked first: reading a range Kafka no longer holds would wait out the stall timeout
        log = clients.log_bounds(clients.admin_client(pipeline), pipeline, ranges)
    except clients.KafkaSourceError:  # the topic is gone, or Kafka cannot be reached
        return {p: None for p in ranges}
    config = clients.consumer_config(pipeline)
    found: dict[KafkaPartition, list[int] | None] = {}
    for p, (start, end) in sorted(ranges.items()):
        where = f"pipeline {pipeline.name}: verify: {p}"
        if not log[p].earliest <= start <= end <= log[p].latest:
            found[p] = None
            continue
        try:
            with clients.range_consumer(config, pipeline.name) as consumer:
                held = {m.offset() for batch in clients.read_messages(consumer, p.topic, p.partition, start, end,
                                                                    pipeline.source.stall_timeout_seconds, where)
                        for m in batch}
        except (clients.KafkaReadError, clients.KafkaSourceError):
            found[p] = None
            continue
        found[p] = sorted(held - in_tables([s for s in mine if pieces[s].partition == p]))
    return found
