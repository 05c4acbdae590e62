"""The declared types as Arrow's JSON reader reads them (the *parse type*), and the checked way
back to the declared types, for the json decoder (decoder.py).

Arrow's JSON reader has no map type, takes dates only as day numbers, takes any JSON number into a
float32 (1e39 becomes inf) and a string's raw bytes as binary, and accepts decimals with more integer
digits than their precision (it checks the digits as written, then rescales). So it reads every field
as nullable, MAP as a list of {"key", "value"} objects, DATE, TIMESTAMP, TIMESTAMP_NTZ and BINARY as
strings and FLOAT as DOUBLE; ``convert`` then builds the declared types, vectorised at every depth:
NOT NULL fields, ISO-8601 dates and timestamps of years 1 to 9999 (a TIMESTAMP without a zone is UTC,
a TIMESTAMP_NTZ with one is refused), base64 BINARY (RFC 4648, padded), FLOAT within its range,
DECIMAL within its precision.

Invariant: every slot converts exactly, or the top-level row holding it gets a one-line reason
naming the path (ddl.py's notation) and quoting at most 64 characters of the value.
"""

from __future__ import annotations

import decimal
from typing import Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from oncemore.core.ddl import field_path, to_ddl

_ZONED = r"[T ][0-9:.]*(Z|[+-][0-9]{2}(:?[0-9]{2})?)$"
# Years 1 to 9999 as days (DATE) and microseconds (TIMESTAMP) from the epoch.
_YEARS_1_TO_9999 = {pa.int32(): (-719_162, 2_932_896), pa.int64(): (-62_135_596_800_000_000, 253_402_300_799_999_999)}
_BASE64 = np.full(256, 255, dtype=np.uint8)
_BASE64[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", np.uint8)] = np.arange(64)
_BASE64[ord("=")] = 64


def parse_type(kind: pa.DataType) -> pa.DataType:
    """What Arrow's JSON reader is asked to read for ``kind`` (module docstring)."""
    if pa.types.is_struct(kind):
        return pa.struct([pa.field(f.name, parse_type(f.type)) for f in kind])
    if pa.types.is_list(kind):
        return pa.list_(parse_type(kind.value_type))
    if pa.types.is_map(kind):
        return pa.list_(pa.struct([("key", pa.string()), ("value", parse_type(kind.item_type))]))
    if pa.types.is_date32(kind) or pa.types.is_timestamp(kind) or pa.types.is_binary(kind):
        return pa.string()
    if pa.types.is_float32(kind):
        return pa.float64()
    return kind


def convert(parsed: pa.StructArray, declared: pa.StructType,
            readings: Mapping[tuple[str, ...], Callable] | None = None) -> tuple[pa.StructArray, dict[int, str]]:
    """Rows of parse type ``parse_type(declared)`` as ``declared``, and by row why one cannot be (its
    slots then hold whatever converted: the caller must not store that row). ``readings``: the
    leaves read from several JSON kinds (json/readings.py), by reader path (``("after", "balance")``,
    ``"[]"`` for list elements), each a function (its slots, each slot's row, its path) -> (the
    leaf as declared, the reason by slot for those that cannot be)."""
    failures: dict[int, str] = {}
    return _convert(parsed, declared, "", (), lambda slots: slots, failures, readings or {}), failures


def _convert(parsed: pa.Array, declared: pa.DataType, path: str, reader: tuple[str, ...], owner,
             failures: dict[int, str], readings: Mapping[tuple[str, ...], Callable]) -> pa.Array:
    """``parsed`` (of the parse type) as ``declared``. A slot that cannot be gives the reason to
    ``failures`` under its owner, the top-level row holding it (``owner`` maps slots to rows)."""

    def fail(slots, reason) -> None:
        for slot, row in zip(slots, owner(np.asarray(slots, dtype=np.int64))):
            failures.setdefault(int(row), reason(int(slot)))

    if reader in readings:
        converted, bad = readings[reader](parsed, owner(np.arange(len(parsed), dtype=np.int64)), path)
        fail(sorted(bad), lambda slot: bad[slot])
        return converted
    mask = parsed.is_null() if parsed.null_count else None
    if pa.types.is_struct(declared):
        children = []
        for index, field in enumerate(declared):
            child_path = field_path(path, field.name)
            child = _convert(parsed.field(index), field.type, child_path, (*reader, field.name), owner, failures,
                             readings)
            if not field.nullable and child.null_count:
                missing = pc.and_(child.is_null(), parsed.is_valid())
                fail(_indices(missing), lambda _: f"column {child_path!r} is declared NOT NULL but is missing or null")
            children.append(child)
        return pa.StructArray.from_arrays(children, fields=list(declared), mask=mask)
    if pa.types.is_list(declared) or pa.types.is_map(declared):
        offsets = parsed.offsets.to_numpy()
        items = parsed.values.slice(offsets[0], offsets[-1] - offsets[0])
        rebased = pa.array(offsets - offsets[0], pa.int32())

        def item_owner(slots):
            return owner(np.searchsorted(offsets, slots + offsets[0], side="right") - 1)

        if pa.types.is_list(declared):
            elements = _convert(items, declared.value_type, path + "[]", (*reader, "[]"), item_owner, failures, readings)
            return pa.ListArray.from_arrays(rebased, elements, type=declared, mask=mask)
        values = _convert(items.field(1), declared.item_type, path + "{}", (*reader, "[]", "value"), item_owner,
                          failures, readings)
        return pa.MapArray.from_arrays(rebased, items.field(0), values, type=declared, mask=mask)
    if pa.types.is_date32(declared) or pa.types.is_timestamp(declared):
        converted, bad = _temporal(parsed, declared)
        fail(bad, lambda slot: f"column {path!r}: {parsed[slot].as_py()[:64]!r} is not a valid {to_ddl(declared)} "
                               "(ISO-8601, years 1 to 9999)")
        return converted
    if pa.types.is_binary(declared):
        converted, bad = from_base64(parsed)
        fail(bad, lambda slot: f"column {path!r}: {parsed[slot].as_py()[:64]!r} is not base64 "
                               "(BINARY is read from base64 text, as Spark does)")
        return converted
    if pa.types.is_float32(declared):
        converted = parsed.cast(pa.float32())
        fail(_indices(pc.and_(pc.is_inf(converted), pc.invert(pc.is_inf(parsed)))),
             lambda slot: f"column {path!r}: {parsed[slot].as_py()} is beyond FLOAT's range")
        return converted
    if pa.types.is_decimal(declared):
        fail(beyond_precision(parsed, declared),
             lambda slot: f"column {path!r}: {parsed[slot].as_py()} does not fit {to_ddl(declared)}")
    return parsed


def _indices(mask: pa.Array) -> np.ndarray:
    return pc.indices_nonzero(pc.fill_null(mask, False)).to_numpy()


def beyond_precision(values: pa.Array, kind: pa.Decimal128Type) -> np.ndarray:
    """Slots holding more integer digits than ``kind`` allows. Arrow's JSON reader checks the digits as
    written, then rescales: 1234.5 becomes 1234.50 in a DECIMAL(5,2), and a 37-digit integer becomes a
    39-digit value in a DECIMAL(38,2); no reader of the table could read them back."""
    wide = values.cast(pa.decimal256(76, kind.scale))
    limit = pa.scalar(decimal.Decimal(10) ** (kind.precision - kind.scale), wide.type)
    return _indices(pc.greater_equal(pc.abs(wide), limit))


def _temporal(text: pa.StringArray, kind: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """ISO-8601 text as a date or timestamp of years 1 to 9999, and the slots that are not."""
    if pa.types.is_timestamp(kind) and kind.tz is not None:
        zoned = pc.match_substring_regex(text, _ZONED)
        instants, bad_zoned = cast_each(pc.if_else(zoned, text, None), kind)
        # No zone: UTC, the session time zone oncemore gives Spark.
        naive, bad_naive = cast_each(pc.if_else(zoned, None, text), pa.timestamp(kind.unit))
        values, bad = pc.if_else(zoned, instants, naive.cast(kind)), bad_zoned + bad_naive
    else:
        values, bad = cast_each(text, kind)
    storage = pa.int32() if pa.types.is_date32(kind) else pa.int64()
    low, high = _YEARS_1_TO_9999[storage]
    numbers = values.cast(storage)
    outside = _indices(pc.or_(pc.less(numbers, low), pc.greater(numbers, high)))
    return values, np.union1d(np.asarray(bad, dtype=np.int64), outside)


def cast_each(values: pa.Array, kind: pa.DataType) -> tuple[pa.Array, list[int]]:
    """``values`` cast to ``kind``, the slots that do not cast left null: the whole array at once, or
    by halves around the ones that fail."""
    try:
        return values.cast(kind), []
    except pa.ArrowInvalid:
        if len(values) == 1:
            return pa.nulls(1, kind), [0]
    middle = len(values) // 2
    left, bad_left = cast_each(values.slice(0, middle), kind)
    right, bad_right = cast_each(values.slice(middle), kind)
    return pa.concat_arrays([left, right]), bad_left + [middle + slot for slot in bad_right]


def from_base64(text: pa.StringArray) -> tuple[pa.BinaryArray, np.ndarray]:
    """Base64 text (RFC 4648 alphabet, padded, nothing else) as bytes, and the slots that are not."""
    count = len(text)
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)[text.offset : text.offset + count + 1].astype(np.int64)
    data = (np.frombuffer(text.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
            if offsets[-1] > offsets[0] else np.zeros(0, np.uint8))
    starts, lengths = offsets[:-1] - offsets[0], np.diff(offsets)
    owner = np.repeat(np.arange(count), lengths)  # the slot of every character
    sextets = _BASE64[data]
    pad = sextets == 64
    pads = np.bincount(owner[pad], minlength=count)
    bad = (lengths % 4 != 0) | (pads > 2)
    bad[owner[sextets == 255]] = True
    bad[owner[pad & (np.arange(len(data)) - starts[owner] < (lengths - pads)[owner])]] = True  # '=' before the end
    groups = (sextets[~bad[owner]] & 63).reshape(-1, 4)  # padding decodes as zero bits, dropped below
    decoded = np.empty((len(groups), 3), dtype=np.uint8)
    decoded[:, 0] = (groups[:, 0] << 2) | (groups[:, 1] >> 4)
    decoded[:, 1] = (groups[:, 1] << 4) | (groups[:, 2] >> 2)
    decoded[:, 2] = (groups[:, 2] << 6) | groups[:, 3]
    full = np.where(bad, 0, lengths // 4 * 3)
    kept = full - np.where(bad, 0, pads)
    decoded_owner = np.repeat(np.arange(count), full)
    position = np.arange(full.sum()) - (np.cumsum(full) - full)[decoded_owner]
    payload = decoded.reshape(-1)[position < kept[decoded_owner]]
    new_offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int32)
    array = pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(new_offsets), pa.py_buffer(payload)])
    bad_slots = np.flatnonzero(bad & np.asarray(text.is_valid().to_numpy(zero_copy_only=False)))
    return pc.if_else(pc.and_(text.is_valid(), pa.array(~bad)), array, None), bad_slots
