"""One part of an upsert batch applied to its tables: the change rows the tasks staged, reduced to
the last event per key, MERGEd into the main table in the commit that records the positions.

Order: without ``sequence_by``, Kafka's offsets (a key seen in two partitions refuses the part:
the order between them is undefined); with it, the greatest sequence wins, ties by (topic,
partition, offset), the coordinates kept in the row. Each event counts once: ``inserted``,
``updated``, ``deleted`` (a row removed), ``noop_deletes`` (a delete of a key the table does not
hold), ``stale`` (not newer than the row or the delete the tables hold: changes nothing),
``superseded`` (a later event of its key in the same part), ``tombstones`` (under sequence_by, a
null value is Kafka's compaction marker: counted, not applied); with ``quarantined`` and
``filtered`` they account for every record read. ``written`` is every change row that reached the
MERGE, the sum of the first seven.

Deletes hold against late events: under sequence_by, every applied delete (noop ones included) is
MERGEd into the tombstones table (key, sequence, coordinates, when) with its positions, *before*
the main commit, as the quarantine table's part is; the main MERGE builds on it, so a crash
between the two leaves a delete that the rerun applies again (an event equal to a held delete is
that delete, not stale). The main table holds only live rows.

The events are classified against the snapshot the MERGE runs on, and the MERGE applies exactly
the ones that change a row; a MERGE that changes nothing is a commit of the positions alone
(committer.merge). delta-rs's counts are checked against the classification.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from functools import reduce

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from oncemore.commit.committer import CommitOutcome, check_committable, held, merge
from oncemore.core import crashpoints
from oncemore.core.columns import (
    CHANGE_COLUMN,
    DELETED_AT_FIELD,
    OFFSET_COLUMN,
    PARTITION_COLUMN,
    SEQUENCE_COLUMN,
    TIMESTAMP,
    TIMESTAMP_COLUMN,
    TOPIC_COLUMN,
)
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.errors import OncemoreError
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger

log = logging.getLogger("oncemore")

COUNTS = ("inserted", "updated", "deleted", "noop_deletes", "stale", "superseded", "tombstones")
ORDER = (TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN)
# DataFusion's memory for one MERGE before it spills (delta-rs's default pool is unbounded).
MERGE_MEMORY_BYTES = 1 << 30


class KeyInTwoPartitions(OncemoreError):
    """Without sequence_by, one key's events came from two partitions: their order is undefined."""


class MergeMiscount(OncemoreError):
    """delta-rs's MERGE changed other rows than the classification said (after its commit landed)."""


@dataclass(frozen=True)
class UpsertSpec:
    """What a part's MERGE needs of the pipeline's upsert block; travels in the part's JSON."""

    keys: tuple[str, ...]  # as the table names them
    sequenced: bool
    tombstones_uri: str | None


@dataclass
class Changes:
    """A part's change rows reduced: one per key, with the counts of the events left behind."""

    latest: pa.Table
    counts: dict[str, int]


def reduce_changes(rows: pa.Table, spec: UpsertSpec, pipeline: str) -> Changes:
    """The last event per key (module docstring: order); under sequence_by, tombstones left out."""
    counts = dict.fromkeys(COUNTS, 0)
    kind = rows.column(CHANGE_COLUMN)
    if spec.sequenced:
        markers = pc.equal(kind, "tombstone")
        counts["tombstones"] = pc.sum(markers).as_py() or 0
        rows = rows.filter(pc.invert(markers))
        order = [SEQUENCE_COLUMN, *ORDER]
    else:
        rows = rows.set_column(rows.schema.get_field_index(CHANGE_COLUMN), CHANGE_COLUMN,
                               pc.if_else(pc.equal(kind, "tombstone"), "delete", kind))
        _one_partition_per_key(rows, spec.keys, pipeline)
        order = list(ORDER)
    rows = rows.sort_by([(k, "ascending") for k in (*spec.keys, *order)])
    last = None
    for key in spec.keys:
        column = rows.column(key)
        differs = pc.not_equal(column.slice(0, len(column) - 1), column.slice(1))
        last = differs if last is None else pc.or_(last, differs)
    if rows.num_rows:
        ends = pa.concat_arrays([(last.combine_chunks() if last is not None else pa.array([], pa.bool_())),
                                 pa.array([True])])
        latest = rows.filter(ends)
    else:
        latest = rows
    counts["superseded"] = rows.num_rows - latest.num_rows
    return Changes(latest, counts)


