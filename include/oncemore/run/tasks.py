"""What a Spark task does with its ranges, on the executor: read each range in turn, route and
decode it, and account for every record of it in a RangeResult.

Two ways, one decoder and one file writer per table:
- ``ingest_ranges`` (records stay in Python: no transform, no expectations): the good rows go to
  their table's files (the main table's, or with routes, each record's route's: decode/routing.py),
  the bad ones to the quarantine table's, and the RangeResults list them all;
- ``decode_ranges`` (records go through Spark): the good rows are handed to Spark, the bad ones go
  to the quarantine table's files, and the RangeResults (written to the part's staging area,
  staging.py) list those; the sink's tasks write the main table's files (run/deltasink.py).
``sample_ranges`` decodes the same way and keeps both kinds of rows in memory, writing nothing
(``oncemore check --sample``). A task writes a file per table for its ranges, not one per range
(``TaskFiles``): a topic of 1,000 partitions made 1,000 files and a megabyte of Delta log per commit.
Each table keeps only rows at or after its own position (its floors, taskspec.py: what an earlier
crash between a part's commits already committed is not written again; ``held`` counts them), a
range may stop early at its byte budget or at the first record whose key or value was written with
a schema ahead of its reader (``reached``, ``schema_ahead``; the rest follows in the next commit,
once the run followed that schema), and ``records``/``quarantined``/``unrouted`` count every record
read, so the driver knows how many a transform filtered. While a task runs, Python's cyclic garbage
collector is paused, and when it ends the task gives back the memory it freed (``task_memory``):
Spark reuses its Python worker for the next one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from oncemore.commit.inputs import AheadRecord, RangeResult
from oncemore.core import hours
from oncemore.core.columns import OFFSET_COLUMN, QUARANTINE_SCHEMA, QUARANTINE_TAG, TIMESTAMP_COLUMN
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.stopwatch import TASK_PHASES, Stopwatch
from oncemore.decode.decoder import SchemaAhead
from oncemore.decode.routing import Router
from oncemore.decode.rows import Decoded, RecordDecoder, quarantine_rows
from oncemore.kafka.batches import RangeRecords
from oncemore.run.taskspec import TableSpec, TaskSpec
from oncemore.run.workermemory import task_memory
from oncemore.write.files import TableWriter
from oncemore.write.fit import conform, unstorable_rows

# A RangeResult as the one row per range an ingest task yields to the driver.
MANIFEST_SCHEMA = pa.schema([("range", pa.string())])


def manifest_batch(result: RangeResult) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{"range": result.to_json()}], schema=MANIFEST_SCHEMA)


class TaskFiles:
    """The table writers of one Spark task's ranges, and the RangeResults that wait for their files.

    The ranges that start where their partition's part starts share one writer per table, so the
    task writes a file per table, not one per range: the driver never drops such a range
    (committer.covered_prefix keeps every partition's first range), so a file never holds rows the
    commit leaves out. A later sub-range of a partition split across tasks gets writers of its own:
    the driver drops it, and deletes its files, when an earlier sub-range stopped short.
    """

    def __init__(self, spec: TaskSpec, part_starts: Mapping[KafkaPartition, int]):
        self.spec, self.part_starts = spec, part_starts
        self.shared = spec.writers()
        self.held: list[RangeResult] = []

    def writers(self, records: RangeRecords) -> dict[str, TableWriter]:
        """The writers, by tag, for a range about to be read."""
        if records.start == self.part_starts[KafkaPartition(records.topic, records.partition)]:
            return self.shared
        return self.spec.writers()

    def done(self, result: RangeResult, writers: dict[str, TableWriter]) -> list[RangeResult]:
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


def _with_files(result: RangeResult, writers: dict[str, TableWriter]) -> RangeResult:
    began = time.perf_counter()
    files = tuple(f for writer in writers.values() for f in writer.close())
    seconds = {**result.seconds, "write": round(result.seconds.get("write", 0.0) + time.perf_counter() - began, 6)}
    return replace(result, files=result.files + files, seconds=seconds)


class _RangeDecoding:
    """One range's batches routed to their tables (one table: every record to it), decoded, the bad
    records (those the quarantine table's floor lets through) written to the quarantine table, and
    the counts kept; yields each table's good rows at or after its floor."""

    def __init__(self, records: RangeRecords, spec: TaskSpec, decoders: Mapping[str, RecordDecoder],
                 check_storable: bool, quarantine):
        self.records, self.spec, self.decoders = records, spec, decoders
        self.check_storable = check_storable
        self.quarantine = quarantine
        key = f"{records.topic}/{records.partition}"
        self.floor = spec.quarantine_floors[key]
        self.table_floors = {t.tag: t.floors.get(key, 0) for t in spec.tables}
        self.router = Router(spec.router) if spec.router is not None else None
        self.count = self.quarantined = self.unrouted = self.held = 0
        self.hours: hours.Hours = {}  # rows written (counted by the caller that writes them) and quarantined
        self.table_hours: dict[str, hours.Hours] = {}  # routes: per table, the rows it was given (by the caller)
        self.schema_ahead: str | None = None
        self.watch = Stopwatch()
        self._ahead_table = "main"

    def rows(self) -> Iterator[tuple[TableSpec, pa.Table]]:
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
                                                    self.records.partition, offset, self._ahead_table))
            yield from self._accounted(kept, *decoded)
            if ahead is not None:
                return

    def _decoded_before_ahead(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, tuple, SchemaAhead | None]:
        """The batch up to its first record whose writer schema is ahead of its reader (all of it
        when none is), decoded, and that record's SchemaAhead. Cut until the part before decodes,
        so a record ahead in its key behind one ahead in its value cannot escape the range."""
        ahead = None
        while True:
            try:
                return batch, self._decoded(batch), ahead
            except SchemaAhead as found:
                ahead, batch = found, batch.slice(0, found.index)

    def _decoded(self, batch: pa.RecordBatch) -> tuple[list[tuple[TableSpec, Decoded]], pa.Table, pa.Array]:
        """Each table's records of ``batch`` decoded; the quarantine rows of the records no route
        takes or whose route cannot be read; the offsets of the unrouted records skipped. SchemaAhead
        for the batch's first record ahead of its table's reader."""
        if self.router is None:
            table = self.spec.tables[0]
            return [(table, self.decoders[table.tag].decode(batch))], _NO_ROWS, _NO_OFFSETS
        routed = self.router.route(batch)
        found, aheads = [], []
        for i, table in enumerate(self.spec.tables):
            rows = np.flatnonzero(routed.index == i)
            if not len(rows):
                continue
            try:
                found.append((table, self.decoders[table.tag].decode(
                    batch if len(rows) == batch.num_rows else batch.take(pa.array(rows)))))
            except SchemaAhead as ahead:
                aheads.append((int(rows[ahead.index]), table.tag, ahead))
        if aheads:
            index, self._ahead_table, ahead = min(aheads, key=lambda a: a[0])
            raise SchemaAhead(index, ahead.schema_id, str(ahead), ahead.role)
        reasons = dict(routed.malformed)
        if not self.spec.skip_unrouted:
            reasons.update(routed.unrouted)
        rows = sorted(reasons)
        bad = quarantine_rows(pa.Table.from_batches([batch]).take(rows), [reasons[r] for r in rows]) if rows else _NO_ROWS
        skipped = (batch.column("offset").take(sorted(routed.unrouted)) if self.spec.skip_unrouted and routed.unrouted
                   else _NO_OFFSETS)
        return found, bad, skipped

    def _accounted(self, batch: pa.RecordBatch, decoded: list[tuple[TableSpec, Decoded]], unrouted: pa.Table,
                   skipped: pa.Array) -> Iterator[tuple[TableSpec, pa.Table]]:
        bad_rows = [unrouted]
        for table, found in decoded:
            good, bad = found.good, found.bad
            if self.check_storable and good.num_rows:
                good, bad = self._storable(batch, table, good, bad)
            bad_rows.append(bad)
            floor = self.table_floors[table.tag]
            if good.num_rows and floor:  # rows another commit of the table holds (tables.py) are not written again
                offsets = good.column(OFFSET_COLUMN)
                needed = pc.greater_equal(offsets, floor)
                self.held += good.num_rows - pc.sum(needed).as_py() if pc.any(pc.invert(needed)).as_py() else 0
                good = good.filter(needed)
            if good.num_rows:
                yield table, good
        bad = pa.concat_tables(bad_rows) if len(bad_rows) > 1 else bad_rows[0]
        self.count += batch.num_rows
        self.quarantined += bad.num_rows
        hours.count(self.hours, bad.column(TIMESTAMP_COLUMN), hours.QUARANTINED)
        if bad.num_rows:
            kept = bad.filter(pc.greater_equal(bad.column(OFFSET_COLUMN), self.floor))
            if self.router is not None:
                hours.count(self.table_hours.setdefault(QUARANTINE_TAG, {}), kept.column(TIMESTAMP_COLUMN),
                            hours.QUARANTINED)
            with self.watch.timing("write"):
                self.quarantine.write(kept)
        if len(skipped):
            counted = pc.sum(pc.greater_equal(skipped, self.floor)).as_py() or 0
            self.unrouted += counted
            self.held += len(skipped) - counted

    def _storable(self, batch: pa.RecordBatch, table: TableSpec, good: pa.Table, bad: pa.Table) -> tuple[pa.Table, pa.Table]:
        """``good`` without the rows ``table`` cannot hold (a partition value, a column's value), which join ``bad``."""
        unstorable = unstorable_rows(good, table.table_schema, table.partition_by)
        if not unstorable:
            return good, bad
        rows = sorted(unstorable)
        offsets = set(good.column(OFFSET_COLUMN).take(rows).to_pylist())
        read = pa.Table.from_batches([batch])
        read = read.filter(pc.is_in(read.column("offset"), pa.array(sorted(offsets), pa.int64())))
        bad = pa.concat_tables([bad, quarantine_rows(read, [unstorable[r] for r in rows])])
        keep = pc.invert(pc.is_in(good.column(OFFSET_COLUMN), pa.array(sorted(offsets), pa.int64())))
        return good.filter(keep), bad

    def result(self) -> RangeResult:
        """What the range did; its files follow from TaskFiles."""
        records = self.records
        return RangeResult(records.topic, records.partition, records.start, records.end, records.reached,
                           records.bytes_read, self.count, self.quarantined, (), self.schema_ahead,
                           {p: round(self.watch.seconds[p], 6) for p in TASK_PHASES}, self.hours,
                           self.unrouted, self.held, self.table_hours)


