"""Delta statistics are never wrong: files with extreme values are committed, then an independent
reader (DuckDB, which skips files by these statistics) must find exactly the rows Python finds."""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta, timezone

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from conftest import duckdb_connection
from oncemore.commit.committer import commit
from oncemore.commit.tables import ensure_table
from oncemore.core.columns import decoded_schema
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.ddl import parse_ddl
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.write.files import TableWriter
from oncemore.write.filestats import FileStats

SCHEMA = decoded_schema("json", parse_ddl("at TIMESTAMP, local TIMESTAMP_NTZ, d DATE, x DOUBLE, s STRING"), None, False)
UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MS = 1000
# One file per group, so statistics decide which files a filter reads.
GROUPS = {
    "year 999": [(datetime(999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC), date(500, 1, 1), 1.0, "a")],
    "microseconds at a millisecond edge": [(datetime(2026, 1, 1, 0, 0, 0, 999, tzinfo=UTC), date(2026, 1, 1), 2.0, "b"),
                                           (datetime(2026, 1, 1, 0, 0, 0, 1_001, tzinfo=UTC), date(2026, 1, 2), 3.0, "c")],
    "Kafka microseconds taken as milliseconds": [(1_767_225_600_000_000 * MS, date(9999, 12, 31), float("nan"), "d" * 40)],
    "ordinary": [(datetime(2026, 6, 1, tzinfo=UTC), date(2026, 6, 1), float("inf"), "e")],
}


def micros(value) -> int:
    return value if isinstance(value, int) else (value - EPOCH) // timedelta(microseconds=1)


def rows_table(rows, first_offset: int) -> pa.Table:
    stamps = pa.array([micros(r[0]) for r in rows], pa.int64())
    n = len(rows)
    return pa.table({
        "at": stamps.cast(pa.timestamp("us", tz="UTC")), "local": stamps.cast(pa.timestamp("us")),
        "d": pa.array([r[1] for r in rows], pa.date32()), "x": [r[2] for r in rows], "s": [r[3] for r in rows],
        "_kafka_topic": ["t"] * n, "_kafka_partition": pa.array([0] * n, pa.int32()),
        "_kafka_offset": pa.array(range(first_offset, first_offset + n), pa.int64()),
        "_kafka_timestamp": stamps.cast(pa.timestamp("us", tz="UTC")),
    }, schema=SCHEMA)


def test_bounds_are_zero_padded_rounded_outward_or_left_out():
    stats = FileStats(SCHEMA)
    for offset, rows in enumerate(GROUPS.values()):
        stats.add(rows_table(rows, offset * 10))
    written = json.loads(stats.to_json())
    # The year-55,000 value leaves no maximum; the minimum is year 999, zero-padded.
    assert written["minValues"]["at"] == "0999-12-31T23:59:59.999Z"
    assert "at" not in written["maxValues"] and "_kafka_timestamp" not in written["maxValues"]
    assert (written["minValues"]["d"], written["maxValues"]["d"]) == ("0500-01-01", "9999-12-31")
    assert written["minValues"]["local"] == "0999-12-31T23:59:59.999"
    assert "x" not in written["minValues"] and "x" not in written["maxValues"]  # NaN and infinity seen
    assert written["maxValues"]["s"] == "e"

    long_text = FileStats(SCHEMA)
    long_text.add(rows_table(GROUPS["Kafka microseconds taken as milliseconds"], 0))
    written = json.loads(long_text.to_json())
    assert written["minValues"]["s"] == "d" * 32 and "s" not in written["maxValues"]  # a cut maximum is no maximum

    edge = FileStats(SCHEMA)
    edge.add(rows_table(GROUPS["microseconds at a millisecond edge"], 0))
    written = json.loads(edge.to_json())
    assert (written["minValues"]["at"], written["maxValues"]["at"]) == ("2026-01-01T00:00:00.000Z", "2026-01-01T00:00:00.002Z")


