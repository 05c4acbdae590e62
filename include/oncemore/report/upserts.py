"""``oncemore verify`` of an upsert table (commit/merge.py), where a row is a key's latest event, not
a record: verify.py's history, positions and rows-in-committed-ranges checks hold as they are;
in place of its per-commit row counts, this module checks

- keys: no key is on two rows of the main table (named by the key and the coordinates of two of
  its rows);
- records: each commit's record accounts for its events and for every record of its ranges:
  ``written`` is the sum of merge.COUNTS (inserted, updated, deleted, noop_deletes, stale,
  superseded, tombstones), and written + quarantined + filtered is the number of records its
  ranges held: with a replay, exactly the records Kafka holds in them (replay.py counts them; on
  a compacted topic, no fewer: its cleaner may have removed some since), else no more than its
  ranges hold offsets (the rest are transaction markers, aborted records or records compaction
  removed); its quarantined records are the quarantine table's rows of its ranges, less those a
  recorded deletion removed since (as for an append).

Invariant: it reads only what the snapshots list (the key columns and coordinates of the main
table's files, on Spark) and the commits' records, and writes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pyarrow as pa

from oncemore.commit.merge import COUNTS
from oncemore.config.model import Pipeline
from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, TOPIC_COLUMN, key_columns
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.commitinfo import CommitEntry
from oncemore.report.history import File, Piece, Removals, versions_at
from oncemore.report.verdict import EXAMPLES, Discrepancy, VerifyReport

if TYPE_CHECKING:
    from oncemore.report.replay import Replayable
    from oncemore.report.tablescan import Coverage

COORDINATES = (TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN)


def audit_upserts(pipeline: Pipeline, spark_factory: Callable, table, files: list[File], covered: Coverage,
                  pieces: dict[int, Piece], per_piece: dict, audited: list[CommitEntry], removals: Removals,
                  report: VerifyReport, replay: Replayable | None) -> None:
    """The keys and records checks (module docstring) of ``table``'s snapshot and its main
    ``files``; with ``replay`` (what Kafka said of the ranges), replay.py's comparison first,
    whose counts the records check uses."""
    schema = pa.schema(table.schema().to_arrow())
    keys = key_columns(schema, pipeline.upsert.keys)
    report.rows = report.rows or {"main": 0, "quarantine": 0, "pending": 0, "before": 0, "foreign": 0}
    if files:
        _check_keys(spark_factory(), pipeline, files, schema, keys, pieces, report)
    read = None
    if replay is not None:
        from oncemore.report.replay import replay_table

        read = replay_table(spark_factory(), pipeline, table, schema, keys, files, covered, pieces, removals, report,
                            replay.compacted)
    _check_records(audited, pieces, per_piece, removals, report, read, replay.compacted if replay else frozenset())


def key_text(row, keys: list[str]) -> str:
    """A key as messages name it: ``{'id': 3}``."""
    return str({k: row[k] for k in keys})


def _check_keys(spark, pipeline: Pipeline, files: list[File], schema: pa.Schema, keys: list[str],
                pieces: dict[int, Piece], report: VerifyReport) -> None:
    from pyspark.sql import functions as F

    from oncemore.report.tablescan import table_rows

    columns = pa.schema([schema.field(c) for c in (*keys, *COORDINATES)])
    rows = table_rows(spark, files, columns, pipeline.sink.storage_options)
    at = F.struct(*COORDINATES)
    twice = rows.groupBy(*keys).agg(F.count(F.lit(1)).alias("n"), F.min(at).alias("first"),
                                    F.max(at).alias("last")).filter(F.col("n") > 1)
    found = twice.orderBy(*keys).limit(EXAMPLES).collect()
    for row in found:
        first, last = row["first"], row["last"]
        p = KafkaPartition(first[TOPIC_COLUMN], first[PARTITION_COLUMN])
        offset = first[OFFSET_COLUMN]
        report.add(Discrepancy(
            "key", p.topic, p.partition, offset, offset + 1, versions_at(pieces, p, offset),
            f"key {key_text(row, keys)} is on {row['n']} rows of the table (this one and "
            f"{last[TOPIC_COLUMN]}/{last[PARTITION_COLUMN]} offset {last[OFFSET_COLUMN]}): an upsert table holds "
            "one row per key"))
    if len(found) == EXAMPLES:
        report.counts["key"] = twice.count()


def _check_records(audited: list[CommitEntry], pieces: dict[int, Piece], per_piece, removals: Removals,
                   report: VerifyReport, read: dict[int, int] | None, compacted: frozenset[str]) -> None:
    """Per batch commit, its record against its events, its ranges and the quarantine table
    (module docstring); ``read``: the records Kafka holds per piece (a replay's), else None, of
    which the ``compacted`` topics' may hold fewer than were read."""
    by_version: dict[int, list[int]] = {}
    for s, piece in pieces.items():
        for version in piece.versions:
            by_version.setdefault(version, []).append(s)
    report.events = dict.fromkeys(COUNTS, 0)
    for entry in audited:
        record = entry.record
        ranges = record.partition_ranges()
        if record.deletion is not None:
            report.rows["deleted"] = report.rows.get("deleted", 0) + record.deletion.rows
        if record.reset is not None or record.deletion is not None or not ranges:
            continue
        faults = _record_faults(entry, by_version.get(entry.version, []), pieces, per_piece, removals, report, read,
                                any(p.topic in compacted for p in ranges))
        p, (start, end) = min(ranges.items())
        for detail in faults:
            report.add(Discrepancy("count", p.topic, p.partition, start, end, (entry.version,),
                                   f"commit {entry.version} (run {record.run_id}, {len(ranges)} partition(s)) {detail}"))


def _record_faults(entry: CommitEntry, mine: list[int], pieces: dict[int, Piece], per_piece, removals: Removals,
                   report: VerifyReport, read: dict[int, int] | None, compacts: bool) -> list[str]:
    """What is wrong with one commit's record (``mine``: the pieces of its ranges; ``compacts``: a
    topic of them is compacted); its events and offsets added to ``report``."""
    counts, ranges = entry.record.records, entry.record.partition_ranges()
    faults = []
    lacking = [c for c in COUNTS if c not in counts]
    if lacking:
        faults.append(f"records no {', '.join(lacking)}: it does not say what its events did")
    for name in COUNTS:
        report.events[name] += counts.get(name, 0)
    events = sum(counts.get(c, 0) for c in COUNTS)
    written, quarantined, filtered = (counts.get(c, 0) for c in ("written", "quarantined", "filtered"))
    report.filtered += filtered
    if written != events:
        faults.append(f"wrote {written} change row(s), its events add up to {events} ("
                      + ", ".join(f"{counts.get(c, 0)} {c}" for c in COUNTS) + ")")
    offsets = sum(e - s for s, e in ranges.values())
    accounted = written + quarantined + filtered
    held = sum(read.get(s, 0) for s in mine) if read is not None else None
    sums = f"accounts for {accounted} record(s) ({written} written + {quarantined} quarantined + {filtered} filtered)"
    if accounted > offsets:
        faults.append(f"{sums}, more than its ranges hold offsets ({offsets})")
    elif held is not None and (accounted < held or (accounted > held and not compacts)):
        faults.append(f"{sums}, Kafka holds {held} in its ranges")
    elif held is not None:  # fewer: records the cleaner removed since
        report.replayed["compacted"] += accounted - held
    report.offsets_without_row += max(offsets - (held if held is not None else accounted), 0)
    if any(len(pieces[s].versions) > 1 for s in mine):
        return faults  # offsets ingested again after a rewinding reset: counted per offset by verify.py
    found = sum(per_piece[s]["rows"] - per_piece[s]["main"] for s in mine if s in per_piece)
    removed = sum(removals.within("quarantine", p, s, e) for p, (s, e) in ranges.items())
    report.rows["deleted"] = report.rows.get("deleted", 0) + removed
    if found != quarantined - removed:
        since = f" ({removed} of them deleted since by oncemore delete)" if removed else ""
        outside = removals.outside["quarantine"]
        faults.append(f"has {found} rows in the quarantine table, its record says {quarantined}{since}"
                      + ("; rows were removed outside oncemore by version(s) "
                         + ", ".join(f"{v} ({operation})" for v, operation in outside) if outside else ""))
    return faults


def replay_discrepancy(row, keys: list[str], pieces: dict[int, Piece], removals: Removals) -> Discrepancy:
    """A key that differs from the replay, placed at the replay's event (the table's row for an extra one)."""
    at = "t" if row["status"] == "extra" else "r"
    p = KafkaPartition(row[f"{at}{TOPIC_COLUMN}"], row[f"{at}{PARTITION_COLUMN}"])
    offset = row[f"{at}{OFFSET_COLUMN}"]
    key = key_text(row, keys)
    table_at = f"{row[f't{TOPIC_COLUMN}']}/{row[f't{PARTITION_COLUMN}']} offset {row[f't{OFFSET_COLUMN}']}"
    if row["status"] == "different":
        detail = (f"key {key}: the table's row (from {table_at}) differs from the replay's (from this event) in "
                  f"{', '.join(row['differing'])}")
    elif row["status"] == "missing":
        detail = f"key {key}: the replay's row (from this event) is not in the table"
    else:
        by = "the replay" if row["seed"] is None else "a newer delete the tombstones table holds"
        deletes = (f"{by} deletes the key ({row[f'r{TOPIC_COLUMN}']}/{row[f'r{PARTITION_COLUMN}']} offset "
                   f"{row[f'r{OFFSET_COLUMN}']})" if row["change"] is not None else "no replayed event has the key")
        detail = f"key {key}: the table holds a row (from this event) that the replay does not: {deletes}"
    outside = removals.outside["main"]
    if outside:
        detail += "; the table was changed outside oncemore by version(s) " + ", ".join(
            f"{v} ({operation})" for v, operation in outside)
    return Discrepancy("replay", p.topic, p.partition, offset, offset + 1, versions_at(pieces, p, offset), detail)