def _one_partition_per_key(rows: pa.Table, keys: tuple[str, ...], pipeline: str) -> None:
    where = pc.binary_join_element_wise(rows.column(TOPIC_COLUMN),
                                        pc.cast(rows.column(PARTITION_COLUMN), pa.string()), "/")
    grouped = rows.select(list(keys)).append_column("_where", where).group_by(list(keys)).aggregate(
        [("_where", "count_distinct")])
    twice = grouped.filter(pc.greater(grouped.column("_where_count_distinct"), 1))
    if twice.num_rows:
        key = {k: v for k, v in twice.slice(0, 1).to_pylist()[0].items() if k in keys}
        mine = rows.filter(reduce(pc.and_, [pc.equal(rows.column(k), v) for k, v in key.items()]))
        events = sorted(zip(mine.column(TOPIC_COLUMN).to_pylist(), mine.column(PARTITION_COLUMN).to_pylist(),
                            mine.column(OFFSET_COLUMN).to_pylist()))
        partitions = sorted({f"{t}/{p}" for t, p, _ in events})
        raise KeyInTwoPartitions(
            f"pipeline {pipeline}: key {key} has events in partitions {', '.join(partitions)} of this batch (at "
            f"{', '.join(f'{t}/{p} offset {o}' for t, p, o in events[:6])}{', ...' if len(events) > 6 else ''}; "
            f"{twice.num_rows} keys in all): without upsert.sequence_by their order is undefined; nothing of the "
            "batch was committed (set sequence_by, or keep one key in one partition)",
            key=str(key), partitions=partitions, offsets=[f"{t}/{p}:{o}" for t, p, o in events], keys=twice.num_rows)


def _newer(a: pa.Table, b: pa.Table) -> pa.Array:
    """Row by row, whether ``a``'s event comes after ``b``'s (``b``'s may be NULL: then True).
    Order: the sequence, then the coordinates."""
    names = [SEQUENCE_COLUMN, *ORDER]
    result = pa.array([False] * a.num_rows, pa.bool_())
    for name in reversed(names):  # lexicographic, built from the last column up
        x, y = a.column(name), b.column(name)
        result = pc.or_(pc.greater(x, y), pc.and_(pc.equal(x, y), result))
    return pc.fill_null(result, True)


def _matched(latest: pa.Table, other: pa.Table, keys: tuple[str, ...], columns: list[str]) -> pa.Table:
    """Per row of ``latest`` (one per key), ``other``'s ``columns`` of its key (NULL where ``other``
    has none; it has at most one per key) and ``_present``. Only keys and ``columns`` are joined:
    Arrow's join takes no nested payload."""
    left = latest.select(list(keys)).append_column("_row", pa.array(range(latest.num_rows), pa.int64()))
    right = other.select([*keys, *columns]).append_column("_present", pa.array([True] * other.num_rows, pa.bool_()))
    joined = left.join(right, list(keys), join_type="left outer").sort_by("_row")
    return joined.select([*columns, "_present"])


