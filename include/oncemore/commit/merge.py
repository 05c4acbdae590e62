"""One part of an upsert batch applied to its tables: the change rows the tasks staged, reduced to
the last event per key, MERGEd into the main table in the commit that records the positions.

Order: without ``sequence_by``, Kafka's offsets (a key seen in two partitions refuses the part:
the order between them is undefined; a tombstone deletes); with it, the greatest sequence wins
(a NULL sequence, of a row an accepted change of sequence_by cleared, before any number), ties by
(topic, partition, offset), the coordinates kept in the row. Under sequence_by a tombstone (a
null value: no sequence) deletes its key when the key's state (the latest of the part's last
event, the table's row and the held delete) came from the tombstone's own partition at a lower
offset: one partition's order is Kafka's, and on a compacted topic the d before it may be gone.
That delete keeps the state's sequence at the tombstone's coordinates, so an event not newer
than the deleted row stays out. Each event counts once: ``inserted``, ``updated``, ``deleted`` (a
row removed), ``noop_deletes`` (a delete of a key the table does not hold), ``stale`` (not newer
than the row or the delete the tables hold: changes nothing), ``superseded`` (a later event of its
key in the same part: an event, or a tombstone of its partition after it), ``tombstones`` (a
tombstone that deletes nothing: counted); with ``quarantined`` and ``filtered`` they account for
every record read. ``written`` is every change row that reached the MERGE, the sum of the first
seven. ``unavailable`` counts placeholders nothing held a value for (placeholders.py).

Deletes hold against late events: under sequence_by, every applied delete (noop ones included) is
MERGEd into the tombstones table (key, sequence, coordinates, when) with its positions, *before*
the main commit, as the quarantine table's part is; the main MERGE builds on it, so a crash
between the two leaves a delete that the rerun applies again (an event, or a tombstone, at a held
delete's coordinates is that delete, not stale). The main table holds only live rows. Each commit
refuses a table whose recorded sequence_by is not the part's (sequencing.py).

The events are classified against the snapshot the MERGE runs on; the MERGE applies exactly the
ones that change a row (none: a commit of the positions alone, committer.merge), and its counts
are checked against the classification. ``upsert.merge`` says where it runs: ``local``, delta-rs's
MERGE in this process; ``cluster``, a copy-on-write of the touched files by the cluster's tasks,
committed by delta-rs with the positions in one commit (copyonwrite.py). The table's rows of the
part's keys, with a placeholder's stored values, and the deletes the tombstones table holds of
them come from this process's scans (local), or from the cluster's key scans, whose matches of the
main table also locate the files to rewrite (cluster). The classification and the counts are the same either
way, and either way a changed key in a file delta-rs cannot remove (removable.py) refuses the part
before its first commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import reduce
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from oncemore.commit.committer import CommitOutcome, held, merge
from oncemore.commit.copyonwrite import (NOTHING, UNREMOVABLE, ClusterRewrite, commit_rewrite, part_of, rewrite_part,
                                         scan_keys)
from oncemore.commit.inputs import UpsertSpec
from oncemore.commit.keyrows import matched, read, typed
from oncemore.commit.placeholders import filled, key_starts, placeheld, unsent, with_stored
from oncemore.commit.removable import WAY_OUT, UnremovableFile, holding, unremovable
from oncemore.commit.sequencing import check_sequence
from oncemore.commit.tablefeatures import check_rewritable, check_scannable
from oncemore.commit.tombstones import MERGE_MEMORY_BYTES, keep_deletes, on_keys
from oncemore.core import crashpoints
from oncemore.core.columns import (
    CHANGE_COLUMN,
    OFFSET_COLUMN,
    PARTITION_COLUMN,
    SEQUENCE_COLUMN,
    TIMESTAMP_COLUMN,
    TOPIC_COLUMN,
)
from oncemore.core.coordinates import KafkaPartition, nested
from oncemore.core.errors import OncemoreError
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger

log = logging.getLogger("oncemore")

COUNTS = ("inserted", "updated", "deleted", "noop_deletes", "stale", "superseded", "tombstones")
ORDER = (TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN)


class KeyInTwoPartitions(OncemoreError):
    """Without sequence_by, one key's events came from two partitions: their order is undefined."""


class MergeMiscount(OncemoreError):
    """delta-rs's MERGE changed other rows than the classification said (after its commit landed)."""


