"""Spark's decoders as the reference (issue 28): the same bytes decoded by oncemore's decoders and by
Spark's own ``from_avro`` (spark-avro, on a Connect server started with the Spark packages) and
``from_json``, over a corpus of schemas and edge values. Each case gives the same rows and the same
types, or it is in ``KNOWN``: a named difference with its reason, asserted to be exactly what it is
(so a change on either side fails here). docs/pipelines.md's "Spark's decoders as the reference" lists
the same differences.

Spark runs in PERMISSIVE mode (from_json's default; from_avro's default is FAILFAST, where a record
Spark cannot read fails the whole query instead of giving the NULLs shown here), with the session
time zone UTC, as oncemore's sessions have it; all cases in one query, but for the values that fail
Spark's whole query even so, each read alone. A record oncemore quarantines is ``QUARANTINED``; a
struct whose fields are all NULL is ``NULLS`` (what PERMISSIVE gives for a record it cannot read);
dates compare as days and timestamps as microseconds since the epoch (Python's datetime stops at
year 9999); types compare as Spark's simple strings, nullability aside (oncemore makes every
column nullable).

Protobuf is not here: spark-protobuf is not served by Maven Central on this machine (docs/pipelines.md).
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import fastavro
import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import from_arrow_type

from oncemore.core.columns import SchemaError
from oncemore.core.ddl import parse_ddl
from oncemore.decode.avro.decoder import AvroDecoder
from oncemore.decode.decoder import SchemaAhead
from oncemore.decode.json.decoder import JsonDecoder
from oncemore.decode.registry import RegistrySchema, SchemaNotFound

QUARANTINED, NULLS, AHEAD, REFUSED = "QUARANTINED", "NULLS", "AHEAD", "REFUSED"


# ---------------------------------------------------------------------------------------------
# The corpus


@dataclass
class AvroCase:
    name: str
    writer: Any  # the writer's schema (parsed JSON)
    records: list  # values fastavro writes with it
    reader: Any = None  # the table's (reader's) schema, when it is another
    bodies: list = field(default_factory=list)  # more Avro bodies, as bytes (crafted: garbage, edges)
    raises: set = field(default_factory=set)  # rows whose decoding fails Spark's whole query: each read alone
    spark_refuses: bool = False  # Spark refuses the schema itself: the case is tried alone, REFUSED if it fails


@dataclass
class JsonCase:
    name: str
    ddl: str
    texts: list  # JSON values (str, or bytes as they are)
    raises: set = field(default_factory=set)  # as AvroCase's
    spark_refuses: bool = False


def record(name: str, *fields: tuple) -> dict:
    return {"type": "record", "name": name,
            "fields": [{"name": f[0], "type": f[1], **({"default": f[2]} if len(f) > 2 else {})} for f in fields]}


def logical(kind: str, logical_type: str, **more) -> dict:
    return {"type": kind, "logicalType": logical_type, **more}


def zigzag(n: int) -> bytes:
    """An Avro long as written."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def unscaled(n: int) -> bytes:
    """A decimal's unscaled value as Avro bytes (length-prefixed two's complement)."""
    raw = n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True)
    return zigzag(len(raw)) + raw


ENUM = {"type": "enum", "name": "Suit", "symbols": ["HEARTS", "SPADES"]}
FIXED4 = {"type": "fixed", "name": "Four", "size": 4}
POINT = record("Point", ("x", "int"), ("y", "int"))
INT_MIN, INT_MAX, LONG_MIN, LONG_MAX = -(2 ** 31), 2 ** 31 - 1, -(2 ** 63), 2 ** 63 - 1

