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

import hashlib
import logging
import time
import uuid
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
    SEQUENCE_PROPERTY,
    TIMESTAMP,
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
# DataFusion's memory for one MERGE before it spills (delta-rs's default pool is unbounded).
MERGE_MEMORY_BYTES = 1 << 30


class KeyInTwoPartitions(OncemoreError):
    """Without sequence_by, one key's events came from two partitions: their order is undefined."""


class SequenceChanged(OncemoreError):
    """The table's sequences were computed with another upsert.sequence_by than the pipeline's."""


def check_sequence(pipeline: str, table_uri: str, table: DeltaTable | None, sequence_by: str | None) -> None:
    """SequenceChanged unless ``table`` (None: none yet) was ordered by ``sequence_by``: its
    SEQUENCE_PROPERTY, or for a table older than it, whether it has a sequence column."""
    if table is None:
        return
    wanted = sequence_by or ""
    recorded = table.metadata().configuration.get(SEQUENCE_PROPERTY)
    if recorded is None:  # a table made before the expression was recorded
        had = SEQUENCE_COLUMN in pa.schema(table.schema().to_arrow()).names
        if had == bool(wanted):
            return
        recorded_text = "a sequence_by (a _sequence column)" if had else "no sequence_by (Kafka's offsets)"
    elif recorded == wanted:
        return
    else:
        recorded_text = f"sequence_by {recorded!r}" if recorded else "no sequence_by (Kafka's offsets)"
    wanted_text = f"sequence_by {wanted!r}" if wanted else "no sequence_by"
    raise SequenceChanged(
        f"pipeline {pipeline}: table {table_uri} was ordered by {recorded_text}, the pipeline says {wanted_text}: "
        "the rows and deletes it holds would be compared with sequences of another meaning; nothing was "
        "committed. `oncemore resequence` accepts the change (the rows held then lose to any later event)",
        pipeline=pipeline, table_uri=table_uri, recorded=recorded, sequence_by=wanted)


class MergeMiscount(OncemoreError):
    """delta-rs's MERGE changed other rows than the classification said (after its commit landed)."""


@dataclass(frozen=True)
class UpsertSpec:
    """What a part's MERGE needs of the pipeline's upsert block; travels in the part's JSON."""

    keys: tuple[str, ...]  # as the table names them
    sequenced: bool
    tombstones_uri: str | None
    placeholder: str | None = None
    sequence_by: str | None = None  # the expression, checked against the table's record at each commit  # upsert.unavailable_value_placeholder: a column value that is not sent


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


def placeholder_forms(kind: pa.DataType, placeholder: str) -> list | None:
    """The values a column of ``kind`` holds where Debezium did not send it (an unchanged TOASTed
    value): the placeholder text, its bytes in a binary column, a one-element array of it (or of
    its name UUID, as Java's UUID.nameUUIDFromBytes makes it) in an array of strings, its bytes one
    per element in an array of integers; None: a column that never carries it."""
    raw = placeholder.encode()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return [placeholder]
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return [raw]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        element = kind.value_type
        if pa.types.is_string(element) or pa.types.is_large_string(element):
            digest = bytearray(hashlib.md5(raw).digest())
            digest[6], digest[8] = (digest[6] & 0x0F) | 0x30, (digest[8] & 0x3F) | 0x80
            return [[placeholder], [str(uuid.UUID(bytes=bytes(digest)))]]
        if pa.types.is_integer(element):
            return [list(raw)]
    return None


def _unavailable(column: pa.ChunkedArray, forms: list) -> pa.Array:
    """Row by row, whether ``column`` holds one of ``forms`` (placeholder_forms)."""
    if isinstance(forms[0], list):
        return pa.array([v in forms for v in column.to_pylist()], pa.bool_())
    return pc.fill_null(pc.is_in(column, value_set=pa.array(forms, column.type)), False).combine_chunks()


def _placeheld(rows: pa.Table, spec: UpsertSpec) -> dict[str, list]:
    """The columns of ``rows`` that may carry the placeholder, with its forms."""
    if spec.placeholder is None:
        return {}
    own = {*spec.keys, SEQUENCE_COLUMN, CHANGE_COLUMN, *ORDER, TIMESTAMP_COLUMN}
    found = {f.name: placeholder_forms(f.type, spec.placeholder) for f in rows.schema if f.name not in own}
    return {name: forms for name, forms in found.items() if forms is not None}


