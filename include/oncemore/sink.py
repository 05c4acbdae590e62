"""Delta sink: executors write Parquet files into the table directory, the driver commits them.

Files are invisible until a commit references them, so a crash before the commit leaves only
unreferenced files (``vacuum(full=True)`` removes them). The commit is the only place
positions move: it re-reads them from a fresh snapshot, refuses to move them from anything but
the batch's expected positions, and puts add actions, txn actions and the batch description
in one Delta commit. delta-rs neither checks txn versions nor validates added files; both are
done here.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Schema, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from .decode import Decoder
from .ledger import METADATA_KEY, BatchRecord, Ledger, app_id, open_table
from .schema import OFFSET_COLUMN, PARTITION_COLUMN, QUARANTINE_SCHEMA, main_table_schema

# Rows buffered per Parquet row group: far fewer, larger row groups than one per Arrow batch
# (PLATFORM.md: 37 MB vs 24 MB for the same data). Memory is bounded by this, not the range.
ROW_GROUP_ROWS = 100_000
# A task rolls to a new file past this many rows.
FILE_ROWS = 4_000_000
# Delta truncates string statistics to a prefix; so do we (a prefix is a valid minimum).
STATS_STRING_PREFIX = 32
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
# Characters Spark escapes in Hive-style partition directory names (ExternalCatalogUtils).
_PATH_ESCAPED = set('"#%\'*/:=?\\\x7f{[]^')

class CommitConflict(RuntimeError):
    """Positions moved between planning and commit in a way no retry of this batch can fix."""


class InvalidDataFile(RuntimeError):
    pass


@dataclass(frozen=True)
class DataFile:
    """One written Parquet file, as executors report it to the driver."""

    table: str  # "main" | "quarantine"
    path: str  # relative to the table root
    size: int
    partition_values: str  # JSON {column: value-as-string or null}
    num_records: int
    stats: str  # Delta stats JSON
    kafka_partition: int
    min_offset: int
    max_offset: int


# DataFile as the rows an ingest task yields to the driver.
MANIFEST_SCHEMA = pa.schema(
    [("table", pa.string()), ("path", pa.string()), ("size", pa.int64()), ("partition_values", pa.string()),
     ("num_records", pa.int64()), ("stats", pa.string()), ("kafka_partition", pa.int32()),
     ("min_offset", pa.int64()), ("max_offset", pa.int64())]
)


def manifest_batch(files: list[DataFile]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([asdict(f) for f in files], schema=MANIFEST_SCHEMA)


def filesystem(table_uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem and root path for a table URI (local path, file://, s3://, ...)."""
    if "://" not in table_uri:
        return pafs.LocalFileSystem(), str(_absolute(table_uri))
    fs, path = pafs.FileSystem.from_uri(table_uri)
    return fs, path


def _absolute(path: str) -> Path:
    return Path(path).expanduser().resolve()


def table_location(table_uri: str) -> str:
    """The URI delta-rs is given: local paths made absolute so every process agrees."""
    return table_uri if "://" in table_uri else str(_absolute(table_uri))


# ---------------------------------------------------------------------------------------------
# Executor side


@dataclass(frozen=True)
class TaskSpec:
    """What a task needs to turn its records into table files (travels as a data source option)."""

    format_type: str
    schema_ddl: str | None
    table_uri: str
    quarantine_uri: str
    partition_by: tuple[str, ...]
    # Per partition, the first offset the quarantine table still needs (its own position).
    quarantine_floors: dict[int, int]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TaskSpec":
        data = json.loads(text)
        data["partition_by"] = tuple(data["partition_by"])
        data["quarantine_floors"] = {int(p): v for p, v in data["quarantine_floors"].items()}
        return cls(**data)


def write_task_files(records: Iterator[pa.RecordBatch], spec: TaskSpec) -> list[DataFile]:
    """Decodes a task's record batches and writes them as Parquet files into both tables."""
    decoder = Decoder(spec.format_type, spec.schema_ddl)
    main = TableWriter("main", spec.table_uri, main_table_schema(spec.format_type, spec.schema_ddl), spec.partition_by)
    quarantine = TableWriter("quarantine", spec.quarantine_uri, QUARANTINE_SCHEMA)
    for batch in records:
        decoded = decoder.decode(batch)
        main.write(decoded.good)
        if decoded.bad.num_rows:
            floor = spec.quarantine_floors[decoded.bad.column(PARTITION_COLUMN)[0].as_py()]
            quarantine.write(decoded.bad.filter(pc.greater_equal(decoded.bad.column(OFFSET_COLUMN), floor)))
    return main.close() + quarantine.close()


