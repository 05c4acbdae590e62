"""The rows a table holds of an upsert part's keys (merge.py): read by this process, or the
cluster's key scan's matches (copyonwrite.scan_keys), typed alike; and per key of the part, the
row of its key.

Invariant: values are taken by row number, never carried through a join (Arrow's join takes no
nested payload, such as a placeholder's array), and a key of the part gets at most its one row.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable


def matched(latest: pa.Table, other: pa.Table, keys, columns: list[str]) -> pa.Table:
    """Per row of ``latest`` (one per key), ``other``'s ``columns`` of its key (NULL where ``other``
    has none; it has at most one per key) and ``_present``."""
    left = latest.select(list(keys)).append_column("_row", pa.array(range(latest.num_rows), pa.int64()))
    right = other.select(list(keys)).append_column("_at", pa.array(range(other.num_rows), pa.int64()))
    at = left.join(right, list(keys), join_type="left outer").sort_by("_row").column("_at")
    return pa.table({**{n: other.column(n).take(at) for n in columns}, "_present": pc.is_valid(at)})


def typed(rows: pa.Table, keys: list[str], columns: list[str], like: pa.Schema) -> pa.Table:
    """``rows``' keys and ``columns``, typed as in ``like``."""
    return rows.select([*keys, *columns]).cast(pa.schema([like.field(n).with_nullable(True) for n in (*keys, *columns)]))


def read(table: DeltaTable, keys: list[str], probe: pa.Table, columns: list[str], like: pa.Schema) -> pa.Table:
    """The table's rows of the keys in ``probe``: keys and ``columns`` (typed), batch by batch, only
    the matches kept. Not through a pushed-down filter: pyarrow prunes by the files' statistics,
    which delta-rs writes truncated for long strings (the filter then fails on every run)."""
    wanted = [*keys, *columns]
    schema = pa.schema([like.field(n).with_nullable(True) for n in wanted])
    if not probe.num_rows:
        return schema.empty_table()
    probe = probe.select(keys)
    found = []
    for batch in table.to_pyarrow_dataset().to_batches(columns=wanted):
        if batch.num_rows:
            rows = pa.Table.from_batches([batch]).select(wanted).cast(schema)
            at = rows.select(keys).append_column("_at", pa.array(range(rows.num_rows), pa.int64()))
            found.append(rows.take(at.join(probe, keys, join_type="left semi").column("_at")))
    return pa.concat_tables(found) if found else schema.empty_table()


__all__ = ["matched", "read", "typed"]