def reduce_changes(rows: pa.Table, spec: UpsertSpec, pipeline: str) -> Changes:
    """The last event per key (module docstring: order), a placeholder taking the value of its
    key's event before it in the part; under sequence_by, each key's last tombstone per partition
    beside them."""
    counts = dict.fromkeys(COUNTS, 0)
    counts["unavailable"] = 0
    stream_ms = _stream_ms(rows)
    kind = rows.column(CHANGE_COLUMN)
    keys = list(spec.keys)
    marks = None
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
    rows = _filled(rows, keys, _placeheld(rows, spec), counts)
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


def _starts(rows: pa.Table, keys: list[str]) -> pa.Array:
    """Row by row (``rows`` sorted by key), whether it is its key's first."""
    if not rows.num_rows:
        return pa.array([], pa.bool_())
    first = None
    for key in keys:
        column = rows.column(key)
        differs = pc.fill_null(pc.not_equal(column.slice(0, len(column) - 1), column.slice(1)), True)
        first = differs if first is None else pc.or_(first, differs)
    return pa.concat_arrays([pa.array([True]), first.combine_chunks()])


def _last(rows: pa.Table, group: list[str], order: list[str], sorted_: bool = False) -> pa.Table:
    """The last row of each ``group`` by ``order``."""
    if not rows.num_rows:
        return rows
    if not sorted_:
        rows = rows.sort_by([(k, "ascending") for k in (*group, *order)])
    starts = _starts(rows, group)
    return rows.filter(pa.concat_arrays([starts.slice(1), pa.array([True])]))


def _filled(rows: pa.Table, keys: list[str], columns: dict[str, list], counts: dict[str, int]) -> pa.Table:
    """``rows`` (sorted by key and order) with each placeholder taking its key's previous event's
    value, unless a delete of the key comes between (then NULL, counted ``unavailable``). A
    placeholder in a key's first event is left for the MERGE (the row the table holds)."""
    if not columns or not rows.num_rows:
        return rows
    n = rows.num_rows
    starts = _starts(rows, keys)
    deleted = pc.equal(rows.column(CHANGE_COLUMN), "delete").combine_chunks()
    after_delete = pc.and_(pc.invert(starts), pa.concat_arrays([pa.array([False]), deleted.slice(0, n - 1)]))
    fresh = pc.or_(starts, after_delete)  # where a key's values begin again
    # Within a key, the segments since its first event or its last delete: a placeholder reaches back no further.
    index = pa.array(range(n), pa.int64())
    segment_start = pc.fill_null_forward(pc.if_else(fresh, index, pa.scalar(None, pa.int64())))
    for name, forms in columns.items():
        missing = _unavailable(rows.column(name), forms)
        source = pc.fill_null_forward(pc.if_else(pc.or_(pc.invert(missing), fresh), index, pa.scalar(None, pa.int64())))
        values = rows.column(name).combine_chunks().take(source)
        # Still a placeholder after a delete of its key in this part: nothing holds its value.
        lost = pc.and_(_unavailable(pa.chunked_array([values]), forms),
                       pc.not_equal(segment_start, _key_start(starts)))
        counts["unavailable"] += pc.sum(lost).as_py() or 0
        values = pc.if_else(lost, pa.nulls(n, values.type), values)
        rows = rows.set_column(rows.schema.get_field_index(name), name, values)
    return rows


def _key_start(starts: pa.Array) -> pa.Array:
    """Row by row, the index of its key's first row."""
    index = pa.array(range(len(starts)), pa.int64())
    return pc.fill_null_forward(pc.if_else(starts, index, pa.scalar(None, pa.int64())))


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


def _matched(latest: pa.Table, other: pa.Table, keys: tuple[str, ...], columns: list[str]) -> pa.Table:
    """Per row of ``latest`` (one per key), ``other``'s ``columns`` of its key (NULL where ``other``
    has none; it has at most one per key) and ``_present``. Only keys and ``columns`` are joined:
    Arrow's join takes no nested payload."""
    left = latest.select(list(keys)).append_column("_row", pa.array(range(latest.num_rows), pa.int64()))
    right = other.select([*keys, *columns]).append_column("_present", pa.array([True] * other.num_rows, pa.bool_()))
    joined = left.join(right, list(keys), join_type="left outer").sort_by("_row")
    present = pc.fill_null(joined.column("_present"), False)
    return joined.select(columns).append_column("_present", present)