_NO_ROWS = QUARANTINE_SCHEMA.empty_table()
_NO_OFFSETS = pa.array([], pa.int64())


def ingest_ranges(ranges: Iterable[RangeRecords], spec: TaskSpec, decoders: Mapping[str, RecordDecoder],
                  part_starts: Mapping[KafkaPartition, int]) -> Iterator[RangeResult]:
    """Decodes a task's ranges and writes their records as Parquet files into their tables."""
    files = TaskFiles(spec, part_starts)
    with task_memory():
        for records in ranges:
            writers = files.writers(records)
            decoding = _RangeDecoding(records, spec, decoders, True, writers[QUARANTINE_TAG])
            for table, good in decoding.rows():
                hours.count(decoding.hours, good.column(TIMESTAMP_COLUMN), hours.WRITTEN)
                if decoding.router is not None:
                    hours.count(decoding.table_hours.setdefault(table.tag, {}), good.column(TIMESTAMP_COLUMN),
                                hours.WRITTEN)
                with decoding.watch.timing("write"):
                    writers[table.tag].write(conform(good, table.table_schema))
            yield from files.done(decoding.result(), writers)
        yield from files.close()


class _KeptRows:
    """Stands in for the quarantine table's writer where nothing may be written: keeps the rows."""

    def __init__(self):
        self.tables: list[pa.Table] = []

    def write(self, table: pa.Table) -> None:
        self.tables.append(table)


