"""Records as read to rows of the records schema and quarantine rows: every record is one or the
other; nothing a reader could not read back is stored (a value decoder's own cases are in
test_json, test_avro and test_protobuf)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from oncemore.core.columns import HEADERS_TYPE, QUARANTINE_SCHEMA, SchemaError
from oncemore.core.ddl import parse_ddl
from oncemore.decode.recordspec import FormatSpec, RecordSpec
from oncemore.decode.rows import RecordDecoder
from oncemore.kafka.batches import READ_SCHEMA


def records(values: list[bytes | None], stamps_ms: list[int] | None = None, keys=None, headers=None) -> pa.RecordBatch:
    n = len(values)
    stamps_ms = stamps_ms or [1_700_000_000_000] * n
    micros = [s * 1000 if abs(s) <= (2**63 - 1) // 1000 else None for s in stamps_ms]
    return pa.RecordBatch.from_arrays(
        [pa.array(keys or [b"k"] * n, pa.binary()), pa.array(values, pa.binary()), pa.array(["t"] * n),
         pa.array([2] * n, pa.int32()), pa.array(range(100, 100 + n), pa.int64()),
         pa.array(micros, pa.int64()).cast(pa.timestamp("us", tz="UTC")), pa.array([0] * n, pa.int32()),
         pa.array(headers, HEADERS_TYPE) if headers else pa.nulls(n, HEADERS_TYPE), pa.array(stamps_ms, pa.int64())],
        schema=READ_SCHEMA,
    )


def json_decoder(ddl: str, key: FormatSpec | None = None, headers: bool = False) -> RecordDecoder:
    return RecordDecoder(RecordSpec(FormatSpec("json", ddl=ddl), key, headers))


def test_json_good_rows_keep_their_kafka_coordinates():
    decoded = json_decoder("id BIGINT, name STRING, at TIMESTAMP").decode(
        records([b'{"id": 1, "name": "a", "extra": true}', b'{"id": 2, "at": "2026-01-05T11:00:00Z"}']))
    assert decoded.bad.num_rows == 0
    assert decoded.good.column_names == ["id", "name", "at", "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp"]
    assert decoded.good.select(["id", "name", "_kafka_partition", "_kafka_offset"]).to_pylist() == [
        {"id": 1, "name": "a", "_kafka_partition": 2, "_kafka_offset": 100},
        {"id": 2, "name": None, "_kafka_partition": 2, "_kafka_offset": 101},
    ]


def test_every_kind_of_bad_record_is_quarantined_with_its_bytes_and_rows_stay_aligned():
    values = [b'{"id": 1}', b"not json", None, b'{"id": "x"}', b'{\n  "id": 5\n}', b'{"id": 6} {"id": 7}',
              b"", b"  ", b'{"name": "no id"}', b"[1]", b'{"id": 11}']
    decoded = json_decoder("id BIGINT NOT NULL, name STRING").decode(records(values))
    assert decoded.good.select(["id", "_kafka_offset"]).to_pylist() == [
        {"id": 1, "_kafka_offset": 100}, {"id": 5, "_kafka_offset": 104}, {"id": 11, "_kafka_offset": 110}]
    bad = {row["_kafka_offset"]: row for row in decoded.bad.to_pylist()}
    assert sorted(bad) == [101, 102, 103, 105, 106, 107, 108, 109]
    assert decoded.bad.schema == QUARANTINE_SCHEMA
    assert bad[101]["value"] == b"not json" and bad[101]["key"] == b"k" and bad[101]["_kafka_partition"] == 2
    assert "tombstone" in bad[102]["error"] and "empty" in bad[106]["error"] and "empty" in bad[107]["error"]
    assert "id" in bad[103]["error"] and "id" in bad[108]["error"]
    assert decoded.good.num_rows + decoded.bad.num_rows == len(values)


def test_raw_keeps_bytes_and_quarantines_only_what_no_timestamp_holds():
    decoder = RecordDecoder(RecordSpec(FormatSpec("raw"), FormatSpec("raw"), False))
    decoded = decoder.decode(records([b"\x00\xff", None]))
    assert decoded.good.select(["key", "value"]).to_pylist() == [{"key": b"k", "value": b"\x00\xff"}, {"key": b"k", "value": None}]
    assert decoded.bad.num_rows == 0


NOT_OBJECTS = {b"null": "JSON null", b" null ": "JSON null", b"[1]": "a JSON array", b'"text"': "a JSON string",
               b"42": "a JSON number", b"-1": "a JSON number", b"true": "a JSON boolean", b"\xef\xbb\xbf{}": "not valid JSON",
               b"nullx": "not valid JSON",
               b"\t\n": "empty"}


def test_values_that_are_not_json_objects_are_quarantined_before_arrow_sees_them():
    # Arrow's reader kills the process on a top-level null opening a block (pyarrow 26): decode in a
    # child so a regression fails this test instead of the test run.
    child = subprocess.run([sys.executable, "-c", f"""