def apply(ledger: Ledger, tombstones: Ledger | None, changes: Changes, spec: UpsertSpec, expected, new_positions,
          partitions, record: CommitInfo, pipeline: str) -> tuple[CommitOutcome, dict[str, int]]:
    """The part's ``changes`` (reduce_changes: before any commit of the part) applied: its
    tombstones commit (sequence_by), then its main MERGE commit; returns the main outcome and the
    counts (module docstring)."""
    table = ledger.snapshot()
    if held(ledger, table, expected, new_positions):
        return CommitOutcome("already_committed", None), changes.counts
    latest, counts = changes.latest, dict(changes.counts)
    order = [SEQUENCE_COLUMN, *ORDER] if spec.sequenced else list(ORDER)
    if spec.sequenced and latest.num_rows:
        theirs = _matched(latest, _read(tombstones.snapshot(), spec.keys, latest, order), spec.keys, order)
        # An event equal to a held delete is that delete (its main commit did not land): not stale.
        stale = pc.and_(pc.is_valid(theirs.column("_present")), _newer(theirs, latest))
        counts["stale"] += pc.sum(stale).as_py() or 0
        latest = latest.filter(pc.invert(stale))
    # Without a sequence only whether the table holds the key matters: its order is not read.
    compared = order if spec.sequenced else []
    theirs = _matched(latest, _read(table, spec.keys, latest, compared), spec.keys, compared)
    present = pc.is_valid(theirs.column("_present"))
    # Without a sequence, the positions order the parts: an event of a later part is newer.
    stale = (pc.and_(present, pc.invert(_newer(latest, theirs))) if spec.sequenced
             else pa.array([False] * latest.num_rows, pa.bool_()))
    upserts, deletes = pc.equal(latest.column(CHANGE_COLUMN), "upsert"), pc.equal(latest.column(CHANGE_COLUMN), "delete")
    live = pc.invert(stale)
    expect = {
        "inserted": pc.and_(live, pc.and_(upserts, pc.invert(present))),
        "updated": pc.and_(live, pc.and_(upserts, present)),
        "deleted": pc.and_(live, pc.and_(deletes, present)),
        "noop_deletes": pc.and_(live, pc.and_(deletes, pc.invert(present))),
    }
    counts["stale"] += pc.sum(stale).as_py() or 0
    for name, mask in expect.items():
        counts[name] = pc.sum(mask).as_py() or 0
    changing = latest.filter(pc.or_(pc.or_(expect["inserted"], expect["updated"]), expect["deleted"]))
    counts_record = replace(record, records={**record.records, **counts})
    if spec.sequenced:
        kept = latest.filter(pc.or_(expect["deleted"], expect["noop_deletes"])).select(
            [*spec.keys, *order, TIMESTAMP_COLUMN])
        if kept.num_rows:
            _keep_deletes(tombstones, kept, new_positions, partitions, counts_record)
            crashpoints.reach("tombstones_committed")
    outcome, metrics = merge(ledger, table, changing, _on_keys(spec.keys), _main_clauses, expected, new_positions,
                             partitions, counts_record, MERGE_MEMORY_BYTES)
    if outcome.status == "committed" and metrics:  # none when a retried commit was found to be ours
        found = {"inserted": metrics.get("num_target_rows_inserted"), "updated": metrics.get("num_target_rows_updated"),
                 "deleted": metrics.get("num_target_rows_deleted")}
        if any(found[k] != counts[k] for k in found):
            raise MergeMiscount(f"pipeline {pipeline}: {ledger.table_uri} version {outcome.version}: the MERGE "
                                f"changed {found}, the events said {({k: counts[k] for k in found})}",
                                version=outcome.version, found=found)
    return outcome, counts


def _on_keys(keys: tuple[str, ...]) -> str:
    return " AND ".join(f"t.`{k}` = s.`{k}`" for k in keys)


def _main_clauses(merger):
    return (merger.when_matched_delete(predicate=f"s.{CHANGE_COLUMN} = 'delete'")
            .when_matched_update_all(predicate=f"s.{CHANGE_COLUMN} = 'upsert'", except_cols=[CHANGE_COLUMN])
            .when_not_matched_insert_all(predicate=f"s.{CHANGE_COLUMN} = 'upsert'", except_cols=[CHANGE_COLUMN]))


def _read(table: DeltaTable, keys: tuple[str, ...], latest: pa.Table, columns: list[str]) -> pa.Table:
    """The table's keys and ``columns`` of the keys in ``latest``, batch by batch (only the matches
    are kept). Not through a pushed-down filter: pyarrow prunes by the files' statistics, which
    delta-rs writes truncated for long strings (the filter then fails on every run)."""
    wanted = [*keys, *columns]
    schema = pa.schema([pa.field(n, latest.schema.field(n).type) for n in wanted])
    if not latest.num_rows:
        return schema.empty_table()
    probe = latest.select(list(keys))
    found = []
    for batch in table.to_pyarrow_dataset().to_batches(columns=wanted):
        if batch.num_rows:
            rows = pa.Table.from_batches([batch]).select(wanted).cast(schema)
            found.append(rows.join(probe, list(keys), join_type="inner").select(wanted))
    return pa.concat_tables(found) if found else schema.empty_table()


def _keep_deletes(tombstones: Ledger, deletes: pa.Table, new_positions, partitions, record: CommitInfo) -> None:
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
    merge(tombstones, table, source, _on_keys(tuple(keys)), clauses, current, moves, partitions, record,
          MERGE_MEMORY_BYTES)


def _newer_sql() -> list[str]:
    """SQL: s's event comes after t's (the sequence, then the coordinates), as disjuncts."""
    names = [SEQUENCE_COLUMN, *ORDER]
    terms = []
    for i, name in enumerate(names):
        equal = [f"s.{n} = t.{n}" for n in names[:i]]
        terms.append(" AND ".join([*equal, f"s.{name} > t.{name}"]))
    return [f"({t})" for t in terms]


__all__ = ["COUNTS", "KeyInTwoPartitions", "MergeMiscount", "UpsertSpec", "apply", "reduce_changes"]
