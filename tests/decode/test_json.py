"""JsonDecoder: one row per value or a one-line reason naming the path, at any depth; never a silent
NULL. Types, nested paths, decimals at the edges (Arrow's rescaling bug), temporal text, base64, maps,
NOT NULL, inputs that are not one JSON object, rows staying aligned, and a Delta round trip read back
by delta-rs and by DuckDB."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path

import deltalake
import numpy as np
import pyarrow as pa
import pytest

from conftest import duckdb_connection
from oncemore.core.columns import SchemaError
from oncemore.core.ddl import parse_ddl
from oncemore.decode.json.decoder import JsonDecoder
from oncemore.decode.json.objects import not_json_objects

UTC = timezone.utc


def decode(ddl: str, values: list[bytes | None]):
    return JsonDecoder(parse_ddl(ddl)).decode(pa.array(values, pa.binary()))


def one(ddl: str, value: bytes):
    """The row or the error of a single value."""
    decoded = decode(ddl, [value])
    return decoded.errors.get(0) or decoded.table.to_pylist()[0]


def test_flat_values_of_every_scalar_type():
    decoded = decode(
        "a TINYINT, b SMALLINT, c INT, d BIGINT, e FLOAT, f DOUBLE, g BOOLEAN, h STRING, i BINARY, j DECIMAL(5,2), "
        "k DATE, l TIMESTAMP, m TIMESTAMP_NTZ, n CHAR(2)",
        [b'{"a": -128, "b": 32767, "c": -2147483648, "d": 9223372036854775807, "e": 1.5, "f": -2.5e-3, "g": true, '
         b'"h": "caf\\u00e9 \xf0\x9f\x98\x80", "i": "AAH/", "j": "-999.99", "k": "2024-02-29", '
         b'"l": "2024-02-29T23:30:00+01:00", "m": "2024-02-29T23:30:00.123456", "n": "no length check"}',
         b'{"f": NaN, "e": -Infinity, "j": 1.5e2, "l": "2024-02-29 10:00:00", "i": ""}'])
    assert decoded.errors == {}
    first, second = decoded.table.to_pylist()
    assert first == {"a": -128, "b": 32767, "c": -2147483648, "d": 9223372036854775807, "e": 1.5, "f": -0.0025,
                     "g": True, "h": "café \U0001F600", "i": b"\x00\x01\xff", "j": Decimal("-999.99"),
                     "k": date(2024, 2, 29), "l": datetime(2024, 2, 29, 22, 30, tzinfo=UTC),
                     "m": datetime(2024, 2, 29, 23, 30, 0, 123456), "n": "no length check"}
    assert second["j"] == Decimal("150.00") and second["e"] == float("-inf") and second["f"] != second["f"]
    assert second["l"] == datetime(2024, 2, 29, 10, tzinfo=UTC)  # no zone: UTC
    assert second["i"] == b"" and second["a"] is None


DEPTH_3 = "customer STRUCT<address: STRUCT<zip: {}>>"


@pytest.mark.parametrize("declared, value, problem", [
    ("INT", b'"12345"', "expected INT, found a JSON string"),
    ("STRING", b"12345", "expected STRING, found a JSON number"),
    ("STRING", b"true", "expected STRING, found a JSON boolean"),
    ("BOOLEAN", b'"true"', "expected BOOLEAN, found a JSON string"),
    ("BOOLEAN", b"1", "expected BOOLEAN, found a JSON number"),
    ("DOUBLE", b'"1.5"', "expected DOUBLE, found a JSON string"),
    ("DECIMAL(5,2)", b"true", "expected DECIMAL(5,2), found a JSON boolean"),
    ("ARRAY<INT>", b'{"a": 1}', "expected ARRAY<INT>, found a JSON object"),
    ("STRUCT<a: INT>", b"[1]", "expected STRUCT<a: INT>, found a JSON array"),
    ("MAP<STRING, INT>", b"[1]", "expected MAP<STRING, INT>, found a JSON array"),
    ("MAP<STRING, INT>", b'"a"', "expected MAP<STRING, INT>, found a JSON string"),
    ("DATE", b"19000", "expected DATE (ISO-8601 text; a number's unit would be a guess), found a JSON number"),
    ("TIMESTAMP", b"1767610800000000", "expected TIMESTAMP (ISO-8601 text; a number's unit would be a guess), found a JSON number"),
    ("BINARY", b"5", "expected BINARY (base64 text), found a JSON number"),
    ("TINYINT", b"128", "128 does not fit TINYINT"),
    ("SMALLINT", b"-32769", "-32769 does not fit SMALLINT"),
    ("INT", b"2147483648", "2147483648 does not fit INT"),
    ("BIGINT", b"9223372036854775808", "9223372036854775808 does not fit BIGINT"),
    ("INT", b"1.5", "1.5 does not fit INT"),
    ("INT", b"1.0", "1.0 does not fit INT"),
    ("BIGINT", b"1e2", "1e2 does not fit BIGINT"),
    ("DECIMAL(5,2)", b"1234.5", "1234.50 does not fit DECIMAL(5,2)"),
    ("DECIMAL(5,2)", b"0.001", "0.001 does not fit DECIMAL(5,2)"),
    ("DECIMAL(5,2)", b'"12a"', "'12a' does not fit DECIMAL(5,2)"),
    ("DOUBLE", b"1e400", "1e400 does not fit DOUBLE"),
    ("FLOAT", b"1e39", "1e+39 is beyond FLOAT's range"),
    ("DATE", b'"2024-02-30"', "'2024-02-30' is not a valid DATE (ISO-8601, years 1 to 9999)"),
    ("DATE", b'"0000-12-31"', "'0000-12-31' is not a valid DATE"),
    ("TIMESTAMP", b'"2024-01-01T00:00:00.1234567Z"', "'2024-01-01T00:00:00.1234567Z' is not a valid TIMESTAMP"),
    ("TIMESTAMP", b'"9999-12-31T23:00:00-02:00"', "is not a valid TIMESTAMP (ISO-8601, years 1 to 9999)"),
    ("TIMESTAMP_NTZ", b'"2024-01-01T00:00:00Z"', "'2024-01-01T00:00:00Z' is not a valid TIMESTAMP_NTZ"),
    ("BINARY", b'"aGVsbG8"', "'aGVsbG8' is not base64 (BINARY is read from base64 text, as Spark does)"),
    ("BINARY", b'"aGV sbG8="', "is not base64"),
    ("BINARY", b'"aGVsbG8=="', "is not base64"),
    ("BINARY", b'"a=Vs"', "is not base64"),
])
def test_a_mismatch_at_depth_3_names_the_path_and_the_problem(declared, value, problem):
    error = one(DEPTH_3.format(declared) + ", id INT", b'{"id": 1, "customer": {"address": {"zip": ' + value + b"}}}")
    assert error.startswith("column 'customer.address.zip': ") and problem in error, error


def test_paths_through_arrays_and_maps():
    ddl = "items ARRAY<STRUCT<p: INT>>, attrs MAP<STRING, ARRAY<STRUCT<at: DATE>>>, grid ARRAY<ARRAY<SMALLINT>>"
    assert one(ddl, b'{"items": [{"p": 1}, {"p": "x"}]}') == "column 'items[].p': expected INT, found a JSON string"
    assert one(ddl, b'{"attrs": {"a": [{"at": "2024-13-01"}]}}') == \
        "column 'attrs{}[].at': '2024-13-01' is not a valid DATE (ISO-8601, years 1 to 9999)"
    assert one(ddl, b'{"grid": [[1], [2, 70000]]}') == "column 'grid[][]': 70000 does not fit SMALLINT"
    assert one(ddl, b'{"attrs": {"a": [], "a": null}}') == \
        "column 'attrs': key 'a' appears twice (Spark refuses duplicate map keys)"


def test_a_number_only_arrow_names_by_its_type_is_found_among_fields_of_that_type():
    ddl = "a INT, s STRUCT<b INT, c ARRAY<INT>>, d DECIMAL(5,2), e DECIMAL(5,2)"
    assert one(ddl, b'{"a": 1, "s": {"b": 2, "c": [3, 4.5]}}') == "column 's.c[]': 4.5 does not fit INT"
    assert one(ddl, b'{"a": 1.5, "s": {"b": 2.5}}') == "column 'a': 1.5 does not fit INT"
    assert one(ddl, b'{"d": 1.5, "e": 1.234}') == "column 'e': 1.234 does not fit DECIMAL(5,2)"


@pytest.mark.parametrize("declared, value, stored", [
    ("DECIMAL(5,2)", b"999.99", Decimal("999.99")),
    ("DECIMAL(5,2)", b"-999.99", Decimal("-999.99")),
    ("DECIMAL(5,2)", b"1.230", Decimal("1.23")),
    ("DECIMAL(5,2)", b"-0.0", Decimal("0.00")),
    ("DECIMAL(5,2)", b'"12.3"', Decimal("12.30")),
    ("DECIMAL(5,2)", b"9.9999e2", Decimal("999.99")),
    ("DECIMAL(5,2)", b"1000.00", "1000.00 does not fit DECIMAL(5,2)"),
    ("DECIMAL(5,2)", b"-1000", "-1000.00 does not fit DECIMAL(5,2)"),
    ("DECIMAL(5,2)", b"1e3", "1000.00 does not fit DECIMAL(5,2)"),
    ("DECIMAL(5,0)", b"99999", Decimal("99999")),
    ("DECIMAL(5,0)", b"100000", "100000 does not fit DECIMAL(5,0)"),
    ("DECIMAL(38,2)", b"9" * 36 + b".99", Decimal("9" * 36 + ".99")),
    # Arrow stores these 37 integer digits as a 39-digit DECIMAL(38,2) value: refused.
    ("DECIMAL(38,2)", b"1" + b"0" * 36, "1" + "0" * 36 + ".00 does not fit DECIMAL(38,2)"),
    ("DECIMAL(38,0)", b"9" * 38, Decimal("9" * 38)),
    ("DECIMAL(38,38)", b"0." + b"1" * 38, Decimal("0." + "1" * 38)),
    ("DECIMAL(38,38)", b"1", "1.00000000000000000000000000000000000000 does not fit DECIMAL(38,38)"),
])
def test_decimals_at_the_edges_at_depth(declared, value, stored):
    result = one(f"items ARRAY<STRUCT<d: {declared}>>", b'{"items": [{"d": 0}, {"d": ' + value + b"}]}")
    if isinstance(stored, str):
        assert result == f"column 'items[].d': {stored}"
    else:
        assert result["items"][1]["d"] == stored and str(result["items"][1]["d"]) == str(stored)


def test_dates_and_timestamps_nested_in_arrays_and_structs():
    ddl = "events ARRAY<STRUCT<at: TIMESTAMP, local: TIMESTAMP_NTZ, days: ARRAY<DATE>>>, m MAP<STRING, TIMESTAMP>"
    row = one(ddl, json.dumps({
        "events": [{"at": "2026-01-05T11:00:00Z", "local": "2026-01-05T11:00:00", "days": ["0001-01-01", None, "9999-12-31"]},
                   {"at": "2026-01-05T12:00:00+01:00", "local": "2026-01-05 11:00"},
                   {"at": "2026-01-05", "local": None, "days": []},
                   {"at": "0001-01-01T00:00:00Z", "local": "9999-12-31T23:59:59.999999"}, None],
        "m": {"naive": "2026-01-05T11:00:00", "zoned": "2026-01-05T11:00:00.5-00:30", "none": None}}).encode())
    noon = datetime(2026, 1, 5, 11, tzinfo=UTC)
    assert row["events"] == [
        {"at": noon, "local": datetime(2026, 1, 5, 11), "days": [date(1, 1, 1), None, date(9999, 12, 31)]},
        {"at": noon, "local": datetime(2026, 1, 5, 11), "days": None},
        {"at": datetime(2026, 1, 5, tzinfo=UTC), "local": None, "days": []},
        {"at": datetime(1, 1, 1, tzinfo=UTC), "local": datetime(9999, 12, 31, 23, 59, 59, 999999), "days": None},
        None]
    assert row["m"] == [("naive", noon), ("zoned", datetime(2026, 1, 5, 11, 30, 0, 500000, tzinfo=UTC)), ("none", None)]
    assert one(ddl, b'{"events": [{"days": ["2026-01-05", "yesterday"]}]}') == \
        "column 'events[].days[]': 'yesterday' is not a valid DATE (ISO-8601, years 1 to 9999)"
    assert one(ddl, b'{"events": [{"at": "0001-01-01T00:30:00+01:00"}]}') == \
        "column 'events[].at': '0001-01-01T00:30:00+01:00' is not a valid TIMESTAMP (ISO-8601, years 1 to 9999)"
    assert one(ddl, b'{"m": {"k": 1767610800}}') == \
        "column 'm{}': expected TIMESTAMP (ISO-8601 text; a number's unit would be a guess), found a JSON number"


def test_maps_from_json_objects():
    ddl = "id INT, labels MAP<STRING, STRING>, stock MAP<STRING, STRUCT<n: INT NOT NULL, price: DECIMAL(6,2)>>, " \
          "nested ARRAY<MAP<STRING, ARRAY<BIGINT>>>"
    decoded = decode(ddl, [
        b'{"id": 1, "labels": {"a": "x", "": "empty key", "b": null}, "stock": {"s1": {"n": 2, "price": 0.1}}, '
        b'"nested": [{"k": [1, null]}, null, {}], "other": {"q": 1e400}}',
        b'{"id": 2, "labels": {}, "stock": null}',
        b'{"id": 3, "stock": {"s1": {"price": 1}}}',
        b'{"id": 4, "stock": {"s1": {"n": 1, "price": 10000}}}',
        b'{"id": 5, "labels": {"a": 1}}',
        b'{"id": 6, "labels": {"a": "x", "a": "y"}}',
        b'{"id": 7, "labels": [{"key": "a", "value": "x"}]}',
        b'{"id": 8, "nested": [{"k": [1.5]}]}',
        b'{"id": 9, "labels": {"a": "x"}',
        None,
    ])
    rows = decoded.table.to_pylist()
    assert rows[0] == {"id": 1, "labels": [("a", "x"), ("", "empty key"), ("b", None)],
                       "stock": [("s1", {"n": 2, "price": Decimal("0.10")})], "nested": [[("k", [1, None])], None, []]}
    assert rows[1] == {"id": 2, "labels": [], "stock": None, "nested": None}
    assert decoded.errors == {
        2: "column 'stock{}.n' is declared NOT NULL but is missing or null",
        3: "column 'stock{}.price': 10000.00 does not fit DECIMAL(6,2)",
        4: "column 'labels{}': expected STRING, found a JSON number",
        5: "column 'labels': key 'a' appears twice (Spark refuses duplicate map keys)",
        6: "column 'labels': expected MAP<STRING, STRING>, found a JSON array",
        7: "column 'nested[]{}[]': 1.5 does not fit BIGINT",
        8: "invalid JSON: Expecting ',' delimiter at character 31",
    }
    assert rows[9] == {"id": None, "labels": None, "stock": None, "nested": None}  # a null input: a null row
    assert decoded.table.schema == parse_ddl(ddl)


def test_a_map_needs_string_keys_for_json():
    with pytest.raises(SchemaError, match="column 'counts': JSON object keys are strings"):
        JsonDecoder(parse_ddl("counts MAP<INT, STRING>"))


def test_not_null_at_every_depth_only_where_the_parent_is_present():
    ddl = "id BIGINT NOT NULL, c STRUCT<name: STRING NOT NULL, a: STRUCT<zip: INT NOT NULL>>, " \
          "items ARRAY<STRUCT<sku: STRING NOT NULL>>"
    decoded = decode(ddl, [
        b'{"id": 1}', b'{"id": 2, "c": null, "items": [null]}', b'{"id": 3, "c": {"name": "n", "a": null}}',
        b'{"c": {"name": "n"}}', b'{"id": null}', b'{"id": 6, "c": {"a": {"zip": 1}}}',
        b'{"id": 7, "c": {"name": "n", "a": {}}}', b'{"id": 8, "c": {"name": "n", "a": {"zip": null}}}',
        b'{"id": 9, "items": [{"sku": "a"}, {"sku": null}]}', b'{"id": 10, "items": [{}]}',
    ])
    assert decoded.errors == {
        3: "column 'id' is declared NOT NULL but is missing or null",
        4: "column 'id' is declared NOT NULL but is missing or null",
        5: "column 'c.name' is declared NOT NULL but is missing or null",
        6: "column 'c.a.zip' is declared NOT NULL but is missing or null",
        7: "column 'c.a.zip' is declared NOT NULL but is missing or null",
        8: "column 'items[].sku' is declared NOT NULL but is missing or null",
        9: "column 'items[].sku' is declared NOT NULL but is missing or null",
    }
    assert [row["id"] for row in decoded.table.to_pylist()[:3]] == [1, 2, 3]
    assert decoded.table.to_pylist()[2]["c"] == {"name": "n", "a": None}


NOT_OBJECTS = {b"null": "value is JSON null, not a JSON object", b" null ": "value is JSON null, not a JSON object",
               b"[1]": "value is a JSON array, not a JSON object", b'"text"': "value is a JSON string, not a JSON object",
               b"42": "value is a JSON number, not a JSON object", b"-1": "value is a JSON number, not a JSON object",
               b"true": "value is a JSON boolean, not a JSON object",
               b"\xef\xbb\xbf{}": "value is not valid JSON, not a JSON object",
               # Not JSON at all, whatever the first byte suggests.
               b"nope": "value is not valid JSON, not a JSON object", b"nullx": "value is not valid JSON, not a JSON object",
               b"trueish": "value is not valid JSON, not a JSON object", b"NaN": "value is not valid JSON, not a JSON object",
               b"not json": "value is not valid JSON, not a JSON object",
               # Avro (schema ID 7) read as JSON: named for what it is.
               b"\x00\x00\x00\x00\x07\x02\xfe": "value is not valid UTF-8 (byte 6), so not JSON; it starts as Confluent's "
                                               "wire format does (magic byte 0, schema ID 7): Avro or Protobuf needs format "
                                               "type avro or protobuf, JSON Schema confluent_framing: true",
               b"": "value is empty, not a JSON object", b"\t\n": "value is empty, not a JSON object",
               b"\xff{}": "value is not valid UTF-8 (byte 0), so not JSON",
               b'{"id": 1} x': "value does not end with the '}' closing a JSON object (truncated, or text after it)",
               b'{"id": 1': "value does not end with the '}' closing a JSON object (truncated, or text after it)"}


def test_inputs_that_are_not_one_json_object():
    # Arrow's reader kills the process on a top-level null opening a block (pyarrow 26): decode in a
    # child so a regression fails this test instead of the test run.
    child = subprocess.run([sys.executable, "-c", f"""