AVRO_CASES = [
    AvroCase("primitives", record("P", ("b", "boolean"), ("i", "int"), ("l", "long"), ("f", "float"), ("d", "double"),
                                  ("s", "string"), ("y", "bytes")),
             [{"b": True, "i": 1, "l": 2, "f": 1.5, "d": -2.5, "s": "text", "y": b"\x00\xff"},
              {"b": False, "i": INT_MIN, "l": LONG_MIN, "f": float("nan"), "d": float("inf"), "s": "", "y": b""},
              {"b": False, "i": INT_MAX, "l": LONG_MAX, "f": -float("inf"), "d": float("nan"), "s": "caf\u00e9 \U0001F600",
               "y": b"x" * 100}]),
    AvroCase("decimal-bytes", record("D", ("d", logical("bytes", "decimal", precision=9, scale=2))),
             [{"d": Decimal("0.00")}, {"d": Decimal("1234567.89")}, {"d": Decimal("-9999999.99")}, {"d": Decimal("-0.01")}],
             bodies=[unscaled(10 ** 9)]),  # 10000000.00: one digit more than DECIMAL(9,2) holds
    AvroCase("decimal-fixed", record("D", ("d", logical("fixed", "decimal", name="Money", size=8, precision=18, scale=4))),
             [{"d": Decimal("0.0000")}, {"d": Decimal("12345678901234.5678")}, {"d": Decimal("-0.0001")}],
             bodies=[(10 ** 18).to_bytes(8, "big", signed=True)]),  # 19 digits in a DECIMAL(18,4)
    AvroCase("decimal-38", record("D", ("d", logical("bytes", "decimal", precision=38, scale=10))),
             [{"d": Decimal("9" * 28 + "." + "9" * 10)}, {"d": Decimal("-1E-10")}]),
    AvroCase("uuid", record("U", ("u", logical("string", "uuid"))),
             [{"u": "123e4567-e89b-12d3-a456-426614174000"}, {"u": "not-a-uuid"}, {"u": ""}]),
    AvroCase("date", record("D", ("d", logical("int", "date"))),
             [{"d": 0}, {"d": 19782}, {"d": -1}, {"d": 2932896}, {"d": 2932897}, {"d": -719162}, {"d": -141428},
              {"d": INT_MAX}, {"d": INT_MIN}]),
    AvroCase("time-millis", record("T", ("t", logical("int", "time-millis"))),
             [{"t": 0}, {"t": 86_399_999}, {"t": -1}, {"t": 86_400_000}]),
    AvroCase("time-micros", record("T", ("t", logical("long", "time-micros"))),
             [{"t": 0}, {"t": 86_399_999_999}, {"t": -1}, {"t": LONG_MAX}], raises={2}),
    AvroCase("timestamp-millis", record("T", ("t", logical("long", "timestamp-millis"))),
             [{"t": 0}, {"t": 1_709_251_200_123}, {"t": -1}, {"t": -62_135_596_800_000}, {"t": 253_402_300_799_999},
              {"t": -12_219_292_800_001}, {"t": LONG_MAX}, {"t": 10 ** 16}]),
    AvroCase("timestamp-micros", record("T", ("t", logical("long", "timestamp-micros"))),
             [{"t": 0}, {"t": 1_709_251_200_123_456}, {"t": -1}, {"t": -62_135_596_800_000_000},
              {"t": 253_402_300_799_999_999}, {"t": LONG_MAX}, {"t": LONG_MIN}]),
    AvroCase("local-timestamp-millis", record("T", ("t", logical("long", "local-timestamp-millis"))),
             [{"t": 0}, {"t": 1_709_251_200_123}, {"t": -62_135_596_800_000}, {"t": LONG_MIN}]),
    AvroCase("local-timestamp-micros", record("T", ("t", logical("long", "local-timestamp-micros"))),
             [{"t": 0}, {"t": 1_709_251_200_123_456}, {"t": -62_135_596_800_000_000}, {"t": LONG_MAX}]),
    AvroCase("duration", record("T", ("d", {"type": "fixed", "name": "Dur", "size": 12, "logicalType": "duration"})),
             [{"d": b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"}]),
    AvroCase("enum", record("E", ("e", ENUM)), [{"e": "HEARTS"}, {"e": "SPADES"}], bodies=[zigzag(2), zigzag(-1)]),
    AvroCase("fixed", record("F", ("f", FIXED4)), [{"f": b"\x00\x01\x02\x03"}, {"f": b"\xff" * 4}]),
    AvroCase("map", record("M", ("m", {"type": "map", "values": "long"}),
                           ("n", {"type": "map", "values": ["null", "string"]})),
             [{"m": {"a": 1, "b": LONG_MIN}, "n": {"x": None, "y": "v"}}, {"m": {}, "n": {}},
              {"m": {"": 0, "\u00e9": 1}, "n": {"k": ""}}]),
    AvroCase("array", record("A", ("xs", {"type": "array", "items": "int"}),
                             ("ps", {"type": "array", "items": POINT}),
                             ("nested", {"type": "array", "items": {"type": "array", "items": ["null", "string"]}})),
             [{"xs": [1, 2, 3], "ps": [{"x": 1, "y": 2}], "nested": [["a", None], []]},
              {"xs": [], "ps": [], "nested": []}]),
    AvroCase("nested-record", record("N", ("id", "long"),
                                     ("inner", record("Inner", ("p", POINT), ("tags", {"type": "array", "items": "string"}),
                                                      ("maybe", ["null", "Point"]))),
                                     ("opt", ["null", record("Opt", ("z", "string"))])),
             [{"id": 1, "inner": {"p": {"x": 1, "y": 2}, "tags": ["t"], "maybe": {"x": 3, "y": 4}}, "opt": {"z": "z"}},
              {"id": 2, "inner": {"p": {"x": 0, "y": 0}, "tags": [], "maybe": None}, "opt": None}]),
    AvroCase("union-null-first", record("U", ("s", ["null", "string"]), ("l", ["null", "long"]),
                                        ("d", ["null", logical("long", "timestamp-micros")])),
             [{"s": None, "l": None, "d": None}, {"s": "x", "l": 5, "d": 1_709_251_200_123_456}]),
    AvroCase("union-null-last", record("U", ("s", ["string", "null"]), ("e", [ENUM, "null"])),
             [{"s": "x", "e": "SPADES"}, {"s": None, "e": None}]),
    AvroCase("union-int-long", record("U", ("n", ["int", "long"]), ("m", ["null", "long", "int"])),
             [{"n": 1, "m": None}, {"n": LONG_MAX, "m": 2}, {"n": INT_MIN, "m": LONG_MIN}]),
    AvroCase("union-float-double", record("U", ("x", ["float", "double"])),
             [{"x": 1.5}, {"x": 1e300}, {"x": float("nan")}]),
    AvroCase("union-multi", record("U", ("v", ["null", "string", "long", POINT]), ("w", ["int", "string"]),
                                   ("n", ["boolean", "double", "bytes", {"type": "array", "items": "int"},
                                          {"type": "map", "values": "int"}])),
             [{"v": None, "w": 1, "n": True}, {"v": "s", "w": "t", "n": 2.5}, {"v": 7, "w": 0, "n": b"b"},
              {"v": {"x": 1, "y": 2}, "w": "", "n": [1]}, {"v": "", "w": -1, "n": {"k": 1}}]),
    AvroCase("union-named", record("U", ("v", ["null", ENUM, FIXED4, record("Rec", ("a", "int"))])),
             [{"v": None}, {"v": "HEARTS"}, {"v": b"abcd"}, {"v": {"a": 1}}]),
    AvroCase("union-of-int-long-string", record("U", ("v", ["int", "long", "string"])),
             [{"v": 1}, {"v": LONG_MAX}, {"v": "s"}]),
    AvroCase("recursive", record("Node", ("next", ["null", "Node"])), [{"next": {"next": None}}], spark_refuses=True),
    AvroCase("top-level-string", "string", ["a", ""]),
    AvroCase("top-level-array", {"type": "array", "items": "long"}, [[1, 2], []]),
    AvroCase("top-level-union", ["null", "int"], [None, 3]),
    AvroCase("evolution-added-fields-with-defaults",
             record("V", ("id", "int"), ("name", "string"), ("ratio", "float")),
             [{"id": 1, "name": "a", "ratio": 0.5}, {"id": INT_MIN, "name": "", "ratio": -1.5}],
             reader=record("V", ("id", "long"), ("name", "string"), ("ratio", "double"),
                           ("email", ["null", "string"], None), ("score", "int", 7), ("suit", ENUM, "SPADES"),
                           ("tags", {"type": "array", "items": "string"}, ["t"]),
                           ("at", logical("long", "timestamp-millis"), 1000),
                           ("money", logical("bytes", "decimal", precision=5, scale=2), "\u0004\u00d2"),
                           ("point", POINT, {"x": 1, "y": 2}))),
    AvroCase("evolution-removed-field",
             record("V", ("id", "int"), ("old", "string")), [{"id": 1, "old": "gone"}],
             reader=record("V", ("id", "int"))),
    AvroCase("evolution-enum-symbol-added",
             record("E", ("e", {"type": "enum", "name": "Suit", "symbols": ["HEARTS", "SPADES", "CLUBS"]})),
             [{"e": "HEARTS"}, {"e": "CLUBS"}],
             reader=record("E", ("e", {"type": "enum", "name": "Suit", "symbols": ["HEARTS", "SPADES"], "default": "HEARTS"}))),
    AvroCase("evolution-union-widened",
             record("V", ("v", "string")), [{"v": "s"}],
             reader=record("V", ("v", ["null", "string"], None))),
    AvroCase("evolution-logical-type-changed",
             record("T", ("t", logical("long", "timestamp-millis"))), [{"t": 1_709_251_200_123}],
             reader=record("T", ("t", logical("long", "timestamp-micros")))),
    AvroCase("bodies-not-of-the-schema", record("R", ("a", "int"), ("s", "string")),
             [{"a": 1, "s": "ok"}],
             bodies=[b"", b"\x02", b"\x02\x10abc", b"\x02\x02x" + b"\x00\x00", b"\x02\x01"]),  # empty, truncated, trailing, negative length
]

JSON_CASES = [
    JsonCase("integers", "a TINYINT, b SMALLINT, c INT, d BIGINT", [
        '{"a": 127, "b": -32768, "c": 2147483647, "d": -9223372036854775808}',
        '{"a": 128}', '{"b": 32768}', '{"c": 2147483648}', '{"d": 9223372036854775808}', '{"a": -129}',
        '{"c": 1.0}', '{"c": 1.5}', '{"c": 1e2}', '{"c": "12"}', '{"c": true}', '{"c": null}', '{}',
        '{"c": 1, "extra": [1, {"x": 2}], "d": 5}']),
    JsonCase("floats", "f FLOAT, d DOUBLE", [
        '{"f": 1.5, "d": -2.5e-3}', '{"f": 3, "d": 4}', '{"f": NaN, "d": -Infinity}', '{"f": "NaN", "d": "Infinity"}',
        '{"f": 1e39}', '{"d": 1e309}', '{"f": "1.5"}', '{"d": true}', '{"f": 1e-50}']),
    JsonCase("decimal", "x DECIMAL(5,2)", [
        '{"x": 123.45}', '{"x": "123.45"}', '{"x": -0.5}', '{"x": 1e2}', '{"x": 1234.5}', '{"x": 1.234}',
        '{"x": 999.995}', '{"x": "abc"}', '{"x": ""}', '{"x": true}', '{"x": 12}']),
    JsonCase("decimal-38", "x DECIMAL(38,0), y DECIMAL(38,37)", [
        '{"x": 99999999999999999999999999999999999999, "y": 9.9999999999999999999999999999999999999}',
        '{"x": 100000000000000000000000000000000000000}', '{"y": 10.0}']),
    JsonCase("boolean", "b BOOLEAN", ['{"b": true}', '{"b": false}', '{"b": "true"}', '{"b": 1}', '{"b": null}']),
    JsonCase("string", "s STRING", [
        '{"s": "x"}', '{"s": ""}', '{"s": "caf\\u00e9 \\ud83d\\ude00"}', '{"s": 12}', '{"s": 1.50}', '{"s": true}',
        '{"s": {"a": 1}}', '{"s": [1, "x"]}', '{"s": null}']),
    JsonCase("binary", "y BINARY", ['{"y": "AAH/"}', '{"y": ""}', '{"y": "not base64!"}', '{"y": "AAE"}', '{"y": 12}']),
    JsonCase("date", "d DATE", [
        '{"d": "2024-02-29"}', '{"d": "0001-01-01"}', '{"d": "9999-12-31"}', '{"d": "2024-2-9"}', '{"d": "2024-02-30"}',
        '{"d": "2024-02-29T10:00:00"}', '{"d": "+10000-01-01"}', '{"d": 19782}', '{"d": "yesterday"}']),
    JsonCase("timestamp", "t TIMESTAMP", [
        '{"t": "2024-02-29T23:30:00+01:00"}', '{"t": "2024-02-29T10:00:00Z"}', '{"t": "2024-02-29 10:00:00"}',
        '{"t": "2024-02-29T10:00:00.123456"}', '{"t": "2024-02-29"}', '{"t": "2024-02-29T10:00:00.1234567"}',
        '{"t": "0001-01-01T00:00:00Z"}', '{"t": 1700000000}', '{"t": 1700000000.5}', '{"t": "garbage"}',
        '{"t": "2024-02-29T10:00"}']),
    JsonCase("timestamp-ntz", "t TIMESTAMP_NTZ", [
        '{"t": "2024-02-29T23:30:00.123456"}', '{"t": "2024-02-29 10:00:00"}', '{"t": "2024-02-29T23:30:00+01:00"}',
        '{"t": "2024-02-29T10:00:00Z"}', '{"t": "2024-02-29"}', '{"t": 5}']),
    JsonCase("array", "xs ARRAY<INT>", [
        '{"xs": [1, 2]}', '{"xs": []}', '{"xs": [1, null]}', '{"xs": "x"}', '{"xs": [1, "a"]}', '{"xs": {"a": 1}}',
        '{"xs": [2147483648]}', '{"xs": null}']),
    JsonCase("map", "m MAP<STRING, INT>", [
        '{"m": {"a": 1, "b": 2}}', '{"m": {}}', '{"m": {"a": null}}', '{"m": {"a": "x"}}', '{"m": {"a": 1, "a": 2}}',
        '{"m": []}', '{"m": [{"key": "a", "value": 1}]}', '{"m": 3}']),
    JsonCase("nested", "s STRUCT<a: INT, b: STRUCT<c: STRING, d: ARRAY<DATE>>>, t ARRAY<STRUCT<k: STRING, v: MAP<STRING, DOUBLE>>>", [
        '{"s": {"a": 1, "b": {"c": "x", "d": ["2024-01-01"]}}, "t": [{"k": "k", "v": {"x": 1.5}}]}',
        '{"s": {"b": {}}, "t": []}', '{"s": {"a": 1, "zz": 2, "b": {"c": "x", "e": 1}}}', '{"s": null, "t": null}',
        '{"s": [1], "t": [{"k": 1}]}', '{"s": {"a": 1, "b": {"d": ["not a date"]}}}', '{"t": [{"v": {"x": "y"}}]}',
        '{"s": {"a": "wrong", "b": {"c": "fine"}}, "t": [{"k": "fine"}]}']),
    JsonCase("char-varchar", "c CHAR(2), v VARCHAR(3)", ['{"c": "ab", "v": "abc"}', '{"c": "abc", "v": "abcd"}'],
             spark_refuses=True),
    JsonCase("not-null", "a INT NOT NULL, b STRING", ['{"a": 1, "b": "x"}', '{"b": "x"}', '{"a": null}']),
    JsonCase("not-one-object", "a INT", [
        '[{"a": 1}]', '1', '"a"', 'null', '', 'garbage', '{"a": 1} {"a": 2}', '{"a": 1', '{"a": 1}x', ' {"a": 1} ',
        '{"a": 1, "a": 2}', b'{"a": 1, "s": "\xff"}', '{"a":\n1}']),
]


# ---------------------------------------------------------------------------------------------
# Decoding both ways


class CorpusRegistry:
    """The registry as AvroDecoder asks it: writer schemas by ID (the corpus has no references)."""

    url = "corpus"

    def __init__(self, schemas: dict[int, RegistrySchema]):
        self.schemas = schemas

    def schema(self, schema_id: int, fmt: str | None = None) -> RegistrySchema:
        if schema_id not in self.schemas:
            raise SchemaNotFound(f"no schema {schema_id}")
        return self.schemas[schema_id]

    def version(self, subject: str, version: int, fmt: str | None = None):
        raise SchemaNotFound(f"no subject {subject}")


def avro_bodies(case: AvroCase) -> list[bytes]:
    parsed = fastavro.parse_schema(case.writer)
    bodies = []
    for value in case.records:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, value)
        bodies.append(out.getvalue())
    return bodies + case.bodies


def canonical(value: Any) -> Any:
    """A value as compared: NaN as "NaN", map entries and lists as lists."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def as_numbers(kind: pa.DataType) -> pa.DataType:
    """``kind`` with dates as their days and timestamps as their microseconds (int32, int64): values
    beyond Python's years 1 to 9999 compare as well as the others (types are compared apart)."""
    if pa.types.is_date32(kind):
        return pa.int32()
    if pa.types.is_timestamp(kind):
        return pa.int64()
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(as_numbers(f.type)).with_nullable(True) for f in kind])
    if pa.types.is_map(kind):
        return pa.map_(kind.key_field, kind.item_field.with_type(as_numbers(kind.item_type)))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.list_(kind.value_field.with_type(as_numbers(kind.value_type)))
    return kind


