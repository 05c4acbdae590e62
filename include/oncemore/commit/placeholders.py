"""Debezium's placeholder for a value it did not send (``upsert.unavailable_value_placeholder``;
PostgreSQL's unchanged TOASTed column under REPLICA IDENTITY DEFAULT): in an upsert part's change
rows (merge.py), a placeholder takes the value of its key's previous event in the part, else of
the row the table holds.

Invariant: a placeholder is never stored as a value. Where nothing holds the key's value (no row,
or a delete of the key came between), the column is NULL and counted (``unavailable``). The forms
are those Debezium sends per column type: the text in a string column, its bytes in a binary one
(base64 in JSON, decoded), a one-element array of it (or of its name UUID) in an array of strings,
its bytes one per element in an array of integers. Other array types (dates, decimals, booleans)
are not recognized: their placeholder arrays are stored as decoded.
"""

from __future__ import annotations

import hashlib
import uuid

import pyarrow as pa
import pyarrow.compute as pc

from oncemore.core.columns import CHANGE_COLUMN, OFFSET_COLUMN, PARTITION_COLUMN, SEQUENCE_COLUMN, TIMESTAMP_COLUMN, \
    TOPIC_COLUMN

OWN = {SEQUENCE_COLUMN, CHANGE_COLUMN, TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN, TIMESTAMP_COLUMN}


def placeholder_forms(kind: pa.DataType, placeholder: str) -> list | None:
    """The values a column of ``kind`` holds where Debezium did not send it (module docstring);
    None: a column that never carries it."""
    raw = placeholder.encode()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return [placeholder]
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return [raw]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        element = kind.value_type
        if pa.types.is_string(element) or pa.types.is_large_string(element):
            digest = bytearray(hashlib.md5(raw).digest())  # Java's UUID.nameUUIDFromBytes
            digest[6], digest[8] = (digest[6] & 0x0F) | 0x30, (digest[8] & 0x3F) | 0x80
            return [[placeholder], [str(uuid.UUID(bytes=bytes(digest)))]]
        if pa.types.is_integer(element):
            return [list(raw)]
    return None


def placeheld(rows: pa.Table, keys, placeholder: str | None) -> dict[str, list]:
    """The columns of ``rows`` that may carry ``placeholder`` (None: none), with its forms."""
    if placeholder is None:
        return {}
    found = {f.name: placeholder_forms(f.type, placeholder) for f in rows.schema if f.name not in {*keys, *OWN}}
    return {name: forms for name, forms in found.items() if forms is not None}


def _unavailable(column, forms: list) -> pa.Array:
    """Row by row, whether ``column`` holds one of ``forms``."""
    if isinstance(forms[0], list):
        return pa.array([v in forms for v in column.to_pylist()], pa.bool_())
    found = pc.fill_null(pc.is_in(column, value_set=pa.array(forms, column.type)), False)
    return found.combine_chunks() if isinstance(found, pa.ChunkedArray) else found


def unsent(rows: pa.Table, columns: dict[str, list]) -> dict[str, pa.Array]:
    """Per column of ``columns`` (placeheld) where some row holds the placeholder, which rows do."""
    masks = {name: _unavailable(rows.column(name), forms) for name, forms in columns.items()}
    return {name: mask for name, mask in masks.items() if pc.any(mask).as_py()}


def key_starts(rows: pa.Table, keys) -> pa.Array:
    """Row by row (``rows`` sorted by key), whether it is its key's first."""
    if not rows.num_rows:
        return pa.array([], pa.bool_())
    first = None
    for key in keys:
        column = rows.column(key)
        differs = pc.fill_null(pc.not_equal(column.slice(0, len(column) - 1), column.slice(1)), True)
        first = differs if first is None else pc.or_(first, differs)
    return pa.concat_arrays([pa.array([True]), first.combine_chunks()])


def _first_of(mask: pa.Array) -> pa.Array:
    """Row by row, the index of the last row at or before it where ``mask`` holds."""
    index = pa.array(range(len(mask)), pa.int64())
    return pc.fill_null_forward(pc.if_else(mask, index, pa.scalar(None, pa.int64())))


def filled(rows: pa.Table, keys, columns: dict[str, list], counts: dict[str, int]) -> pa.Table:
    """``rows`` (sorted by key and order) with each placeholder taking its key's previous event's
    value, unless a delete of the key comes between (then NULL, counted ``unavailable``). A
    placeholder in a key's first event is left for the row the table holds (with_stored)."""
    if not columns or not rows.num_rows:
        return rows
    n = rows.num_rows
    starts = key_starts(rows, keys)
    deleted = pc.equal(rows.column(CHANGE_COLUMN), "delete").combine_chunks()
    after_delete = pc.and_(pc.invert(starts), pa.concat_arrays([pa.array([False]), deleted.slice(0, n - 1)]))
    fresh = pc.or_(starts, after_delete)  # where a key's values begin again: a placeholder reaches back no further
    since_delete = pc.not_equal(_first_of(fresh), _first_of(starts))
    index = pa.array(range(n), pa.int64())
    for name, forms in columns.items():
        missing = _unavailable(rows.column(name), forms)
        source = pc.fill_null_forward(pc.if_else(pc.or_(pc.invert(missing), fresh), index,
                                                 pa.scalar(None, pa.int64())))
        values = rows.column(name).combine_chunks().take(source)
        lost = pc.and_(_unavailable(values, forms), since_delete)
        counts["unavailable"] += pc.sum(lost).as_py() or 0
        rows = rows.set_column(rows.schema.get_field_index(name), name,
                               pc.if_else(lost, pa.nulls(n, values.type), values))
    return rows


def with_stored(ups: pa.Table, masks: dict[str, pa.Array], stored: pa.Table, unavailable: int) -> tuple[pa.Table, int]:
    """``ups`` with the placeholders ``masks`` (unsent) name taking ``stored``'s values (the rows
    the table holds, row by row, ``_present`` where it holds one); NULL where it holds none,
    counted. Returns the rows and ``unavailable`` plus those."""
    for name, mask in masks.items():
        unknown = pc.and_(mask, pc.invert(stored.column("_present")))
        unavailable += pc.sum(unknown).as_py() or 0
        ups = ups.set_column(ups.schema.get_field_index(name), name,
                             pc.if_else(mask, stored.column(name), ups.column(name)))
    return ups, unavailable
