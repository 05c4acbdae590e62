"""``oncemore verify --replay`` of an upsert table: its committed ranges read again from Kafka through
Spark as a run reads them (its reading tasks, shape/changes.py's change rows), folded to the last
event per key in the pipeline's order, and compared with the table key by key (every column the
replay has: the row's, the sequence and the coordinates).

Order: with ``sequence_by``, the greatest (sequence, topic, partition, offset); without, the
commit that applied the event (the last one covering its offset, after a rewinding reset), then
its coordinates: the MERGE's order, where an event of a later part is newer. A delete removes its
key, and so does a tombstone without ``sequence_by``; with it a tombstone deletes the key's winner
when that came from the tombstone's partition at a lower offset. A placeholder takes the value of
its key's event before it (fold.py). Records that cannot be applied (quarantined) are ignored.
After an accepted change of sequence_by (``oncemore resequence``), the events of commits before it
are not folded: the rows they left are weighed as the table holds them, as rows of commits the
log no longer keeps are.

With ``sequence_by`` an event never wins over a newer state the tables hold from outside the
replayed events, as it did not in the MERGE: the fold is seeded, per key, with (1) the table's row
where no replayed event has its coordinates (a row of a commit the log no longer keeps, or in no
committed range, or on a compacted topic one whose record the cleaner removed since), as an upsert
of its sequence and coordinates, and (2) the tombstones table's deletes that the main table's
snapshot holds (a delete at or past the main position is a batch's whose main commit is still to
come), as deletes of theirs. A seed at the coordinates of a replayed event of its key is that
event and is left out: a row another tool changed in place keeps its coordinates and is compared
with its event. Without ``sequence_by`` a replayed event is newer than any row of a commit the log
no longer keeps (an older commit), and a compacted topic's cleaner keeps the last record by
offset, which is the one applied: nothing is seeded.

Each key is then ``same``; ``different`` (the columns that differ named); ``missing`` (the replay
has a row, the table none); ``extra`` (the table has a row the replay deletes, a held delete
newer than it included, or one of a key no replayed event has); ``deleted_since`` (a row ``oncemore
delete`` recorded removing); or ``unreplayed`` (the fold's winner is the table's own row, seeded;
without ``sequence_by``, a row of a commit the log no longer keeps, or in no committed range,
which verify.py names, that no replayed event touches). The first three are discrepancies. A key
whose winner is a held delete and that the table does not hold is consistent and counted nowhere.

Schema evolution: a row is compared as its commit could have written it (epochs.py).

Invariants: every committed range is read whole, or the replay fails naming it
(ReplayImpossible): Kafka's log no longer holds it (asked before anything is read), or a record
could not be decoded by the reader schema. A compacted topic's cleaner may have removed records of
a range since a run read them: its commits may account for more records than the replay reads.
The replay writes no table file (its quarantine floors lie past every range); its tasks' counts
come back through a staging directory of the quarantine table's, removed at the end. Under
``sequence_by``, a delete that maintenance forgot (older than ``tombstone_retention_hours``) no
longer holds against a late event: the table may then hold a key the replay deletes, named as
extra. A seeded row is taken as the table holds it: a row of a commit the log no longer keeps (or
whose record a compacted topic's cleaner removed) that another tool changed is beyond the replay,
as its event is.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import reduce

import pyarrow as pa
from confluent_kafka import KafkaException

from oncemore.commit.inputs import RangeResult
from oncemore.config.model import Pipeline
from oncemore.core.columns import (
    CHANGE_COLUMN,
    OFFSET_COLUMN,
    PARTITION_COLUMN,
    SEQUENCE_COLUMN,
    TOPIC_COLUMN,
    key_columns,
)
from oncemore.core.coordinates import KafkaPartition, OffsetRange
from oncemore.core.errors import OncemoreError
from oncemore.plan.ledger import Ledger, open_table
from oncemore.report.epochs import as_written, schema_epochs
from oncemore.report.fold import SEED, last_events
from oncemore.report.history import File, Piece, Removals, snapshot_files
from oncemore.report.tablescan import Coverage, table_rows
from oncemore.report.upserts import replay_discrepancy
from oncemore.report.verdict import EXAMPLES, VerifyReport
from oncemore.run.session import slots
from oncemore.run.staging import Staging

RECORDS_PER_TASK = 1_000_000  # offsets a replay task reads, at least one task per slot
BEYOND = 1 << 62  # a byte budget and a quarantine floor no range reaches
STATUSES = ("same", "different", "missing", "extra", "deleted_since", "unreplayed")
FAULTS = ("different", "missing", "extra")
COORDINATES = (TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN)


class ReplayImpossible(OncemoreError):
    """A committed range cannot be read again whole: Kafka no longer holds it, or cannot say."""


@dataclass(frozen=True)
class Replayable:
    """What Kafka said before a replay: every committed range is in its log; ``compacted``, the
    topics whose cleaner may have removed records of them since they were read."""

    compacted: frozenset[str]


def replayable(pipeline: Pipeline, pieces: dict[int, Piece]) -> Replayable:
    """Raises ReplayImpossible naming the first committed range Kafka's log no longer holds."""
    from oncemore.kafka import clients

    where = f"pipeline {pipeline.name}: verify --replay"
    partitions = {piece.partition for piece in pieces.values()}
    admin = clients.admin_client(pipeline)
    try:
        log = clients.log_bounds(admin, pipeline, partitions)
        compacted = _compacted(admin, pipeline, {p.topic for p in partitions})
    except (clients.KafkaSourceError, KafkaException) as exc:
        raise ReplayImpossible(f"{where}: Kafka cannot say what it holds of the committed ranges ({exc}); verify "
                               "without --replay audits the tables alone") from None
    for piece in sorted(pieces.values(), key=lambda x: (x.partition, x.start)):
        held = log[piece.partition]
        if piece.start < held.earliest or piece.end > held.latest:
            raise ReplayImpossible(
                f"{where}: {piece.partition} offsets [{piece.start}, {piece.end}), committed by version(s) "
                f"{', '.join(map(str, piece.versions))}, are no longer all in Kafka (its log holds "
                f"[{held.earliest}, {held.latest})): the table cannot be replayed; verify without --replay audits the "
                "tables alone", topic=piece.partition.topic, partition=piece.partition.partition, start=piece.start,
                end=piece.end, log_start=held.earliest, log_end=held.latest, versions=list(piece.versions))
    return Replayable(compacted)


