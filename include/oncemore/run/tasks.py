"""What a Spark task does with its ranges, on the executor: read each range in turn, decode it, and
account for every record of it in a RangeResult.

Two ways, one decoder and one file writer per table:
- ``ingest_ranges`` (records stay in Python: no transform, no expectations): the good rows go to
  the main table's files, the bad ones to the quarantine table's, and the RangeResults list both;
- ``decode_ranges`` (records go through Spark): the good rows are handed to Spark, the bad ones go
  to the quarantine table's files, and the RangeResults (written to the part's staging area,
  staging.py) list those; the sink's tasks write the main table's files (run/deltasink.py).
``sample_ranges`` decodes the same way and keeps both kinds of rows in memory, writing nothing
(``oncemore check --sample``). A task writes a file per table for its ranges, not one per range
(``TaskFiles``): a topic of 1,000 partitions made 1,000 files and a megabyte of Delta log per commit. The quarantine table keeps only
rows at or after its own position (``quarantine_floors``: what an earlier crash between a batch's
two commits already committed is not written again), a range may stop early at its byte budget or
at the first record whose key or value was written with a schema ahead of the reader
(``reached``, ``schema_ahead``; the rest follows in the next commit, once the run followed that
schema), and ``records``/``quarantined`` count every record read, so the driver knows how many a
transform filtered. While a task runs, Python's cyclic garbage collector is paused, and when it
ends the task gives back the memory it freed (``task_memory``): Spark reuses its Python worker for
the next one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from oncemore.commit.inputs import AheadRecord, RangeResult
from oncemore.core import hours
from oncemore.core.columns import OFFSET_COLUMN, QUARANTINE_SCHEMA, TIMESTAMP_COLUMN, schema_from_text, schema_text
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.stopwatch import TASK_PHASES, Stopwatch
from oncemore.decode.decoder import SchemaAhead
from oncemore.decode.recordspec import RecordSpec
from oncemore.decode.rows import Decoded, RecordDecoder, quarantine_rows
from oncemore.kafka.batches import RangeRecords
from oncemore.run.workermemory import task_memory
from oncemore.write.files import TableWriter, conform, unstorable_partition_values

# A RangeResult as the one row per range an ingest task yields to the driver.
MANIFEST_SCHEMA = pa.schema([("range", pa.string())])


def manifest_batch(result: RangeResult) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{"range": result.to_json()}], schema=MANIFEST_SCHEMA)


@dataclass(frozen=True)
class TaskSpec:
    """What a task needs to turn records into table files. Travels as a data source option
    (``to_json``); the storage and registry settings travel apart, one option each
    (``storage.<KEY>``, ``registry.<key>``, ``key.registry.<key>``), so Spark redacts secret ones."""

    records: RecordSpec
    table_schema: pa.Schema  # the main table's, which files are written in
    table_uri: str
    quarantine_uri: str
    partition_by: tuple[str, ...]
    # Per "topic/partition", the first offset the quarantine table still needs (its own position).
    quarantine_floors: dict[str, int]
    storage_options: dict[str, str] = field(default_factory=dict)
    value_registry: dict[str, str] | None = None
    key_registry: dict[str, str] | None = None

    def to_json(self) -> str:
        return json.dumps({
            "records": json.loads(self.records.to_json()),
            "table_schema": schema_text(self.table_schema),
            "table_uri": self.table_uri, "quarantine_uri": self.quarantine_uri, "partition_by": list(self.partition_by),
            "quarantine_floors": self.quarantine_floors,
        })

    @classmethod
    def from_json(cls, text: str, storage_options: Mapping[str, str], value_registry: Mapping[str, str] | None,
                  key_registry: Mapping[str, str] | None) -> "TaskSpec":
        data = json.loads(text)
        return cls(records=RecordSpec.from_json(json.dumps(data["records"])),
                   table_schema=schema_from_text(data["table_schema"]),
                   table_uri=data["table_uri"], quarantine_uri=data["quarantine_uri"],
                   partition_by=tuple(data["partition_by"]), quarantine_floors=data["quarantine_floors"],
                   storage_options=dict(storage_options), value_registry=dict(value_registry) if value_registry else None,
                   key_registry=dict(key_registry) if key_registry else None)

    def decoder(self) -> RecordDecoder:
        return RecordDecoder(self.records, self.value_registry, self.key_registry)

    def quarantine_writer(self) -> TableWriter:
        return TableWriter("quarantine", self.quarantine_uri, QUARANTINE_SCHEMA, (), self.storage_options)

    def main_writer(self) -> TableWriter:
        return TableWriter("main", self.table_uri, self.table_schema, self.partition_by, self.storage_options)


class TaskFiles:
    """The table writers of one Spark task's ranges, and the RangeResults that wait for their files.

    The ranges that start where their partition's part starts share one main and one quarantine
    writer, so the task writes a file per table, not one per range: the driver never drops such a
    range (committer.covered_prefix keeps every partition's first range), so a file never holds
    rows the commit leaves out. A later sub-range of a partition split across tasks gets writers of
    its own: the driver drops it, and deletes its files, when an earlier sub-range stopped short.
    """

    def __init__(self, spec: TaskSpec, part_starts: Mapping[KafkaPartition, int]):
        self.spec, self.part_starts = spec, part_starts
        self.shared = (spec.main_writer(), spec.quarantine_writer())
        self.held: list[RangeResult] = []

    def writers(self, records: RangeRecords) -> tuple[TableWriter, TableWriter]:
        """(main, quarantine) for a range about to be read."""
        if records.start == self.part_starts[KafkaPartition(records.topic, records.partition)]:
            return self.shared
        return self.spec.main_writer(), self.spec.quarantine_writer()

    def done(self, result: RangeResult, writers: tuple[TableWriter, TableWriter]) -> list[RangeResult]:
        """The results ready for the driver once ``result``'s range is read with ``writers``: its
        own, files included, when its writers are its own; none while the shared files are open."""
        if writers is self.shared:
            self.held.append(result)
            return []
        return [_with_files(result, writers)]

    def close(self) -> list[RangeResult]:
        """The results that waited for the shared files; the last one carries them."""
        held, self.held = self.held, []
        return held[:-1] + [_with_files(held[-1], self.shared)] if held else []


def _with_files(result: RangeResult, writers: tuple[TableWriter, TableWriter]) -> RangeResult:
    began = time.perf_counter()
    files = tuple(f for writer in writers for f in writer.close())
    seconds = {**result.seconds, "write": round(result.seconds.get("write", 0.0) + time.perf_counter() - began, 6)}
    return replace(result, files=result.files + files, seconds=seconds)


class _RangeDecoding:
    """One range's batches decoded, the bad records (those the floor lets through) written to the
    quarantine table, and the counts kept; yields the good rows."""

    def __init__(self, records: RangeRecords, spec: TaskSpec, decoder: RecordDecoder, check_partitions: bool,
                 quarantine: TableWriter):
        self.records, self.spec, self.decoder = records, spec, decoder
        self.check_partitions = check_partitions
        self.quarantine = quarantine
        self.floor = spec.quarantine_floors[f"{records.topic}/{records.partition}"]
        self.count = self.quarantined = 0
        self.hours: hours.Hours = {}  # rows written (counted by the caller that writes them) and quarantined
        self.schema_ahead: str | None = None
        self.watch = Stopwatch()

    def rows(self) -> Iterator[pa.Table]:
        batches = iter(self.records)
        while True:
            with self.watch.timing("read"):
                batch = next(batches, None)
            if batch is None:
                return
            with self.watch.timing("decode"):
                kept, decoded, ahead = self._decoded_before_ahead(batch)
            if ahead is not None:
                # Stop before the record whose writer schema the reader lacks: the run follows it.
                offset = batch.column("offset")[ahead.index].as_py()
                self.records.stop_at(offset)
                self.schema_ahead = str(AheadRecord(ahead.role, ahead.schema_id, self.records.topic,
                                                    self.records.partition, offset))
            yield from self._accounted(kept, decoded)
            if ahead is not None:
                return

    def _decoded_before_ahead(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, Decoded, SchemaAhead | None]:
        """The batch up to its first record whose writer schema is ahead of the reader (all of it
        when none is), decoded, and that record's SchemaAhead. Cut until the part before decodes,
        so a record ahead in its key behind one ahead in its value cannot escape the range."""
        ahead = None
        while True:
            try:
                return batch, self.decoder.decode(batch), ahead
            except SchemaAhead as found:
                ahead, batch = found, batch.slice(0, found.index)

    def _accounted(self, batch: pa.RecordBatch, decoded) -> Iterator[pa.Table]:
        good, bad = decoded.good, decoded.bad
        if self.check_partitions and good.num_rows:
            unstorable = unstorable_partition_values(good, self.spec.partition_by)
            if unstorable:
                rows = sorted(unstorable)
                offsets = set(good.column(OFFSET_COLUMN).take(rows).to_pylist())
                read = pa.Table.from_batches([batch])
                read = read.filter(pc.is_in(read.column("offset"), pa.array(sorted(offsets), pa.int64())))
                bad = pa.concat_tables([bad, quarantine_rows(read, [unstorable[r] for r in rows])])
                keep = pc.invert(pc.is_in(good.column(OFFSET_COLUMN), pa.array(sorted(offsets), pa.int64())))
                good = good.filter(keep)
        self.count += batch.num_rows
        self.quarantined += bad.num_rows
        hours.count(self.hours, bad.column(TIMESTAMP_COLUMN), hours.QUARANTINED)
        if bad.num_rows:
            with self.watch.timing("write"):
                self.quarantine.write(bad.filter(pc.greater_equal(bad.column(OFFSET_COLUMN), self.floor)))
        if good.num_rows:
            yield good

    def result(self) -> RangeResult:
        """What the range did; its files follow from TaskFiles."""
        records = self.records
        return RangeResult(records.topic, records.partition, records.start, records.end, records.reached,
                           records.bytes_read, self.count, self.quarantined, (), self.schema_ahead,
                           {p: round(self.watch.seconds[p], 6) for p in TASK_PHASES}, self.hours)


def ingest_ranges(ranges: Iterable[RangeRecords], spec: TaskSpec, decoder: RecordDecoder,
                  part_starts: Mapping[KafkaPartition, int]) -> Iterator[RangeResult]:
    """Decodes a task's ranges and writes their records as Parquet files into both tables."""
    files = TaskFiles(spec, part_starts)
    with task_memory():
        for records in ranges:
            main, quarantine = writers = files.writers(records)
            decoding = _RangeDecoding(records, spec, decoder, True, quarantine)
            for good in decoding.rows():
                hours.count(decoding.hours, good.column(TIMESTAMP_COLUMN), hours.WRITTEN)
                with decoding.watch.timing("write"):
                    main.write(conform(good, spec.table_schema))
            yield from files.done(decoding.result(), writers)
        yield from files.close()


class _KeptRows:
    """Stands in for the quarantine table's writer where nothing may be written: keeps the rows."""

    def __init__(self):
        self.tables: list[pa.Table] = []

    def write(self, table: pa.Table) -> None:
        self.tables.append(table)


def sample_ranges(ranges: Iterable[RangeRecords], spec: TaskSpec, decoder: RecordDecoder,
                  check_partitions: bool) -> tuple[list[RangeResult], list[pa.Table], pa.Table]:
    """Ranges decoded as a task decodes them, in this process, writing nothing: their RangeResults,
    the good rows, and the quarantine rows (QUARANTINE_SCHEMA, with the reasons)."""
    results, good, bad = [], [], _KeptRows()
    for records in ranges:
        decoding = _RangeDecoding(records, spec, decoder, check_partitions, bad)
        good += list(decoding.rows())
        results.append(decoding.result())
    return results, good, pa.concat_tables(bad.tables) if bad.tables else QUARANTINE_SCHEMA.empty_table()


def decode_ranges(ranges: Iterable[RangeRecords], spec: TaskSpec, decoder: RecordDecoder,
                  part_starts: Mapping[KafkaPartition, int]) -> Iterator[pa.Table | RangeResult]:
    """A task's good rows, for Spark, while its quarantine rows are written to files; each range's
    RangeResult once it is ready (after its rows)."""
    files = TaskFiles(spec, part_starts)
    with task_memory():
        for records in ranges:
            writers = files.writers(records)
            decoding = _RangeDecoding(records, spec, decoder, False, writers[1])
            yield from decoding.rows()
            yield from files.done(decoding.result(), writers)
        yield from files.close()
