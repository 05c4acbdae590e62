"""Records shaped in Spark on their way in: a SQL or Python transform over the view `records`,
expectations, partition columns a transform derives (pruned by readers), nested types, and a table
following its schema. Every offset of a committed range is in the table, the quarantine table or
the commit's filtered count, exactly once: counted by (topic, partition, offset)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from decimal import Decimal

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from conftest import (
    ROOT,
    assert_exactly_once,
    held_positions,
    order,
    orders,
    produced_coordinates,
    query,
    read_coordinates,
)
from oncemore.commit.evolution import SchemaChangeRefused
from oncemore.core.errors import TaskFailed
from oncemore.run import runner
from oncemore.shape.transform import TransformRefused

pytestmark = pytest.mark.spark
HOUR = 3_600_000
BASE = int(datetime.datetime(2026, 11, 20, tzinfo=datetime.timezone.utc).timestamp() * 1000)


def commits(table_uri: str) -> list[dict]:
    return [json.loads(c["oncemore"]) for c in reversed(DeltaTable(table_uri).history()) if "oncemore" in c]


def accounted(pipeline) -> list[tuple[str, int, int]]:
    return read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri)


def test_a_sql_transform_filters_derives_a_date_partition_and_counts_what_it_drops(broker, topic, make_pipeline, spark):
    # Three days of records, some malformed, some failing an expectation, some filtered out.
    records = [(i % 3, None, order(i), BASE + (i % 3) * 24 * HOUR + i) for i in range(300)]
    records[5] = (records[5][0], None, b"{broken", records[5][3])
    produced = produced_coordinates(topic, broker.produce(topic, records))
    pipeline = make_pipeline(topic, transform="SELECT *, to_date(_kafka_timestamp) AS day, amount * 2 AS doubled "
                                              "FROM records WHERE amount >= 10",
                             expectations=[{"name": "not_huge", "check": "amount < 300"}],
                             sink={"partition_by": ["day"]})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    filtered = sum(1 for i in range(300) if i != 5 and i * 1.25 < 10)
    huge = sum(1 for i in range(300) if i * 1.25 >= 300)
    (record,) = commits(pipeline.sink.table_uri)
    assert record["records"] == {"written": 300 - 1 - filtered - huge, "quarantined": 1 + huge, "filtered": filtered}
    # What the run hands back of its commits is what the tables hold.
    for role, uri in (("main", pipeline.sink.table_uri), ("quarantine", pipeline.sink.quarantine_uri)):
        sizes = DeltaTable(uri).get_add_actions(flatten=True).column("size_bytes").to_pylist()
        assert report.added[role] == {"rows": query(uri, "SELECT count(*) FROM {table}")[0][0], "bytes": sum(sizes),
                                      "files": len(sizes)}, role
    assert record["expectations"] == {"not_huge": huge}
    landed = accounted(pipeline)
    assert len(landed) == len(set(landed)) == 300 - filtered and set(landed) <= set(produced)
    assert query(pipeline.sink.table_uri, "SELECT min(doubled), count(DISTINCT day) FROM {table}") == [(20.0, 3)]
    errors = query(pipeline.sink.quarantine_uri, "SELECT error, value FROM {table} WHERE error LIKE 'expectation%'")
    assert len(errors) == huge and errors[0][0] == "expectation not_huge failed"
    assert json.loads(errors[0][1])["amount"] >= 300 and "day" in json.loads(errors[0][1])
    # Readers prune by the derived column: one day's files, and DuckDB reads only them.
    table = DeltaTable(pipeline.sink.table_uri)
    day = datetime.date(2026, 11, 21)
    one_day = table.file_uris(file_pruning_predicate=[("day", "=", day.isoformat())])
    assert 0 < len(one_day) < len(table.file_uris())
    assert query(pipeline.sink.table_uri, f"SELECT count(*) FROM {{table}} WHERE day = DATE '{day}'") == [
        (sum(1 for i in range(300) if i % 3 == 1 and i != 5 and 10 <= i * 1.25 < 300),)]
    plan = "\n".join(r[1] for r in query(pipeline.sink.table_uri,
                                         f"EXPLAIN ANALYZE SELECT count(*) FROM {{table}} WHERE day = DATE '{day}'"))
    assert f"Total Files Read: {len(one_day)}" in plan
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "no-op"


def test_a_python_transform_and_an_expectation_that_fails_the_run(broker, topic, make_pipeline, spark):
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 90)))
    pipeline = make_pipeline(topic, transform={"python": "shaping_transforms:upper_customers"})
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(accounted(pipeline), produced)
    assert query(pipeline.sink.table_uri, "SELECT DISTINCT left(customer, 9) FROM {table}") == [("CUSTOMER-",)]

    strict = make_pipeline(topic, name="strict", expectations=[{"name": "below_50", "check": "id < 50", "on_fail": "fail"}])
    with pytest.raises(TaskFailed, match=r"ExpectationFailed: pipeline strict: expectation below_50 failed for "
                                         rf"{topic}/\d offset \d+"):
        runner.run(strict, spark_factory=lambda: spark)
    assert read_coordinates(strict.sink.table_uri) == [] and read_coordinates(strict.sink.quarantine_uri) == []


@pytest.mark.parametrize("transform, problem", [
    ("SELECT customer, count(*) AS n FROM records GROUP BY customer", "drops _kafka_topic"),
    ("SELECT count(*) AS n, first(_kafka_topic) AS _kafka_topic, first(_kafka_partition) AS _kafka_partition, "
     "first(_kafka_offset) AS _kafka_offset FROM records", "aggregates"),
    ("SELECT *, explode(array(1, 2)) AS copy FROM records", "explodes"),
    ("SELECT id, _kafka_topic, _kafka_partition, _kafka_offset + 1 AS _kafka_offset FROM records", "computes _kafka_offset"),
    ("SELECT r.* FROM records r JOIN records s ON r.id = s.id", "joins"),
    ("SELECT DISTINCT * FROM records", "removes duplicates"),
    ("SELECT * FROM records LIMIT 5", "limits"),
    ("SELECT r.* FROM records r, LATERAL (VALUES (1), (2)) AS t(c) WHERE r._kafka_offset % 2 = 0", r"joins \(LATERAL\)"),
    ("SELECT r.* FROM records r, range(2)", "joins"),
    ("WITH twice AS (SELECT * FROM records UNION ALL SELECT * FROM records) SELECT * FROM twice", "unions"),
    ({"python": "shaping_transforms:twice_through_an_rdd"}, "reads an RDD's rows"),
    ("SELECT nope FROM records", "UNRESOLVED_COLUMN"),
    ("SELEC * FROM records", "PARSE_SYNTAX_ERROR"),
    ("SELECT *, amount * 2 AS _oncemore_expect_double FROM records", "names starting with _oncemore_expect_ are"),
])
def test_a_transform_that_cannot_keep_the_promise_is_refused_before_anything_is_read(broker, topic, make_pipeline, spark,
                                                                                      transform, problem):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic, transform=transform)
    with pytest.raises(TransformRefused, match=f"pipeline orders: transform: .*{problem}"):
        runner.run(pipeline, spark_factory=lambda: spark)
    assert read_coordinates(pipeline.sink.table_uri) == [] and read_coordinates(pipeline.sink.quarantine_uri) == []


def test_common_table_expressions_and_subqueries_pass_and_each_record_is_counted_once(broker, topic, make_pipeline,
                                                                                      spark):
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 60)))
    pipeline = make_pipeline(topic, transform=(
        "WITH big AS (SELECT * FROM records WHERE amount >= 10) "
        "SELECT *, (SELECT max(id) FROM records) AS top FROM big WHERE id IN (SELECT id FROM records WHERE id % 2 = 0)"))
    runner.run(pipeline, spark_factory=lambda: spark)
    (record,) = commits(pipeline.sink.table_uri)
    kept = [i for i in range(60) if i * 1.25 >= 10 and i % 2 == 0]
    assert record["records"] == {"written": len(kept), "quarantined": 0, "filtered": 60 - len(kept)}
    assert sorted(r[0] for r in query(pipeline.sink.table_uri, "SELECT id FROM {table}")) == kept
    assert query(pipeline.sink.table_uri, "SELECT DISTINCT top FROM {table}") == [(59,)]
    assert set(read_coordinates(pipeline.sink.table_uri)) <= set(produced)


@pytest.mark.parametrize("transform", ["SELECT * FROM records WHERE 1 = 0", {"python": "shaping_transforms:nothing"}])
def test_a_transform_spark_folds_to_nothing_still_reads_quarantines_and_counts_every_record(broker, topic, make_pipeline,
                                                                                            spark, transform):
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 30) + [(2, None, b"{broken", None)]))
    pipeline = make_pipeline(topic, transform=transform)
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"
    (record,) = commits(pipeline.sink.table_uri)
    assert record["records"] == {"written": 0, "quarantined": 1, "filtered": 30}
    assert read_coordinates(pipeline.sink.quarantine_uri) == [(topic, 2, 10)] and (topic, 2, 10) in produced
    assert held_positions(pipeline.sink.table_uri, "orders", topic) == {0: 10, 1: 10, 2: 11}
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "no-op"


def test_a_row_failing_an_expectation_is_quarantined_even_holding_a_time_python_cannot(broker, topic, make_pipeline,
                                                                                       spark):
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 12)))
    # Spark's timestamps reach year 294247; Python's stop at 9999.
    pipeline = make_pipeline(topic, transform="SELECT *, timestamp_micros(id * 100000000000000000) AS far FROM records",
                             expectations=[{"name": "near", "check": "id < 4"}])
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(accounted(pipeline), produced)
    errors = query(pipeline.sink.quarantine_uri, "SELECT error, value FROM {table} ORDER BY _kafka_offset, _kafka_partition")
    assert len(errors) == 8 and {e for e, _ in errors} == {"expectation near failed"}
    held = [json.loads(v) for _, v in errors]
    assert sorted(row["far"] for row in held if row["id"] >= 4) == [i * 100000000000000000 for i in range(4, 12)]


def test_a_partition_date_past_year_9999_is_quarantined_with_the_reason(broker, topic, make_pipeline, spark):
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 9)))
    pipeline = make_pipeline(topic, transform="SELECT *, date_add(DATE '9999-12-30', CAST(id AS INT)) AS day FROM records",
                             sink={"partition_by": ["day"]})
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(accounted(pipeline), produced)
    assert query(pipeline.sink.table_uri, "SELECT id, day FROM {table} ORDER BY id") == [
        (0, datetime.date(9999, 12, 30)), (1, datetime.date(9999, 12, 31))]
    errors = query(pipeline.sink.quarantine_uri, "SELECT error FROM {table} WHERE error LIKE '%years 1-9999%'")
    assert len(errors) == 7 and "column 'day' partitions the table and holds a date outside years 1-9999" in errors[0][0]


@pytest.mark.parametrize("stamp", ["dropped", "retyped"])
def test_a_transform_without_a_kafka_timestamp_still_quarantines_and_never_sticks(broker, topic, make_pipeline, spark,
                                                                                   stamp):
    # Each rerun used to fail at the first row for the quarantine (KeyError, ArrowInvalid): stuck for good.
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 30)))
    kept = {"dropped": "", "retyped": ", CAST(_kafka_timestamp AS STRING) AS _kafka_timestamp"}[stamp]
    pipeline = make_pipeline(topic, transform=f"SELECT _kafka_topic, _kafka_partition, _kafka_offset, id, amount{kept}, "
                                              "CASE WHEN id % 10 = 3 THEN '' ELSE 'shop' END AS shop FROM records",
                             expectations=[{"name": "small", "check": "amount < 30"}], sink={"partition_by": ["shop"]})

    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(accounted(pipeline), produced)
    errors = query(pipeline.sink.quarantine_uri, "SELECT error, _kafka_timestamp, value FROM {table}")
    empty = [e for e in errors if "Delta reads an empty partition value as NULL" in e[0]]
    assert len(empty) == 3 and len(errors) == 3 + sum(1 for i in range(30) if i * 1.25 >= 30 and i % 10 != 3)
    assert {e[1] for e in errors} == {None} and all(json.loads(e[2])["id"] is not None for e in errors)
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "no-op"


def test_a_failing_cast_under_ansi_fails_the_run_naming_the_ranges_and_the_error(broker, topic, make_pipeline, spark):
    broker.produce(topic, orders(0, 30) + [(1, None, json.dumps({"id": 99, "customer": "x", "amount": 1.0}).encode(), None)])
    pipeline = make_pipeline(topic, transform="SELECT *, CAST(customer AS INT) AS n FROM records WHERE id = 99")
    with pytest.raises(TaskFailed, match=rf"pipeline orders: the Spark task reading .*{topic}/1 \[0, 11\).*failed: .*CAST_INVALID_INPUT"):
        runner.run(pipeline, spark_factory=lambda: spark)
    assert read_coordinates(pipeline.sink.table_uri) == []


def test_retried_task_attempts_on_the_transform_path_commit_each_record_once(broker, topic, make_pipeline):
    # local[2] allows no retry: local[2, 3] retries a failed task up to 3 times, as a cluster does.
    records = orders(0, 3_000) + [(1, None, b"{broken", None)]
    produced = produced_coordinates(topic, broker.produce(topic, records))
    pipeline = make_pipeline(topic, transform={"python": "shaping_transforms:fails_each_tasks_first_attempt"},
                             expectations=[{"name": "small", "check": "amount < 3000"}],
                             limits={"max_records_per_commit": 1_200, "max_records_per_partition": 150},
                             quarantine={"max_fraction": 1})  # the last batch fails the expectation whole
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "include"), str(ROOT / "tests" / "shape")]),
           "ONCEMORE_SPARK_MASTER": "local[2,3]"}

    done = subprocess.run([sys.executable, "-m", "oncemore.cli", "run", "--config", pipeline.origin, "--verbose"],
                          env=env, capture_output=True, text=True, timeout=600)

    assert done.returncode == 0, done.stderr[-3000:]
    assert "this task's first attempt fails" in done.stderr  # every task failed once
    assert_exactly_once(accounted(pipeline), produced)
    assert len(read_coordinates(pipeline.sink.quarantine_uri)) == 1 + sum(1 for i in range(3_000) if i * 1.25 >= 3000)


NESTED = ("id BIGINT NOT NULL, customer STRUCT<name: STRING, address: STRUCT<zip: STRING, lines: ARRAY<STRING>>>, "
          "amount DECIMAL(10,2), tags MAP<STRING, INT>, seen TIMESTAMP, day DATE, flags ARRAY<BOOLEAN>, raw BINARY, "
          "small TINYINT")


def nested(i: int) -> bytes:
    return json.dumps({"id": i, "customer": {"name": f"n{i}", "address": {"zip": f"{i:05d}", "lines": ["a", f"l{i}"]}},
                       "amount": f"{i}.50", "tags": {"k": i}, "seen": "2026-11-20T10:00:00Z", "day": "2026-11-20",
                       "flags": [True, False], "raw": "aGk=", "small": i % 100}).encode()


def test_nested_values_round_trip_and_a_value_that_does_not_fit_is_quarantined_with_its_path(broker, topic, make_pipeline, spark):
    bad = {3: b'{"id": 3, "customer": {"address": {"zip": 7}}}', 4: b'{"id": 4, "amount": 123456789.5}',
           5: b'{"id": 5, "small": 300}', 6: b'{"id": 6, "day": "2026-02-30"}'}
    records = [(i % 3, None, bad.get(i, nested(i)), None) for i in range(60)]
    produced = produced_coordinates(topic, broker.produce(topic, records))
    pipeline = make_pipeline(topic, format={"type": "json", "schema": NESTED})

    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(accounted(pipeline), produced)
    assert query(pipeline.sink.table_uri, "SELECT customer.address.zip, customer.address.lines[2], amount, tags['k'], seen, "
                                          "day, flags, raw, small FROM {table} WHERE id = 7") == [
        ("00007", "l7", Decimal("7.50"), 7, datetime.datetime(2026, 11, 20, 10, tzinfo=datetime.timezone.utc),
         datetime.date(2026, 11, 20), [True, False], b"hi", 7)]
    assert DeltaTable(pipeline.sink.table_uri).to_pyarrow_table(filters=[("id", "=", 7)]).column("amount").to_pylist() == [
        Decimal("7.50")]
    errors = dict(query(pipeline.sink.quarantine_uri, "SELECT _kafka_partition * 100 + _kafka_offset, error FROM {table}"))
    by_id = {i: errors[(i % 3) * 100 + i // 3] for i in bad}
    assert "customer.address.zip" in by_id[3] and "amount" in by_id[4] and "small" in by_id[5] and "day" in by_id[6]


def test_the_table_follows_new_nullable_fields_and_refuses_changes_it_cannot_take(broker, topic, make_pipeline, spark):
    first = produced_coordinates(topic, broker.produce(topic, [(i % 3, None, nested(i), None) for i in range(30)]))
    pipeline = make_pipeline(topic, format={"type": "json", "schema": NESTED})
    runner.run(pipeline, spark_factory=lambda: spark)
    grown = NESTED.replace("lines: ARRAY<STRING>>", "lines: ARRAY<STRING>, country: STRING>") + ", channel STRING"
    more = produced_coordinates(topic, broker.produce(topic, [
        (i % 3, None, json.dumps({"id": i, "channel": "web", "customer": {"address": {"country": "NO"}}}).encode(), None)
        for i in range(30, 45)]))
    pipeline = make_pipeline(topic, format={"type": "json", "schema": grown})
    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(accounted(pipeline), first + more)
    assert query(pipeline.sink.table_uri, "SELECT count(*), count(channel), count(customer.address.country) FROM {table}") == [
        (45, 15, 15)]
    version = DeltaTable(pipeline.sink.table_uri).version()
    broker.produce(topic, [(0, None, nested(99), None)])
    changed = make_pipeline(topic, format={"type": "json", "schema": grown.replace("amount DECIMAL(10,2)", "amount STRING")})
    with pytest.raises(SchemaChangeRefused, match="column amount: the table has decimal\\(10,2\\), the records have string"):
        runner.run(changed, spark_factory=lambda: spark)
    strict = make_pipeline(topic, format={"type": "json", "schema": grown + ", extra INT"}, sink={"schema_evolution": "fail"})
    with pytest.raises(SchemaChangeRefused, match="adds extra to the table and sink.schema_evolution is fail"):
        runner.run(strict, spark_factory=lambda: spark)
    dropped = make_pipeline(topic, format={"type": "json", "schema": grown.replace("id BIGINT NOT NULL, ", "")})
    with pytest.raises(SchemaChangeRefused, match="column id is NOT NULL in the table and the records no longer have it"):
        runner.run(dropped, spark_factory=lambda: spark)
    assert DeltaTable(pipeline.sink.table_uri).version() == version, "nothing was written"


def test_one_topic_into_two_pipelines_with_different_transforms(broker, topic, make_pipeline, spark):
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 120)))
    cheap = make_pipeline(topic, name="cheap", transform="SELECT * FROM records WHERE amount < 50")
    dear = make_pipeline(topic, name="dear", transform="SELECT id, amount, _kafka_topic, _kafka_partition, _kafka_offset "
                                                       "FROM records WHERE amount >= 50")
    runner.run(cheap, spark_factory=lambda: spark)
    runner.run(dear, spark_factory=lambda: spark)
    assert_exactly_once(read_coordinates(cheap.sink.table_uri) + read_coordinates(dear.sink.table_uri), produced)
    assert [c["records"]["filtered"] for c in commits(cheap.sink.table_uri)] == [sum(1 for i in range(120) if i * 1.25 >= 50)]
    assert pa.schema(DeltaTable(dear.sink.table_uri).schema().to_arrow()).names == [
        "id", "amount", "_kafka_topic", "_kafka_partition", "_kafka_offset"]
