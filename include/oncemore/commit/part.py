"""The run's side of one part of a batch: from what its tasks read and wrote to its two commits.

Shared by both ways records travel (run/jobs.py): the run calls it with the ingest tasks'
RangeResults, or with the staged RangeResults of the reading tasks and the files the sink's tasks
report (run/deltasink.py). Either way:

- per partition, the part covers the ranges read without a hole from its start (a range cut short
  by a byte budget or a newer writer schema ends it; files of ranges after the cut are deleted);
- every file is validated (exists, its size, the table's schema, offsets inside the covered range);
- every record read is accounted for: written + quarantined + filtered, none negative (a
  transform that makes two rows of one record is refused before any commit);
- a part that quarantined more than the pipeline's ``quarantine`` limit allows fails before any
  commit, its files deleted (share.py), unless the run accepts it;
- the quarantine table commits first; the main commit, which moves positions over quarantined
  records too, is made only once the quarantine table holds its part of the range (this part's
  commit, or another run's of the same records); otherwise the part is discarded and the batch
  goes round from the positions as they are (``quarantine_behind``);
- files offered to no commit, or to one refused before any attempt, are deleted; after a commit
  attempt they are never deleted (an attempt that seemed to fail may have landed).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from oncemore.commit.committer import CommitOutcome, commit, covered_prefix, delete_files, validate_files
from oncemore.commit.copyonwrite import ClusterRewrite
from oncemore.commit.inputs import CHANGES_TAG, Part, RangeResult
from oncemore.commit.merge import Changes, apply, describe_counts, reduce_changes
from oncemore.commit.share import Reason, commonest, describe_records, judge, records_read
from oncemore.core import crashpoints, hours
from oncemore.core.columns import (MAIN_TAG, OFFSET_COLUMN, PARTITION_COLUMN, QUARANTINE_SCHEMA, QUARANTINE_TAG,
                                   TOPIC_COLUMN, change_schema)
from oncemore.core.coordinates import KafkaPartition, by_text, from_text, nested
from oncemore.core.errors import CommitConflict, InvalidDataFile, QuarantineExceeded
from oncemore.core.stopwatch import RUN_PHASES, TASK_PHASES, Stopwatch
from oncemore.core.storage import filesystem
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.write.files import DataFile

log = logging.getLogger("oncemore")


@dataclass(frozen=True)
class Written:
    """What the tasks that write the main table did, per partition (the fused path's are in its
    RangeResults): main files, quarantine files of rows failing an expectation, and the counts
    of rows written and failing each expectation (those below the quarantine floor included)."""

    files: tuple[DataFile, ...] = ()
    violations: Mapping[str, int] = field(default_factory=dict)  # {expectation: rows}
    violations_by_partition: Mapping[KafkaPartition, int] = field(default_factory=dict)
    hours: Mapping[str, list[int]] = field(default_factory=dict)  # core/hours.py: rows written and quarantined
    write_seconds: float = 0.0  # task time writing them


@dataclass(frozen=True)
class PartOutcome:
    status: str  # committed | already_committed | lost_race | conflict | quarantine_behind | nothing_read
    version: int | None
    quarantine_version: int | None
    read: Mapping[KafkaPartition, tuple[int, int]]
    records: Mapping[str, int]  # written, quarantined, filtered (with routes, unrouted)
    bytes_read: int
    schema_ahead: str | None  # the record whose writer schema the reader lacks (inputs.AheadRecord as text)
    profile: Mapping[str, int] = field(default_factory=dict)  # {phase: ms} of this part (core/stopwatch.py)
    quarantine_accepted: bool = False  # over the quarantine limit, committed because the run accepts it
    # What this part's own commits added, by table ("main", "quarantine"): {rows, bytes, files} of
    # the files committed; a MERGE's main commit: {rows} inserted or updated (delta-rs writes its files).
    added: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    versions: Mapping[str, int] = field(default_factory=dict)  # with routes: by tag, the versions this part committed

    def to_json(self) -> str:
        data = asdict(self)
        data["read"] = by_text(self.read)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "PartOutcome":
        data = json.loads(text)
        data["read"] = {k: tuple(v) for k, v in from_text(data["read"]).items()}
        return cls(**data)


def commit_part(part: Part, results: Iterable[RangeResult], written: Written, table_schemas: pa.Schema | Mapping[str, pa.Schema],
                storage_options: Mapping[str, str] | None = None, ledgers: Mapping[str, Ledger] | None = None,
                cluster: ClusterRewrite | None = None) -> PartOutcome:
    """Validates and commits one part (module docstring). ``table_schemas``: the data tables'
    schemas by tag (one schema: the main table's). ``ledgers``: the tables' ledgers by tag, of a
    caller that keeps them (their snapshots are then only updated). ``cluster``: an upsert's
    MERGE on the cluster (``upsert.merge: cluster``, merge.py), given by a caller holding Spark."""
    schemas = table_schemas if isinstance(table_schemas, Mapping) else {MAIN_TAG: table_schemas}
    ledgers = ledgers or {tag: Ledger(uri, part.pipeline, storage_options) for tag, uri in part.tables().items()}
    watch = Stopwatch()
    watch.add_ms({"spark_job": int(time.time() * 1000) - part.started_ms})
    crashpoints.reach("written")
    ends, kept, dropped = covered_prefix(results, part.starts)
    for phase in TASK_PHASES:
        watch.seconds[phase] += sum(r.seconds.get(phase, 0.0) for r in kept)
    watch.seconds["write"] += written.write_seconds
    _delete(part, [f for r in dropped for f in r.files], storage_options)
    read = {p: (part.starts[p], ends[p]) for p in part.starts}
    files = [f for r in kept for f in r.files] + list(written.files)
    by_table = {tag: [f for f in files if f.table == tag] for tag in [*part.tables(), CHANGES_TAG]}
    quarantine_files, change_files = by_table[QUARANTINE_TAG], by_table[CHANGES_TAG]
    data_files = [f for tag, found in by_table.items() if tag not in (QUARANTINE_TAG, CHANGES_TAG) for f in found]
    schema_ahead = next((r.schema_ahead for r in kept if r.schema_ahead is not None), None)
    with watch.timing("validate"):
        for route in part.routes:
            validate_files(route.table_uri, by_table[route.tag], schemas[route.tag], route.partition_by,
                           route.ranges(read), storage_options)
        if part.table_uri is not None:
            validate_files(part.table_uri, by_table[MAIN_TAG], schemas[MAIN_TAG], part.partition_by, read,
                           storage_options)
        validate_files(part.quarantine_uri, quarantine_files, QUARANTINE_SCHEMA, (), read, storage_options)
        validate_files(part.changes_uri, change_files, change_schema(schemas.get(MAIN_TAG)), (), read, storage_options)
    counted = _accounted(part, kept, data_files + change_files, written, read)
    # A quarantine table that holds every record the part quarantined (no file of them is left to
    # commit) took them from a run that accepted the part and stopped before its other commits:
    # judging it again would hold those commits back for good.
    decided = counted["quarantined"] > 0 and not quarantine_files
    limit = replace(part.quarantine_limit, accepted=True) if decided else part.quarantine_limit
    try:
        over_limit = judge(limit, part.pipeline, part.batch_seq, read, counted,
                           lambda: _reasons(part, quarantine_files, storage_options))
    except QuarantineExceeded:
        _delete(part, files, storage_options)  # offered to no commit
        delete_files(part.changes_uri, change_files, storage_options)
        raise
    records = {k: v for k, v in counted.items() if k != "held"}  # a part's own count, never a commit's
    # An upsert part's events reduced before any commit: a part that cannot be applied commits nothing.
    changes = _changes(part, change_files, schemas[MAIN_TAG], storage_options) if part.upsert is not None else None
    crashpoints.reach("validated")

    added: dict[str, dict[str, int]] = {}

    def outcome_of(status: str, version: int | None, quarantine_version: int | None, bytes_read: int,
                   versions: Mapping[str, int] | None = None) -> PartOutcome:
        return PartOutcome(status, version, quarantine_version, read, records, bytes_read, schema_ahead, watch.ms(),
                           over_limit, added, dict(versions or {}))

    built_on = [part.expected] if not part.routes else [part.quarantine_expected, *(t.expected for t in part.routes)]
    if all(expected.get(p) == end for expected in built_on for p, (_, end) in read.items()):
        # Cut before its first record (a newer writer schema) with no position to record: a part
        # that read nothing still commits when it moves a position (a start at latest, a gap).
        return outcome_of("nothing_read", None, None, 0)
    record = CommitInfo(
        pipeline=part.pipeline, run_id=part.run_id, batch_seq=part.batch_seq, until=part.until,
        ranges=nested({p: [s, e] for p, (s, e) in read.items()}), records=records,
        expectations=dict(written.violations),
        gaps=[g for g in part.gaps if part.expected.get(KafkaPartition(g.topic, g.partition)) == g.start],
        topic_ids={t: part.topic_ids.get(t) for t in sorted({p.topic for p in read})}, cluster_id=part.cluster_id,
        bytes_read=sum(r.bytes_read for r in kept),
        log_end=nested({p: part.log_end[p] for p in read if p in part.log_end}),
        duration_ms=int(time.time() * 1000) - part.started_ms,
        profile={**{p: part.profile[p] for p in RUN_PHASES if p in part.profile}, **watch.ms()},
        hours=hours.merged(*(r.hours for r in kept), written.hours),
        quarantine_accepted=over_limit, judging=part.judging,
    )
    if over_limit:
        log.warning("pipeline %s: batch %d quarantined %d of its %d records, over the quarantine limit; committed "
                    "because the run accepts it (--accept-quarantine)", part.pipeline, part.batch_seq,
                    records["quarantined"], records_read(counted))
    if part.routes:
        from oncemore.commit.routed import commit_routes

        with watch.timing("commit"):
            status, versions, own = commit_routes(part, ledgers, by_table, kept, read, record, storage_options)
        added.update(own)
        log.info("pipeline %s: batch %d %s %s (%s)", part.pipeline, part.batch_seq, status,
                 ", ".join(f"{p} [{s}, {e})" for p, (s, e) in sorted(read.items())), describe_records(records))
        return outcome_of(status, None, versions.get(QUARANTINE_TAG), record.bytes_read, versions)
    main, quarantine = ledgers[MAIN_TAG], ledgers[QUARANTINE_TAG]
    main_files = by_table[MAIN_TAG]
    new_positions = {p: e for p, (_, e) in read.items()}
    quarantine_version = None
    if quarantine_files:
        touched = {KafkaPartition.parse(key) for f in quarantine_files for key in f.offsets}
        with watch.timing("commit"):
            outcome = _commit(part, quarantine, quarantine_files, {p: part.quarantine_expected.get(p) for p in touched},
                              {p: new_positions[p] for p in touched}, record)
            quarantine_version = outcome.version
            if outcome.status == "committed":
                added["quarantine"] = files_added(quarantine_files)
            held = quarantine.positions(touched)
        crashpoints.reach("quarantine_committed")
        short = {p: held[p] for p in touched if held[p] is None or held[p] < new_positions[p]}
        if short:
            log.warning("pipeline %s: the quarantine table holds %s, not the ends %s this part reached; its main "
                        "commit waits, the batch goes round from the positions as they are", part.pipeline,
                        by_text(short), by_text({p: new_positions[p] for p in short}))
            delete_files(part.table_uri, main_files, storage_options)  # never offered to a commit
            return outcome_of("quarantine_behind", None, quarantine_version, record.bytes_read)
    with watch.timing("commit"):
        if part.upsert is None:
            outcome = _commit(part, main, main_files, {p: part.expected.get(p) for p in read}, new_positions, record)
        else:
            outcome, counts = _merge(part, main, changes, {p: part.expected.get(p) for p in read}, new_positions,
                                     record, storage_options, cluster)
            records.update(counts)
    if outcome.status == "committed":
        added["main"] = (files_added(main_files) if part.upsert is None else
                         {"rows": records.get("inserted", 0) + records.get("updated", 0)})
    crashpoints.reach("main_committed")
    counted_text = describe_counts(records) if part.upsert is not None else describe_records(records)
    log.info("pipeline %s: batch %d %s %s (%s)", part.pipeline, part.batch_seq, outcome.status,
             ", ".join(f"{p} [{s}, {e})" for p, (s, e) in sorted(read.items())), counted_text)
    return outcome_of(outcome.status, outcome.version, quarantine_version, record.bytes_read)


def files_added(files: list[DataFile]) -> dict[str, int]:
    """Rows, bytes and files a commit of ``files`` adds to its table."""
    return {"rows": sum(f.num_records for f in files), "bytes": sum(f.size for f in files), "files": len(files)}


def _accounted(part: Part, kept: list[RangeResult], data_files: list[DataFile], written: Written,
               read: Mapping[KafkaPartition, tuple[int, int]]) -> dict[str, int]:
    """Per partition, the records read are rows written, quarantined, filtered, unrouted or held
    (share.OUTCOMES): never more rows than records (a transform that explodes a record is refused
    here, before any commit), and none filtered without a transform (a record the tasks' files
    lost is refused the same way)."""
    records = {p: 0 for p in read}
    quarantined, rows, other = dict(records), dict(records), dict(records)
    unrouted = held = 0
    for r in kept:
        records[r.key] += r.records
        quarantined[r.key] += r.quarantined
        other[r.key] += r.unrouted + r.held
        unrouted, held = unrouted + r.unrouted, held + r.held
    for f in data_files:
        for text, (_, _, count) in f.offsets.items():
            rows[KafkaPartition.parse(text)] += count
    for p, count in written.violations_by_partition.items():
        quarantined[p] = quarantined.get(p, 0) + count
    for p in read:
        found = rows[p] + quarantined[p] + other[p]
        if not part.may_filter and found < records[p]:
            raise InvalidDataFile(
                f"pipeline {part.pipeline}: {p} [{read[p][0]}, {read[p][1]}): {records[p]} records read, only "
                f"{rows[p]} rows written and {quarantined[p]} quarantined"
                + (f" ({other[p]} more unrouted or held by a table already)" if part.routes else "")
                + ", and no transform filters: nothing was committed", partition=str(p), records=records[p], rows=rows[p])
        if found > records[p]:
            raise InvalidDataFile(
                f"pipeline {part.pipeline}: {p} [{read[p][0]}, {read[p][1]}): {records[p]} records became {rows[p]} rows "
                f"and {quarantined[p]} quarantined: the transform made more than one row of a record; nothing was "
                "committed", partition=str(p), records=records[p], rows=rows[p])
    total = {"written": sum(rows.values()), "quarantined": sum(quarantined.values())}
    total["filtered"] = sum(records.values()) - total["written"] - total["quarantined"] - unrouted - held
    if part.routes:
        total.update(unrouted=unrouted, held=held)
    return total


def _reasons(part: Part, files: list[DataFile], storage_options: Mapping[str, str] | None) -> list[Reason]:
    """The commonest reasons among the part's quarantine rows, read from its files (rows below the
    quarantine table's position are there already, not in them)."""
    fs, root = filesystem(part.quarantine_uri, storage_options)
    columns = ["error", TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN]
    rows = [pq.read_table(f"{root}/{f.path}", columns=columns, filesystem=fs) for f in files]
    return commonest(row for t in rows for row in zip(*(t.column(c).to_pylist() for c in columns)))


def _commit(part: Part, ledger: Ledger, files, expected, new_positions, record) -> CommitOutcome:
    try:
        outcome = commit(ledger, files, expected, new_positions, part.partitions, record)
    except CommitConflict as conflict:
        if not conflict.evidence.get("attempted"):  # refused before any commit attempt: the files are ours alone
            delete_files(ledger.table_uri, files, ledger.storage_options)
        # The batch loop re-reads the positions and goes on from wherever they are now.
        log.warning("pipeline %s: %s; continuing from the new positions", part.pipeline, conflict)
        return CommitOutcome("conflict", None)
    if outcome.status == "already_committed":
        log.warning("pipeline %s: %s already holds this range (another run committed it); dropping our files",
                    part.pipeline, ledger.table_uri)
        delete_files(ledger.table_uri, files, ledger.storage_options)
    elif outcome.status == "lost_race":
        # After a commit attempt the files are left alone; vacuum(full=True) removes them.
        log.warning("pipeline %s: %s: a concurrent run committed this range first", part.pipeline, ledger.table_uri)
    return outcome


def _changes(part: Part, files: list[DataFile], table_schema: pa.Schema,
             storage_options: Mapping[str, str] | None) -> Changes:
    """The part's staged change rows, reduced to the last event per key (merge.py)."""
    fs, root = filesystem(part.changes_uri, storage_options)
    rows = [pq.read_table(f"{root}/{f.path}", filesystem=fs) for f in files]
    return reduce_changes(pa.concat_tables(rows) if rows else change_schema(table_schema).empty_table(), part.upsert,
                          part.pipeline)


def _merge(part: Part, main: Ledger, changes: Changes, expected, new_positions, record: CommitInfo,
           storage_options: Mapping[str, str] | None, cluster: ClusterRewrite | None) -> tuple[CommitOutcome, dict]:
    """The part's changes applied (merge.py): its tombstones commit, then its main MERGE."""
    tombstones = (Ledger(part.upsert.tombstones_uri, part.pipeline, storage_options)
                  if part.upsert.sequenced else None)
    try:
        outcome, counts = apply(main, tombstones, changes, part.upsert, expected, new_positions, part.partitions,
                                record, part.pipeline, cluster)
    except CommitConflict as conflict:
        log.warning("pipeline %s: %s; continuing from the new positions", part.pipeline, conflict)
        return CommitOutcome("conflict", None), {}
    if outcome.status in ("already_committed", "lost_race"):
        log.warning("pipeline %s: %s already holds this range (another run committed it)", part.pipeline,
                    main.table_uri)
    return outcome, counts


def _delete(part: Part, files: list[DataFile], storage_options: Mapping[str, str] | None) -> None:
    for table, uri in part.tables().items():
        delete_files(uri, [f for f in files if f.table == table], storage_options)
