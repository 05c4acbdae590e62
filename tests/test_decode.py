from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

from pathlib import Path

import pyarrow as pa
import pytest

from oncemore.decode import Decoder
from oncemore.schema import QUARANTINE_SCHEMA, RECORD_SCHEMA, SchemaError, parse_schema


EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def records(values: list[bytes | None], stamps_ms: list[int] | None = None) -> pa.RecordBatch:
    n = len(values)
    stamps_ms = stamps_ms or [1_700_000_000_000] * n
    micros = [s * 1000 if abs(s) <= (2**63 - 1) // 1000 else None for s in stamps_ms]
    return pa.RecordBatch.from_arrays(
        [pa.array([b"k"] * n, pa.binary()), pa.array(values, pa.binary()), pa.array(["t"] * n),
         pa.array([2] * n, pa.int32()), pa.array(range(100, 100 + n), pa.int64()),
         pa.array(micros, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
         pa.array([0] * n, pa.int32()), pa.array(stamps_ms, pa.int64())],
        schema=RECORD_SCHEMA,
    )


def test_json_good_rows_keep_their_kafka_coordinates():
    decoded = Decoder("json", "id BIGINT, name STRING, at TIMESTAMP").decode(
        records([b'{"id": 1, "name": "a", "extra": true}', b'{"id": 2, "at": "2026-01-05T11:00:00Z"}']))
    assert decoded.bad.num_rows == 0
    assert decoded.good.column_names == ["id", "name", "at", "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp"]
    assert decoded.good.select(["id", "name", "_kafka_partition", "_kafka_offset"]).to_pylist() == [
        {"id": 1, "name": "a", "_kafka_partition": 2, "_kafka_offset": 100},
        {"id": 2, "name": None, "_kafka_partition": 2, "_kafka_offset": 101},
    ]


def test_every_kind_of_bad_record_is_quarantined_and_rows_stay_aligned():
    values = [b'{"id": 1}', b"not json", None, b'{"id": "x"}', b'{\n  "id": 5\n}', b'{"id": 6} {"id": 7}',
              b"", b"  ", b'{"name": "no id"}', b"[1]", b'{"id": 11}']
    decoded = Decoder("json", "id BIGINT NOT NULL, name STRING").decode(records(values))
    assert decoded.good.select(["id", "_kafka_offset"]).to_pylist() == [
        {"id": 1, "_kafka_offset": 100}, {"id": 5, "_kafka_offset": 104}, {"id": 11, "_kafka_offset": 110}]
    bad = {row["_kafka_offset"]: row for row in decoded.bad.to_pylist()}
    assert sorted(bad) == [101, 102, 103, 105, 106, 107, 108, 109]
    assert decoded.bad.schema == QUARANTINE_SCHEMA
    assert bad[101]["value"] == b"not json" and bad[101]["key"] == b"k" and bad[101]["_kafka_partition"] == 2
    assert "tombstone" in bad[102]["error"]
    assert "2 JSON objects" in bad[105]["error"]
    assert "empty" in bad[106]["error"] and "empty" in bad[107]["error"]
    assert "NOT NULL" in bad[108]["error"]
    assert decoded.good.num_rows + decoded.bad.num_rows == len(values)


def test_all_bad_batch_gives_empty_good_table_with_the_schema():
    decoded = Decoder("json", "id BIGINT").decode(records([b"x", b"y"]))
    assert decoded.good.num_rows == 0 and decoded.good.column_names[0] == "id"
    assert decoded.bad.num_rows == 2


def test_raw_keeps_bytes_and_never_quarantines():
    decoded = Decoder("raw").decode(records([b"\x00\xff", None]))
    assert decoded.good.select(["key", "value"]).to_pylist() == [{"key": b"k", "value": b"\x00\xff"}, {"key": b"k", "value": None}]
    assert decoded.bad.num_rows == 0


def test_schema_ddl_types():
    schema = parse_schema("a TINYINT, b INT NOT NULL, c DECIMAL(10, 2), d VARCHAR(20), `e-f` DATE, g TIMESTAMP_NTZ")
    assert [str(f.type) for f in schema] == ["int8", "int32", "decimal128(10, 2)", "string", "date32[day]", "timestamp[us]"]
    assert not schema.field("b").nullable and schema.names[4] == "e-f"
    with pytest.raises(SchemaError, match="duplicate"):
        parse_schema("a INT, a STRING")


@pytest.mark.parametrize("ddl, problem", [
    ("id INT, ID STRING", "duplicate column 'ID' (Delta column names ignore case)"),
    ("`e f` INT", "cannot hold a column name with ' '"),
    ("`a=b` INT, `c;d` INT", "with '='"),
    ("_KAFKA_offset BIGINT", "reserved"),
])
def test_column_names_delta_cannot_hold_are_refused(ddl, problem):
    with pytest.raises(SchemaError, match=re.escape(problem)):
        parse_schema(ddl)


def test_a_decimal_beyond_its_precision_is_quarantined_not_stored():
    # Arrow's reader checks the digits as written, then rescales: 1234.5 became 1234.50 in DECIMAL(5,2).
    decoded = Decoder("json", "id BIGINT, d DECIMAL(5,2)").decode(records(
        [b'{"id": 1, "d": 999.99}', b'{"id": 2, "d": 1234.5}', b'{"id": 3, "d": "-1234.5"}', b'{"id": 4, "d": -0.01}']))
    assert decoded.good.select(["id"]).to_pylist() == [{"id": 1}, {"id": 4}]
    bad = {row["_kafka_offset"]: row["error"] for row in decoded.bad.to_pylist()}
    assert bad == {101: "column 'd': 1234.50 does not fit DECIMAL(5,2)", 102: "column 'd': -1234.50 does not fit DECIMAL(5,2)"}


def test_dates_and_timestamps_are_read_from_iso_text_and_bad_ones_quarantined_alone():
    decoder = Decoder("json", "id BIGINT, d DATE, at TIMESTAMP, local TIMESTAMP_NTZ")
    decoded = decoder.decode(records([
        b'{"id": 1, "d": "2026-01-05", "at": "2026-01-05T11:00:00Z", "local": "2026-01-05T11:00:00"}',
        b'{"id": 2, "d": "0999-12-31", "at": "0999-12-31T23:59:59.5+01:00"}',
        b'{"id": 3, "at": "2026-01-05 11:00:00"}',  # no zone: UTC
        b'{"id": 4, "d": "2026-02-30"}',
        b'{"id": 5, "at": 1767610800000000}',
        b'{"id": 6, "at": "+55000-01-01T00:00:00Z"}',
    ]))
    good = {row["id"]: row for row in decoded.good.to_pylist()}
    assert sorted(good) == [1, 2, 3]
    micros = decoded.good.column("at").cast(pa.int64()).to_pylist()
    before_1000 = (datetime(999, 12, 31, 22, 59, 59, 500_000, tzinfo=timezone.utc) - EPOCH) // timedelta(microseconds=1)
    assert micros == [1_767_610_800_000_000, before_1000, 1_767_610_800_000_000]
    assert str(good[2]["d"]) == "0999-12-31"
    errors = {row["_kafka_offset"] - 100 + 1: row["error"] for row in decoded.bad.to_pylist()}
    assert "'2026-02-30' is not a valid DATE" in errors[4]
    assert "a number where TIMESTAMP needs an ISO-8601 string" in errors[5]
    assert "is not a valid TIMESTAMP" in errors[6]


def test_a_kafka_timestamp_no_microsecond_timestamp_holds_is_quarantined_with_its_value():
    nanos = 1_767_610_800_000_000_000
    for format_args in (("raw",), ("json", "id BIGINT")):
        decoded = Decoder(*format_args).decode(records([b'{"id": 1}', b'{"id": 2}'], [1_767_610_800_000, nanos]))
        assert decoded.good.column("_kafka_offset").to_pylist() == [100]
        (bad,) = decoded.bad.to_pylist()
        assert bad["_kafka_offset"] == 101 and bad["value"] == b'{"id": 2}' and bad["_kafka_timestamp"] is None
        assert f"Kafka timestamp {nanos} ms" in bad["error"]


NOT_OBJECTS = {b"null": "JSON null", b" null ": "JSON null", b"[1]": "a JSON array", b'"text"': "a JSON string",
               b"42": "a JSON number", b"-1": "a JSON number", b"true": "a JSON boolean", b"\xef\xbb\xbf{}": "not JSON",
               b"\t\n": "empty"}


def test_values_that_are_not_json_objects_are_quarantined_before_arrow_sees_them():
    # Arrow's reader kills the process on a top-level null opening a block (pyarrow 26): decode in a
    # child so a regression fails this test instead of the test run.
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", f"""
import json, sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1] / "include")!r}]
from test_decode import records, NOT_OBJECTS
from oncemore.decode import Decoder
values = list(NOT_OBJECTS) + [b'{{"id": 1}}', b"null", b'{{"id": 2}}']
decoded = Decoder("json", "id BIGINT NOT NULL, name STRING").decode(records(values))
print(json.dumps([decoded.good.column("_kafka_offset").to_pylist(),
                  {{r["_kafka_offset"]: r["error"] for r in decoded.bad.to_pylist()}}]))