class _StatsAccumulator:
    """Delta per-file statistics (numRecords, minValues, maxValues, nullCount) over written rows."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.num_records = 0
        self.null_count = {f.name: 0 for f in schema}
        self.minimum: dict[str, object] = {}
        self.maximum: dict[str, object] = {}
        self.unbounded: set[str] = set()  # columns holding NaN: no min/max is valid

    def add(self, table: pa.Table) -> None:
        self.num_records += table.num_rows
        for field in self.schema:
            column = table.column(field.name)
            self.null_count[field.name] += column.null_count
            if field.name in self.unbounded or not _has_min_max(field.type) or column.null_count == len(column):
                continue
            bounds = pc.min_max(column).as_py()
            low, high = bounds["min"], bounds["max"]
            if isinstance(low, float) and (math.isnan(low) or math.isnan(high)):
                self.unbounded.add(field.name)
                self.minimum.pop(field.name, None)
                self.maximum.pop(field.name, None)
                continue
            self.minimum[field.name] = min(self.minimum.get(field.name, low), low)
            self.maximum[field.name] = max(self.maximum.get(field.name, high), high)

    def to_json(self) -> str:
        minimum = {n: (v[:STATS_STRING_PREFIX] if isinstance(v, str) else _stat_value(v)) for n, v in self.minimum.items()}
        # A truncated string is no valid maximum: leave long ones out.
        maximum = {
            n: _stat_value(v) for n, v in self.maximum.items()
            if not (isinstance(v, str) and len(v) > STATS_STRING_PREFIX)
        }
        return json.dumps(
            {"numRecords": self.num_records, "minValues": minimum, "maxValues": maximum, "nullCount": self.null_count}
        )


def _has_min_max(kind: pa.DataType) -> bool:
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_string(kind)
            or pa.types.is_date(kind) or pa.types.is_timestamp(kind))


def _stat_value(value):
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if value.tzinfo else value.strftime("%Y-%m-%dT%H:%M:%S.%f")
    if isinstance(value, date):
        return value.isoformat()
    return value


def partition_value_text(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def escape_path_name(text: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _PATH_ESCAPED or ord(c) < 0x20 else c for c in text)


class _OpenFile:
    def __init__(self, fs: pafs.FileSystem, root: str, relative: str, schema: pa.Schema, partition_values: dict):
        self.relative, self.partition_values = relative, partition_values
        self.path = f"{root}/{relative}"
        directory = self.path.rsplit("/", 1)[0]
        fs.create_dir(directory, recursive=True)
        self.fs, self.schema = fs, schema
        self.writer = pq.ParquetWriter(fs.open_output_stream(self.path), schema, compression="snappy")
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.stats = _StatsAccumulator(schema)
        self.kafka_partition: int | None = None
        self.min_offset, self.max_offset = None, None

    def write(self, table: pa.Table, kafka_partition: int, min_offset: int, max_offset: int) -> None:
        self.kafka_partition = kafka_partition
        self.min_offset = min_offset if self.min_offset is None else min(self.min_offset, min_offset)
        self.max_offset = max_offset if self.max_offset is None else max(self.max_offset, max_offset)
        self.stats.add(table)
        self.buffer.append(table)
        self.buffered += table.num_rows
        if self.buffered >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            self.writer.write_table(pa.concat_tables(self.buffer), row_group_size=self.buffered)
            self.buffer, self.buffered = [], 0

    def close(self, table_name: str) -> DataFile:
        self._flush()
        self.writer.close()
        size = self.fs.get_file_info(self.path).size
        return DataFile(
            table=table_name,
            path=self.relative,
            size=size,
            partition_values=json.dumps(self.partition_values, sort_keys=True),
            num_records=self.stats.num_records,
            stats=self.stats.to_json(),
            kafka_partition=self.kafka_partition,
            min_offset=self.min_offset,
            max_offset=self.max_offset,
        )


class TableWriter:
    """Writes one task's rows of one table into Parquet files under the table root.

    One open file per table partition value; files roll after FILE_ROWS rows.
    """

    def __init__(self, table_name: str, table_uri: str, schema: pa.Schema, partition_by: Iterable[str] = ()):
        self.table_name = table_name
        self.fs, self.root = filesystem(table_uri)
        self.partition_by = list(partition_by)
        self.file_schema = pa.schema([f for f in schema if f.name not in self.partition_by])
        self.open: dict[tuple, _OpenFile] = {}
        self.done: list[DataFile] = []

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        for key, part in self._split(table):
            handle = self.open.get(key)
            if handle is None:
                handle = self.open[key] = self._new_file(key)
            partitions = pc.unique(part.column(PARTITION_COLUMN)).to_pylist()
            if len(partitions) != 1:
                raise InvalidDataFile(f"one task must hold one Kafka partition, got {partitions}")
            offsets = pc.min_max(part.column(OFFSET_COLUMN)).as_py()
            handle.write(part.select(self.file_schema.names), partitions[0], offsets["min"], offsets["max"])
            if handle.stats.num_records >= FILE_ROWS:
                self.done.append(self.open.pop(key).close(self.table_name))

    def _split(self, table: pa.Table) -> Iterator[tuple[tuple, pa.Table]]:
        if not self.partition_by:
            yield (), table
            return
        keys = table.select(self.partition_by).group_by(self.partition_by).aggregate([]).to_pylist()
        for key in keys:
            mask = None
            for column, value in key.items():
                match = pc.is_null(table.column(column)) if value is None else pc.equal(table.column(column), value)
                mask = match if mask is None else pc.and_(mask, match)
            yield tuple(partition_value_text(key[c]) for c in self.partition_by), table.filter(mask)

    def _new_file(self, key: tuple) -> _OpenFile:
        values = dict(zip(self.partition_by, key))
        directory = "/".join(
            f"{escape_path_name(column)}={_HIVE_NULL if value is None else escape_path_name(value)}"
            for column, value in values.items()
        )
        name = f"part-{uuid.uuid4().hex}.oncemore.snappy.parquet"
        return _OpenFile(self.fs, self.root, f"{directory}/{name}" if directory else name, self.file_schema, values)

    def close(self) -> list[DataFile]:
        files = self.done + [handle.close(self.table_name) for handle in self.open.values()]
        self.open, self.done = {}, []
        return files


# ---------------------------------------------------------------------------------------------
# Driver side


@dataclass(frozen=True)
class CommitOutcome:
    status: str  # "committed" | "already_committed" (checked before trying) | "lost_race" (a concurrent commit won)
    version: int | None


def ensure_table(table_uri: str, schema: pa.Schema, partition_by: Iterable[str], name: str, description: str) -> DeltaTable:
    """Opens the table, creating it when missing; fails clearly if its schema is not ``schema``."""
    location = table_location(table_uri)
    table = open_table(location)
    if table is None:
        try:
            table = DeltaTable.create(
                location, schema, mode="error", partition_by=list(partition_by) or None, name=name,
                description=description,
            )
        except Exception:
            # Another run created it first (version 0 exists): use theirs.
            table = open_table(location)
            if table is None:
                raise
    expected = Schema.from_arrow(schema).to_json()
    if table.schema().to_json() != expected:
        raise InvalidDataFile(
            f"table {table_uri} has schema {table.schema().to_json()}, the pipeline writes {expected}; "
            "schema changes are not applied automatically"
        )
    if list(table.metadata().partition_columns) != list(partition_by):
        raise InvalidDataFile(
            f"table {table_uri} is partitioned by {table.metadata().partition_columns}, "
            f"the pipeline says {list(partition_by)}"
        )
    return table


def validate_files(table_uri: str, files: list[DataFile], schema: pa.Schema, partition_by: Iterable[str],
                   ranges: Mapping[int, tuple[int, int]]) -> None:
    """Every file exists with its reported size, has the table's schema and holds only offsets
    inside its partition's range. delta-rs would commit a broken file without a word."""
    fs, root = filesystem(table_uri)
    file_schema = pa.schema([f for f in schema if f.name not in set(partition_by)])
    for data_file in files:
        where = f"{table_uri}/{data_file.path}"
        info = fs.get_file_info(f"{root}/{data_file.path}")
        if info.type != pafs.FileType.File or info.size != data_file.size:
            raise InvalidDataFile(f"{where}: missing or size {info.size} != reported {data_file.size}")
        found = pq.read_schema(fs.open_input_file(f"{root}/{data_file.path}"))
        if not found.remove_metadata().equals(file_schema, check_metadata=False):
            raise InvalidDataFile(f"{where}: schema {found} differs from the table's {file_schema}")
        start, end = ranges.get(data_file.kafka_partition, (0, 0))
        if not (start <= data_file.min_offset and data_file.max_offset < end):
            raise InvalidDataFile(
                f"{where}: offsets [{data_file.min_offset}, {data_file.max_offset}] of partition "
                f"{data_file.kafka_partition} fall outside the batch range [{start}, {end})"
            )


