"""The sink's tasks: what ``mapInArrow`` runs over a run's shaped DataFrame (run/jobs.py), each
Spark task writing the rows of any Kafka partitions to the tables' files.

A task (``SinkTasks``) splits off the rows failing an expectation (quarantined as the row the
transform made, in JSON, with the expectation's name; or, for ``on_fail: fail``, failing the task
naming expectation, topic, partition and offset) and rows a Delta table could not read back (an
empty string as a partition value) or whose column cannot hold a value (write/fit.unstorable_rows),
and writes the rest in the table's schema; it yields one row, its ``WrittenFiles`` as JSON: its
files and counts. An upsert's tasks write change rows instead, to the part's staging area, and
quarantine those that cannot be applied, with their record's bytes (a Debezium truncate fails the
task, naming it). The run commits the part from these rows and the reading tasks' RangeResults, as
it commits an ingest job's (commit/part.py); a job that fails commits nothing, and the files its
finished tasks wrote are in no commit (vacuum removes them).

Not a Data Source sink: Spark plans one in Python processes of its own on the driver (making the
writer, its commit), each with its daemon, kept a minute idle; with the records' source that was
~700 MiB of a run through a transform (docs/performance.md, "A transform's run"). The options reach
the tasks inside the function, as the reading tasks' (run/kafkasource.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from oncemore.commit.inputs import Part
from oncemore.core import hours
from oncemore.core.columns import (
    CHANGE_COLUMN,
    INVALID_COLUMN,
    METADATA_FIELDS,
    OFFSET_COLUMN,
    PARTITION_COLUMN,
    QUARANTINE_SCHEMA,
    RECORD_KEY_COLUMN,
    RECORD_VALUE_COLUMN,
    SEQUENCE_FIELD,
    TIMESTAMP,
    TIMESTAMP_COLUMN,
    TOPIC_COLUMN,
    VERDICT_PREFIX,
    change_schema,
)
from oncemore.core.errors import OncemoreError
from oncemore.core.stopwatch import Stopwatch
from oncemore.write.files import TableWriter
from oncemore.write.fit import conform, unstorable_rows

# A task's WrittenFiles as the one row it yields to the run.
MESSAGE_SCHEMA = pa.schema([("written", pa.string())])


class ExpectationFailed(OncemoreError):
    """A row failed an expectation whose ``on_fail`` is ``fail``."""


class TruncateRefused(OncemoreError):
    """An upsert pipeline met a Debezium truncate: no change by key says which rows it removed."""


@dataclass
class WrittenFiles:
    """What one sink task wrote: its files (write/files.DataFile's fields), the rows failing each
    expectation, in all and by ``topic/partition``, its seconds writing, and its rows by hour."""

    files: list[dict]
    violations: dict[str, int]
    violations_by_partition: dict[str, int]
    write_seconds: float = 0.0
    hours: dict[str, list[int]] | None = None  # core/hours.py: the rows this task wrote and quarantined

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WrittenFiles":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class SinkTasks:
    """What ``mapInArrow`` runs over the shaped rows of a Spark task: their files written, and one
    row (MESSAGE_SCHEMA) saying what they hold. ``expectations``: [{name, on_fail}], in the order
    of their verdict columns; ``keep_rows`` false: the rows are the records, read only for the
    quarantine, none kept; ``floors``: the quarantine table's positions, by ``topic/partition``;
    ``without_pandas``: the job runs no Python but oncemore's (run/workermemory.pandas_kept_out)."""

    part: Part
    table_schema: pa.Schema
    expectations: list[dict]
    keep_rows: bool
    floors: dict[str, int]
    storage: dict[str, str]
    without_pandas: bool

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from oncemore.run.workermemory import pandas_kept_out

        with pandas_kept_out(self.without_pandas):
            written = self.write(batches)
        yield pa.RecordBatch.from_pylist([{"written": written.to_json()}], schema=MESSAGE_SCHEMA)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WrittenFiles:
        if not self.keep_rows:
            for _ in iterator:  # the reading tasks run to the end of their ranges
                pass
            return WrittenFiles([], {}, {})
        if self.part.upsert is None:
            main = TableWriter("main", self.part.table_uri, self.table_schema, self.part.partition_by, self.storage)
            schema = self.table_schema
        else:  # change rows, staged for the driver's MERGE (commit/merge.py)
            schema = change_schema(self.table_schema)
            main = TableWriter("changes", self.part.changes_uri, schema, (), self.storage)
        quarantine = TableWriter("quarantine", self.part.quarantine_uri, QUARANTINE_SCHEMA, (), self.storage)
        violations: Counter = Counter()
        by_partition: Counter = Counter()
        counted: hours.Hours = {}
        watch = Stopwatch()
        for batch in iterator:
            rows, errors = classified(pa.Table.from_batches([batch]), self.part.pipeline, self.expectations,
                                      self.part.upsert and self.part.upsert.keys, self.table_schema,
                                      self.part.partition_by, violations)
            if errors:
                failing = sorted(errors)
                bad = rows.take(failing)
                hours.count(counted, _timestamps(bad), hours.QUARANTINED)
                for text in (f"{t}/{p}" for t, p in zip(bad.column(TOPIC_COLUMN).to_pylist(),
                                                         bad.column(PARTITION_COLUMN).to_pylist())):
                    by_partition[text] += 1
                with watch.timing("write"):
                    quarantine.write(self._quarantined(bad, [errors[i] for i in failing]))
                keep = pa.array([i not in errors for i in range(rows.num_rows)])
                rows = rows.filter(keep)
            if rows.num_rows:
                hours.count(counted, _timestamps(rows), hours.WRITTEN)
                with watch.timing("write"):
                    main.write(conform(rows, schema))
        with watch.timing("write"):
            files = main.close() + quarantine.close()
        return WrittenFiles([f.__dict__ for f in files], dict(violations), dict(by_partition), watch.seconds["write"],
                            counted)

    def _quarantined(self, bad: pa.Table, errors: list[str]) -> pa.Table:
        """Rows that cannot be written, as quarantine rows: an upsert's change rows with their
        record's key and value bytes (shape/changes.py carries them); rows a transform made with the
        row as JSON for the value (the record's bytes are no longer at hand); with their
        coordinates and the reason. Rows under the quarantine table's own position are already
        there (a crash between a batch's two commits). The transform keeps the coordinates as read
        (transform.py), but may drop or retype the Kafka timestamp: then it is NULL here, never a
        reason to fail (every rerun would fail alike)."""
        if self.part.upsert is not None:
            keys, values = bad.column(RECORD_KEY_COLUMN), bad.column(RECORD_VALUE_COLUMN)
        else:
            metadata = [f.name for f in METADATA_FIELDS]
            keys = pa.nulls(bad.num_rows, pa.binary())
            values = pa.array([json.dumps(row, default=str).encode() for row in
                               _python_rows(bad.drop_columns([c for c in metadata if c in bad.column_names]))],
                              pa.binary())
        stamp = bad.column(TIMESTAMP_COLUMN) if TIMESTAMP_COLUMN in bad.column_names else None
        if stamp is None or not (pa.types.is_timestamp(stamp.type) and stamp.type.tz is not None):
            stamp = pa.nulls(bad.num_rows, TIMESTAMP)
        table = pa.Table.from_arrays(
            [keys, values, pa.array(errors, pa.string()),
             bad.column(TOPIC_COLUMN), bad.column(PARTITION_COLUMN), bad.column(OFFSET_COLUMN),
             stamp.cast(TIMESTAMP)], schema=QUARANTINE_SCHEMA)
        floors = pa.array([self.floors.get(f"{t}/{p}", 0) for t, p in zip(table.column(TOPIC_COLUMN).to_pylist(),
                                                                          table.column(PARTITION_COLUMN).to_pylist())],
                          pa.int64())
        return table.filter(pc.greater_equal(table.column(OFFSET_COLUMN), floors))


def classified(rows: pa.Table, pipeline: str, expectations: list[dict], upsert_keys, schema: pa.Schema,
               partition_by, violations: Counter) -> tuple[pa.Table, dict[int, str]]:
    """Shaped rows without the expectations' verdicts (and an upsert's invalid column), and why each row
    that cannot be written goes to the quarantine table instead, by row: an expectation it fails
    (``on_fail: quarantine``; ``violations`` counts every expectation's failures), a change that
    cannot be applied, a partition value or a column's value the table (of ``schema``) cannot hold.
    ExpectationFailed for an expectation whose ``on_fail`` is ``fail``, TruncateRefused for a
    Debezium truncate. ``upsert_keys``: an upsert's key columns (None: rows are appended); a change
    that is no upsert applies by key alone, so the values it carries are dropped, never judged. The
    sink's tasks and ``oncemore check --sample`` (ops/sample.py) judge rows with it alike."""
    verdicts = [f"{VERDICT_PREFIX}{i}" for i in range(len(expectations))]
    errors = _failed_expectations(rows, pipeline, expectations, verdicts, violations)
    rows = rows.drop_columns(verdicts)
    judged = schema
    if upsert_keys:
        errors.update(_inapplicable(rows, pipeline))
        rows = _values_of_upserts(rows.drop_columns([INVALID_COLUMN]), upsert_keys, schema)
        keys = {k.lower() for k in upsert_keys}  # a delete's values are NULL: only its key must be there
        judged = pa.schema([f if f.name.lower() in keys else f.with_nullable(True) for f in schema])
    for i, message in unstorable_rows(rows, judged, partition_by).items():
        errors.setdefault(i, message)
    return rows, errors


def _values_of_upserts(rows: pa.Table, keys, schema: pa.Schema) -> pa.Table:
    """Change rows with the table's value columns NULL where the change is no upsert (a delete, a
    tombstone): the MERGE applies those by key, and a value the table's column could not hold (a
    NULL element where it has none) must not quarantine a delete. Keys and oncemore's own columns
    (the sequence, the coordinates) stay."""
    upserts = pc.fill_null(pc.equal(rows.column(CHANGE_COLUMN), "upsert"), False)
    if pc.all(upserts).as_py():
        return rows
    kept = {k.lower() for k in keys} | {f.name for f in (SEQUENCE_FIELD, *METADATA_FIELDS)}
    for field in schema:
        if field.name in rows.column_names and field.name.lower() not in kept:
            column = rows.column(field.name)
            rows = rows.set_column(rows.schema.get_field_index(field.name), field.name,
                                   pc.if_else(upserts, column, pa.nulls(rows.num_rows, column.type)))
    return rows


def _failed_expectations(rows: pa.Table, pipeline: str, expectations: list[dict], verdicts: list[str],
                         violations: Counter) -> dict[int, str]:
    errors: dict[int, str] = {}
    for expectation, column in zip(expectations, verdicts):
        failing = pc.indices_nonzero(pc.invert(rows.column(column))).to_pylist()
        if not failing:
            continue
        violations[expectation["name"]] += len(failing)
        if expectation["on_fail"] == "fail":
            first = rows.select([TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN]).slice(failing[0], 1).to_pylist()[0]
            raise ExpectationFailed(
                f"pipeline {pipeline}: expectation {expectation['name']} failed for "
                f"{first[TOPIC_COLUMN]}/{first[PARTITION_COLUMN]} offset {first[OFFSET_COLUMN]} "
                f"({len(failing)} rows of this task); nothing was committed",
                expectation=expectation["name"], topic=first[TOPIC_COLUMN], partition=first[PARTITION_COLUMN],
                offset=first[OFFSET_COLUMN])
        for i in failing:
            errors.setdefault(i, f"expectation {expectation['name']} failed")
    return errors


def _inapplicable(rows: pa.Table, pipeline: str) -> dict[int, str]:
    """Change rows that cannot be applied, by row (shape/changes.py says why); a Debezium truncate
    fails the task, naming where it is: its deletes are not in the stream."""
    truncates = pc.indices_nonzero(pc.fill_null(pc.equal(rows.column(CHANGE_COLUMN), "truncate"), False)).to_pylist()
    if truncates:
        first = rows.select([TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN]).slice(truncates[0], 1).to_pylist()[0]
        raise TruncateRefused(
            f"pipeline {pipeline}: {first[TOPIC_COLUMN]}/{first[PARTITION_COLUMN]} offset "
            f"{first[OFFSET_COLUMN]}: a Debezium truncate (op t) cannot be applied by key; nothing was committed "
            "(empty the table with oncemore delete, then reset past it)", topic=first[TOPIC_COLUMN],
            partition=first[PARTITION_COLUMN], offset=first[OFFSET_COLUMN])
    invalid = rows.column(INVALID_COLUMN)
    return {i: invalid[i].as_py() for i in pc.indices_nonzero(pc.is_valid(invalid)).to_pylist()}


def _timestamps(rows: pa.Table) -> pa.ChunkedArray | None:
    """The rows' Kafka timestamps, which a transform may have dropped (hours.count then counts none)."""
    return rows.column(TIMESTAMP_COLUMN) if TIMESTAMP_COLUMN in rows.column_names else None


def _python_rows(table: pa.Table) -> list[dict]:
    """The rows as Python values; a row holding a date or timestamp Python cannot (beyond year 9999,
    which Spark allows) has its dates and times as the integers Arrow stores (days, microseconds)."""
    try:
        return table.to_pylist()
    except (OverflowError, ValueError):
        pass
    rows = []
    stored = table.cast(pa.schema([f.with_type(_stored(f.type)) for f in table.schema]))
    for i in range(table.num_rows):
        try:
            rows.append(table.slice(i, 1).to_pylist()[0])
        except (OverflowError, ValueError):
            rows.append(stored.slice(i, 1).to_pylist()[0])
    return rows


def _stored(kind: pa.DataType) -> pa.DataType:
    """``kind`` with every date, time, timestamp and duration as the integer Arrow stores it in."""
    if pa.types.is_temporal(kind):
        return pa.int32() if kind.bit_width == 32 else pa.int64()
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(_stored(f.type)) for f in kind])
    if pa.types.is_map(kind):
        return pa.map_(_stored(kind.key_type), _stored(kind.item_type))
    if pa.types.is_list(kind):
        return pa.list_(kind.value_field.with_type(_stored(kind.value_type)))
    return kind
