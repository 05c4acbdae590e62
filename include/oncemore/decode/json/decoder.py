"""JSON values as rows of a declared schema (Spark DDL, see ddl.py): the json format's ValueDecoder.

Invariant (decode/decoder.py): one row per input, in input order, or the input's index in ``errors`` with a
one-line reason naming the path (``customer.address.zip``, ``items[]`` for ARRAY elements, ``attrs{}``
for MAP values) and quoting at most 64 characters of the value; never a silent NULL, never a default.
In the spirit of Spark's from_json in FAILFAST mode, but per value: a value is exactly one JSON object
in UTF-8; every declared value must be of its declared type:
- integers: JSON numbers without fraction or exponent, within the type's range;
- DECIMAL(p,s): JSON numbers or numeric strings with at most s fractional and p-s integer digits;
- FLOAT, DOUBLE: JSON numbers within the type's range (NaN and Infinity are kept, as Spark reads them);
- BOOLEAN: true or false; STRING: JSON strings only; BINARY: base64 strings (RFC 4648, padded), as
  Spark's JSON reader reads binary;
- DATE, TIMESTAMP, TIMESTAMP_NTZ: ISO-8601 strings of years 1 to 9999 (a number is refused: its unit
  would be a guess); a TIMESTAMP without a zone is UTC; a TIMESTAMP_NTZ with one is refused;
- STRUCT: a JSON object, undeclared fields ignored; ARRAY: a JSON array; MAP: a JSON object whose keys
  appear once each (Spark refuses duplicate map keys).

What becomes NULL by design: a null input (whether a tombstone is acceptable is the caller's call);
a missing field or JSON null for a nullable column or struct field; a JSON null element of an ARRAY or
value of a MAP (Spark DDL makes both nullable). A JSON object without any declared field is a struct
whose fields are NULL, not a NULL struct. A missing or null NOT NULL field is an error.

How: Arrow's JSON reader parses a whole batch at once, one value per line, against the parse type
(json/types.py: what the reader can read, e.g. DATE as text, MAP as a list of entries); types.py then
converts the columns to the declared types and checks what the reader does not, vectorised at every
depth. A batch the reader refuses is bisected, and a parse error naming its row takes that row out
alone first, so a few bad values cost a few extra parses. The reader's messages name a path or only a
type; for the latter the field is found by parsing the value alone without each candidate field. If
the schema has a MAP, each value first goes through Python's json module, which rewrites map objects
as entry lists (rewrite.py): per-value Python work, the price of MAP columns (here ~100k values/s
against 500-800k for a schema without one).

Leaves a writer sends as more than one JSON kind (``readings``: Debezium's source fields, its
decimals; json/readings.py, decode/envelope.py) are parsed as one kind at a time, the one the reader
last found there: when it finds another, it says so ("changed from string to number") and the block
is read again with that leaf switched, once per leaf; a block holding both kinds is bisected as any
refused block is. A kind whose parse type also takes another (a decimal takes numeric text) is
checked first by reading the block with the leaf as a double, which takes numbers only.

Alignment: a value that does not start with '{' and end with '}' (whitespace aside) is refused
before parsing, and a raw newline inside a value reaches the reader as a carriage return (JSON
whitespace too, and as invalid inside a string). So each line ends with a '}': if it closes the
value's outermost object, the next line starts a new one; if it closes an inner one, the next line's
'{' is a syntax error; if it sits in a string, the newline is. An object never spans two values, and
"as many rows as values" proves one row per value. (Without the '}' check, '{"a":' and '{"x":1}}'
read as one object, and a later '{}{}' as two: the count comes out right, every row misplaced.)
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from oncemore.core.ddl import check_json_types, field_path, to_ddl, types_within
from oncemore.decode.decoder import DecodedValues
from oncemore.decode.json.connect import Unwrapped
from oncemore.decode.json.objects import not_json_objects
from oncemore.decode.json.readings import (DecimalReading, Reading, at_leaves, canonical, canonical_type,
                                           decimal_meanings, only)
from oncemore.decode.json.rewrite import Refused, Rewriter
from oncemore.decode.json.types import convert, parse_type

_CHANGED = re.compile(r"Column\((.*)\) changed from \S+ to (\S+) in row")
_TWICE = re.compile(r"Column\((.*)\) was specified twice")
# Arrow's messages for a JSON number a column cannot take name the column's type, not its path.
_UNFIT = [re.compile(r"Failed to convert JSON to (?P<type>\w+(?:\(\d+, \d+\))?)(?:, couldn't parse:|: )(?P<value>\S*)"),
          re.compile(r"The string (?P<value>'.*') is not a valid (?P<type>decimal128) number"),
          re.compile(r"(?P<value>Empty string) cannot be converted to (?P<type>decimal128)")]
_IN_ROW = re.compile(r" in row (\d+)$")
_TOO_BIG = "Number too big to be stored in double"


class JsonDecoder:
    """Decodes JSON values into ``schema`` (see the module docstring). ``readings``: the leaves read
    from more than one JSON kind (json/readings.py), by reader path (``("source", "lsn")``)."""

    def __init__(self, schema: pa.Schema, readings: Mapping[tuple[str, ...], Reading] | None = None):
        check_json_types(schema)
        self.schema = schema
        self._readings = dict(readings or {})
        self._declared = pa.struct(list(schema))
        self._base_type = parse_type(self._declared)
        # The kind each leaf of ``readings`` is parsed as now: switched when the reader finds another.
        self._kinds = {reader: next(iter(reading.kinds)) for reader, reading in self._readings.items()}
        self._canonical_type = at_leaves(self._base_type, {r: canonical_type(x) for r, x in self._readings.items()})
        self._flexible = {"/" + "/".join(reader): reader for reader in self._readings}
        self._has_map = any(pa.types.is_map(kind) for _, kind in types_within(self._declared, ""))
        self._rewriter = Rewriter(self._declared, self._readings)

    def __reduce__(self):
        # Spark ships decoders to its Python workers by pickling: rebuild there from the schema.
        return JsonDecoder, (self.schema, self._readings)

    @property
    def _parse_type(self) -> pa.StructType:
        """What the reader is asked to read now: each flexible leaf as the kind it is parsed as."""
        return at_leaves(self._base_type, {r: self._readings[r].kinds[k] for r, k in self._kinds.items()})

    def _nodes(self) -> dict[str, tuple]:
        """Every field, ARRAY element and MAP value, keyed as Arrow's messages name it
        ("/customer/address/zip"): (its reader path, its path, declared type, parse type now)."""
        return {"/" + "/".join(reader): (reader, path, declared, parsed)
                for reader, path, declared, parsed in _nodes(self._declared, self._parse_type, (), "")}

    def decode(self, values: pa.Array, connect: Unwrapped | None = None) -> DecodedValues:
        """``connect``: the values' JsonConverter schemas (connect.py), when they came wrapped."""
        values = values.cast(pa.binary())
        errors = not_json_objects(values)
        rows = np.flatnonzero(pc.is_valid(values).to_numpy(zero_copy_only=False))  # input index of each text
        if errors:
            rows = rows[~np.isin(rows, list(errors))]
        texts = values if len(rows) == len(values) else values.take(rows)
        if self._has_map:
            texts, refused = self._with_map_entries(texts)
            rows = _refuse(rows, refused, errors)
        pieces, refused = [], {}
        if len(texts):
            self._parse(texts, 0, len(texts), pieces, refused)
        rows = _refuse(rows, refused, errors)
        chunks = [chunk for table in pieces for chunk in table.to_struct_array().chunks]
        parsed = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks or [pa.array([], self._canonical_type)])
        converted, failures = convert(parsed, self._declared, self._converters(connect, rows))
        if len(rows) < len(values) or failures:
            # Inputs without a row (null, refused, failed) get a null row; the others keep theirs, in order.
            at = np.full(len(values), -1)
            at[rows] = np.arange(len(rows))
            for slot, message in failures.items():
                errors[int(rows[slot])] = message
                at[rows[slot]] = -1
            converted = converted.take(pa.array(at, mask=at < 0))
        return DecodedValues(pa.Table.from_struct_array(converted), errors)

    def _parse(self, texts: pa.Array, start: int, stop: int, pieces: list[pa.Table], refused: dict[int, str]) -> None:
        """Parses texts[start:stop] into ``pieces`` (in order); each text the reader refuses alone goes
        to ``refused`` by position. A refused block is bisected; when the reader's error names a row
        (a parse error does), that row is taken out alone first."""
        while start < stop:
            try:
                pieces.append(self._read_now(texts.slice(start, stop - start)))
                return
            except (pa.ArrowInvalid, _NotOneObject) as exc:
                if stop - start == 1:
                    self._parse_one(texts[start].as_py(), start, exc, pieces, refused)
                    return
                named = _IN_ROW.search(str(exc))
            row = int(named.group(1)) if named else stop - start
            if row < stop - start:
                self._parse(texts, start, start + row, pieces, refused)
                self._parse(texts, start + row, start + row + 1, pieces, refused)
                start += row + 1
            middle = (start + stop) // 2
            self._parse(texts, start, middle, pieces, refused)
            start = middle

    def _parse_one(self, text: bytes, position: int, exc: Exception, pieces: list[pa.Table],
                   refused: dict[int, str]) -> None:
        if _TOO_BIG in str(exc):
            # Arrow's reader refuses a number beyond a double's range anywhere, even in a field it would
            # ignore: without its undeclared fields the value may read, and a declared one gets named.
            try:
                text = self._rewriter.text(text.decode()).encode()
            except Refused as refusal:
                refused[position] = str(refusal)
                return
            try:
                pieces.append(self._read_now(pa.array([text], pa.binary())))
                return
            except (pa.ArrowInvalid, _NotOneObject) as again:
                exc = again
        refused[position] = self._message(text, exc)

    def _read_now(self, texts: pa.Array) -> pa.Table:
        """``texts`` read with each flexible leaf as the kind it is parsed as now, switched to the
        kind the reader names when it finds another there (each leaf once: a block holding both
        raises, and is bisected), the leaves held as their canonical type. A leaf whose parse type
        takes another kind too (a decimal takes numeric text) is checked to hold its kind only."""
        switched: set[tuple[str, ...]] = set()
        while True:
            try:
                guarded = {r: pa.float64() for r, k in self._kinds.items() if k in self._readings[r].guarded}
                if guarded:  # first: a float64 takes numbers only, and a string there makes the reader say so
                    self._read(texts, only(self._base_type, guarded))
                table = self._read(texts)
                if not self._readings:
                    return table
                return pa.Table.from_struct_array(canonical(table.to_struct_array().combine_chunks(), self._readings,
                                                            self._kinds))
            except pa.ArrowInvalid as exc:
                changed = _CHANGED.search(str(exc))
                reader = self._flexible.get(changed.group(1)) if changed else None
                if reader is None or reader in switched or changed.group(2) not in self._readings[reader].kinds:
                    raise
                switched.add(reader)
                self._kinds[reader] = changed.group(2)

    def _converters(self, connect: Unwrapped | None, rows: np.ndarray) -> dict:
        """convert()'s functions for the flexible leaves, for the parsed rows (input indices ``rows``):
        what a string of a decimal leaf is, per record, from its JsonConverter schema if it has one."""
        converters = {}
        for reader, reading in self._readings.items():
            meanings = None
            if connect is not None and isinstance(reading, DecimalReading):
                meanings = decimal_meanings(reading, connect.schemas, reader)[connect.schema_index[rows]]
            converters[reader] = partial(reading.convert, meanings=meanings)
        return converters

    def _read(self, texts: pa.Array, parse_type: pa.StructType | None = None) -> pa.Table:
        text = _one_per_line(texts)
        table = pajson.read_json(
            pa.BufferReader(text),
            read_options=pajson.ReadOptions(use_threads=False, block_size=max(text.size + 1, 1 << 16)),
            parse_options=pajson.ParseOptions(explicit_schema=pa.schema(list(parse_type or self._parse_type)),
                                              unexpected_field_behavior="ignore"),
        )
        if table.num_rows != len(texts):
            raise _NotOneObject(f"value holds {table.num_rows} JSON objects, expected exactly one")
        return table

    def _message(self, text: bytes, exc: Exception) -> str:
        """One line for why the reader refused ``text`` alone."""
        reason = str(exc)
        if isinstance(exc, _NotOneObject):
            return reason
        changed = _CHANGED.search(reason)
        nodes = self._nodes()
        if changed and changed.group(1) not in nodes:  # inside a flexible leaf's object (a decimal's scale)
            return f"column {changed.group(1).strip('/').replace('/', '.')!r}: found a JSON {changed.group(2)}"
        if changed:
            _, path, declared, parsed = nodes[changed.group(1)]
            found = changed.group(2)
            why = ""
            if changed.group(1) in self._flexible:
                why = f" (a JSON {' or '.join(self._readings[self._flexible[changed.group(1)]].kinds)})"
            elif pa.types.is_string(parsed) and not pa.types.is_string(declared):
                why = (" (base64 text)" if pa.types.is_binary(declared)
                       else " (ISO-8601 text; a number's unit would be a guess)")
            return f"column {path!r}: expected {to_ddl(declared)}{why}, found a JSON {found}"
        twice = _TWICE.search(reason)
        if twice and twice.group(1) in nodes:
            return f"column {nodes[twice.group(1)][1]!r}: the key appears twice in one JSON object"
        for pattern in _UNFIT:
            unfit = pattern.search(reason)
            if unfit:
                culprit = self._culprit(text, unfit.group("type"), reason)
                if culprit:
                    return f"column {culprit[1]!r}: {unfit.group('value')[:64]} does not fit {to_ddl(culprit[2])}"
        reason = re.sub(r"^JSON parse error: | in row \d+$", "", reason.strip())
        return f"invalid JSON ({reason}): {text[:64].decode('utf-8', 'replace')!r}{'...' if len(text) > 64 else ''}"

    def _culprit(self, text: bytes, type_name: str, reason: str) -> tuple | None:
        """The leaf of Arrow type ``type_name`` that made the reader refuse ``text`` with ``reason``:
        the one whose removal from the parse type makes it read, or refuse for another reason."""
        candidates = [node for node in self._nodes().values()
                      if str(node[3]) == type_name or (type_name == "decimal128" and pa.types.is_decimal(node[3]))]
        if len(candidates) == 1:
            return candidates[0]
        for candidate in candidates:
            try:
                self._read(pa.array([text]), _without(self._parse_type, candidate[0]))
                return candidate
            except (pa.ArrowInvalid, _NotOneObject) as exc:
                if str(exc) != reason:
                    return candidate
        return None

    def _with_map_entries(self, texts: pa.Array) -> tuple[pa.Array, dict[int, str]]:
        rewritten, refused = [], {}
        for position, text in enumerate(texts.cast(pa.string()).to_pylist()):
            try:
                rewritten.append(self._rewriter.text(text))
            except Refused as refusal:
                refused[position] = str(refusal)
        return pa.array(rewritten, pa.string()).cast(pa.binary()), refused