@dataclass
class Changes:
    """A part's change rows reduced: one event per key, under sequence_by each key's last
    tombstone per partition (keys, coordinates, timestamp), the counts of the events left behind
    and, per partition, the greatest Kafka timestamp of its change rows (the stream's time)."""

    latest: pa.Table
    marks: pa.Table | None
    counts: dict[str, int]
    stream_ms: dict[KafkaPartition, int]


def describe_counts(records: dict[str, int]) -> str:
    """An upsert's counts as its log lines say them: inserted, updated, deleted and stale always,
    the others where not zero (``records``: a commit record's, or their sums)."""
    always = ("inserted", "updated", "deleted", "stale")
    others = [n for n in (*COUNTS, "quarantined", "filtered", "unavailable") if n not in always]
    return ", ".join(f"{records.get(n, 0)} {n}" for n in always) + "".join(
        f", {records[n]} {n}" for n in others if records.get(n))


def reduce_changes(rows: pa.Table, spec: UpsertSpec, pipeline: str) -> Changes:
    """The last event per key (module docstring: order), a placeholder taking the value of its
    key's event before it in the part; under sequence_by, each key's last tombstone per partition
    beside them."""
    counts, stream_ms = {**dict.fromkeys(COUNTS, 0), "unavailable": 0}, _stream_ms(rows)
    kind, keys, marks = rows.column(CHANGE_COLUMN), list(spec.keys), None
    if spec.sequenced:
        markers = pc.equal(kind, "tombstone")
        marks = _last(rows.filter(markers).select([*keys, *ORDER, TIMESTAMP_COLUMN]), [*keys, *ORDER[:2]],
                      [OFFSET_COLUMN])
        # An earlier tombstone of a key in a partition never decides: the partition's last one
        # comes after every event the earlier one comes after.
        counts["tombstones"] = (pc.sum(markers).as_py() or 0) - marks.num_rows
        rows = rows.filter(pc.invert(markers))
        order = [SEQUENCE_COLUMN, *ORDER]
    else:
        rows = rows.set_column(rows.schema.get_field_index(CHANGE_COLUMN), CHANGE_COLUMN,
                               pc.if_else(pc.equal(kind, "tombstone"), "delete", kind))
        _one_partition_per_key(rows, spec.keys, pipeline)
        order = list(ORDER)
    rows = rows.sort_by([(k, "ascending") for k in (*keys, *order)])
    rows = filled(rows, keys, placeheld(rows, spec.keys, spec.placeholder), counts)
    latest = _last(rows, keys, order, sorted_=True)
    counts["superseded"] = rows.num_rows - latest.num_rows
    return Changes(latest, marks, counts, stream_ms)


def _stream_ms(rows: pa.Table) -> dict[KafkaPartition, int]:
    """Per partition, the greatest Kafka timestamp (ms) of ``rows``."""
    stamped = rows.select([TOPIC_COLUMN, PARTITION_COLUMN]).append_column(
        "_ms", pc.cast(rows.column(TIMESTAMP_COLUMN), pa.int64())).filter(pc.is_valid(pc.field("_ms")))
    greatest = stamped.group_by([TOPIC_COLUMN, PARTITION_COLUMN]).aggregate([("_ms", "max")])
    return {KafkaPartition(t, p): us // 1000 for t, p, us in zip(*(greatest.column(c).to_pylist() for c in (
        TOPIC_COLUMN, PARTITION_COLUMN, "_ms_max")))}


def _last(rows: pa.Table, group: list[str], order: list[str], sorted_: bool = False) -> pa.Table:
    """The last row of each ``group`` by ``order``."""
    if not rows.num_rows:
        return rows
    if not sorted_:
        rows = rows.sort_by([(k, "ascending") for k in (*group, *order)])
    starts = key_starts(rows, group)
    return rows.filter(pa.concat_arrays([starts.slice(1), pa.array([True])]))


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


def _after(a: pa.Table, b: pa.Table, names: list[str]) -> pa.Array:
    """Row by row, whether ``a``'s event comes after ``b``'s by ``names`` (lexicographic). A NULL
    sequence (a row whose sequence an accepted change of sequence_by cleared) comes before any
    number; NULL coordinates never appear where both are present."""
    result = pa.array([False] * a.num_rows, pa.bool_())
    for name in reversed(names):  # built from the last column up
        x, y = a.column(name), b.column(name)
        if name == SEQUENCE_COLUMN:
            greater = pc.if_else(pc.is_null(x), False, pc.if_else(pc.is_null(y), True, pc.greater(x, y)))
            equal = pc.if_else(pc.is_null(x), pc.is_null(y), pc.fill_null(pc.equal(x, y), False))
        else:
            greater, equal = pc.fill_null(pc.greater(x, y), False), pc.fill_null(pc.equal(x, y), False)
        result = pc.or_(greater, pc.and_(equal, result))
    return result