import json, sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[2] / "include")!r}]
from test_rows import records, json_decoder, NOT_OBJECTS
values = list(NOT_OBJECTS) + [b'{{"id": 1}}', b"null", b'{{"id": 2}}']
decoded = json_decoder("id BIGINT NOT NULL, name STRING").decode(records(values))
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
    decoded = json_decoder("id BIGINT, name STRING").decode(records(values))
    assert decoded.good.select(["id", "name"]).to_pylist() == [{"id": 1, "name": "fine"}, {"id": 5, "name": "\U0001F600"}]
    decoded.good.validate(full=True)
    bad = {row["_kafka_offset"]: row["error"] for row in decoded.bad.to_pylist()}
    assert bad[101] == "value is not valid UTF-8 (byte 22), so not JSON" and "not valid UTF-8" in bad[102]
    assert "surrogate" in bad[103]


@pytest.mark.parametrize("ddl, problem", [
    ("id INT, ID STRING", "ignore case"),
    ("`e f` INT", "' '"),
    ("`a=b` INT, `c;d` INT", "'='"),
    ("_KAFKA_offset BIGINT", "reserved"),
])
def test_column_names_delta_cannot_hold_are_refused(ddl, problem):
    with pytest.raises(SchemaError, match=problem):
        parse_ddl(ddl)


def test_a_decimal_beyond_its_precision_is_quarantined_not_stored():
    # Arrow's reader checks the digits as written, then rescales: 1234.5 became 1234.50 in DECIMAL(5,2).
    decoded = json_decoder("id BIGINT, d DECIMAL(5,2)").decode(records(
        [b'{"id": 1, "d": 999.99}', b'{"id": 2, "d": 1234.5}', b'{"id": 3, "d": "-1234.5"}', b'{"id": 4, "d": -0.01}']))
    assert decoded.good.select(["id"]).to_pylist() == [{"id": 1}, {"id": 4}]
    bad = {row["_kafka_offset"]: row["error"] for row in decoded.bad.to_pylist()}
    assert sorted(bad) == [101, 102] and all("DECIMAL(5,2)" in e and "d" in e for e in bad.values())


def test_a_kafka_timestamp_no_microsecond_timestamp_holds_is_quarantined_with_its_value():
    nanos = 1_767_610_800_000_000_000
    for decoder in (RecordDecoder(RecordSpec(FormatSpec("raw"), FormatSpec("raw"), False)), json_decoder("id BIGINT")):
        decoded = decoder.decode(records([b'{"id": 1}', b'{"id": 2}'], [1_767_610_800_000, nanos]))
        assert decoded.good.column("_kafka_offset").to_pylist() == [100]
        (bad,) = decoded.bad.to_pylist()
        assert bad["_kafka_offset"] == 101 and bad["value"] == b'{"id": 2}' and bad["_kafka_timestamp"] is None
        assert f"Kafka timestamp {nanos} ms" in bad["error"]


def test_keys_and_headers_become_columns_and_a_key_that_does_not_decode_quarantines_its_record():
    headers = [[{"key": "trace", "value": b"a"}, {"key": "trace", "value": b"b"}], [], [{"key": "x", "value": None}]]
    decoder = json_decoder("id BIGINT", key=FormatSpec("json", ddl="region STRING, shard INT"), headers=True)
    decoded = decoder.decode(records([b'{"id": 1}', b'{"id": 2}', b'{"id": 3}'],
                                     keys=[b'{"region": "eu", "shard": 4}', b'{"shard": "x"}', None], headers=headers))
    assert decoded.good.column_names[:3] == ["key", "id", "headers"]
    assert decoded.good.select(["key", "id", "headers"]).to_pylist() == [
        {"key": {"region": "eu", "shard": 4}, "id": 1, "headers": headers[0]},
        {"key": None, "id": 3, "headers": headers[2]}]
    (bad,) = decoded.bad.to_pylist()
    assert bad["_kafka_offset"] == 101 and bad["error"].startswith("key: ") and "shard" in bad["error"]
    strings = RecordDecoder(RecordSpec(FormatSpec("string"), FormatSpec("string"), False)).decode(
        records([b"plain", b"\xff"], keys=[b"k1", b"k2"]))
    assert strings.good.select(["key", "value"]).to_pylist() == [{"key": "k1", "value": "plain"}]
    assert strings.bad.to_pylist()[0]["error"] == "not valid UTF-8 (byte 0)"
