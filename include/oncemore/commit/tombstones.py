"""An upsert part's deletes kept in its tombstones table (merge.py: deletes hold against late
events), with the positions of their partitions, by a delta-rs MERGE on the driver whatever
``upsert.merge`` says: it holds deletes only, a small table beside the main one.

Invariant: a newer delete replaces an older one of its key, one the table holds already changes
nothing, and the positions there only ever move forward.
"""

from __future__ import annotations

import time

import pyarrow as pa

from oncemore.commit.committer import check_committable, merge
from oncemore.core.columns import DELETED_AT_FIELD, OFFSET_COLUMN, PARTITION_COLUMN, SEQUENCE_COLUMN, TIMESTAMP, \
    TIMESTAMP_COLUMN, TOPIC_COLUMN
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger

ORDER = (TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN)
# DataFusion's memory for one MERGE before it spills (delta-rs's default pool is unbounded).
MERGE_MEMORY_BYTES = 1 << 30


def on_keys(keys: tuple[str, ...]) -> str:
    return " AND ".join(f"t.`{k}` = s.`{k}`" for k in keys)


def keep_deletes(tombstones: Ledger, deletes: pa.Table, new_positions, partitions, record: CommitInfo) -> None:
    """The deletes MERGEd into the tombstones table (a newer delete replaces an older one of its
    key; one it holds already changes nothing) with the positions of their partitions, which only
    ever move forward there. Always MERGEd, whatever the positions say: after a reset rewound the
    main table, or a maintenance forgot them, the tombstones table may hold positions past deletes
    it does not hold."""
    table = tombstones.snapshot()
    touched = {KafkaPartition(t, p) for t, p in zip(deletes.column(TOPIC_COLUMN).to_pylist(),
                                                    deletes.column(PARTITION_COLUMN).to_pylist())}
    current = tombstones.positions(touched, table)
    moves = {p: max(new_positions[p], current[p] or 0) for p in touched}
    check_committable(tombstones, table, {p.topic for p in touched})
    now = pa.array([int(time.time() * 1_000_000)] * deletes.num_rows, pa.int64()).cast(TIMESTAMP)
    source = deletes.append_column(DELETED_AT_FIELD, now)
    target = pa.schema(table.schema().to_arrow())
    schema = pa.schema([target.field(n) for n in source.column_names])
    source = source.cast(schema)
    newer = " OR ".join(_newer_sql())

    def clauses(merger):
        return merger.when_matched_update_all(predicate=newer).when_not_matched_insert_all()

    keys = [n for n in deletes.column_names if n not in (SEQUENCE_COLUMN, *ORDER, TIMESTAMP_COLUMN)]
    merge(tombstones, table, source, on_keys(tuple(keys)), clauses, current, moves, partitions, record,
          MERGE_MEMORY_BYTES)


def _newer_sql() -> list[str]:
    """SQL: s's event comes after t's (the sequence, then the coordinates), as disjuncts."""
    names = [SEQUENCE_COLUMN, *ORDER]
    terms = []
    for i, name in enumerate(names):
        equal = [f"s.{n} = t.{n}" for n in names[:i]]
        terms.append(" AND ".join([*equal, f"s.{name} > t.{name}"]))
    return [f"({t})" for t in terms]


__all__ = ["MERGE_MEMORY_BYTES", "keep_deletes", "on_keys"]
