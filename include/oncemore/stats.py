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
_MIN_DAYS, _MAX_DAYS = -719_162, 2_932_896


class FileStats:
    """Accumulates statistics over the tables written to one file."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.num_records = 0
        self.null_count = {f.name: 0 for f in schema}
        self.minimum: dict[str, object] = {}
        self.maximum: dict[str, object] = {}
        self.unbounded: set[tuple[str, str]] = set()  # (column, side) that saw a value no bound may cover

    def add(self, table: pa.Table) -> None:
        self.num_records += table.num_rows
        for field in self.schema:
            column = table.column(field.name)
            self.null_count[field.name] += column.null_count
            if column.null_count == len(column):
                continue
            low, high = _bounds(column, field.type)
            self._merge(field.name, low, "min")
            self._merge(field.name, high, "max")

    def _merge(self, name: str, value, side: str) -> None:
        into, pick = (self.minimum, min) if side == "min" else (self.maximum, max)
        if (name, side) in self.unbounded:
            return
        if value is _NO_BOUND:
            self.unbounded.add((name, side))
            into.pop(name, None)
        elif value is not None:
            into[name] = value if name not in into else pick(into[name], value)

    def to_json(self) -> str:
        minimum = {n: _text(v, self.schema.field(n).type, "min") for n, v in self.minimum.items()}
        maximum = {n: _text(v, self.schema.field(n).type, "max") for n, v in self.maximum.items()}
        return json.dumps({
            "numRecords": self.num_records,
            "minValues": {n: v for n, v in minimum.items() if v is not _NO_BOUND},
            "maxValues": {n: v for n, v in maximum.items() if v is not _NO_BOUND},
            "nullCount": self.null_count,
        })


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
    found = pc.min_max(column).as_py()
    low, high = found["min"], found["max"]
    if pa.types.is_floating(kind) and not (math.isfinite(low) and math.isfinite(high)):
        # NaN sorts nowhere and JSON has no infinity: no bound for this column at all.
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
        if not _MIN_DAYS <= value <= _MAX_DAYS:
            return _NO_BOUND
        day = _EPOCH + timedelta(days=value)
        return f"{day.year:04d}-{day.month:02d}-{day.day:02d}"
    if isinstance(value, str) and len(value) > STRING_PREFIX:
        return value[:STRING_PREFIX] if side == "min" else _NO_BOUND
    return value