def _compacted(admin, pipeline: Pipeline, topics: set[str]) -> frozenset[str]:
    """The ``topics`` whose ``cleanup.policy`` compacts."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    if not topics:
        return frozenset()
    asked = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in sorted(topics)])
    return frozenset(resource.name for resource, future in asked.items()
                     if "compact" in future.result(timeout=pipeline.source.stall_timeout_seconds)["cleanup.policy"].value)


def replay_table(spark, pipeline: Pipeline, table, schema: pa.Schema, keys: list[str], files: list[File],
                 covered: Coverage, pieces: dict[int, Piece], removals: Removals, report: VerifyReport,
                 compacted: frozenset[str] = frozenset()) -> dict[int, int]:
    """Compares the table (``files`` of its snapshot ``table``, in ``schema``) with its replay
    (module docstring; ``compacted``: the topics whose cleaner may have removed records), the
    keys that differ added to ``report``; the records Kafka holds per piece."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    staging_id = f"verify-{uuid.uuid4().hex}"
    staging = Staging(pipeline.sink.quarantine_uri, staging_id, pipeline.sink.storage_options)
    try:
        changes = _changes(spark, pipeline, schema, pieces, staging_id)
        sequenced = pipeline.upsert.sequence_by is not None
        # Events of commits before an accepted change of sequence_by were ordered by the old one:
        # the rows they left are weighed as the table holds them (sequences cleared), not replayed.
        horizon = max((e.version for e in Ledger(pipeline.sink.table_uri, pipeline.name, pipeline.sink.storage_options)
                       .recent_batches(None, table) if e.record.resequence is not None), default=-1)
        seeds = _seeds(spark, pipeline, table, schema, keys, files, covered, pieces, removals,
                       compacted, horizon) if sequenced else None
        placed = _placed(changes, covered, pieces, removals).filter(F.col("_version") > horizon)
        last = last_events(placed, keys, sequenced, seeds, pipeline.upsert.unavailable_value_placeholder)
        rows = _placed(table_rows(spark, files, schema, pipeline.sink.storage_options), covered, pieces, removals)
        compared = _compared(rows, last, schema, keys, changes.columns,
                             schema_epochs(pipeline, table, schema), horizon).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            found = {r["status"]: r["count"] for r in compared.groupBy("status").count().collect()}
            read = _records_read(staging, pieces, pipeline)
            report.replayed = {"records": sum(read.values()), **{s: found.get(s, 0) for s in STATUSES},
                               "compacted": 0}  # upserts.py: records the commits accounted for, gone since
            for status in FAULTS:
                if found.get(status):
                    shown = compared.filter(F.col("status") == status).orderBy(*keys).limit(EXAMPLES).collect()
                    for row in shown:
                        report.add(replay_discrepancy(row, keys, pieces, removals))
            if any(found.get(s) for s in FAULTS):
                report.counts["replay"] = sum(found.get(s, 0) for s in FAULTS)
        finally:
            compared.unpersist()
    finally:
        staging.remove()
    return read