@dataclass
class _Decision:
    """What a sequenced part does to its keys: the change rows the main MERGE applies, the
    deletes the tombstones table keeps, and the events' counts."""

    changing: pa.Table
    kept: pa.Table
    counts: dict[str, int]


def _universe(changes: Changes, keys: list[str]) -> pa.Table:
    """Under sequence_by, the part's keys: of its last events and of its tombstones."""
    latest = changes.latest.select(keys)
    return pa.concat_tables([latest, changes.marks.select(keys).cast(latest.schema)]).group_by(keys).aggregate([])


def _decide(changes: Changes, universe: pa.Table, rows: pa.Table, held: pa.Table, stored: Callable,
            spec: UpsertSpec) -> _Decision:
    """Under sequence_by, per key of the part: its state is the latest of its part's last event,
    the table's row and the delete the tombstones table holds (module docstring: order); a
    tombstone of the part in the partition that state came from, at a later offset, deletes it
    (the delete keeping the state's sequence and the tombstone's coordinates). The part's event
    or tombstone that is that state decides the key; the others are stale, superseded (by a
    tombstone of their partition after them) or tombstones (counted, not applied). ``universe``:
    the part's keys (_universe); ``rows``, ``held``: the table's rows and the tombstones table's
    deletes of them (keys and order); ``stored``: the table's values for placeholders (_kept_values)."""
    latest, marks, counts = changes.latest, changes.marks, dict(changes.counts)
    keys, order = list(spec.keys), [SEQUENCE_COLUMN, *ORDER]
    like = latest.schema
    event = matched(universe, latest.append_column("_event", pa.array(range(latest.num_rows), pa.int64())), spec.keys,
                     [*order, CHANGE_COLUMN, TIMESTAMP_COLUMN, "_event"])
    row = matched(universe, rows, spec.keys, order)
    kept = matched(universe, held, spec.keys, order)
    # The state before the part's tombstones: the latest of the three (an event equal to a held
    # delete is that delete, whose main commit did not land: the event stays the state).
    names = [*order, "_present"]
    state, source = event.select(names), pc.if_else(event.column("_present"), 0, -1)
    for code, other in ((1, row), (2, kept)):
        take = pc.and_(other.column("_present"), pc.or_(pc.invert(state.column("_present")),
                                                        _after(other, state, order)))
        state = pa.table({n: pc.if_else(take, other.column(n), state.column(n)) for n in names})
        source = pc.if_else(take, code, source)
    change = pc.fill_null(event.column(CHANGE_COLUMN), "")
    upsert = pc.or_(pc.equal(source, 1), pc.and_(pc.equal(source, 0), pc.equal(change, "upsert")))
    probe = universe.append_column(TOPIC_COLUMN, state.column(TOPIC_COLUMN)).append_column(
        PARTITION_COLUMN, state.column(PARTITION_COLUMN))
    mark = matched(probe, marks.cast(pa.schema([like.field(n) for n in marks.column_names])),
                    (*spec.keys, *ORDER[:2]), [OFFSET_COLUMN, TIMESTAMP_COLUMN])
    later = pc.fill_null(pc.greater(mark.column(OFFSET_COLUMN), state.column(OFFSET_COLUMN)), False)
    same = pc.fill_null(pc.equal(mark.column(OFFSET_COLUMN), state.column(OFFSET_COLUMN)), False)
    by_mark = pc.or_(pc.and_(upsert, later), pc.and_(pc.equal(source, 2), same))  # the latter: its delete is held
    by_event = pc.and_(pc.equal(source, 0), pc.invert(by_mark))
    deletes = pc.or_(by_mark, pc.and_(by_event, pc.invert(upsert)))
    upserts = pc.and_(by_event, upsert)
    present = row.column("_present")
    masks = {"inserted": pc.and_(upserts, pc.invert(present)), "updated": pc.and_(upserts, present),
             "deleted": pc.and_(deletes, present), "noop_deletes": pc.and_(deletes, pc.invert(present))}
    for name, mask in masks.items():
        counts[name] = pc.sum(mask).as_py() or 0
    left = pc.and_(event.column("_present"), pc.invert(by_event))
    superseded = pc.and_(left, pc.and_(by_mark, pc.equal(source, 0)))
    counts["superseded"] += pc.sum(superseded).as_py() or 0
    counts["stale"] += pc.sum(pc.and_(left, pc.invert(superseded))).as_py() or 0
    counts["tombstones"] += marks.num_rows - (pc.sum(by_mark).as_py() or 0)
    # The main MERGE's rows: the deciding upserts whole, the deletes of rows the table holds by key.
    chosen = pc.filter(event.column("_event"), upserts)
    ups = latest.take(chosen)
    if spec.placeholder is not None:
        ups, counts["unavailable"] = _kept_values(ups, stored, spec, counts["unavailable"])
    gone = universe.filter(pc.and_(deletes, present))
    loose = pa.schema([f.with_nullable(True) for f in like])  # a delete's row is its key alone
    removed = pa.table({n: gone.column(n) if n in keys else pa.nulls(gone.num_rows, like.field(n).type)
                        for n in like.names}).cast(loose)
    removed = removed.set_column(like.get_field_index(CHANGE_COLUMN), CHANGE_COLUMN,
                                 pa.array(["delete"] * gone.num_rows, pa.string()))
    # The deletes kept: the state's sequence, the deciding event's or tombstone's coordinates.
    at = {n: pc.if_else(by_mark, mark.column(n) if n in (OFFSET_COLUMN, TIMESTAMP_COLUMN) else state.column(n),
                        event.column(n)) for n in (*ORDER, TIMESTAMP_COLUMN)}
    kept_deletes = pa.table({**{k: universe.column(k) for k in keys}, SEQUENCE_COLUMN: state.column(SEQUENCE_COLUMN),
                             **at}).filter(deletes)
    return _Decision(pa.concat_tables([ups.cast(loose), removed]), kept_deletes, counts)


