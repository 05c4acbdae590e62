"""Delta per-file statistics (numRecords, minValues, maxValues, nullCount) of the rows a file holds.

A wrong bound silently hides rows from every reader that skips files by statistics, a missing
one only costs a scan; so a bound is written only when it is certainly right: strings are cut to
a prefix (a valid minimum; a cut maximum is left out), timestamps are written with millisecond
precision rounded outward (min down, max up), dates and timestamps outside years 1-9999 and
non-finite floats get no bound, and bounds are computed from integers, never through Python
datetimes (which cannot hold year 10000 and print year 999 as "999").
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc

STRING_PREFIX = 32
_EPOCH = datetime(1970, 1, 1)
# Microseconds from the epoch to 0001-01-01T00:00:00 and to the last millisecond of 9999.
_MIN_MICROS = -62_135_596_800_000_000
_MAX_MICROS = 253_402_300_799_999_000
FIRST_DAY, LAST_DAY = -719_162, 2_932_896  # 0001-01-01 and 9999-12-31, in days from the epoch


class FileStats:
    """Accumulates statistics over the tables written to one file. Columns are the schema's leaves:
    a struct's fields are nested in the statistics as Delta writes them (``{"s": {"a": 1}}``), an
    array or a map gets none (as delta-rs and Spark write them: a number where a reader expects
    an object makes it drop the file's statistics, its record count included)."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.leaves = [(path, kind) for field in schema for path, kind in _leaves((field.name,), field.type)]
        self.num_records = 0
        self.null_count = {path: 0 for path, _ in self.leaves}
        self.minimum: dict[tuple[str, ...], object] = {}
        self.maximum: dict[tuple[str, ...], object] = {}
        self.unbounded: set[tuple[tuple[str, ...], str]] = set()  # (leaf, side) that saw a value no bound may cover

    def add(self, table: pa.Table) -> None:
        self.num_records += table.num_rows
        for path, kind in self.leaves:
            column = _leaf(table, path)
            self.null_count[path] += column.null_count
            if column.null_count == len(column):
                continue
            low, high = _bounds(column, kind)
            self._merge(path, low, "min")
            self._merge(path, high, "max")

    def _merge(self, path: tuple[str, ...], value, side: str) -> None:
        into, pick = (self.minimum, min) if side == "min" else (self.maximum, max)
        if (path, side) in self.unbounded:
            return
        if value is _NO_BOUND:
            self.unbounded.add((path, side))
            into.pop(path, None)
        elif value is not None:
            into[path] = value if path not in into else pick(into[path], value)

    def to_json(self) -> str:
        kinds = dict(self.leaves)
        stats = {"numRecords": self.num_records, "minValues": {}, "maxValues": {}, "nullCount": {}}
        for side, found in (("min", self.minimum), ("max", self.maximum)):
            for path, value in found.items():
                text = _text(value, kinds[path], side)
                if text is not _NO_BOUND:
                    _nest(stats["minValues" if side == "min" else "maxValues"], path, text)
        for path, count in self.null_count.items():
            _nest(stats["nullCount"], path, count)
        return json.dumps(stats)


def _leaves(path: tuple[str, ...], kind: pa.DataType):
    """(path, type) of the statistics' leaves under ``kind``: a struct's fields, recursively;
    arrays and maps have none."""
    if pa.types.is_struct(kind):
        for child in kind:
            yield from _leaves(path + (child.name,), child.type)
    elif not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind)):
        yield path, kind


def _leaf(table: pa.Table, path: tuple[str, ...]) -> pa.ChunkedArray:
    """The values of a leaf; a null struct makes its fields null (``flatten`` keeps the parent's
    validity, ``field`` would not)."""
    column = table.column(path[0])
    for name in path[1:]:
        index = column.type.get_field_index(name)
        column = pa.chunked_array([chunk.flatten()[index] for chunk in column.chunks],
                                  type=column.type.field(index).type)
    return column


def _nest(into: dict, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        into = into.setdefault(name, {})
    into[path[-1]] = value


_NO_BOUND = object()


def _bounds(column: pa.ChunkedArray, kind: pa.DataType) -> tuple[object, object]:
    """(min, max) in a comparable form, None where the type gets no bounds, _NO_BOUND where this
    column's values forbid one."""
    if pa.types.is_timestamp(kind):
        column = column.cast(pa.int64())
    elif pa.types.is_date32(kind):
        column = column.cast(pa.int32())
    elif not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_string(kind)):
        return None, None
    if pa.types.is_floating(kind) and pc.any(pc.is_nan(column)).as_py():
        # min_max skips NaN, but a reader compares it (NaN > 5 is true in DuckDB and Spark):
        # a file holding NaN gets no bound on that column at all.
        return _NO_BOUND, _NO_BOUND
    found = pc.min_max(column).as_py()
    low, high = found["min"], found["max"]
    if pa.types.is_floating(kind) and not (math.isfinite(low) and math.isfinite(high)):
        # JSON has no infinity.
        return _NO_BOUND, _NO_BOUND
    return low, high


def _text(value, kind: pa.DataType, side: str):
    """A bound as Delta's stats JSON writes it, or _NO_BOUND."""
    if pa.types.is_timestamp(kind):
        if kind.unit != "us":
            return _NO_BOUND
        millis = value // 1000 if side == "min" else -((-value) // 1000)  # outward to the millisecond
        if not _MIN_MICROS <= millis * 1000 <= _MAX_MICROS:
            return _NO_BOUND
        moment = _EPOCH + timedelta(milliseconds=millis)
        text = (f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment.hour:02d}:{moment.minute:02d}:"
                f"{moment.second:02d}.{moment.microsecond // 1000:03d}")
        return text + "Z" if kind.tz else text
    if pa.types.is_date32(kind):
        if not FIRST_DAY <= value <= LAST_DAY:
            return _NO_BOUND
        day = _EPOCH + timedelta(days=value)
        return f"{day.year:04d}-{day.month:02d}-{day.day:02d}"
    if isinstance(value, str) and len(value) > STRING_PREFIX:
        return value[:STRING_PREFIX] if side == "min" else _NO_BOUND
    return value