def _changes(spark, pipeline: Pipeline, schema: pa.Schema, pieces: dict[int, Piece], staging_id: str):
    """The change rows of every piece's records, read by the reading tasks as a run reads them."""
    from oncemore.decode.resolve import registries, resolve
    from oncemore.run.jobs import reading_options
    from oncemore.run.kafkasource import records_frame, records_schema
    from oncemore.run.prepare import task_spec
    from oncemore.shape.changes import change_rows

    partitions = {piece.partition for piece in pieces.values()}
    settings = registries(pipeline)
    spec = task_spec(pipeline, resolve(pipeline, sorted({p.topic for p in partitions})), schema,
                     dict.fromkeys(partitions, BEYOND), settings)
    options = {**reading_options(pipeline, spec, _tasks(pieces, slots(spark)), BEYOND), "staging": staging_id}
    return change_rows(records_frame(spark, options, records_schema(spec)), pipeline)


def _tasks(pieces: dict[int, Piece], slots: int) -> list[list[OffsetRange]]:
    """The pieces as the reading tasks' ranges: about as many as slots, or RECORDS_PER_TASK
    offsets each, whichever is more, by size; each task's ranges in partition order."""
    total = sum(p.end - p.start for p in pieces.values())
    count = min(len(pieces), max(slots, -(-total // RECORDS_PER_TASK)))
    tasks: list[list[Piece]] = [[] for _ in range(count)]
    load = [0] * count
    for piece in sorted(pieces.values(), key=lambda p: p.start - p.end):
        lightest = load.index(min(load))
        tasks[lightest].append(piece)
        load[lightest] += piece.end - piece.start
    return [[OffsetRange(p.partition.topic, p.partition.partition, p.start, p.end)
             for p in sorted(task, key=lambda p: (p.partition, p.start))] for task in tasks if task]


def _placed(frame, covered: Coverage, pieces: dict[int, Piece], removals: Removals):
    """``frame`` with, from its coordinates: ``_piece`` (its piece of committed history; negative:
    none), ``_version`` and ``_first`` (the last and the first commit covering it) and
    ``_deleted`` (a recorded deletion of the main table removed it)."""
    from pyspark.sql.types import BooleanType, LongType, StructField, StructType

    coverage = covered.to_json()
    versions = [max(pieces[s].versions) for s in range(len(pieces))]
    firsts = [min(pieces[s].versions) for s in range(len(pieces))]
    spans = {str(p): _merged(runs) for p, runs in removals.deleted["main"].items()}

    def place(batches):
        import numpy as np

        known = Coverage.from_json(coverage)
        version_of, first_of = (np.asarray(v + [0], dtype=np.int64) for v in (versions, firsts))
        for batch in batches:
            where = pa.table({"t": batch.column(TOPIC_COLUMN), "p": batch.column(PARTITION_COLUMN)})
            topics, partitions = (where.column(c).to_numpy() for c in ("t", "p"))  # strings as objects
            offsets = batch.column(OFFSET_COLUMN).to_numpy(zero_copy_only=False).astype(np.int64)
            piece, deleted = np.full(len(offsets), -1, dtype=np.int64), np.zeros(len(offsets), dtype=bool)
            for group in where.group_by(["t", "p"]).aggregate([]).to_pylist():
                topic, partition = group["t"], group["p"]
                at = np.flatnonzero((topics == topic) & (partitions == partition))
                piece[at] = known.segments_of(topic, partition, offsets[at], False)
                runs = np.asarray(spans.get(f"{topic}/{partition}", []), dtype=np.int64).reshape(-1, 2)
                if len(runs):
                    inside = np.searchsorted(runs[:, 0], offsets[at], side="right") - 1
                    deleted[at] = (inside >= 0) & (offsets[at] < runs[np.maximum(inside, 0), 1])
            version = pa.array(version_of[np.maximum(piece, 0)], mask=piece < 0)
            first = pa.array(first_of[np.maximum(piece, 0)], mask=piece < 0)
            yield pa.RecordBatch.from_arrays([*batch.columns, pa.array(piece), version, first, pa.array(deleted)],
                                             names=[*batch.schema.names, "_piece", "_version", "_first", "_deleted"])

    placed = [StructField("_piece", LongType()), StructField("_version", LongType()), StructField("_first", LongType()),
              StructField("_deleted", BooleanType())]
    return frame.mapInArrow(place, StructType([*frame.schema.fields, *placed]))


def _merged(runs: list[tuple[int, int]]) -> list[list[int]]:
    """Spans [start, end) sorted and joined where they touch or overlap."""
    merged: list[list[int]] = []
    for start, end in sorted(runs):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _seeds(spark, pipeline: Pipeline, table, schema: pa.Schema, keys: list[str], files: list[File],
           covered: Coverage, pieces: dict[int, Piece], removals: Removals, compacted: frozenset[str],
           horizon: int = -1):
    """Under sequence_by, the states the tables hold from outside the replayed events (module
    docstring), in ``keys``, the order's columns, the change and SEED; None: none."""
    from pyspark.sql import functions as F

    options = pipeline.sink.storage_options
    order = [SEQUENCE_COLUMN, *COORDINATES]
    found = []
    if files:
        # With the columns a placeholder can take: a later event's placeholder takes the row's value.
        carried = [f.name for f in schema if f.name not in (*keys, *order) and not f.name.startswith("_")
                   and (pa.types.is_string(f.type) or pa.types.is_binary(f.type) or pa.types.is_list(f.type))]
        rows = _placed(table_rows(spark, files, pa.schema([schema.field(c) for c in (*keys, *order, *carried)]),
                                  options), covered, pieces, removals)
        # Rows no replayed event can be: of no piece; on a compacted topic, any (the fold leaves
        # out a seed at its event's coordinates).
        unreplayed = (F.col("_piece") < 0) | F.coalesce(F.col("_version") <= horizon, F.lit(False))
        if compacted:
            unreplayed = unreplayed | F.col(TOPIC_COLUMN).isin(sorted(compacted))
        found.append(rows.filter(unreplayed).select(*keys, *order, *carried, F.lit("upsert").alias(CHANGE_COLUMN),
                                                    F.lit("row").alias(SEED)))
    held = open_table(pipeline.sink.tombstones_uri, options)
    deletes = snapshot_files(False, held, pipeline.sink.tombstones_uri) if held is not None else []
    if deletes:
        held_schema = pa.schema(held.schema().to_arrow())
        names = key_columns(held_schema, pipeline.upsert.keys)
        kept = table_rows(spark, deletes, pa.schema([held_schema.field(c) for c in (*names, *order)]), options)
        partitions = sorted(KafkaPartition(r[TOPIC_COLUMN], r[PARTITION_COLUMN])
                            for r in kept.select(TOPIC_COLUMN, PARTITION_COLUMN).distinct().collect())
        # A delete at or past the main table's position is of a batch whose main commit is to come
        # (the tombstones commit lands first; a run may be committing, or crashed between the two).
        positions = {str(p): v for p, v in Ledger(pipeline.sink.table_uri, pipeline.name, options).positions(
            partitions, table).items() if v is not None}
        if positions:
            position = F.create_map(*[F.lit(x) for p, v in sorted(positions.items()) for x in (p, v)])[
                F.concat_ws("/", F.col(TOPIC_COLUMN), F.col(PARTITION_COLUMN).cast("string"))]
            found.append(kept.filter(F.col(OFFSET_COLUMN) < position).select(
                *[F.col(n).alias(k) for n, k in zip(names, keys)], *order, F.lit("delete").alias(CHANGE_COLUMN),
                F.lit("tombstone").alias(SEED)))
    return reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), found) if found else None


def _compared(table, last, schema: pa.Schema, keys: list[str], replayed: list[str],
              epochs: list[tuple[int, tuple]] | None = None, horizon: int = -1):
    """The table's rows and the replay's last events joined by key, each with its ``status``
    (module docstring) and ``differing``, the columns whose values differ; ``epochs`` (_epochs):
    the table's schema by version, where it changed."""
    from pyspark.sql import functions as F

    names = {c.lower() for c in replayed}
    columns = [f.name for f in schema if f.name not in keys and f.name.lower() in names]
    types = {f.name: f.dataType for f in table.schema.fields}
    t, r = table.alias("t"), last.alias("r")

    def comparable(column, name):
        cast = column.cast(types[name])
        return F.to_json(cast) if "map<" in types[name].simpleString() else cast

    def equal_in(name):
        mine, theirs = comparable(F.col(f"t.`{name}`"), name), F.col(f"r.`{name}`").cast(types[name])
        same_now = mine.eqNullSafe(comparable(theirs, name))
        then = as_written(theirs, name, types[name], epochs or [], F.col("t._first"))
        return same_now if then is None else same_now | mine.eqNullSafe(comparable(then, name))

    equal = {c: equal_in(c) for c in columns}
    joined = t.join(r, reduce(lambda a, b: a & b, [F.col(f"t.`{k}`") == F.col(f"r.`{k}`") for k in keys]), "full_outer")
    in_table, in_replay = F.col(f"t.{TOPIC_COLUMN}").isNotNull(), F.col(f"r.{CHANGE_COLUMN}").isNotNull()
    seed = F.col(f"r.{SEED}")
    live = F.coalesce((F.col(f"r.{CHANGE_COLUMN}") == "upsert") & seed.isNull(), F.lit(False))
    same = reduce(lambda a, b: a & b, equal.values(), F.lit(True))
    status = (F.when(in_table & F.coalesce(seed == "row", F.lit(False)), "unreplayed")
              .when(in_table & live & same, "same").when(in_table & live, "different")
              .when(in_table & ~in_replay & ((F.col("t._piece") < 0) | F.coalesce(F.col("t._version") <= horizon,
                                                                                 F.lit(False))), "unreplayed")
              .when(in_table, "extra")
              .when(live & F.col("r._deleted"), "deleted_since").when(live, "missing").otherwise("gone"))
    return joined.select(
        *[F.coalesce(F.col(f"t.`{k}`"), F.col(f"r.`{k}`")).alias(k) for k in keys], status.alias("status"),
        F.array_compact(F.array(*[F.when(~e, F.lit(c)) for c, e in equal.items()])).alias("differing"),
        F.col(f"r.{CHANGE_COLUMN}").alias("change"), seed.alias("seed"),
        *[F.col(f"t.{c}").alias(f"t{c}") for c in COORDINATES], *[F.col(f"r.{c}").alias(f"r{c}") for c in COORDINATES])


def _records_read(staging: Staging, pieces: dict[int, Piece], pipeline: Pipeline) -> dict[int, int]:
    """The records Kafka holds per piece, as its task counted them; ReplayImpossible where a
    piece was not read to its end."""
    results = {}
    for text in staging.get("range-"):  # a retried task's attempts read the same records
        result = RangeResult.from_json(text)
        results[(result.key, result.start)] = result
    read = {}
    for s, piece in pieces.items():
        result = results.get((piece.partition, piece.start))
        if result is None or result.reached < piece.end:
            reached = piece.start if result is None else result.reached
            why = f": {result.schema_ahead} is ahead of the reader" if result is not None and result.schema_ahead else ""
            raise ReplayImpossible(
                f"pipeline {pipeline.name}: verify --replay: {piece.partition} offsets [{reached}, {piece.end}) were not "
                f"read again{why}; the table cannot be compared with its replay", topic=piece.partition.topic,
                partition=piece.partition.partition, start=reached, end=piece.end)
        read[s] = result.records
    return read