def _where(mask: pa.Array, a: pa.Table, b: pa.Table, names: list[str]) -> pa.Table:
    """Row by row, ``a``'s ``names`` where ``mask``, else ``b``'s."""
    return pa.table({n: pc.if_else(mask, a.column(n), b.column(n)) for n in names})


@dataclass
class _Decision:
    """What a sequenced part does to its keys: the change rows the main MERGE applies, the
    deletes the tombstones table keeps, and the events' counts."""

    changing: pa.Table
    kept: pa.Table
    counts: dict[str, int]


def _decide(changes: Changes, table: DeltaTable, held: DeltaTable, spec: UpsertSpec) -> _Decision:
    """Under sequence_by, per key of the part: its state is the latest of its part's last event,
    the table's row and the delete the tombstones table holds (module docstring: order); a
    tombstone of the part in the partition that state came from, at a later offset, deletes it
    (the delete keeping the state's sequence and the tombstone's coordinates). The part's event
    or tombstone that is that state decides the key; the others are stale, superseded (by a
    tombstone of their partition after them) or tombstones (counted, not applied)."""
    latest, marks, counts = changes.latest, changes.marks, dict(changes.counts)
    keys, order = list(spec.keys), [SEQUENCE_COLUMN, *ORDER]
    universe = pa.concat_tables([latest.select(keys), marks.select(keys).cast(latest.select(keys).schema)]) \
        .group_by(keys).aggregate([])
    like = latest.schema
    event = _matched(universe, latest.append_column("_event", pa.array(range(latest.num_rows), pa.int64())), spec.keys,
                     [*order, CHANGE_COLUMN, "_event"])
    row = _matched(universe, _read(table, spec.keys, universe, order, like), spec.keys, order)
    kept = _matched(universe, _read(held, spec.keys, universe, order, like), spec.keys, order)
    # The state before the part's tombstones: the latest of the three (an event equal to a held
    # delete is that delete, whose main commit did not land: the event stays the state).
    names = [*order, "_present"]
    state, source = event.select(names), pc.if_else(event.column("_present"), 0, -1)
    for code, other in ((1, row), (2, kept)):
        take = pc.and_(other.column("_present"), pc.or_(pc.invert(state.column("_present")),
                                                        _after(other, state, order)))
        state, source = _where(take, other, state, names), pc.if_else(take, code, source)
    change = pc.fill_null(event.column(CHANGE_COLUMN), "")
    upsert = pc.or_(pc.equal(source, 1), pc.and_(pc.equal(source, 0), pc.equal(change, "upsert")))
    probe = universe.append_column(TOPIC_COLUMN, state.column(TOPIC_COLUMN)).append_column(
        PARTITION_COLUMN, state.column(PARTITION_COLUMN))
    mark = _matched(probe, marks.cast(pa.schema([like.field(n) for n in marks.column_names])),
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
        ups, counts["unavailable"] = _kept_values(ups, table, spec, counts["unavailable"])
    gone = universe.filter(pc.and_(deletes, present))
    loose = pa.schema([f.with_nullable(True) for f in like])  # a delete's row is its key alone
    removed = pa.table({n: gone.column(n) if n in keys else pa.nulls(gone.num_rows, like.field(n).type)
                        for n in like.names}).cast(loose)
    removed = removed.set_column(like.get_field_index(CHANGE_COLUMN), CHANGE_COLUMN,
                                 pa.array(["delete"] * gone.num_rows, pa.string()))
    # The deletes kept: the state's sequence, the deciding event's or tombstone's coordinates.
    at = {n: pc.if_else(by_mark, mark.column(n) if n in (OFFSET_COLUMN, TIMESTAMP_COLUMN) else state.column(n),
                        _matched(universe, latest, spec.keys, [n]).column(n)) for n in (*ORDER, TIMESTAMP_COLUMN)}
    kept_deletes = pa.table({**{k: universe.column(k) for k in keys}, SEQUENCE_COLUMN: state.column(SEQUENCE_COLUMN),
                             **at}).filter(deletes)
    return _Decision(pa.concat_tables([ups.cast(loose), removed]), kept_deletes, counts)


def _kept_values(ups: pa.Table, table: DeltaTable, spec: UpsertSpec, unavailable: int) -> tuple[pa.Table, int]:
    """``ups`` with each placeholder left (one in its key's first event of the part) taking the
    value of the row the table holds; where it holds none, NULL, counted."""
    columns = _placeheld(ups, spec)
    masks = {name: _unavailable(ups.column(name), forms) for name, forms in columns.items()}
    masks = {name: mask for name, mask in masks.items() if pc.any(mask).as_py()}
    if not masks:
        return ups, unavailable
    needed = ups.filter(reduce(pc.or_, masks.values()))
    stored = _matched(ups, _read(table, spec.keys, needed, list(masks), ups.schema), spec.keys, list(masks))
    for name, mask in masks.items():
        unknown = pc.and_(mask, pc.invert(stored.column("_present")))
        unavailable += pc.sum(unknown).as_py() or 0
        values = pc.if_else(mask, stored.column(name), ups.column(name))
        ups = ups.set_column(ups.schema.get_field_index(name), name, values)
    return ups, unavailable


def apply(ledger: Ledger, tombstones: Ledger | None, changes: Changes, spec: UpsertSpec, expected, new_positions,
          partitions, record: CommitInfo, pipeline: str) -> tuple[CommitOutcome, dict[str, int]]:
    """The part's ``changes`` (reduce_changes: before any commit of the part) applied: its
    tombstones commit (sequence_by), then its main MERGE commit; returns the main outcome and the
    counts (module docstring)."""
    table = ledger.snapshot()
    if held(ledger, table, expected, new_positions):
        return CommitOutcome("already_committed", None), changes.counts
    if spec.sequence_by is not None or not spec.sequenced:  # a resequence may have landed since the run began
        check_sequence(pipeline, ledger.table_uri, table, spec.sequence_by)
    if spec.sequenced:
        decision = _decide(changes, table, tombstones.snapshot(), spec)
        changing, counts = decision.changing, decision.counts
    else:
        # Without a sequence, the positions order the parts: an event of a later part is newer,
        # and only whether the table holds the key matters.
        latest, counts = changes.latest, dict(changes.counts)
        present = _matched(latest, _read(table, spec.keys, latest, [], latest.schema), spec.keys, []).column("_present")
        upserts, deletes = (pc.equal(latest.column(CHANGE_COLUMN), c) for c in ("upsert", "delete"))
        masks = {"inserted": pc.and_(upserts, pc.invert(present)), "updated": pc.and_(upserts, present),
                 "deleted": pc.and_(deletes, present), "noop_deletes": pc.and_(deletes, pc.invert(present))}
        for name, mask in masks.items():
            counts[name] = pc.sum(mask).as_py() or 0
        changing = latest.filter(pc.or_(pc.or_(masks["inserted"], masks["updated"]), masks["deleted"]))
        if spec.placeholder is not None:
            ups = changing.filter(pc.equal(changing.column(CHANGE_COLUMN), "upsert"))
            ups, counts["unavailable"] = _kept_values(ups, table, spec, counts["unavailable"])
            changing = pa.concat_tables([ups, changing.filter(pc.equal(changing.column(CHANGE_COLUMN), "delete"))])
    counts_record = replace(record, records={**record.records, **counts},
                            stream_ms=nested({p: ms for p, ms in changes.stream_ms.items()}))
    if spec.sequenced and decision.kept.num_rows:
        _keep_deletes(tombstones, decision.kept, new_positions, partitions, counts_record)
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


def _read(table: DeltaTable, keys: tuple[str, ...], latest: pa.Table, columns: list[str], like: pa.Schema) -> pa.Table:
    """The table's keys and ``columns`` (typed as in ``like``) of the keys in ``latest``, batch by
    batch (only the matches are kept). Not through a pushed-down filter: pyarrow prunes by the files' statistics, which
    delta-rs writes truncated for long strings (the filter then fails on every run)."""
    wanted = [*keys, *columns]
    schema = pa.schema([pa.field(n, like.field(n).type) for n in wanted])
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


__all__ = ["COUNTS", "KeyInTwoPartitions", "MergeMiscount", "SequenceChanged", "check_sequence", "UpsertSpec", "apply", "describe_counts", "reduce_changes"]
