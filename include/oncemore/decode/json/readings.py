"""Leaves a writer sends as more than one JSON kind, each read from every kind it may come as into
its one declared type (the envelope says which leaves, decode/envelope.py; json/decoder.py parses
a leaf as the kind Arrow's reader finds there):

- ``TextReading``: a STRING a connector writes as a JSON string or a number (Debezium's
  ``source.txId`` and ``source.lsn``: numbers from PostgreSQL, text from Oracle, YugabyteDB,
  Informix). The text; a number as its digits.
- ``DecimalReading``: a DECIMAL(p,s) Debezium writes. A JSON string is the unscaled value's
  big-endian two's-complement bytes in base64 (``decimal.handling.mode=precise`` through
  JsonConverter's ``decimal.format=BASE64``, both the defaults) at its scale: the one the record's
  Connect schema gives (``org.apache.kafka.connect.data.Decimal``, parameter ``scale``), else the
  declared one; or, where the record's schema says the column is a string
  (``decimal.handling.mode=string``), the number's text. A JSON object is a VariableScaleDecimal
  ``{"scale", "value"}`` (value in base64). A JSON number is the number (``double``, or
  ``decimal.format=NUMERIC``); a JSON string where the record's schema names another type (a
  double's ``"NaN"`` or ``"Infinity"``) is none.

Invariant: each value converts exactly into the declared type, or its record gets the reason
naming the path; nothing is rounded. What a JSON string means is fixed per leaf and record (its
schema, else the documented default), never "a number where it parses as one".
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from oncemore.core.ddl import to_ddl
from oncemore.decode.json.types import beyond_precision, cast_each, from_base64

# What a DECIMAL leaf's JSON string is, per record (DecimalReading's ``meanings``): a scale (a
# Connect Decimal's may be negative) is base64 of the unscaled value at that scale; or one of these.
NUMERIC_TEXT = -1000  # the number's text (the record's schema: a string)
NO_SCALE = -1001  # the record's schema names a Decimal without a usable scale
# The record's schema gives the column another type (a double's NaN and Infinity are JSON strings).
NOT_DECIMAL = -1002
# Kafka Connect's logical type of a decimal (connect/api Decimal.LOGICAL_NAME).
CONNECT_DECIMAL = "org.apache.kafka.connect.data.Decimal"


@dataclass(frozen=True)
class TextReading:
    """A STRING leaf written as a JSON string or number (module docstring)."""

    # JSON kind -> what Arrow's reader parses it as, the first tried first; and the kinds whose
    # parse type takes another kind too (checked, json/decoder.py): none.
    kinds: ClassVar[dict] = {"string": pa.string(), "number": pa.int64()}
    guarded: ClassVar[frozenset] = frozenset()

    def convert(self, parsed: pa.StructArray, rows: np.ndarray, path: str,
                meanings: np.ndarray | None = None) -> tuple[pa.Array, dict[int, str]]:
        """``parsed``: the leaf's slots (canonical_type); ``rows``: each slot's record (unused)."""
        texts, numbers = parsed.flatten()
        return pc.coalesce(texts, numbers.cast(pa.string())), {}


@dataclass(frozen=True)
class DecimalReading:
    """A DECIMAL(p,s) leaf Debezium writes (module docstring). ``base64``: what a JSON string is
    when no schema says (True: base64 at the declared scale; False: the number's text)."""

    declared: pa.Decimal128Type
    base64: bool

    # Arrow's reader takes a numeric JSON string into a decimal too: a block read with the number
    # kind is checked to hold numbers only (json/decoder.py).
    guarded: ClassVar[frozenset] = frozenset({"number"})

    @property
    def kinds(self) -> dict:
        return {"string": pa.string(), "object": pa.struct([("scale", pa.int32()), ("value", pa.string())]),
                "number": self.declared}

    def default_meaning(self) -> int:
        return self.declared.scale if self.base64 else NUMERIC_TEXT

    def convert(self, parsed: pa.StructArray, rows: np.ndarray, path: str,
                meanings: np.ndarray | None = None) -> tuple[pa.Array, dict[int, str]]:
        """``parsed``: the leaf's slots (canonical_type: one child per kind, one set per slot);
        ``rows``: each slot's record; ``meanings``: per record, what a string is (None: the
        ``default_meaning`` for all)."""
        count, bad = len(parsed), {}
        slot_meanings = np.full(count, self.default_meaning()) if meanings is None else meanings[rows]
        texts, objects, numbers = parsed.flatten()
        object_scales, object_values = objects.flatten()
        wide = pa.decimal128(38, self.declared.scale)
        # Base64 strings and VariableScaleDecimal values: unscaled bytes, each at its scale.
        string_valid = texts.is_valid().to_numpy(zero_copy_only=False)
        object_valid = objects.is_valid().to_numpy(zero_copy_only=False)
        encoded = pc.if_else(pa.array(string_valid & (slot_meanings > NUMERIC_TEXT)), texts, object_values)
        scales = np.where(string_valid, slot_meanings, object_scales.fill_null(NO_SCALE).to_numpy(zero_copy_only=False))
        in_bytes = (string_valid & (slot_meanings > NUMERIC_TEXT)) | object_valid
        for slot in np.flatnonzero(string_valid & (slot_meanings == NO_SCALE)).tolist():
            bad[slot] = (f"column {path!r}: its Connect schema names a {CONNECT_DECIMAL} without a scale "
                         "parameter, so the value's scale is unknown")
        for slot in np.flatnonzero(string_valid & (slot_meanings == NOT_DECIMAL)).tolist():
            bad[slot] = (f"column {path!r}: {texts[slot].as_py()[:64]!r} is no decimal (the record's Connect schema "
                         "gives the column a type other than a Decimal or a string: a double's NaN or Infinity?)")
        for slot in np.flatnonzero(object_valid & (pc.is_null(object_values).to_numpy(zero_copy_only=False)
                                                   | (scales == NO_SCALE))).tolist():
            bad[slot] = f"column {path!r}: a VariableScaleDecimal needs both its scale and its value"
        from_bytes = _from_unscaled(encoded, np.where(in_bytes, scales, 0), in_bytes & ~_marked(bad, count),
                                    wide, path, self.declared, bad)
        # Numeric text: the record's schema says the column is a string, or no schema says (envelope none).
        text_slots = string_valid & (slot_meanings == NUMERIC_TEXT)
        from_text, failed = cast_each(pc.if_else(pa.array(text_slots), texts, None), wide)
        for slot in failed:
            bad.setdefault(slot, f"column {path!r}: {texts[slot].as_py()[:64]!r} is not a number that fits "
                                 f"{to_ddl(self.declared)}")
        values = pc.coalesce(from_bytes, from_text, numbers.cast(wide))
        for slot in beyond_precision(values, self.declared).tolist():
            bad.setdefault(slot, f"column {path!r}: {values[slot].as_py()} does not fit {to_ddl(self.declared)}")
        keep = pa.array(~_marked(bad, count))
        return pc.if_else(keep, values, None).cast(self.declared, safe=False), bad


def _marked(bad: dict[int, str], count: int) -> np.ndarray:
    marked = np.zeros(count, dtype=bool)
    marked[list(bad)] = True
    return marked


def _from_unscaled(encoded: pa.StringArray, scales: np.ndarray, wanted: np.ndarray, wide: pa.Decimal128Type,
                   path: str, declared: pa.Decimal128Type, bad: dict[int, str]) -> pa.Array:
    """Base64 of unscaled big-endian two's-complement integers (Java's BigInteger.toByteArray, as
    Connect's Decimal writes them), each at ``scales[slot]``, as ``wide`` (the declared scale, 38
    digits), for the ``wanted`` slots; the reason for each that is not one, or does not fit, in ``bad``."""
    count = len(encoded)
    raw, not_base64 = from_base64(pc.if_else(pa.array(wanted), encoded, None))
    for slot in not_base64.tolist():
        bad[slot] = (f"column {path!r}: {encoded[slot].as_py()[:64]!r} is not base64 (Debezium's precise decimal: "
                     "the unscaled value's bytes; for decimal.handling.mode=string declare the column STRING)")
    offsets = np.frombuffer(raw.buffers()[1], dtype=np.int32)[raw.offset: raw.offset + count + 1].astype(np.int64)
    data = np.frombuffer(raw.buffers()[2], dtype=np.uint8) if raw.buffers()[2] is not None else np.zeros(0, np.uint8)
    lengths = np.where(raw.is_valid().to_numpy(zero_copy_only=False), np.diff(offsets), -1)
    for slot in np.flatnonzero(lengths == 0).tolist():
        bad[slot] = f"column {path!r}: an empty unscaled value is no decimal"
    # Longer than 16 bytes: only redundant sign bytes may lead (a minimal encoding has none).
    starts = offsets[:-1].copy()
    for slot in np.flatnonzero(lengths > 16).tolist():
        body = data[starts[slot]: starts[slot] + lengths[slot]]
        sign = 0xFF if body[0] >= 0x80 else 0x00
        cut = lengths[slot] - 16
        if np.all(body[:cut] == sign) and (body[cut] >= 0x80) == (sign == 0xFF):
            starts[slot], lengths[slot] = starts[slot] + cut, 16
        else:
            bad[slot] = f"column {path!r}: an unscaled value of {lengths[slot]} bytes does not fit {to_ddl(declared)}"
    good = (lengths > 0) & (lengths <= 16) & ~_marked(bad, count)
    # Sign-extended to 16 bytes, big-endian, then reversed: Arrow's decimal128 is little-endian.
    matrix = np.zeros((count, 16), dtype=np.uint8)
    negative = good & (data[np.where(good, starts, 0)] >= 0x80) if len(data) else good & False
    matrix[negative] = 0xFF
    owner = np.repeat(np.flatnonzero(good), lengths[good])
    within = np.arange(len(owner)) - np.repeat(np.cumsum(lengths[good]) - lengths[good], lengths[good])
    matrix[owner, 16 - lengths[owner] + within] = data[starts[owner] + within]
    little = np.ascontiguousarray(matrix[:, ::-1]).tobytes()
    values: list[pa.Array] = []
    order = np.flatnonzero(good)
    for scale in np.unique(scales[good]).tolist():
        slots = order[scales[order] == scale]
        # Arrow takes any scale (a VariableScaleDecimal's may be 127, or -40); one beyond -38..38
        # rescales into ``wide`` where the value fits and fails the cast where it does not.
        unscaled = pa.Array.from_buffers(pa.decimal128(38, scale), count, [None, pa.py_buffer(little)]).take(pa.array(slots))
        rescaled, failed = cast_each(unscaled, wide)
        for at in failed:
            slot = int(slots[at])
            # Python's Decimal, not as_py(): it names the value at a scale Arrow's conversion refuses.
            value = Decimal(int.from_bytes(little[slot * 16: slot * 16 + 16], "little", signed=True)).scaleb(-scale)
            bad.setdefault(slot, f"column {path!r}: {value} does not fit {to_ddl(declared)}")
        values.append(pc.if_else(pa.array(np.isin(np.arange(count), slots)), _scatter(rescaled, slots, count, wide), None))
    return pc.coalesce(*values) if values else pa.nulls(count, wide)


def _scatter(values: pa.Array, slots: np.ndarray, count: int, kind: pa.DataType) -> pa.Array:
    """``values[i]`` at ``slots[i]`` of an array of ``count``, null elsewhere."""
    at = np.full(count, -1)
    at[slots] = np.arange(len(slots))
    return values.take(pa.array(at, mask=at < 0)) if len(values) else pa.nulls(count, kind)


Reading = TextReading | DecimalReading


def decimal_meanings(reading: DecimalReading, schemas: list[dict], reader: tuple[str, ...]) -> np.ndarray:
    """What a JSON string of the leaf at ``reader`` is under each of ``schemas`` (the records'
    JsonConverter schemas, json/connect.py) and, last, under none: a scale (base64 of the unscaled
    value at it), NUMERIC_TEXT, NO_SCALE or NOT_DECIMAL."""
    from oncemore.decode.json.connect import field_schema

    found = []
    for schema in schemas:
        leaf = field_schema(schema, reader)
        meaning = reading.default_meaning()
        if isinstance(leaf, dict) and leaf.get("name") == CONNECT_DECIMAL:
            try:
                meaning = int((leaf.get("parameters") or {})["scale"])
            except (KeyError, TypeError, ValueError):
                meaning = NO_SCALE
        elif isinstance(leaf, dict) and leaf.get("type") == "string":
            meaning = NUMERIC_TEXT
        elif isinstance(leaf, dict) and "type" in leaf:
            meaning = NOT_DECIMAL
        found.append(meaning)
    return np.array([*found, reading.default_meaning()], dtype=np.int64)


def at_leaves(kind: pa.DataType, leaves: dict[tuple[str, ...], pa.DataType], reader: tuple[str, ...] = ()) -> pa.DataType:
    """Parse type ``kind`` with the type at each reader path of ``leaves`` (``"[]"`` for a list's
    elements) replaced by the one given."""
    if reader in leaves:
        return leaves[reader]
    if not any(path[:len(reader)] == reader for path in leaves):
        return kind
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(at_leaves(f.type, leaves, (*reader, f.name))) for f in kind])
    if pa.types.is_list(kind):
        return pa.list_(at_leaves(kind.value_type, leaves, (*reader, "[]")))
    return kind


