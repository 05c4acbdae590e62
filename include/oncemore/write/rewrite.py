"""One task of an upsert's copy-on-write (commit/copyonwrite.py), executor side: the table's files
it was given, read row group by row group, without the rows whose keys the part changes, then the
part's new rows, written as the table's other files are (files.py: its schema, partition
directories, statistics).

Invariant: a task reports every row it read, dropped and added, and the files it wrote, so the
driver can refuse a rewrite whose rows do not add up before anything is committed; the files it
writes are invisible until that commit references them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from oncemore.core.columns import CHANGE_COLUMN, schema_from_text
from oncemore.core.storage import filesystem
from oncemore.write.files import DataFile, TableWriter
from oncemore.write.fit import conform

ROW_GROUP_BATCH_ROWS = 100_000  # rows of a touched file in memory at once


@dataclass(frozen=True)
class TouchedFile:
    """A table file holding at least one key the part changes, as its add action says."""

    path: str  # relative to the table root, as stored (the Delta log's, URL-decoded)
    size: int
    partition_values: Mapping[str, str | None]  # as text, the log's
    keys_held: int  # how many keys of the part's change rows it holds (each key is on one row of the table)


@dataclass(frozen=True)
class RewriteTask:
    """One task's share: the files it rewrites and its staged change rows (Parquet: the upserts
    whole, the deletes by key, with the change column), its new rows being the upserts."""

    table_uri: str
    table_schema: str  # core.columns.schema_text of the snapshot's schema
    partition_by: tuple[str, ...]
    keys: tuple[str, ...]
    changes_path: str  # under the part's staging area (filesystem of table_uri's storage)
    files: tuple[TouchedFile, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RewriteTask":
        data = json.loads(text)
        data["files"] = tuple(TouchedFile(**f) for f in data["files"])
        return cls(**{**data, "partition_by": tuple(data["partition_by"]), "keys": tuple(data["keys"])})


@dataclass(frozen=True)
class RewriteResult:
    """What one task did: rows read from its files, dropped (their keys changed), added (the
    upserts), and the files it wrote."""

    read: int
    dropped: int
    added: int
    files: tuple[DataFile, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "files": [f.__dict__ for f in self.files]})

    @classmethod
    def from_json(cls, text: str) -> "RewriteResult":
        data = json.loads(text)
        return cls(data["read"], data["dropped"], data["added"], tuple(DataFile.from_dict(f) for f in data["files"]))


def rewrite(task: RewriteTask, storage_options: Mapping[str, str] | None = None) -> RewriteResult:
    """The task's files without the changed keys' rows, and its upserts, written (module docstring)."""
    schema = schema_from_text(task.table_schema)
    fs, root = filesystem(task.table_uri, storage_options)
    changes_fs, changes_path = filesystem(task.changes_path, storage_options)
    changes = pq.read_table(changes_path, filesystem=changes_fs)
    keys = list(task.keys)
    probe = changes.select(keys).cast(pa.schema([schema.field(k) for k in keys]))
    writer = TableWriter("main", task.table_uri, schema, task.partition_by, storage_options)
    read = dropped = 0
    for touched in task.files:
        parquet = pq.ParquetFile(fs.open_input_file(f"{root}/{touched.path}"))
        for batch in parquet.iter_batches(batch_size=ROW_GROUP_BATCH_ROWS):
            # In the table's types first: another writer's file may hold other encodings (string_view).
            rows = conform(_with_partition_values(pa.Table.from_batches([batch]), touched.partition_values, schema),
                           schema)
            kept = _without(rows, probe, keys)
            read, dropped = read + rows.num_rows, dropped + rows.num_rows - kept.num_rows
            writer.write(kept)
    upserts = changes.filter(pc.equal(changes.column(CHANGE_COLUMN), "upsert")).drop_columns([CHANGE_COLUMN])
    writer.write(conform(upserts, schema))
    return RewriteResult(read, dropped, upserts.num_rows, tuple(writer.close()))


def column_batches(parquet: pq.ParquetFile, columns: tuple[str, ...], partition_values: Mapping[str, str | None],
                   schema: pa.Schema, row_groups: list[int] | None = None) -> Iterator[pa.Table]:
    """A table file's ``columns`` (in ``schema``'s types; one the file lacks as NULL), its
    ``row_groups`` (all: None) batch by batch, as ``rewrite`` reads the file (the cluster's key scan,
    keyscan.py, and removable.py read keys with it)."""
    present = set(parquet.schema_arrow.names)
    stored = [c for c in columns if c not in partition_values and c in present]
    kinds = pa.schema([schema.field(c) for c in columns])
    groups = list(range(parquet.num_row_groups)) if row_groups is None else row_groups
    if not groups:
        return
    for batch in parquet.iter_batches(batch_size=ROW_GROUP_BATCH_ROWS, columns=stored, row_groups=groups):
        rows = _with_partition_values(pa.Table.from_batches([batch]), partition_values, schema)
        yield conform(rows, kinds)


def _with_partition_values(rows: pa.Table, values: Mapping[str, str | None], schema: pa.Schema) -> pa.Table:
    """A file's rows with its partition columns as the log's partition values say (Delta keeps
    them in the log; delta-spark writes them in the file too, and the log's are authoritative)."""
    rows = rows.drop_columns([c for c in values if c in rows.column_names])
    for column, text in values.items():
        kind = schema.field(column).type
        # A timestamp's text is in UTC without a zone (files.partition_value_text): parsed as such.
        parsed = pa.timestamp(kind.unit) if pa.types.is_timestamp(kind) else kind
        value = pa.array([text], pa.string()).cast(parsed).cast(kind)[0] if text is not None else pa.scalar(None, kind)
        rows = rows.append_column(pa.field(column, kind), pa.array([value.as_py()] * rows.num_rows, kind))
    return rows


def _without(rows: pa.Table, probe: pa.Table, keys: list[str]) -> pa.Table:
    """``rows`` but those whose keys are in ``probe`` (joined on the keys alone: Arrow's join takes
    no nested payload)."""
    if not probe.num_rows or not rows.num_rows:
        return rows
    left = rows.select(keys).cast(probe.schema).append_column("_row", pa.array(range(rows.num_rows), pa.int64()))
    kept = left.join(probe, keys, join_type="left anti").column("_row")
    return rows.take(pc.take(kept, pc.sort_indices(kept)))  # in the file's order


__all__ = ["RewriteResult", "RewriteTask", "TouchedFile", "column_batches", "rewrite"]