@pytest.mark.parametrize("predicate", [
    "\"at\" < TIMESTAMPTZ '1000-01-01 00:00:00+00'",
    "\"at\" >= TIMESTAMPTZ '0999-12-31 23:59:59.9995+00'",
    "\"at\" > TIMESTAMPTZ '2026-01-01 00:00:00.001+00'",
    "\"at\" <= TIMESTAMPTZ '2026-01-01 00:00:00.000999+00'",
    "\"at\" > TIMESTAMPTZ '9999-01-01 00:00:00+00'",
    "local > TIMESTAMP '2026-01-01 00:00:00.001'",
    "d < DATE '1000-01-01'",
    "d >= DATE '9999-12-31'",
    "x > 2.5",
    "s >= 'dddd'",
])
def test_an_independent_reader_filtering_by_the_statistics_finds_every_row(tmp_path, predicate):
    table_uri = str(tmp_path / "extremes")
    ensure_table(table_uri, SCHEMA, (), "extremes", "statistics test")
    writer, offset = TableWriter("main", table_uri, SCHEMA), 0
    files = []
    for rows in GROUPS.values():
        writer.write(rows_table(rows, offset))
        files += writer.close()
        offset += len(rows)
    record = CommitInfo(pipeline="stats", run_id="r", ranges={"t": {"0": [0, offset]}})
    key = KafkaPartition("t", 0)
    commit(Ledger(table_uri, "stats"), files, {key: None}, {key: offset}, [key], record)

    reader = duckdb_connection()
    reader.execute(f"CREATE TABLE copied AS SELECT * FROM delta_scan('{table_uri}')")  # no file skipping here
    assert [r[0] for r in reader.execute("SELECT _kafka_offset FROM copied ORDER BY 1").fetchall()] == list(range(offset))
    expected = reader.execute(f"SELECT _kafka_offset FROM copied WHERE {predicate} ORDER BY 1").fetchall()
    filtered = reader.execute(f"SELECT _kafka_offset FROM delta_scan('{table_uri}') WHERE {predicate} ORDER BY 1").fetchall()
    assert filtered == expected and expected, predicate


def test_a_file_holding_nan_gets_no_bound_on_that_column():
    stats = FileStats(SCHEMA)
    stats.add(rows_table([(datetime(2026, 1, 1, tzinfo=UTC), date(2026, 1, 1), 1.0, "a"),
                          (datetime(2026, 1, 1, tzinfo=UTC), date(2026, 1, 1), float("nan"), "a")], 0))
    written = json.loads(stats.to_json())
    # min_max skips NaN; a bound of 1.0 would hide the NaN row from "x > 5" (true for NaN in DuckDB).
    assert "x" not in written["minValues"] and "x" not in written["maxValues"]


def test_struct_fields_get_nested_statistics_that_delta_rs_and_duckdb_both_use(tmp_path):
    nested = decoded_schema("json", parse_ddl(
        "o STRUCT<n: BIGINT, inner: STRUCT<s: STRING>>, tags ARRAY<STRING>, m MAP<STRING, BIGINT>"), None, False)
    n = 4
    table = pa.table({
        "o": pa.array([{"n": 1, "inner": {"s": "a"}}, None, {"n": 7, "inner": None}, {"n": None, "inner": {"s": "z"}}],
                      nested.field("o").type),
        "tags": [["x"], None, [], ["y", "z"]], "m": pa.array([[("k", 1)], None, [], [("j", 2)]], nested.field("m").type),
        "_kafka_topic": ["t"] * n, "_kafka_partition": pa.array([0] * n, pa.int32()),
        "_kafka_offset": pa.array(range(n), pa.int64()),
        "_kafka_timestamp": pa.array([0] * n, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
    }, schema=nested)
    stats = FileStats(nested)
    stats.add(table)
    written = json.loads(stats.to_json())
    # A null struct makes its fields null; arrays and maps get no statistics at all.
    assert written["nullCount"]["o"] == {"n": 2, "inner": {"s": 2}}
    assert (written["minValues"]["o"], written["maxValues"]["o"]) == ({"n": 1, "inner": {"s": "a"}},
                                                                       {"n": 7, "inner": {"s": "z"}})
    assert "tags" not in written["nullCount"] and "m" not in written["nullCount"]

    table_uri = str(tmp_path / "nested")
    ensure_table(table_uri, nested, (), "nested", "statistics test")
    writer = TableWriter("main", table_uri, nested)
    writer.write(table)
    record = CommitInfo(pipeline="stats", run_id="r", ranges={"t": {"0": [0, n]}})
    key = KafkaPartition("t", 0)
    commit(Ledger(table_uri, "stats"), writer.close(), {key: None}, {key: n}, [key], record)
    # delta-rs drops a file's statistics (record count included) when they do not fit the schema.
    assert DeltaTable(table_uri).count() == n
    reader = duckdb_connection()
    assert reader.execute(f"SELECT count(*) FROM delta_scan('{table_uri}') WHERE o.n > 5").fetchone()[0] == 1