def _kept_values(ups: pa.Table, stored: Callable, spec: UpsertSpec, unavailable: int) -> tuple[pa.Table, int]:
    """``ups`` with each placeholder left taking the value of the row the table holds
    (placeholders.py); ``stored(probe, columns)``: the table's rows of the keys in ``probe``, those
    columns with them, read for the keys whose placeholders need them alone (TOASTed values are large)."""
    masks = unsent(ups, placeheld(ups, spec.keys, spec.placeholder))
    if not masks:
        return ups, unavailable
    needed = ups.filter(reduce(pc.or_, masks.values()))
    return with_stored(ups, masks, matched(ups, stored(needed, list(masks)), spec.keys, list(masks)), unavailable)


def apply(ledger: Ledger, tombstones: Ledger | None, changes: Changes, spec: UpsertSpec, expected, new_positions,
          partitions, record: CommitInfo, pipeline: str,
          cluster: ClusterRewrite | None = None) -> tuple[CommitOutcome, dict[str, int]]:
    """The part's ``changes`` (reduce_changes: before any commit of the part) applied: its
    tombstones commit (sequence_by), then its main commit, a delta-rs MERGE here or, given
    ``cluster``, a copy-on-write on it (copyonwrite.py: rewritten and checked before the
    tombstones commit, so that its refusal commits nothing); returns the main outcome and the
    counts (module docstring)."""
    table = ledger.snapshot()
    if held(ledger, table, expected, new_positions):
        return CommitOutcome("already_committed", None), changes.counts
    if spec.sequence_by is not None or not spec.sequenced:  # a resequence may have landed since the run began
        check_sequence(pipeline, ledger.table_uri, table, spec.sequence_by)
    where = f"{part_of(pipeline, record)}: {ledger.table_uri} version {table.version()}"
    check_scannable(table, ledger.table_uri, where)  # before the part's first commit
    check_rewritable(table, ledger.table_uri, where, cluster is not None)
    # The table's rows of the part's keys (their order under sequence_by), the deletes the
    # tombstones table holds of them, and the values placeholders take: on the cluster, its scan
    # tasks find them, and the main rows' files are where the copy-on-write's changed keys are.
    keys, order, like = list(spec.keys), [SEQUENCE_COLUMN, *ORDER] if spec.sequenced else [], changes.latest.schema
    wanted = _universe(changes, keys) if spec.sequenced else changes.latest.select(keys)
    scanned = scan_keys(table, wanted, spec.keys, order, cluster, where) if cluster is not None else None

    def rows_of(of: DeltaTable, probe: pa.Table, columns: list[str], at: str) -> pa.Table:
        if cluster is None:
            return read(of, keys, probe, columns, like)
        return typed(scan_keys(of, probe, spec.keys, columns, cluster, at).rows, keys, columns, like)

    def stored(probe: pa.Table, columns: list[str]) -> pa.Table:
        return rows_of(table, probe, columns, where)

    rows = typed(scanned.rows, keys, order, like) if scanned is not None else read(table, keys, wanted, order, like)
    if spec.sequenced:
        kept = tombstones.snapshot()
        at = f"{where}; {tombstones.table_uri} version {kept.version()}"
        check_scannable(kept, tombstones.table_uri, at)
        decision = _decide(changes, wanted, rows, rows_of(kept, wanted, order, at), stored, spec)
        changing, counts = decision.changing, decision.counts
    else:
        # Without a sequence, the positions order the parts: an event of a later part is newer,
        # and only whether the table holds the key matters.
        latest, counts = changes.latest, dict(changes.counts)
        present = matched(latest, rows, spec.keys, []).column("_present")
        upserts, deletes = (pc.equal(latest.column(CHANGE_COLUMN), c) for c in ("upsert", "delete"))
        masks = {"inserted": pc.and_(upserts, pc.invert(present)), "updated": pc.and_(upserts, present),
                 "deleted": pc.and_(deletes, present), "noop_deletes": pc.and_(deletes, pc.invert(present))}
        for name, mask in masks.items():
            counts[name] = pc.sum(mask).as_py() or 0
        changing = latest.filter(pc.or_(pc.or_(masks["inserted"], masks["updated"]), masks["deleted"]))
        if spec.placeholder is not None:
            ups = changing.filter(pc.equal(changing.column(CHANGE_COLUMN), "upsert"))
            ups, counts["unavailable"] = _kept_values(ups, stored, spec, counts["unavailable"])
            changing = pa.concat_tables([ups, changing.filter(pc.equal(changing.column(CHANGE_COLUMN), "delete"))])
    counts_record = replace(record, records={**record.records, **counts},
                            stream_ms=nested({p: ms for p, ms in changes.stream_ms.items()}))
    if cluster is None:  # delta-rs's MERGE would leave such a file live and say nothing (the cluster's locate refuses it)
        found = holding(table, unremovable(table), list(spec.keys), changing, ledger.storage_options)
        if found:
            raise UnremovableFile(f"{where}: {UNREMOVABLE.format(path=found[0]['path'])}; {NOTHING}; {WAY_OUT}",
                                  path=found[0]["path"])
    # The cluster's rewrite is done and checked before the part's first commit: a refusal commits nothing.
    rewritten = rewrite_part(table, changing, spec.keys, cluster, scanned, counts, where, pipeline) if cluster else None
    if spec.sequenced and decision.kept.num_rows:
        keep_deletes(tombstones, decision.kept, new_positions, partitions, counts_record)
        crashpoints.reach("tombstones_committed")
    if rewritten is None:
        outcome, metrics = merge(ledger, table, changing, on_keys(spec.keys), _main_clauses, expected, new_positions,
                                 partitions, counts_record, MERGE_MEMORY_BYTES)
    else:
        outcome, metrics = commit_rewrite(ledger, table, rewritten, expected, new_positions, partitions, counts_record,
                                          pipeline)
    if outcome.status == "committed" and metrics:  # none when a retried commit was found to be ours
        found = {"inserted": metrics.get("num_target_rows_inserted"), "updated": metrics.get("num_target_rows_updated"),
                 "deleted": metrics.get("num_target_rows_deleted")}
        if any(found[k] != counts[k] for k in found):
            raise MergeMiscount(f"pipeline {pipeline}: {ledger.table_uri} version {outcome.version}: the MERGE "
                                f"changed {found}, the events said {({k: counts[k] for k in found})}",
                                version=outcome.version, found=found)
    return outcome, counts


def _main_clauses(merger):
    return (merger.when_matched_delete(predicate=f"s.{CHANGE_COLUMN} = 'delete'")
            .when_matched_update_all(predicate=f"s.{CHANGE_COLUMN} = 'upsert'", except_cols=[CHANGE_COLUMN])
            .when_not_matched_insert_all(predicate=f"s.{CHANGE_COLUMN} = 'upsert'", except_cols=[CHANGE_COLUMN]))


__all__ = ["COUNTS", "KeyInTwoPartitions", "MergeMiscount", "apply", "describe_counts", "reduce_changes"]