def sample_ranges(ranges: Iterable[RangeRecords], spec: TaskSpec, decoders: Mapping[str, RecordDecoder],
                  check_storable: bool) -> tuple[list[RangeResult], list[tuple[str, pa.Table]], pa.Table]:
    """Ranges decoded as a task decodes them, in this process, writing nothing: their RangeResults,
    the good rows (by the tag of their table), and the quarantine rows (QUARANTINE_SCHEMA, with the reasons)."""
    results, good, bad = [], [], _KeptRows()
    for records in ranges:
        decoding = _RangeDecoding(records, spec, decoders, check_storable, bad)
        good += [(table.tag, rows) for table, rows in decoding.rows()]
        results.append(decoding.result())
    return results, good, pa.concat_tables(bad.tables) if bad.tables else QUARANTINE_SCHEMA.empty_table()


def decode_ranges(ranges: Iterable[RangeRecords], spec: TaskSpec, decoder: RecordDecoder,
                  part_starts: Mapping[KafkaPartition, int]) -> Iterator[pa.Table | RangeResult]:
    """A task's good rows (of a pipeline without routes), for Spark, while its quarantine rows are
    written to files; each range's RangeResult once it is ready (after its rows)."""
    files = TaskFiles(spec, part_starts)
    with task_memory():
        for records in ranges:
            writers = files.writers(records)
            decoding = _RangeDecoding(records, spec, {spec.main.tag: decoder}, False, writers[QUARANTINE_TAG])
            yield from (rows for _, rows in decoding.rows())
            yield from files.done(decoding.result(), writers)
        yield from files.close()