def commit_batch(
    table_uri: str,
    pipeline: str,
    topic: str,
    files: list[DataFile],
    expected: Mapping[int, int | None],
    new_positions: Mapping[int, int],
    batch: BatchRecord,
) -> CommitOutcome:
    """One Delta commit: ``files`` plus txn actions moving ``expected`` to ``new_positions``.

    Returns already_committed (and commits nothing) when the table's positions already reach
    ``new_positions``: a retry, rerun or concurrent duplicate got there first. Raises
    CommitConflict when they are neither where this batch starts nor where it ends.
    """
    location = table_location(table_uri)
    ledger = Ledger(location, pipeline, topic)
    table = DeltaTable(location)
    if already_committed(table_uri, topic, ledger.committed_positions(new_positions, table), expected, new_positions):
        return CommitOutcome("already_committed", None)
    now_ms = int(time.time() * 1000)
    actions = [
        AddAction(f.path, f.size, json.loads(f.partition_values), now_ms, True, f.stats) for f in files
    ]
    properties = CommitProperties(
        app_transactions=[Transaction(app_id(pipeline, topic, p), v) for p, v in sorted(new_positions.items())],
        custom_metadata={METADATA_KEY: batch.to_json()},
    )
    try:
        table.create_write_transaction(
            actions, mode="append", schema=table.schema(),
            partition_by=list(table.metadata().partition_columns) or None, commit_properties=properties,
        )
    except CommitFailedError:
        # A concurrent commit touched the same positions. If it covered this range, we are done.
        if _reached(ledger.committed_positions(new_positions), new_positions):
            return CommitOutcome("lost_race", None)
        raise
    table.update_incremental()
    return CommitOutcome("committed", table.version())


