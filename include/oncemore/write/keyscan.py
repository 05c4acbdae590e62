"""One task of the key scan of an upsert's MERGE on the cluster (commit/copyonwrite.py), executor
side: its share of the table's live files (slices of their row groups), read as the rewrite reads
them (rewrite.column_batches: the keys and the order columns only, partition values from the log),
joined with the part's keys (staged Parquet, hashed once per task: the file's rows stream past it),
the matching rows staged as Parquet with the index of the file holding each. Columns Arrow's join
cannot carry (lists, structs, maps: a placeholder's stored values, commit/placeholders.py) are read
in a second pass over the same slices and taken at the matches' places.

Invariant: a task reports, per slice, the rows it read and the rows its file's footer holds, so the
driver refuses a scan that did not read every row of every live file before it classifies anything;
every row it read whose keys the part has is in its matches.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from typing import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.acero as acero
import pyarrow.parquet as pq

from oncemore.core.columns import schema_from_text
from oncemore.core.storage import filesystem
from oncemore.write.rewrite import column_batches

FILE_COLUMN = "_file"  # in a task's matches: the index of the file holding the row
_PLACE = "_place"  # in the first pass's matches: the row's place among the rows the task read


@dataclass(frozen=True)
class FileSlice:
    """A share of one live file: its row groups ``i`` with ``i % parts == part``."""

    file: int  # the file's index in the driver's list of the snapshot's live files
    path: str  # relative to the table root, URL-decoded
    partition_values: Mapping[str, str | None]  # as text, the log's
    part: int = 0
    parts: int = 1


@dataclass(frozen=True)
class ScanTask:
    """One task's share of the scan: its slices, the part's keys staged (in the table's key
    types), and where it stages its matches."""

    table_uri: str
    table_schema: str  # core.columns.schema_text of the snapshot's schema
    keys: tuple[str, ...]
    columns: tuple[str, ...]  # read beside the keys: the classification's order, a placeholder's stored values
    keys_path: str  # under the part's staging area
    found_uri: str  # the directory its matches are staged in
    slices: tuple[FileSlice, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ScanTask":
        data = json.loads(text)
        return cls(**{**data, "keys": tuple(data["keys"]), "columns": tuple(data["columns"]),
                      "slices": tuple(FileSlice(**s) for s in data["slices"])})


@dataclass(frozen=True)
class SliceRead:
    """What a task read of one slice: its rows, and the rows its file's footer says the file holds."""

    file: int
    part: int
    read: int
    rows: int


@dataclass(frozen=True)
class ScanResult:
    """What one task did: per slice, the rows read; its matches (keys, columns, FILE_COLUMN),
    ``found`` rows staged at ``found_path`` (None: no match)."""

    slices: tuple[SliceRead, ...]
    found: int
    found_path: str | None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ScanResult":
        data = json.loads(text)
        return cls(tuple(SliceRead(**s) for s in data["slices"]), data["found"], data["found_path"])


def matches_schema(schema: pa.Schema, keys: tuple[str, ...], columns: tuple[str, ...]) -> pa.Schema:
    """The schema of a task's matches on a table of ``schema``."""
    return pa.schema([schema.field(c) for c in (*keys, *columns)]).append(pa.field(FILE_COLUMN, pa.int64()))


def scan(task: ScanTask, storage_options: Mapping[str, str] | None = None) -> ScanResult:
    """The task's slices' rows whose keys the part has, staged (module docstring)."""
    schema = schema_from_text(task.table_schema)
    fs, root = filesystem(task.table_uri, storage_options)
    keys_fs, keys_path = filesystem(task.keys_path, storage_options)
    probe = pq.read_table(keys_path, filesystem=keys_fs)
    nested = tuple(c for c in task.columns if pa.types.is_nested(schema.field(c).type))
    flat = tuple(c for c in task.columns if c not in nested)
    joined = matches_schema(schema, task.keys, flat)
    if nested:
        joined = joined.append(pa.field(_PLACE, pa.int64()))
    reads: list[SliceRead] = []

    def batches() -> Iterator[pa.RecordBatch]:
        place = 0
        for share in task.slices:
            parquet, read = _open(fs, root, share), 0
            for rows in _slice_rows(parquet, share, (*task.keys, *flat), schema):
                extra = {FILE_COLUMN: np.full(rows.num_rows, share.file, np.int64)}
                if nested:
                    extra[_PLACE] = np.arange(place, place + rows.num_rows, dtype=np.int64)
                for name, values in extra.items():
                    rows = rows.append_column(joined.field(name), pa.array(values))
                read, place = read + rows.num_rows, place + rows.num_rows
                yield from rows.to_batches()
            reads.append(SliceRead(share.file, share.part, read, parquet.metadata.num_rows))

    # Acero's hash join builds on its right input (the part's keys) once, and streams the left.
    rows = acero.Declaration("record_batch_reader_source", acero.RecordBatchReaderSourceNodeOptions(
        pa.RecordBatchReader.from_batches(joined, batches())))
    keys = acero.Declaration("table_source", acero.TableSourceNodeOptions(probe.select(list(task.keys))))
    found = acero.Declaration("hashjoin", acero.HashJoinNodeOptions("left semi", list(task.keys), list(task.keys)),
                              inputs=[rows, keys]).to_table(use_threads=False)
    if not found.num_rows:
        return ScanResult(tuple(reads), 0, None)
    if nested:
        found = _with_nested(task, fs, root, schema, found.sort_by(_PLACE), nested)
    found = found.select(matches_schema(schema, task.keys, task.columns).names)
    found_fs, found_root = filesystem(task.found_uri, storage_options)
    name = f"found-{uuid.uuid4().hex}.parquet"
    pq.write_table(found, f"{found_root}/{name}", filesystem=found_fs)
    return ScanResult(tuple(reads), found.num_rows, f"{task.found_uri.rstrip('/')}/{name}")


def _open(fs, root: str, share: FileSlice) -> pq.ParquetFile:
    return pq.ParquetFile(fs.open_input_file(f"{root}/{share.path}"))


def _slice_rows(parquet: pq.ParquetFile, share: FileSlice, columns, schema: pa.Schema) -> Iterator[pa.Table]:
    return column_batches(parquet, tuple(columns), share.partition_values, schema,
                          list(range(share.part, parquet.num_row_groups, share.parts)))


def _with_nested(task: ScanTask, fs, root: str, schema: pa.Schema, found: pa.Table, nested: tuple[str, ...]) -> pa.Table:
    """``found`` (in the order of its places) with its rows' ``nested`` columns, read in a second
    pass over the task's slices in the same order (the keys beside them: a batch's rows are counted
    even where a file lacks the columns)."""
    places = found.column(_PLACE).to_numpy()
    taken, start = [], 0
    for share in task.slices:
        for rows in _slice_rows(_open(fs, root, share), share, (*task.keys, *nested), schema):
            low, high = np.searchsorted(places, [start, start + rows.num_rows])
            if high > low:
                taken.append(rows.select(list(nested)).take(pa.array(places[low:high] - start)))
            start += rows.num_rows
    values = pa.concat_tables(taken)
    for name in nested:
        found = found.append_column(schema.field(name), values.column(name))
    return found


__all__ = ["FILE_COLUMN", "FileSlice", "ScanResult", "ScanTask", "SliceRead", "matches_schema", "scan"]
