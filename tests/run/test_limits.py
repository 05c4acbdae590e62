"""Nothing gets stuck on size or odd values: byte budgets bound tasks and commits for large
values, a single value of several MB goes through, odd timestamps neither crash nor write wrong
statistics (checked by filtering with DuckDB), and a plan of 64 partitions x 100 batches reaches
spark-submit through a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from conftest import (
    ROOT,
    allow_any_timestamp,
    assert_exactly_once,
    duckdb_connection,
    oncemore_commits,
    order,
    read_pairs,
)
from oncemore.run import runner

pytestmark = pytest.mark.spark
VALUE = 40 * 1024


def big(i: int) -> bytes:
    return json.dumps({"id": i, "customer": "x" * (VALUE - 40), "amount": 1.0}).encode()


def test_large_values_make_more_smaller_commits_within_the_byte_limits(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, [(i % 3, None, big(i), None) for i in range(180)])
    limits = {"max_bytes_per_task": 400_000, "max_bytes_per_commit": 800_000}
    pipeline = make_pipeline(topic, limits=limits)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 180 and len(report.batches) == 1, "one planned batch, cut into commits by bytes"
    commits = oncemore_commits(pipeline.sink.table_uri)
    assert len(commits) >= 180 * VALUE // 800_000
    # Three tasks a commit here (one per partition); each stops after the record reaching its share.
    assert all(record.bytes_read <= 800_000 + 3 * (VALUE + 10) for _, record in commits)
    assert sum(record.bytes_read for _, record in commits) == sum(len(big(i)) for i in range(180))
    assert all(record.batch_seq == 0 for _, record in commits)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_value_of_several_megabytes_goes_through_even_past_every_budget(broker, topic, make_pipeline, spark):
    huge = json.dumps({"id": 1, "customer": "y" * (6 << 20), "amount": 2.0}).encode()
    produced = broker.produce(topic, [(0, None, order(0), None), (0, None, huge, None), (0, None, order(2), None)])
    pipeline = make_pipeline(topic, limits={"max_bytes_per_task": 1 << 20, "max_bytes_per_commit": 1 << 20})

    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    reader = duckdb_connection()
    length = reader.execute(f"SELECT length(customer) FROM delta_scan('{pipeline.sink.table_uri}') WHERE id = 1").fetchall()
    assert length == [(6 << 20,)]


def test_odd_timestamps_neither_crash_nor_mislead_a_reader_filtering_on_them(broker, topic, make_pipeline, spark):
    now_ms = 1_767_610_800_000
    stamps = {"milliseconds": now_ms, "microseconds sent as milliseconds": now_ms * 1000,
              "nanoseconds sent as milliseconds": now_ms * 1_000_000}
    values = [b'{"id": 1, "at": "0999-12-31T23:59:59Z", "d": "0999-12-31"}',
              b'{"id": 2, "at": "9999-12-31T23:59:59.999999Z", "d": "9999-12-31"}',
              b'{"id": 3, "at": "2026-01-05T11:00:00.000500Z", "d": "2026-01-05"}']
    records = [(0, None, value, stamp) for value in values for stamp in stamps.values()]
    allow_any_timestamp(broker, topic)
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT, at TIMESTAMP, d DATE"})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.written, report.quarantined) == (6, 3), "nanosecond Kafka timestamps cannot be stored"
    main, quarantine = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert_exactly_once(main + quarantine, produced)
    reader = duckdb_connection()
    table = f"delta_scan('{pipeline.sink.table_uri}')"
    reader.execute(f"CREATE TABLE copied AS SELECT * FROM {table}")  # read once in full: no file skipping
    for predicate in ["\"at\" < TIMESTAMPTZ '1000-01-01 00:00:00+00'", "d < DATE '1000-01-01'",
                      "\"at\" > TIMESTAMPTZ '9999-12-31 23:59:59.9995+00'", "d >= DATE '9999-12-31'",
                      "\"at\" >= TIMESTAMPTZ '2026-01-05 11:00:00.0005+00'",
                      "_kafka_timestamp > TIMESTAMPTZ '9999-01-01 00:00:00+00'",
                      "_kafka_timestamp < TIMESTAMPTZ '2027-01-01 00:00:00+00'"]:
        expected = reader.execute(f"SELECT _kafka_offset FROM copied WHERE {predicate} ORDER BY 1").fetchall()
        found = reader.execute(f"SELECT _kafka_offset FROM {table} WHERE {predicate} ORDER BY 1").fetchall()
        assert found == expected and found, predicate
    stored = reader.execute("SELECT epoch_us(_kafka_timestamp) FROM copied WHERE id = 1 ORDER BY 1").fetchall()
    assert stored == [(now_ms * 1000,), (now_ms * 1000 * 1000,)]
    errors = [r[0] for r in duckdb_connection().execute(
        f"SELECT error FROM delta_scan('{pipeline.sink.quarantine_uri}')").fetchall()]
    assert errors == [f"Kafka timestamp {now_ms * 1_000_000} ms is beyond what a microsecond timestamp can hold "
                      "(the producer stamped another unit?)"] * 3


def test_a_plan_of_64_partitions_and_100_batches_reaches_spark_submit_through_a_file(broker, make_pipeline, tmp_path):
    topic = "wide"
    broker.create_topic(topic, 64)
    produced = broker.produce(topic, [(p, None, order(i), None) for i in range(100) for p in range(64)])
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 64})
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}

    planned = subprocess.run([sys.executable, "-m", "oncemore.cli", "plan", "--config", pipeline.origin, "--json"],
                             env=env, capture_output=True, text=True, check=True)
    plan = json.loads(planned.stdout)
    assert len(plan["batches"]) == 100 and all(len(b["ranges"]) == 64 for b in plan["batches"])
    assert len(planned.stdout) > 131_072, "more than Linux takes as one command-line argument"
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(planned.stdout)

    from oncemore.run.session import package_zip

    submitted = subprocess.run(
        ["spark-submit", "--master", "local[2]", "--py-files", package_zip(), str(ROOT / "spark_jobs" / "ingest.py"),
         "--config", pipeline.origin, "--plan-file", str(plan_file), "--run-id", "wide-run"],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert "committed 100 batch(es), 6400 records written" in submitted.stdout
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_task_writes_one_file_per_table_for_all_its_ranges(broker, make_pipeline, spark):
    # One file per range made a topic of 1,000 partitions commit 1,000 files and a megabyte of log.
    topic = "twelve"
    broker.create_topic(topic, 12)
    produced = broker.produce(topic, [(p, None, order(i) if i % 6 else b"not json", None)
                                      for i in range(6) for p in range(12)])
    pipeline = make_pipeline(topic)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.written, report.quarantined) == (60, 12)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri) + read_pairs(pipeline.sink.quarantine_uri), produced)
    for uri in (pipeline.sink.table_uri, pipeline.sink.quarantine_uri):
        files = pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist()
        assert len(files) <= 2, f"{len(files)} files from 2 tasks"  # local[2]: two tasks of six ranges
        assert sum(f["num_records"] for f in files) == (60 if uri == pipeline.sink.table_uri else 12)
        assert all(f["min._kafka_partition"] < f["max._kafka_partition"] for f in files), "a file holds many ranges"


def test_a_sub_range_after_one_cut_short_is_dropped_with_its_files_while_its_task_mates_commit(
        broker, make_pipeline, spark):
    # Partition 0 is split into [0, 10) and [10, 15); its first sub-range stops at the task's byte
    # budget after 3 records, so the second is dropped (its own files deleted) while partition 3's
    # range, read by the same task into the task's shared file, commits.
    topic = "split"
    broker.create_topic(topic, 4)
    records = [(0, None, big(i), None) for i in range(15)]
    records += [(p, None, order(i), None) for p, count in ((1, 10), (2, 10), (3, 5)) for i in range(count)]
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic, limits={"max_records_per_partition": 10, "max_bytes_per_task": 100_000})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 40
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    first = oncemore_commits(pipeline.sink.table_uri)[0][1]
    assert first.ranges[topic] == {"0": [0, 3], "1": [0, 10], "2": [0, 10], "3": [0, 5]}
    table = DeltaTable(pipeline.sink.table_uri)
    on_disk = {p.name for p in Path(pipeline.sink.table_uri).glob("*.parquet")}
    assert on_disk == {Path(uri).name for uri in table.file_uris()}, "the dropped sub-range's files are deleted"