def python_rows(table: pa.Table) -> list[dict]:
    return table.cast(pa.schema([f.with_type(as_numbers(f.type)).with_nullable(True) for f in table.schema])).to_pylist()


def compared(value: Any) -> Any:
    value = canonical(value)
    return NULLS if isinstance(value, dict) and value and all(v is None for v in value.values()) else value


def oncemore_avro(case: AvroCase, bodies: list[bytes]) -> tuple[str | None, list]:
    """oncemore's type (Spark's simple string) and rows for a case: the record's columns as one
    struct (a plain type as itself), QUARANTINED for a record in errors; REFUSED for a schema the
    table cannot take, AHEAD for a writer with what the reader lacks (the run evolves the table)."""
    writer = RegistrySchema(json.dumps(case.writer))
    reader = RegistrySchema(json.dumps(case.reader)) if case.reader is not None else writer
    try:
        decoder = AvroDecoder(CorpusRegistry({1: writer}), reader)
    except SchemaError:
        return REFUSED, [REFUSED] * len(bodies)
    framed = pa.array([b"\x00\x00\x00\x00\x01" + body for body in bodies], pa.binary())
    try:
        decoded = decoder.decode(framed)
    except SchemaAhead:
        return AHEAD, [AHEAD] * len(bodies)
    plain = not (isinstance(case.reader or case.writer, dict) and (case.reader or case.writer)["type"] == "record")
    kind = decoder.schema.field("value").type if plain else pa.struct(list(decoder.schema))
    rows = [row["value"] if plain else row for row in python_rows(decoded.table)]
    return _simple(kind), [QUARANTINED if i in decoded.errors else compared(row) for i, row in enumerate(rows)]


