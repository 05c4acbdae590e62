"""Spark Python Data Sources over the files of a pipeline's tables, for ``oncemore verify``:
``oncemore_coordinates`` gives each row of the listed Parquet files as (quarantine, topic,
partition, offset, segment, table), where ``segment`` is the piece of committed history the offset falls
in (``Coverage``); ``oncemore_table_rows`` gives the rows themselves, the columns of a schema
(an upsert table's keys, or its whole rows for ``verify --replay``).

Only the columns asked for are read, file by file and row group by row group, through the same
pyarrow filesystems the writers use (local, S3); a column a file lacks (added to the table after
it) is NULL. The files are what the tables' snapshots list (delta-rs on the driver), so
compaction and vacuum change which files are read, never which rows.

Options: ``files`` (per Spark task, a list of [quarantine, table root, path, partition values,
deleted rows, the index of its table among the audited ones]: a column the table is partitioned by is in the path, not the file; the positions
of the rows a deletion vector deletes are skipped), ``coverage`` (Coverage as JSON; the
coordinates), ``schema`` (the columns as an Arrow schema in text, core/columns.py; the rows),
``storage.<KEY>`` the storage settings (one option each, so Spark redacts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

NAME = "oncemore_coordinates"
ROWS_NAME = "oncemore_table_rows"
SCHEMA = "quarantine BOOLEAN, topic STRING, partition INT, offset BIGINT, segment BIGINT, table INT"

# What a row's segment is when it is no piece of committed history.
OUTSIDE = -1  # in no committed range of the audited history
BEFORE = -2  # below the audited history (--since, or commit files removed by log cleanup)
PENDING = -3  # a quarantine row at or past the main table's position: its batch's main commit is to come
FOREIGN = -4  # another pipeline's topic in a shared table


@dataclass(frozen=True)
class Coverage:
    """Per "topic/partition": the boundaries of its pieces of committed history and each piece's
    segment id (OUTSIDE for a hole), where the audit starts (None: the whole log) and the main
    table's position; the pipeline's topics; whether the whole log is audited."""

    partitions: Mapping[str, dict]  # {"topic/partition": {"bounds": [...], "segments": [...], "start": int|None, "position": int|None}}
    topics: tuple[str, ...]
    whole_log: bool

    def to_json(self) -> str:
        return json.dumps({"partitions": self.partitions, "topics": list(self.topics), "whole_log": self.whole_log})

    @classmethod
    def from_json(cls, text: str) -> "Coverage":
        data = json.loads(text)
        return cls(data["partitions"], tuple(data["topics"]), data["whole_log"])

    def segments_of(self, topic: str, partition: int, offsets, quarantine: bool):
        """The segment of each of ``offsets`` (a numpy int64 array) of one partition."""
        import numpy as np

        if topic not in self.topics:
            return np.full(len(offsets), FOREIGN, dtype=np.int64)
        known = self.partitions.get(f"{topic}/{partition}")
        if known is None:  # a partition without a position: never committed, or not since the audit starts
            code = PENDING if quarantine else OUTSIDE if self.whole_log else BEFORE
            return np.full(len(offsets), code, dtype=np.int64)
        bounds = np.asarray(known["bounds"], dtype=np.int64)
        pieces = np.asarray(known["segments"] + [OUTSIDE], dtype=np.int64)  # the last: past the end
        index = np.searchsorted(bounds, offsets, side="right") - 1
        segments = np.where(index < 0, OUTSIDE, pieces[np.clip(index, 0, len(pieces) - 1)])
        if known["start"] is not None:
            segments = np.where(offsets < known["start"], BEFORE, segments)
        if quarantine and known["position"] is not None:
            segments = np.where((segments == OUTSIDE) & (offsets >= known["position"]), PENDING, segments)
        return segments


class FilesPartition(InputPartition):
    def __init__(self, files: list[tuple[bool, str, str, dict, list[int], int]]):
        super().__init__(files)
        self.files = files


class CoordinatesDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema) -> "CoordinatesReader":
        return CoordinatesReader(self.options)


class _FilesReader(DataSourceReader):
    def __init__(self, options):
        self.tasks = json.loads(options["files"])
        self.storage = {k[len("storage."):]: v for k, v in options.items() if k.startswith("storage.")}

    def partitions(self) -> list[FilesPartition]:
        return [FilesPartition([tuple(f) for f in files]) for files in self.tasks]

    def tables(self, task: FilesPartition, schema) -> Iterator:
        """The rows of the task's files, ``schema``'s columns in its types: (quarantine, the index of
        the file's table, a table) per batch read."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from oncemore.core.storage import filesystem

        for quarantine, root, path, partition_values, deleted, index in task.files:
            fs, base = filesystem(root, self.storage)
            deleted, first = np.asarray(deleted, dtype=np.int64), 0
            with fs.open_input_file(f"{base}/{path}") as handle:
                parquet = pq.ParquetFile(handle)
                stored = set(parquet.schema_arrow.names)
                in_file = [f.name for f in schema if f.name not in partition_values and f.name in stored]
                for batch in parquet.iter_batches(columns=in_file, batch_size=1 << 17):
                    if deleted.size:  # rows a deletion vector deletes, by their position in the file
                        keep = np.ones(batch.num_rows, dtype=bool)
                        keep[deleted[(deleted >= first) & (deleted < first + batch.num_rows)] - first] = False
                        first += batch.num_rows
                        batch = batch.filter(pa.array(keep))
                    # Other writers' files may hold other encodings (delta-rs writes string_view).
                    yield quarantine, index, pa.table([
                        batch.column(f.name).cast(f.type) if f.name in in_file
                        else pa.array([partition_values[f.name]] * batch.num_rows, pa.string()).cast(f.type)
                        if f.name in partition_values else pa.nulls(batch.num_rows, f.type)
                        for f in schema], schema=schema)


class CoordinatesReader(_FilesReader):
    def __init__(self, options):
        super().__init__(options)
        self.coverage_json = options["coverage"]

    def read(self, task: FilesPartition | None) -> Iterator:
        if task is None:
            return
        import pyarrow as pa

        from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, TOPIC_COLUMN

        coverage = Coverage.from_json(self.coverage_json)
        schema = pa.schema([(TOPIC_COLUMN, pa.string()), (PARTITION_COLUMN, pa.int32()), (OFFSET_COLUMN, pa.int64())])
        for quarantine, index, table in self.tables(task, schema):
            yield from _placed(table, quarantine, index, coverage)


class RowsDataSource(DataSource):
    """The rows of the listed files, in the columns of option ``schema``."""

    @classmethod
    def name(cls) -> str:
        return ROWS_NAME

    def schema(self) -> StructType:
        from pyspark.sql.pandas.types import from_arrow_schema

        return from_arrow_schema(_nullable(self.options["schema"]))

    def reader(self, schema) -> "RowsReader":
        return RowsReader(self.options)


class RowsReader(_FilesReader):
    def __init__(self, options):
        super().__init__(options)
        self.schema_text = options["schema"]

    def read(self, task: FilesPartition | None) -> Iterator:
        if task is None:
            return
        schema = _nullable(self.schema_text)
        for _, _, table in self.tables(task, schema):
            yield from table.to_batches()


def _nullable(text: str):
    """The Arrow schema in ``text``, every field nullable (as Spark reads a data source's rows)."""
    import pyarrow as pa

    from oncemore.core.columns import schema_from_text

    return pa.schema([f.with_nullable(True) for f in schema_from_text(text)])


def table_rows(spark, files, schema, storage_options) -> "DataFrame":
    """A DataFrame of the rows of ``files`` (history.File, of one table) in ``schema``'s columns
    (an Arrow schema): the rows a snapshot holds."""
    from oncemore.core.columns import schema_text
    from oncemore.report.history import scan_tasks
    from oncemore.run.session import register_source, slots

    register_source(spark, RowsDataSource)
    reader = (spark.read.format(ROWS_NAME).option("files", json.dumps(scan_tasks(files, slots(spark))))
              .option("schema", schema_text(schema)))
    for key, value in (storage_options or {}).items():
        reader = reader.option(f"storage.{key}", value)
    return reader.load()


def _placed(table, quarantine: bool, index: int, coverage: Coverage) -> Iterator:
    """The rows of ``table`` (topic, partition, offset; of the audited table ``index``) with their
    segments, a batch per partition: sorted once by partition, then cut (a file holds a task's many
    partitions)."""
    import numpy as np
    import pyarrow as pa

    from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, TOPIC_COLUMN

    if not table.num_rows:
        return
    topics = table[TOPIC_COLUMN].combine_chunks().dictionary_encode()
    key = topics.indices.to_numpy().astype(np.int64) << 32 | table[PARTITION_COLUMN].to_numpy().astype(np.int64)
    order = np.argsort(key, kind="stable")
    key, offsets = key[order], table[OFFSET_COLUMN].to_numpy()[order]
    cuts = [0, *(np.flatnonzero(np.diff(key)) + 1).tolist(), len(key)]
    for begin, end in zip(cuts, cuts[1:]):
        topic, partition = topics.dictionary[int(key[begin] >> 32)].as_py(), int(key[begin] & 0xFFFFFFFF)
        part = offsets[begin:end]
        yield pa.RecordBatch.from_arrays(
            [pa.array(np.full(len(part), quarantine)), pa.array([topic] * len(part), pa.string()),
             pa.array(np.full(len(part), partition, dtype=np.int32)), pa.array(part, pa.int64()),
             pa.array(coverage.segments_of(topic, partition, part, quarantine), pa.int64()),
             pa.array(np.full(len(part), index, dtype=np.int32))],
            names=["quarantine", "topic", "partition", "offset", "segment", "table"])