def only(kind: pa.DataType, leaves: dict[tuple[str, ...], pa.DataType], reader: tuple[str, ...] = ()) -> pa.DataType | None:
    """Parse type ``kind`` reduced to the paths to ``leaves``, each with the type given (None: none
    under ``reader``)."""
    if reader in leaves:
        return leaves[reader]
    if pa.types.is_struct(kind):
        fields = [(f.name, inner) for f in kind if (inner := only(f.type, leaves, (*reader, f.name))) is not None]
        return pa.struct(fields) if fields else None
    if pa.types.is_list(kind):
        inner = only(kind.value_type, leaves, (*reader, "[]"))
        return pa.list_(inner) if inner is not None else None
    return None


def canonical_type(reading: Reading) -> pa.StructType:
    """How a leaf read from several kinds is held until it is converted: one child per kind."""
    return pa.struct(list(reading.kinds.items()))


def canonical(array: pa.Array, readings: dict[tuple[str, ...], Reading], kinds: dict[tuple[str, ...], str],
              reader: tuple[str, ...] = ()) -> pa.Array:
    """``array``, parsed with each leaf of ``readings`` as the kind ``kinds`` names, with those leaves
    as canonical_type: the child of that kind holding the values, the others null."""
    if reader in readings:
        kind = kinds[reader]
        children = [array if name == kind else pa.nulls(len(array), parsed)
                    for name, parsed in readings[reader].kinds.items()]
        return pa.StructArray.from_arrays(children, names=list(readings[reader].kinds),
                                          mask=array.is_null() if array.null_count else None)
    if not any(path[:len(reader)] == reader for path in readings):
        return array
    mask = array.is_null() if array.null_count else None
    if pa.types.is_struct(array.type):
        names = [f.name for f in array.type]
        children = [canonical(array.field(i), readings, kinds, (*reader, name)) for i, name in enumerate(names)]
        return pa.StructArray.from_arrays(children, names=names, mask=mask)
    if pa.types.is_list(array.type):
        offsets = array.offsets.to_numpy()
        items = array.values.slice(offsets[0], offsets[-1] - offsets[0])
        elements = canonical(items, readings, kinds, (*reader, "[]"))
        return pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int32()), elements, mask=mask)
    return array