def oncemore_json(case: JsonCase, texts: list[bytes]) -> tuple[str, list]:
    decoder = JsonDecoder(parse_ddl(case.ddl))
    decoded = decoder.decode(pa.array(texts, pa.binary()))
    rows = python_rows(decoded.table)
    return _simple(pa.struct(list(decoder.schema))), [QUARANTINED if i in decoded.errors else compared(row)
                                                      for i, row in enumerate(rows)]


def _simple(kind: pa.DataType) -> str:
    return from_arrow_type(kind, prefer_timestamp_ntz=True).simpleString()


@dataclass
class Outcome:
    spark_type: str
    oncemore_type: str
    spark: list
    oncemore: list

    def differences(self) -> tuple[tuple[str, str] | None, dict[int, tuple]]:
        types = None if self.spark_type == self.oncemore_type else (self.spark_type, self.oncemore_type)
        rows = {i: (s, o) for i, (s, o) in enumerate(zip(self.spark, self.oncemore)) if s != o}
        return types, rows


@pytest.fixture(scope="module")
def outcomes(delta_server) -> dict[str, Outcome]:
    """Every case decoded by oncemore and, in one query on the Connect server with spark-avro, by Spark."""
    return decode_corpus(delta_server.url)


def decode_corpus(url: str) -> dict[str, Outcome]:
    from pyspark.sql import SparkSession

    avro = {f"avro/{case.name}": avro_bodies(case) for case in AVRO_CASES}
    texts = {f"json/{case.name}": [t.encode() if isinstance(t, str) else t for t in case.texts] for case in JSON_CASES}
    inputs = {**avro, **texts}
    cases = [(f"avro/{case.name}", case) for case in AVRO_CASES] + [(f"json/{case.name}", case) for case in JSON_CASES]
    raises = {name: case.raises for name, case in cases}
    refused = {name for name, case in cases if case.spark_refuses}
    spark = SparkSession.builder.remote(url).create()
    try:
        # Every value Spark reads without failing the query, in one query; each that fails it, alone.
        types, found = spark_decode(spark, {name: [None if i in raises[name] else v for i, v in enumerate(values)]
                                            for name, values in inputs.items() if name not in refused})
        for name in refused:
            try:
                spark_decode(spark, {name: inputs[name]})
                types[name], found[name] = "read", ["read"] * len(inputs[name])
            except Exception:
                types[name], found[name] = REFUSED, [REFUSED] * len(inputs[name])
        for name, rows in raises.items():
            for i in sorted(rows):
                try:
                    _, alone = spark_decode(spark, {name: [None] * i + [inputs[name][i]]})
                    found[name][i] = alone[name][i]
                except Exception as exc:
                    found[name][i] = f"QUERY FAILS: {type(exc).__name__}"
    finally:
        spark.stop()
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # the process's other sessions are classic
    outcomes = {}
    for case in AVRO_CASES:
        name = f"avro/{case.name}"
        kind, rows = oncemore_avro(case, avro[name])
        outcomes[name] = Outcome(types[name], kind, found[name], rows)
    for case in JSON_CASES:
        name = f"json/{case.name}"
        kind, rows = oncemore_json(case, texts[name])
        outcomes[name] = Outcome(types[name], kind, found[name], rows)
    return outcomes