"""], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-2000:]
    good, bad = json.loads(child.stdout)
    count = len(NOT_OBJECTS)
    assert good == [100 + count, 102 + count]
    for i, kind in enumerate(NOT_OBJECTS.values()):
        assert bad[str(100 + i)] == f"value is {kind}, not a JSON object"
    assert bad[str(101 + count)] == "value is JSON null, not a JSON object"


def test_invalid_utf8_is_quarantined_and_never_reaches_a_string_column():
    values = [b'{"id": 1, "name": "fine"}', b'{"id": 2, "name": "caf\xe9"}', b'{"id": 3, "name": "\xff\xfe"}',
              b'{"id": 4, "name": "\\ud800"}', b'{"id": 5, "name": "\xf0\x9f\x98\x80"}']
    decoded = Decoder("json", "id BIGINT, name STRING").decode(records(values))
    assert decoded.good.select(["id", "name"]).to_pylist() == [{"id": 1, "name": "fine"}, {"id": 5, "name": "\U0001F600"}]
    decoded.good.validate(full=True)
    bad = {row["_kafka_offset"]: row["error"] for row in decoded.bad.to_pylist()}
    assert bad[101] == "value is not valid UTF-8 (byte 22), so not JSON" and "not valid UTF-8" in bad[102]
    assert "surrogate" in bad[103]
