"""Rows written by a task as Parquet files with Delta statistics under a table's root, in
Hive-style partition directories, in the table's schema.

Files are invisible until the driver's commit references them (committer.py), so a task that
fails or is cut short leaves only unreferenced files. Each file is reported as a DataFile: its
statistics and, per Kafka partition, the offsets it holds, which the driver checks against the
ranges it commits. Memory is bounded by rows and bytes at every stage (row groups, files), never
by the range or by the values' size. Rows come here in the table's schema, those it cannot hold
already taken out (fit.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, TOPIC_COLUMN
from oncemore.core.storage import filesystem
from oncemore.write.filestats import FileStats

# Rows buffered per Parquet row group: far fewer, larger row groups than one per Arrow batch
# (PLATFORM.md: 37 MB vs 24 MB for the same data), and never more than ROW_GROUP_BYTES in memory.
# 50,000, not 100,000: a replayed task of 500,000 records peaked 23 MiB lower, as fast, and a 1 M-record
# run's tree ~30 MiB lower (docs/performance.md, "Memory beside the peer").
ROW_GROUP_ROWS = 50_000
ROW_GROUP_BYTES = 128 << 20
# A task rolls to a new file past either bound.
FILE_ROWS = 4_000_000
FILE_BYTES = 1 << 30
# The rows of a file's first row group that decide which of its columns are dictionary-encoded.
DICTIONARY_SAMPLE_ROWS = 10_000
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
# Characters Spark escapes in Hive-style partition directory names (ExternalCatalogUtils).
_PATH_ESCAPED = set('"#%\'*/:=?\\\x7f{[]^')


@dataclass(frozen=True)
class DataFile:
    """One written Parquet file, as executors report it to the driver."""

    table: str  # "main" | "quarantine"
    path: str  # relative to the table root
    size: int
    partition_values: str  # JSON {column: value-as-string or null}
    num_records: int
    stats: str  # Delta stats JSON
    offsets: dict[str, list[int]]  # {"topic/partition": [min offset, max offset, rows]} of the rows it holds

    @classmethod
    def from_dict(cls, data: Mapping) -> "DataFile":
        return cls(**data)


def kafka_offsets(rows: pa.Table) -> dict[str, tuple[int, int, int]]:
    """Per "topic/partition" of ``rows``: the lowest and highest offset and the number of rows."""
    grouped = rows.group_by([TOPIC_COLUMN, PARTITION_COLUMN]).aggregate(
        [(OFFSET_COLUMN, "min"), (OFFSET_COLUMN, "max"), (OFFSET_COLUMN, "count")])
    return {f"{g[TOPIC_COLUMN]}/{g[PARTITION_COLUMN]}": (g[f"{OFFSET_COLUMN}_min"], g[f"{OFFSET_COLUMN}_max"],
                                                        g[f"{OFFSET_COLUMN}_count"]) for g in grouped.to_pylist()}


def partition_value_text(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        # The protocol's timestamp form, in UTC when the value has a zone: delta-rs refuses the
        # ISO form's 'T' in a partition value.
        if value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def logged_partition_values(add: Mapping, columns) -> dict[str, str | None]:
    """A live file's partition values (an add action as delta-rs's ``get_add_actions`` lists it,
    typed) as the log spells them, for ``columns``."""
    return {c: partition_value_text((add.get("partition") or {}).get(c)) for c in columns}


def escape_path_name(text: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _PATH_ESCAPED or ord(c) < 0x20 else c for c in text)


def dictionary_columns(rows: pa.Table) -> list[str]:
    """The Parquet columns (leaf paths) of a file starting with ``rows`` to dictionary-encode: every
    column but a top-level one whose first DICTIONARY_SAMPLE_ROWS values are nearly all distinct
    (9 in 10). Arrow's writer dictionary-encodes every column until its dictionary passes 1 MiB,
    so a row group of distinct offsets, timestamps or ids was hashed into a dictionary as
    large as the values (Spark's Parquet writer gives up on a dictionary that does not pay; Arrow's
    does not). A column of 10,000 names in 100,000 rows is 63 % distinct in its first 10,000 and
    half the size with a dictionary: it keeps it. Measured on 100,000 flat JSON records: 235 ns a
    record written and 2.6 MB with every column encoded, 155 ns and 2.0 MB with these."""
    sample = rows.slice(0, DICTIONARY_SAMPLE_ROWS)
    paths: list[str] = []
    for field, column in zip(sample.schema, sample.columns):
        if pa.types.is_nested(field.type):
            paths += _parquet_leaves(field.name, field.type)
            continue
        try:
            distinct = pc.count_distinct(column, mode="all").as_py()
        except pa.ArrowNotImplementedError:  # a type without the kernel keeps Arrow's default
            distinct = 0
        if distinct * 10 < len(column) * 9:
            paths.append(field.name)
    return paths


def _parquet_leaves(path: str, kind: pa.DataType) -> list[str]:
    """The paths of the Parquet columns an Arrow column of type ``kind`` is written as (Arrow's
    names for nested types: ``list.element``, ``key_value.key``/``value``)."""
    if pa.types.is_struct(kind):
        return [leaf for child in kind for leaf in _parquet_leaves(f"{path}.{child.name}", child.type)]
    if pa.types.is_map(kind):
        return (_parquet_leaves(f"{path}.key_value.key", kind.key_type)
                + _parquet_leaves(f"{path}.key_value.value", kind.item_type))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _parquet_leaves(f"{path}.list.element", kind.value_type)
    return [path]


class _OpenFile:
    def __init__(self, fs: pafs.FileSystem, root: str, relative: str, schema: pa.Schema, partition_values: dict):
        self.relative, self.partition_values = relative, partition_values
        self.path = f"{root}/{relative}"
        fs.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
        self.fs, self.schema = fs, schema
        # ParquetWriter leaves a stream it was handed open: closed in close(), which is what
        # completes an object store's upload.
        self.stream = fs.open_output_stream(self.path)
        self.writer: pq.ParquetWriter | None = None  # opened with the first row group (dictionary_columns)
        self.buffer: list[pa.Table] = []
        self.buffered_rows = self.buffered_bytes = self.written_bytes = 0
        self.stats = FileStats(schema)
        self.offsets: dict[str, list[int]] = {}  # {"topic/partition": [min, max, rows]}

    @property
    def full(self) -> bool:
        return self.stats.num_records >= FILE_ROWS or self.written_bytes + self.buffered_bytes >= FILE_BYTES

    def write(self, table: pa.Table, offsets: Mapping[str, tuple[int, int, int]]) -> None:
        for key, (low, high, rows) in offsets.items():
            known = self.offsets.get(key)
            self.offsets[key] = [low, high, rows] if known is None else [min(known[0], low), max(known[1], high),
                                                                         known[2] + rows]
        self.stats.add(table)
        self.buffer.append(table)
        self.buffered_rows += table.num_rows
        self.buffered_bytes += table.nbytes
        if self.buffered_rows >= ROW_GROUP_ROWS or self.buffered_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            rows = pa.concat_tables(self.buffer)
            if self.writer is None:
                self.writer = pq.ParquetWriter(self.stream, self.schema, compression="snappy",
                                               use_dictionary=dictionary_columns(rows))
            self.writer.write_table(rows, row_group_size=self.buffered_rows)
            self.written_bytes += self.buffered_bytes
            self.buffer, self.buffered_rows, self.buffered_bytes = [], 0, 0

    def close(self, table_name: str) -> DataFile:
        self._flush()
        self.writer.close()
        self.stream.close()
        return DataFile(
            table=table_name,
            path=self.relative,
            size=self.fs.get_file_info(self.path).size,
            partition_values=json.dumps(self.partition_values, sort_keys=True),
            num_records=self.stats.num_records,
            stats=self.stats.to_json(),
            offsets=self.offsets,
        )


class TableWriter:
    """Writes one task's rows of one table into Parquet files under the table root.

    One open file per table partition value; files roll after FILE_ROWS rows or FILE_BYTES.
    """

    def __init__(self, table_name: str, table_uri: str, schema: pa.Schema, partition_by: Iterable[str] = (),
                 storage_options: Mapping[str, str] | None = None):
        self.table_name = table_name
        self.fs, self.root = filesystem(table_uri, storage_options)
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
            handle.write(part.select(self.file_schema.names), kafka_offsets(part))
            if handle.full:
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
