"""``oncemore check --sample N`` on a real broker: the latest records of each partition read through
the formats, the transform and the expectations, what would be quarantined named with its reason,
and nothing written (both tables' directories exactly as they were)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import oncemore, orders
from oncemore.ops.sample import sample_checks
from oncemore.run import runner


def tree(*roots: str) -> dict[str, tuple[int, int]]:
    """Every file under ``roots``: its size and modification time."""
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for root in roots if Path(root).exists()
            for f in Path(root).rglob("*")}


@pytest.mark.spark
def test_check_sample_names_a_wrong_type_and_its_records_and_writes_nothing(broker, topic, make_pipeline, spark):
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT, customer STRING, amount INT"})
    broker.produce(topic, [(i % 3, None, b'{"id": %d, "customer": "c", "amount": 12}' % i, None) for i in range(30)])
    assert runner.run(pipeline, spark_factory=lambda: spark).written == 30  # whole amounts fit INT
    broker.produce(topic, [(i % 3, None, b'{"id": %d, "customer": "c", "amount": 12.50}' % i, None)
                           for i in range(30, 630)])
    before = tree(pipeline.sink.table_uri, pipeline.sink.quarantine_uri)

    checked = oncemore("check", pipeline.origin, "--sample", "100", check_no_spark=True)

    assert checked.returncode == 1, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert "FAILED orders: sample: the latest 100 offsets of 3 partition(s) read, nothing written: 300 records, 0 " \
           "would be written, 300 of 300 records quarantined (100.0%), 0 filtered: more than the limit of 50% " \
           "(quarantine.max_fraction): a run would fail on a batch like this" in lines
    (reason,) = [line for line in lines if "would quarantine" in line]
    assert reason == (f"FAILED orders: would quarantine: 300 x column 'amount': ... does not fit INT at {topic}/0 "
                      f"[110, 210); {topic}/1 [110, 210); {topic}/2 [110, 210) (first: {topic}/0 offset 110: column "
                      "'amount': 12.50 does not fit INT, value '{\"id\": 330, \"customer\": \"c\", \"amount\": 12.50}')")
    # Only the other checks' lines besides: config, kafka, topic, read, positions, records, tables, airflow.
    assert [line.split(":")[1].strip() for line in lines if line.startswith("ok")] == [
        "config", "kafka", f"topic {topic}", "read", "positions", "records", "table", "quarantine table", "airflow"]
    assert tree(pipeline.sink.table_uri, pipeline.sink.quarantine_uri) == before

    usage = oncemore("check", pipeline.origin, "--sample", "0", check_no_spark=True)
    assert usage.returncode == 2 and "--sample 0: read at least 1 offset of each partition" in usage.stderr


@pytest.mark.spark
def test_a_sample_goes_through_the_transform_and_the_expectations_as_a_run_would(broker, topic, make_pipeline, spark):
    records = orders(0, 90)
    records[40] = (records[40][0], None, b"{broken", None)
    broker.produce(topic, records)
    pipeline = make_pipeline(topic, transform="SELECT * FROM records WHERE id % 2 = 0",
                             expectations=[{"name": "small", "check": "amount < 50"}])

    checks = sample_checks(pipeline, 20, lambda: spark)

    # The latest 20 of each partition: orders 30 to 89; 40 is broken, the odd ones are filtered, and
    # of the even ones amount = 1.25 id < 50 holds for id < 40 (30 to 38).
    assert [c.line() for c in checks] == [
        "ok     orders: sample: the latest 20 offsets of 3 partition(s) read, nothing written: 60 records, 5 would be "
        "written, 25 of 60 records quarantined (41.7%), 30 filtered; within the quarantine limit of 50%",
        f"ok     orders: would quarantine: 24 x expectation small failed at {topic}/0 14, 16, 18, 20, ... (4 more "
        f"runs); {topic}/1 15, 17, 19, 21, ... (4 more runs); {topic}/2 14, 16, 18, 20, ... (4 more runs) (first: "
        f"{topic}/0 offset 14)",
        f"ok     orders: would quarantine: 1 x value does not end with the '}}' closing a JSON object (truncated, or "
        f"text after it) at {topic}/1 13 (first: {topic}/1 offset 13, value '{{broken')",
    ]
    assert not Path(pipeline.sink.table_uri).exists() and not Path(pipeline.sink.quarantine_uri).exists()


def test_a_sample_of_empty_partitions_reads_nothing(broker, topic, make_pipeline):
    pipeline = make_pipeline(topic)
    assert [c.line() for c in sample_checks(pipeline, 10, lambda: None)] == [
        "ok     orders: sample: every partition is empty: nothing to read"]
    assert json.dumps(pipeline.quarantine.model_dump()) == '{"max_fraction": 0.5, "min_quarantined": 10}'