def spark_decode(spark, inputs: dict[str, list]) -> tuple[dict[str, str], dict[str, list]]:
    """Spark's result type and rows for each case named in ``inputs`` (its values; None: not read),
    in one query: a column per case, from_avro or from_json of that case's rows."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    cases = {f"avro/{c.name}": c for c in AVRO_CASES} | {f"json/{c.name}": c for c in JSON_CASES}
    rows = [(name, i, value) for name, values in inputs.items() for i, value in enumerate(values)]
    frame = spark.createDataFrame(rows, "case STRING, row INT, input BINARY")
    columns = []
    for name in inputs:
        case = cases[name]
        value = F.when(F.col("case") == name, F.col("input"))
        if isinstance(case, AvroCase):
            options = {"mode": "PERMISSIVE", **({"avroSchema": json.dumps(case.reader)} if case.reader else {})}
            columns.append(from_avro(value, json.dumps(case.writer), options).alias(name))
        else:
            columns.append(F.from_json(value.cast("string"), case.ddl).alias(name))
    result = frame.select("case", "row", *columns)
    types = {f.name: f.dataType.simpleString() for f in result.schema.fields if f.name in inputs}
    # Arrow has no way over Connect for Spark's TIME type (from_avro's time-micros): as JSON text.
    table = result.select("case", "row", *[F.to_json(F.struct(F.col(f"`{name}`").alias("t"))).alias(name)
                                           if "time(" in kind else F.col(f"`{name}`")
                                           for name, kind in types.items()]).toArrow()
    found: dict[str, list] = {name: [None] * len(values) for name, values in inputs.items()}
    for row in python_rows(table):
        if inputs[row["case"]][row["row"]] is not None:
            found[row["case"]][row["row"]] = compared(row[row["case"]])
    return types, found


# ---------------------------------------------------------------------------------------------
# The differences, each with its reason


@dataclass(frozen=True)
class Known:
    reason: str
    rows: dict = field(default_factory=dict)  # row -> (Spark's value, oncemore's)
    types: tuple | None = None  # (Spark's type, oncemore's), where they differ


def nulled(*rows: int) -> dict:
    """Rows Spark reads as NULL (a struct of NULLs, PERMISSIVE) where oncemore quarantines the record."""
    return {i: (NULLS, QUARANTINED) for i in rows}


# Spark's PERMISSIVE mode makes NULL of a value it cannot read; oncemore quarantines the record, with
# its bytes and the reason, and never stores a NULL in place of what could not be stored (decode/decoder.py).
# With from_avro's default FAILFAST, Spark fails the whole query instead.
NULL_FOR_QUARANTINE = "Spark NULLs what it cannot read, oncemore quarantines it"

KNOWN: dict[str, Known] = {
    "avro/decimal-bytes": Known(f"a decimal with more digits than its precision: {NULL_FOR_QUARANTINE}", nulled(4)),
    "avro/decimal-fixed": Known(f"a decimal with more digits than its precision: {NULL_FOR_QUARANTINE}", nulled(3)),
    "avro/timestamp-millis": Known(f"milliseconds beyond a microsecond timestamp: {NULL_FOR_QUARANTINE}", nulled(6, 7)),
    "avro/local-timestamp-millis": Known(f"milliseconds beyond a microsecond timestamp: {NULL_FOR_QUARANTINE}", nulled(3)),
    "avro/time-micros": Known(
        "Spark 4.2 reads time-micros as TIME(6) (time-millis as INT, as oncemore does); no Delta table holds a TIME "
        "column (nor does Arrow carry one over Connect), so oncemore keeps the microseconds after midnight as BIGINT. "
        "A negative time fails Spark's whole query, even PERMISSIVE; one past a day is NULL; oncemore keeps the "
        "integer as written",
        {0: ('{"t":{"t":"00:00:00"}}', {"t": 0}), 1: ('{"t":{"t":"23:59:59.999999"}}', {"t": 86_399_999_999}),
         2: ("QUERY FAILS: DateTimeException", {"t": -1}), 3: ('{"t":{}}', {"t": LONG_MAX})},
        ("struct<t:time(6)>", "struct<t:bigint>")),
    "avro/enum": Known(f"an enum index past the symbols, or negative: {NULL_FOR_QUARANTINE}", nulled(2, 3)),
    "avro/union-of-int-long-string": Known(
        "oncemore refuses the schema: fastavro gives a Python int for the int and the long branch alike, so which "
        "member column a value belongs in would be a guess (a union of exactly int and long is one BIGINT, as in "
        "Spark); Spark reads the written branch index",
        {0: ({"v": {"member0": 1, "member1": None, "member2": None}}, REFUSED),
         1: ({"v": {"member0": None, "member1": LONG_MAX, "member2": None}}, REFUSED),
         2: ({"v": {"member0": None, "member1": None, "member2": "s"}}, REFUSED)},
        ("struct<v:struct<member0:int,member1:bigint,member2:string>>", REFUSED)),
    "avro/top-level-union": Known(
        "a Spark bug: from_avro reads the null branch of a top-level union of null and int as 0; oncemore reads "
        "NULL, as written", {0: (0, None)}),
    "avro/evolution-removed-field": Known(
        "a writer with a field the reader lacks: Spark's from_avro drops it silently; oncemore stops the range "
        "there (SchemaAhead) and the run evolves the table to hold it first",
        {0: ({"id": 1}, AHEAD)}, ("struct<id:int>", AHEAD)),
    "avro/evolution-enum-symbol-added": Known(
        "a writer with an enum symbol the reader lacks: Spark reads the reader's default in its place (CLUBS "
        "becomes HEARTS); oncemore stops the range (SchemaAhead) and the run evolves the table first",
        {0: ({"e": "HEARTS"}, AHEAD), 1: ({"e": "HEARTS"}, AHEAD)}, ("struct<e:string>", AHEAD)),
    "avro/evolution-logical-type-changed": Known(
        "a timestamp-millis writer read into a timestamp-micros reader: Spark reads the milliseconds as "
        "microseconds (2024-03-01 becomes 1970-01-20); oncemore quarantines the writer's records as unresolvable",
        {0: ({"t": 1_709_251_200_123}, QUARANTINED)}),
    "avro/bodies-not-of-the-schema": Known(
        f"truncated bodies: {NULL_FOR_QUARANTINE}; a body with bytes after its record: Spark reads the record and "
        "ignores them, oncemore quarantines it (not written with that writer schema?)",
        {**nulled(1, 2, 3, 5), 4: ({"a": 1, "s": "x"}, QUARANTINED)}),
    "json/integers": Known(
        f"integers out of range, with a fraction or an exponent, or of another JSON type: {NULL_FOR_QUARANTINE}. "
        "128 for a TINYINT is a Spark bug: Jackson's byte reading wraps it to -128",
        {1: ({"a": -128, "b": None, "c": None, "d": None}, QUARANTINED), **nulled(2, 3, 4, 5, 6, 7, 8, 9, 10)}),
    "json/floats": Known(
        f"Spark reads quoted NaN and Infinity as numbers, and a number beyond FLOAT's or DOUBLE's range as Infinity; "
        f"oncemore stores neither a string for a number nor Infinity for a finite number. Other JSON types: "
        f"{NULL_FOR_QUARANTINE}",
        {3: ({"f": "NaN", "d": math.inf}, QUARANTINED), 4: ({"f": math.inf, "d": None}, QUARANTINED),
         5: ({"f": None, "d": math.inf}, QUARANTINED), **nulled(6, 7)}),
    "json/decimal": Known(
        f"Spark rounds a decimal with more fractional digits than its scale (1.234 to 1.23), oncemore stores no "
        f"rounded value; more integer digits than its precision, text that is not a number, other JSON types: "
        f"{NULL_FOR_QUARANTINE}",
        {**nulled(4, 6, 7, 8, 9), 5: ({"x": Decimal("1.23")}, QUARANTINED)}),
    "json/decimal-38": Known(f"more digits than DECIMAL(38,s) holds: {NULL_FOR_QUARANTINE}", nulled(1, 2)),
    "json/boolean": Known(f"a string or a number for a BOOLEAN: {NULL_FOR_QUARANTINE}", nulled(2, 3)),
    "json/string": Known(
        "Spark's STRING takes any JSON value as its text (a number, a boolean, an object, an array); oncemore's "
        "takes JSON strings only: another type is the producer's type error, quarantined",
        {3: ({"s": "12"}, QUARANTINED), 4: ({"s": "1.5"}, QUARANTINED), 5: ({"s": "true"}, QUARANTINED),
         6: ({"s": '{"a":1}'}, QUARANTINED), 7: ({"s": '[1,"x"]'}, QUARANTINED)}),
    "json/binary": Known(f"text that is not base64 (RFC 4648, padded), a number: {NULL_FOR_QUARANTINE}", nulled(2, 3, 4)),
    "json/date": Known(
        f"Spark's DATE parsing is lenient: 2024-2-9, a date followed by a time (the time dropped), and years "
        f"past 9999; oncemore takes ISO-8601 dates of years 1 to 9999 (what Parquet and Delta readers read back). "
        f"An invalid day, a number, other text: {NULL_FOR_QUARANTINE}",
        {3: ({"d": 19762}, QUARANTINED), 5: ({"d": 19782}, QUARANTINED), 6: ({"d": 2_932_897}, QUARANTINED),
         **nulled(4, 7, 8)}),
    "json/timestamp": Known(
        f"Spark truncates a seventh fractional digit and reads a JSON number as seconds since the epoch; oncemore "
        f"stores no truncated value and takes no number (its unit would be a guess). A fractional number, other "
        f"text: {NULL_FOR_QUARANTINE}",
        {5: ({"t": 1_709_200_800_123_456}, QUARANTINED), 7: ({"t": 1_700_000_000_000_000}, QUARANTINED),
         **nulled(8, 9)}),
    "json/timestamp-ntz": Known(f"a TIMESTAMP_NTZ with a zone, a number: {NULL_FOR_QUARANTINE}", nulled(2, 3, 5)),
    "json/array": Known(f"an ARRAY of another JSON type or with an element that does not fit: {NULL_FOR_QUARANTINE}",
                        nulled(3, 4, 5, 6)),
    "json/map": Known(
        f"a key twice in one MAP object: Spark keeps both entries, a map with a repeated key, which Spark refuses "
        f"everywhere else (spark.sql.mapKeyDedupPolicy); a value that does not fit, another JSON type: "
        f"{NULL_FOR_QUARANTINE}",
        {**nulled(3, 5, 6, 7), 4: ({"m": [["a", 1], ["a", 2]]}, QUARANTINED)}),
    "json/nested": Known(
        "Spark's PERMISSIVE keeps what it could read of a record and NULLs the rest (partial results), and reads "
        "a number for a STRING as its text; oncemore quarantines the record, naming the field",
        {4: ({"s": None, "t": [{"k": "1", "v": None}]}, QUARANTINED),
         5: ({"s": {"a": 1, "b": {"c": None, "d": None}}, "t": None}, QUARANTINED),
         6: ({"s": None, "t": [{"k": None, "v": None}]}, QUARANTINED),
         7: ({"s": {"a": None, "b": {"c": "fine", "d": None}}, "t": [{"k": "fine", "v": None}]}, QUARANTINED)}),
    "json/char-varchar": Known(
        "Spark 4's from_json refuses CHAR and VARCHAR in its schema (unless spark.sql.legacy.charVarcharAsString); "
        "oncemore reads them as STRING without a length check, as that setting does",
        {0: (REFUSED, {"c": "ab", "v": "abc"}), 1: (REFUSED, {"c": "abc", "v": "abcd"})},
        (REFUSED, "struct<c:string,v:string>")),
    "json/not-null": Known(
        "Spark's from_json makes every field nullable (NOT NULL is dropped); oncemore quarantines a record whose "
        "NOT NULL field is missing or null",
        {1: ({"a": None, "b": "x"}, QUARANTINED), **nulled(2)}),
    "json/not-one-object": Known(
        f"Spark reads the first JSON object of a value and ignores what follows (a second object, text), keeps the "
        f"last of a key written twice, and reads a value that is not UTF-8; oncemore takes a value that is exactly "
        f"one JSON object in UTF-8. Not an object, invalid JSON: {NULL_FOR_QUARANTINE} (an empty value: a NULL "
        f"struct)",
        {**nulled(0, 1, 2, 3, 5, 7), 4: (None, QUARANTINED), 6: ({"a": 1}, QUARANTINED),
         8: ({"a": 1}, QUARANTINED), 10: ({"a": 2}, QUARANTINED), 11: ({"a": 1}, QUARANTINED)}),
}


CASES = [f"avro/{c.name}" for c in AVRO_CASES] + [f"json/{c.name}" for c in JSON_CASES]


def test_the_corpus_is_what_the_readme_counts():
    values = sum(len(avro_bodies(c)) for c in AVRO_CASES) + sum(len(c.texts) for c in JSON_CASES)
    assert (len(AVRO_CASES), len(JSON_CASES), values) == (35, 16, 237)
    assert len(KNOWN) == 28 and sum(len(k.rows) for k in KNOWN.values()) == 98
    assert set(KNOWN) <= set(CASES) and all(k.reason for k in KNOWN.values())


@pytest.mark.spark
@pytest.mark.parametrize("case", CASES)
def test_oncemore_decodes_as_spark_does_or_the_difference_is_known(outcomes, case):
    types, rows = outcomes[case].differences()
    known = KNOWN.get(case, Known(""))
    assert (types, rows) == (known.types, known.rows)