def _reached(current: Mapping[int, int | None], target: Mapping[int, int]) -> bool:
    return all(current[p] is not None and current[p] >= v for p, v in target.items())


def already_committed(table_uri: str, topic: str, current: Mapping[int, int | None],
                      expected: Mapping[int, int | None], new_positions: Mapping[int, int]) -> bool:
    """True when the table's ``current`` positions already reach ``new_positions``; False when
    they are exactly the ``expected`` ones a batch builds on; CommitConflict otherwise."""
    if _reached(current, new_positions):
        return True
    moved = {p: (expected[p], current[p], new_positions[p]) for p in new_positions if current[p] != expected[p]}
    if moved:
        detail = ", ".join(f"{topic}/{p}: expected {e}, found {c}, batch ends at {n}" for p, (e, c, n) in moved.items())
        raise CommitConflict(
            f"{table_uri}: positions moved since planning ({detail}); nothing was committed. "
            "Another run ingested part of this range: run again to replan from the new positions."
        )
    return False


def delete_files(table_uri: str, files: Iterable[DataFile]) -> None:
    """Removes files this run wrote and decided not to commit (never after a commit attempt)."""
    fs, root = filesystem(table_uri)
    for data_file in files:
        try:
            fs.delete_file(f"{root}/{data_file.path}")
        except (FileNotFoundError, OSError):
            pass
