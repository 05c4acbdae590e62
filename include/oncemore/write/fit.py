"""Rows fitted to a table before they are written: which rows the table cannot hold as they are,
and why (``unstorable_rows``, the reason the quarantine table keeps), and the rest in the table's
schema (``conform``).

A row is judged by what the table would do with it, never by what its records declared: a
partition value a Delta table could not read back as written (an empty string: Delta reads it as
NULL) or whose directory a file system cannot name, and a value the table's own column cannot hold
at any depth (a NULL element where a table made by another writer has none, a value the safe cast
to the column's type refuses). What ``unstorable_rows`` lets through, ``conform`` converts without
failing: both read a column's nested values alike (a struct's fields as they show through it, a
list's or map's items as its offsets reach them).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from oncemore.write.files import escape_path_name
from oncemore.write.filestats import FIRST_DAY, LAST_DAY

# The longest name of one directory: ext4, XFS and HDFS's default (S3 keys hold more, but a table
# that moves to a file system must still hold its partitions).
MAX_NAME_BYTES = 255


def unstorable_partition_values(rows: pa.Table, partition_by: Iterable[str]) -> dict[int, str]:
    """By row, why a row's partition value cannot be stored: an empty string (Delta reads an empty
    partition value as NULL, protocol: Partition Value Serialization), one whose directory name
    would pass MAX_NAME_BYTES (every write of it would fail), or a date outside years 1-9999
    (Spark's dates reach further; a partition value's text cannot say it)."""
    problems: dict[int, str] = {}
    for column in partition_by:
        kind, values = rows.schema.field(column).type, rows.column(column)
        if pa.types.is_string(kind):
            for row in pc.indices_nonzero(pc.fill_null(pc.equal(values, ""), False)).to_pylist():
                problems.setdefault(row, f"column {column!r} partitions the table and Delta reads an empty "
                                         "partition value as NULL: the row would not read back as sent")
            # Escaping at most triples a character's bytes: only values that could be too long are looked at.
            long = pc.greater(pc.binary_length(values), (MAX_NAME_BYTES - len(column) - 1) // 3)
            for row in pc.indices_nonzero(pc.fill_null(long, False)).to_pylist():
                size = len(f"{escape_path_name(column)}={escape_path_name(values[row].as_py())}".encode())
                if size > MAX_NAME_BYTES:
                    problems.setdefault(row, f"column {column!r} partitions the table and this value makes a "
                                             f"directory name of {size} bytes, more than the {MAX_NAME_BYTES} a file "
                                             "or object store's name may hold")
        elif pa.types.is_date32(kind):
            days = values.cast(pa.int32())
            outside = pc.or_(pc.less(days, FIRST_DAY), pc.greater(days, LAST_DAY))
            for row in pc.indices_nonzero(pc.fill_null(outside, False)).to_pylist():
                problems.setdefault(row, f"column {column!r} partitions the table and holds a date outside years "
                                         f"1-9999 ({days[row].as_py()} days from 1970-01-01)")
    return problems


def unstorable_rows(rows: pa.Table, schema: pa.Schema, partition_by: Iterable[str]) -> dict[int, str]:
    """By row, why a row cannot be written to the table of ``schema`` (and ``partition_by``) as it
    is: its partition value (unstorable_partition_values) or a value its column cannot hold
    (unholdable_values); such a row goes to the quarantine table with the reason."""
    problems = unstorable_partition_values(rows, partition_by)
    for row, problem in unholdable_values(rows, schema).items():
        problems.setdefault(row, problem)
    return problems


def unholdable_values(rows: pa.Table, schema: pa.Schema) -> dict[int, str]:
    """By row, why the table's column (``schema``, the table's) cannot hold a row's value, at any
    depth (a struct's field, an array's element, a map's value): a value the safe cast to the
    column's type refuses (an integer it would overflow, a decimal or timestamp it would round),
    a NULL where the column, or a field of its struct that is not NULL itself, is NOT NULL, or a
    NULL element of an ARRAY, or value of a MAP, whose type holds none (delta-spark makes them
    of ``array(...)`` and ``map(...)``; evolution.py lets the records fill such a column, as a row
    holding no NULL there is fine). Cheap where every value fits: a cast per column whose type
    differs, a null count per such array or map; rows are looked for only in a column that fails."""
    problems: dict[int, str] = {}
    for field in schema:
        if field.name not in rows.column_names:
            continue
        start = 0
        for chunk in rows.column(field.name).chunks:
            found = _nulls_unheld(chunk, pa.array(np.ones(len(chunk), bool)), field, field.name)
            for row, problem in {**_unheld(chunk, field.type, field.name), **found}.items():
                problems.setdefault(start + row, problem)
            start += len(chunk)
    return problems


def _nulls_unheld(array: pa.Array, shown: pa.Array, field: pa.Field, path: str) -> dict[int, str]:
    """The positions where ``field`` is NOT NULL and ``array`` holds a NULL that shows (``shown``:
    its struct is not NULL itself), with the reason."""
    if field.nullable or not array.null_count:
        return {}
    rows = pc.indices_nonzero(pc.and_(array.is_null(), shown)).to_pylist()
    return dict.fromkeys(rows, f"column {path!r}: a NULL, which the table's column ({field.type} NOT NULL) cannot hold")


def _unheld(array: pa.Array, kind: pa.DataType, path: str) -> dict[int, str]:
    """unholdable_values for one array's values (by position), ``path`` naming them as
    evolution.py does (``a.b``, ``a[]``, ``a{}``)."""
    if pa.types.is_struct(kind) and pa.types.is_struct(array.type):
        found: dict[int, str] = {}
        children = dict(zip((f.name for f in array.type), array.flatten()))  # NULL where the struct is
        for field in kind:
            child = children.get(field.name, pa.nulls(len(array), field.type))
            for row, problem in {**_unheld(child, field.type, f"{path}.{field.name}"),
                                 **_nulls_unheld(child, array.is_valid(), field, f"{path}.{field.name}")}.items():
                found.setdefault(row, problem)
        return found
    if pa.types.is_list(kind) and pa.types.is_list(array.type):
        return _unheld_items(array, array.values, kind.value_field, f"{path}[]")
    if pa.types.is_map(kind) and pa.types.is_map(array.type):
        return _unheld_items(array, array.items, kind.item_field, f"{path}{{}}")
    if array.type.equals(kind):
        return {}
    refused = _refused(array, kind)
    if not refused:
        return {}
    try:
        texts = array.take(refused).cast(pa.string()).to_pylist()
    except pa.ArrowNotImplementedError:  # a type Arrow cannot spell: the reason names the column alone
        texts = ["a value"] * len(refused)
    # Numbers as they are, other values quoted: as the decoders quote them (share.reason_kind groups them).
    number = pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_decimal(array.type)
    shown = texts if number else [repr(t) for t in texts]
    return {row: f"column {path!r}: {text} does not fit the table's column type {kind}"
            for row, text in zip(refused, shown)}


def _unheld_items(array: pa.Array, child: pa.Array, field: pa.Field, path: str) -> dict[int, str]:
    """_unheld for a list's elements or a map's values (``child``, of ``field``), by the position of
    the list or map holding them, one reason a row; the items under a NULL list or map are left out
    (nothing of them is stored). NULL items are mapped to their rows in numpy, a reason a row."""
    offsets, items = _reached(array, child)
    nulls = (pc.indices_nonzero(items.is_null()).to_numpy() if not field.nullable and items.null_count
             else np.empty(0, np.int64))
    deeper = _unheld(items, field.type, path)
    if not len(nulls) and not deeper:
        return {}
    holder = np.repeat(np.arange(len(array)), np.diff(offsets.to_numpy()))
    held = array.is_valid().to_numpy(zero_copy_only=False)
    reason = f"column {path!r}: a NULL, which the table's column ({field.type} NOT NULL) cannot hold"
    by_row = {row: reason for row in np.unique(holder[nulls]).tolist() if held[row]}
    for item, problem in deeper.items():
        if held[holder[item]]:
            by_row.setdefault(int(holder[item]), problem)
    return by_row


def _refused(array: pa.Array, kind: pa.DataType) -> list[int]:
    """The positions of ``array`` whose values the safe cast to ``kind`` refuses, by the cast itself:
    one cast where it takes them all, else each half cast in turn (about 2 log2 n ever smaller
    casts per value refused, never a value at a time in Python)."""
    try:
        array.cast(kind)
        return []
    except pa.ArrowInvalid:
        if len(array) == 1:
            return [0]
    half = len(array) // 2
    return _refused(array.slice(0, half), kind) + [half + i for i in _refused(array.slice(half), kind)]


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` in the table's ``schema``: its columns in its order, a column or a struct field the
    rows lack (the table gained it by schema evolution, or the records no longer have it) as NULL."""
    if rows.schema.equals(schema, check_metadata=False) and not any(_hides_required(f.type) for f in schema):
        return rows
    arrays = [_conform(rows.column(f.name).combine_chunks(), f.type) if f.name in rows.column_names
              else pa.nulls(rows.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _hides_required(kind: pa.DataType) -> bool:
    """Whether values of ``kind`` may hold a NOT NULL struct field under a NULL struct (at any
    depth), where a decoder or Spark leaves a NULL that Parquet's writer refuses."""
    if pa.types.is_struct(kind):
        return any(not f.nullable or _hides_required(f.type) for f in kind)
    if pa.types.is_map(kind):
        return _hides_required(kind.item_type)
    if pa.types.is_list(kind):  # the nested types _conform rebuilds (no decoder makes large or fixed-size lists)
        return _hides_required(kind.value_type)
    return False


def _conform(array: pa.Array, kind: pa.DataType) -> pa.Array:
    if array.type.equals(kind) and not _hides_required(kind):
        return array
    if pa.types.is_struct(kind) and pa.types.is_struct(array.type):
        children = dict(zip((f.name for f in array.type), array.flatten()))  # as unholdable_values judged them
        fields = list(kind)
        arrays = [_conform(children[f.name], f.type) if f.name in children else pa.nulls(len(array), f.type)
                  for f in fields]
        if array.null_count:  # a NOT NULL field under a NULL struct: no value is stored, and Parquet's writer refuses a NULL
            hidden = array.is_null()
            arrays = [pc.if_else(hidden, _placeholders(f.type, len(array)), a) if not f.nullable and a.null_count else a
                      for f, a in zip(fields, arrays)]
        return pa.StructArray.from_arrays(arrays, fields=fields, mask=array.is_null())
    if pa.types.is_list(kind) and pa.types.is_list(array.type):
        offsets, values = _reached(array, array.values)
        return pa.ListArray.from_arrays(offsets, _conform(values, kind.value_type), type=kind, mask=array.is_null())
    if pa.types.is_map(kind) and pa.types.is_map(array.type):
        (offsets, keys), (_, items) = _reached(array, array.keys), _reached(array, array.items)
        return pa.MapArray.from_arrays(offsets, _conform(keys, kind.key_type), _conform(items, kind.item_type),
                                       type=kind, mask=array.is_null())
    return array.cast(kind)


def _placeholders(kind: pa.DataType, count: int) -> pa.Array:
    """``count`` values of ``kind`` holding no NULL at any depth (zero, empty, false): what a NOT NULL
    field holds under a NULL struct, where nothing reads it."""
    if pa.types.is_struct(kind):
        return pa.StructArray.from_arrays([_placeholders(f.type, count) for f in kind], fields=list(kind))
    offsets = pa.array(np.zeros(count + 1, np.int32))
    if pa.types.is_map(kind):
        return pa.MapArray.from_arrays(offsets, pa.array([], kind.key_type), pa.array([], kind.item_type), type=kind)
    if pa.types.is_list(kind):
        return pa.ListArray.from_arrays(offsets, pa.array([], kind.value_type), type=kind)
    if pa.types.is_large_list(kind):
        return pa.LargeListArray.from_arrays(offsets.cast(pa.int64()), pa.array([], kind.value_type), type=kind)
    if pa.types.is_fixed_size_list(kind):
        return pa.FixedSizeListArray.from_arrays(_placeholders(kind.value_type, count * kind.list_size), type=kind)
    if pa.types.is_fixed_size_binary(kind):
        return pa.array([bytes(kind.byte_width)] * count, kind)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return pa.array([""] * count, pa.string()).cast(kind)
    if pa.types.is_decimal(kind):
        return pa.array([0] * count, pa.decimal128(1, 0)).cast(kind)
    return pa.array(np.zeros(count, np.int32 if pa.types.is_date32(kind) or pa.types.is_time32(kind) else np.int64)).cast(kind)


def _reached(array: pa.Array, child: pa.Array) -> tuple[pa.Array, pa.Array]:
    """A list's or map's offsets from 0 and the part of its ``child`` (values, keys, items) they
    reach: a slice's own, a NULL list's backing values included (``flatten`` leaves those out,
    which the offsets then no longer fit)."""
    offsets = array.offsets
    first, last = offsets[0].as_py(), offsets[-1].as_py()
    if first:
        offsets = pc.subtract(offsets, pa.scalar(first, offsets.type))
    return offsets, child.slice(first, last - first)