class _NotOneObject(ValueError):
    pass


def _refuse(rows: np.ndarray, refused: dict[int, str], errors: dict[int, str]) -> np.ndarray:
    """Records the refused positions' reasons by input index; the rows left, in order."""
    if not refused:
        return rows
    for position, message in refused.items():
        errors[int(rows[position])] = message
    keep = np.ones(len(rows), dtype=bool)
    keep[list(refused)] = False
    return rows[keep]


def _one_per_line(texts: pa.Array) -> pa.Buffer:
    """The texts (none null) one per line. A raw newline inside a text becomes a carriage return:
    JSON whitespace as well, and as invalid inside a string."""
    texts = texts.cast(pa.binary())
    lines = pc.binary_join_element_wise(texts, pa.scalar(b"\n"), b"")
    size = int(np.frombuffer(lines.buffers()[1], np.int32)[len(lines)])  # a fresh array: its data starts at 0
    if np.count_nonzero(np.frombuffer(lines.buffers()[2], np.uint8, count=size) == 10) > len(texts):
        return _one_per_line(pc.replace_substring(texts, "\n", "\r"))
    return lines.buffers()[2].slice(0, size)


def _nodes(declared: pa.DataType, parsed: pa.DataType, reader: tuple[str, ...], path: str):
    """(reader path, path, declared type, parse type) of every field, element and map value below."""
    if pa.types.is_struct(declared):
        for field, parsed_field in zip(declared, parsed):
            inner = (*reader, field.name), field_path(path, field.name)
            yield *inner, field.type, parsed_field.type
            yield from _nodes(field.type, parsed_field.type, *inner)
    elif pa.types.is_list(declared):
        yield (*reader, "[]"), path + "[]", declared.value_type, parsed.value_type
        yield from _nodes(declared.value_type, parsed.value_type, (*reader, "[]"), path + "[]")
    elif pa.types.is_map(declared):
        value = parsed.value_type.field("value").type
        yield (*reader, "[]", "value"), path + "{}", declared.item_type, value
        yield from _nodes(declared.item_type, value, (*reader, "[]", "value"), path + "{}")


def _without(kind: pa.DataType, reader: tuple[str, ...]) -> pa.DataType:
    """Parse type ``kind`` without the field at ``reader``, or the innermost field holding it."""
    head, rest = reader[0], reader[1:]
    if head == "[]":
        return pa.list_(_without(kind.value_type, rest))
    fields = []
    for field in kind:
        if field.name != head:
            fields.append(field)
        elif any(part != "[]" for part in rest):
            fields.append(field.with_type(_without(field.type, rest)))
    return pa.struct(fields)
