"""A Spark Python Data Source over the Kafka coordinates of a pipeline's tables, for ``oncemore
verify``: each row of the listed Parquet files as (quarantine, topic, partition, offset, segment),
where ``segment`` is the piece of committed history the offset falls in (``Coverage``).

Only the ``_kafka_topic``, ``_kafka_partition`` and ``_kafka_offset`` columns are read, file by file
and row group by row group, through the same pyarrow filesystems the writers use (local, S3).
The files are what the tables' snapshots list (delta-rs on the driver), so compaction and vacuum
change which files are read, never which rows.

Options: ``files`` (per Spark task, a list of [quarantine, table root, path, partition values,
deleted rows]: a ``_kafka_*`` column the table is partitioned by is in the path, not the file; the
positions of the rows a deletion vector deletes are skipped), ``coverage``
(Coverage as JSON), ``storage.<KEY>`` the storage settings (one option each, so Spark redacts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Mapping

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

NAME = "oncemore_coordinates"
SCHEMA = "quarantine BOOLEAN, topic STRING, partition INT, offset BIGINT, segment BIGINT"

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


class CoordinatesPartition(InputPartition):
    def __init__(self, files: list[tuple[bool, str, str, dict, list[int]]]):
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


class CoordinatesReader(DataSourceReader):
    def __init__(self, options):
        self.tasks = json.loads(options["files"])
        self.coverage_json = options["coverage"]
        self.storage = {k[len("storage."):]: v for k, v in options.items() if k.startswith("storage.")}

    def partitions(self) -> list[CoordinatesPartition]:
        return [CoordinatesPartition([tuple(f) for f in files]) for files in self.tasks]

    def read(self, task: CoordinatesPartition | None) -> Iterator:
        if task is None:
            return
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, TOPIC_COLUMN
        from oncemore.core.storage import filesystem

        coverage = Coverage.from_json(self.coverage_json)
        types = {TOPIC_COLUMN: pa.string(), PARTITION_COLUMN: pa.int32(), OFFSET_COLUMN: pa.int64()}
        for quarantine, root, path, partition_values, deleted in task.files:
            fs, base = filesystem(root, self.storage)
            in_file = [c for c in types if c not in partition_values]
            deleted, first = np.asarray(deleted, dtype=np.int64), 0
            with fs.open_input_file(f"{base}/{path}") as handle:
                for batch in pq.ParquetFile(handle).iter_batches(columns=in_file, batch_size=1 << 17):
                    # Other writers' files may hold other encodings (delta-rs writes string_view).
                    table = pa.table({c: batch.column(c).cast(types[c]) for c in in_file})
                    if deleted.size:  # rows a deletion vector deletes, by their position in the file
                        keep = np.ones(table.num_rows, dtype=bool)
                        keep[deleted[(deleted >= first) & (deleted < first + table.num_rows)] - first] = False
                        first += table.num_rows
                        table = table.filter(pa.array(keep))
                    for column, text in partition_values.items():
                        if column in types:
                            table = table.append_column(column, pa.array([text] * len(table)).cast(types[column]))
                    yield from _placed(table, quarantine, coverage)


def _placed(table, quarantine: bool, coverage: Coverage) -> Iterator:
    """The rows of ``table`` (topic, partition, offset) with their segments, a batch per
    partition: sorted once by partition, then cut (a file holds a task's many partitions)."""
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
             pa.array(coverage.segments_of(topic, partition, part, quarantine), pa.int64())],
            names=["quarantine", "topic", "partition", "offset", "segment"])