import json, sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}, {str(Path(__file__).parents[2] / "include")!r}]
import pyarrow as pa
from test_json import NOT_OBJECTS
from oncemore.core.ddl import parse_ddl
from oncemore.decode.json.decoder import JsonDecoder
values = [b"null", b'{{"id": 1}}', None] + list(NOT_OBJECTS) + [b'{{"id": 2}}', b'{{}}{{}}', b' {{"id": 3}}\\r\\n']
decoded = JsonDecoder(parse_ddl("id BIGINT")).decode(pa.array(values, pa.large_binary()))
print(json.dumps([decoded.table.column("id").to_pylist(), decoded.errors]))
"""], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-2000:]
    ids, errors = json.loads(child.stdout)
    count = len(NOT_OBJECTS)
    assert ids == [None, 1, None] + [None] * count + [2, None, 3]
    assert errors == {"0": "value is JSON null, not a JSON object",
                      **{str(3 + i): message for i, message in enumerate(NOT_OBJECTS.values())},
                      str(4 + count): "value holds 2 JSON objects, expected exactly one"}
    assert not_json_objects(pa.array([None, b"{}"], pa.binary())) == {}  # a null input is the caller's call


def test_values_that_would_only_parse_together_never_shift_rows():
    # Joined one per line, "{"a":" and "{"x": 1}}" read as one object and "{}{}" as two: three rows for
    # three values, each in the wrong place. Each is refused alone; the good rows keep their places.
    values = [b'{"id": 1}', b'{"a":', b'{"x": 1}}', b'{"id": 4}', b"{}{}", b'{"id": 6, "s": "}', b'{", "id": 7}',
              b'{"id": 8}']
    decoded = decode("id BIGINT, a STRUCT<x: INT>, s STRING", values)
    assert decoded.table.column("id").to_pylist() == [1, None, None, 4, None, None, None, 8]
    assert sorted(decoded.errors) == [1, 2, 4, 5, 6]
    assert decoded.errors[2] == "invalid JSON (The document is empty.): '{\"x\": 1}}'"


def test_pretty_printed_values_read_and_raw_newlines_in_strings_do_not():
    decoded = decode("id BIGINT, s STRUCT<name: STRING>", [
        b'{\n  "id": 1,\n  "s": {\n    "name": "a"\n  }\n}', b'{"id": 2, "s": {"name": "line\nbreak"}}', b'{"id": 3}'])
    assert decoded.table.column("id").to_pylist() == [1, None, 3]
    assert decoded.errors[1].startswith("invalid JSON (Invalid encoding in string.)")


def test_undeclared_fields_are_ignored_at_every_level_even_a_number_arrow_cannot_read():
    row = one("id BIGINT, s STRUCT<a: INT>, items ARRAY<STRUCT<b: STRING>>",
              b'{"id": 1, "s": {"a": 2, "x": [1, {"y": null}]}, "items": [{"b": "c", "z": 1e400}], "w": "v"}')
    assert row == {"id": 1, "s": {"a": 2}, "items": [{"b": "c"}]}


def test_a_key_twice_in_an_object_is_refused():
    assert one("s STRUCT<a: INT>", b'{"s": {"a": 1, "a": 2}}') == "column 's.a': the key appears twice in one JSON object"


def test_many_bad_values_among_good_ones_keep_every_row_in_place():
    values, expected = [], {}
    for i in range(5000):
        if i % 97 == 3:
            values.append(b'{"id": %d, "at": "not a time"}' % i)
            expected[i] = "column 'at': 'not a time' is not a valid TIMESTAMP (ISO-8601, years 1 to 9999)"
        elif i % 89 == 5:
            values.append(b'{"id": "%d"}' % i)
            expected[i] = "column 'id': expected BIGINT, found a JSON string"
        elif i % 83 == 7:
            values.append(b'{"id": %d, "n": 1.5}' % i)
            expected[i] = "column 'n': 1.5 does not fit INT"
        else:
            values.append(b'{"id": %d, "at": "2026-01-05T11:00:00Z", "n": %d}' % (i, i % 1000))
    decoded = decode("id BIGINT, at TIMESTAMP, n INT", values)
    assert decoded.errors == expected
    ids = decoded.table.column("id").to_pylist()
    assert ids == [None if i in expected else i for i in range(5000)]
    assert decoded.table.column("n").to_pylist() == [None if i in expected else i % 1000 for i in range(5000)]


def test_messages_are_one_line_and_quote_at_most_64_characters():
    long = "x" * 10_000
    errors = decode("d DATE, b BINARY, s STRUCT<n: INT>", [
        json.dumps({"d": long}).encode(), json.dumps({"b": long + "\n"}).encode(),
        b'{"s": {"n": 1' + b"1" * 10_000 + b'.5}}', b'{"s": ' + long.encode() + b"}"]).errors
    assert len(errors) == 4
    for message in errors.values():
        assert "\n" not in message and len(message) < 200, message


ROUND_TRIP_DDL = (
    "id BIGINT NOT NULL, t8 TINYINT, s16 SMALLINT, f FLOAT, d DOUBLE, ok BOOLEAN, raw BINARY, name VARCHAR(10), "
    "day DATE, at TIMESTAMP, local TIMESTAMP_NTZ, price DECIMAL(38,2), "
    "customer STRUCT<name: STRING NOT NULL, address: STRUCT<zip: INT, since: DATE>>, "
    "items ARRAY<STRUCT<sku: STRING, price: DECIMAL(10,2), at: ARRAY<TIMESTAMP>>>, "
    "attrs MAP<STRING, STRUCT<n: INT, days: ARRAY<DATE>>>, labels MAP<STRING, STRING>")


def test_decoded_rows_round_trip_through_delta_and_spark_types(tmp_path):
    values = [
        json.dumps({"id": 1, "t8": -128, "s16": 300, "f": 1.25, "d": 1e300, "ok": False, "raw": "AP8=", "name": "n",
                    "day": "0001-01-01", "at": "2026-01-05T11:00:00.000001+05:30", "local": "9999-12-31T23:59:59.999999",
                    "customer": {"name": "Ada", "address": {"zip": 75001, "since": "2020-02-29"}},
                    "items": [{"sku": "a", "price": "-12345678.90", "at": ["2026-01-05T11:00:00Z", None]}, None,
                              {"sku": None, "price": None, "at": []}],
                    "attrs": {"x": {"n": 1, "days": ["2026-01-05"]}, "y": None}, "labels": {"k": "v", "e": ""}}).encode()
        + b"",
        b'{"id": 2, "price": 123456789012345678901234567890123456.78, "customer": {"name": "B", "address": null}, '
        b'"items": [], "attrs": {}, "labels": null}',
        b'{"id": 3}',
    ]
    decoded = decode(ROUND_TRIP_DDL, values)
    assert decoded.errors == {}
    table = decoded.table
    assert table.schema == parse_ddl(ROUND_TRIP_DDL)
    deltalake.write_deltalake(str(tmp_path), table)
    assert deltalake.DeltaTable(str(tmp_path)).to_pyarrow_table().sort_by("id").equals(table)
    duck = duckdb_connection().execute(f"SELECT * FROM delta_scan('{tmp_path}') ORDER BY id").to_arrow_table()
    assert duck.to_pylist() == table.to_pylist()  # time zone names differ (Etc/UTC), instants do not
    # The same Arrow types come back from a Spark schema: no cast between oncemore and Spark.
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

    assert to_arrow_schema(from_arrow_schema(table.schema), timezone="UTC") == table.schema


def test_empty_all_null_sliced_and_pickled_inputs():
    import pickle

    decoder = pickle.loads(pickle.dumps(JsonDecoder(parse_ddl("id INT NOT NULL, m MAP<STRING, INT>"))))
    assert decoder.decode(pa.array([], pa.binary())).table.schema == decoder.schema
    nulls = decoder.decode(pa.array([None, None], pa.binary()))
    assert nulls.errors == {} and nulls.table.to_pylist() == [{"id": None, "m": None}] * 2
    sliced = pa.array([b"x", b'{"id": 1, "m": {"a": 1}}', b'{"id": 2}'], pa.binary())[1:]
    assert decoder.decode(sliced).table.to_pylist() == [{"id": 1, "m": [("a", 1)]}, {"id": 2, "m": None}]


def connect_decode(ddl: str, values: list[bytes | None], role: str = "value"):
    """Values read as a json format with schemas_enable (Kafka Connect's JsonConverter wrapper)."""
    from oncemore.decode.recordspec import FormatSpec, RecordSpec
    from oncemore.decode.rows import RecordDecoder

    spec = FormatSpec("json", ddl=ddl, schemas_enable=True)
    records = pa.table({"key": pa.array(values if role == "key" else [b'{"schema":null,"payload":{"k":1}}'] * len(values),
                                        pa.binary()),
                        "value": pa.array(values if role == "value" else [b'{"id":1}'] * len(values), pa.binary()),
                        "topic": ["t"] * len(values), "partition": pa.array([0] * len(values), pa.int32()),
                        "offset": pa.array(range(len(values)), pa.int64()),
                        "timestamp": pa.array([0] * len(values), pa.timestamp("us", tz="UTC")),
                        "timestamp_ms": pa.array([0] * len(values), pa.int64())})
    key = spec if role == "key" else FormatSpec("json", ddl="k INT", schemas_enable=True)
    value = spec if role == "value" else FormatSpec("json", ddl="id INT")
    return RecordDecoder(RecordSpec(value, key, False)).decode(records)


WRAPPER = ': schemas_enable expects Kafka Connect\'s JsonConverter wrapper, one object with exactly the keys "schema" and "payload"'


def test_jsonconverter_wrappers_are_read_compact_or_not_and_anything_else_is_refused_naming_why():
    # Compact and schema first as JsonConverter writes them (read in bytes, the batch at once), or
    # written otherwise (read alone): the payload's text is what is decoded, numbers as written.
    schema = b'{"type":"struct","fields":[{"type":"int32","optional":false,"field":"id"}],"optional":false}'
    values = [b'{"schema":' + schema + b',"payload":{"id":1,"n":12.50}}', b'{"schema":null,"payload":{"id":2}}',
              b' { "payload" : {"id": 3, "n": 0.10} , "schema" : ' + schema + b' }\n',
              # The separator's text inside the schema: the split after it is not a JSON schema, so alone.
              b'{"schema":{"doc":",\\"payload\\":","name":"x"},"payload":{"id":4}}',
              b'{"schema":{"parameters":{"payload":"p"},"type":"struct"},"payload":{"id":5}}',
              b'{"id":6}', b'{"schema":{},"payload":{"id":7},"extra":1}', b'{"schema":7,"payload":{"id":8}}',
              b'{"schema":{},"payload":{"id":9}', b"[1]", b"{}", b'{"payload":{"id":12},"payload":{"id":12}}',
              b"\xff", b'{"schema":{},"payload":"text"}']
    decoded = connect_decode("id INT, n DECIMAL(4,2)", values)
    assert decoded.good.column("id").to_pylist() == [1, 2, 3, 4, 5]
    assert decoded.good.column("n").to_pylist() == [Decimal("12.50"), None, Decimal("0.10"), None, None]
    assert dict(zip(decoded.bad.column("_kafka_offset").to_pylist(), decoded.bad.column("error").to_pylist())) == {
        5: "value has the keys 'id'" + WRAPPER,
        6: "value has the keys 'schema', 'payload', 'extra'" + WRAPPER,
        7: "its schema is not a JSON object" + WRAPPER,
        8: "value is not valid JSON (expected ',' or '}' at character 32)",
        9: "value does not start with '{' (found '[1]')" + WRAPPER,
        10: "value is an empty object" + WRAPPER,
        11: "value has the key 'payload' twice" + WRAPPER,
        12: "value is not valid UTF-8 (byte 0), so not JSON",
        13: "value is a JSON string, not a JSON object"}
    assert decoded.bad.column("value").to_pylist() == values[5:]  # quarantined with the record's bytes


def test_a_null_payload_is_a_null_value_and_a_null_record_a_tombstone():
    # JsonConverter writes a null schema and value (Debezium's tombstone) as no bytes; a schema with
    # a null value as {"schema": ..., "payload": null}, which it reads back as a null value.
    decoded = connect_decode("id INT", [None, b'{"schema":{"type":"int32","optional":true},"payload":null}',
                                        b'{ "schema": null, "payload": null }'])
    assert decoded.good.num_rows == 0
    assert decoded.bad.column("error").to_pylist() == [
        "value is null (a tombstone), not a record",
        "value's payload is null (JsonConverter's null value), not a record",
        "value's payload is null (JsonConverter's null value), not a record"]


def test_a_key_through_jsonconverter_is_read_from_its_payload_and_a_wrapped_value_without_the_setting_refused():
    decoded = connect_decode("k INT", [b'{"schema":{"type":"struct","fields":[{"type":"int32","optional":false,'
                                       b'"field":"k"}],"optional":false,"name":"shop.Key"},"payload":{"k":7}}',
                                       b'{"k":8}', None], role="key")
    assert decoded.good.column("key").to_pylist() == [{"k": 7}, None]
    assert decoded.bad.column("error").to_pylist() == ["key: value has the keys 'k'" + WRAPPER]
    from oncemore.decode.recordspec import FormatSpec, RecordSpec
    from oncemore.decode.rows import RecordDecoder

    wrapped = b'{"schema":{"type":"struct"},"payload":{"id":1}}'
    # A plain JSON value that merely has such keys among others is a row: JsonConverter's wrapper has exactly two.
    not_wrapped = b'{"schema":"orders-v2","payload":{"note":"x"},"id":7}'
    for ddl, value, refused in (("id INT", wrapped, True), ("id INT", not_wrapped, False),
                                ("schema STRUCT<type: STRING>, payload STRUCT<id: INT>", wrapped, False)):
        decoder = RecordDecoder(RecordSpec(FormatSpec("json", ddl=ddl), None, False))
        result = decoder.decode(pa.table({
            "key": pa.array([None], pa.binary()), "value": pa.array([value], pa.binary()), "topic": ["t"],
            "partition": pa.array([0], pa.int32()), "offset": pa.array([0], pa.int64()),
            "timestamp": pa.array([0], pa.timestamp("us", tz="UTC")), "timestamp_ms": pa.array([0], pa.int64())}))
        assert result.bad.column("error").to_pylist() == ([
            'value is Kafka Connect\'s JsonConverter wrapper {"schema": ..., "payload": ...} (the converter\'s '
            "schemas.enable=true): set format.schemas_enable: true to read its payload"] if refused else [])
        assert result.good.num_rows == (0 if refused else 1)


def unscaled(number: int, size: int | None = None) -> str:
    """Base64 of ``number``'s big-endian two's-complement bytes: Connect's Decimal as JsonConverter
    writes it (Java's BigInteger.toByteArray, minimal unless ``size`` is given)."""
    import base64

    size = size or max(1, (number + (number < 0)).bit_length() // 8 + 1)
    return base64.b64encode(number.to_bytes(size, "big", signed=True)).decode()


def debezium_decode(row_ddl: str, values: list, connect=None, wrapped: bool = False):
    """Debezium envelopes around rows of ``row_ddl`` (``values``: the ``after`` rows), read as
    resolve.py reads a json Debezium value; ``connect``: a JsonConverter schema for every value."""
    from oncemore.decode.envelope import envelope_ddl, json_readings
    from oncemore.decode.json.connect import Unwrapped

    schema = parse_ddl(envelope_ddl(row_ddl))
    decoder = JsonDecoder(schema, json_readings(schema, True, wrapped))
    texts = pa.array([json.dumps({"op": "c", "after": row, "source": source}).encode() for row, source in values])
    if connect is None:
        return decoder.decode(texts)
    return decoder.decode(texts, Unwrapped(texts, np.zeros(len(values), dtype=np.int64), [connect]))


def test_debezium_source_fields_sent_as_numbers_or_text_are_read_from_either_as_text():
    # PostgreSQL writes txId and lsn as INT64, Oracle's txId and YugabyteDB's txId and lsn are
    # strings (their SourceInfoStructMaker classes); SQL Server's LSNs are hex text.
    values = [({"id": 1}, {"txId": 555, "lsn": 24023128, "ts_ms": 1559033904863}),
              ({"id": 2}, {"txId": "6.28.807", "scn": "2122185", "commit_scn": "2122185"}),
              ({"id": 3}, {"txId": "02000a0037030000"}), ({"id": 4}, {"lsn": "1:23:abc:0:7000", "commit_time": 7}),
              ({"id": 5}, {"lsn": 24023200, "txId": None}),
              ({"id": 6}, {"commit_lsn": "00000027:00000758:0005", "change_lsn": "00000027:00000758:0003",
                           "event_serial_no": 1}),
              ({"id": 7}, {"file": "mysql-bin.000003", "pos": 570, "row": 0}), ({"id": 8}, {"txId": True})]
    decoded = debezium_decode("id BIGINT", values)
    sources = [{k: v for k, v in (row["source"] or {}).items() if v is not None} for row in decoded.table.to_pylist()]
    assert sources[:7] == [{"txId": "555", "lsn": "24023128", "ts_ms": 1559033904863},
                           {"txId": "6.28.807", "scn": "2122185", "commit_scn": "2122185"}, {"txId": "02000a0037030000"},
                           {"lsn": "1:23:abc:0:7000", "commit_time": 7}, {"lsn": "24023200"},
                           {"commit_lsn": "00000027:00000758:0005", "change_lsn": "00000027:00000758:0003",
                            "event_serial_no": 1},
                           {"file": "mysql-bin.000003", "pos": 570, "row": 0}]
    assert decoded.errors == {7: "column 'source.txId': expected STRING (a JSON string or number), found a JSON boolean"}


def test_debezium_precise_decimals_are_read_exactly_from_each_kind_and_never_guessed():
    # decimal.handling.mode=precise through JsonConverter (decimal.format=BASE64): base64 of the
    # unscaled value at the column's scale; a VariableScaleDecimal {"scale", "value"}; with
    # decimal.handling.mode=double, or decimal.format=NUMERIC, a JSON number.
    rows = [{"id": 1, "d": unscaled(1234)}, {"id": 2, "d": unscaled(-5)}, {"id": 3, "d": unscaled(-5, 20)},
            {"id": 4, "d": {"scale": 3, "value": unscaled(12340)}}, {"id": 5, "d": 7.25},
            # "1234" is base64 (bytes d7 6d f8) and a number: under Debezium's envelope a string is
            # base64, so it is -2658824 unscaled, never the number 1234.
            {"id": 6, "d": "1234"}, {"id": 7, "d": None},
            {"id": 8, "d": "12.34"}, {"id": 9, "d": {"scale": 3, "value": unscaled(12345)}}, {"id": 10, "d": ""},
            {"id": 11, "d": unscaled(10**10)}, {"id": 12, "d": unscaled(1, 17)},  # sign bytes before it: 0.01
            {"id": 13, "d": {"scale": 2}},
            {"id": 14, "d": unscaled(1, 17).replace("A", "/", 1)}, {"id": 15, "d": 1.234}]
    decoded = debezium_decode("id BIGINT, d DECIMAL(10,2)", [(row, {}) for row in rows])
    found = [row["after"] and row["after"]["d"] for row in decoded.table.to_pylist()]
    assert found[:7] == [Decimal("12.34"), Decimal("-0.05"), Decimal("-0.05"), Decimal("12.34"), Decimal("7.25"),
                         Decimal("-26588.24"), None]
    assert found[11] == Decimal("0.01")
    assert decoded.errors == {
        7: "column 'after.d': '12.34' is not base64 (Debezium's precise decimal: the unscaled value's bytes; for "
           "decimal.handling.mode=string declare the column STRING)",
        8: "column 'after.d': 12.345 does not fit DECIMAL(10,2)",
        9: "column 'after.d': an empty unscaled value is no decimal",
        10: "column 'after.d': 100000000.00 does not fit DECIMAL(10,2)",
        12: "column 'after.d': a VariableScaleDecimal needs both its scale and its value",
        13: "column 'after.d': an unscaled value of 17 bytes does not fit DECIMAL(10,2)",
        14: "column 'after.d': 1.234 does not fit DECIMAL(10,2)"}


def test_a_variable_scale_decimal_beyond_arrows_38_is_read_where_it_fits_and_quarantined_where_not():
    # PostgreSQL's unconstrained NUMERIC and Oracle's NUMBER reach scales of 127 (and below -38).
    rows = [{"id": 1, "d": {"scale": 40, "value": unscaled(10**38)}}, {"id": 2, "d": {"scale": 40, "value": unscaled(1)}},
            {"id": 3, "d": {"scale": -39, "value": unscaled(0)}}, {"id": 4, "d": {"scale": -39, "value": unscaled(1)}},
            {"id": 5, "d": {"scale": 127, "value": unscaled(-7)}}, {"id": 6, "d": {"scale": 2, "value": unscaled(5)}}]
    decoded = debezium_decode("id BIGINT, d DECIMAL(10,2)", [(row, {}) for row in rows])
    found = [row["after"] and row["after"]["d"] for row in decoded.table.to_pylist()]
    assert (found[0], found[2], found[5]) == (Decimal("0.01"), Decimal("0.00"), Decimal("0.05"))
    assert decoded.errors == {1: "column 'after.d': 1E-40 does not fit DECIMAL(10,2)",
                              3: "column 'after.d': 1E+39 does not fit DECIMAL(10,2)",
                              4: "column 'after.d': -7E-127 does not fit DECIMAL(10,2)"}


def test_a_decimal_leaf_parsed_as_numbers_never_takes_numeric_text_for_one():
    # Arrow's reader takes "1234" into a decimal column as 1234: once a leaf reads numbers, each
    # block is checked to hold numbers there, and a string switches it back.
    from oncemore.decode.envelope import envelope_ddl, json_readings

    schema = parse_ddl(envelope_ddl("d DECIMAL(10,2)"))
    decoder = JsonDecoder(schema, json_readings(schema, True, False))

    def read(values):
        texts = pa.array([json.dumps({"op": "c", "after": {"d": value}}).encode() for value in values])
        decoded = decoder.decode(texts)
        return [row["after"] and row["after"]["d"] for row in decoded.table.to_pylist()], decoded.errors

    assert read([12.5, 3]) == ([Decimal("12.50"), Decimal("3.00")], {})
    assert read(["1234", 7.25, unscaled(1), {"scale": 0, "value": unscaled(2)}]) == (
        [Decimal("-26588.24"), Decimal("7.25"), Decimal("0.01"), Decimal("2.00")], {})
    assert read([9]) == ([Decimal("9.00")], {})


def test_a_jsonconverter_schema_says_each_records_decimal_scale_or_that_the_column_is_text():
    # JsonConverter writes a Connect Decimal's schema with its scale as a string parameter
    # (org.apache.kafka.connect.data.Decimal, parameters {"scale": "3", "connect.decimal.precision": "12"});
    # decimal.handling.mode=string makes the column a string.
    def connect(column: dict) -> dict:
        row = {"type": "struct", "fields": [{"type": "int64", "optional": False, "field": "id"}, {**column, "field": "d"}],
               "optional": True, "name": "shop.public.t.Value"}
        return {"type": "struct", "fields": [{**row, "field": "before"}, {**row, "field": "after"}],
                "optional": False, "name": "shop.public.t.Envelope"}

    scale_3 = connect({"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal", "version": 1,
                       "parameters": {"scale": "3", "connect.decimal.precision": "12"}})
    decoded = debezium_decode("id BIGINT, d DECIMAL(10,2)", [({"id": 1, "d": unscaled(12340)}, {}),
                                                            ({"id": 2, "d": unscaled(12345)}, {})], scale_3, True)
    assert [row["after"] and row["after"]["d"] for row in decoded.table.to_pylist()] == [Decimal("12.34"), None]
    assert decoded.errors == {1: "column 'after.d': 12.345 does not fit DECIMAL(10,2)"}
    as_text = connect({"type": "string", "optional": True})
    decoded = debezium_decode("id BIGINT, d DECIMAL(10,2)", [({"id": 1, "d": "1234"}, {}), ({"id": 2, "d": "x"}, {})],
                              as_text, True)
    assert [row["after"] and row["after"]["d"] for row in decoded.table.to_pylist()] == [Decimal("1234.00"), None]
    assert decoded.errors == {1: "column 'after.d': 'x' is not a number that fits DECIMAL(10,2)"}
    # decimal.handling.mode=double: Jackson writes a double's NaN and Infinity as JSON strings, no base64.
    as_double = connect({"type": "double", "optional": True})
    decoded = debezium_decode("id BIGINT, d DECIMAL(10,2)", [({"id": 1, "d": "Infinity"}, {}), ({"id": 2, "d": 12.5}, {})],
                              as_double, True)
    assert [row["after"] and row["after"]["d"] for row in decoded.table.to_pylist()] == [None, Decimal("12.50")]
    assert decoded.errors == {0: "column 'after.d': 'Infinity' is no decimal (the record's Connect schema gives the "
                                 "column a type other than a Decimal or a string: a double's NaN or Infinity?)"}
    no_scale = connect({"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal"})
    decoded = debezium_decode("id BIGINT, d DECIMAL(10,2)", [({"id": 1, "d": unscaled(1)}, {})], no_scale, True)
    assert decoded.errors == {0: "column 'after.d': its Connect schema names a org.apache.kafka.connect.data.Decimal "
                                 "without a scale parameter, so the value's scale is unknown"}


def test_debezium_decimals_inside_arrays_and_maps_read_as_at_the_top():
    # A schema with a MAP reads each value through Python's json first (rewrite.py): a
    # VariableScaleDecimal object stays the object it is there.
    decoded = debezium_decode("id BIGINT, m MAP<STRING, DECIMAL(5,1)>, a ARRAY<DECIMAL(5,1)>", [
        ({"id": 1, "m": {"x": unscaled(15), "y": None}, "a": [unscaled(-3), None]}, {}),
        ({"id": 2, "m": {"x": {"scale": 2, "value": unscaled(250)}}, "a": [{"scale": 0, "value": unscaled(7)}]}, {}),
        ({"id": 3, "m": {"x": unscaled(10**5)}}, {})])
    assert [row["after"] and (row["after"]["m"], row["after"]["a"]) for row in decoded.table.to_pylist()] == [
        ([("x", Decimal("1.5")), ("y", None)], [Decimal("-0.3"), None]),
        ([("x", Decimal("2.5"))], [Decimal("7.0")]), None]
    assert decoded.errors == {2: "column 'after.m{}': 10000.0 does not fit DECIMAL(5,1)"}
